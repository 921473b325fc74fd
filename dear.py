"""DeAR: Fine-Grained VLM Adaptation by Decomposing Attention Head Roles (CVPR 2026), in plain PyTorch.

Top to bottom: 1. attribute tokens, 2. the role-based mask, 3. the DeAR module (Figure 2), 4. logits, fusion, loss,
5. the recipe (Config, MMRL/MMRL++ tables, flags), 6. training and evaluation, 7. the run, 8. predict and explain.
Blocks count from 1 in the paper (J = 9: tokens enter block 9 of 12), the flags and roles files; from 0 in the code,
converted once in DeAR.__init__ (self.first = J - 1)."""

import argparse
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: fast on shared CPU cores

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from PIL import Image  # noqa: E402

import clip  # noqa: E402
import data  # noqa: E402
import entropy  # noqa: E402
import toyworld  # noqa: E402
from data import UserError  # noqa: E402

ATTRIBUTES = ("color", "shape", "texture", "object", "location")
K = len(ATTRIBUTES)  # attribute tokens, one per attribute, in this order
RES_RANK, PROJ_RANK = 4, 64  # MMRL++'s RES_LORA_DIM and PROJ_LORA_DIM (configs/trainers/MMRLpp/*.yaml)

# 1. Attribute tokens: one shared matrix R, mapped to every block J..L of both towers


class Aligner(nn.Module):
    """R [K, rep] -> the tokens of block i [K, width], one tower. mmrlpp, as MMRL++ (yunncheng/MMRL trainers/mmrlpp.py,
    Shared_Residual_Representation_Aligner, Residual_Aligner): a shared trainable W plus per block a rank-4 residual
    A_i B_i (A kaiming-uniform, B zeros) and a bias of its own (the shared Linear's at first), so every block starts
    with the same tokens. mmrl, as MMRL (trainers/mmrl.py): a full Linear per block, all copies of one."""

    def __init__(self, n_blocks, rep_dim, width, kind):
        super().__init__()
        base = nn.Linear(rep_dim, width)  # nn.Linear's default initialisation, as both
        if kind == "mmrlpp":
            self.weight = nn.Parameter(base.weight.detach().clone())  # [width, rep], shared by the blocks
            self.A = nn.Parameter(torch.empty(n_blocks, width, RES_RANK))
            for a in self.A.data:
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.B = nn.Parameter(torch.zeros(n_blocks, RES_RANK, rep_dim))
        else:
            self.weight = nn.Parameter(base.weight.detach().repeat(n_blocks, 1, 1))  # [n, width, rep]
        self.bias = nn.Parameter(base.bias.detach().repeat(n_blocks, 1))  # [n, width]

    def forward(self, R, i):
        W = self.weight[i] if self.weight.dim() == 3 else self.weight + self.A[i] @ self.B[i]
        return F.linear(R, W, self.bias[i])  # [K, width]


def insert(x, fresh):
    """The K tokens right after the first token (CLS, or SOT): [B, 1 + K + rest, D]."""
    return torch.cat([x[:, :1], fresh.unsqueeze(0).expand(x.shape[0], -1, -1), x[:, 1:]], dim=1)


def mix(x, fresh, beta):
    """MMRL++'s beta mixing of the token slots: beta F^l(R) + (1 - beta) (their output of block l-1)."""
    tokens = beta * fresh.unsqueeze(0) + (1.0 - beta) * x[:, 1 : 1 + K]  # [B, K, D]
    return torch.cat([x[:, :1], tokens, x[:, 1 + K :]], dim=1)


# 2. The role-based attention mask of one vision block


def role_mask(head_roles, num_patches, variant="role"):
    """The additive mask [H, L, L] of one block, order [CLS, attr_1..attr_K, patches]; row = query, column = key.
    - generalization head (and an "other specialist"): originals (CLS, patches) and attribute tokens never see each
      other; each attribute token sees only itself. These heads compute exactly what frozen CLIP computes.
    - attribute head of attribute a: originals <-> attr_a both ways; the other tokens see only themselves.
    - mixed head: no restriction. Variants: "generalization-only" (attribute heads act as mixed), "none"."""
    H, L = len(head_roles), 1 + K + num_patches
    allowed = torch.ones(H, L, L, dtype=torch.bool)
    attr = torch.arange(1, 1 + K)
    orig = torch.tensor([0] + list(range(1 + K, L)))  # CLS and patches
    for h, entry in enumerate(head_roles):
        role = entry["role"]
        if variant == "none" or role == "mixed" or (variant == "generalization-only" and role == "attribute"):
            continue
        a = allowed[h]
        a[attr[:, None], :] = False  # attribute rows read nothing ...
        a[:, attr] = False  # ... and nobody reads attribute columns,
        a[attr, attr] = True  # except each token itself
        if role == "attribute":
            i = 1 + ATTRIBUTES.index(entry["attribute"])
            a[i, orig] = a[orig, i] = True  # attr_a <-> originals
    return torch.zeros(H, L, L).masked_fill(~allowed, float("-inf"))


# 3. The DeAR module


class DeAR(nn.Module):
    """Frozen CLIP + attribute tokens from block J + role masks + P_attr + fusion weights w. Exact shortcuts (tests
    check them against every block on every position): blocks 1..J-1 once, without autograd; the last block on the
    rows read (CLS and the tokens, EOT); the prompt start shared by all classes once per block; length groups."""

    def __init__(self, clip_model, roles, J=9, beta=0.9, rep_dim=512, mask="role", attr_tokens=True,
                 alpha_cls=0.7, tokens="mmrlpp"):  # fmt: skip
        super().__init__()
        self.clip = clip_model.eval().requires_grad_(False)
        visual, L = clip_model.visual, clip_model.visual.transformer.layers
        self.J, self.first, self.L, self.Lt = J, J - 1, L, clip_model.transformer.layers
        n = L - self.first  # blocks with tokens: J..L of the vision tower, the last n of the text tower
        self.first_text = self.Lt - n
        if not (1 <= J <= L and self.first_text >= 0):
            raise UserError(f"--J {J}: the backbone has {L} vision and {self.Lt} text blocks")
        self.beta, self.use_tokens, self.kind = beta, attr_tokens, tokens
        self.R = nn.Parameter(torch.randn(K, rep_dim) * 0.02)  # MMRL's init; both towers' tokens are projections of R
        self.F_v = Aligner(n, rep_dim, visual.transformer.width, tokens)
        self.F_t = Aligner(n, rep_dim, clip_model.transformer.width, tokens)
        D, E = visual.proj.shape
        if tokens == "mmrlpp":  # P_attr = frozen proj + A B, rank 64 (MMRL++ clip/model_mmrlpp.py, proj_rep)
            self.P_A = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(D, PROJ_RANK), a=math.sqrt(5)))
            self.P_B = nn.Parameter(torch.zeros(PROJ_RANK, E))
        else:  # MMRL: a full trainable P_attr, here starting as a copy of proj
            self.P_full = nn.Parameter(visual.proj.detach().clone())
        alpha = torch.tensor([alpha_cls] + [(1 - alpha_cls) / K] * K)  # alpha_cls for the class logits, the rest evenly
        self.w, self.roles = nn.Parameter(alpha.log()), roles  # fusion weights: alpha = softmax(w)
        for i, b in enumerate(range(self.first, L)):  # buffers: .to(device) moves them; not saved
            m = role_mask(roles[b + 1], visual.num_patches, mask) if attr_tokens and mask != "none" else None
            self.register_buffer(f"mask_{i}", m, persistent=False)
        if not attr_tokens:  # nothing but w would remain: the model is frozen CLIP
            self.requires_grad_(False)

    def trainable_state(self):
        return {k: v for k, v in self.state_dict().items() if not k.startswith("clip.")}

    def load_trainable(self, state, path):
        """A saved trainable state, strictly: the same keys and shapes, finite values."""
        if set(state) != set(self.trainable_state()) or not all(v.isfinite().all() for v in state.values()):
            raise UserError(f"{path} does not fit this model (other keys, or values that are not finite)")
        try:
            self.load_state_dict({**self.state_dict(), **state})
        except RuntimeError as e:
            raise UserError(f"{path} does not fit this model: {str(e).splitlines()[-1].strip()}") from None

    def attr_proj(self):
        return self.clip.visual.proj + self.P_A @ self.P_B if self.kind == "mmrlpp" else self.P_full  # [D, E]

    def alpha(self):
        return self.w.softmax(0)  # [1 + K]: alpha_cls, alpha_color, ...

    def forward(self, images, t=None, with_frozen=False):
        """Figure 2, a step a line. t [C, E]: class features if computed already; with_frozen: also f^0 (the loss)."""
        scale = self.clip.logit_scale
        t = self.encode_classes() if t is None else t  # [C, E]      text tokens in J..L
        x = self.frozen_prefix(images)  # [B, 1+P, D]  blocks 1..J-1
        f0 = self.frozen_feature(x) if with_frozen or not self.use_tokens else None  # [B, E]  f^0
        if not self.use_tokens:  # zero-shot CLIP
            logits, feats, t = cosine_logits(f0.unsqueeze(1), t, scale)  # [B, 1, C]
            return {"logits": logits, "fused": logits[:, 0], "f_cls": feats[:, 0], "f0": f0.float(), "t": t}
        x = self.token_blocks(x)  # [B, 1+K, D]  tokens from J, role masks
        f_cls, f_attr = self.image_features(x)  # [B, E], [B, K, E]
        logits, feats, t = cosine_logits(torch.cat([f_cls.unsqueeze(1), f_attr], 1), t, scale)  # [B, 1+K, C]
        fused = fuse(logits, self.alpha())  # [B, C]  sum_k alpha_k logits_k
        f0 = None if f0 is None else f0.float()
        return {"logits": logits, "fused": fused, "f_cls": feats[:, 0], "f_attr": feats[:, 1:], "f0": f0, "t": t}

    @torch.no_grad()
    def frozen_prefix(self, images):
        visual = self.clip.visual
        return visual.run_blocks(visual.embed(images), 0, self.first)  # [B, 1+P, D]

    @torch.no_grad()
    def frozen_feature(self, x):
        """f^0 [B, E]: blocks J..L without tokens; the last block computes CLS alone."""
        cls = self.clip.visual.run_blocks(x, self.first, self.L, rows=slice(0, 1))[:, 0]  # [B, D]
        return F.normalize(self.clip.visual.head(cls), dim=-1)

    def token_blocks(self, x, last_input=False):
        """Blocks J..L with the tokens, inserted at J, mixed from J+1, under the role masks; in fp32 from J, as MMRL
        (autocast still runs the matmuls in half). [B, 1+P, D] -> [B, 1+K, D] (last_input: block L's input)."""
        x = x.float()
        for i, b in enumerate(range(self.first, self.L)):
            fresh = self.F_v(self.R, i).float()  # [K, D]
            x = insert(x, fresh) if i == 0 else mix(x, fresh, self.beta)  # [B, 1+K+P, D]
            if last_input and b == self.L - 1:
                return x
            rows = slice(0, 1 + K) if b == self.L - 1 else None
            x = self.clip.visual.run_blocks(x, b, b + 1, attn_mask=getattr(self, f"mask_{i}"), rows=rows)
        return x

    def image_features(self, x):
        """f_cls [B, E]: CLS through the frozen ln_post and proj; f_attr [B, K, E]: the tokens through P_attr."""
        f_cls = self.clip.visual.head(x[:, 0])
        f_attr = self.clip.visual.ln_post(x[:, 1 : 1 + K]) @ self.attr_proj().to(x.dtype)
        return F.normalize(f_cls, dim=-1), F.normalize(f_attr, dim=-1)

    @torch.no_grad()
    def set_classes(self, classnames, template):
        """Once per class list: blocks 1..J-1 of every prompt, and t^0. text_shared [1, S, W]: the first S positions,
        equal in every prompt (SOT and the template's first words), so also equal states under the causal mask:
        blocks J..L run them once. text_groups: the rest of each prompt, in groups padded to their longest."""
        m, device = self.clip, self.w.device
        tokens = clip.tokenize([template.format(c) for c in classnames], context_length=m.context_length)
        tokens = tokens.to(device)  # [C, T]
        eot = tokens.argmax(-1)  # [C]: EOT has the largest id
        same = (tokens == tokens[:1]).all(0).long().cumprod(0)  # [T]: 1 while all prompts agree
        S = min(int(same.sum()), int(eot.min()))
        groups, t0, order = [], [], []
        for n, idx, rows, pick in clip.model.length_buckets(eot):  # a group's EOTs sit at rows [r] (<= n)
            x = m.run_text_blocks(m.embed_text(tokens[idx, : n + 1]), 0, self.first_text)
            t0.append(m.text_head(m.run_text_blocks(x, self.first_text, self.Lt, rows=rows), pick))  # [c, E]
            groups.append((x[:, S:], rows - S, pick))  # [c, n + 1 - S, W]
            order.append(idx)
            self.text_shared = x[:1, :S]  # [1, S, W], equal in every group
        self.text_groups, self.text_order = groups, torch.cat(order).argsort()  # group order -> class order
        self.t0 = F.normalize(torch.cat(t0)[self.text_order], dim=-1)  # [C, E]
        self.prompt_tokens = tokens

    def encode_classes(self):
        """t [C, E]: the K text tokens after SOT in blocks J..L (causal: they see SOT, the words see them)."""
        if not self.use_tokens:
            return self.t0
        m, shared, parts = self.clip, self.text_shared, [g[0] for g in self.text_groups]
        for i, b in enumerate(range(self.first_text, self.Lt)):
            fresh = self.F_t(self.R, i).to(shared.dtype)  # [K, W]
            shared = insert(shared, fresh) if i == 0 else mix(shared, fresh, self.beta)  # [1, S + K, W]
            last = b == self.Lt - 1
            parts = [m.run_text_blocks(x, b, b + 1, rows=g[1] if last else None, past=shared)
                     for x, g in zip(parts, self.text_groups)]  # fmt: skip
            if not last:
                shared = m.run_text_blocks(shared, b, b + 1)
        t = torch.cat([m.text_head(x, g[2]) for x, g in zip(parts, self.text_groups)])  # [C, E]
        return F.normalize(t[self.text_order], dim=-1)


# 4. Logits, fusion and loss in fp32 outside autocast: logits are ~100 cos, where bf16 steps of 0.125-0.25 would tie


def cosine_logits(feats, t, logit_scale):
    """s cos(f, t) [B, S, C] with s = exp(logit_scale); feats [B, S, E], t [C, E]. Returns logits and features."""
    with torch.autocast(feats.device.type, enabled=False):
        feats, t = F.normalize(feats.float(), dim=-1), F.normalize(t.float(), dim=-1)
        return logit_scale.float().exp() * feats @ t.t(), feats, t


def fuse(logits, alpha):
    """sum_k alpha_k logits_k [B, C] of the six logit sets [B, 1+K, C]."""
    with torch.autocast(logits.device.type, enabled=False):
        return torch.einsum("k,bkc->bc", alpha.float(), logits.float())


def dear_loss(out, labels, t0, alpha, lambda_reg, lambda_fusion):
    """CE(fused, y) + lambda_reg [(1 - cos(f_cls, f^0)) + (1 - cos(t, t^0))] + lambda_fusion (-log alpha_cls)."""
    with torch.autocast(labels.device.type, enabled=False):
        ce = F.cross_entropy(out["fused"].float(), labels)
        reg_img = 1 - F.cosine_similarity(out["f_cls"].float(), out["f0"].float(), dim=-1).mean()
        reg_txt = 1 - F.cosine_similarity(out["t"].float(), t0.float(), dim=-1).mean()
        fusion = -alpha[0].float().log()
        total = ce + lambda_reg * (reg_img + reg_txt) + lambda_fusion * fusion
    return total, {"ce": ce.detach(), "reg_img": reg_img.detach(), "reg_txt": reg_txt.detach(), "fusion": fusion}


# 5. The recipe: a field left None takes its default from these tables (resolve), yunncheng/MMRL at 27d8821

# (beta, lambda_reg) per dataset, base-to-novel and few-shot: MMRL++'s table (trainers/config.py); else (0.9, 1.0)
DATASET_DEFAULTS = {"imagenet": (0.9, 0.2), "fgvc_aircraft": (0.9, 2.0), "ucf101": (0.9, 3.0), "dtd": (0.9, 7.0),
                    "oxford_pets": (0.7, 0.01), "stanford_cars": (0.7, 6.0), "caltech101": (0.6, 3.0),
                    "sun397": (0.5, 3.0), "oxford_flowers": (0.4, 7.0), "eurosat": (0.2, 0.01),
                    "food101": (0.1, 1.0)}  # fmt: skip
XD_DEFAULTS = (0.9, 0.1)  # the ImageNet source of cross-dataset / domain generalisation (MMRL++, task CD)
# MMRL++'s test-time beta per xd target (task CD); --target-beta source uses the source's beta instead
XD_TARGET_BETA = {"imagenetv2": 0.9, "imagenet_r": 0.9, "imagenet_a": 0.8, "imagenet_sketch": 0.7,
                  "fgvc_aircraft": 0.9, "ucf101": 0.9, "sun397": 0.7, "oxford_pets": 0.6, "caltech101": 0.6,
                  "dtd": 0.5, "oxford_flowers": 0.4, "stanford_cars": 0.3, "eurosat": 0.3, "food101": 0.3}  # fmt: skip
# (epochs, batch, warm-up epochs, lr), a published config per row: b2n MMRL's vit_b16 (ImageNet: vit_b16_imagenet);
# fewshot MMRL++'s vit_b16_few_shot, tuned with the table above; xd MMRL's vit_b16_cross_datasets; toy: 20 epochs fit.
SCHEDULES = {"b2n": (10, 4, 1, 1e-3), ("b2n", "imagenet"): (5, 32, 1, 1e-3), ("b2n", "toyworld"): (20, 4, 1, 1e-3),
             "fewshot": (100, 32, 1, 2e-3), ("fewshot", "imagenet"): (5, 32, 1, 1e-3),
             ("fewshot", "toyworld"): (50, 32, 1, 1e-3), "xd": (1, 32, 0, 1e-3)}  # fmt: skip


def number(kind, ok, what):
    """An argparse type: a finite `kind` with ok(value)."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


POSITIVE, COUNT = number(int, lambda v: v >= 1, "a whole number >= 1"), number(int, lambda v: v >= 0, "a count >= 0")
SEED, CROP = number(int, lambda v: 0 <= v < 2**32, "a seed < 2^32"), number(float, lambda v: 0 < v <= 1, "in (0, 1]")
UNIT, OPEN = number(float, lambda v: 0 <= v <= 1, "in [0, 1]"), number(float, lambda v: 0 < v < 1, "in (0, 1)")
NONNEG, RATE = number(float, lambda v: v >= 0, "a number >= 0"), number(float, lambda v: v > 0, "a number > 0")


def opt(default, help, type=str, choices=None, **kw):
    return dataclasses.field(default=default, metadata=dict(help=help, type=type, choices=choices, **kw))


@dataclasses.dataclass
class Config:
    dataset: str = opt("eurosat", "a data.py name (toyworld: offline), or folder:PATH")
    root: str = opt(os.environ.get("DATA", "data"), "folder of the datasets in CoOp's layout ($DATA)")
    protocol: str = opt("b2n", "base-to-novel, few-shot, or cross-dataset (train the source, test --targets too)",
                        choices=("b2n", "fewshot", "xd"))  # fmt: skip
    method: str = opt("dear", "zeroshot: frozen CLIP through the same code", choices=("dear", "zeroshot"))
    shots: int = opt(16, "training images per class", POSITIVE)
    seed: int = opt(1, "seed of the few-shot subset and the run", SEED)
    backbone: str = opt(None, "ViT-B/32, ViT-B/16, ViT-L/14, ViT-L/14@336px, toy, or a file (default: ViT-B/16; toy)")
    targets: list = opt(None, "xd targets, comma-separated or repeated (default: ImageNet's 4 variants, 10 datasets)",
                        action="append")  # fmt: skip
    out: str = opt("runs", "output root; every run gets its own folder")
    J: int = opt(None, "tokens enter block J (from 1) (default: the last third of the blocks: 9 of 12)", POSITIVE)
    beta: float = opt(None, "token mixing (default: MMRL++'s table, else 0.9)", UNIT)
    lambda_reg: float = opt(None, "self-regularisation (default: MMRL++'s table, else 1.0; xd source 0.1)", NONNEG)
    lambda_fusion: float = opt(1.0, "weight of -log alpha_cls", NONNEG)
    alpha_cls: float = opt(0.7, "initial fusion weight of the class logits (each token: the rest / 5)", OPEN)
    rep_dim: int = opt(512, "width of the shared token matrix R", POSITIVE)
    tokens: str = opt("mmrlpp", "MMRL++'s token parameters (shared aligner + rank-4 residuals, P_attr = proj + rank 64)"
                      "or MMRL's (a full aligner per block and P_attr)", choices=("mmrlpp", "mmrl"))  # fmt: skip
    mask: str = opt("role", "per-head mask or an ablation", choices=("role", "generalization-only", "none"))
    attr_tokens: bool = opt(True, "ablation: no attribute tokens (frozen CLIP)", flag="--no-attr-tokens")
    novel_logits: str = opt("fused", "novel classes, xd targets (cls: MMRL's)", choices=("fused", "cls"))
    target_beta: str = opt("table", "xd targets: MMRL++'s beta, or the source's", choices=("table", "source"))
    roles: str = opt(None, "roles JSON written by entropy.py (default: computed once, cached)")
    roles_control: str = opt("none", "random: each block's roles shuffled (by --seed); oracle: the toy's ground truth",
                             choices=("none", "random", "oracle"))  # fmt: skip
    epochs: int = opt(None, "default: b2n 10 (ImageNet 5, toy 20), fewshot 100 (ImageNet 5, toy 50), xd 1", POSITIVE)
    batch_size: int = opt(None, "default: 4 (b2n), 32 (ImageNet b2n, fewshot, xd)", POSITIVE)
    warmup_epochs: int = opt(None, "epochs at --warmup-lr before the cosine (default: 1; xd 0)", COUNT)
    lr: float = opt(None, "AdamW lr (default: 1e-3; fewshot 2e-3, ImageNet fewshot 1e-3)", RATE)
    warmup_lr: float = opt(1e-5, "learning rate of the warm-up epochs", RATE)
    weight_decay: float = opt(5e-4, "AdamW weight decay", NONNEG)
    crop_scale: float = opt(None, "smallest area of the training crop (default: 0.5; toyworld 1)", CROP)
    eval_batch_size: int = opt(100, "evaluation batch size", POSITIVE)
    workers: int = opt(None, "data-loading processes (default: up to 4); no result depends on it", COUNT)
    device: str = opt("auto", "auto, cpu, cuda or cuda:N")
    precision: str = opt("amp", "amp: fp16 + GradScaler on CUDA, fp32 on a CPU (MMRL's); head and loss always fp32",
                         choices=("amp", "fp16", "bf16", "fp32"))  # fmt: skip
    eval_precision: str = opt("fp32", "as MMRL's test()", choices=("fp32", "fp16", "bf16"))
    eval_only: bool = opt(False, "evaluate the run of --load on --dataset / --protocol")
    load: str = opt(None, "a finished run folder")
    resume: bool = opt(False, "continue an interrupted run from its last epoch (else start it)")
    force: bool = opt(False, "redo a finished run, or restart an interrupted one")
    roles_only: bool = opt(False, "only compute (or find) the head roles, into OUT/roles/J<J>/")


GROUPS = {"J": "the method", "epochs": "optimisation", "eval_only": "runs"}
NAMES = [f.name for f in dataclasses.fields(Config)]
TUNED = ["backbone"] + NAMES[NAMES.index("J") : NAMES.index("eval_only")]  # the flags that name a variant
# the fields that change no result, or only through files compared by content; and what --eval-only takes from a run
BOOKKEEPING = ("root", "out", "workers", "eval_batch_size", "device", "load", "resume", "force", "roles_only")
CARRIED = ("backbone", "J", "beta", "rep_dim", "tokens", "mask", "attr_tokens", "alpha_cls", "roles_control", "seed",
           "method", "novel_logits")  # fmt: skip


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description="DeAR: adapt CLIP with attribute tokens and role-based head masks.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)  # fmt: skip
    p.error, g = refuse, p.add_argument_group("what to run")
    for f in dataclasses.fields(Config):
        m = dict(f.metadata)
        flag = m.pop("flag", "--" + f.name.replace("_", "-"))
        if f.name in GROUPS:  # the fields come in four groups, each starting with one of these
            g = p.add_argument_group(GROUPS[f.name])
        if f.type is bool:
            g.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true", help=m["help"])
        else:
            shown = f" (default: {f.default})" if f.default is not None and "default" not in m["help"] else ""
            g.add_argument(flag, dest=f.name, default=f.default, **dict(m, help=m["help"] + shown))
    return Config(**vars(p.parse_args(argv)))


EXAMPLES = """examples:
  python dear.py --dataset toyworld                  # offline, a tiny CLIP, minutes on a CPU
  python dear.py --dataset eurosat --shots 16        # base-to-novel, seed 1, ViT-B/16
  python dear.py predict --load RUN a.jpg --explain x.png   # classify and explain your own images
environment: DATA (default --root), CLIP_CACHE (checkpoints, the toy CLIP, head roles; default ~/.cache/clip)"""


def refuse(message):
    raise UserError(f"{message} (see --help)")  # argparse's errors as one line, through main's handler


def resolve(cfg: Config) -> Config:
    """The flags checked (a Config built in code too), every None filled from the tables (J later: default_J)."""
    for f in dataclasses.fields(Config):
        value, m, flag = getattr(cfg, f.name), f.metadata, "--" + f.name.replace("_", "-")
        try:
            if value is not None and f.type in (int, float) and m["type"](str(value)) != value:
                raise argparse.ArgumentTypeError(f"{value!r} is not a {f.type.__name__}")
        except argparse.ArgumentTypeError as e:
            raise UserError(f"{flag}: {e}") from None
        if value is not None and m["choices"] and value not in m["choices"]:
            raise UserError(f"{flag} {value!r}: choose from {', '.join(m['choices'])}")
    c = dataclasses.replace(cfg)
    c.backbone = c.backbone or ("toy" if c.dataset == "toyworld" else "ViT-B/16")
    beta, lam = XD_DEFAULTS if c.protocol == "xd" else DATASET_DEFAULTS.get(c.dataset, (0.9, 1.0))
    epochs, batch, warmup, lr = SCHEDULES.get((c.protocol, c.dataset), SCHEDULES[c.protocol])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for k, v in dict(beta=beta, lambda_reg=lam, epochs=epochs, batch_size=batch, warmup_epochs=warmup, lr=lr,
                     crop_scale=1.0 if c.dataset == "toyworld" else 0.5, workers=min(4, cpus)).items():  # fmt: skip
        setattr(c, k, v if getattr(c, k) is None else getattr(c, k))
    c.targets = [t for v in c.targets or [] for t in ([v] if v.startswith("folder:") else v.split(",")) if t]
    if c.protocol == "xd" and not c.targets:
        c.targets = [t for t in data.DG_TARGETS + data.B2N_DATASETS if t != c.dataset]
    return c


def default_J(num_layers):
    """Tokens in the last third of the blocks, as DeAR's 9..12 of 12: ViT-L/14 17..24, the toy CLIP 3..4."""
    return num_layers - math.ceil(num_layers / 3) + 1


def eval_beta(c: Config, dataset):
    """An evaluation's beta: the run's, except on xd targets (MMRL++'s test-time beta, where its table has one)."""
    if c.protocol != "xd" or dataset == c.dataset or c.target_beta == "source":
        return c.beta
    return XD_TARGET_BETA.get(dataset, c.beta)


# 6. Training and evaluation, MMRL's protocol

AMP = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def lr_at(epoch, c: Config):
    """Epoch e from 0: warmup_lr for e < W, then lr (1 + cos(pi (e - W) / E)) / 2, as Dassl, stepped per epoch."""
    if epoch < c.warmup_epochs:
        return c.warmup_lr
    return c.lr * (1 + math.cos(math.pi * (epoch - c.warmup_epochs) / c.epochs)) / 2


def pick_device(c: Config):
    """The device; amp (MMRL's PREC "amp") becomes fp16 with a GradScaler on CUDA, fp32 on a CPU."""
    name = ("cuda" if torch.cuda.is_available() else "cpu") if c.device == "auto" else c.device
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available here")
    if "bf16" in (c.precision, c.eval_precision) and name.startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise UserError("--precision bf16: this GPU has no bfloat16; use fp16")
    c.precision = ("fp16" if name.startswith("cuda") else "fp32") if c.precision == "amp" else c.precision
    return torch.device(name)


class SeededImages(data.ImageList):
    """Each image's augmentation from a seed of its own (the loader hands it over): none depends on --workers."""

    def __getitem__(self, item):
        i, seed = item
        torch.default_generator.manual_seed(seed)  # the CPU generator only (torch.manual_seed seeds CUDA too: slow)
        return super().__getitem__(i)


def train(model, ds, c: Config, device, ckpt, log):
    """Train on ds.train, a checkpoint at each epoch's end: --resume ends with an uninterrupted run's weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        log("no trainable parameters (no attribute tokens): the model is frozen CLIP")
        return {"steps": 0, "trainable": 0}
    model.set_classes(ds.classnames, ds.template)
    amp = AMP[c.precision]
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)  # skips overflowing fp16 steps (MMRL)
    start = 0  # or the epoch of the last checkpoint (--resume)
    if os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=device, weights_only=True)
        if state["precision"] != c.precision:
            raise UserError(f"{ckpt} was written with --precision {state['precision']}; resume with it, or --force")
        model.load_trainable(state["model"], ckpt)
        opt.load_state_dict(state["opt"])
        scaler.load_state_dict(state["scaler"])
        start = state["epoch"]
        log(f"resuming from {ckpt} at epoch {start + 1}")
    images = SeededImages(ds.train, data.train_transform(model.clip.visual.input_resolution, c.crop_scale))
    n = len(ds.train)
    steps = max(1, n // c.batch_size)  # Dassl drops the last incomplete batch
    t_start, done, log_every = time.time(), 0, max(1, min(50, steps // 2))
    taken = lambda: int(opt.state[params[0]].get("step", 0))  # noqa: E731  AdamW's count: skipped steps excluded
    for epoch in range(start, c.epochs):
        for g in opt.param_groups:
            g["lr"] = lr_at(epoch, c)
        seed = c.seed * 1000 + epoch
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        batches = [
            [(i, seed * 2**24 + i) for i in order[s * c.batch_size : (s + 1) * c.batch_size]] for s in range(steps)
        ]
        loader = torch.utils.data.DataLoader(images, batch_sampler=batches, num_workers=c.workers,
                                             pin_memory=device.type == "cuda")  # fmt: skip
        model.train()
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                out = model(x, with_frozen=True)
            loss, parts = dear_loss(out, y, model.t0, model.alpha(), c.lambda_reg, c.lambda_fusion)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            done += 1
            if (step + 1) % log_every == 0 or step + 1 == steps:  # the only waits for the device
                value, skipped = loss.item(), epoch * steps + step + 1 - taken()
                if not math.isfinite(value) and not scaler.is_enabled():  # nothing skips this step: stop
                    to = "--precision fp32" if c.precision == "bf16" else "a lower --lr"
                    raise UserError(f"the loss became {value} by epoch {epoch + 1}, step {step + 1}; try {to}")
                eta = (time.time() - t_start) / done * ((c.epochs - start) * steps - done)
                ce, lr = parts["ce"].item(), lr_at(epoch, c)
                log(f"epoch {epoch + 1}/{c.epochs} step {step + 1}/{steps} loss {value:.4f} ce {ce:.3f} lr {lr:.2e}"
                    + (f" skipped {skipped}" if skipped else "") + f" eta {eta:.0f}s")  # fmt: skip
        save({"model": model.trainable_state(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
              "epoch": epoch + 1, "precision": c.precision}, ckpt)  # fmt: skip
    return {"steps": done, "skipped_steps": c.epochs * steps - taken(), "trainable": sum(p.numel() for p in params)}


@torch.no_grad()
def evaluate(model, items, classnames, template, c: Config, device, rule="fused", log=print, name=""):
    """Top-1 accuracy (%) of the fused (or class) logits, overall and per class; fp32 as MMRL's test() by default."""
    model.eval().set_classes(classnames, template)
    amp = AMP[c.eval_precision]
    images = data.ImageList(items, data.test_transform(model.clip.visual.input_resolution))
    loader = torch.utils.data.DataLoader(images, batch_size=c.eval_batch_size, num_workers=c.workers,
                                         pin_memory=device.type == "cuda")  # fmt: skip
    correct = torch.zeros(len(classnames), dtype=torch.long, device=device)  # per true class
    count, t_start = torch.zeros_like(correct), time.time()
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        t = model.encode_classes()  # [C, E], once for the whole evaluation
        for i, (x, y) in enumerate(loader):
            out = model(x.to(device, non_blocking=True), t=t)
            scores, y = out["fused"] if rule == "fused" else out["logits"][:, 0], y.to(device)  # [B, C]
            correct.index_add_(0, y, (scores.argmax(-1) == y).long())
            count.index_add_(0, y, torch.ones_like(y))
            if (i + 1) % 50 == 0:
                eta = (time.time() - t_start) / (i + 1) * (len(loader) - i - 1)
                log(f"  eval {name}: {i + 1}/{len(loader)} batches, eta {eta:.0f}s")
    correct, count = correct.tolist(), count.tolist()
    per_class = [{"class": k, "accuracy": 100.0 * a / max(1, n), "n": n} for k, a, n in zip(classnames, correct, count)]
    accuracy = 100.0 * sum(correct) / max(1, sum(count))
    return dict(accuracy=accuracy, n=sum(count), logits=rule, precision=c.eval_precision, per_class=per_class)


# 7. The run. Its folder is its identity: a finished run is reused, and an interrupted one resumed, only when its
# recorded config (the resolved flags; by content the dataset folder, checkpoint and roles) equals the call's.


def save(obj, path):
    """A checkpoint, or JSON for a .json path, written whole or not at all."""
    tmp = f"{path}.tmp{os.getpid()}"
    if path.endswith(".json"):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


def run_dir(c: Config):
    """(OUT/<protocol>/<dataset>/<method>-<variant>-shots<K>-seed<S>/, the flags that differ from the dataset's defaults
    by name: the variant, `default` or e.g. `mask-none_J-7`); a folder:PATH dataset: its folder, its path's hash."""
    base = resolve(Config(dataset=c.dataset, protocol=c.protocol, root=c.root))
    names = ("backbone", "precision", "eval_precision") if c.method == "zeroshot" else TUNED  # zero-shot: what it uses
    changed = {k: getattr(c, k) for k in names if k not in BOOKKEEPING and getattr(c, k) != getattr(base, k)}
    parts = [f"{k}-{v}" for k, v in changed.items()]  # a long part is cut and hashed
    parts = [p if len(p) < 40 else p[:20] + hashlib.sha256(p.encode()).hexdigest()[:8] for p in parts]
    variant, tag, path = "_".join(parts).replace("/", "-") or "default", c.dataset, os.path.realpath(c.dataset[7:])
    if c.dataset.startswith("folder:"):
        tag = f"folder-{os.path.basename(path)}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    if c.eval_only:
        return os.path.join(c.load, "eval", f"{c.protocol}-{tag}"), variant, changed
    return os.path.join(c.out, c.protocol, tag, f"{c.method}-{variant}-shots{c.shots}-seed{c.seed}"), variant, changed


def environment():
    """Where a run ran: versions, the device, the code's commit and whether the tree had changes."""
    git = lambda *a: subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), *a],  # noqa: E731
                                    capture_output=True, text=True).stdout.strip()  # fmt: skip
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((l.split(":")[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), cpu)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu
    return dict(python=platform.python_version(), torch=torch.__version__, torchvision=torchvision.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), device=device,
                git_commit=git("rev-parse", "HEAD") or None, git_dirty=bool(git("status", "--porcelain")))  # fmt: skip


def build(c: Config, device, log, roles_path=None, trained=None):
    """The backbone, the roles and the DeAR model of a config (trained: a model.pt): (model, roles file or None)."""
    clip_model, _ = toyworld.load_clip(c.backbone, device=device, log=log)
    if c.backbone == "toy" and device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the toy CLIP's matrices are too small for a second thread to pay
    L = clip_model.visual.transformer.layers
    c.J, roles = c.J or default_J(L), None
    if c.J > L:
        raise UserError(f"--J {c.J}: {c.backbone} has {L} blocks")
    layers = list(range(c.J, L + 1))
    if c.method == "dear" and c.attr_tokens and c.mask != "none":
        roles_path = roles_path or c.roles
        if not roles_path:  # computed once and cached, on ImageNet's test images if ImageNet is under --root (as
            # TextSpan), else on the run's own training images (never its test images)
            imagenet = os.path.isdir(data.dataset_folder("imagenet", c.root))
            probe, split = ("imagenet", "test") if imagenet else (c.dataset, "train")
            log(f"head roles of {c.backbone}, blocks {c.J}..{L}: probe {probe} {split} (computed once, then cached)")
            roles_path = entropy.run(c.backbone, probe, c.root, layers, split=split, log=log, model=clip_model)
        heads = clip_model.visual.transformer.heads
        roles = entropy.load_roles(roles_path, num_layers=L, num_heads=heads, layers=layers, sha256=clip_model.sha256)
        if c.roles_control != "none":
            roles = entropy.control_roles(roles, c.roles_control, c.seed)
    torch.manual_seed(c.seed)  # the tokens' initialisation
    model = DeAR(clip_model, roles, c.J, c.beta, c.rep_dim, c.mask, c.method == "dear" and c.attr_tokens, c.alpha_cls,
                 c.tokens).to(device)  # fmt: skip
    if trained:
        model.load_trainable(torch.load(trained, map_location=device, weights_only=True), trained)
    return model, roles_path if roles is not None else None


def run(cfg: Config, log_to_stdout=True):
    """One run: train (unless zero-shot or --eval-only), evaluate, write results.json; returns the results."""
    if cfg.eval_only:
        if not (cfg.load and os.path.isfile(os.path.join(cfg.load, "model.pt"))):
            raise UserError("--eval-only needs --load RUN, a finished run folder")
        with open(os.path.join(cfg.load, "config.json")) as f:
            cfg = dataclasses.replace(cfg, **{k: v for k, v in json.load(f)["config"].items() if k in CARRIED})
    c = resolve(cfg)
    rdir, variant, changed = run_dir(c)  # named by the flags as given (amp, not what amp resolves to)
    device = pick_device(c)
    if c.dataset == "toyworld":
        toyworld.ensure_dataset(c.root)
    if c.protocol == "b2n":  # every split is read before anything is written, so a missing dataset stops it here
        train_ds, novel = (data.build_dataset(c.dataset, c.root, c.shots, c.seed, s) for s in ("base", "novel"))
        evals = [(train_ds, "base", "fused"), (novel, "novel", c.novel_logits)]
    else:
        train_ds = data.build_dataset(c.dataset, c.root, c.shots, c.seed)
        evals = [(train_ds, "all", "fused")] + [
            (data.build_dataset(t, c.root), "all", c.novel_logits) for t in c.targets
        ]
    os.makedirs(rdir, exist_ok=True)
    p = lambda f: os.path.join(rdir, f)  # noqa: E731
    fd = os.open(p(".lock"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # one process a folder; never a link
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"{rdir} is being written by another process") from None
    for f in ("results.json", "checkpoint.pt", "model.pt", "roles.json", "config.json") if c.force else ():
        if os.path.exists(p(f)):  # results first: once they are gone the folder holds no finished run
            os.remove(p(f))
    log_file = open(p("log.txt"), "a")

    def log(msg):
        for out in (log_file, sys.stdout) if log_to_stdout else (log_file,):
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=out, flush=True)

    try:
        env = environment()
        log(f"{c.method} {c.protocol} {c.dataset} -> {rdir} | " + " ".join(f"{k} {v}" for k, v in env.items()))
        resuming, finished = c.resume and os.path.exists(p("checkpoint.pt")), os.path.exists(p("results.json"))
        own = os.path.join(c.load, "roles.json") if c.eval_only else p("roles.json")  # resumed, evaluated: its own
        own = own if (c.eval_only or resuming) and os.path.exists(own) else None
        model, roles = build(c, device, log, own, os.path.join(c.load, "model.pt") if c.eval_only else None)
        config = {k: v for k, v in dataclasses.asdict(c).items() if k not in BOOKKEEPING}
        roles_sha = roles and hashlib.sha256(open(roles, "rb").read()).hexdigest()
        inputs = {"dataset_folder": os.path.realpath(data.dataset_folder(c.dataset, c.root)),
                  "backbone_sha256": model.clip.sha256, "roles_sha256": roles_sha}  # fmt: skip
        if os.path.exists(p("checkpoint.pt")) and not (finished or c.resume):
            raise UserError(f"{rdir} holds an interrupted run: pass --resume to continue it, or --force")
        if finished or resuming:  # the folder's recorded config must equal this call's
            saved = json.load(open(p("config.json"))) if os.path.exists(p("config.json")) else {}
            now = {f"config.{k}": v for k, v in config.items()} | {f"inputs.{k}": v for k, v in inputs.items()}
            was = {f"{g}.{k}": v for g in ("config", "inputs") for k, v in saved.get(g, {}).items()}
            diff = [f"{k}: {was.get(k)!r} -> {v!r}" for k, v in now.items() if was.get(k) != v]
            if diff:
                raise UserError(
                    f"{rdir} holds a run of another config ({'; '.join(diff[:4])}); use another --out or --force"
                )
        if finished:
            results = json.load(open(p("results.json")))
            if not all(0 <= e["accuracy"] <= 100 for e in results["evals"]):  # NaN fails too
                raise UserError(f"{p('results.json')} holds accuracies outside 0..100; --force redoes the run")
            print(f"done already: {p('results.json')} (--force redoes it)")
            return results
        if roles and os.path.realpath(roles) != os.path.realpath(p("roles.json")):
            shutil.copyfile(roles, p("roles.json.tmp"))
            os.replace(p("roles.json.tmp"), p("roles.json"))
        if roles:
            entropy.write_report(json.load(open(p("roles.json"))), rdir)  # roles.md, roles.png
        classes = sum((e[0].classnames for e in evals[: 2 if c.protocol == "b2n" else 1]), [])  # base + novel
        save({"config": config, "inputs": inputs, "env": env, "classes": classes, "template": train_ds.template},
             p("config.json"))  # fmt: skip
        t0, stats = time.time(), None
        if c.method == "dear" and not c.eval_only:
            log(f"train: {len(train_ds.train)} images, {len(train_ds.classnames)} classes, {c.epochs} epochs, batch "
                f"{c.batch_size}, beta {c.beta}, lambda_reg {c.lambda_reg}, J {c.J}, tokens {c.tokens}: "
                f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable values")  # fmt: skip
            stats = train(model, train_ds, c, device, p("checkpoint.pt"), log)
            save(model.trainable_state(), p("model.pt"))
        results = {"config": config, "inputs": inputs, "variant": variant, "changed": changed, "env": env, "evals": [],
                   "train": stats, "train_shots": train_ds.shots_per_class,
                   "warnings": list(dict.fromkeys(w for ds, _, _ in evals for w in ds.warnings))}  # fmt: skip
        t1 = time.time()
        for ds, split, rule in evals:
            model.beta = eval_beta(c, ds.name)  # xd targets: MMRL++'s test-time beta
            r = evaluate(model, ds.test, ds.classnames, ds.template, c, device, rule, log, f"{ds.name}/{split}")
            results["evals"].append({"dataset": ds.name, "split": split, "beta": model.beta, **r})
            log(f"{ds.name} {split}: {r['accuracy']:.2f}% of {r['n']} ({rule} logits, beta {model.beta})")
        if c.protocol == "b2n":
            b, n = (e["accuracy"] for e in results["evals"])
            results["hm"] = 2 * b * n / (b + n) if b + n > 0 else 0.0
            log(f"HM {results['hm']:.2f}")
        if model.use_tokens:
            results["fusion_weights"] = dict(zip(("cls",) + ATTRIBUTES, model.alpha().tolist()))
        results["timing"] = {"train_s": t1 - t0, "eval_s": time.time() - t1}
        save(results, p("results.json"))
        if os.path.exists(p("checkpoint.pt")):
            os.remove(p("checkpoint.pt"))
        log(f"wrote {p('results.json')}")
        return results
    finally:
        log_file.close()
        os.close(fd)


# 8. Predict and explain (entropy.attention_maps: what each token's expert heads look at) on your own images


def predict(argv):
    p = argparse.ArgumentParser(prog="dear.py predict", description="Classify (and explain) images with a trained run.")
    p.add_argument("images", nargs="+", help="image files")
    p.add_argument("--load", required=True, help="a finished run folder")
    p.add_argument("--classes", help="a file of class names, one a line (default: the run's classes, base and novel)")
    p.add_argument("--template", help="the prompt template (default: the run's)")
    p.add_argument("--explain", help="a PNG: what CLS and each attribute token look at in the last block")
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    with open(os.path.join(a.load, "config.json")) as f:
        saved = json.load(f)
    c = resolve(Config(**dict(saved["config"], device=a.device)))
    device = pick_device(c)
    model = build(c, device, print, os.path.join(a.load, "roles.json"), os.path.join(a.load, "model.pt"))[0]
    names = [l.strip() for l in open(a.classes) if l.strip()] if a.classes else saved["classes"]
    model.eval().set_classes(names, a.template or saved["template"])
    images = [Image.open(f).convert("RGB") for f in a.images]
    x = torch.stack([data.test_transform(model.clip.visual.input_resolution)(im) for im in images]).to(device)
    out, alpha = model(x), dict(zip(("cls",) + ATTRIBUTES, model.alpha().tolist() if model.use_tokens else [1.0]))
    report, top = [], out["fused"].softmax(-1).topk(min(5, len(names)))  # [B, 5]
    for i, f in enumerate(a.images):
        evidence = {k: {"alpha": alpha[k], "top": names[out["logits"][i, j].argmax()]} for j, k in enumerate(alpha)}
        top5 = [[names[j], p] for p, j in zip(top.values[i].tolist(), top.indices[i].tolist())]
        report.append({"image": f, "top5": top5, "evidence": evidence})
        if not a.json:
            print(f + ": " + ", ".join(f"{n} {p:.1%}" for n, p in top5))
            print(
                "  by logit set: " + ", ".join(f"{k} (alpha {v['alpha']:.2f}) {v['top']}" for k, v in evidence.items())
            )
    if a.explain and model.use_tokens:
        maps, heads = entropy.attention_maps(model, x)  # a token without a head in block L: an empty map, "-"
        labels = ["CLS"] + [f"{k} alpha {alpha[k]:.2f}{'' if h else ' -'}" for k, h in zip(ATTRIBUTES, heads[1:])]
        entropy.draw_maps(images, maps.cpu(), labels, a.explain)
    if a.json:
        print(json.dumps(report, indent=1))
    return report


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["predict"]:
            return predict(argv[1:])
        cfg = parse_args(argv)
        if cfg.roles_only:  # the roles a run would use, copied to OUT/roles/J<J>/ (where tables.py reads them)
            c = resolve(dataclasses.replace(cfg, method="dear", attr_tokens=True, mask="role"))
            source, dest = os.path.dirname(build(c, pick_device(c), print)[1]), os.path.join(c.out, "roles", f"J{c.J}")
            shutil.copytree(source, dest, dirs_exist_ok=True)  # the cache's roles.json, roles.md and roles.png
            return print(f"roles copied to {dest}")
        results = run(cfg)
    except (UserError, OSError) as e:  # a problem the user can fix, or the system reports: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted: rerun the same command with --resume to continue from the last epoch", file=sys.stderr)
        sys.exit(130)
    line = {e["dataset"] + "/" + e["split"]: round(e["accuracy"], 2) for e in results["evals"]}
    print(json.dumps(dict(line, **({"hm": round(results["hm"], 2)} if "hm" in results else {}))))
    return results


if __name__ == "__main__":
    main()

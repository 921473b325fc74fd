"""DeAR: Fine-Grained VLM Adaptation by Decomposing Attention Head Roles (CVPR 2026), in PyTorch.

Read top to bottom: 1. the attribute tokens, 2. the role-based mask, 3. the DeAR module (Figure 2;
the text side stated plainly, then its fast form), 4. logits, fusion and loss, 5. the recipe
(Config: every flag; MMRL and MMRL++'s tables), 6. training, 7. evaluation, 8. the run and the
command line. A run's folder and records are runs.py's, the head roles entropy.py's, the
datasets data.py's.

Blocks count from 1 in the paper (J = 9: the tokens enter block 9 of 12), in the flags and in the
roles files, and from 0 in the code. DeAR.__init__ converts once: self.blocks = range(J - 1, L) are
the vision blocks that hold the tokens, and self.roles[i] the head roles of the i-th of them.

examples:
  python dear.py --dataset toyworld                  # offline, a tiny CLIP, minutes on a CPU
  python dear.py --dataset eurosat --shots 16        # base-to-novel, seed 1, ViT-B/16
  python predict.py --load RUN --explain x.png a.jpg   # classify and explain your own images
environment: DATA (default --root), CLIP_CACHE (checkpoints, the toy CLIP, head roles; default
  ~/.cache/clip)
"""

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import time
from typing import NamedTuple

import data  # before torch: OpenMP's idle threads sleep, and Ctrl-C or SIGTERM is one line
import torch
import torch.nn as nn
import torch.nn.functional as F

import clip
import entropy
import runs
import toyworld
from data import UserError  # a mistake the user can fix

ATTRIBUTES = ("color", "shape", "texture", "object", "location")
K = len(ATTRIBUTES)  # attribute tokens, one per attribute, in this order
RES_RANK = 4  # MMRL++'s RES_LORA_DIM (configs/trainers/MMRLpp/*.yaml): each block's residual
PROJ_RANK = 64  # MMRL++'s PROJ_LORA_DIM: the rank of P_attr's residual

# 1. Attribute tokens: one shared matrix R, mapped to every block J..L of both towers


class Aligner(nn.Module):
    """R [K, rep] -> the tokens of the i-th block with tokens [K, width], in one tower.

    mmrlpp, as MMRL++ (yunncheng/MMRL trainers/mmrlpp.py, Shared_Residual_Representation_Aligner,
    Residual_Aligner): a shared trainable W plus per block a rank-4 residual A_i B_i (A
    kaiming-uniform, B zeros) and a bias of its own (the shared Linear's at first), so every block
    starts with the same tokens. mmrl, as MMRL (trainers/mmrl.py): a full Linear per block, all
    copies of one."""

    def __init__(self, n_blocks, rep_dim, width, kind):
        super().__init__()
        base = nn.Linear(rep_dim, width)  # nn.Linear's default initialisation, as both
        if kind == "mmrlpp":
            self.weight = nn.Parameter(base.weight.detach().clone())  # [width, rep], shared
            self.A = nn.Parameter(torch.empty(n_blocks, width, RES_RANK))
            for a in self.A.data:
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.B = nn.Parameter(torch.zeros(n_blocks, RES_RANK, rep_dim))
        else:
            self.weight = nn.Parameter(base.weight.detach().repeat(n_blocks, 1, 1))  # [n, width, r]
        self.bias = nn.Parameter(base.bias.detach().repeat(n_blocks, 1))  # [n, width]

    def forward(self, R, i):
        if self.weight.dim() == 3:  # mmrl
            W = self.weight[i]
        else:
            W = self.weight + self.A[i] @ self.B[i]
        return F.linear(R, W, self.bias[i])  # [K, width]


def insert(x, fresh):
    """The K tokens right after the first token (CLS, or SOT): [B, 1 + K + rest, D]."""
    tokens = fresh.unsqueeze(0).expand(x.shape[0], -1, -1)
    return torch.cat([x[:, :1], tokens, x[:, 1:]], dim=1)


def mix(x, fresh, beta):
    """MMRL++'s beta mixing of the token slots: beta F^l(R) + (1 - beta) (their output of l-1)."""
    tokens = beta * fresh.unsqueeze(0) + (1.0 - beta) * x[:, 1 : 1 + K]  # [B, K, D]
    return torch.cat([x[:, :1], tokens, x[:, 1 + K :]], dim=1)


# 2. The role-based attention mask of one vision block (mask.png, written with a run's roles,
# draws it)


def role_mask(head_roles, num_patches, variant="role"):
    """The additive mask [H, T, T] of one block, order [CLS, attr_1..attr_K, patches]; row = query,
    column = key.
    - generalization head (and an "other specialist"): originals (CLS, patches) and attribute
      tokens never see each other; each attribute token sees only itself. These heads compute what
      frozen CLIP computes.
    - attribute head of attribute a: originals <-> attr_a both ways; the other tokens see only
      themselves.
    - mixed head: no restriction.
    Variants: "generalization-only" (attribute heads act as mixed), "none" (no mask)."""
    H = len(head_roles)
    T = 1 + K + num_patches
    allowed = torch.ones(H, T, T, dtype=torch.bool)
    attr = torch.arange(1, 1 + K)
    orig = torch.tensor([0] + list(range(1 + K, T)))  # CLS and patches
    for h, entry in enumerate(head_roles):
        role = entry["role"]
        as_mixed = variant == "generalization-only" and role == "attribute"
        if variant == "none" or role == "mixed" or as_mixed:
            continue
        a = allowed[h]
        a[attr[:, None], :] = False  # attribute rows read nothing ...
        a[:, attr] = False  # ... and nobody reads attribute columns,
        a[attr, attr] = True  # except each token itself
        if role == "attribute":
            i = 1 + ATTRIBUTES.index(entry["attribute"])
            a[i, orig] = True  # attr_a reads the originals
            a[orig, i] = True  # and they read it
    return torch.zeros(H, T, T).masked_fill(~allowed, float("-inf"))


# 3. The DeAR module


class DeAR(nn.Module):
    """Frozen CLIP + attribute tokens from block J + role masks + P_attr + fusion weights w."""

    def __init__(self, clip_model, roles, J=9, beta=0.9, rep_dim=512, mask="role",
                 attr_tokens=True, alpha_cls=0.7, tokens="mmrlpp"):
        super().__init__()
        self.clip = clip_model.eval().requires_grad_(False)
        visual = clip_model.visual
        depth = visual.transformer.layers
        text_depth = clip_model.transformer.layers
        if not 1 <= J <= depth or depth - J + 1 > text_depth:
            raise UserError(f"--J {J}: the backbone has {depth} vision, {text_depth} text blocks")
        self.blocks = range(J - 1, depth)  # the vision blocks with tokens, J..L, counted from 0
        self.text_blocks = range(text_depth - len(self.blocks), text_depth)  # the last as many
        self.beta = beta
        self.use_tokens = attr_tokens
        self.kind = tokens
        self.R = nn.Parameter(torch.randn(K, rep_dim) * 0.02)  # MMRL's init; both towers' tokens
        self.F_v = Aligner(len(self.blocks), rep_dim, visual.transformer.width, tokens)
        self.F_t = Aligner(len(self.blocks), rep_dim, clip_model.transformer.width, tokens)
        D, E = visual.proj.shape
        if tokens == "mmrlpp":  # P_attr = frozen proj + A B, rank 64 (MMRL++'s proj_rep)
            self.P_A = nn.Parameter(torch.empty(D, PROJ_RANK))
            nn.init.kaiming_uniform_(self.P_A, a=math.sqrt(5))
            self.P_B = nn.Parameter(torch.zeros(PROJ_RANK, E))
        else:  # MMRL: a full trainable P_attr, here starting as a copy of proj
            self.P_full = nn.Parameter(visual.proj.detach().clone())
        alpha = torch.tensor([alpha_cls] + [(1 - alpha_cls) / K] * K)  # the class logits first
        self.w = nn.Parameter(alpha.log())  # fusion weights: alpha = softmax(w)
        # the roles files count blocks from 1: block b (from 0) is roles[b + 1]
        self.roles = [roles[b + 1] for b in self.blocks] if roles else None
        masks = None
        if attr_tokens and mask != "none":
            masks = torch.stack([role_mask(r, visual.num_patches, mask) for r in self.roles])
        self.register_buffer("masks", masks, persistent=False)  # [n, H, T, T]; not saved
        if not attr_tokens:  # nothing but w would remain: the model is frozen CLIP
            self.requires_grad_(False)

    def mask(self, i):
        """The additive attention mask [H, T, T] of the i-th block with tokens (None: no mask)."""
        return None if self.masks is None else self.masks[i]

    def trainable_state(self):
        return {k: v for k, v in self.state_dict().items() if not k.startswith("clip.")}

    def load_trainable(self, state, path):
        """A saved trainable state, strictly: the same keys and shapes, finite values."""
        own = self.trainable_state()
        finite = all(torch.is_tensor(v) and v.isfinite().all() for v in state.values())
        if set(state) != set(own) or not finite:
            raise UserError(f"{path} does not fit this model (other keys, or values not finite)")
        for k, v in own.items():
            if state[k].shape != v.shape:
                raise UserError(f"{path} does not fit this model: {k} is {list(state[k].shape)}")
        self.load_state_dict({**self.state_dict(), **state})

    def attr_proj(self):
        """P_attr [D, E]."""
        return self.clip.visual.proj + self.P_A @ self.P_B if self.kind == "mmrlpp" else self.P_full

    def alpha(self):
        return self.w.softmax(0)  # [1 + K]: alpha_cls, alpha_color, ...

    def forward(self, images, t=None, with_frozen=False):
        """Figure 2, a step a line. t [C, E]: class features if computed already; with_frozen:
        also f^0, frozen CLIP's image feature (the loss, the readouts)."""
        scale = self.clip.logit_scale
        t = self.encode_classes() if t is None else t  # [C, E]      text tokens in J..L
        x = self.frozen_prefix(images)  # [B, 1+P, D]  blocks 1..J-1
        f0 = self.frozen_feature(x) if with_frozen or not self.use_tokens else None  # [B, E]
        if not self.use_tokens:  # zero-shot CLIP
            logits, feats, t = cosine_logits(f0.unsqueeze(1), t, scale)  # [B, 1, C]
            return dict(logits=logits, fused=logits[:, 0], f_cls=feats[:, 0], f0=f0, t=t)
        x = self.token_blocks(x)  # [B, 1+K, D]  tokens from J, role masks
        f_cls, f_attr = self.image_features(x)  # [B, E], [B, K, E]
        feats = torch.cat([f_cls.unsqueeze(1), f_attr], 1)  # [B, 1+K, E]
        logits, feats, t = cosine_logits(feats, t, scale)  # [B, 1+K, C]  six logit sets
        fused = fuse(logits, self.alpha())  # [B, C]  sum_k alpha_k logits_k
        return dict(logits=logits, fused=fused, f_cls=feats[:, 0], f_attr=feats[:, 1:], f0=f0, t=t)

    def frozen_prefix(self, images):
        """Blocks 1..J-1, without autograd: [B, 3, R, R] -> [B, 1+P, D]."""
        visual = self.clip.visual
        with torch.no_grad():
            return visual.run_blocks(visual.embed(images), 0, self.blocks.start)

    def frozen_feature(self, x):
        """f^0 [B, E] in fp32: blocks J..L without tokens; the last block computes CLS alone."""
        visual = self.clip.visual
        with torch.no_grad():
            cls = visual.run_blocks(x, self.blocks.start, self.blocks.stop, rows=slice(0, 1))
            return F.normalize(visual.head(cls[:, 0]).float(), dim=-1)

    def token_blocks(self, x, stop=None):
        """Blocks J..L with the tokens: inserted at J, mixed from J+1, each block under its role
        mask; the stream in fp32 from J, as MMRL (autocast still runs the matmuls in half).
        [B, 1+P, D] -> [B, 1+K, D]: the last block computes only CLS and the tokens.
        stop=i: the input of the i-th block with tokens instead, [B, 1+K+P, D]."""
        x = x.float()
        for i, b in enumerate(self.blocks):
            fresh = self.F_v(self.R, i).float()  # [K, D]
            x = insert(x, fresh) if i == 0 else mix(x, fresh, self.beta)  # [B, 1+K+P, D]
            if i == stop:
                return x
            rows = slice(0, 1 + K) if b == self.blocks[-1] else None
            x = self.clip.visual.run_blocks(x, b, b + 1, attn_mask=self.mask(i), rows=rows)
        return x

    def image_features(self, x):
        """f_cls [B, E]: CLS through the frozen ln_post and proj; f_attr [B, K, E]: the tokens
        through P_attr."""
        f_cls = self.clip.visual.head(x[:, 0])
        f_attr = self.clip.visual.ln_post(x[:, 1 : 1 + K]) @ self.attr_proj().to(x.dtype)
        return F.normalize(f_cls, dim=-1), F.normalize(f_attr, dim=-1)

    def text_features_plain(self, classnames, template):
        """The text side, stated plainly: t [C, E]. Every prompt runs whole; from block J the K
        tokens sit right after SOT (inserted at J, mixed after it, as in the image tower); the
        causal mask grows by K, so the tokens see SOT and the words see the tokens; each prompt is
        read at its EOT, K positions later (the padding after the longest prompt's EOT, which no
        position reads, is left out). encode_classes computes the same, faster."""
        m = self.clip
        tokens = clip.tokenize([template.format(c) for c in classnames], m.context_length)
        tokens = tokens[:, : tokens.argmax(-1).max() + 1].to(self.w.device)  # [C, T]
        x = m.run_text_blocks(m.embed_text(tokens), 0, self.text_blocks.start)  # [C, T, W]
        for i, b in enumerate(self.text_blocks):
            fresh = self.F_t(self.R, i)  # [K, W]
            x = insert(x, fresh) if i == 0 else mix(x, fresh, self.beta)  # [C, T+K, W]
            x = m.run_text_blocks(x, b, b + 1)  # the causal mask over T+K positions
        return F.normalize(m.text_head(x, tokens.argmax(-1) + K), dim=-1)  # EOT: the largest id

    # The fast form: the same computation, faster (the tests compare the two; BENCH.md gives each
    # shortcut's share of a training step's FLOPs):
    # - blocks 1..J-1 and t^0 run once per class list (set_classes), not once per step;
    # - the prompts' shared start (SOT and the template's first words) runs once per block: causal,
    #   it sees only itself, so its states are equal in every prompt;
    # - prompts run in groups of similar length, each padded only to its longest
    #   (clip.model.length_buckets), and the last block computes only the EOT rows (in the image
    #   tower, token_blocks: only CLS and the tokens).

    def set_classes(self, classnames, template):
        """Once per class list: self.prompts (the prompts' states at block J's input, in length
        groups after their shared start) and self.t0 [C, E] (frozen CLIP's class features)."""
        m = self.clip
        try:
            tokens = clip.tokenize([template.format(c) for c in classnames], m.context_length)
        except RuntimeError as e:  # OpenAI's error for a prompt longer than the context
            raise UserError(f"{e}: shorten the class name or the template") from None
        tokens = tokens.to(self.w.device)  # [C, T]
        eot = tokens.argmax(-1)  # [C]: EOT has the largest id
        same = (tokens == tokens[:1]).all(0).long().cumprod(0)  # [T]: 1 while every prompt agrees
        S = min(int(same.sum()), int(eot.min()))  # the shared start, never past an EOT
        J = self.text_blocks.start
        groups = []
        t0 = []
        with torch.no_grad():
            for n, idx, rows, pick in clip.model.length_buckets(eot):  # idx[i]'s EOT: rows[pick[i]]
                x = m.run_text_blocks(m.embed_text(tokens[idx, : n + 1]), 0, J)  # [c, n + 1, W]
                frozen = m.run_text_blocks(x, J, self.text_blocks.stop, rows=rows)  # [c, r, W]
                t0.append(m.text_head(frozen, pick))  # [c, E]
                groups.append(PromptGroup(x[:, S:], rows - S, pick, idx))
        order = torch.cat([g.classes for g in groups]).argsort()
        self.prompts = Prompts(x[:1, :S], groups, order)
        self.t0 = F.normalize(torch.cat(t0)[order], dim=-1)  # [C, E]

    def encode_classes(self):
        """t [C, E]: text_features_plain's, from set_classes' prompts."""
        if not self.use_tokens:
            return self.t0
        m, p = self.clip, self.prompts
        shared = p.shared
        states = [g.states for g in p.groups]
        for i, b in enumerate(self.text_blocks):
            fresh = self.F_t(self.R, i).to(shared.dtype)  # [K, W]
            shared = insert(shared, fresh) if i == 0 else mix(shared, fresh, self.beta)  # [1,S+K,W]
            last = b == self.text_blocks[-1]
            states = [m.run_text_blocks(x, b, b + 1, rows=g.eot_rows if last else None, past=shared)
                      for x, g in zip(states, p.groups)]
            if not last:
                shared = m.run_text_blocks(shared, b, b + 1)
        t = torch.cat([m.text_head(x, g.pick) for x, g in zip(states, p.groups)])  # group order
        return F.normalize(t[p.order], dim=-1)  # [C, E]


class PromptGroup(NamedTuple):
    """Prompts of similar length, padded to the group's longest."""

    states: torch.Tensor  # [c, n, W]: block J's input after the shared start
    eot_rows: torch.Tensor  # [r]: the group's distinct EOT positions in states (the rows read)
    pick: torch.Tensor  # [c]: each prompt's EOT among eot_rows
    classes: torch.Tensor  # [c]: which classes these prompts are


class Prompts(NamedTuple):
    """What set_classes computes once for a class list."""

    shared: torch.Tensor  # [1, S, W]: block J's input at the first S positions, the same in each
    groups: list  # [PromptGroup]
    order: torch.Tensor  # [C]: the groups' prompts back in class order


# 4. Logits, fusion and loss, in fp32 outside autocast: logits are ~100 cos, where bf16 steps of
# 0.125-0.25 would tie or flip close classes


def cosine_logits(feats, t, logit_scale):
    """s cos(f, t) [B, S, C] with s = exp(logit_scale); feats [B, S, E], t [C, E]. Returns the
    logits and both features, normalised."""
    with torch.autocast(feats.device.type, enabled=False):
        feats = F.normalize(feats.float(), dim=-1)
        t = F.normalize(t.float(), dim=-1)
        return logit_scale.float().exp() * feats @ t.t(), feats, t


def fuse(logits, alpha):
    """sum_k alpha_k logits_k [B, C] of the six logit sets [B, 1+K, C]."""
    with torch.autocast(logits.device.type, enabled=False):
        return torch.einsum("k,bkc->bc", alpha.float(), logits.float())


def dear_loss(out, labels, t0, alpha, lambda_reg, lambda_fusion):
    """CE(fused, y) + lambda_reg [(1 - cos(f_cls, f^0)) + (1 - cos(t, t^0))]
    + lambda_fusion (-log alpha_cls)."""
    with torch.autocast(labels.device.type, enabled=False):
        ce = F.cross_entropy(out["fused"].float(), labels)
        reg_img = 1 - F.cosine_similarity(out["f_cls"].float(), out["f0"].float(), dim=-1).mean()
        reg_txt = 1 - F.cosine_similarity(out["t"].float(), t0.float(), dim=-1).mean()
        fusion = -alpha[0].float().log()
        total = ce + lambda_reg * (reg_img + reg_txt) + lambda_fusion * fusion
    parts = {"ce": ce, "reg_img": reg_img, "reg_txt": reg_txt, "fusion": fusion}
    return total, {k: v.detach() for k, v in parts.items()}


# 5. The recipe: a field left None takes its default from these tables (resolve); yunncheng/MMRL at
# 27d8821

# (beta, lambda_reg) per dataset, base-to-novel and few-shot: MMRL++'s table (trainers/config.py);
# (0.9, 1.0) elsewhere
DATASET_DEFAULTS = {
    "imagenet": (0.9, 0.2), "fgvc_aircraft": (0.9, 2.0), "ucf101": (0.9, 3.0), "dtd": (0.9, 7.0),
    "oxford_pets": (0.7, 0.01), "stanford_cars": (0.7, 6.0), "caltech101": (0.6, 3.0),
    "sun397": (0.5, 3.0), "oxford_flowers": (0.4, 7.0), "eurosat": (0.2, 0.01),
    "food101": (0.1, 1.0)}
XD_DEFAULTS = (0.9, 0.1)  # the ImageNet source of xd and domain generalisation (MMRL++, task CD)
# MMRL++'s test-time beta per xd target (task CD); --target-beta source uses the source's instead
XD_TARGET_BETA = {
    "imagenetv2": 0.9, "imagenet_r": 0.9, "imagenet_a": 0.8, "imagenet_sketch": 0.7,
    "fgvc_aircraft": 0.9, "ucf101": 0.9, "sun397": 0.7, "oxford_pets": 0.6, "caltech101": 0.6,
    "dtd": 0.5, "oxford_flowers": 0.4, "stanford_cars": 0.3, "eurosat": 0.3, "food101": 0.3}
# (epochs, batch, warm-up epochs, lr), a published config per row: b2n MMRL's vit_b16 (ImageNet:
# vit_b16_imagenet); fewshot MMRL++'s vit_b16_few_shot, tuned with the table above; xd MMRL's
# vit_b16_cross_datasets; the toy world: the epochs that fit it
SCHEDULES = {
    "b2n": (10, 4, 1, 1e-3),
    ("b2n", "imagenet"): (5, 32, 1, 1e-3),
    ("b2n", "toyworld"): (20, 4, 1, 1e-3),
    "fewshot": (100, 32, 1, 2e-3),
    ("fewshot", "imagenet"): (5, 32, 1, 1e-3),
    ("fewshot", "toyworld"): (50, 32, 1, 1e-3),
    "xd": (1, 32, 0, 1e-3)}
# vision blocks of OpenAI's ViTs (openai/CLIP model-card.md): J's default before a checkpoint loads
DEPTHS = {"ViT-B/32": 12, "ViT-B/16": 12, "ViT-L/14": 24, "ViT-L/14@336px": 24}

TEXT = data.text  # a path, a name, a list: never empty
SEED = data.number(int, lambda v: 0 <= v < 2**32, "a seed in [0, 2^32)")
CROP = data.number(float, lambda v: 0 < v <= 1, "in (0, 1]")
UNIT = data.number(float, lambda v: 0 <= v <= 1, "in [0, 1]")
OPEN = data.number(float, lambda v: 0 < v < 1, "in (0, 1)")
NONNEG = data.number(float, lambda v: v >= 0, "a number >= 0")
RATE = data.number(float, lambda v: v > 0, "a number > 0")


def opt(default, help, type=TEXT, choices=None, kind="variant", **kw):
    """A Config field: its flag's help, type and choices, and its kind: "run" (names the run:
    recorded, part of the folder's path), "variant" (recorded; names the folder's variant when not
    at the dataset's default) or "place" (where or how fast it runs: changes no result, so it is not
    recorded)."""
    metadata = dict(help=help, type=type, choices=choices, kind=kind, **kw)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class Config:
    dataset: str = opt("eurosat", "a data.py name (toyworld: offline), or folder:PATH", kind="run")
    root: str = opt(data.DEFAULT_ROOT, "the datasets (default: $DATA, else data)", kind="place")
    protocol: str = opt("b2n", "base-to-novel, few-shot, or cross-dataset (train, then --targets)",
                        choices=("b2n", "fewshot", "xd"), kind="run")
    method: str = opt("dear", "or zero-shot CLIP", choices=("dear", "zeroshot"), kind="run")
    shots: int = opt(16, "training images per class", data.POSITIVE, kind="run")
    seed: int = opt(1, "seed of the few-shot subset and the run", SEED, kind="run")
    backbone: str = opt(None, "ViT-B/16 (default; toyworld: toy), -B/32, -L/14(@336px), a file")
    targets: list = opt(None, "xd targets, comma-separated or repeated (default: ImageNet's 4 "
                        "variants and the other 10 datasets)", action="append", kind="run")
    out: str = opt("runs", "output root; every run gets its own folder", kind="place")
    J: int = opt(None, "tokens enter block J, from 1 (default: the last third)", data.POSITIVE)
    beta: float = opt(None, "token mixing (default: MMRL++'s table, else 0.9)", UNIT)
    lambda_reg: float = opt(None, "default: MMRL++'s table, else 1.0; xd source 0.1", NONNEG)
    lambda_fusion: float = opt(1.0, "weight of -log alpha_cls", NONNEG)
    alpha_cls: float = opt(0.7, "initial alpha_cls (each token: (1 - alpha_cls) / 5)", OPEN)
    rep_dim: int = opt(512, "width of the shared token matrix R", data.POSITIVE)
    tokens: str = opt("mmrlpp", "MMRL++'s (a shared aligner + rank-4 residuals, P_attr = proj + "
                      "rank 64) or MMRL's (full ones)", choices=("mmrlpp", "mmrl"))
    mask: str = opt("role", "per-head mask", choices=("role", "generalization-only", "none"))
    attr_tokens: bool = opt(True, "no attribute tokens (frozen CLIP)", flag="--no-attr-tokens")
    novel_logits: str = opt("fused", "novel, xd targets (cls: MMRL's)", choices=("fused", "cls"))
    target_beta: str = opt("table", "xd targets: MMRL++'s beta", choices=("table", "source"))
    roles: str = opt(None, "roles JSON written by entropy.py (default: computed once, cached)")
    roles_control: str = opt("none", "random: each block's shuffled", choices=("none", "random"))
    epochs: int = opt(None, "default: b2n 10 (ImageNet 5, toy 20), fewshot 100 (ImageNet 5, toy "
                      "50), xd 1", data.POSITIVE)
    batch_size: int = opt(None, "default: 4 (b2n), 32 (ImageNet b2n, fewshot, xd)", data.POSITIVE)
    warmup_epochs: int = opt(None, "epochs at --warmup-lr first (default 1; xd 0)", data.COUNT)
    lr: float = opt(None, "AdamW lr (default: 1e-3; fewshot 2e-3, ImageNet fewshot 1e-3)", RATE)
    warmup_lr: float = opt(1e-5, "learning rate of the warm-up epochs", RATE)
    weight_decay: float = opt(5e-4, "AdamW weight decay", NONNEG)
    crop_scale: float = opt(None, "smallest area of a training crop (default 0.5, toy 1)", CROP)
    eval_batch_size: int = opt(100, "evaluation batch size", data.POSITIVE, kind="place")
    workers: int = opt(None, "loader processes (default: up to 4)", data.COUNT, kind="place")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N", kind="place")
    precision: str = opt("amp", "amp: fp16 + GradScaler on CUDA, fp32 on a CPU (MMRL's); the head "
                         "and the loss in fp32 always", choices=("amp", "fp16", "bf16", "fp32"))
    eval_precision: str = opt("fp32", "as MMRL's test()", choices=("fp32", "fp16", "bf16"))
    eval_only: bool = opt(False, "evaluate the run in --load (into RUN/eval/)", kind="run")
    load: str = opt(None, "a finished run folder", kind="place")
    resume: bool = opt(False, "continue an interrupted run from its last epoch", kind="place")
    force: bool = opt(False, "redo a finished run, or restart an interrupted one", kind="place")
    roles_only: bool = opt(False, "only the head roles, into OUT/roles/J<J>/", kind="place")


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
RECORDED = [n for n, f in FIELDS.items() if f.metadata["kind"] != "place"]  # config.json's config
GROUPS = {"J": "the method", "epochs": "optimisation", "eval_only": "runs"}  # --help: from each
# what a value of each field may be: its flag's type, choices or true/false; resolve fills every
# None but roles's; CONFIG: a recorded config's schema (runs.read_config, runs.read_results)
SCHEMA = {n: bool if f.type is bool else tuple(f.metadata["choices"] or ()) or f.metadata["type"]
          for n, f in FIELDS.items()}
SCHEMA["targets"] = [TEXT]
CONFIG = {n: (SCHEMA[n], None) if n == "roles" else SCHEMA[n] for n in RECORDED}


def flag(name):
    return FIELDS[name].metadata.get("flag", "--" + name.replace("_", "-"))


def parse_args(argv=None):
    """(the Config of a command line, the flags given: {field: flag}). Every default is
    argparse's SUPPRESS, so the namespace holds exactly what was given, whatever its value."""
    parser = data.Parser(description="DeAR: adapt CLIP with attribute tokens and role-based masks.",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=__doc__[__doc__.index("examples:") :])
    group = parser.add_argument_group("what to run")
    for name, f in FIELDS.items():
        m = {k: v for k, v in f.metadata.items() if k not in ("flag", "kind")}
        if name in GROUPS:
            group = parser.add_argument_group(GROUPS[name])
        if f.type is bool:
            m = dict(help=m["help"], action="store_false" if f.default else "store_true")
        elif f.default is not None and "default" not in m["help"]:
            m["help"] += f" (default: {f.default})"
        group.add_argument(flag(name), dest=name, default=argparse.SUPPRESS, **m)
    given = vars(parser.parse_args(argv))
    return Config(**given), {name: flag(name) for name in given}


def resolve(cfg: Config) -> Config:
    """The final config: every value checked (a Config built in code too), every None filled from
    the tables, J from the backbone's depth, the device and amp's precision from this machine."""
    for name, f in FIELDS.items():  # as its flag would take it (None: a default still to fill)
        value = getattr(cfg, name)
        wrong = data.mismatch(value, SCHEMA[name], flag(name))
        if wrong and not (value is None and f.default is None):
            raise UserError(wrong)
    c = dataclasses.replace(cfg)
    c.backbone = c.backbone or ("toy" if c.dataset == "toyworld" else "ViT-B/16")
    beta, lam = XD_DEFAULTS if c.protocol == "xd" else DATASET_DEFAULTS.get(c.dataset, (0.9, 1.0))
    epochs, batch, warmup, lr = SCHEDULES.get((c.protocol, c.dataset), SCHEDULES[c.protocol])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    crop = 1.0 if c.dataset == "toyworld" else 0.5
    defaults = dict(beta=beta, lambda_reg=lam, epochs=epochs, batch_size=batch,
                    warmup_epochs=warmup, lr=lr, crop_scale=crop, workers=min(4, cpus))
    for name, value in defaults.items():
        if getattr(c, name) is None:
            setattr(c, name, value)
    depth = backbone_depth(c.backbone)
    c.J = c.J or default_J(depth)
    if c.J > depth:
        raise UserError(f"--J {c.J}: {c.backbone} has {depth} blocks")
    c.targets = [t for v in c.targets or [] for t in ([v] if v.startswith("folder:")
                                                      else v.split(","))]
    if c.protocol == "xd" and not c.targets:
        c.targets = [t for t in data.DG_TARGETS + data.B2N_DATASETS if t != c.dataset]
    again = [t for t in c.targets if not t.strip() or t == c.dataset or c.targets.count(t) > 1]
    if again:
        raise UserError(f"--targets {','.join(c.targets)}: {again[0]!r} is empty, the source or "
                        "named twice; each target once, not the source")
    c.device = runs.device(c.device, bf16="bf16" in (c.precision, c.eval_precision))
    if c.precision == "amp":  # MMRL's PREC "amp": fp16 with a GradScaler on CUDA, fp32 on a CPU
        c.precision = "fp16" if c.device.startswith("cuda") else "fp32"
    return c


@functools.lru_cache
def backbone_depth(backbone):
    """The vision tower's blocks: OpenAI's ViTs and the toy by their sizes, a file as loaded."""
    depths = {**DEPTHS, toyworld.BACKBONE: toyworld.TOY_CONFIG["vision_layers"]}
    return depths.get(backbone) or runs.load_backbone(backbone, "cpu").visual.transformer.layers


def default_J(num_layers):
    """Tokens in the last third of the blocks, as DeAR's 9..12 of 12: ViT-L/14 17..24, toy 3..4."""
    return num_layers - math.ceil(num_layers / 3) + 1


def eval_beta(c: Config, dataset):
    """An evaluation's beta: the run's, except on xd targets (MMRL++'s test-time beta, where its
    table has one)."""
    if c.protocol != "xd" or dataset == c.dataset or c.target_beta == "source":
        return c.beta
    return XD_TARGET_BETA.get(dataset, c.beta)


def changed_flags(c: Config):
    """The recorded flags of the run's kind that differ from the dataset's defaults (and a backbone
    that is not the dataset's): its variant, in its folder's name."""
    base = resolve(Config(c.dataset, protocol=c.protocol, backbone=c.backbone, device=c.device))
    changed = {n: getattr(c, n) for n, f in FIELDS.items() if f.metadata["kind"] == "variant"
               and runs.reads(c.method, n) and getattr(c, n) != getattr(base, n)}
    if c.backbone != resolve(Config(dataset=c.dataset)).backbone:
        changed = {"backbone": c.backbone, **changed}
    return changed


# 6. Training, MMRL's protocol

AMP = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def lr_at(epoch, c: Config):
    """Epoch e from 0: warmup_lr for e < W, then lr (1 + cos(pi (e - W) / E)) / 2, as Dassl,
    stepped per epoch."""
    if epoch < c.warmup_epochs:
        return c.warmup_lr
    return c.lr * (1 + math.cos(math.pi * (epoch - c.warmup_epochs) / c.epochs)) / 2


def seed_of(*parts):
    """A 64-bit seed of its parts (the run's seed, the epoch, an image): any seed, no overflow."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


class SeededImages(data.ImageList):
    """Each image's augmentation from a seed of its own (the loader hands it over): none depends
    on --workers."""

    def __getitem__(self, item):
        i, seed = item
        torch.default_generator.manual_seed(seed)  # the CPU's only (torch.manual_seed: CUDA's too)
        return super().__getitem__(i)


def batches(n, epoch, c: Config):
    """An epoch's batches of (image, its seed), shuffled by (seed, epoch); Dassl drops the last
    incomplete batch."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed_of(c.seed, epoch)))
    pairs = [(i, seed_of(c.seed, epoch, i)) for i in order.tolist()]
    steps = max(1, n // c.batch_size)
    return [pairs[s * c.batch_size : (s + 1) * c.batch_size] for s in range(steps)]


def train(model, ds, c: Config, folder):
    """Train on ds.train, a checkpoint at each epoch's end: --resume ends with exactly an
    uninterrupted run's weights. Returns what results.json records of it."""
    device = torch.device(c.device)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        folder.log("no trainable parameters (no attribute tokens): the model is frozen CLIP")
        return {"steps": 0, "trainable": 0}
    trainable = sum(p.numel() for p in params)
    folder.log(f"train: {len(ds.train)} images, {len(ds.classnames)} classes, {c.epochs} epochs, "
               f"batch {c.batch_size}, beta {c.beta}, lambda_reg {c.lambda_reg}, J {c.J}, tokens "
               f"{c.tokens}: {trainable:,} trainable values")
    model.set_classes(ds.classnames, ds.template)
    amp = AMP[c.precision]
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay, fused=cuda)
    scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)  # skips fp16 overflows
    start = folder.resume(model, opt, scaler, c.precision, c.epochs)  # 0: no checkpoint.pt there
    images = SeededImages(ds.train, data.train_transform(model.clip.visual.input_resolution,
                                                         c.crop_scale))
    steps = max(1, len(images) // c.batch_size)
    progress = runs.Progress(folder.log, c.epochs, steps, start, opt, c.precision)
    for epoch in range(start, c.epochs):
        for g in opt.param_groups:
            g["lr"] = lr_at(epoch, c)
        loader = torch.utils.data.DataLoader(images, batch_sampler=batches(len(images), epoch, c),
                                             num_workers=c.workers, pin_memory=cuda)
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
            progress.step(epoch, step, loss, parts["ce"], lr_at(epoch, c), scaler.is_enabled())
        folder.checkpoint(model, opt, scaler, epoch + 1, c.precision)
    return {"steps": progress.done, "skipped_steps": progress.skipped(c.epochs * steps),
            "trainable": trainable}


# 7. Evaluation: the accuracy a run reports, and the readouts that say which side moved

READOUTS = ("fused", "class", "image", "text")  # the accuracies evaluate records


def evaluate(model, ds, split, c: Config, rule="fused", log=print):
    """One split's evaluation record: top-1 accuracy (%) of the fused (or class) logits, overall
    and per class, in fp32 as MMRL's test() by default, at the split's beta (eval_beta); and in the
    same pass the readouts, the accuracy of: fused; class (the class logits alone); image (the
    trained image feature f_cls against frozen CLIP's class features t^0: the image side alone);
    text (frozen CLIP's image feature f^0 against the trained class features t: the text side
    alone)."""
    device = torch.device(c.device)
    model.beta = eval_beta(c, ds.name)  # xd targets: MMRL++'s test-time beta
    model.eval().set_classes(ds.classnames, ds.template)
    amp = AMP[c.eval_precision]
    images = data.ImageList(ds.test, clip.transform(model.clip.visual.input_resolution))
    loader = torch.utils.data.DataLoader(images, batch_size=c.eval_batch_size,
                                         num_workers=c.workers, pin_memory=device.type == "cuda")
    correct = torch.zeros(len(ds.classnames), dtype=torch.long, device=device)  # per true class
    count = torch.zeros_like(correct)
    right = torch.zeros(len(READOUTS), dtype=torch.long, device=device)
    t_start = time.time()
    with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        t = model.encode_classes()  # [C, E], once for the whole evaluation
        for i, (x, y) in enumerate(loader):
            out = model(x.to(device, non_blocking=True), t=t, with_frozen=True)
            y = y.to(device)
            scores = torch.stack([out["fused"], out["logits"][:, 0], out["f_cls"] @ model.t0.t(),
                                  out["f0"] @ out["t"].t()])  # [4, B, C]: READOUTS' order
            hits = scores.argmax(-1) == y  # [4, B]
            right += hits.sum(1)
            correct.index_add_(0, y, hits[0 if rule == "fused" else 1].long())
            count.index_add_(0, y, torch.ones_like(y))
            if (i + 1) % 50 == 0:
                eta = (time.time() - t_start) / (i + 1) * (len(loader) - i - 1)
                log(f"  eval {ds.name}/{split}: {i + 1}/{len(loader)} batches, eta {eta:.0f}s")
    correct, count = correct.tolist(), count.tolist()
    n = max(1, sum(count))
    beta = model.beta if model.use_tokens else None  # zero-shot CLIP has no tokens to mix
    r = dict(dataset=ds.name, split=split, beta=beta, accuracy=100.0 * sum(correct) / n,
             n=sum(count), logits=rule, precision=c.eval_precision,
             per_class=[{"class": k, "accuracy": 100.0 * a / max(1, m), "n": m}
                        for k, a, m in zip(ds.classnames, correct, count)],
             readouts={k: 100.0 * v / n for k, v in zip(READOUTS, right.tolist())})
    how = f"{rule} logits, beta {beta}" if model.use_tokens else "zero-shot CLIP"
    seen = ", ".join(f"{k} {v:.2f}" for k, v in r["readouts"].items())
    log(f"{ds.name} {split}: {r['accuracy']:.2f}% of {r['n']} ({how}); readouts {seen}")
    return r


# 8. The run (its folder and records: runs.py) and the command line


def build(c: Config, log, roles_file=None, trained=None):
    """The DeAR model of a final config, on c.device, and the roles file it masks with (None:
    no mask): the backbone; the roles (roles_file, --roles, or entropy.py's, computed once and
    cached); trained: a model.pt to load."""
    device = torch.device(c.device)
    clip_model = runs.load_backbone(c.backbone, device, log)
    L = clip_model.visual.transformer.layers
    roles = None
    if c.method == "dear" and c.attr_tokens and c.mask != "none":
        roles_file = roles_file or c.roles or compute_roles(c, clip_model, log)
        heads = clip_model.visual.transformer.heads
        roles = entropy.load_roles(roles_file, L, heads, list(range(c.J, L + 1)), clip_model.sha256)
        roles = entropy.control_roles(roles, c.roles_control, c.seed)
    torch.manual_seed(c.seed)  # the tokens' initialisation
    model = DeAR(clip_model, roles, c.J, c.beta, c.rep_dim, c.mask, c.method == "dear" and
                 c.attr_tokens, c.alpha_cls, c.tokens).to(device)
    if trained:
        model.load_trainable(data.read_torch(trained, "run it again (--force)", dict), trained)
    return model, roles_file if roles is not None else None


def compute_roles(c: Config, clip_model, log):
    """Concept Entropy's roles file for blocks J..L, computed once and cached: on ImageNet's test
    images if ImageNet is under --root (as TextSpan), else on the run's own training images (never
    its test images)."""
    imagenet = os.path.isdir(data.dataset_folder("imagenet", c.root))
    probe, split = ("imagenet", "test") if imagenet else (c.dataset, "train")
    layers = list(range(c.J, clip_model.visual.transformer.layers + 1))
    log(f"head roles of {c.backbone}, blocks {layers[0]}..{layers[-1]}: probe {probe} {split}")
    return entropy.run(clip_model, probe, c.root, layers, split=split, log=log, workers=c.workers)


def read_datasets(c: Config):
    """(the training set, [(dataset, split, logits rule)] to evaluate): every split (and a --roles
    file) is read before anything is loaded or written, so that a bad one stops the call here."""
    if c.roles and not c.eval_only:  # --eval-only: the run's own; load_roles: its fit to the model
        entropy.read_roles(c.roles)
    if c.dataset == "toyworld":
        toyworld.ensure_dataset(c.root)
    if c.protocol == "b2n":
        base = data.build_dataset(c.dataset, c.root, c.shots, c.seed, "base")
        novel = data.build_dataset(c.dataset, c.root, c.shots, c.seed, "novel")
        return base, [(base, "base", "fused"), (novel, "novel", c.novel_logits)]
    source = data.build_dataset(c.dataset, c.root, c.shots, c.seed)
    targets = [(data.build_dataset(t, c.root), "all", c.novel_logits) for t in c.targets]
    return source, [(source, "all", "fused")] + targets


def load_run(run, c: Config, log):
    """A finished run's model, rebuilt with its own roles.json and model.pt, once the backbone, the
    roles and the weights are those it recorded (runs.check_use); with the roles file and the
    run's config.json."""
    own = os.path.join(run, "roles.json")
    weights = os.path.join(run, "model.pt") if c.method == "dear" else None
    model, roles = build(c, log, own if os.path.lexists(own) else None, weights)
    now = {"backbone_sha256": model.clip.sha256, "roles_sha256": roles and data.sha256_file(roles),
           "model_sha256": weights and data.sha256_file(weights)}
    return model, roles, runs.check_use(run, CONFIG, now)


def settings(cfg: Config, given=()):
    """The final config of a call: each flag given that the call does not read refused; under
    --eval-only every recorded setting but those it reads taken from the run in --load."""
    call = "roles-only" if cfg.roles_only else "eval-only" if cfg.eval_only else cfg.method
    runs.refuse_unread(call, dict(given), cfg.protocol, RECORDED)
    if cfg.eval_only and not cfg.load:
        raise UserError("--eval-only needs --load RUN, a finished run folder")
    carried = runs.read_config(cfg.load, CONFIG)["config"] if cfg.eval_only else {}
    carried = {k: v for k, v in carried.items() if not runs.reads("eval-only", k)}
    return resolve(dataclasses.replace(cfg, **carried))


def run(cfg: Config, given=()):
    """One run: train (unless zero-shot or --eval-only), evaluate each split, write results.json;
    returns the results. given: the flags the user gave (parse_args)."""
    c = settings(cfg, given)
    train_set, evals = read_datasets(c)
    changed = changed_flags(c)
    path, variant = runs.run_dir(c, changed)
    with runs.RunFolder(path, c.load if c.eval_only else c.out, c.force, c.resume) as folder:
        if c.eval_only:
            model, roles, _ = load_run(c.load, c, folder.log)
        else:  # --resume: with the run's own copy of its roles
            own = folder.file("roles.json")
            model, roles = build(c, folder.log, own if c.resume and os.path.lexists(own) else None)
        items = [train_set.train] + [(ds.name, ds.test, ds.template) for ds, _, _ in evals]
        inputs = runs.inputs(data.dataset_folder(c.dataset, c.root), items, model.clip.sha256,
                             roles)
        record = {"config": {n: getattr(c, n) for n in RECORDED}, "inputs": inputs,
                  "env": folder.env}
        done = folder.finished(record, CONFIG)
        if done:
            print(f"done already: {folder.file('results.json')} (--force redoes it)")
            return done
        classes = [k for ds, split, _ in evals if ds is train_set or split == "novel"
                   for k in ds.classnames]  # base and novel: what predict names
        folder.begin(record, roles, model, classes, train_set.template)
        if roles:
            report(model, c, folder.path)
        t0 = time.time()
        stats = None
        weights = os.path.join(c.load, "model.pt") if c.eval_only and c.method == "dear" else None
        if c.method == "dear" and not c.eval_only:
            stats = train(model, train_set, c, folder)
            weights = data.write_torch(folder.file("model.pt"), model.trainable_state())
        t1 = time.time()
        warnings = list(dict.fromkeys(w for ds, _, _ in evals for w in ds.warnings))
        results = {**record, "variant": variant, "changed": changed, "train": stats,
                   "train_shots": train_set.shots_per_class, "warnings": warnings,
                   "model_sha256": weights and data.sha256_file(weights)}
        results["evals"] = [evaluate(model, ds, split, c, rule, folder.log)
                            for ds, split, rule in evals]
        if c.protocol == "b2n":
            results["hm"] = runs.harmonic_mean(*(e["accuracy"] for e in results["evals"]))
            folder.log(f"HM {results['hm']:.2f}")
        if model.use_tokens:
            results["fusion_weights"] = dict(zip(("cls",) + ATTRIBUTES, model.alpha().tolist()))
        results["timing"] = {"train_s": t1 - t0, "eval_s": time.time() - t1}
        return folder.end(results)


def report(model, c: Config, folder):
    """Beside the roles.json in folder: roles.md, roles.png (entropy.write_report) and mask.png,
    the masks the model applies (none under --mask none)."""
    entropy.write_report(entropy.read_roles(os.path.join(folder, "roles.json")), folder)
    if model.masks is not None:
        entropy.draw_mask(model.masks, model.roles, c.J, c.mask, os.path.join(folder, "mask.png"))


def roles_only(c: Config):
    """The roles a run would mask with, copied from the cache into OUT/roles/J<J>/ (where tables.py
    reads them), with their report and mask.png."""
    dest = data.makedirs_below(c.out, os.path.join(c.out, "roles", f"J{c.J}"))  # before the work
    model, roles = build(c, print)
    data.atomic_write(os.path.join(dest, "roles.json"), functools.partial(shutil.copyfile, roles))
    report(model, c, dest)
    print(f"roles copied to {dest}")


def call(argv):
    cfg, given = parse_args(argv)
    if cfg.roles_only:
        return roles_only(settings(cfg, given))
    results = run(cfg, given)
    line = {e["dataset"] + "/" + e["split"]: round(e["accuracy"], 2) for e in results["evals"]}
    if "hm" in results:
        line["hm"] = round(results["hm"], 2)
    print(json.dumps(line))
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    again = "interrupted: the same command with --resume continues from the last finished epoch"
    return data.guarded(call, argv, interrupted=again)


if __name__ == "__main__":
    main()

"""DeAR: Fine-Grained VLM Adaptation by Decomposing Attention Head Roles (CVPR 2026).

A reference reproduction in plain PyTorch. This file is the method and its command line; read it top
to bottom:

  1. Attribute tokens: one shared matrix R, per-block aligners F_v / F_t, beta mixing
  2. role_mask: the role-based per-head attention mask of one vision block
  3. The DeAR module: frozen prefix, tokens from block J, f_cls / f_attr / t, six logits, fusion alpha
  4. The loss: CE on the fused logits + lambda_reg * self-regularisation + lambda_fusion * -log alpha_cls
  5. The command line: a Config (config.py) from the flags, handed to runs.run with the method

Layers, from the top: dear.py (the method, the CLI) -> runs.py (one run: its folder, what it reads,
results.json; the method is handed to it as `make_model` / `make_loss`) -> config.py (Config, the
per-dataset tables, resolve) -> train.py (MMRL's training loop and evaluation, nothing DeAR-specific)
and entropy.py (the head roles, Concept Entropy).

The paper counts blocks from 1 (J = 9: tokens enter block 9 of 12), and so do the flags and the roles
file. Code indexes blocks from 0: `DeAR.__init__` converts J once (`self.first = J - 1`), and
`block_masks` reads the 1-based roles with `roles[b + 1]`. Every design choice the paper leaves open is a
flag; see README.md, "Where this reproduction had to choose".
"""
import argparse
import copy
import dataclasses
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import clip
import data
import runs
import toyworld
from clip.model import length_buckets
from config import CHOICES, Config, data_root, resolve
from runs import run_dir  # noqa: F401  run_all.sh asks dear.py where a run writes (dear.run_dir)
from train import RunError

ATTRIBUTES = ("color", "shape", "texture", "object", "location")
K = len(ATTRIBUTES)  # number of attribute tokens, one per attribute, in this order

# ----------------------------------------------------------------------------------------------
# 1. Attribute tokens


class AttributeTokens(nn.Module):
    """The learnable attribute tokens: one shared matrix R [K, rep_dim] and, for every block l in J..L,
    a vision aligner F_v^l: rep_dim -> D and a text aligner F_t^l: rep_dim -> W.
    Vision and text tokens are projections of the same R, which couples the two modalities.
    As in MMRL, one aligner of each kind is initialised and copied to every block: all F_v^l start identical,
    and so do all F_t^l (they are trained apart)."""

    def __init__(self, n_blocks: int, rep_dim: int, vision_width: int, text_width: int):
        super().__init__()
        self.R = nn.Parameter(torch.randn(K, rep_dim) * 0.02)
        F_v, F_t = nn.Linear(rep_dim, vision_width), nn.Linear(rep_dim, text_width)  # nn.Linear's default init
        self.F_v = nn.ModuleList([copy.deepcopy(F_v) for _ in range(n_blocks)])
        self.F_t = nn.ModuleList([copy.deepcopy(F_t) for _ in range(n_blocks)])

    def vision(self, i: int) -> torch.Tensor:
        return self.F_v[i](self.R)  # [K, D]: the tokens fed to the i-th block after insertion

    def text(self, i: int) -> torch.Tensor:
        return self.F_t[i](self.R)  # [K, W]


def insert(x: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Put the K tokens right after the first token (CLS, or SOT on the text side): [B, 1 + K + rest, D]."""
    return torch.cat([x[:, :1], fresh.unsqueeze(0).expand(x.shape[0], -1, -1), x[:, 1:]], dim=1)


def mix(x: torch.Tensor, fresh: torch.Tensor, beta: float) -> torch.Tensor:
    """beta mixing of the token slots x[:, 1:1+K]: beta * F^l(R) + (1 - beta) * (their output of block l-1).
    x: [B, L, D]; fresh: [K, D]. Returns a new tensor (no in-place write, autograd stays simple)."""
    tokens = beta * fresh.unsqueeze(0) + (1.0 - beta) * x[:, 1:1 + K]  # [B, K, D]
    return torch.cat([x[:, :1], tokens, x[:, 1 + K:]], dim=1)


# ----------------------------------------------------------------------------------------------
# 2. The role-based attention mask


def role_mask(head_roles, num_patches: int, variant: str = "role") -> torch.Tensor:
    """The additive mask [H, L, L] of one vision block, L = 1 + K + num_patches, token order
    [CLS, attr_1..attr_K, patches]; row = query, column = key; 0 = allowed, -inf = blocked.

    - generalization head (and an "other specialist": a low-entropy head whose concept is not one of the
      five): the originals (CLS, patches) and the attribute tokens never see each other; each attribute
      token sees only itself. These heads compute exactly what the frozen CLIP computes.
    - attribute head for attribute a: originals <-> attr_a both ways; every other attribute token sees only
      itself and nobody sees it.
    - mixed head: no restriction.
    variant "generalization-only": attribute heads act as mixed; "none": no mask at all (all zeros).
    """
    H, L = len(head_roles), 1 + K + num_patches
    allowed = torch.ones(H, L, L, dtype=torch.bool)
    attr = torch.arange(1, 1 + K)                   # positions of the attribute tokens
    orig = torch.tensor([0] + list(range(1 + K, L)))  # CLS and patches
    eye = torch.eye(K, dtype=torch.bool)
    for h, entry in enumerate(head_roles):
        role = entry["role"]
        if variant == "none" or role == "mixed" or (variant == "generalization-only" and role == "attribute"):
            continue
        a = allowed[h]
        a[attr[:, None], :] = False                  # attribute rows: nothing ...
        a[:, attr] = False                           # ... and attribute columns: nobody,
        a[attr[:, None], attr[None, :]] = eye        # except each token itself.
        if role == "attribute":
            i = 1 + ATTRIBUTES.index(entry["attribute"])
            a[i, orig] = True                        # attr_a reads the originals
            a[orig, i] = True                        # the originals read attr_a
    mask = torch.zeros(H, L, L)
    return mask.masked_fill(~allowed, float("-inf"))


def block_masks(roles, first: int, num_layers: int, num_patches: int, variant: str):
    """One [H, L, L] mask per block first..num_layers-1 (0-based), or None where nothing is masked."""
    if variant == "none":
        return [None] * (num_layers - first)
    return [role_mask(roles[b + 1], num_patches, variant) for b in range(first, num_layers)]  # roles: 1-based


# ----------------------------------------------------------------------------------------------
# 3. The DeAR module


class DeAR(nn.Module):
    """Frozen CLIP + attribute tokens from block J + role masks + a trainable P_attr + fusion weights w."""

    def __init__(self, clip_model, roles, J=9, beta=0.9, rep_dim=512, mask="role", attr_tokens=True,
                 alpha_cls=0.7):
        super().__init__()
        self.clip = clip_model.eval()
        for p in self.clip.parameters():
            p.requires_grad_(False)
        visual, L = clip_model.visual, clip_model.visual.transformer.layers
        if not 1 <= J <= L:
            raise ValueError(f"J must lie in 1..{L} (the backbone has {L} blocks), got {J}")
        self.J, self.first, self.L, self.beta, self.use_tokens = J, J - 1, L, beta, attr_tokens  # first: 0-based
        n = L - self.first  # blocks that carry tokens: J..L in the vision tower, the last n in the text tower
        self.Lt = clip_model.transformer.layers
        self.first_text = self.Lt - n  # equals J - 1 when both towers are equally deep (ViT-B)
        if self.first_text < 0:
            raise ValueError(f"J = {J} puts tokens in {n} blocks, but the text tower has only {self.Lt}")
        self.tokens = AttributeTokens(n, rep_dim, visual.transformer.width, clip_model.transformer.width)
        self.P_attr = nn.Parameter(visual.proj.detach().clone())  # [D, E], initialised as a copy of proj
        # fusion weights: alpha = softmax(w), initialised to alpha_cls for the class logits, the rest shared
        w = torch.tensor([alpha_cls] + [(1 - alpha_cls) / K] * K).log()
        self.w = nn.Parameter(w)
        masks = block_masks(roles, self.first, L, visual.num_patches, mask) if attr_tokens else [None] * n
        for i, m in enumerate(masks):  # buffers, so .to(device) moves them; not saved in checkpoints
            self.register_buffer(f"mask_{i}", m, persistent=False)
        if not attr_tokens:  # nothing but the fusion weights would remain: the model is frozen CLIP
            for p in self.trainable():
                p.requires_grad_(False)

    def trainable(self):
        return [p for name, p in self.named_parameters() if not name.startswith("clip.")]

    def trainable_state(self):
        return {k: v for k, v in self.state_dict().items() if not k.startswith("clip.")}

    def alpha(self) -> torch.Tensor:
        return self.w.softmax(0)  # [1 + K]: alpha_cls, alpha_color, ...

    def fusion_weights(self) -> dict:
        """alpha by name, as results.json records it: {"cls": .., "color": .., ...}."""
        return dict(zip(("cls",) + ATTRIBUTES, self.alpha().tolist()))

    def set_beta(self, beta: float):
        """The token mixing beta of the next forward passes (an evaluation may use another beta than training:
        the xd targets); nothing is rebuilt, encode_images / encode_classes read self.beta."""
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must lie in [0, 1], got {beta}")
        self.beta = float(beta)

    # --- text side -------------------------------------------------------------------------------
    @torch.no_grad()
    def set_classes(self, classnames, template):
        """Everything class-dependent that never changes: the text prefix (blocks 1..J-1 of every class
        prompt) and the frozen CLIP text features t^0. Computed once per class list.

        The prefix is kept in the form encode_classes runs fastest, with the same result:
        - text_shared [1, S, W]: the first S positions, whose token ids are the same in every prompt (SOT and
          the template's first words). Under the causal mask their states are the same for every class, so
          blocks J..L run them once, and every class attends to them.
        - text_groups: the rest of each prompt in groups padded to their longest (length_buckets; exact, causal):
          [(indices, [c, n, W], rows [r]: the group's EOT positions in x, pick [c]: each prompt's row in rows)].
        """
        prompts = [template.format(c.replace("_", " ")) for c in classnames]
        device = self.P_attr.device
        tokens = clip.tokenize(prompts, context_length=self.clip.context_length).to(device)  # [C, T]
        eot = tokens.argmax(-1)                                         # [C] EOT has the largest id
        same = (tokens == tokens[:1]).all(0).long().cumprod(0)          # [T] 1 while every prompt agrees
        S = min(int(same.sum()), int(eot.min()))                        # keep at least EOT per class
        groups, t0, order = [], [], []
        for n, idx, rows, pick in length_buckets(eot):                  # EOTs at rows [r] (<= n); pick [c]
            x = self.clip.run_text_blocks(self.clip.embed_text(tokens[idx, : n + 1]), 0, self.first_text)
            frozen = self.clip.run_text_blocks(x, self.first_text, self.Lt, rows=rows)  # [c, r, W]
            t0.append(self.clip.text_head(frozen, pick))                # [c, E]
            groups.append((idx, x[:, S:], rows - S, pick))              # [c, n + 1 - S, W], rows in x[:, S:]
            order.append(idx)
            self.text_shared = x[:1, :S]                                # [1, S, W], equal in every group
        self.text_groups = groups
        self.text_order = torch.cat(order).argsort()                    # group order -> class order
        self.t0 = F.normalize(torch.cat(t0)[self.text_order], dim=-1)  # [C, E]
        self.classnames = list(classnames)

    def encode_classes(self) -> torch.Tensor:
        """t_c: class text features with the text tokens inside blocks J..L, normalised. [C, E]
        The shared start runs once per block and every class group attends to it (causal: the start never
        sees the class name); the last block computes only EOT."""
        if not self.use_tokens:
            return self.t0
        shared = self.text_shared                                        # [1, S, W]: [SOT, common words]
        parts = [x for _, x, _, _ in self.text_groups]                   # [c, n, W]: the rest of each prompt
        for i, b in enumerate(range(self.first_text, self.Lt)):
            fresh = self.tokens.text(i).to(shared.dtype)                 # [K, W]
            shared = insert(shared, fresh) if i == 0 else mix(shared, fresh, self.beta)  # [1, S + K, W]:
            # [SOT, t_1..t_K, common words]; tokens see SOT and earlier tokens, the words after see the tokens
            last = b == self.Lt - 1
            parts = [self.clip.run_text_blocks(x, b, b + 1, rows=g[2] if last else None, past=shared)
                     for x, g in zip(parts, self.text_groups)]           # causal over [shared, x]
            if not last:
                shared = self.clip.run_text_blocks(shared, b, b + 1)
        t = torch.cat([self.clip.text_head(x, g[3]) for x, g in zip(parts, self.text_groups)])  # [C, E]
        return F.normalize(t[self.text_order], dim=-1)

    # --- image side ------------------------------------------------------------------------------
    def encode_images(self, images, with_frozen=False):
        """f_cls [B, E] (frozen proj) and f_attr [B, K, E] (P_attr), normalised; with_frozen also returns the
        frozen CLIP feature f^0 [B, E], which reuses the prefix (it is needed only for the loss).
        The last block computes only the rows read afterwards: CLS for f^0, CLS and the K tokens otherwise."""
        visual = self.clip.visual
        with torch.no_grad():  # blocks 1..J-1 never change: no autograd
            x = visual.run_blocks(visual.embed(images), 0, self.first)  # [B, 1+P, D]
            f0 = None
            if with_frozen or not self.use_tokens:
                cls = visual.run_blocks(x, self.first, self.L, rows=slice(0, 1))[:, 0]  # [B, D]
                f0 = F.normalize(visual.head(cls), dim=-1)
        if not self.use_tokens:
            return f0, None, f0
        for i, b in enumerate(range(self.first, self.L)):
            fresh = self.tokens.vision(i).to(x.dtype)                    # [K, D]
            x = insert(x, fresh) if i == 0 else mix(x, fresh, self.beta)  # [B, 1+K+P, D]: [CLS, attr_1..attr_K, patches]
            rows = slice(0, 1 + K) if b == self.L - 1 else None          # last block: [B, 1+K, D]
            x = visual.run_blocks(x, b, b + 1, attn_mask=getattr(self, f"mask_{i}"), rows=rows)  # role mask of b
        f_cls = visual.head(x[:, 0])                                  # [B, E]
        f_attr = visual.ln_post(x[:, 1:1 + K]) @ self.P_attr.to(x.dtype)  # [B, K, E]
        return F.normalize(f_cls, dim=-1), F.normalize(f_attr, dim=-1), f0

    def forward(self, images, t=None, with_frozen=False):
        """Six logit sets [B, 1+K, C] (class first, then the K attribute tokens) and the fused logits [B, C].
        The towers may run under autocast; the head (cosine logits, alpha fusion) is always fp32 (fp32_head)."""
        t = self.encode_classes() if t is None else t
        f_cls, f_attr, f0 = self.encode_images(images, with_frozen)
        feats = f_cls.unsqueeze(1) if f_attr is None else torch.cat([f_cls.unsqueeze(1).float(), f_attr.float()], 1)
        logits, fused, feats, t = fp32_head(feats, t, self.clip.logit_scale, None if f_attr is None else self.w)
        f0 = None if f0 is None else f0.float()
        out = {"logits": logits, "fused": fused, "f_cls": feats[:, 0], "f0": f0, "t": t}
        if f_attr is not None:
            out["f_attr"] = feats[:, 1:]
        return out


def fp32_head(feats, t, logit_scale, w=None):
    """The final head in fp32, outside autocast, in training and evaluation alike.

    feats [B, S, E] (S = 1 + K: f_cls then f_attr, or S = 1: f_cls alone), t [C, E]: features that may come out
    of autocast in half precision; they are cast to fp32 and normalised again. logits = s * cos(f, t) [B, S, C]
    with s = exp(logit_scale); fused = sum_k alpha_k logits_k with alpha = softmax(w) ([B, C]; w None: the class
    logits alone). CLIP's logits are about 100 cos, 20-35, where bf16 steps are 0.125-0.25 (fp16 0.016-0.03):
    computed in half precision, close classes would tie or swap. Returns logits, fused and the fp32 features."""
    with torch.autocast(feats.device.type, enabled=False):
        feats = F.normalize(feats.float(), dim=-1)                # [B, S, E]
        t = F.normalize(t.float(), dim=-1)                        # [C, E]
        logits = logit_scale.float().exp() * feats @ t.t()        # [B, S, C]
        if w is None:
            return logits, logits[:, 0], feats, t
        fused = torch.einsum("k,bkc->bc", w.float().softmax(0), logits)  # sum_k alpha_k logits_k
    return logits, fused, feats, t


# ----------------------------------------------------------------------------------------------
# 4. The loss


def dear_loss(out, labels, t0, alpha, lambda_reg, lambda_fusion):
    """CE(fused, y) + lambda_reg * [(1 - cos(f_cls, f^0)) + (1 - cos(t, t^0))] + lambda_fusion * -log alpha_cls,
    in fp32 outside autocast. Returns the total and its parts (0-dim tensors on the device: reading them waits
    for it, which the training loop does only at log lines)."""
    with torch.autocast(labels.device.type, enabled=False):
        ce = F.cross_entropy(out["fused"].float(), labels)
        reg_img = 1 - F.cosine_similarity(out["f_cls"].float(), out["f0"].float(), dim=-1).mean()
        reg_txt = 1 - F.cosine_similarity(out["t"].float(), t0.float(), dim=-1).mean()
        fusion = -alpha[0].float().log()
        total = ce + lambda_reg * (reg_img + reg_txt) + lambda_fusion * fusion
    parts = {"ce": ce, "reg_img": reg_img, "reg_txt": reg_txt, "fusion": fusion}
    return total, {k: v.detach() for k, v in parts.items()}


def make_model(clip_model, roles, cfg: Config) -> DeAR:
    """The model of a run (runs.run calls it with the backbone and the head roles it loaded)."""
    return DeAR(clip_model, roles, J=cfg.J, beta=cfg.beta, rep_dim=cfg.rep_dim, mask=cfg.mask,
                attr_tokens=cfg.method == "dear" and cfg.attr_tokens, alpha_cls=cfg.alpha_cls)


def make_loss(cfg: Config):
    """The DeAR loss with a run's weights, as train.train calls it: loss_fn(model, out, labels)."""
    def loss_fn(model, out, labels):
        return dear_loss(out, labels, model.t0, model.alpha(), cfg.lambda_reg, cfg.lambda_fusion)
    return loss_fn


# ----------------------------------------------------------------------------------------------
# 5. The command line


def parse_args(argv=None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(
        description="DeAR: adapt CLIP with attribute tokens and role-based per-head attention masks.",
        epilog="Examples:\n"
               "  python dear.py --dataset toyworld                # offline demo, tiny CLIP, minutes on a CPU\n"
               "  python dear.py --dataset eurosat --shots 16      # base-to-novel, seed 1, ViT-B/16\n"
               "  python dear.py --dataset imagenet --protocol xd  # ImageNet -> 4 variants + 10 "
               "datasets\n\nEnvironment: DATA (default --root), CLIP_CACHE (CLIP checkpoints, the "
               "toy CLIP and the head roles;\n  default ~/.cache/clip), DEAR_CACHE (the split "
               "files "
               "data.py cannot write beside a read-only dataset;\n  default ~/.cache/dear)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--dataset", default=d.dataset, help="one of " + ", ".join(data.DATASETS) +
                   ", or folder:PATH (default: %(default)s)")
    g.add_argument("--root", default=data_root(),
                   help="folder holding the datasets in the CoOp layout (default: $DATA or data)")
    g.add_argument("--protocol", default=d.protocol, choices=CHOICES["protocol"],
                   help="b2n: train on the base classes, test base and novel; fewshot: all classes; xd: "
                        "train on the source (ImageNet), test it and --targets (default: %(default)s)")
    g.add_argument("--method", default=d.method, choices=CHOICES["method"],
                   help="zeroshot: frozen CLIP with the dataset's template, through the same code "
                        "(default: %(default)s)")
    g.add_argument("--shots", type=int, default=d.shots,
                   help="training images per class (default: %(default)s)")
    g.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the few-shot subset and the run (default: %(default)s)")
    g.add_argument("--backbone", default=None,
                   help="CLIP name (" + ", ".join(clip.available_models() + [toyworld.BACKBONE]) +
                        ") or a checkpoint path (default: ViT-B/16; toy for --dataset toyworld)")
    g.add_argument("--targets", action="append", default=None,
                   help="xd: target datasets, comma-separated or the flag repeated; a folder:PATH "
                        "target is taken whole, commas and all (default: the 4 ImageNet variants "
                        "and the other 10 datasets)")
    g.add_argument("--out", default=d.out,
                   help="output root; every run gets its own folder (default: %(default)s)")
    g = p.add_argument_group("the method (the paper's names)")
    g.add_argument("--J", type=int, default=None,
                   help="attribute tokens enter block J (1-based) and stay to the last block (default: 9 "
                        "of 12 blocks; the last quarter of the blocks in general)")
    g.add_argument("--beta", type=float, default=None,
                   help="token mixing (default: per-dataset table, 0.9 otherwise)")
    g.add_argument("--lambda-reg", type=float, default=None,
                   help="self-regularisation weight (default: per-dataset table)")
    g.add_argument("--lambda-fusion", type=float, default=d.lambda_fusion,
                   help="weight of -log alpha_cls (default: %(default)s)")
    g.add_argument("--alpha-cls", type=float, default=d.alpha_cls,
                   help="initial fusion weight of the class logits; each attribute gets (1 - it) / 5 "
                        "(default: %(default)s)")
    g.add_argument("--rep-dim", type=int, default=d.rep_dim,
                   help="width of the shared token matrix R (default: %(default)s)")
    g.add_argument("--mask", default=d.mask, choices=CHOICES["mask"],
                   help="role-based per-head mask, or an ablation variant (default: %(default)s)")
    g.add_argument("--no-attr-tokens", dest="attr_tokens", action="store_false",
                   help="ablation: no attribute tokens at all (the model is then frozen CLIP)")
    g.add_argument("--novel-logits", default=d.novel_logits, choices=CHOICES["novel_logits"],
                   help="logits on novel classes and target datasets; cls is MMRL's class-only rule "
                        "(default: %(default)s)")
    g.add_argument("--target-beta", default=d.target_beta, choices=CHOICES["target_beta"],
                   help="xd: beta of each target dataset; table: MMRL++'s test-time beta per target "
                        "(ImageNet-V2 0.9 ... Food101 0.3), source: the source's beta for every target "
                        "(default: %(default)s)")
    g.add_argument("--roles", default=None,
                   help="roles JSON written by entropy.py (default: computed once and cached)")
    g.add_argument("--roles-control", default=d.roles_control, choices=CHOICES["roles_control"],
                   help="control for Concept Entropy: random = each block's roles shuffled among its "
                        "heads (seeded by --seed; role counts kept); oracle = roles from the toy world's "
                        "ground-truth probes (default: %(default)s)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=None,
                   help="default: 10 (b2n), 20 (b2n toyworld), 50 (fewshot), 5 (ImageNet b2n and "
                        "fewshot), 1 (xd)")
    g.add_argument("--batch-size", type=int, default=None,
                   help="default: 4 (b2n), 32 (ImageNet b2n, fewshot, xd)")
    g.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default: %(default)s)")
    g.add_argument("--warmup-epochs", type=int, default=None,
                   help="epochs at --warmup-lr before the cosine schedule (default: 1; 0 for xd)")
    g.add_argument("--warmup-lr", type=float, default=d.warmup_lr, help="(default: %(default)s)")
    g.add_argument("--crop-scale", type=float, default=None,
                   help="smallest area of the training RandomResizedCrop (default: 0.5; 1.0 for toyworld)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="(default: %(default)s)")
    g.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size,
                   help="(default: %(default)s)")
    g.add_argument("--workers", type=int, default=None,
                   help="data-loading processes (default: 4, or fewer on a machine with fewer CPUs)")
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--precision", default=d.precision, choices=CHOICES["precision"],
                   help="amp: MMRL's PREC amp, autocast fp16 + GradScaler on CUDA, fp32 on CPU; fp16: the "
                        "same, CUDA only; bf16: autocast bf16 (CUDA, or CPU autocast); fp32: no autocast. "
                        "Parameters stay fp32 and the logits, fusion and loss are fp32 in every mode; "
                        "config.json records the precision used (default: %(default)s)")
    g = p.add_argument_group("runs")
    g.add_argument("--eval-only", action="store_true",
                   help="evaluate the model of --load on --dataset / --protocol")
    g.add_argument("--load", default=None,
                   help="a finished run folder (holding model.pt and config.json)")
    g.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from its last checkpoint")
    g.add_argument("--force", action="store_true",
                   help="redo a finished run, or restart an interrupted one")
    g.add_argument("--roles-only", action="store_true",
                   help="only compute (or find) the head roles and copy them to OUT/roles/J<J>/ "
                        "(run_all.sh's roles stage)")
    args = p.parse_args(argv)
    args.targets = runs.split_targets(args.targets) if args.targets else d.targets
    return Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                     if hasattr(args, f.name)})


def main(argv=None):
    cfg = parse_args(argv)
    try:
        if cfg.roles_only:
            return runs.export_roles(cfg)
        results = runs.run(cfg, make_model, make_loss)
    except (RunError, data.DataError, toyworld.ToyWorldError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except runs.Interrupted as e:
        print(f"\n{e}", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:  # outside a run folder (the roles stage, a toy pretraining before any run)
        print("\ninterrupted: nothing was kept; rerun the same command to start again", file=sys.stderr)
        sys.exit(130)
    line = {e["dataset"] + "/" + e["split"]: round(e["accuracy"], 2) for e in results["evals"]}
    print(json.dumps(dict(line, **({"hm": round(results["hm"], 2)} if "hm" in results else {}))))


if __name__ == "__main__":
    main()

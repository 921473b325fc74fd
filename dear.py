"""DeAR: Fine-Grained VLM Adaptation by Decomposing Attention Head Roles (CVPR 2026), in PyTorch.

Read top to bottom: 1. the attribute tokens, 2. the role-based mask, 3. the DeAR module (Figure 2),
4. logits, fusion and loss, 5. the recipe (Config: every flag; MMRL and MMRL++'s tables),
6. training and evaluation, 7. the run, 8. predict and explain.

Blocks count from 1 in the paper (J = 9: the tokens enter block 9 of 12), in the flags and in the
roles files, and from 0 in the code. DeAR.__init__ converts once: self.blocks = range(J - 1, L) are
the vision blocks that hold the tokens, and self.roles[i] the head roles of the i-th of them.

examples:
  python dear.py --dataset toyworld                  # offline, a tiny CLIP, minutes on a CPU
  python dear.py --dataset eurosat --shots 16        # base-to-novel, seed 1, ViT-B/16
  python dear.py predict --load RUN a.jpg --explain x.png   # classify and explain your own images
environment: DATA (default --root), CLIP_CACHE (checkpoints, the toy CLIP, head roles; default
  ~/.cache/clip)
"""

import argparse
import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import pickle
import platform
import re
import shutil
import subprocess
import sys
import time
from typing import NamedTuple

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads sleep

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image, ImageDraw

import clip
import data
import entropy
import toyworld
from data import UserError  # a mistake the user can fix (data.py opens with the file helpers)

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


# 2. The role-based attention mask of one vision block


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
#
# The text side, stated plainly (tests/test_dear.py, hand_text, writes it out): every prompt runs
# whole; from block J the K tokens sit right after SOT (inserted at J, mixed after it, as in the
# image tower); the causal mask grows by K, so the tokens see SOT and the words see the tokens; each
# prompt is read at its EOT, now K positions later. encode_classes computes exactly that, faster
# (the tests compare the two; BENCH.md gives each shortcut's share of a training step's FLOPs):
# - blocks 1..J-1 and t^0 run once per class list (set_classes), not once per step;
# - the prompts' shared start (SOT and the template's first words) runs once per block: causal, it
#   sees only itself, so its states are equal in every prompt;
# - prompts run in groups of similar length, each padded only to its longest
#   (clip.model.length_buckets), and the last block computes only the EOT rows (in the image
#   tower: only CLS and the tokens).


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


class DeAR(nn.Module):
    """Frozen CLIP + attribute tokens from block J + role masks + P_attr + fusion weights w.
    Blocks 1..J-1 run once and without autograd; the last block computes only the rows read."""

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
        if self.kind == "mmrlpp":
            return self.clip.visual.proj + self.P_A @ self.P_B
        return self.P_full

    def alpha(self):
        return self.w.softmax(0)  # [1 + K]: alpha_cls, alpha_color, ...

    def forward(self, images, t=None, with_frozen=False):
        """Figure 2, a step a line. t [C, E]: class features if computed already; with_frozen:
        also f^0 (the loss)."""
        scale = self.clip.logit_scale
        t = self.encode_classes() if t is None else t  # [C, E]      text tokens in J..L
        x = self.frozen_prefix(images)  # [B, 1+P, D]  blocks 1..J-1
        f0 = self.frozen_feature(x) if with_frozen or not self.use_tokens else None  # [B, E]
        if not self.use_tokens:  # zero-shot CLIP
            logits, feats, t = cosine_logits(f0.unsqueeze(1), t, scale)  # [B, 1, C]
            return dict(logits=logits, fused=logits[:, 0], f_cls=feats[:, 0], f0=f0.float(), t=t)
        x = self.token_blocks(x)  # [B, 1+K, D]  tokens from J, role masks
        f_cls, f_attr = self.image_features(x)  # [B, E], [B, K, E]
        feats = torch.cat([f_cls.unsqueeze(1), f_attr], 1)  # [B, 1+K, E]
        logits, feats, t = cosine_logits(feats, t, scale)  # [B, 1+K, C]  six logit sets
        fused = fuse(logits, self.alpha())  # [B, C]  sum_k alpha_k logits_k
        f0 = None if f0 is None else f0.float()
        return dict(logits=logits, fused=fused, f_cls=feats[:, 0], f_attr=feats[:, 1:], f0=f0, t=t)

    def frozen_prefix(self, images):
        """Blocks 1..J-1, without autograd: [B, 3, R, R] -> [B, 1+P, D]."""
        visual = self.clip.visual
        with torch.no_grad():
            return visual.run_blocks(visual.embed(images), 0, self.blocks.start)

    def frozen_feature(self, x):
        """f^0 [B, E]: blocks J..L without tokens; the last block computes CLS alone."""
        visual = self.clip.visual
        with torch.no_grad():
            cls = visual.run_blocks(x, self.blocks.start, self.blocks.stop, rows=slice(0, 1))
            return F.normalize(visual.head(cls[:, 0]), dim=-1)

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

    def set_classes(self, classnames, template):
        """Once per class list: Prompts (the prompts' states at block J's input) and t^0 [C, E]
        (frozen CLIP's class features)."""
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
        """t [C, E]: the text side stated above, from set_classes' Prompts."""
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

    def attention_maps(self, images):
        """What CLS (every head) and each attribute token (its expert heads; the mixed heads where
        it has none) attend to among the patches in the last block: [B, 1+K, P]; and those heads,
        a list per map (empty: no head of the block lets the token see the patches)."""
        last = len(self.blocks) - 1
        with torch.no_grad():
            x = self.token_blocks(self.frozen_prefix(images), stop=last)  # block L's input
            block = self.clip.visual.transformer.resblocks[self.blocks[last]]
            w = block.attn(block.ln_1(x), self.mask(last), need_weights=True)[1]  # [B, H, T, T]
        w = w[:, :, : 1 + K, 1 + K :]  # queries CLS and the tokens, keys the patches
        roles = self.roles[last] if self.roles else [{"role": "mixed"}] * w.shape[1]
        mixed = [h for h, r in enumerate(roles) if r["role"] == "mixed"]
        heads = [list(range(w.shape[1]))]  # CLS: every head
        for a in ATTRIBUTES:
            experts = [h for h, r in enumerate(roles) if r.get("attribute") == a]
            heads.append(experts or mixed)
        none = torch.zeros_like(w[:, 0, 0])  # a token no head lets see the patches: an empty map
        maps = [w[:, hs, k].mean(1) if hs else none for k, hs in enumerate(heads)]
        return torch.stack(maps, 1), heads


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


POSITIVE = data.POSITIVE
COUNT = data.number(int, lambda v: v >= 0, "a count >= 0")
SEED = data.number(int, lambda v: 0 <= v < 2**32, "a seed < 2^32")
CROP = data.number(float, lambda v: 0 < v <= 1, "in (0, 1]")
UNIT = data.number(float, lambda v: 0 <= v <= 1, "in [0, 1]")
OPEN = data.number(float, lambda v: 0 < v < 1, "in (0, 1)")
NONNEG = data.number(float, lambda v: v >= 0, "a number >= 0")
RATE = data.number(float, lambda v: v > 0, "a number > 0")


def opt(default, help, type=str, choices=None, kind="variant", **kw):
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
    shots: int = opt(16, "training images per class", POSITIVE, kind="run")
    seed: int = opt(1, "seed of the few-shot subset and the run", SEED, kind="run")
    backbone: str = opt(None, "ViT-B/16 (default; toyworld: toy), -B/32, -L/14(@336px), a file")
    targets: list = opt(None, "xd targets, comma-separated or repeated (default: ImageNet's 4 "
                        "variants and the other 10 datasets)", action="append", kind="run")
    out: str = opt("runs", "output root; every run gets its own folder", kind="place")
    J: int = opt(None, "tokens enter block J, from 1 (default: the last third: 9 of 12)", POSITIVE)
    beta: float = opt(None, "token mixing (default: MMRL++'s table, else 0.9)", UNIT)
    lambda_reg: float = opt(None, "default: MMRL++'s table, else 1.0; xd source 0.1", NONNEG)
    lambda_fusion: float = opt(1.0, "weight of -log alpha_cls", NONNEG)
    alpha_cls: float = opt(0.7, "initial alpha_cls (each token: (1 - alpha_cls) / 5)", OPEN)
    rep_dim: int = opt(512, "width of the shared token matrix R", POSITIVE)
    tokens: str = opt("mmrlpp", "MMRL++'s (a shared aligner + rank-4 residuals, P_attr = proj + "
                      "rank 64) or MMRL's (full ones)", choices=("mmrlpp", "mmrl"))
    mask: str = opt("role", "per-head mask", choices=("role", "generalization-only", "none"))
    attr_tokens: bool = opt(True, "no attribute tokens (frozen CLIP)", flag="--no-attr-tokens")
    novel_logits: str = opt("fused", "novel, xd targets (cls: MMRL's)", choices=("fused", "cls"))
    target_beta: str = opt("table", "xd targets: MMRL++'s beta", choices=("table", "source"))
    roles: str = opt(None, "roles JSON written by entropy.py (default: computed once, cached)")
    roles_control: str = opt("none", "random: each block's shuffled", choices=("none", "random"))
    epochs: int = opt(None, "default: b2n 10 (ImageNet 5, toy 20), fewshot 100 (ImageNet 5, toy "
                      "50), xd 1", POSITIVE)
    batch_size: int = opt(None, "default: 4 (b2n), 32 (ImageNet b2n, fewshot, xd)", POSITIVE)
    warmup_epochs: int = opt(None, "epochs at --warmup-lr first (default 1; xd 0)", COUNT)
    lr: float = opt(None, "AdamW lr (default: 1e-3; fewshot 2e-3, ImageNet fewshot 1e-3)", RATE)
    warmup_lr: float = opt(1e-5, "learning rate of the warm-up epochs", RATE)
    weight_decay: float = opt(5e-4, "AdamW weight decay", NONNEG)
    crop_scale: float = opt(None, "smallest area of a training crop (default 0.5, toy 1)", CROP)
    eval_batch_size: int = opt(100, "evaluation batch size", POSITIVE, kind="place")
    workers: int = opt(None, "loader processes (default: up to 4)", COUNT, kind="place")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N", kind="place")
    precision: str = opt("amp", "amp: fp16 + GradScaler on CUDA, fp32 on a CPU (MMRL's); the head "
                         "and the loss in fp32 always", choices=("amp", "fp16", "bf16", "fp32"))
    eval_precision: str = opt("fp32", "as MMRL's test()", choices=("fp32", "fp16", "bf16"))
    eval_only: bool = opt(False, "evaluate --load's run, into RUN/eval/<protocol>-<dataset>/",
                          kind="run")
    load: str = opt(None, "a finished run folder", kind="place")
    resume: bool = opt(False, "continue an interrupted run from its last epoch", kind="place")
    force: bool = opt(False, "redo a finished run, or restart an interrupted one", kind="place")
    roles_only: bool = opt(False, "only the head roles, into OUT/roles/J<J>/", kind="place")


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
RECORDED = [n for n, f in FIELDS.items() if f.metadata["kind"] != "place"]  # config.json's config
GROUPS = {"J": "the method", "epochs": "optimisation", "eval_only": "runs"}  # --help: from each
# The flags each kind of call reads. A flag given (not at its default) to a call that does not read
# it is refused, never ignored: --targets and --target-beta are read with --protocol xd only, and
# --eval-only takes every other recorded setting from the run it evaluates.
PLACE = ["root", "workers", "eval_batch_size", "device"]
READS = {
    "dear": [n for n in FIELDS if n not in ("eval_only", "load", "roles_only")],
    "zeroshot": ["dataset", "protocol", "method", "backbone", "targets", "eval_precision", "out",
                 "resume", "force", *PLACE],
    "eval-only": ["dataset", "protocol", "targets", "target_beta", "eval_precision", "eval_only",
                  "load", "force", *PLACE],
    "roles-only": ["dataset", "backbone", "J", "out", "roles_only", *PLACE]}


def flag(name):
    return FIELDS[name].metadata.get("flag", "--" + name.replace("_", "-"))


def parse_args(argv=None) -> Config:
    parser = data.Parser(description="DeAR: adapt CLIP with attribute tokens and role-based masks.",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=__doc__[__doc__.index("examples:") :])
    group = parser.add_argument_group("what to run")
    for name, f in FIELDS.items():
        m = {k: v for k, v in f.metadata.items() if k not in ("flag", "kind")}
        if name in GROUPS:
            group = parser.add_argument_group(GROUPS[name])
        if f.type is bool:
            action = "store_false" if f.default else "store_true"
            group.add_argument(flag(name), dest=name, action=action, help=m["help"])
            continue
        if f.default is not None and "default" not in m["help"]:
            m["help"] += f" (default: {f.default})"
        group.add_argument(flag(name), dest=name, default=f.default, **m)
    return Config(**vars(parser.parse_args(argv)))


def refuse_unread(cfg: Config):
    """Refuse each flag that the call sets and does not read (READS): a call is "dear" (train, then
    evaluate), "zeroshot", "eval-only" or "roles-only"."""
    call = "roles-only" if cfg.roles_only else "eval-only" if cfg.eval_only else cfg.method
    for name, f in FIELDS.items():
        if getattr(cfg, name) == f.default:
            continue
        if name not in READS[call]:
            carried = call == "eval-only" and name in RECORDED
            why = "it takes the run's own" if carried else "drop it"
            what = {"dear": "a DeAR run", "zeroshot": "--method zeroshot"}.get(call, "--" + call)
            raise UserError(f"{flag(name)} is not read by {what}: {why}")
        if name in ("targets", "target_beta") and cfg.protocol != "xd":
            raise UserError(f"{flag(name)} is read by --protocol xd only: drop it, or add it")


def with_run_settings(cfg: Config):
    """--eval-only: the call's flags, and every other recorded setting from the run in --load."""
    if not cfg.load:
        raise UserError("--eval-only needs --load RUN, a finished run folder")
    recorded = read_config(cfg.load)["config"]
    carried = {k: v for k, v in recorded.items() if k not in READS["eval-only"]}
    return dataclasses.replace(cfg, **carried)


def resolve(cfg: Config) -> Config:
    """The final config: every value checked (a Config built in code too), every None filled from
    the tables, J from the backbone's depth, the device and amp's precision from this machine."""
    for name in FIELDS:
        check_value(name, getattr(cfg, name))
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
    splits = [[v] if v.startswith("folder:") else v.split(",") for v in c.targets or []]
    c.targets = [t for names in splits for t in names if t]
    if c.protocol == "xd" and not c.targets:
        c.targets = [t for t in data.DG_TARGETS + data.B2N_DATASETS if t != c.dataset]
    c.device = resolve_device(c)
    if c.precision == "amp":  # MMRL's PREC "amp": fp16 with a GradScaler on CUDA, fp32 on a CPU
        c.precision = "fp16" if c.device.startswith("cuda") else "fp32"
    return c


def check_value(name, value):
    """A field's value, checked as its flag's: the type, the range, the choices (None: the
    default)."""
    f = FIELDS[name]
    parse = f.metadata["type"]
    choices = f.metadata["choices"]
    want = (int, float) if f.type is float else f.type
    if value is None:
        return
    if not isinstance(value, want) or isinstance(value, bool) != (f.type is bool):
        raise UserError(f"{flag(name)}: {value!r} is not a {f.type.__name__}")
    try:
        if f.type in (int, float) and parse(str(value)) != value:
            raise argparse.ArgumentTypeError(f"{value!r} is not a {f.type.__name__}")
    except argparse.ArgumentTypeError as e:
        raise UserError(f"{flag(name)}: {e}") from None
    if choices and value not in choices:
        raise UserError(f"{flag(name)} {value!r}: choose from {', '.join(choices)}")


def resolve_device(c: Config):
    """auto: CUDA where there is one, else the CPU; a device this machine lacks is refused here."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", c.device):
        raise UserError(f"--device {c.device!r}: choose auto, cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = ("cuda" if count else "cpu") if c.device == "auto" else c.device
    if device.startswith("cuda") and (torch.device(device).index or 0) >= count:
        raise UserError(f"--device {device}: this machine has {count} CUDA devices")
    bf16 = "bf16" in (c.precision, c.eval_precision)
    if bf16 and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise UserError("--precision bf16: this GPU has no bfloat16; use fp16")
    return device


@functools.lru_cache
def backbone_depth(backbone):
    """The vision tower's blocks: OpenAI's ViTs and the toy by their sizes, a file as loaded."""
    if backbone == toyworld.BACKBONE:
        return toyworld.TOY_CONFIG["vision_layers"]
    if backbone in DEPTHS:
        return DEPTHS[backbone]
    return load_backbone(backbone, "cpu").visual.transformer.layers


def default_J(num_layers):
    """Tokens in the last third of the blocks, as DeAR's 9..12 of 12: ViT-L/14 17..24, toy 3..4."""
    return num_layers - math.ceil(num_layers / 3) + 1


def eval_beta(c: Config, dataset):
    """An evaluation's beta: the run's, except on xd targets (MMRL++'s test-time beta, where its
    table has one)."""
    if c.protocol != "xd" or dataset == c.dataset or c.target_beta == "source":
        return c.beta
    return XD_TARGET_BETA.get(dataset, c.beta)


# 6. Training and evaluation, MMRL's protocol

AMP = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
CHECKPOINT = {"model": dict, "opt": dict, "scaler": dict, "epoch": int, "precision": str}


def lr_at(epoch, c: Config):
    """Epoch e from 0: warmup_lr for e < W, then lr (1 + cos(pi (e - W) / E)) / 2, as Dassl,
    stepped per epoch."""
    if epoch < c.warmup_epochs:
        return c.warmup_lr
    return c.lr * (1 + math.cos(math.pi * (epoch - c.warmup_epochs) / c.epochs)) / 2


class SeededImages(data.ImageList):
    """Each image's augmentation from a seed of its own (the loader hands it over): none depends
    on --workers."""

    def __getitem__(self, item):
        i, seed = item
        torch.default_generator.manual_seed(seed)  # the CPU's only (torch.manual_seed: CUDA's too)
        return super().__getitem__(i)


def train(model, ds, c: Config, ckpt, log):
    """Train on ds.train, a checkpoint at each epoch's end: --resume ends with an uninterrupted
    run's weights."""
    device = torch.device(c.device)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        log("no trainable parameters (no attribute tokens): the model is frozen CLIP")
        return {"steps": 0, "trainable": 0}
    log(f"train: {len(ds.train)} images, {len(ds.classnames)} classes, {c.epochs} epochs, batch "
        f"{c.batch_size}, beta {c.beta}, lambda_reg {c.lambda_reg}, J {c.J}, tokens {c.tokens}: "
        f"{sum(p.numel() for p in params):,} trainable values")
    model.set_classes(ds.classnames, ds.template)
    amp = AMP[c.precision]
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay, fused=cuda)
    scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)  # skips fp16 overflows
    start = 0  # or the epoch of the last checkpoint (--resume)
    if os.path.exists(ckpt):
        start = resume(ckpt, model, opt, scaler, c)
        log(f"resuming from {ckpt} at epoch {start + 1}")
    augment = data.train_transform(model.clip.visual.input_resolution, c.crop_scale)
    images = SeededImages(ds.train, augment)
    n = len(ds.train)
    steps = max(1, n // c.batch_size)  # Dassl drops the last incomplete batch
    log_every = max(1, min(50, steps // 2))
    t_start = time.time()
    done = 0
    for epoch in range(start, c.epochs):
        for g in opt.param_groups:
            g["lr"] = lr_at(epoch, c)
        seed = c.seed * 1000 + epoch
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        batches = [[(i, seed * 2**24 + i) for i in order[s * c.batch_size : (s + 1) * c.batch_size]]
                   for s in range(steps)]
        loader = torch.utils.data.DataLoader(images, batch_sampler=batches,
                                             num_workers=c.workers, pin_memory=cuda)
        model.train()
        for step, (x, y) in enumerate(loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                out = model(x, with_frozen=True)
            loss, parts = dear_loss(out, y, model.t0, model.alpha(), c.lambda_reg, c.lambda_fusion)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            done += 1
            if (step + 1) % log_every == 0 or step + 1 == steps:  # the only waits for the device
                value = loss.item()
                if not math.isfinite(value) and not scaler.is_enabled():  # nothing skips it: stop
                    to = "--precision fp32" if c.precision == "bf16" else "a lower --lr"
                    when = f"by epoch {epoch + 1}, step {step + 1}"
                    raise UserError(f"the loss became {value} {when}; try {to}")
                skipped = epoch * steps + step + 1 - steps_taken(opt, params)
                eta = (time.time() - t_start) / done * ((c.epochs - start) * steps - done)
                log(f"epoch {epoch + 1}/{c.epochs} step {step + 1}/{steps} loss {value:.4f} "
                    f"ce {parts['ce'].item():.3f} lr {lr_at(epoch, c):.2e}"
                    + (f" skipped {skipped}" if skipped else "") + f" eta {eta:.0f}s")
        state = {"model": model.trainable_state(), "opt": opt.state_dict(),
                 "scaler": scaler.state_dict(), "epoch": epoch + 1, "precision": c.precision}
        data.atomic_write(ckpt, functools.partial(torch.save, state))
    skipped = c.epochs * steps - steps_taken(opt, params)
    return {"steps": done, "skipped_steps": skipped, "trainable": sum(p.numel() for p in params)}


def steps_taken(opt, params):
    """AdamW's own count of its steps: a step the GradScaler skipped is not among them."""
    return int(opt.state[params[0]].get("step", 0))


def resume(ckpt, model, opt, scaler, c: Config):
    """checkpoint.pt into the model, the optimiser and the GradScaler; returns its epochs."""
    fix = "--force starts the run again"
    state = data.read_torch(ckpt, fix, CHECKPOINT)
    if state["precision"] != c.precision:
        raise UserError(f"{ckpt}: of --precision {state['precision']}; resume with it, or --force")
    if not 1 <= state["epoch"] <= c.epochs:
        raise UserError(f"{ckpt}: holds epoch {state['epoch']}, not one of 1..{c.epochs}; {fix}")
    model.load_trainable(state["model"], ckpt)
    try:
        opt.load_state_dict(state["opt"])
        scaler.load_state_dict(state["scaler"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"{ckpt}: its optimiser state does not fit ({e}); {fix}") from None
    return state["epoch"]


def evaluate(model, items, classnames, template, c: Config, rule="fused", log=print, name=""):
    """Top-1 accuracy (%) of the fused (or class) logits, overall and per class; fp32 as MMRL's
    test() by default."""
    device = torch.device(c.device)
    model.eval().set_classes(classnames, template)
    amp = AMP[c.eval_precision]
    images = data.ImageList(items, clip.transform(model.clip.visual.input_resolution))
    loader = torch.utils.data.DataLoader(images, batch_size=c.eval_batch_size,
                                         num_workers=c.workers, pin_memory=device.type == "cuda")
    correct = torch.zeros(len(classnames), dtype=torch.long, device=device)  # per true class
    count = torch.zeros_like(correct)
    t_start = time.time()
    with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        t = model.encode_classes()  # [C, E], once for the whole evaluation
        for i, (x, y) in enumerate(loader):
            out = model(x.to(device, non_blocking=True), t=t)
            scores = out["fused"] if rule == "fused" else out["logits"][:, 0]  # [B, C]
            y = y.to(device)
            correct.index_add_(0, y, (scores.argmax(-1) == y).long())
            count.index_add_(0, y, torch.ones_like(y))
            if (i + 1) % 50 == 0:
                eta = (time.time() - t_start) / (i + 1) * (len(loader) - i - 1)
                log(f"  eval {name}: {i + 1}/{len(loader)} batches, eta {eta:.0f}s")
    correct, count = correct.tolist(), count.tolist()
    per_class = [{"class": k, "accuracy": 100.0 * a / max(1, n), "n": n}
                 for k, a, n in zip(classnames, correct, count)]
    accuracy = 100.0 * sum(correct) / max(1, sum(count))
    return dict(accuracy=accuracy, n=sum(count), logits=rule, precision=c.eval_precision,
                per_class=per_class)


# 7. The run. Its folder is its identity: a finished run is reused, and an interrupted one resumed,
# only when everything it recorded (the resolved config; by content the dataset folder, the
# checkpoint and the roles) equals the call's.

RUN_FILES = ("results.json", "checkpoint.pt", "model.pt", "roles.json", "config.json")  # in order
KINDS = {"targets": [str], "roles": (str, None)}  # recorded fields other than their field's type
RECORD = {"config": {n: KINDS.get(n, FIELDS[n].type) for n in RECORDED},
          "inputs": {"dataset_folder": str, "backbone_sha256": str, "roles_sha256": (str, None)},
          "env": dict, "classes": [str], "template": str}
PER_CLASS = {"class": str, "accuracy": slice(0, 100), "n": int}
EVAL = {"dataset": str, "split": str, "beta": (slice(0, 1), None), "accuracy": slice(0, 100),
        "n": int, "logits": str, "precision": str, "per_class": [PER_CLASS]}
RESULTS = {"config": RECORD["config"], "inputs": RECORD["inputs"], "env": dict, "variant": str,
           "changed": dict, "evals": [EVAL], "train": (dict, None), "hm?": slice(0, 100),
           "warnings": [str]}


def sha256_text(text):
    return hashlib.sha256(text.encode()).hexdigest()


def read_config(run):
    """A run folder's config.json, checked: every setting as its flag's."""
    path = os.path.join(run, "config.json")
    fix = f"{run} holds no whole run: give a finished run folder"
    return checked_config(path, data.read_json(path, RECORD, fix), fix)


def read_results(path):
    """A results.json, checked: every accuracy in 0..100, every setting as its flag's."""
    return checked_config(path, data.read_json(path, RESULTS, "--force redoes the run"),
                          "--force redoes the run")


def checked_config(path, doc, fix):
    for name, value in doc["config"].items():
        try:
            if name not in RECORDED:
                raise UserError(f"{name!r} is not a recorded setting of this version")
            check_value(name, value)
        except UserError as e:
            raise UserError(f"{path}: config {e}; {fix}") from None
    return doc


def run_dir(c: Config):
    """(the folder, the variant, the flags that name it): OUT/<protocol>/<dataset>/<method>-
    <variant>-shots<K>-seed<S>/, the variant `default` or the flags that differ from the dataset's
    defaults (`mask-none_J-7`); a folder:PATH dataset is named by its folder and its path's hash;
    --eval-only: RUN/eval/<protocol>-<dataset>/."""
    base = resolve(Config(c.dataset, protocol=c.protocol, backbone=c.backbone, device=c.device))
    names = [n for n in READS[c.method] if FIELDS[n].metadata["kind"] == "variant"]
    changed = {n: getattr(c, n) for n in names if getattr(c, n) != getattr(base, n)}
    if c.backbone != resolve(Config(dataset=c.dataset)).backbone:
        changed = {"backbone": c.backbone, **changed}
    parts = [f"{k}-{v}" for k, v in changed.items()]  # a long one (a path): cut, and hashed
    short = [p if len(p) < 40 else p[:20] + sha256_text(p)[:8] for p in parts]
    variant = "_".join(short).replace("/", "-") or "default"
    if len(variant) > 120:  # a folder name has at most 255 bytes: cut, and hashed
        variant = variant[:111] + "_" + sha256_text(variant)[:8]
    tag = c.dataset
    if c.dataset.startswith("folder:"):
        path = data.dataset_folder(c.dataset, c.root)
        tag = f"folder-{os.path.basename(path)}-{sha256_text(path)[:8]}"
    if c.eval_only:
        return os.path.join(c.load, "eval", f"{c.protocol}-{tag}"), variant, changed
    name = f"{c.method}-{variant}-shots{c.shots}-seed{c.seed}"
    return os.path.join(c.out, c.protocol, tag, name), variant, changed


class RunFolder:
    """A run's folder, held by one process (flock, never through a link), with its log. It holds a
    finished run (results.json), an interrupted one (checkpoint.pt) or nothing; --force clears it
    first."""

    def __init__(self, path, c: Config):
        self.path = path
        self.c = c
        os.makedirs(path, exist_ok=True)
        self.fd = os.open(self.file(".lock"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise UserError(f"{path} is being written by another process") from None
        for name in RUN_FILES if c.force else ():
            data.remove(self.file(name))
        self.log_file = open(self.file("log.txt"), "a")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.log_file.close()
        os.close(self.fd)

    def file(self, name):
        return os.path.join(self.path, name)

    def log(self, msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, file=self.log_file, flush=True)
        print(line, flush=True)

    def finished(self, record):
        """The folder's results if it holds a finished run of this record (config and inputs);
        None if it holds nothing, or an interrupted run to resume. A run of another record (in
        config.json or results.json) stops the call."""
        done = os.path.exists(self.file("results.json"))
        interrupted = os.path.exists(self.file("checkpoint.pt"))
        if interrupted and not (done or self.c.resume):
            raise UserError(f"{self.path}: an interrupted run; --resume goes on, --force restarts")
        if not (done or (interrupted and self.c.resume)):
            return None
        docs = [read_config(self.path)]
        if done:
            docs.append(read_results(self.file("results.json")))
        now = {f"{g}.{k}": v for g in ("config", "inputs") for k, v in record[g].items()}
        for doc in docs:
            was = {f"{g}.{k}": v for g in ("config", "inputs") for k, v in doc[g].items()}
            keys = [k for k in dict.fromkeys([*now, *was]) if was.get(k) != now.get(k)]
            diff = "; ".join(f"{k}: {was.get(k)!r} -> {now.get(k)!r}" for k in keys[:4])
            if diff:
                raise UserError(f"{self.path} holds a run of another config ({diff}); use another "
                                "--out, or --force")
        return docs[-1] if done else None


def environment():
    """Where a run ran: versions, the device, the code's commit and whether it had changes."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        done = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True)
        return done.stdout.strip()

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":")[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu
    return dict(python=platform.python_version(), torch=torch.__version__,
                torchvision=torchvision.__version__, cuda=torch.version.cuda, device=device,
                cudnn=torch.backends.cudnn.version(), git_commit=git("rev-parse", "HEAD") or None,
                git_dirty=bool(git("status", "--porcelain")))


def load_backbone(name, device, log=print):
    """A frozen CLIP: clip.load for OpenAI's names and checkpoint files; "toy": the toy world's tiny
    CLIP, pretrained into the CLIP cache on first use."""
    fix = "pass ViT-B/32, ViT-B/16, ViT-L/14, ViT-L/14@336px, toy or a ViT CLIP checkpoint file"
    if name == toyworld.BACKBONE:
        path = toyworld.ensure_pretrained(clip.cache_dir(), log)
    else:
        path = name if name in clip.MODELS else data.regular(name, fix)
    try:
        model, _ = clip.load(path, device=device)
    except (RuntimeError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as e:
        why = str(e).strip().splitlines()[0][:100]
        raise UserError(f"{path}: not a ViT CLIP checkpoint ({why}); {fix}") from None
    try:
        clip.tokenizer.get_tokenizer()  # the BPE vocabulary, checked before any work
    except ValueError as e:
        raise UserError(f"{e}; restore clip/ from the repository") from None
    model.name = name
    return model


def build(c: Config, log, roles_file=None, trained=None):
    """The DeAR model of a final config, on c.device, and the roles file it masks with (None:
    no mask): the backbone; the roles (roles_file, --roles, or entropy.py's, computed once and
    cached); trained: a model.pt to load."""
    device = torch.device(c.device)
    clip_model = load_backbone(c.backbone, device, log)
    toy_cpu = c.backbone == toyworld.BACKBONE and device.type == "cpu"
    if toy_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the toy CLIP's matrices are too small for a second thread to pay
    L = clip_model.visual.transformer.layers
    roles = None
    if c.method == "dear" and c.attr_tokens and c.mask != "none":
        roles_file = roles_file or c.roles or compute_roles(c, clip_model, log)
        heads = clip_model.visual.transformer.heads
        roles = entropy.load_roles(roles_file, L, heads, list(range(c.J, L + 1)), clip_model.sha256)
        roles = entropy.control_roles(roles, c.roles_control, c.seed)
    torch.manual_seed(c.seed)  # the tokens' initialisation
    attr_tokens = c.method == "dear" and c.attr_tokens
    model = DeAR(clip_model, roles, c.J, c.beta, c.rep_dim, c.mask, attr_tokens, c.alpha_cls,
                 c.tokens).to(device)
    if trained:
        state = data.read_torch(trained, "train the run again (--force)", dict)
        model.load_trainable(state, trained)
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
    """(the training set, [(dataset, split, logits rule)] to evaluate): every split is read before
    anything is written, so that a missing dataset stops the call here."""
    if c.dataset == "toyworld":
        toyworld.ensure_dataset(c.root)
    if c.protocol == "b2n":
        base = data.build_dataset(c.dataset, c.root, c.shots, c.seed, "base")
        novel = data.build_dataset(c.dataset, c.root, c.shots, c.seed, "novel")
        return base, [(base, "base", "fused"), (novel, "novel", c.novel_logits)]
    source = data.build_dataset(c.dataset, c.root, c.shots, c.seed)
    targets = [(data.build_dataset(t, c.root), "all", c.novel_logits) for t in c.targets]
    return source, [(source, "all", "fused")] + targets


def open_run(folder, c: Config, train_set, evals):
    """The bookkeeping before work: the model and the roles it masks with (the run's own on
    --eval-only and --resume), the record (config, inputs, env), checked against what the folder
    holds; a new run's roles.json, roles.md and config.json. Returns (model, record, the results of
    a finished run of this record, else None)."""
    env = environment()
    where = " ".join(f"{k} {v}" for k, v in env.items())
    folder.log(f"{c.method} {c.protocol} {c.dataset} -> {folder.path} | {where}")
    own = os.path.join(c.load if c.eval_only else folder.path, "roles.json")
    own = own if (c.eval_only or c.resume) and os.path.exists(own) else None
    trained = os.path.join(c.load, "model.pt") if c.eval_only and c.method == "dear" else None
    model, roles = build(c, folder.log, own, trained)
    inputs = {"dataset_folder": os.path.realpath(data.dataset_folder(c.dataset, c.root)),
              "backbone_sha256": model.clip.sha256,
              "roles_sha256": roles and data.sha256_file(roles)}
    record = {"config": {n: getattr(c, n) for n in RECORDED}, "inputs": inputs, "env": env}
    done = folder.finished(record)
    if done:
        return model, record, done
    if roles and os.path.realpath(roles) != os.path.realpath(folder.file("roles.json")):
        data.atomic_write(folder.file("roles.json"), functools.partial(shutil.copyfile, roles))
    if roles:
        entropy.write_report(entropy.read_roles(folder.file("roles.json")), folder.path)
    classes = [k for ds, split, _ in evals if ds is train_set or split == "novel"
               for k in ds.classnames]  # base and novel
    data.write_json(folder.file("config.json"),
                    {**record, "classes": classes, "template": train_set.template})
    return model, record, None


def run(cfg: Config):
    """One run: train (unless zero-shot or --eval-only), evaluate each split, write results.json;
    returns the results."""
    refuse_unread(cfg)
    c = resolve(with_run_settings(cfg) if cfg.eval_only else cfg)
    train_set, evals = read_datasets(c)
    path, variant, changed = run_dir(c)
    with RunFolder(path, c) as folder:
        model, record, done = open_run(folder, c, train_set, evals)
        if done:
            print(f"done already: {folder.file('results.json')} (--force redoes it)")
            return done
        t0 = time.time()
        stats = None
        if c.method == "dear" and not c.eval_only:
            stats = train(model, train_set, c, folder.file("checkpoint.pt"), folder.log)
            state = model.trainable_state()
            data.atomic_write(folder.file("model.pt"), functools.partial(torch.save, state))
        t1 = time.time()
        warnings = list(dict.fromkeys(w for ds, _, _ in evals for w in ds.warnings))
        results = {**record, "variant": variant, "changed": changed, "evals": [], "train": stats,
                   "train_shots": train_set.shots_per_class, "warnings": warnings}
        for ds, split, rule in evals:
            model.beta = eval_beta(c, ds.name)  # xd targets: MMRL++'s test-time beta
            what = f"{ds.name}/{split}"
            r = evaluate(model, ds.test, ds.classnames, ds.template, c, rule, folder.log, what)
            beta = model.beta if model.use_tokens else None  # zero-shot CLIP has no tokens to mix
            results["evals"].append({"dataset": ds.name, "split": split, "beta": beta, **r})
            how = f"{rule} logits, beta {beta}" if model.use_tokens else "zero-shot CLIP"
            folder.log(f"{ds.name} {split}: {r['accuracy']:.2f}% of {r['n']} ({how})")
        if c.protocol == "b2n":
            b, n = (e["accuracy"] for e in results["evals"])
            results["hm"] = 2 * b * n / (b + n) if b + n > 0 else 0.0
            folder.log(f"HM {results['hm']:.2f}")
        if model.use_tokens:
            results["fusion_weights"] = dict(zip(("cls",) + ATTRIBUTES, model.alpha().tolist()))
        results["timing"] = {"train_s": t1 - t0, "eval_s": time.time() - t1}
        data.write_json(folder.file("results.json"), results)
        data.remove(folder.file("checkpoint.pt"))
        folder.log(f"wrote {folder.file('results.json')}")
        return results


# 8. Predict and explain, on your own images

# a colour scale from black through purple and red to pale yellow (as matplotlib's "inferno"): on a
# grey image, it cannot be taken for an object's own colour
HEAT = np.array([[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], float)


def heat(values):
    """Values in [0, 1] [...] -> RGB colours [..., 3] (uint8) on the HEAT scale."""
    stops = np.linspace(0, 1, len(HEAT))
    return np.stack([np.interp(values, stops, HEAT[:, i]) for i in range(3)], -1).astype(np.uint8)


def draw_explain(rows, path, size=160):
    """The --explain sheet, a row per image: its title (file, prediction), the image, then a tile
    per map: the image in grey under the map's heat (each patch's share of the attention, on the
    scale at the row's end). rows: (title, image, maps [1+K, P], labels, heads per map)."""
    height = size + 44
    scale = Image.fromarray(heat(np.linspace(1, 0, size)[:, None].repeat(24, 1)))  # 1 at the top
    page = Image.new("RGB", (size * (2 + K) + 90, height * len(rows)), "white")
    draw = ImageDraw.Draw(page)
    for y, (title, image, maps, labels, heads) in zip(range(0, page.height, height), rows):
        grey = np.asarray(image.convert("L").resize((size, size)), dtype=float)[..., None]
        top = float(maps.max().clamp_min(1e-12))
        g = int(maps.shape[-1] ** 0.5)
        tiles = [image.resize((size, size))]
        for m, hs in zip(maps, heads):
            share = Image.fromarray((m.view(g, g) / top).numpy().astype(np.float32))
            share = np.asarray(share.resize((size, size), Image.BICUBIC)).clip(0, 1)
            tiles.append(Image.fromarray((0.35 * grey + 0.65 * heat(share)).astype(np.uint8)))
            if not hs:  # no head lets this token see the patches: say so
                tiles[-1] = Image.new("RGB", (size, size), "white")
                note = "no head of the last\nblock lets it see\nthe patches"
                ImageDraw.Draw(tiles[-1]).text((6, size // 2 - 18), note, fill="black")
        draw.text((4, y + 2), title, fill="black")
        for i, (tile, label) in enumerate(zip(tiles, ["image"] + labels)):
            page.paste(tile, (i * size, y + 44))
            draw.text((i * size + 2, y + 18), label, fill="black")
        x = size * len(tiles) + 8
        page.paste(scale, (x, y + 44))
        draw.text((x, y + 18), "attention\nper patch", fill="black")
        draw.text((x + 28, y + 44), f"{100 * top:.1f}%", fill="black")
        draw.text((x + 28, y + 32 + size), "0%", fill="black")
    data.atomic_write(path, lambda tmp: page.save(tmp, format="PNG"))


def predict(argv):
    parser = data.Parser(prog="dear.py predict", description="Classify (and explain) images.")
    parser.add_argument("images", nargs="+", help="image files")
    parser.add_argument("--load", required=True, help="a finished run folder")
    parser.add_argument("--classes", help="a file of class names, one a line (default: the run's)")
    parser.add_argument("--template", help="the prompt template (default: the run's)")
    parser.add_argument("--explain", help="a PNG: what CLS and the tokens attend to in block L")
    parser.add_argument("--json", action="store_true", help="JSON instead of text")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    a = parser.parse_args(argv)
    saved = read_config(a.load)
    c = resolve(Config(**saved["config"], device=a.device))
    own = os.path.join(a.load, "roles.json")
    trained = os.path.join(a.load, "model.pt") if c.method == "dear" else None
    model = build(c, print, own if os.path.exists(own) else None, trained)[0]
    names = data.read_text(a.classes, "one class name a line") if a.classes else saved["classes"]
    template = a.template or saved["template"]
    if "{}" not in template:
        raise UserError(f"--template {template!r} has no {{}} for the class name")
    data.check_prompts(names, template)
    model.eval().set_classes(names, template)
    images = [data.open_image(f, "pass image files (PNG, JPEG, ...)") for f in a.images]
    preprocess = clip.transform(model.clip.visual.input_resolution)
    x = torch.stack([preprocess(im) for im in images]).to(c.device)
    with torch.no_grad():
        out = model(x)
    keys = ("cls",) + ATTRIBUTES if model.use_tokens else ("cls",)
    alpha = dict(zip(keys, model.alpha().tolist() if model.use_tokens else [1.0]))
    top = out["fused"].softmax(-1).topk(min(5, len(names)))  # [B, 5]
    report = []
    for i, f in enumerate(a.images):
        top5 = [[names[j], p] for p, j in zip(top.values[i].tolist(), top.indices[i].tolist())]
        picks = out["logits"][i].argmax(-1).tolist()  # [1+K]: each logit set's own pick
        evidence = {k: {"alpha": alpha[k], "top": names[j]} for k, j in zip(keys, picks)}
        report.append({"image": f, "top5": top5, "evidence": evidence})
        if not a.json:
            print(f + ": " + ", ".join(f"{n} {p:.1%}" for n, p in top5))
            sets = [f"{k} (alpha {v['alpha']:.2f}) {v['top']}" for k, v in evidence.items()]
            print("  by logit set: " + ", ".join(sets))
    if a.explain:
        if not model.use_tokens:
            raise UserError(f"--explain: {a.load} has no attribute tokens to explain")
        maps, heads = model.attention_maps(x)  # [B, 1+K, P]
        labels = [f"CLS (alpha {alpha['cls']:.2f})"]
        for k, hs in zip(ATTRIBUTES, heads[1:]):
            expert = hs and model.roles and model.roles[-1][hs[0]]["role"] == "attribute"
            which = "mixed heads" if hs else "no head"
            labels.append(f"{k} (head {','.join(map(str, hs))})" if expert else f"{k} ({which})")
        rows = [(f"{f}: {r['top5'][0][0]} {r['top5'][0][1]:.0%}", im, m, labels, heads)
                for f, r, im, m in zip(a.images, report, images, maps.cpu())]
        draw_explain(rows, a.explain)
        print(f"wrote {a.explain}")
    if a.json:
        print(json.dumps(report, indent=1))
    return report


def roles_only(c: Config):
    """The roles a run would mask with, copied from the cache into OUT/roles/J<J>/ (where tables.py
    reads them)."""
    source = os.path.dirname(build(c, print)[1])
    dest = data.writable_folder(os.path.join(c.out, "roles", f"J{c.J}"))
    for name in ("roles.json", "roles.md", "roles.png"):
        copy = functools.partial(shutil.copyfile, os.path.join(source, name))
        data.atomic_write(os.path.join(dest, name), copy)
    print(f"roles copied to {dest}")


def call(argv):
    if argv[:1] == ["predict"]:
        return predict(argv[1:])
    cfg = parse_args(argv)
    if cfg.roles_only:
        refuse_unread(cfg)
        return roles_only(resolve(cfg))
    results = run(cfg)
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

"""Config: every setting of a run, the per-dataset tables its defaults come from, and `resolve`.

A Config holds None wherever a default depends on the dataset or the protocol; `resolve` fills each None
from the tables below and checks every value, so that a resolved Config says exactly what a run does.
The tables are MMRL's and MMRL++'s published recipes (repositories, files and commits are named at each
table). `CHOICES` lists the allowed values of the fields that take a name; the command line (dear.py)
offers exactly these as argparse choices, and `resolve` checks them for callers that build a Config in code.

Used by runs.py and dear.py; imports train.py (the precision names) only.
"""
import dataclasses
import math
import os
from dataclasses import dataclass

from train import PRECISIONS

# Per-dataset (beta, lambda_reg) for base-to-novel and few-shot: MMRL++'s table (yunncheng/MMRL at 27d8821,
# the MMRL++ training scripts). A dataset not listed gets beta 0.9 and lambda_reg 1.0 (MMRL's default weight).
DATASET_DEFAULTS = {
    "imagenet":       (0.9, 0.2),
    "fgvc_aircraft":  (0.9, 2.0),
    "ucf101":         (0.9, 3.0),
    "dtd":            (0.9, 7.0),
    "oxford_pets":    (0.7, 0.01),
    "stanford_cars":  (0.7, 6.0),
    "caltech101":     (0.6, 3.0),
    "sun397":         (0.5, 3.0),
    "oxford_flowers": (0.4, 7.0),
    "eurosat":        (0.2, 0.01),
    "food101":        (0.1, 1.0),
}
XD_DEFAULTS = (0.9, 0.1)  # beta, lambda_reg of the ImageNet source model (cross-dataset / domain gen.)
# MMRL++'s test-time beta of each target of cross-dataset / domain generalisation: the ImageNet model is
# evaluated on each target with this beta. --target-beta source uses the source's beta instead.
XD_TARGET_BETA = {
    "imagenetv2": 0.9, "imagenet_r": 0.9, "imagenet_a": 0.8, "imagenet_sketch": 0.7,
    "fgvc_aircraft": 0.9, "ucf101": 0.9, "sun397": 0.7, "oxford_pets": 0.6, "caltech101": 0.6,
    "dtd": 0.5, "oxford_flowers": 0.4, "stanford_cars": 0.3, "eurosat": 0.3, "food101": 0.3,
}

# (epochs, batch size, warm-up epochs) per protocol, MMRL's configs (yunncheng/MMRL at 27d8821,
# configs/trainers/MMRL/), and per (protocol, dataset) where it differs (MMRL's few-shot script gives
# ImageNet its vit_b16_imagenet config). The toy world's tiny CLIP needs more steps to fit 16 shots (20
# epochs: with the toy CLIP's 400 pretraining steps, the first `python dear.py --dataset toyworld` stays
# under 3 minutes on 2 CPU cores).
SCHEDULES = {
    "b2n":                  (10, 4, 1),
    ("b2n", "imagenet"):    (5, 32, 1),
    ("b2n", "toyworld"):    (20, 4, 1),
    "fewshot":              (50, 32, 1),
    ("fewshot", "imagenet"): (5, 32, 1),
    "xd":                   (1, 32, 0),
}
# Smallest area of RandomResizedCrop: MMRL's 0.5; the toy world's objects sit in a corner a crop would cut.
CROP_SCALE = {"toyworld": 1.0}

# The allowed values of every field that takes a name (argparse choices on the command line).
CHOICES = {
    "protocol": ("b2n", "fewshot", "xd"),
    "method": ("dear", "zeroshot"),
    "mask": ("role", "generalization-only", "none"),
    "novel_logits": ("fused", "cls"),
    "target_beta": ("table", "source"),
    "roles_control": ("none", "random", "oracle"),
    "precision": PRECISIONS,
}


@dataclass
class Config:
    # what to run
    dataset: str = "eurosat"
    root: str = "data"
    protocol: str = "b2n"             # b2n | fewshot | xd
    method: str = "dear"              # dear | zeroshot
    shots: int = 16
    seed: int = 1
    backbone: str = None              # a clip.available_models() name or a checkpoint path; None =
                                      # ViT-B/16 ("toy": toyworld.py's tiny CLIP, default for toyworld)
    targets: str = ""                 # xd: comma-separated targets ("" = the 4 variants + 10 datasets)
    out: str = "runs"
    # the method (paper names)
    J: int = None                     # tokens enter block J (1-based) and live in blocks J..L;
                                      # None = default_J(L): 9 of 12 blocks (ViT-B), 3 of 4 (toy)
    beta: float = None                # token mixing; None = the DATASET_DEFAULTS table
    lambda_reg: float = None          # self-regularisation weight; None = the table
    lambda_fusion: float = 1.0        # weight of -log alpha_cls
    alpha_cls: float = 0.7            # initial fusion weight of the class logits (the rest: 5 tokens)
    rep_dim: int = 512                # width of the shared token matrix R
    mask: str = "role"                # role | generalization-only | none
    attr_tokens: bool = True          # False: no tokens at all (ablation); the model is frozen CLIP
    novel_logits: str = "fused"       # fused | cls: logits used on novel classes and target datasets
    target_beta: str = "table"        # xd targets: table (XD_TARGET_BETA) | source (the source's beta)
    roles: str = None                 # roles JSON; None = computed once by entropy.py and cached
    roles_control: str = "none"       # none | random | oracle: controls for Concept Entropy
    # optimisation
    epochs: int = None                # None = SCHEDULES
    batch_size: int = None
    warmup_epochs: int = None
    crop_scale: float = None          # smallest crop area of the training augmentation; None = table
    lr: float = 1e-3
    warmup_lr: float = 1e-5
    weight_decay: float = 5e-4
    eval_batch_size: int = 100
    workers: int = None               # data-loading processes; None = min(4, CPUs this process may use)
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    precision: str = "amp"            # amp (fp16 + GradScaler on CUDA, fp32 on CPU) | fp16 | bf16 | fp32;
                                      # runs.run records the one used (fp16, bf16 or fp32)
    # bookkeeping
    eval_only: bool = False
    load: str = None
    resume: bool = False
    force: bool = False
    roles_only: bool = False          # only compute/find the head roles, copy them to <out>/roles/J<J>/


def resolve(cfg: Config) -> Config:
    """Fill every None with its default from the tables above; check values. Returns a new Config."""
    c = dataclasses.replace(cfg)
    for field, allowed in CHOICES.items():
        if getattr(c, field) not in allowed:
            flag = "--" + field.replace("_", "-")
            raise ValueError(f"unknown {flag} {getattr(c, field)!r}; choose " + ", ".join(allowed))
    if c.backbone is None:
        c.backbone = "toy" if c.dataset == "toyworld" else "ViT-B/16"
    beta, lam = XD_DEFAULTS if c.protocol == "xd" else DATASET_DEFAULTS.get(c.dataset, (0.9, 1.0))
    c.beta = beta if c.beta is None else c.beta
    c.lambda_reg = lam if c.lambda_reg is None else c.lambda_reg
    epochs, batch, warmup = SCHEDULES.get((c.protocol, c.dataset), SCHEDULES[c.protocol])
    c.crop_scale = CROP_SCALE.get(c.dataset, 0.5) if c.crop_scale is None else c.crop_scale
    c.workers = min(4, available_cpus()) if c.workers is None else c.workers
    c.epochs = epochs if c.epochs is None else c.epochs
    c.batch_size = batch if c.batch_size is None else c.batch_size
    c.warmup_epochs = warmup if c.warmup_epochs is None else c.warmup_epochs
    check_numbers(c)
    return c


def check_numbers(c: Config):
    """The checks argparse cannot make: ranges and finiteness of the numbers of a filled Config."""
    numbers = {"beta": c.beta, "lambda-reg": c.lambda_reg, "lambda-fusion": c.lambda_fusion,
               "alpha-cls": c.alpha_cls, "lr": c.lr, "warmup-lr": c.warmup_lr,
               "weight-decay": c.weight_decay, "crop-scale": c.crop_scale}
    for flag, value in numbers.items():
        if not math.isfinite(value):
            raise ValueError(f"--{flag} must be a finite number, got {value}")
    checks = [(c.J is None or c.J >= 1, f"--J counts blocks from 1, got {c.J}"),
              (c.lr > 0 and c.warmup_lr > 0, f"--lr must be positive, got {c.lr}"),
              (c.weight_decay >= 0 and c.lambda_reg >= 0 and c.lambda_fusion >= 0,
               "--weight-decay, --lambda-reg and --lambda-fusion must be >= 0"),
              (c.shots >= 1, f"--shots must be >= 1, got {c.shots}"),
              (c.workers >= 0, f"--workers must be >= 0, got {c.workers}"),
              (0.0 <= c.beta <= 1.0, f"--beta must lie in [0, 1], got {c.beta}"),
              (0.0 < c.alpha_cls < 1.0, f"--alpha-cls must lie in (0, 1), got {c.alpha_cls}"),
              (c.epochs >= 1 and c.batch_size >= 1, "--epochs and --batch-size must be >= 1"),
              (0.0 < c.crop_scale <= 1.0, f"--crop-scale must lie in (0, 1], got {c.crop_scale}")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def data_root() -> str:
    """The default --root: $DATA, else "data"."""
    return os.environ.get("DATA", Config.root)


def available_cpus() -> int:
    """CPUs this process may run on (the DataLoader warns when it gets more workers than that)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_J(num_layers: int) -> int:
    """J when none is given: the last quarter of the blocks carry tokens (J = 9 of 12, the paper's)."""
    return num_layers - num_layers // 4


def eval_beta(c: Config, dataset: str) -> float:
    """The beta an evaluation on `dataset` uses: the run's beta, except for the targets of xd, which get
    MMRL++'s test-time beta (XD_TARGET_BETA) unless --target-beta source; a target not in the table keeps
    the run's."""
    if c.protocol != "xd" or dataset == c.dataset or c.target_beta == "source":
        return c.beta
    return XD_TARGET_BETA.get(dataset, c.beta)

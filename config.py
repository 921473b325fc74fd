"""Config: every setting of a run, the tables its defaults come from, `resolve`, and the flags.

A Config holds None wherever a default depends on the dataset or the protocol; `resolve` fills each
None from the tables below and checks every value, so that a resolved Config says exactly what a run
does. The tables are MMRL's and MMRL++'s published recipes (the config each row comes from is named
at each table). `CHOICES` lists the allowed values of the fields that take a name: `parse_args`
(the command line of dear.py, one flag per field) offers exactly these as argparse choices, and
`resolve` checks them for callers that build a Config in code.

Used by runs.py and dear.py; imports clip, data, toyworld (names in the help) and train.
"""

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass

import clip
import data
import toyworld
from train import PRECISIONS

# Per-dataset (beta, lambda_reg) for base-to-novel and few-shot: MMRL++'s table (yunncheng/MMRL at
# 27d8821, trainer MMRLpp). A dataset not listed gets beta 0.9 and lambda_reg 1.0 (MMRL's default).
DATASET_DEFAULTS = {
    "imagenet": (0.9, 0.2),
    "fgvc_aircraft": (0.9, 2.0),
    "ucf101": (0.9, 3.0),
    "dtd": (0.9, 7.0),
    "oxford_pets": (0.7, 0.01),
    "stanford_cars": (0.7, 6.0),
    "caltech101": (0.6, 3.0),
    "sun397": (0.5, 3.0),
    "oxford_flowers": (0.4, 7.0),
    "eurosat": (0.2, 0.01),
    "food101": (0.1, 1.0),
}
XD_DEFAULTS = (0.9, 0.1)  # beta, lambda_reg of the ImageNet source of cross-dataset / domain gen.
# MMRL++'s test-time beta of each target of cross-dataset / domain generalisation: the ImageNet
# model is evaluated on each target with this beta. --target-beta source uses the source's beta
# instead.
XD_TARGET_BETA = {
    "imagenetv2": 0.9,
    "imagenet_r": 0.9,
    "imagenet_a": 0.8,
    "imagenet_sketch": 0.7,
    "fgvc_aircraft": 0.9,
    "ucf101": 0.9,
    "sun397": 0.7,
    "oxford_pets": 0.6,
    "caltech101": 0.6,
    "dtd": 0.5,
    "oxford_flowers": 0.4,
    "stanford_cars": 0.3,
    "eurosat": 0.3,
    "food101": 0.3,
}

# (epochs, batch size, warm-up epochs, learning rate) per protocol, and per (protocol, dataset)
# where it differs. Each row is one published config of yunncheng/MMRL at 27d8821, never a mix:
#   b2n      MMRL's vit_b16 (ImageNet: vit_b16_imagenet)
#   fewshot  MMRL++'s configs/trainers/MMRLpp/vit_b16_few_shot.yaml, which goes with MMRL++'s
#            beta / lambda_reg table above (ImageNet: vit_b16_imagenet, as MMRL's few-shot script)
#   xd       MMRL's vit_b16_cross_datasets (no warm-up)
# The toy world keeps the recipe its tables were made with: its tiny CLIP needs 20 b2n epochs to
# fit 16 shots (the first `python dear.py --dataset toyworld` stays under 3 minutes on 2 CPU
# cores), and its few-shot runs keep 50 epochs at lr 1e-3.
SCHEDULES = {
    "b2n": (10, 4, 1, 1e-3),
    ("b2n", "imagenet"): (5, 32, 1, 1e-3),
    ("b2n", "toyworld"): (20, 4, 1, 1e-3),
    "fewshot": (100, 32, 1, 2e-3),
    ("fewshot", "imagenet"): (5, 32, 1, 1e-3),
    ("fewshot", "toyworld"): (50, 32, 1, 1e-3),
    "xd": (1, 32, 0, 1e-3),
}
# Smallest area of RandomResizedCrop: MMRL's 0.5; the toy world's objects sit in a corner a crop
# would cut.
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
    "eval_precision": ("fp32", "fp16", "bf16"),
}


@dataclass
class Config:
    # what to run
    dataset: str = "eurosat"
    root: str = "data"
    protocol: str = "b2n"  # b2n | fewshot | xd
    method: str = "dear"  # dear | zeroshot
    shots: int = 16
    seed: int = 1
    backbone: str = None  # a clip.available_models() name or a checkpoint path; None =
    # ViT-B/16 ("toy": toyworld.py's tiny CLIP, default for
    # toyworld)
    targets: str = ""  # xd: comma-separated targets ("": 4 variants + 10 datasets)
    out: str = "runs"
    # the method (paper names)
    J: int = None  # tokens enter block J (1-based) and live in blocks J..L;
    # None = default_J(L): 9 of 12 blocks (ViT-B), 3 of 4 (toy)
    beta: float = None  # token mixing; None = the DATASET_DEFAULTS table
    lambda_reg: float = None  # self-regularisation weight; None = the table
    lambda_fusion: float = 1.0  # weight of -log alpha_cls
    alpha_cls: float = 0.7  # initial fusion weight of the class logits (rest: tokens)
    rep_dim: int = 512  # width of the shared token matrix R
    mask: str = "role"  # role | generalization-only | none
    attr_tokens: bool = True  # False: no tokens at all (ablation); the model is frozen CLIP
    novel_logits: str = "fused"  # fused | cls: the logits of novel classes and xd targets
    target_beta: str = "table"  # xd targets: table (XD_TARGET_BETA) | source (its beta)
    roles: str = None  # roles JSON; None = computed once by entropy.py and cached
    roles_control: str = "none"  # none | random | oracle: controls for Concept Entropy
    # optimisation
    epochs: int = None  # None = SCHEDULES
    batch_size: int = None
    warmup_epochs: int = None
    crop_scale: float = None  # smallest crop area of the augmentation; None = table
    lr: float = None  # None = SCHEDULES (1e-3; few-shot 2e-3, ImageNet 1e-3)
    warmup_lr: float = 1e-5
    weight_decay: float = 5e-4
    eval_batch_size: int = 100
    workers: int = None  # data loaders; None = min(4, CPUs this process may use)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "amp"  # amp (fp16 + GradScaler on CUDA, fp32 on CPU) | fp16 | bf16 |
    # fp32; runs.run records the one used (fp16, bf16 or fp32)
    eval_precision: str = "fp32"  # fp32 (as MMRL's test()) | fp16 | bf16: autocast, frozen
    # weights in that dtype; runs.run records the one used
    # bookkeeping
    eval_only: bool = False
    load: str = None
    resume: bool = False
    force: bool = False
    roles_only: bool = False  # only find the head roles, copy them to <out>/roles/J<J>/


def resolve(cfg: Config) -> Config:
    """Fill every None with its default from the tables above; check values. Returns a new
    Config."""
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
    epochs, batch, warmup, lr = SCHEDULES.get((c.protocol, c.dataset), SCHEDULES[c.protocol])
    c.crop_scale = CROP_SCALE.get(c.dataset, 0.5) if c.crop_scale is None else c.crop_scale
    c.workers = min(4, available_cpus()) if c.workers is None else c.workers
    c.epochs = epochs if c.epochs is None else c.epochs
    c.batch_size = batch if c.batch_size is None else c.batch_size
    c.warmup_epochs = warmup if c.warmup_epochs is None else c.warmup_epochs
    c.lr = lr if c.lr is None else c.lr
    check_numbers(c)
    return c


def check_numbers(c: Config):
    """The checks argparse cannot make: ranges and finiteness of the numbers of a filled Config."""
    numbers = {
        "beta": c.beta,
        "lambda-reg": c.lambda_reg,
        "lambda-fusion": c.lambda_fusion,
        "alpha-cls": c.alpha_cls,
        "lr": c.lr,
        "warmup-lr": c.warmup_lr,
        "weight-decay": c.weight_decay,
        "crop-scale": c.crop_scale,
    }
    for flag, value in numbers.items():
        if not math.isfinite(value):
            raise ValueError(f"--{flag} must be a finite number, got {value}")
    checks = [
        (c.J is None or c.J >= 1, f"--J counts blocks from 1, got {c.J}"),
        (c.lr > 0, f"--lr must be positive, got {c.lr}"),
        (c.warmup_lr > 0, f"--warmup-lr must be positive, got {c.warmup_lr}"),
        (
            c.weight_decay >= 0 and c.lambda_reg >= 0 and c.lambda_fusion >= 0,
            "--weight-decay, --lambda-reg and --lambda-fusion must be >= 0",
        ),
        (c.shots >= 1, f"--shots must be >= 1, got {c.shots}"),
        (c.workers >= 0, f"--workers must be >= 0, got {c.workers}"),
        (0.0 <= c.beta <= 1.0, f"--beta must lie in [0, 1], got {c.beta}"),
        (0.0 < c.alpha_cls < 1.0, f"--alpha-cls must lie in (0, 1), got {c.alpha_cls}"),
        (c.epochs >= 1 and c.batch_size >= 1, "--epochs and --batch-size must be >= 1"),
        (0.0 < c.crop_scale <= 1.0, f"--crop-scale must lie in (0, 1], got {c.crop_scale}"),
    ]
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
    """J when none is given: the last quarter of the blocks carry tokens (9 of 12, the paper's)."""
    return num_layers - num_layers // 4


def eval_beta(c: Config, dataset: str) -> float:
    """The beta an evaluation on `dataset` uses: the run's beta, except for the targets of xd, which
    get MMRL++'s test-time beta (XD_TARGET_BETA) unless --target-beta source; a target not in the
    table keeps the run's."""
    if c.protocol != "xd" or dataset == c.dataset or c.target_beta == "source":
        return c.beta
    return XD_TARGET_BETA.get(dataset, c.beta)


# ----------------------------------------------------------------------------------------------
# The command line: one flag per field


def split_targets(values) -> list:
    """--targets as given (the flag may be repeated): a value that starts with folder: is one
    target, taken whole; any other value is a comma-separated list of names."""
    found = []
    for value in values:
        found += [value] if value.startswith("folder:") else [t for t in value.split(",") if t]
    return found


def parse_args(argv=None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(
        description="DeAR: adapt CLIP with attribute tokens and role-based per-head attention "
        "masks.",
        epilog="Examples:\n"
        "  python dear.py --dataset toyworld                # offline demo, tiny CLIP, "
        "minutes on a CPU\n"
        "  python dear.py --dataset eurosat --shots 16      # base-to-novel, seed 1, "
        "ViT-B/16\n"
        "  python dear.py --dataset imagenet --protocol xd  # ImageNet -> 4 variants + 10 "
        "datasets\n\nEnvironment: DATA (default --root), CLIP_CACHE (CLIP checkpoints, the "
        "toy CLIP and the head roles;\n  default ~/.cache/clip), DEAR_CACHE (the split files "
        "data.py cannot write beside a read-only dataset;\n  default ~/.cache/dear)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument(
        "--dataset",
        default=d.dataset,
        help="one of " + ", ".join(data.DATASETS) + ", or folder:PATH (default: %(default)s)",
    )
    g.add_argument(
        "--root",
        default=data_root(),
        help="folder holding the datasets in the CoOp layout (default: $DATA or data)",
    )
    g.add_argument(
        "--protocol",
        default=d.protocol,
        choices=CHOICES["protocol"],
        help="b2n: train on the base classes, test base and novel; fewshot: all "
        "classes; xd: train on the source (ImageNet), test it and --targets "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--method",
        default=d.method,
        choices=CHOICES["method"],
        help="zeroshot: frozen CLIP with the dataset's template, through the same code "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--shots",
        type=int,
        default=d.shots,
        help="training images per class (default: %(default)s)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of the few-shot subset and the run (default: %(default)s)",
    )
    g.add_argument(
        "--backbone",
        default=None,
        help="CLIP name ("
        + ", ".join(clip.available_models() + [toyworld.BACKBONE])
        + ") or a checkpoint path (default: ViT-B/16; toy for --dataset toyworld)",
    )
    g.add_argument(
        "--targets",
        action="append",
        default=None,
        help="xd: target datasets, comma-separated or the flag repeated; a folder:PATH "
        "target is taken whole, commas and all (default: the 4 ImageNet variants "
        "and the other 10 datasets)",
    )
    g.add_argument(
        "--out",
        default=d.out,
        help="output root; every run gets its own folder (default: %(default)s)",
    )
    g = p.add_argument_group("the method (the paper's names)")
    g.add_argument(
        "--J",
        type=int,
        default=None,
        help="attribute tokens enter block J (1-based) and stay to the last block "
        "(default: 9 of 12 blocks; the last quarter of the blocks in general)",
    )
    g.add_argument(
        "--beta",
        type=float,
        default=None,
        help="token mixing (default: per-dataset table, 0.9 otherwise)",
    )
    g.add_argument(
        "--lambda-reg",
        type=float,
        default=None,
        help="self-regularisation weight (default: per-dataset table)",
    )
    g.add_argument(
        "--lambda-fusion",
        type=float,
        default=d.lambda_fusion,
        help="weight of -log alpha_cls (default: %(default)s)",
    )
    g.add_argument(
        "--alpha-cls",
        type=float,
        default=d.alpha_cls,
        help="initial fusion weight of the class logits; each attribute gets (1 - it) / "
        "5 (default: %(default)s)",
    )
    g.add_argument(
        "--rep-dim",
        type=int,
        default=d.rep_dim,
        help="width of the shared token matrix R (default: %(default)s)",
    )
    g.add_argument(
        "--mask",
        default=d.mask,
        choices=CHOICES["mask"],
        help="role-based per-head mask, or an ablation variant (default: %(default)s)",
    )
    g.add_argument(
        "--no-attr-tokens",
        dest="attr_tokens",
        action="store_false",
        help="ablation: no attribute tokens at all (the model is then frozen CLIP)",
    )
    g.add_argument(
        "--novel-logits",
        default=d.novel_logits,
        choices=CHOICES["novel_logits"],
        help="logits on novel classes and target datasets; cls is MMRL's class-only "
        "rule (default: %(default)s)",
    )
    g.add_argument(
        "--target-beta",
        default=d.target_beta,
        choices=CHOICES["target_beta"],
        help="xd: beta of each target dataset; table: MMRL++'s test-time beta per "
        "target (ImageNet-V2 0.9 ... Food101 0.3), source: the source's beta for "
        "every target (default: %(default)s)",
    )
    g.add_argument(
        "--roles",
        default=None,
        help="roles JSON written by entropy.py (default: computed once and cached)",
    )
    g.add_argument(
        "--roles-control",
        default=d.roles_control,
        choices=CHOICES["roles_control"],
        help="control for Concept Entropy: random = each block's roles shuffled among "
        "its heads (seeded by --seed; role counts kept); oracle = roles from the "
        "toy world's ground-truth probes (default: %(default)s)",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="default: 10 (b2n), 20 (b2n toyworld), 100 (fewshot: MMRL++'s few-shot "
        "config), 5 (ImageNet b2n and fewshot), 1 (xd)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="default: 4 (b2n), 32 (ImageNet b2n, fewshot, xd)",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help="AdamW learning rate (default: per protocol, 1e-3; 2e-3 for fewshot, as "
        "MMRL++'s few-shot config; 1e-3 for ImageNet fewshot, as vit_b16_imagenet)",
    )
    g.add_argument(
        "--warmup-epochs",
        type=int,
        default=None,
        help="epochs at --warmup-lr before the cosine schedule (default: 1; 0 for xd)",
    )
    g.add_argument("--warmup-lr", type=float, default=d.warmup_lr, help="(default: %(default)s)")
    g.add_argument(
        "--crop-scale",
        type=float,
        default=None,
        help="smallest area of the training RandomResizedCrop (default: 0.5; 1.0 for toyworld)",
    )
    g.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help="(default: %(default)s)"
    )
    g.add_argument(
        "--eval-batch-size", type=int, default=d.eval_batch_size, help="(default: %(default)s)"
    )
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="data-loading processes (default: 4, or fewer on a machine with fewer CPUs)",
    )
    g.add_argument(
        "--device", default=d.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)"
    )
    g.add_argument(
        "--precision",
        default=d.precision,
        choices=CHOICES["precision"],
        help="training precision. amp: MMRL's PREC amp, autocast fp16 + GradScaler on "
        "CUDA, fp32 on CPU; fp16: autocast fp16 + GradScaler, on CUDA or CPU; "
        "bf16: autocast bf16 (CUDA, or CPU autocast); fp32: no autocast. "
        "Parameters stay fp32 and the logits, fusion and loss are fp32 in every "
        "mode; the precision used is part of the run's identity and recorded in "
        "config.json and results.json (default: %(default)s)",
    )
    g.add_argument(
        "--eval-precision",
        default=d.eval_precision,
        choices=CHOICES["eval_precision"],
        help="evaluation runs in fp32 as MMRL's test(), whatever the training "
        "precision; fp16/bf16 evaluate under autocast with the frozen weights in "
        "that dtype, faster on a GPU, only when asked (default: %(default)s)",
    )
    g = p.add_argument_group("runs")
    g.add_argument(
        "--eval-only",
        action="store_true",
        help="evaluate the model of --load on --dataset / --protocol",
    )
    g.add_argument(
        "--load", default=None, help="a finished run folder (holding model.pt and config.json)"
    )
    g.add_argument(
        "--resume", action="store_true", help="continue an interrupted run from its last checkpoint"
    )
    g.add_argument(
        "--force", action="store_true", help="redo a finished run, or restart an interrupted one"
    )
    g.add_argument(
        "--roles-only",
        action="store_true",
        help="only compute (or find) the head roles and copy them to OUT/roles/J<J>/ "
        "(run_all.sh's roles stage)",
    )
    args = p.parse_args(argv)
    args.targets = split_targets(args.targets) if args.targets else d.targets
    return Config(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(Config)
            if hasattr(args, f.name)
        }
    )

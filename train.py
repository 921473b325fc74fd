"""The training loop and the evaluation that dear.py runs: MMRL's protocol in plain PyTorch.

Nothing here is specific to DeAR's idea; dear.py holds the method (tokens, masks, fusion, loss) and hands
its model and loss to `train`. Read top to bottom:

  1. The learning-rate schedule (closed form of Dassl's constant warm-up + per-epoch cosine)
  2. Devices, precision (--precision, the frozen weights kept in the autocast dtype), seeds, the seeded epoch
     order and augmentation
  3. train: AdamW, autocast, one train_step, checkpoints inside and between epochs, --resume
  4. evaluate: top-1 accuracy of the fused (or class-only) logits, per class too

Precision (MMRL's PREC "amp"): the model's parameters stay fp32; the frozen towers run under torch.autocast,
fp16 with a GradScaler by default on CUDA, bf16 or fp32 when asked; the final head (cosine logits, the alpha
fusion) and the loss are computed in fp32 outside autocast (dear.py). On CPU the default is fp32, and
`--precision bf16` runs the same mixed-precision path through CPU autocast.

Used by dear.py (and bench.py); imports data.py and util.py only.
"""
import contextlib
import io
import math
import os
import random
import time

import numpy as np
import torch

import data
from util import fmt_time, write_atomic, write_json_atomic

# ----------------------------------------------------------------------------------------------
# 1. The schedule


def lr_at(epoch: int, cfg) -> float:
    """Learning rate of a 0-based epoch: warm-up epochs at a constant warmup_lr, then cosine stepped once per
    epoch, lr * (1 + cos(pi * (e - W) / E)) / 2 (Dassl's ConstantWarmupScheduler + CosineAnnealingLR)."""
    if epoch < cfg.warmup_epochs:
        return cfg.warmup_lr
    return cfg.lr * (1 + math.cos(math.pi * (epoch - cfg.warmup_epochs) / cfg.epochs)) / 2


# ----------------------------------------------------------------------------------------------
# 2. Devices, precision, seeds and the epoch order


class RunError(Exception):
    """A problem the user can fix; the CLI prints the message and exits with status 2."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"--device {name} was asked for but CUDA is not available here; use --device cpu")
    return torch.device(name)


PRECISIONS = ("amp", "fp16", "bf16", "fp32")


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision a run uses on `device`: fp16, bf16 or fp32.

    amp (the default, MMRL's PREC "amp"): fp16 autocast with a GradScaler on CUDA, fp32 elsewhere.
    fp16: CUDA only (the GradScaler and the fp16 kernels it relies on are CUDA's; on CPU use bf16).
    bf16: CUDA with bf16 support, or CPU autocast (how the mixed-precision path is tested without a GPU).
    fp32: no autocast anywhere (the reference)."""
    if precision not in PRECISIONS:
        raise RunError(f"unknown --precision {precision!r}; choose " + ", ".join(PRECISIONS))
    if precision == "amp":
        return "fp16" if device.type == "cuda" else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise RunError("--precision fp16 needs a CUDA device (autocast fp16 with a GradScaler); "
                       "on a CPU use --precision bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RunError("--precision bf16: this GPU does not support bfloat16; use --precision fp16 (or amp)")
    return precision


def autocast_dtype(device: torch.device, precision: str = "amp"):
    """The autocast dtype of a precision on device: torch.float16, torch.bfloat16, or None (fp32, no autocast)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[resolve_precision(precision, device)]


def autocast(device: torch.device, dtype):
    """torch.autocast for dtype, or a no-op context for None (fp32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def matmul_weights(clip_model):
    """The frozen CLIP tensors that only ever enter autocast's low-precision ops (linear, conv, matmul):
    Linear and Conv weights and biases, the attention in_proj, proj and text_projection. Not LayerNorms,
    embeddings or logit_scale, which stay fp32."""
    for m in clip_model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            yield from m.parameters(recurse=False)
        elif hasattr(m, "in_proj_weight"):  # clip.model.MultiheadAttention
            yield m.in_proj_weight
            yield m.in_proj_bias
    yield clip_model.visual.proj
    yield clip_model.text_projection


@contextlib.contextmanager
def frozen_weights_in(dtype, clip_model):
    """Inside the block, the frozen CLIP's matmul weights are stored in the autocast dtype; the fp32 originals
    come back on exit (so the fp32 path, checkpoints and anything after train/evaluate see fp32).

    Autocast casts a weight at every op unless it requires grad (its cache holds only trainable leaves), so a
    frozen ViT-B/16 has about 160 tensors recast at every step. Casting them once gives the same numbers (the
    same round-to-nearest cast, once instead of every time); run the model under autocast inside the block.
    dtype None (fp32): nothing changes."""
    if dtype is None:
        yield
        return
    saved = [(p, p.data) for p in matmul_weights(clip_model) if not p.requires_grad]
    try:
        for p, full in saved:
            p.data = full.to(dtype)
        yield
    finally:
        for p, full in saved:
            p.data = full


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Augmented(torch.utils.data.Dataset):
    """Training items with augmentations seeded per (epoch seed, item): an epoch is the same on any machine,
    with any number of workers, and a resumed epoch replays exactly. Items are asked for by (epoch seed, index),
    so workers that live across epochs (persistent) get each epoch's seed with every item."""

    def __init__(self, items, transform):
        self.images = data.ImageList(items, transform)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, key):
        seed, i = key
        torch.manual_seed(seed * 1_000_003 + i)
        return self.images[i]


class EpochSampler:
    """The batch sampler of the one training DataLoader: train() sets `batches` (lists of (epoch seed, index))
    before every epoch, and the loader's persistent workers load them."""

    def __init__(self):
        self.batches = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def epoch_batches(n: int, batch_size: int, seed: int):
    """The shuffled batches of one epoch (index lists); the last partial batch is dropped as in Dassl."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    if n >= batch_size:
        order = order[: n - n % batch_size]
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def atomic_save(obj, path: str, as_json=False):
    """A JSON file or a torch checkpoint, written to a temporary file and renamed (never half a file)."""
    if as_json:
        return write_json_atomic(path, obj, indent=2)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(path, buffer.getvalue())


# ----------------------------------------------------------------------------------------------
# 3. Training


def train_step(model, images, labels, loss_fn, opt, scaler, amp):
    """One optimisation step: the model under autocast (amp: its dtype, None: fp32), the loss outside it (the
    model's head and loss_fn compute in fp32), backward through the GradScaler (enabled for fp16 only), AdamW.
    Returns (loss, parts, out), all on the device: nothing here waits for the device."""
    with autocast(images.device, amp):
        out = model(images, with_frozen=True)
    loss, parts = loss_fn(model, out, labels)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # .grad holds the true gradients (fp16: the step is skipped if any is inf or nan)
    scaler.step(opt)
    scaler.update()
    return loss, parts, out


def train(model, ds, cfg, device, rdir, log, loss_fn, ckpt_every_s=600.0):
    """Train the trainable parameters on ds.train with loss_fn(model, out, labels) -> (loss, parts dict of
    0-dim tensors) in cfg.precision; checkpoints at every epoch end (and every ckpt_every_s seconds inside an
    epoch) into rdir/checkpoint.pt, which --resume continues from.

    The device is waited for only at log lines and before a checkpoint: the loss, its parts and the accuracy
    are summed on the device, and a non-finite loss is noticed there, before anything is saved, so the
    checkpoint on disk is always the last good one."""
    params = [p for p in model.trainable() if p.requires_grad]
    if not params:
        log("no trainable parameters (no attribute tokens): nothing to train, the model is frozen CLIP")
        return
    model.set_classes(ds.classnames, ds.template)  # fp32, before the frozen weights change dtype
    precision = resolve_precision(cfg.precision, device)
    amp = autocast_dtype(device, precision)
    # fused AdamW on CUDA: the same update in one kernel, and with the GradScaler it skips an inf step on the
    # device instead of asking the host
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    transform = data.train_transform(model.clip.visual.input_resolution, min_scale=cfg.crop_scale)
    ckpt, start_epoch, start_step = os.path.join(rdir, "checkpoint.pt"), 0, 0
    if os.path.exists(ckpt):
        try:
            state = torch.load(ckpt, map_location=device, weights_only=True)
            saved_precision = state.get("precision", precision)
            if saved_precision == precision:
                model.load_state_dict(state["model"], strict=False)
                opt.load_state_dict(state["optimizer"])
                scaler.load_state_dict(state["scaler"])
                start_epoch, start_step = state["epoch"], state["step"]
        except Exception as e:  # a truncated file, another run's checkpoint, or not a checkpoint at all
            raise RunError(f"the checkpoint {ckpt} cannot be resumed ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); pass --force to start the run over") from None
        if saved_precision != precision:
            raise RunError(f"{ckpt} was written with --precision {saved_precision}; resume with that "
                           f"precision (this run has {precision}), or pass --force to start over")
        log(f"resuming from {ckpt}: epoch {start_epoch + 1}, step {start_step}")

    def save(epoch, step):
        atomic_save({"model": model.trainable_state(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                     "precision": precision, "epoch": epoch, "step": step}, ckpt)

    steps = len(epoch_batches(len(ds.train), cfg.batch_size, 0))
    sampler = EpochSampler()
    loader = torch.utils.data.DataLoader(  # one loader, its workers alive across epochs
        Augmented(ds.train, transform), batch_sampler=sampler, num_workers=cfg.workers,
        pin_memory=device.type == "cuda", persistent_workers=cfg.workers > 0)
    step_ids = torch.arange(steps, device=device)
    total, done, t_start, last_save = (cfg.epochs - start_epoch) * steps - start_step, 0, time.time(), time.time()
    with frozen_weights_in(amp, model.clip):
        for epoch in range(start_epoch, cfg.epochs):
            for group in opt.param_groups:
                group["lr"] = lr_at(epoch, cfg)
            epoch_seed = cfg.seed * 1000 + epoch
            first = start_step if epoch == start_epoch else 0
            sampler.batches = [[(epoch_seed, i) for i in b]
                               for b in epoch_batches(len(ds.train), cfg.batch_size, epoch_seed)[first:]]
            model.train()
            sums = torch.zeros(3, device=device)     # since the last log line: loss, ce, steps
            correct = torch.zeros((), device=device)  # this epoch
            bad, names, seen = None, [], 0  # bad: the first non-finite step of the epoch (index, loss, parts)

            def check():
                """Wait for the device: [loss sum, ce sum, steps, correct] for the log line; stop if a loss since
                the last check was not finite (before anything is saved)."""
                stats = torch.cat([sums, correct[None]] + ([] if bad is None else [bad])).tolist()
                if len(stats) > 4 and stats[4] >= 0:
                    detail = ", ".join(f"{k} {v:.4g}" for k, v in zip(names, stats[6:]))
                    raise RunError(f"the loss became {stats[5]} at epoch {epoch + 1}, step {int(stats[4]) + 1} "
                                   f"(parts: {detail}); the last good checkpoint is kept in {ckpt}. Try a lower "
                                   "--lr, or --precision fp32 to rule out a mixed-precision overflow.")
                return stats[:4]

            for step, (images, labels) in enumerate(loader, start=first):
                seen += labels.numel()
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                loss, parts, out = train_step(model, images, labels, loss_fn, opt, scaler, amp)
                with torch.no_grad():  # bookkeeping on the device, no host synchronisation
                    loss, names = loss.detach().float(), list(parts)
                    sums += torch.stack([loss, parts["ce"].detach().float(), torch.ones_like(loss)])
                    correct += (out["fused"].argmax(-1) == labels).sum()
                    row = torch.stack([step_ids[step].float(), loss] + [parts[k].detach().float() for k in names])
                    if bad is None:
                        bad = torch.full_like(row, -1.0)
                    bad = torch.where((bad[0] < 0) & ~torch.isfinite(loss), row, bad)
                done += 1
                if step + 1 == steps or done % max(1, steps // 5) == 0:
                    loss_sum, ce_sum, n, right = check()
                    sums.zero_()
                    eta = (time.time() - t_start) / done * (total - done)
                    log(f"epoch {epoch + 1}/{cfg.epochs} step {step + 1}/{steps} loss {loss_sum / n:.4f} "
                        f"(ce {ce_sum / n:.3f}) lr {lr_at(epoch, cfg):.2e} acc {100 * right / seen:.1f}% "
                        f"eta {fmt_time(eta)}")
                if time.time() - last_save > ckpt_every_s and step + 1 < steps:
                    check()
                    save(epoch, step + 1)
                    last_save = time.time()
            check()
            save(epoch + 1, 0)
            last_save = time.time()


# ----------------------------------------------------------------------------------------------
# 4. Evaluation


@torch.no_grad()
def evaluate(model, items, classnames, template, cfg, device, logits="fused", log=print, name=""):
    """Top-1 accuracy (%) of `logits` ("fused" or "cls") on items in cfg.precision; class text features computed
    once; hits counted on the device (the host waits once, at the end)."""
    model.eval()
    model.set_classes(classnames, template)  # fp32, before the frozen weights change dtype
    amp = autocast_dtype(device, cfg.precision)
    loader = torch.utils.data.DataLoader(
        data.ImageList(items, data.test_transform(model.clip.visual.input_resolution)),
        batch_size=cfg.eval_batch_size, shuffle=False, num_workers=cfg.workers, pin_memory=device.type == "cuda")
    C = len(classnames)
    correct = torch.zeros(C, dtype=torch.long, device=device)
    count = torch.zeros(C, dtype=torch.long, device=device)
    t_start, n_batches = time.time(), len(loader)
    with frozen_weights_in(amp, model.clip):
        with autocast(device, amp):
            t = model.encode_classes()  # [C, E], once for the whole evaluation
        for i, (images, labels) in enumerate(loader):
            with autocast(device, amp):
                out = model(images.to(device, non_blocking=True), t=t)  # the head is fp32 (DeAR.forward)
            scores = out["fused"] if logits == "fused" else out["logits"][:, 0]
            labels = labels.to(device, non_blocking=True)
            correct.index_add_(0, labels, (scores.argmax(-1) == labels).long())
            count.index_add_(0, labels, torch.ones_like(labels))
            if (i + 1) % max(1, n_batches // 5) == 0 and i + 1 < n_batches:
                eta = (time.time() - t_start) / (i + 1) * (n_batches - i - 1)
                log(f"  eval {name}: {i + 1}/{n_batches} batches, eta {fmt_time(eta)}")
    correct, count = correct.cpu(), count.cpu()
    acc = 100.0 * correct.sum().item() / max(1, count.sum().item())
    per_class = [{"class": c, "accuracy": 100.0 * correct[k].item() / max(1, count[k].item()), "n": count[k].item()}
                 for k, c in enumerate(classnames)]
    return {"accuracy": acc, "n": int(count.sum()), "logits": logits, "per_class": per_class}

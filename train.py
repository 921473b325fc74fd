"""The training loop and the evaluation that dear.py runs: MMRL's protocol in plain PyTorch.

Nothing here is specific to DeAR's idea; dear.py holds the method (tokens, masks, fusion, loss) and hands
its model and loss to `train`. Read top to bottom:

  1. The learning-rate schedule (closed form of Dassl's constant warm-up + per-epoch cosine)
  2. Devices, precision, seeds, the seeded epoch order and augmentation
  3. train: AdamW, autocast, checkpoints inside and between epochs, --resume
  4. evaluate: top-1 accuracy of the fused (or class-only) logits, per class too

Used by dear.py (and bench.py); imports data.py and util.py only.
"""
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


def autocast_dtype(device: torch.device):
    """CUDA: bf16 where supported, else fp16 (with a GradScaler); CPU: None (plain fp32)."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Augmented(torch.utils.data.Dataset):
    """Training items with augmentations seeded per (epoch seed, item): an epoch is the same on any machine,
    with any number of workers, and a resumed epoch replays exactly."""

    def __init__(self, items, transform, seed: int):
        self.images, self.seed = data.ImageList(items, transform), seed

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        torch.manual_seed(self.seed * 1_000_003 + i)
        return self.images[i]


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


def train(model, ds, cfg, device, rdir, log, loss_fn, ckpt_every_s=600.0):
    """Train the trainable parameters on ds.train with loss_fn(model, out, labels) -> (loss, parts dict);
    checkpoints at every epoch end (and every ckpt_every_s
    seconds inside an epoch) into rdir/checkpoint.pt, which --resume continues from."""
    params = [p for p in model.trainable() if p.requires_grad]
    if not params:
        log("no trainable parameters (no attribute tokens): nothing to train, the model is frozen CLIP")
        return
    model.set_classes(ds.classnames, ds.template)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    amp = autocast_dtype(device)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    transform = data.train_transform(model.clip.visual.input_resolution, min_scale=cfg.crop_scale)
    ckpt, start_epoch, start_step = os.path.join(rdir, "checkpoint.pt"), 0, 0
    if os.path.exists(ckpt):
        try:
            state = torch.load(ckpt, map_location=device, weights_only=True)
            model.load_state_dict(state["model"], strict=False)
            opt.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
            start_epoch, start_step = state["epoch"], state["step"]
        except Exception as e:  # a truncated file, another run's checkpoint, or not a checkpoint at all
            raise RunError(f"the checkpoint {ckpt} cannot be resumed ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); pass --force to start the run over") from None
        log(f"resuming from {ckpt}: epoch {start_epoch + 1}, step {start_step}")

    def save(epoch, step):
        atomic_save({"model": model.trainable_state(), "optimizer": opt.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "step": step}, ckpt)

    steps = len(epoch_batches(len(ds.train), cfg.batch_size, 0))
    total, done, t_start, last_save = (cfg.epochs - start_epoch) * steps - start_step, 0, time.time(), time.time()
    for epoch in range(start_epoch, cfg.epochs):
        for group in opt.param_groups:
            group["lr"] = lr_at(epoch, cfg)
        epoch_seed = cfg.seed * 1000 + epoch
        batches = epoch_batches(len(ds.train), cfg.batch_size, epoch_seed)
        first = start_step if epoch == start_epoch else 0
        loader = torch.utils.data.DataLoader(
            Augmented(ds.train, transform, epoch_seed), batch_sampler=batches[first:],
            num_workers=cfg.workers, pin_memory=device.type == "cuda", persistent_workers=False)
        model.train()
        correct = seen = 0
        for step, (images, labels) in enumerate(loader, start=first):
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                out = model(images, with_frozen=True)
                loss, parts = loss_fn(model, out, labels)
            if not torch.isfinite(loss):
                raise RunError(f"the loss became {loss.item()} at epoch {epoch + 1}, step {step + 1} "
                               f"(parts: {parts}); the last good checkpoint is kept in {ckpt}. Try a lower --lr, "
                               "or --device cpu to rule out a mixed-precision overflow.")
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            correct += (out["fused"].argmax(-1) == labels).sum().item()
            seen += labels.numel()
            done += 1
            if step + 1 == steps or done % max(1, steps // 5) == 0:
                eta = (time.time() - t_start) / done * (total - done)
                log(f"epoch {epoch + 1}/{cfg.epochs} step {step + 1}/{steps} loss {loss.item():.4f} "
                    f"(ce {parts['ce']:.3f}) lr {lr_at(epoch, cfg):.2e} acc {100 * correct / seen:.1f}% eta {fmt_time(eta)}")
            if time.time() - last_save > ckpt_every_s and step + 1 < steps:
                save(epoch, step + 1)
                last_save = time.time()
        save(epoch + 1, 0)
        last_save = time.time()


# ----------------------------------------------------------------------------------------------
# 4. Evaluation


@torch.no_grad()
def evaluate(model, items, classnames, template, cfg, device, logits="fused", log=print, name=""):
    """Top-1 accuracy (%) of `logits` ("fused" or "cls") on items; class text features computed once."""
    model.eval()
    model.set_classes(classnames, template)
    amp = autocast_dtype(device)
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        t = model.encode_classes()  # [C, E], once for the whole evaluation
    loader = torch.utils.data.DataLoader(
        data.ImageList(items, data.test_transform(model.clip.visual.input_resolution)),
        batch_size=cfg.eval_batch_size, shuffle=False, num_workers=cfg.workers, pin_memory=device.type == "cuda")
    C = len(classnames)
    correct, count = torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.long)
    t_start, n_batches = time.time(), len(loader)
    for i, (images, labels) in enumerate(loader):
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            out = model(images.to(device, non_blocking=True), t=t)
        scores = out["fused"] if logits == "fused" else out["logits"][:, 0]
        hit = (scores.argmax(-1).cpu() == labels).long()
        correct.index_add_(0, labels, hit)
        count.index_add_(0, labels, torch.ones_like(labels))
        if (i + 1) % max(1, n_batches // 5) == 0 and i + 1 < n_batches:
            eta = (time.time() - t_start) / (i + 1) * (n_batches - i - 1)
            log(f"  eval {name}: {i + 1}/{n_batches} batches, eta {fmt_time(eta)}")
    acc = 100.0 * correct.sum().item() / max(1, count.sum().item())
    per_class = [{"class": c, "accuracy": 100.0 * correct[k].item() / max(1, count[k].item()), "n": count[k].item()}
                 for k, c in enumerate(classnames)]
    return {"accuracy": acc, "n": int(count.sum()), "logits": logits, "per_class": per_class}



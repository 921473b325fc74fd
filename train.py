"""The training loop and the evaluation that dear.py runs: MMRL's protocol in plain PyTorch.

Nothing here is specific to DeAR's idea; dear.py holds the method (tokens, masks, fusion, loss) and
hands its model and loss to `train`. Read top to bottom:

  1. The learning-rate schedule (closed form of Dassl's constant warm-up + per-epoch cosine)
  2. Devices, precision (--precision, the frozen weights kept in the autocast dtype), seeds, the
     seeded epoch order and augmentation
  3. train: AdamW, autocast, one train_step, the GradScaler's skipped steps, checkpoints inside and
     between epochs, --resume
  4. evaluate: top-1 accuracy of the fused (or class-only) logits, per true class too, in fp32
     unless asked

Precision (MMRL's PREC "amp"): the model's parameters stay fp32; in training the frozen towers run
under torch.autocast, fp16 with a GradScaler by default on CUDA, bf16 or fp32 when asked; the final
head (cosine logits, the alpha fusion) and the loss are computed in fp32 outside autocast (dear.py).
On CPU the default is fp32, and `--precision fp16` (CPU autocast with a CPU GradScaler: CUDA's
default code path) or `bf16` runs the mixed-precision path there. Steps the GradScaler skips (an
inf/nan gradient: the first steps of every fp16 run, while it finds its scale) are counted on the
device, shown on the log lines and returned by train. Evaluation runs in fp32 (fp32 weights, no
autocast) as MMRL's test() does, unless cfg.eval_precision asks for fp16 or bf16.

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
    """Learning rate of a 0-based epoch: warm-up epochs at a constant warmup_lr, then cosine stepped
    once per epoch, lr * (1 + cos(pi * (e - W) / E)) / 2 (Dassl's ConstantWarmupScheduler +
    CosineAnnealingLR)."""
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
        raise RunError(
            f"--device {name} was asked for but CUDA is not available here; use --device cpu"
        )
    return torch.device(name)


PRECISIONS = ("amp", "fp16", "bf16", "fp32")


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision a run uses on `device`: fp16, bf16 or fp32.

    amp (the default, MMRL's PREC "amp"): fp16 autocast with a GradScaler on CUDA, fp32 elsewhere.
    fp16: fp16 autocast with a GradScaler, on CUDA or on a CPU (CPU autocast and
    torch.amp.GradScaler("cpu"): the CUDA default's code path, which is how the test suite runs it
    without a GPU). bf16: CUDA with bf16 support, or CPU autocast.
    fp32: no autocast anywhere (the reference)."""
    if precision not in PRECISIONS:
        raise RunError(f"unknown --precision {precision!r}; choose " + ", ".join(PRECISIONS))
    if precision == "amp":
        return "fp16" if device.type == "cuda" else "fp32"
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RunError(
            "--precision bf16: this GPU does not support bfloat16; use --precision fp16 (or amp)"
        )
    return precision


def autocast_dtype(device: torch.device, precision: str = "amp"):
    """The autocast dtype of a precision on device: torch.float16, torch.bfloat16, or None (fp32,
    no autocast)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[
        resolve_precision(precision, device)
    ]


def autocast(device: torch.device, dtype):
    """torch.autocast for dtype, or a no-op context for None (fp32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def matmul_weights(clip_model):
    """The frozen CLIP tensors that only ever enter autocast's low-precision ops (linear, conv,
    matmul): Linear and Conv weights and biases, the attention in_proj, proj and text_projection.
    Not LayerNorms,
    embeddings or logit_scale, which stay fp32."""
    for m in clip_model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            yield from m.parameters(recurse=False)
        elif hasattr(m, "in_proj_weight"):  # clip.model.MultiheadAttention
            yield m.in_proj_weight
            yield m.in_proj_bias
    yield clip_model.visual.proj
    yield clip_model.text_projection


def frozen_weights(dtype, clip_model):
    """The generator of the context manager frozen_weights_in (below). Inside the block, the frozen
    CLIP's matmul weights are stored in the autocast dtype; the fp32 originals
    come back on exit (so the fp32 path, checkpoints and anything after train/evaluate see fp32).

    Autocast casts a weight at every op unless it requires grad (its cache holds only trainable
    leaves), so a frozen ViT-B/16 has about 160 tensors recast at every step. Casting them once
    gives the same numbers (the same round-to-nearest cast, once instead of every time); run the
    model under autocast inside the block.
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


# contextmanager applied here, not as a decorator, and no_grad as a `with` block in evaluate: mutmut
# (mutate.sh) skips decorated functions.
frozen_weights_in = contextlib.contextmanager(frozen_weights)


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Augmented(torch.utils.data.Dataset):
    """Training items with augmentations seeded per (epoch seed, item): an epoch is the same on any
    machine, with any number of workers, and a resumed epoch replays exactly. Items are asked for by
    (epoch seed, index),
    so workers that live across epochs (persistent) get each epoch's seed with every item."""

    def __init__(self, items, transform):
        self.images = data.ImageList(items, transform)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, key):
        seed, i = key
        # the CPU generator the transform draws from; torch.manual_seed would also queue a seed for
        # every accelerator backend, with a stack trace each (0.2 ms per item)
        torch.default_generator.manual_seed(seed * 1_000_003 + i)
        return self.images[i]


class EpochSampler:
    """The batch sampler of the one training DataLoader: train() sets `batches` (lists of
    (epoch seed, index)) before every epoch, and the loader's persistent workers load them."""

    def __init__(self):
        self.batches = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def epoch_batches(n: int, batch_size: int, seed: int):
    """The shuffled batches of one epoch (index lists);
    the last partial batch is dropped as in Dassl."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    if n >= batch_size:
        order = order[: n - n % batch_size]
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def atomic_save(obj, path: str, as_json=False):
    """A JSON file or a torch checkpoint, written to a temporary file and renamed (never half a
    file)."""
    if as_json:
        return write_json_atomic(path, obj, indent=2)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(path, buffer.getvalue())


# ----------------------------------------------------------------------------------------------
# 3. Training


def train_step(model, images, labels, loss_fn, opt, scaler, amp):
    """One optimisation step: the model under autocast (amp: its dtype, None: fp32), the loss
    outside it (the model's head and loss_fn compute in fp32), backward through the GradScaler
    (enabled for fp16 only), AdamW.
    Returns (loss, parts, out), all on the device: nothing here waits for the device."""
    with autocast(images.device, amp):
        out = model(images, with_frozen=True)
    loss, parts = loss_fn(model, out, labels)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    # .grad holds the true gradients (fp16: the step is skipped if any is inf or nan)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return loss, parts, out


def make_scaler(device: torch.device, amp):
    """train.train's GradScaler: enabled for fp16 only, of the device's own type (cuda or cpu)."""
    return torch.amp.GradScaler(device.type, enabled=amp == torch.float16)


def scale_of(scaler, device):
    """The GradScaler's current scale as a 0-dim fp32 tensor on the device, without waiting for it.

    Before its first step a scaler holds its scale as a Python number (get_scale() returns it
    without a sync); afterwards as a device tensor that update() changes in place (read here through
    the private
    `_scale`, since get_scale() would wait for the device). Disabled scaler: 1."""
    if not scaler.is_enabled():
        return torch.ones((), device=device)
    if scaler._scale is None:
        return torch.tensor(float(scaler.get_scale()), device=device)
    return scaler._scale.detach().clone().float().reshape(())


def resume(ckpt, model, opt, scaler, precision, device, log):
    """Load rdir/checkpoint.pt if there is one: (epoch, step, skipped steps so far) to continue
    from, or (0, 0, 0). A checkpoint resumes only in the precision it was written with."""
    if not os.path.exists(ckpt):
        return 0, 0, 0
    try:
        state = torch.load(ckpt, map_location=device, weights_only=True)
        saved_precision = state.get("precision", precision)
        if saved_precision == precision:
            model.load_state_dict(state["model"], strict=False)
            opt.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
        epoch, step = state["epoch"], state["step"]
    except Exception as e:  # a truncated file, another run's checkpoint, or not a checkpoint at all
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise RunError(
            f"the checkpoint {ckpt} cannot be resumed ({type(e).__name__}: "
            f"{first_line}); pass --force to start the run over"
        ) from None
    if saved_precision != precision:
        raise RunError(
            f"{ckpt} was written with --precision {saved_precision}; resume with that "
            f"precision (this run has {precision}), or pass --force to start over"
        )
    log(f"resuming from {ckpt}: epoch {epoch + 1}, step {step}")
    return epoch, step, state.get("skipped_steps", 0)


def train(model, ds, cfg, device, rdir, log, loss_fn, ckpt_every_s=600.0):
    """Train the trainable parameters on ds.train with loss_fn(model, out, labels) -> (loss, parts
    dict of 0-dim tensors) in cfg.precision; checkpoints at every epoch end (and every ckpt_every_s
    seconds inside an epoch) into rdir/checkpoint.pt, which --resume continues from. Returns
    {"steps": steps taken by this call, "skipped_steps": steps the GradScaler skipped (an inf/nan
    gradient; fp16 only; the whole run, across resumes), "final_scale": the GradScaler's scale at
    the end (None unless fp16)}.

    The device is waited for only at log lines and before a checkpoint (wait_and_check): the running
    sums live on the device, and a non-finite loss is noticed there, before anything is saved, so
    the checkpoint on disk is always the last good one."""
    params = [p for p in model.trainable() if p.requires_grad]
    if not params:
        log(
            "no trainable parameters (no attribute tokens): "
            "nothing to train, the model is frozen CLIP"
        )
        return {"steps": 0, "skipped_steps": 0, "final_scale": None}
    model.set_classes(ds.classnames, ds.template)  # fp32, before the frozen weights change dtype
    precision = resolve_precision(cfg.precision, device)
    amp = autocast_dtype(device, precision)
    # fused AdamW on CUDA: the same update in one kernel, and with the GradScaler it skips an inf
    # step on the device instead of asking the host
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    scaler = make_scaler(device, amp)
    ckpt = os.path.join(rdir, "checkpoint.pt")
    start_epoch, start_step, skipped_before = resume(
        ckpt, model, opt, scaler, precision, device, log
    )

    def save(epoch, step, skipped):
        atomic_save(
            {
                "model": model.trainable_state(),
                "optimizer": opt.state_dict(),
                "scaler": scaler.state_dict(),
                "precision": precision,
                "epoch": epoch,
                "step": step,
                "skipped_steps": skipped,
            },
            ckpt,
        )

    transform = data.train_transform(model.clip.visual.input_resolution, min_scale=cfg.crop_scale)
    steps = len(epoch_batches(len(ds.train), cfg.batch_size, 0))  # per epoch
    sampler = EpochSampler()
    loader = torch.utils.data.DataLoader(  # one loader, its workers alive across epochs
        Augmented(ds.train, transform),
        batch_sampler=sampler,
        num_workers=cfg.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=cfg.workers > 0,
    )
    step_ids = torch.arange(steps, device=device).float()  # the step index as a device number
    zero = torch.zeros((), device=device)
    # running sums on the device, read only by wait_and_check
    skipped = zero + skipped_before  # steps the GradScaler skipped, the whole run
    scale = scale_of(scaler, device)  # the scale before the next step
    first_bad = None  # [step, loss, *parts] of the epoch's first non-finite loss; step -1: none yet
    total = (cfg.epochs - start_epoch) * steps - start_step
    done, t_start, last_save, skipped_read = 0, time.time(), time.time(), skipped_before

    def wait_and_check(epoch, sums):
        """Wait for the device, once: the numbers of the log line. The one place that stops
        on a non-finite loss (the epoch's first), before anything is saved."""
        names = list(sums)
        bad = [] if first_bad is None else [first_bad]  # [step, loss, *parts]; step -1: none
        stacked = torch.stack([sums[k] for k in names] + [skipped])
        values = torch.cat([stacked] + bad).tolist()  # the one wait
        got = dict(zip(names + ["skipped"], values))
        bad = values[len(names) + 1 :]
        if bad and bad[0] >= 0:
            detail = ", ".join(f"{k} {v:.4g}" for k, v in zip(part_names, bad[2:]))
            raise RunError(
                f"the loss became {bad[1]} at epoch {epoch + 1}, step {int(bad[0]) + 1} "
                f"(parts: {detail}); the last good checkpoint is kept in {ckpt}. Try a "
                "lower --lr, or --precision fp32 to rule out a mixed-precision "
                "overflow."
            )
        return got

    with frozen_weights_in(amp, model.clip):
        for epoch in range(start_epoch, cfg.epochs):
            for group in opt.param_groups:
                group["lr"] = lr_at(epoch, cfg)
            epoch_seed = cfg.seed * 1000 + epoch
            first = start_step if epoch == start_epoch else 0
            sampler.batches = [
                [(epoch_seed, i) for i in b]
                for b in epoch_batches(len(ds.train), cfg.batch_size, epoch_seed)[first:]
            ]
            model.train()
            # since the last log line: loss, ce, steps; this epoch: correct
            sums = {k: zero.clone() for k in ("loss", "ce", "n", "correct")}
            first_bad, part_names, seen = None, [], 0
            for step, (images, labels) in enumerate(loader, start=first):
                seen += labels.numel()
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                loss, parts, out = train_step(model, images, labels, loss_fn, opt, scaler, amp)
                with torch.no_grad():  # bookkeeping on the device, no host synchronisation
                    loss, part_names = loss.detach().float(), list(parts)
                    sums["loss"] += loss
                    sums["ce"] += parts["ce"].detach().float()
                    sums["n"] += 1
                    sums["correct"] += (out["fused"].argmax(-1) == labels).sum()
                    if scaler.is_enabled():  # the scale goes down iff the GradScaler skipped
                        new_scale = scale_of(scaler, device)
                        skipped += (new_scale < scale).float()
                        scale = new_scale
                    row = torch.stack(
                        [step_ids[step], loss] + [parts[k].detach().float() for k in part_names]
                    )
                    if first_bad is None:
                        first_bad = torch.full_like(row, -1.0)
                    new_bad = (first_bad[0] < 0) & ~torch.isfinite(loss)  # the first one only
                    first_bad = torch.where(new_bad, row, first_bad)
                done += 1
                if step + 1 == steps or done % max(1, steps // 5) == 0:
                    got = wait_and_check(epoch, sums)
                    skipped_read = int(got["skipped"])
                    for k in ("loss", "ce", "n"):
                        sums[k].zero_()
                    eta = (time.time() - t_start) / done * (total - done)
                    log(
                        f"epoch {epoch + 1}/{cfg.epochs} step {step + 1}/{steps} loss "
                        f"{got['loss'] / got['n']:.4f} (ce {got['ce'] / got['n']:.3f}) "
                        f"lr {lr_at(epoch, cfg):.2e} acc {100 * got['correct'] / seen:.1f}% "
                        + (f"skipped {skipped_read} " if scaler.is_enabled() else "")
                        + f"eta {fmt_time(eta)}"
                    )
                if time.time() - last_save > ckpt_every_s and step + 1 < steps:
                    skipped_read = int(wait_and_check(epoch, sums)["skipped"])
                    save(epoch, step + 1, skipped_read)
                    last_save = time.time()
            skipped_read = int(wait_and_check(epoch, sums)["skipped"])
            save(epoch + 1, 0, skipped_read)
            last_save = time.time()
    final_scale = float(scaler.get_scale()) if scaler.is_enabled() else None
    return {"steps": done, "skipped_steps": skipped_read, "final_scale": final_scale}


# ----------------------------------------------------------------------------------------------
# 4. Evaluation


def eval_precision(cfg, device: torch.device) -> str:
    """The precision evaluate runs in: cfg.eval_precision, fp32 unless asked (MMRL evaluates in
    fp32: its model is clip_model.float() under PREC amp and its test() has no autocast), whatever
    cfg.precision is."""
    return resolve_precision(getattr(cfg, "eval_precision", "fp32"), device)


def evaluate(model, items, classnames, template, cfg, device, logits="fused", log=print, name=""):
    """Top-1 accuracy (%) of `logits` ("fused" or "cls") on items, overall and per true class, in
    eval_precision(cfg) (fp32: fp32 weights, no autocast; fp16/bf16: autocast with the frozen
    weights stored in that dtype); class text features computed once; hits counted on the device
    (the host waits once, at
    the end)."""
    model.eval()
    model.set_classes(classnames, template)  # fp32, before the frozen weights change dtype
    precision = eval_precision(cfg, device)
    amp = autocast_dtype(device, precision)
    loader = torch.utils.data.DataLoader(
        data.ImageList(items, data.test_transform(model.clip.visual.input_resolution)),
        batch_size=cfg.eval_batch_size,
        shuffle=False,
        num_workers=cfg.workers,
        pin_memory=device.type == "cuda",
    )
    C = len(classnames)
    correct = torch.zeros(C, dtype=torch.long, device=device)  # per true class
    count = torch.zeros(C, dtype=torch.long, device=device)
    t_start, n_batches = time.time(), len(loader)
    with torch.no_grad(), frozen_weights_in(amp, model.clip):  # set_classes: no_grad too
        with autocast(device, amp):
            t = model.encode_classes()  # [C, E], once for the whole evaluation
        for i, (images, labels) in enumerate(loader):
            with autocast(device, amp):
                # the head is fp32 (DeAR.forward)
                out = model(images.to(device, non_blocking=True), t=t)
            scores = out["fused"] if logits == "fused" else out["logits"][:, 0]  # [B, C]
            labels = labels.to(device, non_blocking=True)
            correct.index_add_(0, labels, (scores.argmax(-1) == labels).long())
            count.index_add_(0, labels, torch.ones_like(labels))
            if (i + 1) % max(1, n_batches // 5) == 0 and i + 1 < n_batches:
                eta = (time.time() - t_start) / (i + 1) * (n_batches - i - 1)
                log(f"  eval {name}: {i + 1}/{n_batches} batches, eta {fmt_time(eta)}")
    correct, count = correct.cpu(), count.cpu()
    acc = 100.0 * correct.sum().item() / max(1, count.sum().item())
    per_class = [
        {
            "class": c,
            "accuracy": 100.0 * correct[k].item() / max(1, count[k].item()),
            "n": count[k].item(),
        }
        for k, c in enumerate(classnames)
    ]
    return {
        "accuracy": acc,
        "n": int(count.sum()),
        "logits": logits,
        "precision": precision,
        "per_class": per_class,
    }

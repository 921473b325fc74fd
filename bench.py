"""Speed bench: what a DeAR training step and a DeAR evaluation cost next to the frozen CLIP.

DeAR trains only tokens and two small maps, so a training step should cost little more than a frozen
CLIP forward pass. Measured in one process, on one device, with random weights of the real shapes
(nothing is downloaded), contenders interleaved (A B A B ...) so that outside load hits both alike;
medians over repeats.
  a. vendored CLIP vs a plain reference on nn.MultiheadAttention (OpenAI's layout), same weights;
     outputs agree
  b. one DeAR training step (train.train_step, what train.train runs) vs one frozen CLIP forward of
     the batch and of all class prompts
  c. the same DeAR step written the naive way vs ours      d. DeAR evaluation vs zero-shot CLIP
  e. peak memory of a training step

    python bench.py --tiny                      # the tiny test model: seconds
    python bench.py --device cuda --repeats 10  # ViT-B/16 shapes on a GPU
    python bench.py --device cpu --classes 10,100 --batches 4,4 --repeats 1  # ViT-B/16, small CPU

Precision (--precision, dear.py's names): amp, the default, is fp16 autocast with a GradScaler on
CUDA and fp32 on a CPU; under autocast the frozen CLIP's matmul weights are stored in that dtype
while the contenders run (train.frozen_weights_in), as in train.train and train.evaluate.
"""

import argparse
import ctypes
import ctypes.util
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads; see BENCH.md
import platform
import statistics
import sys
import time
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

import clip
import dear
import train
from clip.model import CLIP
from dear import ATTRIBUTES, K
from util import fmt_time, write_atomic

# OpenAI's ViT-B/16 hyper-parameters (CLIP constructor arguments) and the tiny test model of
# tests/conftest.py
VIT_B16 = dict(
    embed_dim=512,
    image_resolution=224,
    vision_layers=12,
    vision_width=768,
    vision_patch_size=16,
    context_length=77,
    vocab_size=49408,
    transformer_width=512,
    transformer_heads=8,
    transformer_layers=12,
)
TINY = dict(
    embed_dim=32,
    image_resolution=32,
    vision_layers=4,
    vision_width=64,
    vision_patch_size=8,
    context_length=77,
    vocab_size=49408,
    transformer_width=64,
    transformer_heads=4,
    transformer_layers=2,
    vision_heads=4,
)
# A narrower model with ViT-B/16's depth and token counts (224px / patch 16, 77-token context): the
# 1000-class x 32-image setting in reach of a CPU
NARROW = dict(
    VIT_B16,
    embed_dim=256,
    vision_width=384,
    vision_heads=6,
    transformer_width=256,
    transformer_heads=4,
)
# Targets of the DeAR step / frozen forward ratio (classes, batch)
TRAIN_TARGETS = {(10, 4): "<= 1.45", (1000, 32): "<= 1.15"}
# classes, batches (the training settings), eval_batch (images per batch in a. and d.), prompts (a.)
DEFAULTS = {
    "cuda": dict(
        classes=[10, 100, 1000], batches=[4, 4, 32], eval_batch=100, prompts=1000, narrow=[]
    ),
    "cpu": dict(classes=[10, 100], batches=[4, 4], eval_batch=4, prompts=10, narrow=[(1000, 32)]),
    "tiny": dict(classes=[10, 100], batches=[4, 8], eval_batch=16, prompts=100, narrow=[]),
}
TEMPLATE = "a photo of a {}."
# made-up class names of two to four words, so prompts are about as long as real ones
WORDS = (
    ("red", "green", "blue", "yellow", "black", "white", "brown", "grey", "orange", "purple"),
    ("round", "long", "flat", "tall", "small", "large", "spotted", "striped", "curly", "pointed"),
    ("bird", "dog", "car", "flower", "boat", "chair", "lamp", "shoe", "fish", "house"),
)


def classnames(n: int):
    """n distinct class names; every 7th gets a longer name (the longest prompts set the text
    length)."""
    names = []
    for i in range(n):
        a, b, c = WORDS[0][i % 10], WORDS[1][i // 10 % 10], WORDS[2][i // 100 % 10]
        name = f"{a} {b} {c}" + (f" number {i // 1000}" if i >= 1000 else "")
        names.append(name + " of the northern hills" if i % 7 == 0 else name)
    return names


def bench_roles(J: int, L: int, H: int):
    """A deterministic made-up role table for blocks J..L (1-based): generalization, attribute,
    mixed and other-specialist heads in turn, attribute heads cycling through the five
    attributes."""
    kinds = ("generalization", "attribute", "mixed", "specialist")
    roles = {}
    for layer in range(J, L + 1):
        row = []
        for h in range(H):
            kind = kinds[(layer + h) % len(kinds)]
            row.append(
                {
                    "role": kind,
                    "attribute": ATTRIBUTES[(layer * H + h) % K] if kind == "attribute" else None,
                }
            )
        roles[layer] = row
    return roles


# ----------------------------------------------------------------------------------------------
# The reference CLIP: the plainest way, on nn.MultiheadAttention, sequence-first as OpenAI's
# original. Parameter names equal the vendored model's, so its state dict loads strictly.


class RefLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.float()).to(x.dtype)  # fp32 math, cast back (as CLIP)


class RefQuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)  # CLIP's GELU approximation


class RefBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads)  # expects [L, N, D]
        self.ln_1 = RefLayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(width, 4 * width)),
                    ("gelu", RefQuickGELU()),
                    ("c_proj", nn.Linear(4 * width, width)),
                ]
            )
        )
        self.ln_2 = RefLayerNorm(width)

    def forward(self, x, attn_mask=None):
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=attn_mask)[0]
        return x + self.mlp(self.ln_2(x))


class RefTransformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int):
        super().__init__()
        self.resblocks = nn.ModuleList([RefBlock(width, heads) for _ in range(layers)])

    def forward(self, x, attn_mask=None):
        for block in self.resblocks:
            x = block(x, attn_mask)
        return x


class RefVisual(nn.Module):
    def __init__(self, resolution, patch, width, layers, heads, output_dim):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch, stride=patch, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(width))
        self.positional_embedding = nn.Parameter(torch.empty((resolution // patch) ** 2 + 1, width))
        self.ln_pre = RefLayerNorm(width)
        self.transformer = RefTransformer(width, layers, heads)
        self.ln_post = RefLayerNorm(width)
        self.proj = nn.Parameter(torch.empty(width, output_dim))

    def forward(self, images):
        x = self.conv1(images)  # [N, D, g, g]
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # [N, P, D]
        cls = self.class_embedding.to(x.dtype) + torch.zeros(
            x.shape[0], 1, x.shape[-1], dtype=x.dtype, device=x.device
        )
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)  # [N, 1+P, D]
        x = self.ln_pre(x).permute(1, 0, 2)  # [1+P, N, D]: sequence first
        x = self.transformer(x).permute(1, 0, 2)  # [N, 1+P, D]
        return self.ln_post(x[:, 0]) @ self.proj


class RefCLIP(nn.Module):
    def __init__(
        self,
        embed_dim,
        image_resolution,
        vision_layers,
        vision_width,
        vision_patch_size,
        context_length,
        vocab_size,
        transformer_width,
        transformer_heads,
        transformer_layers,
        vision_heads=None,
    ):
        super().__init__()
        self.visual = RefVisual(
            image_resolution,
            vision_patch_size,
            vision_width,
            vision_layers,
            vision_heads or vision_width // 64,
            embed_dim,
        )
        self.transformer = RefTransformer(transformer_width, transformer_layers, transformer_heads)
        self.token_embedding = nn.Embedding(vocab_size, transformer_width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, transformer_width))
        self.ln_final = RefLayerNorm(transformer_width)
        self.text_projection = nn.Parameter(torch.empty(transformer_width, embed_dim))
        self.logit_scale = nn.Parameter(torch.ones([]))

    def encode_image(self, images):
        return self.visual(images)

    def encode_text(self, tokens):
        T = tokens.shape[1]
        x = self.token_embedding(tokens) + self.positional_embedding[:T]  # [C, T, W]
        # causal: see only the past
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        x = self.transformer(x.permute(1, 0, 2), mask).permute(1, 0, 2)  # run as [T, C, W]
        x = self.ln_final(x)
        return x[torch.arange(x.shape[0]), tokens.argmax(-1)] @ self.text_projection


def build_reference(model: CLIP, sizes: dict) -> RefCLIP:
    """The reference with the very same weights (shared tensors, no copy)."""
    with torch.device("meta"):
        ref = RefCLIP(**sizes)
    ref.load_state_dict(model.state_dict(), strict=True, assign=True)
    return ref.eval()


# ----------------------------------------------------------------------------------------------
# Timing and memory


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA runs asynchronously: wait before reading the clock


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if platform.system() == "Linux" else None
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def cpu_memory_method() -> str:
    """How CPU peaks are read: VmHWM reset through /proc/self/clear_refs (Linux), else getrusage."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_kib("VmHWM")
        return "VmHWM"
    except (OSError, KeyError):
        return "ru_maxrss"


def peak_memory(fn, device, method):
    """Run fn once; return (its peak memory above what was resident before, in bytes, and fn's
    result). CUDA: torch.cuda.max_memory_allocated. CPU/VmHWM: the process high-water mark is reset
    to the current RSS, with glibc told to hand every block over 64 KiB straight back to the OS
    during this one call, so that freed tensors show up as freed. CPU/ru_maxrss: growth of the
    lifetime peak (a lower bound)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base, out
    if method == "VmHWM":
        if _LIBC is not None:
            _LIBC.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
            _LIBC.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        base = _status_kib("VmHWM")
        out = fn()
        peak = _status_kib("VmHWM")
        if _LIBC is not None:
            # glibc's usual steady state, for the timings
            _LIBC.mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024)
        return (peak - base) * 1024, out
    import resource

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024, out


MEM_NOTES = {
    "max_memory_allocated": "CUDA: torch.cuda.max_memory_allocated during the call, minus what was "
    "allocated before it",
    "VmHWM": "CPU: growth of the resident set during the call (VmHWM in /proc/self/status, reset "
    "through /proc/self/clear_refs; freed blocks returned to the OS during that call)",
    "ru_maxrss": "CPU: growth of the process's lifetime peak RSS (getrusage); a lower bound",
}


def count_flops(fn):
    """Matrix-multiply FLOPs (2 per multiply-add) of one call of fn, read from the shape of every
    matmul it runs, backward included (torch's FlopCounterMode); attention goes through the math
    kernel, whose matmuls it sees."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def measure(fns: dict, device, warmup: int, repeats: int, label: str, mem_method: str):
    """Time every function of fns (name -> callable), interleaved (A B A B ...). The first call of
    each measures peak memory, a second counts its FLOPs; then warmup - 1 more warm-up rounds; then
    `repeats` timed rounds, each timed by the wall clock and by the process's CPU time (which does
    not grow while other programs hold the cores). Returns name -> {"s": median seconds (CPU time on
    a CPU, wall time on a GPU), "spread": (max - min) / median, "wall": [...], "cpu": [...], "mem":
    bytes, "flops": int, "out": last result}."""
    res = {name: {"wall": [], "cpu": [], "mem": None, "out": None} for name in fns}
    start = time.perf_counter()
    for name, fn in fns.items():
        res[name]["mem"], res[name]["out"] = peak_memory(fn, device, mem_method)
        res[name]["flops"] = count_flops(fn)
    for _ in range(max(0, warmup - 1)):
        for fn in fns.values():
            fn()
    for r in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t, c = time.perf_counter(), time.process_time()
            res[name]["out"] = fn()
            sync(device)
            res[name]["wall"].append(time.perf_counter() - t)
            res[name]["cpu"].append(time.process_time() - c)
        done = time.perf_counter() - start
        eta = done / (r + 1 + warmup) * (repeats - r - 1)
        print(
            f"  {label}: round {r + 1}/{repeats}, {fmt_time(done)} so far, eta {fmt_time(eta)}",
            flush=True,
        )
    for r in res.values():
        times = r["cpu" if device.type == "cpu" else "wall"]
        r["s"] = statistics.median(times)
        r["spread"] = (max(times) - min(times)) / max(r["s"], 1e-12)
    return res


# ----------------------------------------------------------------------------------------------
# The contenders


# Agreement targets of two computations of the same thing in one precision (the naive step against
# ours, the frozen forward with every position in its last blocks against the pruned one). In fp32
# they agree to rounding; in fp16/bf16 each differs from fp32 by rounding noise, measured over 30
# seeds on the tiny CLIP (tests/test_precision.py: max relative loss difference fp16 2.4e-3, bf16
# 1.4e-2; grad R 8.7e-3, 1.0e-1; max |fused logit difference| / max |logit| 4.5e-3, 3.3e-2), so two
# such computations may differ by up to twice that: the targets are about twice the measured
# maximum, as the tests' tolerances.
# fp32 logits: 3e-4 of the largest logit (the earlier 1e-3 at the tiny model's largest logit, 3)
AGREEMENT = {
    None: dict(loss=1e-5, grad=1e-4, logits=3e-4),
    torch.float16: dict(loss=5e-3, grad=2e-2, logits=1e-2),
    torch.bfloat16: dict(loss=3e-2, grad=0.2, logits=7e-2),
}


def dear_loss_fn(model, out, labels, lambda_reg=1.0, lambda_fusion=1.0):
    """dear.py's loss_fn: the DeAR loss with the default weights."""
    return dear.dear_loss(out, labels, model.t0, model.alpha(), lambda_reg, lambda_fusion)


def dear_step(model, opt, scaler, images, labels, dtype):
    """One DeAR training step: train.train_step, the function train.train runs for every batch
    (autocast in dtype, the loss in fp32, GradScaler, AdamW). Returns the loss and R's gradient
    (unscaled), on the device."""
    loss, _, _ = train.train_step(model, images, labels, dear_loss_fn, opt, scaler, dtype)
    return loss.detach(), model.tokens.R.grad


def frozen_logits(model, images, tokens, every_row=False):
    """Zero-shot logits [B, C] of the frozen CLIP: encode_image and encode_text, whose last blocks
    compute only the rows read (CLS, EOT); every_row: the same features with the last blocks
    computing every position, as OpenAI's CLIP does (texts in the same length groups as
    encode_text)."""
    if every_row:
        v = model.visual
        f = v.head(v.run_blocks(v.embed(images), 0, v.layers)[:, 0])  # every row, then CLS
        eot = tokens.argmax(-1)
        t = torch.empty(len(tokens), model.text_projection.shape[1], device=f.device)
        for n, idx, _, _ in clip.model.length_buckets(eot):
            x = model.run_text_blocks(
                model.embed_text(tokens[idx, : n + 1]), 0, model.transformer.layers
            )
            t[idx] = model.text_head(x, eot[idx]).to(t.dtype)
    else:
        f, t = model.encode_image(images), model.encode_text(tokens)
    return model.logit_scale.exp() * F.normalize(f, dim=-1) @ F.normalize(t, dim=-1).t()


def naive_forward(model, images, tokens):
    """The DeAR forward written the naive way, with DeAR's own parameters: every block of both
    towers runs under autograd (no no_grad prefix, no cached text prefix) and the frozen targets f^0
    and t^0 are recomputed from scratch. Same math as DeAR.forward; returns (the same dict, t^0)."""
    clip_model, visual = model.clip, model.clip.visual
    with torch.no_grad():  # the frozen CLIP targets, recomputed every step
        f0 = F.normalize(clip_model.encode_image(images), dim=-1)
        t0 = F.normalize(clip_model.encode_text(tokens), dim=-1)
    x = clip_model.embed_text(tokens)  # [C, T, W]
    C = x.shape[0]
    for b in range(model.Lt):
        i = b - model.first_text
        if i == 0:  # tokens right after SOT: [C, T + K, W]
            x = torch.cat(
                [x[:, :1], model.tokens.text(0).to(x.dtype).expand(C, -1, -1), x[:, 1:]], dim=1
            )
        elif i > 0:
            x = dear.mix(x, model.tokens.text(i).to(x.dtype), model.beta)
        x = clip_model.run_text_blocks(x, b, b + 1)
    t = F.normalize(clip_model.text_head(x, tokens.argmax(-1) + K), dim=-1)  # [C, E]
    x = visual.embed(images)  # [B, 1+P, D]
    B = x.shape[0]
    for b in range(model.L):
        i = b - model.first
        if i == 0:  # [CLS, attr_1..attr_K, patches]
            x = torch.cat(
                [x[:, :1], model.tokens.vision(0).to(x.dtype).expand(B, -1, -1), x[:, 1:]], dim=1
            )
        elif i > 0:
            x = dear.mix(x, model.tokens.vision(i).to(x.dtype), model.beta)
        x = visual.run_blocks(
            x, b, b + 1, attn_mask=getattr(model, f"mask_{i}") if i >= 0 else None
        )
    f_cls = F.normalize(visual.head(x[:, 0]), dim=-1)
    # [B, K, E]
    f_attr = F.normalize(visual.ln_post(x[:, 1 : 1 + K]) @ model.P_attr.to(x.dtype), dim=-1)
    feats = torch.cat([f_cls.unsqueeze(1), f_attr], dim=1)  # [B, 1+K, E]
    logits = clip_model.logit_scale.exp() * feats @ t.t().to(feats.dtype)  # [B, 1+K, C]
    fused = model.alpha()[None, :, None].to(logits.dtype).mul(logits).sum(1)  # [B, C]
    return {"logits": logits, "fused": fused, "f_cls": f_cls, "f0": f0, "t": t}, t0


def naive_step(
    model, opt, scaler, images, labels, tokens, dtype, lambda_reg=1.0, lambda_fusion=1.0
):
    """The naive step: the frozen weights keep requires_grad=True (only the optimiser leaves them
    out), so autograd records all blocks and computes every weight gradient. Otherwise as
    train.train_step."""
    frozen = list(model.clip.parameters())
    for p in frozen:
        p.requires_grad_(True)
    try:
        with train.autocast(images.device, dtype):
            out, t0 = naive_forward(model, images, tokens)
        loss, _ = dear.dear_loss(out, labels, t0, model.alpha(), lambda_reg, lambda_fusion)  # fp32
        model.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # R.grad: the true gradient, comparable with ours
        scaler.step(opt)
        scaler.update()
    finally:
        for p in frozen:
            p.requires_grad_(False)
            p.grad = None
    return loss.detach(), model.tokens.R.grad


# ----------------------------------------------------------------------------------------------
# The bench


class Bench:
    """What every measurement shares: the device, the timing protocol and the rows of the table."""

    def __init__(self, args):
        self.args, self.device = args, torch.device(args.device)
        self.dtype = train.autocast_dtype(self.device, args.precision)  # None: fp32
        self.mem_method = (
            "max_memory_allocated" if self.device.type == "cuda" else cpu_memory_method()
        )
        self.rows, self.breakdown = [], []
        self.gen = torch.Generator().manual_seed(1)

    def go(self, fns, label, short=False):
        """measure(); short: one forward pass per call (a., d.), timed --short-repeats times, as
        their targets leave a margin of only a few percent."""
        repeats = max(self.args.repeats, self.args.short_repeats) if short else self.args.repeats
        return measure(fns, self.device, self.args.warmup, repeats, label, self.mem_method)

    def row(self, rid, what, first, second, ratio="", target="", limit="", excess=""):
        self.rows.append((rid, what, first, second, ratio, limit, excess, target))

    def compare(self, rid, what, a, b, target=""):
        """A timing row: a and b (measure results), their ratio, the ratio of their FLOPs (the
        limit) and measured / limit (how far the code runs from what its FLOPs allow)."""
        limit = a["flops"] / b["flops"] if a["flops"] and b["flops"] else None
        t = a["s"] / b["s"]
        self.row(
            rid,
            what,
            ms(a, self.device),
            ms(b, self.device),
            f"{t:.2f}",
            target,
            "" if limit is None else f"{limit:.2f}",
            "" if limit is None else f"{t / limit:.2f}",
        )

    def no_grad(self, fn):
        def wrapped():
            with torch.no_grad(), train.autocast(self.device, self.dtype):
                return fn()

        return wrapped

    def images(self, n, R):
        return torch.randn(n, 3, R, R, generator=self.gen).to(self.device)


def bench_clip(b, model, ref, images, tokens):
    """a. the vendored CLIP against the nn.MultiheadAttention reference: agreement (fp32),
    then speed."""
    with torch.no_grad():
        d_img = F.normalize(model.encode_image(images), dim=-1) - F.normalize(
            ref.encode_image(images), dim=-1
        )
        d_txt = F.normalize(model.encode_text(tokens), dim=-1) - F.normalize(
            ref.encode_text(tokens), dim=-1
        )
    b.row(
        "a.agree",
        "max abs difference of normalised features, image / text (fp32)",
        f"{d_img.abs().max().item():.1e}",
        f"{d_txt.abs().max().item():.1e}",
        "",
        "< 1e-5",
    )
    for rid, what, ours, theirs in (
        ("a.image", f"encode_image, {len(images)} images", model.encode_image, ref.encode_image),
        ("a.text", f"encode_text, {len(tokens)} prompts", model.encode_text, ref.encode_text),
    ):
        x = images if rid == "a.image" else tokens
        r = b.go(
            {"ours": b.no_grad(lambda: ours(x)), "ref": b.no_grad(lambda: theirs(x))},
            rid,
            short=True,
        )
        b.compare(rid, what + ": vendored vs nn.MultiheadAttention", r["ours"], r["ref"], "<= 1.0")


def bench_train(b, net, opt, scaler, C, B, model_name, naive=True):
    """b, c, e. one setting: our DeAR step vs the frozen CLIP forward vs the naive step;
    memory; breakdown."""
    device, model, tag = b.device, net.clip, f"C{C}xB{B}"
    names = classnames(C)
    net.set_classes(names, TEMPLATE)
    tokens = clip.tokenize([TEMPLATE.format(c) for c in names]).to(device)  # [C, 77]
    imgs = b.images(B, model.visual.input_resolution)
    labels = (torch.arange(B) % C).to(device)

    fns = {
        "dear": lambda: dear_step(net, opt, scaler, imgs, labels, b.dtype),
        "frozen": b.no_grad(lambda: frozen_logits(model, imgs, tokens)),
    }
    if (C, B) in TRAIN_TARGETS:
        fns["every_row"] = b.no_grad(lambda: frozen_logits(model, imgs, tokens, every_row=True))
    if naive and not b.args.no_naive:
        fns["naive"] = lambda: naive_step(net, opt, scaler, imgs, labels, tokens, b.dtype)
    where = f"{C} classes, batch {B}" + ("" if model_name == "ViT-B/16" else f", {model_name}")
    net.train()
    with train.frozen_weights_in(
        b.dtype, model
    ):  # as in train.train: after set_classes, around every step
        settle_scaler(scaler, fns["dear"])
        try:
            r = b.go(fns, f"b/c. {where}")
        except (
            torch.OutOfMemoryError
        ):  # the naive step keeps every activation of both towers: it may not fit
            fns.pop("naive")
            torch.cuda.empty_cache()
            r = b.go(fns, f"b. {where} (the naive step ran out of memory)")
            b.row(
                f"c.{tag}",
                f"naive DeAR step vs ours, {where}",
                "out of memory",
                ms(r["dear"], device),
            )
            b.row(f"c.agree.{tag}", "naive vs ours: loss / grad R", "out of memory", "-")
        if (
            not b.args.no_breakdown and not b.breakdown
        ):  # the first setting only: it costs four more timings
            b.breakdown.append((C, B, step_breakdown(b, net, imgs, labels, r["dear"]["s"], tag)))
    b.compare(
        f"b.{tag}",
        f"DeAR training step vs frozen CLIP forward (image + {C} prompts), {where}",
        r["dear"],
        r["frozen"],
        TRAIN_TARGETS.get((C, B), ""),
    )
    if "every_row" in r:
        b.compare(
            f"b.rows.{tag}",
            f"DeAR training step vs a frozen forward whose last blocks compute every "
            f"position (image + {C} prompts, as OpenAI's CLIP; the baseline the step targets were "
            f"estimated against), {where}",
            r["dear"],
            r["every_row"],
        )
        diff = (r["every_row"]["out"].float() - r["frozen"]["out"].float()).abs().max().item()
        largest = r["frozen"]["out"].float().abs().max().item()
        b.row(
            f"b.rows.agree.{tag}",
            "frozen forward, last blocks on every position vs on the read rows only: "
            "max abs difference of the logits / largest logit",
            f"{diff:.1e}",
            f"{largest:.1f}",
            f"{diff / max(largest, 1e-12):.1e}",
            f"< {AGREEMENT[b.dtype]['logits']:.0e} (relative)",
        )
    b.row(
        f"f.{tag}",
        f"training throughput, images/s: DeAR step / frozen forward, {where}",
        f"{B / r['dear']['s']:.1f}/s",
        f"{B / r['frozen']['s']:.1f}/s",
    )
    if "naive" in r:
        b.compare(
            f"c.{tag}",
            f"naive DeAR step vs ours (speed-up), {where}",
            r["naive"],
            r["dear"],
            ">= 3",
        )
        (la, ga), (lb, gb) = r["dear"]["out"], r["naive"]["out"]
        rel = ((ga - gb).norm() / gb.norm().clamp_min(1e-12)).item()
        tol = AGREEMENT[b.dtype]
        b.row(
            f"c.agree.{tag}",
            "naive vs ours: loss / relative difference of grad R",
            f"{float(la):.6f} / {float(lb):.6f}",
            f"{rel:.1e}",
            "",
            "equal"
            if b.dtype is None
            else f"loss < {tol['loss']:.0e}, grad < {tol['grad']:.0e} (relative)",
        )
    b.row(
        f"e.{tag}",
        f"peak memory ({b.mem_method}): DeAR step / frozen forward"
        + (" / naive step" if "naive" in r else "")
        + f", {where}",
        mib(r["dear"]),
        mib(r["frozen"]),
        mib(r["naive"]) if "naive" in r else "",
    )


def settle_scaler(scaler, step, most=30):
    """fp16: take steps until the GradScaler stops lowering its scale, as the first steps of a run
    do (a fresh scaler's 65536 overflows; those steps are skipped), so that the timed steps and the
    agreement rows see real gradients. Other precisions: nothing."""
    for _ in range(most if scaler.is_enabled() else 0):
        before = scaler.get_scale()
        step()
        if scaler.get_scale() == before:
            return


def bench_eval(b, net, images, C):
    """d. evaluation: per-batch cost with the class text features computed once,
    as train.evaluate does."""
    net.set_classes(classnames(C), TEMPLATE)
    net.eval()
    scale = net.clip.logit_scale.exp()
    with train.frozen_weights_in(b.dtype, net.clip):  # as in train.evaluate
        t = b.no_grad(net.encode_classes)()
        r = b.go(
            {
                "dear": b.no_grad(lambda: net(images, t=t)["fused"].argmax(-1).cpu()),
                "zs": b.no_grad(
                    lambda: (
                        (scale * F.normalize(net.clip.encode_image(images), dim=-1) @ net.t0.t())
                        .argmax(-1)
                        .cpu()
                    )
                ),
            },
            "d. evaluation",
            short=True,
        )
    n = len(images)
    b.compare(
        "d.eval",
        f"evaluation of a batch of {n} images ({C} classes): DeAR vs zero-shot CLIP",
        r["dear"],
        r["zs"],
        "<= 1.02",
    )
    b.row(
        "f.eval",
        f"evaluation throughput, images/s: DeAR / zero-shot CLIP ({C} classes, batches of {n})",
        f"{n / r['dear']['s']:.1f}/s",
        f"{n / r['zs']['s']:.1f}/s",
    )


def build(b, sizes, J):
    """A random CLIP of these sizes (frozen), DeAR on it with the bench roles, AdamW and the
    GradScaler as train.train makes them."""
    torch.manual_seed(0)
    with torch.device(b.device):
        model = CLIP(**sizes).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    net = dear.DeAR(
        model, bench_roles(J, model.visual.layers, model.visual.heads), J=J, beta=0.9
    ).to(b.device)
    # lr 0: every step does all of AdamW's work but leaves the parameters as they are, so all timed
    # steps see the same parameters and the naive and our losses can be compared
    fused = {"fused": True} if b.device.type == "cuda" else {}  # as train.train
    opt = torch.optim.AdamW(
        [p for p in net.trainable() if p.requires_grad], lr=0.0, weight_decay=5e-4, **fused
    )
    scaler = train.make_scaler(b.device, b.dtype)
    return model, net, opt, scaler


def run(args):
    b = Bench(args)
    sizes, J = dict(TINY if args.tiny else VIT_B16), args.J or (3 if args.tiny else 9)
    name = "tiny" if args.tiny else "ViT-B/16"
    t_start = time.perf_counter()
    print(f"building a random CLIP ({name} shapes) on {b.device} ...", flush=True)
    model, net, opt, scaler = build(b, sizes, J)
    images = b.images(args.eval_batch, model.visual.input_resolution)
    tokens = clip.tokenize([TEMPLATE.format(c) for c in classnames(args.prompts)]).to(b.device)
    bench_clip(b, model, build_reference(model, sizes), images, tokens)
    settings = list(zip(args.classes, args.batches))
    for C, B in settings:  # the naive step is slow: on a CPU it runs in the first setting only
        bench_train(
            b, net, opt, scaler, C, B, name, naive=b.device.type == "cuda" or (C, B) == settings[0]
        )
    bench_eval(b, net, images, settings[0][0])
    prof = profile_step(b, net, opt, scaler, settings[-1]) if args.profile else None
    if args.narrow:
        del model, net, opt, scaler
        print("building a narrower random CLIP (same depth and token counts) ...", flush=True)
        narrow = build(b, NARROW, J)
        for C, B in args.narrow:
            bench_train(b, *narrow[1:], C, B, "narrow model", naive=False)
    longest = (
        int(
            clip.tokenize([TEMPLATE.format(c) for c in classnames(max(args.classes))])
            .argmax(-1)
            .max()
        )
        + 1
    )
    return dict(
        rows=b.rows,
        breakdown=b.breakdown,
        sizes=sizes,
        J=J,
        settings=settings,
        mem_method=b.mem_method,
        elapsed=time.perf_counter() - t_start,
        profile=prof,
        text_len=longest,
    )


def step_breakdown(b, net, imgs, labels, step_s, tag):
    """Where the time of one DeAR step goes, by simple timers on its parts (medians)."""
    visual = net.clip.visual
    x = b.no_grad(lambda: visual.run_blocks(visual.embed(imgs), 0, net.first))()  # [B, 1+P, D]

    def forward():
        with train.autocast(b.device, b.dtype):
            out = net(imgs, with_frozen=True)
        return dear_loss_fn(net, out, labels)[0].item()  # outside autocast, as train.train_step

    def text():
        with train.autocast(b.device, b.dtype):
            return net.encode_classes().sum().item()  # with autograd on, as in the step

    r = b.go(
        {
            "text": text,
            "prefix": b.no_grad(lambda: visual.run_blocks(visual.embed(imgs), 0, net.first)),
            "frozen": b.no_grad(
                lambda: visual.head(visual.run_blocks(x, net.first, net.L, rows=slice(0, 1))[:, 0])
            ),
            "forward": forward,
        },
        f"breakdown {tag}",
    )
    s = {k: v["s"] for k, v in r.items()}
    J, L = net.J, net.L
    return [
        (
            f"text side: blocks {net.first_text + 1}..{net.Lt} "
            "of all prompts, with tokens (forward)",
            s["text"],
        ),
        (f"image prefix: embed + blocks 1..{J - 1}, no autograd", s["prefix"]),
        (f"frozen f^0: blocks {J}..{L} again without tokens, no autograd", s["frozen"]),
        (
            f"image blocks {J}..{L} with tokens and role masks, heads, logits, loss (forward)",
            max(0.0, s["forward"] - s["text"] - s["prefix"] - s["frozen"]),
        ),
        ("backward + AdamW", max(0.0, step_s - s["forward"])),
        ("whole step (from b.)", step_s),
    ]


def profile_step(b, net, opt, scaler, setting):
    """The top operators of one DeAR step (torch.profiler), as text."""
    from torch.profiler import ProfilerActivity, profile

    C, B = setting
    net.set_classes(classnames(C), TEMPLATE)
    imgs, labels = b.images(B, net.clip.visual.input_resolution), (torch.arange(B) % C).to(b.device)
    cuda = b.device.type == "cuda"
    net.train()
    with train.frozen_weights_in(b.dtype, net.clip):
        dear_step(net, opt, scaler, imgs, labels, b.dtype)
        with profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        ) as p:
            dear_step(net, opt, scaler, imgs, labels, b.dtype)
            sync(b.device)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return f"one DeAR step, {C} classes, batch {B}\n" + p.key_averages().table(
        sort_by=key, row_limit=15
    )


def ms(r, device) -> str:
    """The median time and its spread; on a CPU (where the median is CPU time) the median wall time
    too."""
    text = f"{1000 * r['s']:.1f} ms ±{50 * r['spread']:.0f}%"
    return text + (
        f" (wall {1000 * statistics.median(r['wall']):.0f})" if device.type == "cpu" else ""
    )


def mib(r) -> str:
    return "n/a" if r["mem"] is None else f"{r['mem'] / 2**20:.0f} MiB"


def row_ids(settings, device="cpu"):
    """The ids of the result rows a run with these settings writes (without --no-naive or
    --narrow)."""
    per = [
        f"{p}.C{C}xB{B}"
        for i, (C, B) in enumerate(settings)
        for p in ("b", "b.rows", "b.rows.agree", "f", "c", "c.agree", "e")
        # the naive step: first setting only on a CPU
        if (p[0] != "c" or i == 0 or device == "cuda")
        and (not p.startswith("b.rows") or (C, B) in TRAIN_TARGETS)
    ]  # every-row baseline: target settings
    return ["a.agree", "a.image", "a.text"] + per + ["d.eval", "f.eval"]


def markdown(res, args) -> str:
    device = torch.device(args.device)
    s = res["sizes"]
    prec = {
        None: "fp32 (no autocast)",
        torch.bfloat16: "autocast bf16, frozen matmul "
        "weights stored in bf16 (train.frozen_weights_in)",
        torch.float16: "autocast fp16 + GradScaler, frozen matmul weights stored in fp16 "
        "(train.frozen_weights_in)",
    }[train.autocast_dtype(device, args.precision)]
    prec = f"--precision {args.precision}: {prec}; logits head and loss in fp32"
    lines = [
        "# DeAR speed bench",
        "",
        "Written by `bench.py`; every ratio compares two measurements made in the same process, "
        "interleaved, with the same inputs. Random weights with the real shapes (nothing "
        "downloaded).",
        "",
        "| | |",
        "|---|---|",
        f"| command | `python bench.py {' '.join(sys.argv[1:])}` |",
        f"| date | {time.strftime('%Y-%m-%d %H:%M %Z')} |",
        f"| device | {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
        f"({platform.machine()}, {os.cpu_count()} cores) |",
        f"| torch | {torch.__version__} (intra-op threads: {torch.get_num_threads()}) |",
        f"| precision | {prec} |",
        f"| model | {'tiny test CLIP' if args.tiny else 'CLIP ViT-B/16 shapes'}: vision "
        f"{s['vision_layers']} blocks x {s.get('vision_heads') or s['vision_width'] // 64} heads, "
        f"width {s['vision_width']}, {s['image_resolution']}px / patch {s['vision_patch_size']}; "
        f"text {s['transformer_layers']} blocks, width {s['transformer_width']}; J = {res['J']} |",
        f"| settings (classes x batch) | {', '.join(f'{C} x {B}' for C, B in res['settings'])}; "
        f"evaluation batch {args.eval_batch}; prompts of up to {res['text_len']} tokens |",
        "| narrow model | "
        + (
            f"{', '.join(f'{C} x {B}' for C, B in args.narrow)}: vision width "
            f"{NARROW['vision_width']} ({NARROW['vision_heads']} heads), text width "
            f"{NARROW['transformer_width']} ({NARROW['transformer_heads']} heads), depth and token "
            "counts as above |"
            if args.narrow
            else "none |"
        ),
        f"| timing | {args.warmup} warm-up call(s) (the first also measures memory, one more "
        f"counts FLOPs), contenders interleaved, median of {args.repeats} (rows a. and d.: "
        f"{max(args.repeats, args.short_repeats)}) "
        + (
            "**process CPU times** (wall times in brackets); "
            "± is half the range (max - min) / median |"
            if device.type == "cpu"
            else "wall times around `torch.cuda.synchronize`; ± is half the range |"
        ),
        f"| peak memory | {MEM_NOTES[res['mem_method']]} |",
        f"| wall time of the bench | {fmt_time(res['elapsed'])} |",
        "",
        "## Results",
        "",
        "Ratio = first column / second column (time); a ratio below 1 means the first is faster. "
        "FLOP limit = the same ratio of matrix-multiply FLOPs (forward and backward), counted from "
        "the shape of every matmul each contender runs (torch's FlopCounterMode); ratio / limit is "
        "how far the measured ratio is from what the FLOPs allow (target <= 1.10).",
        "",
        "| id | measurement | first | second | ratio | FLOP limit | ratio / limit | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in res["rows"]]
    if res["breakdown"]:
        lines += [
            "",
            "## Where a DeAR training step spends its time",
            "",
            "Simple timers on the parts of the forward pass (medians); the token blocks are the "
            "forward minus the other parts, backward + AdamW is the step minus the forward.",
            "",
        ]
        for C, B, parts in res["breakdown"]:
            total = parts[-1][1]
            lines += [f"{C} classes, batch {B}:", "", "| part | time | share |", "|---|---|---|"]
            lines += [
                f"| {name} | {1000 * t:.1f} ms | {100 * t / total:.0f}% |" for name, t in parts
            ]
            lines.append("")
    lines += [
        "",
        "## How to read this",
        "",
        "- a: `clip/model.py` (batch-first, hand-written attention through "
        "`scaled_dot_product_attention`) against a reference written in bench.py the plainest way: "
        "OpenAI's sequence-first layout on `torch.nn.MultiheadAttention`, sharing the same weight "
        "tensors.",
        "- b: the DeAR step is `train.train_step`, the function `train.train` runs for every batch "
        "(`model(images, with_frozen=True)` under autocast, `dear.dear_loss` in fp32, backward "
        "through the GradScaler, AdamW; lr 0, so every repeat sees the same parameters); frozen = "
        "`encode_image` of the batch + `encode_text` of every class prompt + logits, under "
        "`no_grad`, in the same precision.",
        "- c: the naive step uses DeAR's own parameters and math, but leaves `requires_grad` on "
        "the frozen CLIP weights (autograd through every block of both towers, all weight "
        "gradients computed), re-runs the text prefix every step and recomputes f^0 and t^0 from "
        "scratch. The agree row checks it computes the same loss and gradient as ours. On a CPU it "
        "is timed in the first setting only (it is slow), and never on the narrow model.",
        "- b.rows: the same DeAR step against a frozen forward whose last blocks compute every "
        "position (every row of the last image block, every position of the last text block), as "
        "OpenAI's CLIP does; the agree row checks both frozen forwards give the same logits. It is "
        "the baseline the step targets ("
        + ", ".join(f"{t[3:]} at {C} x {B}" for (C, B), t in TRAIN_TARGETS.items())
        + ") were estimated against; b. compares with our own frozen forward, which computes only "
        "the rows it reads and is that much cheaper.",
        "- d: per-batch cost only, as `train.evaluate` computes the class text features once.",
        "- agree rows: fp32 computations agree to rounding (\"equal\"); in fp16 and bf16 "
        "each differs from fp32 by rounding noise, so their targets are about twice the "
        "spread measured over 30 seeds on the tiny CLIP (fp16: relative loss 5e-3, grad R "
        "2e-2, logits 1e-2 of the largest; bf16: 3e-2, 0.2, 7e-2; `python "
        "tests/test_precision.py --spread 30` measures it). fp16 steps are timed after the "
        "GradScaler has found its scale (its first steps are skipped, as in every fp16 run).",
        "- `python bench.py --tiny` writes BENCH_TINY.md (never this file).",
        "- Roles: a made-up table mixing generalization, attribute, mixed and other-specialist "
        "heads in every block (the masks cost the same whatever the roles).",
    ]
    if device.type == "cpu":
        lines += [
            "- Every number in this file is CPU. CPU timings on a shared machine are noisy: the "
            "ratios of process CPU times, measured interleaved, are what to read.",
            "- GPU numbers were not measured in this file; run `bash bench_gpu.sh` on a GPU (the "
            "code path: `--precision amp` = fp16 autocast with a GradScaler and the frozen weights "
            "stored in fp16, as in dear.py; `torch.cuda.synchronize` around every timed call, "
            "`torch.cuda.max_memory_allocated` for memory).",
        ]
    if res["profile"]:
        lines += [
            "",
            "## Top operators (torch.profiler)",
            "",
            "```",
            res["profile"].rstrip(),
            "```",
        ]
    return "\n".join(lines) + "\n"


def int_list(s: str):
    try:
        values = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers such as 10,1000, got {s!r}"
        )
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive whole numbers such as 10,1000, got {s!r}"
        )
    return values


def settings_list(s: str):
    try:
        pairs = [
            tuple(int(v) for v in item.lower().split("x")) for item in s.split(",") if item.strip()
        ]
    except ValueError:
        pairs = [()]
    if any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(
            f"expected settings such as 1000x32 (classes x batch), got {s!r}"
        )
    return pairs


TINY_OUT = "BENCH_TINY.md"  # --tiny's default --out (git ignores it)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Time a DeAR training step and evaluation "
        "against the frozen CLIP, on random weights.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Defaults (ViT-B/16 on CUDA | ViT-B/16 on CPU | --tiny): "
        + " | ".join(
            f"{k}: " + ", ".join(f"{n} {v}" for n, v in d.items()) for k, d in DEFAULTS.items()
        ),
    )
    p.add_argument(
        "--tiny", action="store_true", help="the tiny CLIP of the tests instead of ViT-B/16 shapes"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--precision",
        default="amp",
        choices=train.PRECISIONS,
        help="as dear.py: amp = fp16 autocast + GradScaler on CUDA, fp32 on a CPU; fp16 "
        "and bf16 also run on a CPU (CPU autocast; fp16 with a CPU GradScaler)",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="timed calls per contender (the median is reported)"
    )
    p.add_argument(
        "--short-repeats",
        type=int,
        default=11,
        help="timed calls per contender in the rows of one forward pass (a., d.): short calls "
        "whose targets leave a margin of a few percent (at least --repeats)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed calls first (>= 1; the first measures memory)",
    )
    p.add_argument(
        "--classes", type=int_list, default=None, help="class counts of the training settings"
    )
    p.add_argument(
        "--batches", type=int_list, default=None, help="training batch size of each setting"
    )
    p.add_argument("--eval-batch", type=int, default=None, help="images per batch in a. and d.")
    p.add_argument("--prompts", type=int, default=None, help="prompts encoded in a.")
    p.add_argument("--J", type=int, default=None, help="tokens enter block J (default 9; tiny: 3)")
    p.add_argument(
        "--narrow",
        type=settings_list,
        default=None,
        help="settings CxB (e.g. 1000x32) run on a narrower model with the same depth and token "
        "counts (default: 1000x32 on a CPU, none on a GPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on a CPU, where "
        "one thread per process measures the work done rather than how many cores are free)",
    )
    p.add_argument("--no-naive", action="store_true", help="skip the naive step (c.)")
    p.add_argument(
        "--no-breakdown", action="store_true", help="skip the per-part timing of the DeAR step"
    )
    p.add_argument(
        "--profile", action="store_true", help="add torch.profiler's top operators of one DeAR step"
    )
    p.add_argument(
        "--out",
        default=None,
        help=f"Markdown file to write (atomically; default BENCH.md, with --tiny "
        f"{TINY_OUT}: the committed BENCH.md holds ViT-B/16 numbers only)",
    )
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(
            f"--device {args.device} was asked for but CUDA is not available here; use --device cpu"
        )
    try:
        train.resolve_precision(args.precision, torch.device(args.device))
    except train.RunError as e:
        p.error(str(e))
    if args.tiny and args.out is not None and os.path.basename(args.out) == "BENCH.md":
        p.error(
            f"--tiny writes tiny-model numbers; BENCH.md keeps the ViT-B/16 ones: pass "
            f"another --out (default {TINY_OUT})"
        )
    args.out = args.out or (TINY_OUT if args.tiny else "BENCH.md")
    kind = "tiny" if args.tiny else "cpu" if args.device == "cpu" else "cuda"
    for name, value in DEFAULTS[kind].items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    if len(args.classes) != len(args.batches):
        p.error(
            f"--classes has {len(args.classes)} entries but --batches has {len(args.batches)}; "
            "give one batch size per class count"
        )
    if min(args.repeats, args.short_repeats, args.warmup, args.eval_batch, args.prompts) < 1:
        p.error("--repeats, --short-repeats, --warmup, --eval-batch and --prompts must be >= 1")
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


KEEP = "## Before and after"


def main(argv=None):
    args = parse_args(argv)
    try:
        res = run(args)
    except ValueError as e:  # e.g. a J that does not fit the towers
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    text = markdown(res, args)
    if os.path.exists(args.out):  # a hand-written "## Before and after" section at the end is kept
        old = open(args.out).read()
        if KEEP in old:
            text += "\n" + old[old.index(KEEP) :]
    write_atomic(args.out, text)
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Speed bench: a DeAR training step and evaluation beside the frozen CLIP, on random weights.

    python bench.py --device cpu     # ViT-B/16's shapes, one CPU thread: assets/BENCH.md (15 min)
    python bench.py --device cuda    # on a GPU: fp16 autocast as in training, and the peak memory
    python bench.py --tiny           # the tests' tiny CLIP, seconds: writes BENCH_TINY.md

What it measures, and how (the Markdown file ends with these notes):

- Time: torch.utils.benchmark.Timer.blocked_autorange, the median of the timed calls (its first call
  warms up); on a CPU one intra-op thread and process CPU time, so that other programs on the
  machine do not count. A CPU's times say little about a GPU's: run `--device cuda` there (peak
  memory: torch.cuda.max_memory_allocated over one call).
- FLOPs: torch.utils.flop_counter.FlopCounterMode, 2 per multiply-add of every matmul and
  convolution, backward included (attention through the math kernel, whose matmuls it sees). Ratios:
  b against a, d against c.
- a: CLIP.forward of the vendored CLIP (which too computes only the rows read and runs prompts in
  length groups). b: dear.train's step: the forward with f^0 under autocast, dear_loss in fp32,
  backward, AdamW (lr 0, so every call sees the same weights; no GradScaler). c: DeAR's forward of
  an evaluation batch, the class features computed once per evaluation (not counted); d: the same
  with the readouts, which need frozen CLIP's image feature f^0 (blocks J..L once more, without the
  tokens; the last block CLS alone).
- Shortcuts, each against the plain computation it replaces, written here on the CLIP seams
  (run_blocks, run_text_blocks). rows read: the last block of both towers computes only the rows
  read (CLS and the K tokens; EOT), not every row. past: the prompt start shared by all classes
  (SOT, the template's first words, the K tokens) runs once a block, not once a prompt. length
  groups: prompts run in groups of similar length (clip.model.length_buckets, which on a GPU mostly
  picks one group), not all padded to the longest. all three: none of them (as
  DeAR.text_features_plain states the text side, but blocks 1..J-1 still once per class list).
"""

import contextlib
import os
import sys
import time
from unittest import mock

import data  # before torch: OpenMP's idle threads sleep, and Ctrl-C or SIGTERM is one line
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.benchmark import Timer
from torch.utils.flop_counter import FlopCounterMode

import clip
import dear


def vit(resolution, layers, width, patch, text_width):
    """CLIP's constructor arguments for an OpenAI ViT (text: 12 blocks, heads of width 64, as
    wide as the features)."""
    return dict(embed_dim=text_width, image_resolution=resolution, vision_layers=layers,
                vision_width=width, vision_patch_size=patch, context_length=77, vocab_size=49408,
                transformer_width=text_width, transformer_heads=text_width // 64,
                transformer_layers=12)


HERE = os.path.dirname(os.path.abspath(__file__))
VIT_B16 = vit(224, 12, 768, 16, 512)
# the tests' tiny CLIP (tests/conftest.py)
TINY = dict(vit(32, 4, 64, 8, 64), embed_dim=32, transformer_layers=2, transformer_heads=4,
            vision_heads=4)
# (classes, batch): base-to-novel's batch of 4; ImageNet's 1000 classes at 32
SETTINGS = ((10, 4), (1000, 32))
TEMPLATE = "a photo of a {}."
WORDS = ("red green blue yellow black white brown grey orange purple".split(),
         "round long flat tall small large spotted striped curly pointed".split(),
         "bird dog car flower boat chair lamp shoe fish house".split())


def classnames(n):
    """n distinct made-up names of 3 words; every 7th has 4 more, as real class lists have long
    names too."""
    names = [" ".join(WORDS[k][i // 10**k % 10] for k in range(3)) for i in range(n)]
    return [name + " of the northern hills" * (i % 7 == 0) for i, name in enumerate(names)]


def made_up_roles(L, H):
    """Every kind of head in every block (what a mask costs does not depend on the roles)."""
    kinds = ("generalization", "attribute", "mixed", "other")
    head = lambda b, h: {"role": kinds[(b + h) % 4], "attribute": dear.ATTRIBUTES[(b + h) % dear.K]}
    return {b: [head(b, h) for h in range(H)] for b in range(1, L + 1)}


# ------------------------------------------------------------------------------------------------
# Measuring


def flops(fn):
    """(FLOPs of one call of fn, its result)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = fn()
    return counter.get_total_flops(), out


def measure(fn, device, min_time):
    """FLOPs, seconds a call (median) and, on CUDA, the peak memory in MiB of fn; and fn's
    result."""
    n, out = flops(fn)
    clock = {"timer": time.process_time} if device.type == "cpu" else {}  # CUDA: Timer syncs
    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(), **clock)
    seconds = timer.blocked_autorange(min_run_time=min_time).median
    r = {"flops": n, "s": seconds, "mib": None, "out": out}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        r["mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return r


def autocast(device):  # --precision amp
    return torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda")


def training_step(model, images, labels):
    """dear.train's step: forward under autocast, the loss in fp32, backward, AdamW (lr 0, so
    every call sees the same weights; on CUDA without the GradScaler, whose few extra operations
    hardly cost). Returns the loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=5e-4, fused=images.device.type == "cuda")

    def step():
        with autocast(images.device):
            out = model(images, with_frozen=True)
        loss, _ = dear.dear_loss(out, labels, model.t0, model.alpha(), 1.0, 1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


# ------------------------------------------------------------------------------------------------
# The exact shortcuts, and the plain computations they replace (the same loss, more FLOPs)


def every_row(run):
    """A run_blocks / run_text_blocks that computes every row of its last block and then keeps
    the rows asked for."""

    def plain(x, start, end, rows=None, **kw):
        y = run(x, start, end, **kw)
        return y if rows is None else y[:, rows]

    return plain


def one_group(eot):
    """length_buckets' answer when every prompt is padded to the longest."""
    rows, pick = eot.unique(return_inverse=True)
    return [(int(eot.max()), torch.arange(len(eot), device=eot.device), rows, pick)]


def whole_prompts(model, names, groups):
    """DeAR.encode_classes without `past`: every prompt runs whole (SOT, the K tokens, its words)
    in blocks J..L."""
    m = model.clip
    tokens = clip.tokenize([TEMPLATE.format(c) for c in names]).to(model.t0.device)
    start = model.text_blocks.start  # block J, counted from 0
    with torch.no_grad():  # blocks 1..J-1, once per class list, as set_classes
        parts = [(m.run_text_blocks(m.embed_text(tokens[idx, : n + 1]), 0, start), idx, rows, pick)
                 for n, idx, rows, pick in groups(tokens.argmax(-1))]

    def encode_classes():
        t, order = [], []
        for x, idx, rows, pick in parts:
            for i, b in enumerate(model.text_blocks):
                fresh = model.F_t(model.R, i).to(x.dtype)  # [K, W]
                x = dear.insert(x, fresh) if i == 0 else dear.mix(x, fresh, model.beta)
                last = b == model.text_blocks[-1]  # then only the rows read: x [c, ., W]
                x = m.run_text_blocks(x, b, b + 1, rows=rows + dear.K if last else None)
            t.append(m.text_head(x, pick))
            order.append(idx)
        # [C, E]
        return torch.nn.functional.normalize(torch.cat(t)[torch.cat(order).argsort()], dim=-1)

    return encode_classes


def without(model, names, shortcut):
    """A context in which the model computes the same without one shortcut (or all three), the
    plain way."""
    m, stack = model.clip, contextlib.ExitStack()
    patch = lambda obj, name, new: stack.enter_context(mock.patch.object(obj, name, new))
    if shortcut in ("rows read", "all three"):
        patch(m.visual, "run_blocks", every_row(m.visual.run_blocks))
        patch(m, "run_text_blocks", every_row(m.run_text_blocks))
    if shortcut in ("past", "all three"):
        groups = one_group if shortcut == "all three" else clip.model.length_buckets
        patch(model, "encode_classes", whole_prompts(model, names, groups))
    if shortcut == "length groups":
        with mock.patch.object(clip.model, "length_buckets", one_group):
            model.set_classes(names, TEMPLATE)
        stack.callback(model.set_classes, names, TEMPLATE)
    return stack


# ------------------------------------------------------------------------------------------------
# The bench


def bench_setting(clip_model, roles, J, C, B, device, min_time):
    """Rows a and b of one setting (C classes, a batch of B), and the shortcut rows."""
    names, R, where = classnames(C), clip_model.visual.input_resolution, f"{C} classes, batch {B}"
    tokens = clip.tokenize([TEMPLATE.format(c) for c in names]).to(device)
    images, labels = torch.randn(B, 3, R, R, device=device), torch.arange(B, device=device) % C
    forward = torch.no_grad()(autocast(device)(lambda: clip_model(images, tokens)[0]))
    base = measure(forward, device, min_time)
    rows = [("a. CLIP forward (frozen): the images and every class prompt", where, base, base, 0)]
    for kind in ("mmrl", "mmrlpp"):  # the default last: its model and step go on below
        print(f"{where}: DeAR step, {kind}", flush=True)
        model = dear.DeAR(clip_model, roles, J, tokens=kind).to(device)
        model.set_classes(names, TEMPLATE)
        step = measure(training_step(model, images, labels), device, min_time)
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)  # trainable
        rows.append((f"b. DeAR training step, --tokens {kind}, vs a.", where, step, base, n_params))
    t = model.encode_classes()
    plain = measure(torch.no_grad()(lambda: model(images, t=t)), device, min_time)
    read = measure(torch.no_grad()(lambda: model(images, t=t, with_frozen=True)), device, min_time)
    rows += [("c. DeAR evaluation of a batch (the class features computed once)", where, plain,
              plain, 0), ("d. the same with the readouts (f^0: blocks J..L without tokens), vs c.",
                          where, read, plain, 0)]
    shortcuts = []
    for shortcut in ("rows read", "past", "length groups", "all three"):
        print(f"{where}: a step without {shortcut}", flush=True)
        with without(model, names, shortcut):
            n, loss = flops(training_step(model, images, labels))
        shortcuts.append((shortcut, where, step["flops"], n, float(loss / step["out"] - 1)))
    return rows, shortcuts


def run(device, tiny=False):
    torch.manual_seed(0)
    with torch.device(device):
        clip_model = clip.CLIP(**(TINY if tiny else VIT_B16)).eval().requires_grad_(False)
    L, H = clip_model.visual.transformer.layers, clip_model.visual.transformer.heads
    J, roles = dear.default_J(L), made_up_roles(L, H)
    # each setting's (cost rows, shortcut rows), gathered by kind
    costs, shortcuts = zip(*[bench_setting(clip_model, roles, J, C, B, device,
                                           0.05 if tiny else 1.0) for C, B in SETTINGS])
    return {"J": J, "costs": sum(costs, []), "shortcuts": sum(shortcuts, [])}


def table(header, rows):
    return [f"| {' | '.join(row)} |" for row in [header, ["---"] * len(header), *rows]]


def markdown(res, device, argv, tiny, elapsed):
    cpu = f"cpu, {torch.get_num_threads()} thread"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    model = "the tiny CLIP" if tiny else "ViT-B/16"
    lines = ["# DeAR bench", "", f"`python bench.py {' '.join(argv)}` on {where}, torch "
             f"{torch.__version__}, {elapsed:.0f} s. Random weights of {model}'s shapes, J = "
             f"{res['J']}, made-up head roles (every kind in every block).", ""]
    g = lambda x: f"{x / 1e9:,.1f}" if x >= 1e9 else f"{x / 1e9:.3g}"
    mib = lambda r: "-" if r["mib"] is None else f"{r['mib']:,.0f} MiB"
    header = "row|setting|time|GFLOP|FLOP ratio|time ratio|trainable|peak memory".split("|")
    lines += table(header, [(what, where, f"{r['s']:.3g} s", g(r["flops"]),
                             f"{r['flops'] / b['flops']:.2f}", f"{r['s'] / b['s']:.2f}",
                             f"{n:,}" if n else "-", mib(r))
                            for what, where, r, b, n in res["costs"]])
    lines += ["", "The exact shortcuts: FLOPs of one DeAR training step (--tokens mmrlpp) with and "
              "without each.", ""]
    header = "shortcut|setting|GFLOP with|GFLOP without|saves|loss without / with - 1".split("|")
    lines += table(header, [(s, where, g(a), g(b), f"{1 - a / b:.1%} of a step", f"{d:.0e}")
                            for s, where, a, b, d in res["shortcuts"]])
    return "\n".join(lines + ["", __doc__.split("\n\n", 3)[3]])


def bench(argv):
    parser = data.Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where available",
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny CLIP: seconds")
    parser.add_argument("--out", help="the Markdown file (default assets/BENCH.md; --tiny "
                        "BENCH_TINY.md)")
    a = parser.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise data.UserError("--device cuda: CUDA is not available here")
    device = torch.device(a.device)
    out = a.out or ("BENCH_TINY.md" if a.tiny else os.path.join(HERE, "assets", "BENCH.md"))
    data.writable_folder(os.path.dirname(os.path.abspath(out)))  # before minutes of timing
    start = time.time()
    if device.type == "cpu":
        torch.set_num_threads(1)
    res = run(device, a.tiny)
    text = markdown(res, device, argv, a.tiny, time.time() - start)
    data.write_text(out, text)
    print(text)
    return res


def main(argv=None):
    return data.guarded(bench, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()

"""train.py: precision modes against fp32, the frozen weights kept in the autocast dtype, the
training loop's bookkeeping (non-finite loss, persistent workers, exact resume), on a tiny random
CLIP.

Tests marked `cuda` run only where CUDA is present (skipped elsewhere;
`pytest -m cuda` selects them)."""

import dataclasses
import math
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import tiny_clip
import data
import dear
import train
from dear import DeAR
from train import RunError

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Tolerances of a precision against fp32 on the tiny CLIP: one training step from the same state
# (|loss difference| / loss, |grad R - grad R fp32| / |grad R fp32|), and an evaluation (the share
# of test images whose top-1 equals fp32's; all of them where fp32's top-1 leads by more than MARGIN
# logits). Set with margin above the deviation measured on a CPU over 30 seeds
# (`python tests/test_precision.py --spread 30` prints it):
#                   loss median / max  grad R median / max  top-1 equal, min  max|dlogit|/max|logit|
#   fp16 SAFE_SCALE  7.7e-4 / 2.4e-3    3.1e-3 / 8.7e-3      100%              1.9e-3 / 4.5e-3
#   bf16             4.8e-3 / 1.4e-2    2.4e-2 / 1.0e-1      87.5%             1.7e-2 / 3.3e-2
# Tolerances: about twice the maximum (bench.py's agreement targets come from the same table).
TOLERANCE = {
    "bf16": dict(loss=3e-2, grad=0.2, agree=0.85),
    "fp16": dict(loss=5e-3, grad=2e-2, agree=0.95),
}
# MARGIN (logits): above the largest fused-logit move measured over 30 seeds (fp16 0.045, bf16 0.39)
MARGIN = 0.5
# A GradScaler scale at which no step of these tests overflows (the unscaled gradients that pass
# through fp16 reach about 20 on the tiny CLIP; a fresh scaler's 65536 overflows:
# test_fp16_fresh_scaler_skips_then_recovers)
SAFE_SCALE = 2.0**8


def roles(layers=range(1, 5)):
    block = [
        {"role": "generalization", "attribute": None},
        {"role": "attribute", "attribute": "color"},
        {"role": "mixed", "attribute": None},
        {"role": "specialist", "attribute": None},
    ]
    return {l: block for l in layers}


def make_model(seed=1):
    torch.manual_seed(seed)
    model = DeAR(tiny_clip(text_layers=3), roles(), J=3)
    with torch.no_grad():
        model.clip.logit_scale.fill_(math.log(100.0))  # CLIP's trained scale: logits of 100 cos
    return model


def loss_fn(model, out, labels):
    return dear.dear_loss(out, labels, model.t0, model.alpha(), 1.0, 1.0)


def cfg(**kw):
    return dear.resolve(
        dear.Config(**{"epochs": 2, "batch_size": 4, "workers": 0, "lambda_reg": 0.1, **kw})
    )


CLASSES = [f"class {i}" for i in range(10)]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """64 noise images (PNG, 32x32) written once; items (path, label 0, name)."""
    folder = tmp_path_factory.mktemp("noise")
    rng = np.random.default_rng(0)
    items = []
    for i in range(64):
        path = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
        items.append((str(path), 0, CLASSES[0]))
    return items


# ---------------------------------------------------------------------------------------- precision


def test_precision_names_and_devices():
    assert train.resolve_precision("amp", CPU) == "fp32"  # CPU stays fp32 unless asked
    assert train.resolve_precision("amp", torch.device("cuda")) == "fp16"  # MMRL's PREC amp on CUDA
    assert (
        train.resolve_precision("bf16", CPU) == "bf16"
        and train.autocast_dtype(CPU, "bf16") == torch.bfloat16
    )
    assert train.autocast_dtype(CPU, "fp32") is None and train.autocast_dtype(CPU) is None
    # fp16 on a CPU: CUDA's default path (CPU autocast fp16 and a GradScaler of the CPU's own type)
    assert train.resolve_precision("fp16", CPU) == "fp16"
    assert train.autocast_dtype(CPU, "fp16") == torch.float16
    scaler = train.make_scaler(CPU, torch.float16)
    assert scaler.is_enabled() and scaler._device == "cpu"
    assert not train.make_scaler(CPU, torch.bfloat16).is_enabled()
    assert not train.make_scaler(CPU, None).is_enabled()
    with pytest.raises(RunError, match="--precision"):
        train.resolve_precision("half", CPU)
    with pytest.raises(ValueError, match="--precision"):
        dear.resolve(dear.Config(precision="half"))


def test_frozen_weights_in_gives_autocast_exactly():
    """Casting the frozen matmul weights once gives the very numbers autocast gives with fp32
    weights; LayerNorm, embeddings, logit_scale and every trainable parameter stay fp32; the fp32
    originals come back after."""
    model = make_model()
    model.set_classes(CLASSES, "a photo of a {}.")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x, with_frozen=True)
    with torch.no_grad(), train.frozen_weights_in(torch.bfloat16, model.clip):
        low = {n for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(x, with_frozen=True)
    # by hand: per block (4 vision + 3 text) in_proj w/b, out_proj w/b, c_fc w/b, c_proj w/b;
    # conv1, proj, text_projection
    blocks = [f"clip.visual.transformer.resblocks.{b}." for b in range(4)] + [
        f"clip.transformer.resblocks.{b}." for b in range(3)
    ]
    expected = {
        p + n
        for p in blocks
        for n in (
            "attn.in_proj_weight",
            "attn.in_proj_bias",
            "attn.out_proj.weight",
            "attn.out_proj.bias",
            "mlp.c_fc.weight",
            "mlp.c_fc.bias",
            "mlp.c_proj.weight",
            "mlp.c_proj.bias",
        )
    }
    expected |= {"clip.visual.conv1.weight", "clip.visual.proj", "clip.text_projection"}
    assert low == expected
    for k in ("logits", "fused", "f_cls", "f0", "t"):
        assert torch.equal(got[k], ref[k]), k
    after = model.state_dict()
    assert all(
        after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items()
    )
    with train.frozen_weights_in(None, model.clip):  # fp32: nothing changes
        assert all(p.dtype == torch.float32 for p in model.parameters())


def with_eval_precision(c, precision):
    """c with eval_precision set (a Config field where there is one; otherwise a namespace copy of
    c)."""
    if any(f.name == "eval_precision" for f in dataclasses.fields(c)):
        return dataclasses.replace(c, eval_precision=precision)
    return types.SimpleNamespace(**vars(c), eval_precision=precision)


def seeded_batch(seed, device, n=8):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 32, 32, generator=g)
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    return images.to(device), labels.to(device)


def one_step(model, precision, device, seed, init_scale=SAFE_SCALE):
    """One train.train_step of model (classes set) on a seeded batch in precision: (loss, grad of R,
    scaler)."""
    amp = train.autocast_dtype(device, precision)
    batch, labels = seeded_batch(seed, device)
    opt = torch.optim.AdamW([p for p in model.trainable() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16, init_scale=init_scale)
    model.train()
    with train.frozen_weights_in(amp, model.clip):
        loss, parts, out = train.train_step(model, batch, labels, loss_fn, opt, scaler, amp)
    assert loss.dtype == out["fused"].dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.trainable())
    return loss.item(), model.tokens.R.grad.detach().cpu().clone(), scaler


def deviation(precision, seed, device):
    """precision against fp32 from the same state (model seed and batch seed `seed`): relative loss
    and grad R differences of one training step, max |fused logit difference| and the share of equal
    top-1 of a forward."""
    result = {}
    for p in ("fp32", precision):
        model = make_model(seed).to(device)
        model.set_classes(CLASSES, "a photo of a {}.")
        amp = train.autocast_dtype(device, p)
        x, _ = seeded_batch(1000 + seed, device, n=32)
        with torch.no_grad(), train.frozen_weights_in(amp, model.clip), train.autocast(device, amp):
            fused = model.eval()(x)["fused"].float().cpu()
        loss, grad, scaler = one_step(model, p, device, seed)
        assert scaler.get_scale() == (SAFE_SCALE if p == "fp16" else 1.0)  # no step was skipped
        result[p] = loss, grad, fused
    (l32, g32, f32), (l, g, f) = result["fp32"], result[precision]
    return {
        "loss": abs(l - l32) / l32,
        "grad": ((g - g32).norm() / g32.norm()).item(),
        "logits": (f - f32).abs().max().item(),
        "logits_rel": ((f - f32).abs().max() / f32.abs().max()).item(),
        "agree": (f.argmax(-1) == f32.argmax(-1)).float().mean().item(),
    }


def step_and_eval(precision, device, items):
    """An evaluation (train.evaluate in eval_precision = precision) and one train_step from the same
    state: (loss, grad of R, the accuracy on each of `items` lists, labelled with fp32's top-1)."""
    model = make_model().to(device)
    c = with_eval_precision(cfg(precision=precision, eval_batch_size=16), precision)
    runs = [
        train.evaluate(model, subset, CLASSES, "a photo of a {}.", c, device, log=lambda *_: None)
        for subset in items
    ]
    assert all(r["precision"] == precision for r in runs)
    model.set_classes(CLASSES, "a photo of a {}.")
    loss, grad, _ = one_step(model, precision, device, seed=3)
    return [loss, grad] + [r["accuracy"] for r in runs]


def labelled_by_fp32(images, device):
    """The test items labelled by fp32's top-1 (a forward written out here, not train.evaluate), and
    the subset where that top-1 leads the runner-up by more than MARGIN."""
    model = make_model().to(device).eval()
    model.set_classes(CLASSES, "a photo of a {}.")
    x = torch.stack(
        [data.test_transform(32)(Image.open(p).convert("RGB")) for p, _, _ in images]
    ).to(device)
    with torch.no_grad():
        fused = model(x)["fused"].double()
    top2 = fused.topk(2, -1)
    items = [(p, int(y), CLASSES[y]) for (p, _, _), y in zip(images, top2.indices[:, 0].tolist())]
    confident = [
        it for it, m in zip(items, (top2.values[:, 0] - top2.values[:, 1]).tolist()) if m > MARGIN
    ]
    return items, confident


def check_against_fp32(precision, device, images):
    items, confident = labelled_by_fp32(images, device)
    assert len(confident) >= len(items) // 2  # the confident subset is a real part of the test
    loss32, grad32, acc32, _ = step_and_eval("fp32", device, [items, confident])
    loss, grad, agree, agree_confident = step_and_eval(precision, device, [items, confident])
    tol = TOLERANCE[precision]
    assert acc32 == 100.0  # train.evaluate in fp32 agrees with the forward written out above
    assert abs(loss - loss32) <= tol["loss"] * loss32
    rel = ((grad - grad32).norm() / grad32.norm()).item()
    assert 1e-6 < rel <= tol["grad"]  # close, and not equal: the low precision did run
    assert agree >= 100 * tol["agree"] and agree_confident == 100.0


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cpu_precisions_agree_with_fp32(precision, images):
    """fp16 (the CUDA default's path: autocast fp16 + GradScaler, here CPU autocast) and bf16 on a
    CPU: one training step and an evaluation within the measured tolerances of fp32."""
    check_against_fp32(precision, CPU, images)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_precisions_agree_with_fp32(precision, images):
    check_against_fp32(precision, torch.device("cuda"), images)


def test_fp16_fresh_scaler_skips_then_recovers():
    """A fresh GradScaler (init 65536) on the tiny CLIP: the scaled gradients overflow fp16, so the
    first steps are skipped (R unchanged, the scale halved each time); then the scale fits and a
    step updates R, finite."""
    model = make_model()
    model.set_classes(CLASSES, "a photo of a {}.")
    batch, labels = seeded_batch(3, CPU)
    opt = torch.optim.AdamW([p for p in model.trainable() if p.requires_grad], lr=1e-3)
    scaler = train.make_scaler(CPU, torch.float16)
    assert scaler.is_enabled() and scaler.get_scale() == 65536.0
    scales, changed, R = [], [], model.tokens.R.detach().clone()
    model.train()
    with train.frozen_weights_in(torch.float16, model.clip):
        for _ in range(12):
            train.train_step(model, batch, labels, loss_fn, opt, scaler, torch.float16)
            scales.append(scaler.get_scale())
            changed.append(not torch.equal(model.tokens.R, R))
            R = model.tokens.R.detach().clone()
    skipped = next(i for i, c in enumerate(changed) if c)  # steps before the first real update
    assert skipped >= 1 and not any(changed[:skipped]) and all(changed[skipped:])
    # halved at every skip, then kept (it would grow after 2000 good steps)
    assert scales[:skipped] == [65536.0 / 2 ** (i + 1) for i in range(skipped)]
    assert scales[skipped:] == [scales[skipped - 1]] * (12 - skipped)
    assert torch.isfinite(model.tokens.R).all() and torch.isfinite(model.tokens.R.grad).all()


# ----------------------------------------------------------------------------------------- the loop


class Data:
    """A training set of the noise images with real labels (the loop only needs .train,
    .classnames, .template)."""

    def __init__(self, images, n=24):
        self.train = [(p, i % 3, CLASSES[i % 3]) for i, (p, _, _) in enumerate(images[:n])]
        self.classnames, self.template = CLASSES[:3], "a photo of a {}."


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(images, tmp_path):
    """A nan loss at epoch 2, step 3 (no check inside train_step): the run stops at the next check
    with the exact step in the message, and checkpoint.pt still holds the end of epoch 1, all
    finite."""
    calls = []

    def poisoned(model, out, labels):
        loss, parts = loss_fn(model, out, labels)
        calls.append(1)
        # 6 steps per epoch
        return (loss * float("nan"), parts) if len(calls) == 6 + 3 else (loss, parts)

    model, logs = make_model(), []
    with pytest.raises(
        RunError, match=r"became nan at epoch 2, step 3 .*last good checkpoint is kept"
    ):
        train.train(model, Data(images), cfg(epochs=3), CPU, str(tmp_path), logs.append, poisoned)
    # the nan did reach the parameters ...
    assert not all(torch.isfinite(p).all() for p in model.trainable())
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert (state["epoch"], state["step"], state["precision"]) == (
        1,
        0,
        "fp32",
    )  # ... but not the checkpoint
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    # it ran on to a log line of epoch 2, then stopped
    assert sum("epoch 2/3" in line for line in logs) >= 1


def test_persistent_workers_and_resume_replay_exactly(images, tmp_path, monkeypatch):
    """Random crops and flips seeded per (epoch, item): two worker processes kept alive across
    epochs give the same model as loading in the main process, and so does a run interrupted at
    epoch 2 and resumed."""
    ds, c0, c2 = (
        Data(images),
        cfg(epochs=3, crop_scale=0.3, lr=5e-3),
        cfg(epochs=3, crop_scale=0.3, lr=5e-3, workers=2),
    )
    ref = make_model()
    train.train(ref, ds, c0, CPU, str(tmp_path / "ref"), lambda m: None, loss_fn)
    real_lr_at = train.lr_at

    def interrupt(epoch, c):
        if epoch == 1:
            raise KeyboardInterrupt
        return real_lr_at(epoch, c)

    monkeypatch.setattr(train, "lr_at", interrupt)
    with pytest.raises(KeyboardInterrupt):
        train.train(make_model(), ds, c2, CPU, str(tmp_path / "run"), lambda m: None, loss_fn)
    monkeypatch.setattr(train, "lr_at", real_lr_at)
    resumed = make_model()
    train.train(resumed, ds, c2, CPU, str(tmp_path / "run"), lambda m: None, loss_fn)
    a, b = ref.trainable_state(), resumed.trainable_state()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(
        RunError, match="written with --precision fp32"
    ):  # a checkpoint resumes in its precision
        train.train(
            make_model(),
            ds,
            cfg(epochs=4, precision="bf16"),
            CPU,
            str(tmp_path / "run"),
            lambda m: None,
            loss_fn,
        )


def frozen_state(model):
    return {k: v.detach().clone() for k, v in model.clip.state_dict().items()}


def test_frozen_weights_come_back_after_an_exception():
    """An exception inside the half-precision block (an interrupted step): every frozen weight is
    fp32 again, bit for bit the original tensor."""
    model = make_model()
    before = frozen_state(model)
    storage = {n: p.data_ptr() for n, p in model.clip.named_parameters()}
    with pytest.raises(KeyboardInterrupt):
        with train.frozen_weights_in(torch.float16, model.clip):
            assert model.clip.visual.proj.dtype == torch.float16  # the block did change them
            raise KeyboardInterrupt
    for n, p in model.clip.named_parameters():
        assert p.dtype == torch.float32 and p.data_ptr() == storage[n], n
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layernorm_computes_in_fp32(dtype):
    """clip.model.LayerNorm on half-precision input, with and without autocast: fp32 statistics and
    fp32 affine weights, cast back to the input's dtype at the end. A LayerNorm in the input's dtype
    (weights rounded to it) gives different numbers on these inputs (large mean, weights not
    representable in half precision)."""
    from clip.model import LayerNorm

    torch.manual_seed(0)
    ln = LayerNorm(64)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(64))
        ln.bias.copy_(0.3 * torch.randn(64))
    x = (50 + 3 * torch.randn(4, 7, 64)).to(dtype)
    ref = F.layer_norm(x.float(), (64,), ln.weight, ln.bias, ln.eps).to(dtype)
    w, b = ln.weight.to(dtype).float(), ln.bias.to(dtype).float()  # the affine weights rounded
    low = F.layer_norm(x.float(), (64,), w, b, ln.eps)
    assert not torch.equal(low.to(dtype), ref)  # the nearest wrong rule differs here
    with torch.no_grad():
        assert torch.equal(ln(x), ref) and ln(x).dtype == dtype
        with torch.autocast("cpu", dtype=dtype):
            assert torch.equal(ln(x), ref)


def dtypes_seen_in_evaluate(c, images):
    """The dtypes inside train.evaluate: an MLP's weight and output in the last vision block, the
    block's output, and ln_post's output (forward hooks)."""
    model, seen = make_model(), set()
    block = model.clip.visual.transformer.resblocks[-1]

    def c_fc(m, i, o):
        seen.update({("c_fc weight", m.weight.dtype), ("c_fc out", o.dtype)})

    hooks = [
        block.mlp.c_fc.register_forward_hook(c_fc),
        block.register_forward_hook(lambda m, i, o: seen.add(("block out", o.dtype))),
        model.clip.visual.ln_post.register_forward_hook(
            lambda m, i, o: seen.add(("ln_post out", o.dtype))
        ),
    ]
    r = train.evaluate(model, images[:8], CLASSES, "a photo of a {}.", c, CPU, log=lambda *_: None)
    for h in hooks:
        h.remove()
    return r, seen


@pytest.mark.parametrize("training", ["fp16", "bf16"])
def test_evaluate_runs_in_fp32_unless_asked(training, images):
    """MMRL evaluates in fp32 (its model is clip_model.float() under PREC amp, its test() has no
    autocast): with training in fp16 or bf16 (CPU autocast standing in for CUDA), evaluate sees fp32
    weights and fp32 activations; eval_precision asks for half precision explicitly, and the result
    records which ran."""
    r, seen = dtypes_seen_in_evaluate(cfg(precision=training), images)
    assert r["precision"] == "fp32" and {d for _, d in seen} == {torch.float32}, seen
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[training]
    r, seen = dtypes_seen_in_evaluate(with_eval_precision(cfg(precision="fp32"), training), images)
    assert r["precision"] == training
    # the frozen weights in the low dtype, and autocast ran its matmuls in it; the token stream of
    # blocks J..L (the last block here) stays fp32 as in MMRL, where torch.cat with the fp32 tokens
    # promotes it
    assert {("c_fc weight", low), ("c_fc out", low), ("block out", torch.float32)} <= seen, seen


def test_training_leaves_every_frozen_tensor_unchanged(images, tmp_path):
    """Two epochs in fp16 (GradScaler) and in bf16: every frozen CLIP tensor (proj, text_projection,
    every weight that was stored in half precision during the run) is fp32 and bitwise what it was.
    """
    for precision in ("fp16", "bf16"):
        model = make_model()
        before = frozen_state(model)
        train.train(
            model,
            Data(images),
            cfg(precision=precision),
            CPU,
            str(tmp_path / precision),
            lambda m: None,
            loss_fn,
        )
        after = model.clip.state_dict()
        assert after.keys() == before.keys()
        assert all(after[k].dtype == before[k].dtype for k in before)
        assert all(torch.equal(after[k], before[k]) for k in before)
        assert not torch.equal(model.tokens.R, make_model().tokens.R)  # it did train


def test_train_counts_skipped_steps_and_logs_them(images, tmp_path, monkeypatch):
    """fp16 with a fresh GradScaler (65536, growth every 3 good steps so that the scale also grows):
    the steps where the scale went down are counted (counted here independently, from get_scale
    around every update), shown on the log lines and returned; a growing scale is not a skip."""
    scales, real = [], torch.amp.GradScaler.update

    def update(self, *a, **k):
        before = self.get_scale()
        real(self, *a, **k)
        scales.append((before, self.get_scale()))

    monkeypatch.setattr(torch.amp.GradScaler, "update", update)
    monkeypatch.setattr(
        train,
        "make_scaler",
        lambda device, amp: torch.amp.GradScaler(
            device.type, enabled=amp == torch.float16, growth_interval=3
        ),
    )
    logs = []
    c = cfg(epochs=3, lr=5e-3, precision="fp16")
    result = train.train(make_model(), Data(images), c, CPU, str(tmp_path), logs.append, loss_fn)
    skips = sum(after < before for before, after in scales)
    grows = sum(after > before for before, after in scales)
    assert len(scales) == result["steps"] == 18 and skips >= 1 and grows >= 1
    assert result["skipped_steps"] == skips and result["final_scale"] == scales[-1][1]
    assert f"skipped {skips} " in logs[-1] and all(" skipped " in line for line in logs)
    shown = [int(line.split(" skipped ")[1].split()[0]) for line in logs]
    assert shown == sorted(shown) and shown[0] < skips  # a running count, one skip at a time
    r32 = train.train(
        make_model(), Data(images), cfg(epochs=1), CPU, str(tmp_path / "fp32"), logs.append, loss_fn
    )
    assert r32 == {"steps": 6, "skipped_steps": 0, "final_scale": None}
    assert " skipped " not in logs[-1]


def test_the_first_nonfinite_step_is_the_one_reported(images, tmp_path):
    """12 steps per epoch, a check every 2 steps: a nan at step 3 poisons the parameters, so step 4
    is also nan before the next check; the message names step 3 (the first), not step 4."""
    calls = []

    def poisoned(model, out, labels):
        loss, parts = loss_fn(model, out, labels)
        calls.append(1)
        return (loss * float("nan"), parts) if len(calls) == 3 else (loss, parts)

    with pytest.raises(RunError, match=r"became nan at epoch 1, step 3 "):
        train.train(
            make_model(),
            Data(images, n=48),
            cfg(epochs=1),
            CPU,
            str(tmp_path),
            lambda m: None,
            poisoned,
        )
    assert len(calls) == 4  # it stopped at the check after step 4


def test_a_nonfinite_first_step_is_reported_in_full(images, tmp_path):
    """Step 1 (index 0) is a step too: wrong rule ruled out, "no bad step yet" read as index < 1.
    The whole message, with the checkpoint and both fixes."""
    poisoned = lambda model, out, labels: (
        loss_fn(model, out, labels)[0] * math.inf,
        {"ce": torch.tensor(1.0)},
    )
    with pytest.raises(RunError) as e:
        train.train(make_model(), Data(images), cfg(epochs=1), CPU, str(tmp_path), print, poisoned)
    assert str(e.value) == (
        f"the loss became inf at epoch 1, step 1 (parts: ce 1); the last good checkpoint is kept "
        f"in {tmp_path / 'checkpoint.pt'}. Try a lower --lr, or --precision fp32 to rule out a "
        "mixed-precision overflow."
    )


def test_each_epoch_trains_at_its_scheduled_lr(images, tmp_path, monkeypatch):
    """A warmup epoch at warmup_lr, then the cosine schedule (lr_at): the optimizer's lr at every
    step. Wrong rule ruled out: the schedule computed and logged but never given to AdamW."""
    opts, lrs, real = [], [], torch.optim.AdamW

    def adamw(*a, **k):
        opts.append(real(*a, **k))
        return opts[-1]

    def recording(model, out, labels):
        lrs.append(opts[0].param_groups[0]["lr"])
        return loss_fn(model, out, labels)

    monkeypatch.setattr(torch.optim, "AdamW", adamw)
    c = cfg(epochs=3, warmup_epochs=1, warmup_lr=1e-4, lr=3e-3, weight_decay=0.02)
    train.train(make_model(), Data(images), c, CPU, str(tmp_path), lambda m: None, recording)
    assert lrs == [train.lr_at(e, c) for e in range(3) for _ in range(6)]
    assert len(set(lrs)) == 3
    assert opts[0].param_groups[0]["weight_decay"] == 0.02  # not AdamW's default 0.01


def test_a_resumed_run_counts_its_steps_skips_and_eta_from_the_checkpoint(
    images, tmp_path, monkeypatch
):
    """Epoch 1 of 2, then resumed with 2 skipped steps recorded in its checkpoint (as an fp16 run
    would have): the count goes on from 2 (not -2), the last line says epoch 2/2 step 6/6 with
    nothing left (eta 0: 6 steps to do, not (2 + 1) x 6), and checkpoint.pt records where it is."""
    ticks = iter(range(10**6, 2 * 10**6, 7))  # the clock: 7 s between two readings
    monkeypatch.setattr(train, "time", type("Clock", (), {"time": lambda: next(ticks)}))
    model = make_model()
    train.train(model, Data(images), cfg(epochs=1), CPU, str(tmp_path), lambda m: None, loss_fn)
    path = tmp_path / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    assert (state["epoch"], state["step"], state["precision"], state["skipped_steps"]) == (
        1,
        0,
        "fp32",
        0,
    )
    assert state["model"].keys() == model.trainable_state().keys()
    torch.save(dict(state, skipped_steps=2), path)
    logs, hits = [], []

    def counting(model, out, labels):  # the epoch's training accuracy, counted here
        hits.append(int((out["fused"].argmax(-1) == labels).sum()))
        return loss_fn(model, out, labels)

    r = train.train(
        make_model(), Data(images), cfg(epochs=2), CPU, str(tmp_path), logs.append, counting
    )
    assert r == {"steps": 6, "skipped_steps": 2, "final_scale": None}
    assert logs[-1].startswith("epoch 2/2 step 6/6 ") and logs[-1].endswith(" eta 0m00s")
    assert f" acc {100 * sum(hits) / 24:.1f}% " in logs[-1] and sum(hits) > 0


def test_a_model_without_tokens_trains_nothing(images, tmp_path):
    logs = []
    frozen = DeAR(tiny_clip(text_layers=3), roles(), J=3, attr_tokens=False)
    r = train.train(frozen, Data(images), cfg(epochs=1), CPU, str(tmp_path), logs.append, loss_fn)
    assert r == {"steps": 0, "skipped_steps": 0, "final_scale": None}
    assert logs == [
        "no trainable parameters (no attribute tokens): nothing to train, the model is frozen CLIP"
    ]
    assert not (tmp_path / "checkpoint.pt").exists()


def host_reads_in_training(images, tmp_path, monkeypatch, n, device=CPU):
    """How often code of this project (not torch's) reads a tensor's value on the host during one
    epoch of train.train on n images (batch 4): .item(), .tolist(), bool(), float(), int() called
    from a project file."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    count = [0]
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            caller = sys._getframe(1).f_code.co_filename
            ours = caller.startswith(root) and "site-packages" not in caller
            # data.py's image pipeline reads CPU tensors of torch's RNG (the crop box, the flip),
            # as torchvision's transforms did: never a device tensor
            pipeline = caller == os.path.join(root, "data.py")
            if ours and "/tests/" not in caller and not pipeline:
                count[0] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    logs = []
    train.train(
        make_model().to(device),
        Data(images, n=n),
        cfg(epochs=1, precision="fp16"),
        device,
        str(tmp_path / str(n)),
        logs.append,
        loss_fn,
    )
    monkeypatch.undo()
    return count[0], len(logs)


def test_training_loop_reads_the_device_only_at_checks(images, tmp_path, monkeypatch):
    """fp16 + GradScaler on a CPU: host reads of tensor values by the project's code (a host sync on
    CUDA), one epoch of 5 steps against one of 10, both with 5 log lines (one read per check): the
    same number of reads, so no step reads one (a per-step .item() adds 5); set_classes, the
    checkpoint and start-up cost the same in both."""
    reads5, logs5 = host_reads_in_training(images, tmp_path, monkeypatch, n=20)
    reads10, logs10 = host_reads_in_training(images, tmp_path, monkeypatch, n=40)
    assert logs5 == logs10 == 5 and reads10 == reads5, (reads5, reads10)


@pytest.mark.cuda
@needs_cuda
def test_cuda_training_loop_waits_only_at_checks(images, tmp_path, monkeypatch):
    """On CUDA (the default fp16 + GradScaler), the host waits for the device at log lines, not at
    every step: synchronisations counted by torch's sync debug mode. set_classes, start-up and the
    checkpoint (scaler.state_dict() reads the scale) cost the same in one epoch of 5 steps and one
    of 10, and both have 5 log lines (a check each), so they sync equally often; a per-step .item()
    would add 5."""
    import warnings

    monkeypatch.setattr(train, "atomic_save", lambda *a, **k: None)
    device = torch.device("cuda")

    def syncs(n):
        logs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train.train(
                    make_model().to(device),
                    Data(images, n=n),
                    cfg(epochs=1),
                    device,
                    str(tmp_path / str(n)),
                    logs.append,
                    loss_fn,
                )
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught), len(logs)

    syncs(20)  # warm-up: first-call syncs (cuBLAS, allocator) stay out of the comparison
    (s5, l5), (s10, l10) = syncs(20), syncs(40)
    # 2: slack for the runtime's own; a per-step sync adds 5
    assert l5 == l10 == 5 and abs(s10 - s5) <= 2, (s5, s10)


@pytest.mark.cuda
@needs_cuda
def test_cuda_fused_sdpa_masked_attention_matches_math():
    """The kernel the method depends on, at ViT-B/16 shapes: fp16 per-head masked attention over 202
    tokens (CLS + 5 attribute tokens + 196 patches), 12 heads, the role masks of a mixed layout
    (dear.role_mask), through each fused SDPA backend available against the MATH backend (fp32
    reference too)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device, H, B, hs = torch.device("cuda"), 12, 4, 64
    kinds = [
        ("generalization", None),
        ("attribute", "color"),
        ("attribute", "shape"),
        ("mixed", None),
        ("specialist", None),
        ("attribute", "texture"),
    ]
    head_roles = [{"role": r, "attribute": a} for r, a in (kinds * 2)[:H]]
    mask = dear.role_mask(head_roles, 196).to(device)  # [12, 202, 202], 0 / -inf
    assert mask.shape == (H, 202, 202) and torch.isinf(mask).any()
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, 202, hs, device=device) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # fp32, any backend
    half = [t.half() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        math_out = F.scaled_dot_product_attention(*half, attn_mask=mask.half())
    assert (math_out.float() - ref).abs().max() < 1e-2
    ran = []
    fused = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)
    for backend in fused:
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(*half, attn_mask=mask.half())
        except RuntimeError:  # this backend does not take this input (flash: no arbitrary mask)
            continue
        ran.append(backend)
        assert torch.isfinite(out).all(), backend
        assert (out.float() - math_out.float()).abs().max() < 5e-3, backend
    assert ran, "no fused SDPA backend ran the masked fp16 attention"
    with torch.autocast("cuda", dtype=torch.float16):  # as DeAR calls it: no backend pinned
        auto = F.scaled_dot_product_attention(*half, attn_mask=mask.half())
    assert (auto.float() - math_out.float()).abs().max() < 5e-3


# python tests/test_precision.py --spread N [--device cuda]: the spread of the TOLERANCE table
if __name__ == "__main__":
    import argparse
    import statistics

    ap = argparse.ArgumentParser()
    ap.add_argument("--spread", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    for prec in ("fp16", "bf16"):
        rows = [deviation(prec, s, torch.device(a.device)) for s in range(a.spread)]
        for key in rows[0]:
            v = sorted(r[key] for r in rows)
            print(f"{prec} {key}: median {statistics.median(v):.2e} max {v[-1]:.2e} min {v[0]:.2e}")

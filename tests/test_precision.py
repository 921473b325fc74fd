"""train.py: precision modes against fp32, the frozen weights kept in the autocast dtype, the training loop's
bookkeeping (non-finite loss, persistent workers, exact resume), on a tiny random CLIP.

Tests marked `cuda` run only where CUDA is present (skipped elsewhere; `pytest -m cuda` selects them)."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import tiny_clip
import dear
import train
from dear import DeAR
from train import RunError

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Stated tolerances of a precision against fp32 on the tiny CLIP (one training step from the same state, and an
# evaluation): |loss difference| / loss, |grad R - grad R fp32| / |grad R fp32|, the share of test images whose
# top-1 equals fp32's (all of them where fp32's top-1 leads by more than MARGIN logits).
TOLERANCE = {"bf16": dict(loss=2e-3, grad=0.1, agree=0.85), "fp16": dict(loss=5e-4, grad=0.02, agree=0.95)}
MARGIN = 0.5


def roles(layers=range(1, 5)):
    block = [{"role": "generalization", "attribute": None}, {"role": "attribute", "attribute": "color"},
             {"role": "mixed", "attribute": None}, {"role": "specialist", "attribute": None}]
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
    return dear.resolve(dear.Config(**{"epochs": 2, "batch_size": 4, "workers": 0, "lambda_reg": 0.1, **kw}))


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


# ---------------------------------------------------------------------------------------------- precision


def test_precision_names_and_devices():
    assert train.resolve_precision("amp", CPU) == "fp32"  # CPU stays fp32 unless asked
    assert train.resolve_precision("amp", torch.device("cuda")) == "fp16"  # MMRL's PREC amp on CUDA
    assert train.resolve_precision("bf16", CPU) == "bf16" and train.autocast_dtype(CPU, "bf16") == torch.bfloat16
    assert train.autocast_dtype(CPU, "fp32") is None and train.autocast_dtype(CPU) is None
    with pytest.raises(RunError, match="fp16 needs a CUDA device"):
        train.resolve_precision("fp16", CPU)
    with pytest.raises(RunError, match="--precision"):
        train.resolve_precision("half", CPU)
    with pytest.raises(ValueError, match="--precision"):
        dear.resolve(dear.Config(precision="half"))


def test_frozen_weights_in_gives_autocast_exactly():
    """Casting the frozen matmul weights once gives the very numbers autocast gives with fp32 weights; LayerNorm,
    embeddings, logit_scale and every trainable parameter stay fp32; the fp32 originals come back after."""
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
    # by hand: per block (4 vision + 3 text) in_proj w/b, out_proj w/b, c_fc w/b, c_proj w/b; conv1, proj, text_projection
    blocks = [f"clip.visual.transformer.resblocks.{b}." for b in range(4)] + \
             [f"clip.transformer.resblocks.{b}." for b in range(3)]
    expected = {p + n for p in blocks for n in ("attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight",
                                                 "attn.out_proj.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                                                 "mlp.c_proj.weight", "mlp.c_proj.bias")}
    expected |= {"clip.visual.conv1.weight", "clip.visual.proj", "clip.text_projection"}
    assert low == expected
    for k in ("logits", "fused", "f_cls", "f0", "t"):
        assert torch.equal(got[k], ref[k]), k
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
    with train.frozen_weights_in(None, model.clip):  # fp32: nothing changes
        assert all(p.dtype == torch.float32 for p in model.parameters())


def step_and_eval(precision, device, items):
    """An evaluation and one train_step from the same state, in `precision` on `device`: (loss, grad of R, the
    accuracy on items labelled with fp32's top-1, the same on the confident subset)."""
    model = make_model().to(device)
    model.set_classes(CLASSES, "a photo of a {}.")
    c = cfg(precision=precision, eval_batch_size=16)
    accuracy = [train.evaluate(model, subset, CLASSES, "a photo of a {}.", c, device, log=lambda *_: None)["accuracy"]
                for subset in items]
    model.set_classes(CLASSES, "a photo of a {}.")
    amp = train.autocast_dtype(device, precision)
    torch.manual_seed(3)
    batch, labels = torch.randn(8, 3, 32, 32).to(device), torch.randint(0, len(CLASSES), (8,)).to(device)
    opt = torch.optim.AdamW([p for p in model.trainable() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    model.train()
    with train.frozen_weights_in(amp, model.clip):
        loss, parts, out = train.train_step(model, batch, labels, loss_fn, opt, scaler, amp)
    assert loss.dtype == out["fused"].dtype == torch.float32 and all(p.dtype == torch.float32 for p in model.trainable())
    return [loss.item(), model.tokens.R.grad.detach().cpu().clone()] + accuracy


def labelled_by_fp32(images, device):
    """The test items labelled by fp32's top-1 (a forward written out here, not train.evaluate), and the subset
    where that top-1 leads the runner-up by more than MARGIN."""
    model = make_model().to(device).eval()
    model.set_classes(CLASSES, "a photo of a {}.")
    x = torch.stack([dear.data.test_transform(32)(Image.open(p).convert("RGB")) for p, _, _ in images]).to(device)
    with torch.no_grad():
        fused = model(x)["fused"].double()
    top2 = fused.topk(2, -1)
    items = [(p, int(y), CLASSES[y]) for (p, _, _), y in zip(images, top2.indices[:, 0].tolist())]
    confident = [it for it, m in zip(items, (top2.values[:, 0] - top2.values[:, 1]).tolist()) if m > MARGIN]
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


def test_bf16_on_cpu_agrees_with_fp32(images):
    check_against_fp32("bf16", CPU, images)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_precisions_agree_with_fp32(precision, images):
    check_against_fp32(precision, torch.device("cuda"), images)


# ---------------------------------------------------------------------------------------------- the loop


class Data:
    """A training set of the noise images with real labels (the loop only needs .train, .classnames, .template)."""

    def __init__(self, images, n=24):
        self.train = [(p, i % 3, CLASSES[i % 3]) for i, (p, _, _) in enumerate(images[:n])]
        self.classnames, self.template = CLASSES[:3], "a photo of a {}."


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(images, tmp_path):
    """A nan loss at epoch 2, step 3 (no check inside train_step): the run stops at the next check with the
    exact step in the message, and checkpoint.pt still holds the end of epoch 1, all finite."""
    calls = []

    def poisoned(model, out, labels):
        loss, parts = loss_fn(model, out, labels)
        calls.append(1)
        return (loss * float("nan"), parts) if len(calls) == 6 + 3 else (loss, parts)  # 6 steps per epoch
    model, logs = make_model(), []
    with pytest.raises(RunError, match=r"became nan at epoch 2, step 3 .*last good checkpoint is kept"):
        train.train(model, Data(images), cfg(epochs=3), CPU, str(tmp_path), logs.append, poisoned)
    assert not all(torch.isfinite(p).all() for p in model.trainable())  # the nan did reach the parameters ...
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert (state["epoch"], state["step"], state["precision"]) == (1, 0, "fp32")  # ... but not the checkpoint
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert sum("epoch 2/3" in line for line in logs) >= 1  # it ran on to a log line of epoch 2, then stopped


def test_persistent_workers_and_resume_replay_exactly(images, tmp_path, monkeypatch):
    """Random crops and flips seeded per (epoch, item): two worker processes kept alive across epochs give the
    same model as loading in the main process, and so does a run interrupted at epoch 2 and resumed."""
    ds, c0, c2 = Data(images), cfg(epochs=3, crop_scale=0.3, lr=5e-3), cfg(epochs=3, crop_scale=0.3, lr=5e-3, workers=2)
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
    with pytest.raises(RunError, match="written with --precision fp32"):  # a checkpoint resumes in its precision
        train.train(make_model(), ds, cfg(epochs=4, precision="bf16"), CPU, str(tmp_path / "run"),
                    lambda m: None, loss_fn)


@pytest.mark.cuda
@needs_cuda
def test_cuda_training_loop_waits_only_at_checks(images, tmp_path, monkeypatch):
    """On CUDA (the default fp16 + GradScaler), the host waits for the device at log lines, not at every step
    (counted by torch's sync debug mode; checkpoint writing, which copies to the host, is left out)."""
    import warnings
    monkeypatch.setattr(train, "atomic_save", lambda *a, **k: None)
    device, ds = torch.device("cuda"), Data(images, n=64)  # 16 steps per epoch, 6 log lines per epoch
    model, logs = make_model().to(device), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train.train(model, ds, cfg(epochs=2), device, str(tmp_path), logs.append, loss_fn)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    steps, checks = 2 * 16, len(logs) + 2  # a check at every log line and at every epoch end
    assert len(syncs) <= checks + 10 < steps, [str(w.message) for w in syncs[:5]]  # + 10: set_classes, start-up

"""train.py on a tiny CLIP: a run interrupted inside an epoch resumes bit-identically, every epoch
has its own order of all the images, and evaluate scores the logits it is asked for."""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import tiny_clip
import data
import dear
import train
from dear import DeAR

COLORS = [(220, 40, 40), (40, 200, 60), (40, 80, 220), (230, 210, 40)]
PER_CLASS, BATCH, EPOCHS = 5, 4, 2  # 20 images: 5 steps per epoch, none dropped
STEPS = PER_CLASS * len(COLORS) // BATCH


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    """A 4-class dataset of noisy coloured 32x32 squares, 5 per class;
    the same items train and test."""
    root = tmp_path_factory.mktemp("squares")
    rng, items = np.random.default_rng(0), []
    for c, color in enumerate(COLORS):
        for i in range(PER_CLASS):
            path = root / f"{c}_{i}.png"
            Image.fromarray(
                np.clip(np.array(color) + rng.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
            ).save(path)
            items.append((str(path), c, f"class {c}"))
    names = [f"class {c}" for c in range(len(COLORS))]
    return data.Dataset(
        name="squares",
        train=items,
        val=[],
        test=items,
        classnames=names,
        template="a photo of a {}.",
    )


def fresh_model(seed=0):
    torch.manual_seed(seed)
    return DeAR(tiny_clip(text_layers=3), None, J=3, beta=0.5, rep_dim=16, mask="none")


# crop_scale 0.5: random crops, so a resumed epoch must also replay the augmentation
CFG = dear.resolve(
    dear.Config(
        epochs=EPOCHS, batch_size=BATCH, warmup_epochs=0, lr=1e-2, crop_scale=0.5, workers=0
    )
)


def recording_loss(calls, stop_at=None):
    """The DeAR loss, recording each step's labels;
    raises KeyboardInterrupt at call number stop_at (0-based)."""

    def loss_fn(model, out, labels):
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        calls.append(labels.tolist())
        return dear.dear_loss(
            out, labels, model.t0, model.alpha(), lambda_reg=1.0, lambda_fusion=1.0
        )

    return loss_fn


def run(ds, rdir, loss_fn):
    model = fresh_model()
    train.train(
        model, ds, CFG, torch.device("cpu"), str(rdir), lambda msg: None, loss_fn, ckpt_every_s=0
    )
    return model.trainable_state()


@pytest.fixture(scope="module")
def full_run(squares, tmp_path_factory):
    """A run never interrupted: (its trained state, the labels of every step)."""
    calls = []
    state = run(squares, tmp_path_factory.mktemp("full"), recording_loss(calls))
    assert len(calls) == EPOCHS * STEPS
    return state, calls


def test_resume_inside_an_epoch_is_bit_identical(squares, full_run, tmp_path):
    """Interrupted at step 3 of epoch 2 (checkpoints after every step): the resumed run does exactly
    the steps that were left, on the same batches, and ends with the same weights as a run never
    interrupted."""
    (full, full_calls), cut_calls, resumed_calls = full_run, [], []
    done = STEPS + 2  # all of epoch 1, steps 1-2 of epoch 2
    with pytest.raises(KeyboardInterrupt):
        run(squares, tmp_path / "cut", recording_loss(cut_calls, stop_at=done))
    assert (tmp_path / "cut" / "checkpoint.pt").exists()
    resumed = run(squares, tmp_path / "cut", recording_loss(resumed_calls))
    assert resumed_calls == full_calls[done:]  # no step repeated, none skipped, the same batches
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    # it did train
    assert not torch.equal(full["tokens.R"], fresh_model().trainable_state()["tokens.R"])


def test_every_epoch_has_a_new_order_of_all_images(squares, full_run):
    calls = full_run[1]
    # labels in the order seen
    epochs = [sum(calls[e * STEPS : (e + 1) * STEPS], []) for e in range(EPOCHS)]
    labels = sorted(y for _, y, _ in squares.train)
    assert all(sorted(order) == labels for order in epochs)  # every image once per epoch
    assert epochs[0] != epochs[1]


def test_evaluate_scores_the_logits_it_is_asked_for(squares):
    """Labels set to the class-logit prediction on images where the fused prediction differs: the
    class-only rule scores 100%, the fused rule 0%."""
    model = fresh_model()
    with (
        torch.no_grad()
    ):  # tokens that matter and fusion weights that favour them, so the two rules disagree
        model.tokens.R.normal_()
        model.P_attr.add_(0.5 * torch.randn_like(model.P_attr))
        model.w.copy_(torch.tensor([-3.0, 0, 0, 0, 0, 0]))
    out = outputs_on_test(model, squares)
    cls, fused = out["logits"][:, 0].argmax(-1), out["fused"].argmax(-1)
    items = [(p, int(cls[i]), "") for i, (p, _, _) in enumerate(squares.test) if cls[i] != fused[i]]
    assert len(items) >= 3
    # several batches, the last one partial
    cfg = dear.resolve(dear.Config(eval_batch_size=2, workers=0))
    for rule, expected in (("cls", 100.0), ("fused", 0.0)):
        r = train.evaluate(
            model,
            items,
            squares.classnames,
            squares.template,
            cfg,
            torch.device("cpu"),
            logits=rule,
            log=lambda msg: None,
        )
        assert r["accuracy"] == pytest.approx(expected) and r["n"] == len(items)
        assert sum(c["n"] for c in r["per_class"]) == len(items)


def outputs_on_test(model, ds):
    """The model's forward (fp32, no autograd) on every test image of ds, with ds's classes."""
    model.set_classes(ds.classnames, ds.template)
    transform = data.test_transform(32)
    images = torch.stack([transform(Image.open(p).convert("RGB")) for p, _, _ in ds.test])
    with torch.no_grad():
        return model(images)


def predicted(model, ds):
    """(path, the model's own fused prediction, "") for every test item: 100% for evaluate."""
    fused = outputs_on_test(model, ds)["fused"].argmax(-1)
    return [(p, int(fused[i]), "") for i, (p, _, _) in enumerate(ds.test)]


def test_evaluate_wiring_progress_and_one_image_classes(squares, monkeypatch):
    """evaluate on the CPU, batches of one image. Its DataLoader gets eval_batch_size and workers,
    keeps the order and pins no memory on a CPU; the class text features are computed once, not
    again at every batch; a progress line comes at every fifth of the batches (every batch when
    there are fewer than 10), never at the last, with the count and the linear ETA (elapsed / done
    x left); an accuracy divides by the true count, also for one image (max(1, n) only guards 0)."""
    model = fresh_model()
    items = predicted(model, squares)
    loaders, real_loader = [], torch.utils.data.DataLoader
    monkeypatch.setattr(
        torch.utils.data, "DataLoader", lambda *a, **kw: loaders.append(kw) or real_loader(*a, **kw)
    )
    encodes, real_encode = [], model.encode_classes
    monkeypatch.setattr(model, "encode_classes", lambda: encodes.append(1) or real_encode())
    ticks = iter(range(1000, 2000, 6))  # the clock: 6 s between two readings
    monkeypatch.setattr(train, "time", type("Clock", (), {"time": lambda: next(ticks)}))
    cfg = dear.resolve(dear.Config(eval_batch_size=1, workers=0))

    def evaluate(items):
        logs, encodes[:] = [], []
        r = train.evaluate(
            model,
            items,
            squares.classnames,
            squares.template,
            cfg,
            torch.device("cpu"),
            log=logs.append,
            name="test",
        )
        assert len(encodes) == 1 and r["n"] == len(items) and r["accuracy"] == 100.0
        return r, [line.split(": ")[1] for line in logs]

    # 17 batches: a line every 3 (17 // 5; // 6 would be 2), the 15th the last
    _, logs = evaluate(items[:17])
    assert logs == [
        f"{k}/17 batches, eta 0m{eta:02d}s"
        for k, eta in [(3, 28), (6, 22), (9, 16), (12, 10), (15, 4)]
    ]  # 6 s a line: elapsed 2k s at batch k, so 2k / k x (17 - k)
    assert loaders[-1]["batch_size"] == 1 and loaders[-1]["num_workers"] == 0
    assert loaders[-1]["shuffle"] is False and loaders[-1]["pin_memory"] is False
    # 5 batches: a line after each but the last; one of them the only image of its class
    lone = min(range(len(COLORS)), key=lambda c: sum(y == c for _, y, _ in items) or 99)
    few = [next(i for i in items if i[1] == lone)] + [i for i in items if i[1] != lone][:4]
    r, logs = evaluate(few)
    assert [line.split(",")[0] for line in logs] == [f"{k}/5 batches" for k in range(1, 5)]
    assert (r["per_class"][lone]["n"], r["per_class"][lone]["accuracy"]) == (1, 100.0)
    r, logs = evaluate(items[:1])  # one image in all
    assert logs == [] and r["accuracy"] == 100.0


# ------------------------------------------------------------------------------------ fp16 vs fp32

SAFE_SCALE = 2.0**8  # no step of the tiny CLIP overflows at this scale (tests/test_precision.py)
# A short run (2 epochs, 10 steps, lr 1e-2) in fp16 / bf16 against fp32 from the same state,
# measured over 10 model seeds on a CPU (short_run with seeds 0-9):
#   worst step's relative loss difference: fp16 median 5.6e-4, max 1.5e-3; bf16 5.0e-3, 1.1e-2
#   |R - R fp32| / |R fp32 - R initial|:   fp16 median 3.8e-3, max 1.1e-2; bf16 3.2e-2, 9.2e-2
#   test accuracy difference (points):     fp16 max 0; bf16 max 5 (one image of 20)
# Tolerances: about twice the maximum; accuracy one image (fp16) or two (bf16) more than measured.
SHORT_RUN_TOLERANCE = {
    "fp16": dict(loss=3e-3, R=2e-2, acc=5.0),
    "bf16": dict(loss=2.5e-2, R=0.2, acc=10.0),
}


def short_run(ds, precision, seed, rdir):
    """train.train for EPOCHS epochs in precision (fp16: GradScaler at SAFE_SCALE, so no step is
    skipped) from fresh_model(seed): {losses [steps], R0, R, acc: fp32 test accuracy, result: what
    train returned}."""
    losses, model = [], fresh_model(seed)
    R0 = model.tokens.R.detach().clone()

    def loss_fn(model, out, labels):
        loss, parts = dear.dear_loss(
            out, labels, model.t0, model.alpha(), lambda_reg=1.0, lambda_fusion=1.0
        )
        losses.append(loss.detach().clone())
        return loss, parts

    real = train.make_scaler
    train.make_scaler = lambda device, amp: torch.amp.GradScaler(
        device.type, enabled=amp == torch.float16, init_scale=SAFE_SCALE
    )
    try:
        cfg = dataclasses.replace(CFG, precision=precision)
        result = train.train(
            model, ds, cfg, torch.device("cpu"), str(rdir), lambda msg: None, loss_fn
        )
    finally:
        train.make_scaler = real
    r = train.evaluate(
        model, ds.test, ds.classnames, ds.template, CFG, torch.device("cpu"), log=lambda m: None
    )
    return {
        "losses": torch.stack(losses),
        "R0": R0,
        "R": model.tokens.R.detach().clone(),
        "acc": r["accuracy"],
        "result": result,
    }


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_short_run_in_half_precision_agrees_with_fp32(squares, precision, tmp_path):
    """A short train.train run (10 steps) in fp16 (CUDA's default path: autocast fp16 + GradScaler,
    here CPU autocast) and in bf16 against fp32: every step's loss, the trained tokens and the test
    accuracy within the measured spread; nothing skipped, everything finite."""
    ref = short_run(squares, "fp32", 0, tmp_path / "fp32")
    got = short_run(squares, precision, 0, tmp_path / precision)
    tol = SHORT_RUN_TOLERANCE[precision]
    assert got["result"]["skipped_steps"] == 0 and got["result"]["steps"] == EPOCHS * STEPS
    assert torch.isfinite(got["R"]).all()
    assert len(got["losses"]) == len(ref["losses"]) == EPOCHS * STEPS
    assert ((got["losses"] - ref["losses"]).abs() / ref["losses"]).max() <= tol["loss"]
    moved = (ref["R"] - ref["R0"]).norm()
    # close, and not equal: half precision did run
    assert moved > 0 and 0 < (got["R"] - ref["R"]).norm() / moved <= tol["R"]
    assert abs(got["acc"] - ref["acc"]) <= tol["acc"]


def test_evaluate_counts_per_class_by_the_true_label(squares):
    """Labels that are right for every third image and wrong otherwise, unequal class counts:
    per_class[c] counts the images whose true label is c (n) and the share of them predicted c;
    counting by the predicted label (the nearest wrong rule) gives other numbers here."""
    model = fresh_model()
    with torch.no_grad():  # tokens and fusion weights that spread the predictions over the classes
        model.tokens.R.normal_()
        model.P_attr.add_(0.5 * torch.randn_like(model.P_attr))
    pred = outputs_on_test(model, squares)["fused"].argmax(-1).tolist()
    C = len(squares.classnames)
    labels = [p if i % 3 == 0 else (p + 1 + i % 2) % C for i, p in enumerate(pred)]
    items = [(path, y, "") for (path, _, _), y in zip(squares.test, labels)]
    n = [labels.count(c) for c in range(C)]
    hits = [sum(p == y == c for p, y in zip(pred, labels)) for c in range(C)]
    by_pred = [pred.count(c) for c in range(C)]
    assert len(set(n)) > 1 and by_pred != n  # unequal counts; the wrong rule counts differently
    cfg = dear.resolve(dear.Config(eval_batch_size=3, workers=0))
    r = train.evaluate(
        model,
        items,
        squares.classnames,
        squares.template,
        cfg,
        torch.device("cpu"),
        log=lambda msg: None,
    )
    assert [c["n"] for c in r["per_class"]] == n
    assert [c["class"] for c in r["per_class"]] == squares.classnames
    assert [c["accuracy"] for c in r["per_class"]] == pytest.approx(
        [100.0 * h / max(1, k) for h, k in zip(hits, n)]
    )
    assert r["accuracy"] == pytest.approx(100.0 * sum(hits) / len(items)) and r["n"] == len(items)
    assert r["precision"] == "fp32" and r["logits"] == "fused"


def test_lr_at_warmup_then_cosine_per_epoch():
    """Two warm-up epochs at warmup_lr, then lr (1 + cos(pi (e - W) / E)) / 2 stepped once per
    epoch: on W = 2, E = 6 the nearest wrong rules (cosine counted from epoch 0, over E - W epochs,
    warm-up of W - 1 or W + 1 epochs, or a linear decay) all give other values."""
    import math
    import types

    cfg = types.SimpleNamespace(warmup_epochs=2, warmup_lr=1e-5, lr=2e-3, epochs=6)
    got = [train.lr_at(e, cfg) for e in range(6)]
    cosine = [2e-3 * (1 + math.cos(math.pi * (e - 2) / 6)) / 2 for e in range(2, 6)]
    assert got[:2] == [1e-5, 1e-5] and got[2:] == pytest.approx(cosine, rel=1e-12)
    assert got[2] == pytest.approx(2e-3)
    assert got[5] == pytest.approx(2e-3 * (1 + math.cos(math.pi / 2)) / 2)


# ------------------------------------------------------------------ mutation survivors (mutate.sh)


def test_resolve_precision_bf16_needs_a_gpu_that_supports_it(monkeypatch):
    """bf16 on a CUDA device without bfloat16 support stops with advice; with support, or for the
    other precisions, or on a CPU, it resolves; an unknown name lists the choices."""
    import types

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(
        train.RunError,
        match=r"^--precision bf16: this GPU does not support "
        r"bfloat16; use --precision fp16 \(or amp\)$",
    ):
        train.resolve_precision("bf16", cuda)
    assert train.resolve_precision("fp16", cuda) == "fp16"
    assert train.resolve_precision("fp32", cuda) == "fp32"
    assert train.resolve_precision("bf16", torch.device("cpu")) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert train.resolve_precision("bf16", cuda) == "bf16"
    with pytest.raises(
        train.RunError, match=r"^unknown --precision 'half'; choose amp, fp16, bf16, fp32$"
    ):
        train.resolve_precision("half", torch.device("cpu"))
    # a config without eval_precision evaluates in fp32, whatever it trains in
    cfg = types.SimpleNamespace(precision="bf16")
    assert train.eval_precision(cfg, torch.device("cpu")) == "fp32"


def test_epoch_batches_drop_the_last_partial_batch():
    """10 items in batches of 4: two full batches of distinct items (the last 2 dropped, as Dassl);
    fewer items than a batch: one batch of all of them."""
    batches = train.epoch_batches(10, 4, 0)
    assert [len(b) for b in batches] == [4, 4] and len(set(sum(batches, []))) == 8
    assert sorted(sum(train.epoch_batches(3, 4, 0), [])) == [0, 1, 2]


def test_scale_of_is_on_the_device_it_is_asked_for():
    """A disabled scaler's 1 and a fresh scaler's first scale are made on the device given (here
    torch's meta device, which needs no GPU), not on the CPU."""
    meta = torch.device("meta")
    off = train.scale_of(train.make_scaler(torch.device("cpu"), None), meta)
    fresh = train.scale_of(train.make_scaler(torch.device("cpu"), torch.float16), meta)
    assert off.device.type == fresh.device.type == "meta" and off.shape == fresh.shape == ()


def test_resume_reads_a_checkpoint_without_newer_fields_and_says_where_it_continues(tmp_path):
    """A checkpoint written before precision and skipped_steps were recorded resumes (as this
    run's precision, 0 skipped); one with skipped_steps returns them; the log line names the next
    epoch (1-based) and the step."""
    cpu, lin = torch.device("cpu"), torch.nn.Linear(2, 2)
    opt, scaler = torch.optim.AdamW(lin.parameters()), train.make_scaler(torch.device("cpu"), None)
    base = {
        "model": lin.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": 3,
        "step": 2,
    }
    old, new = tmp_path / "old.pt", tmp_path / "new.pt"
    torch.save(base, old)
    torch.save({**base, "precision": "fp32", "skipped_steps": 5}, new)
    logs = []
    assert train.resume(str(old), lin, opt, scaler, "fp32", cpu, logs.append) == (3, 2, 0)
    assert logs == [f"resuming from {old}: epoch 4, step 2"]
    assert train.resume(str(new), lin, opt, scaler, "fp32", cpu, logs.append) == (3, 2, 5)


def linear_checkpoint(path, precision="fp16", **extra):
    """A checkpoint of a trained Linear, its AdamW (one step taken) and an fp16 GradScaler at scale
    2**10, 3 steps skipped: (path, the saved state)."""
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    state = {
        "model": lin.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": 1,
        "step": 4,
        "precision": precision,
        "skipped_steps": 3,
        **extra,
    }
    torch.save(state, path)
    return str(path), state


def fresh_training():
    lin = torch.nn.Linear(2, 2)
    return lin, torch.optim.AdamW(lin.parameters(), lr=0.1), torch.amp.GradScaler("cpu")


def test_resume_loads_the_model_the_optimizer_and_the_scaler(tmp_path):
    """Wrong rules ruled out: returning the position without loading (or loading only the model):
    the weights, AdamW's moments and step and the scaler's scale all come back."""
    path, saved = linear_checkpoint(tmp_path / "checkpoint.pt")
    lin, opt, scaler = fresh_training()
    cpu = torch.device("cpu")
    assert train.resume(path, lin, opt, scaler, "fp16", cpu, lambda m: None) == (1, 4, 3)
    assert all(torch.equal(v, lin.state_dict()[k]) for k, v in saved["model"].items())
    moments = opt.state_dict()["state"][0]
    assert torch.equal(moments["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])
    assert int(moments["step"]) == 1 and scaler.get_scale() == 2.0**10


def test_resume_refuses_other_precisions_and_code_in_a_checkpoint(tmp_path, capsys):
    """Another precision: one line naming both precisions and the fixes, nothing loaded. A
    checkpoint that would run code when unpickled (weights_only=False would load it): refused with
    the first line of torch's message only."""
    path, _ = linear_checkpoint(tmp_path / "checkpoint.pt")
    lin, opt, scaler = fresh_training()
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    cpu = torch.device("cpu")
    with pytest.raises(train.RunError) as e:
        train.resume(path, lin, opt, scaler, "bf16", cpu, lambda m: None)
    assert str(e.value) == (
        f"{path} was written with --precision fp16; resume with that precision (this run has "
        "bf16), or pass --force to start over"
    )
    assert all(torch.equal(v, lin.state_dict()[k]) for k, v in before.items())
    assert opt.state_dict()["state"] == {}
    evil, _ = linear_checkpoint(tmp_path / "evil.pt", hook=Evil())
    with pytest.raises(train.RunError) as e:
        train.resume(evil, lin, opt, scaler, "fp16", cpu, lambda m: None)
    try:
        torch.load(evil, weights_only=True)
    except Exception as torch_error:
        lines = str(torch_error).splitlines()
    assert len(lines) > 1  # a message of several lines, of which only the first is kept
    assert str(e.value) == (
        f"the checkpoint {evil} cannot be resumed (UnpicklingError: {lines[0]}); pass --force "
        "to start the run over"
    )
    assert not Evil.ran
    empty = tmp_path / "empty.pt"  # a truncated write: torch raises EOFError with no message
    empty.write_bytes(b"")
    with pytest.raises(train.RunError) as e:
        train.resume(str(empty), lin, opt, scaler, "fp16", cpu, lambda m: None)
    assert str(e.value) == (
        f"the checkpoint {empty} cannot be resumed (EOFError: ); pass --force to start the run over"
    )
    state = torch.load(path, weights_only=True)
    del state["step"]  # written by other code: loads, but says nowhere where to continue
    torch.save(state, tmp_path / "stepless.pt")
    with pytest.raises(train.RunError) as e:  # one line, not a KeyError traceback
        train.resume(str(tmp_path / "stepless.pt"), lin, opt, scaler, "fp16", cpu, print)
    assert str(e.value) == (
        f"the checkpoint {tmp_path / 'stepless.pt'} cannot be resumed (KeyError: 'step'); pass "
        "--force to start the run over"
    )


class Evil:
    """An object whose unpickling runs code."""

    ran = False

    def __reduce__(self):
        return (setattr, (Evil, "ran", True))


# Equivalent mutants (mutate.sh), one line each:
# matmul_weights: m.parameters(recurse=True / None) for a Linear or Conv2d (2 mutants): they have no
#   sub-modules, so their own parameters are all there are (None reads as False).
# epoch_batches: n > batch_size instead of >=: at n == batch_size the slice keeps all n either way.
# train_step: opt.zero_grad(set_to_none=False / None) (2 mutants): the graph is the same at every
#   step, so a parameter with a gradient once has a fresh one at every step; AdamW sees the same.
# evaluate: pin_memory compared with "XXcudaXX" / "CUDA" (2 mutants): False on a CPU, as the code
#   gives there.
# evaluate: device None or dropped in torch.zeros and .to (8 mutants): the CPU, where the tests run;
#   non_blocking False or dropped (4): the same values (the copy only waits).
# evaluate: scores.argmax(+1) on [B, C]: the same axis as -1.
# evaluate: name="XXXX" (a default value): mutmut's trampoline keeps the original signature.
# resume: torch.load's map_location None or dropped (2 mutants): the CPU, where the tests run;
#   weights_only None or dropped (2): torch's default is True (since 2.6), as given; strict=None
#   in load_state_dict: falsy, as False.
# train (a sample: the mutants numbered 5, 10, 15, ...): images.to(None), resume(..., None, ...),
#   scale_of(scaler, None) (the CPU, where the tests run); labels.to(..., non_blocking=False) (the
#   same values); argmax(+1) of the fused [B, C]; {"fused": False} and pin_memory compared with
#   "XXcudaXX" (CUDA only); first_bad[1] < 0 (the stored loss) for first_bad[0] < 0 (its step) as
#   "no bad step yet": the loss is a sum of terms >= 0, so a stored non-finite one (inf, nan) is
#   never < 0 either.
# frozen_weights_in is contextlib.contextmanager(frozen_weights) and evaluate has no decorator,
#   so both are mutated (mutmut 3 skips decorated functions).

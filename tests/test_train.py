"""train.py on a tiny CLIP: a run interrupted inside an epoch resumes bit-identically, every epoch has its own
order of all the images, and evaluate scores the logits it is asked for."""
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
    """A 4-class dataset of noisy coloured 32x32 squares, 5 per class; the same items train and test."""
    root = tmp_path_factory.mktemp("squares")
    rng, items = np.random.default_rng(0), []
    for c, color in enumerate(COLORS):
        for i in range(PER_CLASS):
            path = root / f"{c}_{i}.png"
            Image.fromarray(np.clip(np.array(color) + rng.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)).save(path)
            items.append((str(path), c, f"class {c}"))
    names = [f"class {c}" for c in range(len(COLORS))]
    return data.Dataset(name="squares", train=items, val=[], test=items, classnames=names, template="a photo of a {}.")


def fresh_model():
    torch.manual_seed(0)
    return DeAR(tiny_clip(text_layers=3), None, J=3, beta=0.5, rep_dim=16, mask="none")


# crop_scale 0.5: random crops, so a resumed epoch must also replay the augmentation
CFG = dear.resolve(dear.Config(epochs=EPOCHS, batch_size=BATCH, warmup_epochs=0, lr=1e-2, crop_scale=0.5, workers=0))


def recording_loss(calls, stop_at=None):
    """The DeAR loss, recording each step's labels; raises KeyboardInterrupt at call number stop_at (0-based)."""
    def loss_fn(model, out, labels):
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        calls.append(labels.tolist())
        return dear.dear_loss(out, labels, model.t0, model.alpha(), lambda_reg=1.0, lambda_fusion=1.0)
    return loss_fn


def run(ds, rdir, loss_fn):
    model = fresh_model()
    train.train(model, ds, CFG, torch.device("cpu"), str(rdir), lambda msg: None, loss_fn, ckpt_every_s=0)
    return model.trainable_state()


@pytest.fixture(scope="module")
def full_run(squares, tmp_path_factory):
    """A run never interrupted: (its trained state, the labels of every step)."""
    calls = []
    state = run(squares, tmp_path_factory.mktemp("full"), recording_loss(calls))
    assert len(calls) == EPOCHS * STEPS
    return state, calls


def test_resume_inside_an_epoch_is_bit_identical(squares, full_run, tmp_path):
    """Interrupted at step 3 of epoch 2 (checkpoints after every step): the resumed run does exactly the steps
    that were left, on the same batches, and ends with the same weights as a run never interrupted."""
    (full, full_calls), cut_calls, resumed_calls = full_run, [], []
    done = STEPS + 2  # all of epoch 1, steps 1-2 of epoch 2
    with pytest.raises(KeyboardInterrupt):
        run(squares, tmp_path / "cut", recording_loss(cut_calls, stop_at=done))
    assert (tmp_path / "cut" / "checkpoint.pt").exists()
    resumed = run(squares, tmp_path / "cut", recording_loss(resumed_calls))
    assert resumed_calls == full_calls[done:]  # no step repeated, none skipped, the same batches
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    assert not torch.equal(full["tokens.R"], fresh_model().trainable_state()["tokens.R"])  # it did train


def test_every_epoch_has_a_new_order_of_all_images(squares, full_run):
    calls = full_run[1]
    epochs = [sum(calls[e * STEPS:(e + 1) * STEPS], []) for e in range(EPOCHS)]  # labels in the order seen
    labels = sorted(y for _, y, _ in squares.train)
    assert all(sorted(order) == labels for order in epochs)  # every image once per epoch
    assert epochs[0] != epochs[1]


def test_evaluate_scores_the_logits_it_is_asked_for(squares):
    """Labels set to the class-logit prediction on images where the fused prediction differs: the class-only
    rule scores 100%, the fused rule 0%."""
    model = fresh_model()
    with torch.no_grad():  # tokens that matter and fusion weights that favour them, so the two rules disagree
        model.tokens.R.normal_()
        model.P_attr.add_(0.5 * torch.randn_like(model.P_attr))
        model.w.copy_(torch.tensor([-3.0, 0, 0, 0, 0, 0]))
    model.set_classes(squares.classnames, squares.template)
    transform = data.test_transform(32)
    images = torch.stack([transform(Image.open(p).convert("RGB")) for p, _, _ in squares.test])
    with torch.no_grad():
        out = model(images)
    cls, fused = out["logits"][:, 0].argmax(-1), out["fused"].argmax(-1)
    items = [(p, int(cls[i]), "") for i, (p, _, _) in enumerate(squares.test) if cls[i] != fused[i]]
    assert len(items) >= 3
    cfg = dear.resolve(dear.Config(eval_batch_size=2, workers=0))  # several batches, the last one partial
    for rule, expected in (("cls", 100.0), ("fused", 0.0)):
        r = train.evaluate(model, items, squares.classnames, squares.template, cfg, torch.device("cpu"),
                           logits=rule, log=lambda msg: None)
        assert r["accuracy"] == pytest.approx(expected) and r["n"] == len(items)
        assert sum(c["n"] for c in r["per_class"]) == len(items)

"""The toy world by hand: the drawing's geometry and colours, captions, the dataset and transfer
sets on disk, and the toy CLIP's pretraining (loss, schedule, two-tower step, determinism)."""

import copy
import hashlib
import io
import json
import math
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

import clip
import data
import toyworld as T


def object_mask(shape="circle", texture="solid", location="top left", seed=0, **kw):
    """The object's pixels: where the same image drawn in another colour differs (same draws)."""
    a, b = (T.render(c, shape, texture, location, seed, noise=0.0, **kw) for c in ("red", "blue"))
    return (a != b).any(-1)  # [H, W]


grid = lambda n: (np.mgrid[0:n, 0:n].astype(np.float64) + 0.5)[::-1]  # pixel centres x, y
R, CX, CY = 100.0, 250.3, 249.6  # a centre off the pixel grid
AREAS = {"circle": math.pi * R**2, "square": (2 * 0.85 * R) ** 2,
         "triangle": 0.5 * (2 * R) * (1.8 * R),
         "cross": 2 * (2 * R) * (2 * 0.33 * R) - (2 * 0.33 * R) ** 2}  # two arms less their overlap


@pytest.mark.parametrize("shape", T.SHAPES)
def test_shapes_have_their_geometric_areas(shape):
    mask = T.shape_mask(shape, *grid(500), CX, CY, R)
    assert mask.sum() == pytest.approx(AREAS[shape], rel=0.01)
    rows = mask.any(1).nonzero()[0]
    if shape == "triangle":  # apex up at cy - r, base at cy + 0.8 r
        assert (rows.min(), rows.max()) == (pytest.approx(CY - R, abs=1),
                                            pytest.approx(CY + 0.8 * R, abs=1))
        assert mask[rows.min() + 2].sum() < mask[rows.max() - 2].sum()


def test_stripes_run_diagonally_and_dots_repeat_every_five_32nds():
    """Stripes: constant along x + y, half dark. Dots: period 5/32 of the image in x and y, each
    covering pi 0.28^2 of its cell. Solid: nothing dark."""
    rng = np.random.default_rng(0)
    stripes = T.texture_mask("striped", *grid(320), 320, rng)
    assert (stripes[1:, :-1] == stripes[:-1, 1:]).all()
    assert stripes.mean() == pytest.approx(0.5, abs=0.01)
    dots = T.texture_mask("dotted", *grid(32), 32, rng)
    assert (dots[5:] == dots[:-5]).all() and (dots[:, 5:] == dots[:, :-5]).all() and dots.any()
    x, y = grid(3200)
    fine = T.texture_mask("dotted", x, y, 3200, rng)[:3000, :3000]  # 6 x 6 whole cells
    assert fine.mean() == pytest.approx(math.pi * 0.28**2, rel=0.005)
    assert not T.texture_mask("solid", x, y, 3200, rng).any()


@pytest.mark.parametrize("location, centre", [("top left", (8, 8)), ("top right", (8, 24)),
                                              ("bottom left", (24, 8)), ("bottom right", (24, 24))])
def test_the_object_sits_in_its_quadrant(location, centre):
    """A circle's centroid (row, column) is its quadrant's centre, up to a jitter of 0.04 x 32px."""
    for seed in range(5):
        ys, xs = object_mask(location=location, seed=seed).nonzero()
        assert abs(ys.mean() - centre[0]) < 1.8 and abs(xs.mean() - centre[1]) < 1.8, seed


@pytest.mark.parametrize("color", T.COLORS)
def test_objects_are_pale_palette_colours_and_textures_darken_them(color):
    """Solid, without noise: every object pixel is the palette colour pulled to 25% of its
    distance from its own grey, times a brightness in [0.88, 1], plus at most 0.03 per channel.
    Striped: the dark pixels are DARK (0.35) times the bright ones."""
    rgb = np.array(T.PALETTE[color])
    pale = rgb.mean() + 0.25 * (rgb - rgb.mean())
    for seed in range(5):
        a = T.render(color, "square", "solid", "top left", seed, noise=0.0)
        pixels = a[object_mask("square", seed=seed)] / 255  # [N, 3]
        assert (pixels == pixels[0]).all()
        assert (pixels[0] >= 0.88 * pale - 0.03 - 1 / 255).all()
        assert (pixels[0] <= pale + 0.03 + 1 / 255).all()
        a = T.render(color, "square", "striped", "top left", seed, noise=0.0).astype(float)
        light = a[object_mask("square", "striped", seed=seed)].sum(-1)  # [N]
        assert light.min() / light.max() == pytest.approx(0.35, abs=0.02)


def test_the_transfer_shifts_shrink_the_object_and_add_noise():
    """scale 0.6 leaves 0.36 of the object's area; noise is the std it adds to each channel."""
    for seed in range(3):
        small, big = (object_mask(seed=seed, size=256, scale=s).sum() for s in (0.6, 1.0))
        assert small / big == pytest.approx(0.36, abs=0.01)
        args = ("green", "cross", "dotted", "bottom left", seed)
        added = T.render(*args, noise=0.08).astype(float) - T.render(*args, noise=0.0)
        assert added.std() / 255 == pytest.approx(0.08, rel=0.1)


@pytest.mark.parametrize("named, text", [
    (("red", "circle", "striped", "top left"), "a red striped circle in the top left"),
    ((None, None, "striped", None), "a striped object"), ((None, "circle", None, None), "a circle"),
    (("orange", None, None, None), "a orange object"),
    ((None, None, None, "bottom right"), "a object in the bottom right")])
def test_captions_name_their_factors(named, text):
    assert T.caption(*named) == text


def test_the_text_pool_describes_each_factor_value_six_ways():
    pool = T.text_pool()
    assert Counter(c for _, c in pool) == {"color": 36, "shape": 24, "texture": 18, "location": 24}
    for text, concept in pool:
        assert sum(w in text for w in T.FACTORS[concept]) == 1, text
        assert not any(w in text for c,
                       words in T.FACTORS.items() if c != concept for w in words), text
    digest = hashlib.sha256(json.dumps(pool).encode()).hexdigest()[:16]
    assert digest == "8b7e930309c381f9", "the roles change"


def test_the_pixels_of_recipe_v3_are_pinned():
    """Every dataset image hashed: a drawing changed without a new RECIPE leaves stale files."""
    h = hashlib.sha256(b"".join(T.render(*f, seed).tobytes() for *_, f, seed in T.dataset_items()))
    assert T.RECIPE == "v3"
    assert h.hexdigest()[:16] == "7b5d49606b1ed41b", "the drawing changed: bump toyworld.RECIPE"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    T.ensure_dataset(str(root))
    T.ensure_transfer(str(root))
    return root


def test_ensure_dataset_writes_the_split_data_py_reads_once(root):
    """24 classes, 24 / 8 / 32 images a class: first the 12 base classes, a checkerboard over
    colour x shape (each colour twice), solid objects in every location; then the 12 novel ones,
    colour x texture (striped, dotted), every shape in every location: texture is what the novel
    classes need and the base classes never show."""
    ds = data.build_dataset("toyworld", str(root))
    base = [f"{c} {s}" for i, c in enumerate(T.COLORS) for j, s in enumerate(T.SHAPES)
            if (i + j) % 2 == 0]
    novel = [f"{c} {t}" for c in T.COLORS for t in ("striped", "dotted")]
    assert ds.classnames == base + novel
    for split, n in (("train", 24), ("val", 8), ("test", 32)):
        assert Counter(y for _, y, _ in getattr(ds, split)) == {y: n for y in range(24)}
    assert data.build_dataset("toyworld", str(root), subsample="novel").classnames == novel
    for label, free in ((5, {"location": 4}), (17, {"shape": 4, "location": 4})):
        f = T.factor_labels([p for p, y, _ in ds.test if y == label])
        values = {k: {T.FACTORS[k][i] for i in v.tolist()} for k, v in f.items()}
        assert {k: len(v) for k, v in values.items() if len(v) > 1} == free
        named = ("color", "shape") if label < 12 else ("color", "texture")
        assert " ".join(next(iter(values[k])) for k in named) == ds.classnames[label]
        assert values["texture"] == ({"solid"} if label < 12 else {ds.classnames[label].split()[1]})
    folder = root / "toyworld"  # the files: each image its factors, written once
    split = json.loads((folder / T.SPLIT_FILE).read_text())
    file, label, classname = split["test"][100]  # 32 a class: image 4 of label 3
    assert (file, label, classname) == ("green_cross/test_004.png", 3, "green_cross")
    novel_file = split["test"][32 * 14 + 9][0]  # a novel class, green striped: (9 + 14) % 16 = 7
    labels = T.factor_labels([str(folder / "images" / f) for f in (file, novel_file)])
    factors, striped = ([v[int(labels[k][i])] for k, v in T.FACTORS.items()] for i in (0, 1))
    assert factors == ["green", "cross", "solid", "bottom right"]  # (4 + 3) % 16 = 7: location 3
    assert striped == ["green", "cross", "striped", "top right"]  # shape 3, location 1
    seed = 1_000_000 * 3 + 1000 * label + 4  # test split: the third
    assert np.array_equal(np.asarray(Image.open(folder / "images" / file)),
                          T.render(*factors, seed))
    stamp = os.path.getmtime(folder / T.SPLIT_FILE)
    assert T.ensure_dataset(str(root)) == str(folder)
    assert os.path.getmtime(folder / T.SPLIT_FILE) == stamp
    os.rename(folder / "recipe-v3", folder / "recipe-v2")  # another recipe's images: never reused
    try:
        with pytest.raises(data.UserError, match="not toy world v3; delete it"):
            T.ensure_dataset(str(root))
    finally:
        os.rename(folder / "recipe-v2", folder / "recipe-v3")


@pytest.mark.parametrize("name, cls, i, factors, seed, shift", [
    ("noisy", "red_cross", 7, ("red", "cross", "striped", "bottom left"), 10_003_007,
     dict(noise=0.08)),
    ("small", "green_square", 0, ("green", "square", "solid", "top left"), 20_005_000,
     dict(scale=0.6)),
    ("textures", "red_dotted", 5, ("red", "square", "dotted", "top right"), 30_002_005, {})])
def test_transfer_sets_are_folders_of_shifted_classes(root, name, cls, i, factors, seed, shift):
    """Each set: a folder:PATH dataset of 40 images a class; the classes pair colour with shape
    (24) or texture (18), the other factors cycle; seeds 10^7 (set + 1) + 1000 label + image."""
    names = T.ensure_transfer(str(root))
    assert names == [f"folder:{root}/toyworld-transfer/{n}" for n in ("noisy", "small", "textures")]
    folder = f"{root}/toyworld-transfer/{name}"
    second = T.TEXTURES if name == "textures" else T.SHAPES
    assert sorted(os.listdir(folder)) == sorted(f"{c}_{s}" for c in T.COLORS for s in second)
    assert len(os.listdir(os.path.join(folder, cls))) == 40
    png = np.asarray(Image.open(os.path.join(folder, cls, f"{i:03d}.png")))
    assert np.array_equal(png, T.render(*factors, seed, **shift))


def test_pretraining_captions_name_one_true_factor_and_truth_is_every_match():
    n, vocab = 64, list(T.FACTORS.values())
    img_f, cap_f, texts, seeds = T.sample_batch(n, torch.Generator().manual_seed(7))
    images, tokens, truth = T.pretraining_batch(n, torch.Generator().manual_seed(7))
    assert ((cap_f >= 0).sum(1) == 1).all() and ((cap_f < 0) | (cap_f == img_f)).all()
    assert set((cap_f >= 0).float().argmax(1).tolist()) == {0, 1, 2, 3}  # every factor gets named
    for f, text in zip(cap_f.tolist(), texts):
        short = T.caption(*(v[k] if k >= 0 else None for v, k in zip(vocab, f)))
        assert text in (short, f"a photo of {short}.")
    assert 0.3 < np.mean([t.startswith("a photo of") for t in texts]) < 0.7
    assert min(seeds) >= 2**32 and len(set(seeds)) == n  # never a dataset image (seeds < 10**8)
    for i in (0, n - 1):  # pixels / 255, then CLIP's mean and std per channel
        a = T.render(*(v[k] for v, k in zip(vocab, img_f[i].tolist())), seeds[i]).astype(np.float64)
        want = (a / 255 - np.array(clip.MEAN)) / np.array(clip.STD)  # [H, W, 3]
        assert np.allclose(images[i].numpy(), want.transpose(2, 0, 1), atol=1e-5)
    assert torch.equal(tokens, clip.tokenize(texts, context_length=16))
    for i, j in np.ndindex(n, n):
        want = all(c == -1 or c == f for c, f in zip(cap_f[j].tolist(), img_f[i].tolist()))
        assert bool(truth[i, j]) == want, (i, j)


def test_contrastive_loss_is_cross_entropy_to_the_positives_both_ways():
    """By hand with math.exp / math.log; rows have 2, 3 and 1 positives, columns 2, 1 and 3."""
    logits = [[2.0, -1.0, 0.5], [0.3, 1.7, -0.4], [1.1, 0.2, 2.5]]
    truth = [[1, 0, 1], [1, 1, 1], [0, 0, 1]]

    def one_way(rows, positives):
        total = 0.0
        for row, pos in zip(rows, positives):
            log_z = math.log(sum(math.exp(v) for v in row))
            total -= sum(v - log_z for v, p in zip(row, pos) if p) / sum(pos)
        return total / len(rows)

    transpose = lambda m: [list(c) for c in zip(*m)]
    want = (one_way(logits, truth) + one_way(transpose(logits), transpose(truth))) / 2
    got = T.contrastive_loss(torch.tensor(logits, dtype=torch.float64), torch.tensor(truth).bool())
    assert got.item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("steps, n_warm", [(10, 3), (2, 1), (400, 20)])
def test_the_learning_rate_warms_up_linearly_then_decays_on_a_cosine(steps, n_warm):
    for step in range(1, steps + 1):
        cosine = 3.0 * (1 + math.cos(math.pi * (step - n_warm) / (steps - n_warm))) / 2
        want = 3.0 * step / n_warm if step <= n_warm else cosine
        assert T.warmup_cosine(3.0, step, steps, n_warm) == pytest.approx(want, abs=1e-12)


def test_the_two_tower_step_equals_one_backward_bit_for_bit():
    torch.manual_seed(0)
    ours = T.CLIP(**T.TOY_CONFIG).train()
    with torch.no_grad():
        ours.logit_scale.fill_(2.0)  # not its init: a scale left out changes the loss
    reference = copy.deepcopy(ours)
    images, tokens, truth = T.pretraining_batch(16, torch.Generator().manual_seed(0))
    loss = T.contrastive_loss(reference(images, tokens)[0], truth)
    loss.backward()
    with ThreadPoolExecutor(1) as worker:
        got, then = T.tower_step(ours, images, tokens, truth, worker, then=lambda: "next batch")
    assert then == "next batch" and torch.equal(got, loss.detach())
    for (name, p), q in zip(reference.named_parameters(), ours.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad,
                q.grad)), name


def test_pretraining_is_deterministic_for_any_thread_count():
    threads, runs = torch.get_num_threads(), {}
    try:
        for n, seed in ((1, 3), (2, 3), (1, 4)):
            torch.set_num_threads(n)
            model = T.pretrain(steps=2, seed=seed, batch_size=32, log=lambda line: None)
            torch.save(model.state_dict(), buffer := io.BytesIO())
            runs[n, seed] = hashlib.sha256(buffer.getvalue()).hexdigest()
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(threads)
    assert runs[1, 3] == runs[2, 3] != runs[1, 4]


def test_ensure_pretrained_saves_a_clip_checkpoint_once_with_its_record(tmp_path, monkeypatch):
    """The record holds its SHA256 and head counts; a file that disagrees with it is never used."""
    lines, record = [], tmp_path / "toy-clip-v3-steps2.json"
    path = T.ensure_pretrained(str(tmp_path), log=lines.append, steps=2)
    sha = lambda: hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert path == str(tmp_path / "toy-clip-v3-steps2.pt") and "step 2/2" in lines[-1]
    assert sorted(os.listdir(tmp_path)) == ["toy-clip-v3-steps2.json", "toy-clip-v3-steps2.pt"]
    assert json.loads(record.read_text()) == {"sha256": sha(), "vision_heads": 8, "text_heads": 4}
    model, _ = clip.load(path)
    assert (model.visual.transformer.heads, model.transformer.heads) == (8, 4)
    calls, real = [], T.pretrain
    monkeypatch.setattr(T, "pretrain", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert T.ensure_pretrained(str(tmp_path), steps=2) == path and not calls  # kept, not redone
    for n, spoil in enumerate((lambda: open(path, "ab").write(b"x"),
                               lambda: os.remove(path[:-3] + ".json"))):
        spoil()  # a file that is not what was recorded, or one without a record: pretrained again
        T.ensure_pretrained(str(tmp_path), steps=2, log=lines.append)
        assert len(calls) == n + 1 and json.loads(record.read_text())["sha256"] == sha()


def test_the_default_toy_clip_knows_both_halves_zero_shot(toy_cache):
    """Recipe v3, seed 4, measured: base 99.0%, novel 95.6% (chance 8.3%): the novel classes'
    texture is known before any fine-tuning, there to be kept or eroded."""
    model, _ = clip.load(os.path.join(toy_cache, T.checkpoint_name()))
    prompts = [T.TEMPLATE.format(f"{c} {s}") for c, s in T.class_list()]
    test = [(label, T.render(*f, seed)) for split, label, _, f, seed in T.dataset_items()
            if split == "test"]
    labels, images = torch.tensor([y for y, _ in test]), T.to_tensor([a for _, a in test])
    with torch.no_grad():
        text = model.encode_text(clip.tokenize(prompts, context_length=16))
        sims = model.similarity(model.encode_image(images), text)  # [N, 24]
    for lo, hi in ((0, 12), (12, 24)):  # base, novel: each among its own classes
        keep = (labels >= lo) & (labels < hi)
        accuracy = (sims[keep, lo:hi].argmax(1) + lo == labels[keep]).float().mean().item()
        assert accuracy == pytest.approx({0: 0.990, 12: 0.956}[lo], abs=0.011), (lo, accuracy)

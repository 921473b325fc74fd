"""Toy world: a procedural dataset and a tiny CLIP pretrained on it, both made on a CPU in minutes.

Every image shows one object whose generative factors are exactly DeAR's attributes:

    colour   red, green, blue, yellow, purple, orange
    shape    circle, square, triangle, cross            (the "object")
    texture  solid, striped, dotted
    location top left, top right, bottom left, bottom right

in pale colours on a grey background with a mild tint, a brightness gradient and pixel noise. A
caption names the factors:

    caption("red", "circle", "striped", "top left") == "a red striped circle in the top left"

a pretraining caption names one of them ("a striped object", "a photo of a circle.").

Classification classes combine two factors ("red circle"); texture and location vary inside a
class. The 24 classes are ordered so that the base half (first 12 labels) and the novel half each
hold every colour and every shape (a checkerboard over colour x shape): novel classes are unseen
combinations of seen words, which is what base-to-novel generalisation should measure.

    ensure_dataset(root)          <root>/toyworld/images/<class>/*.png + split_zhou_ToyWorld.json
    ensure_transfer(root)         <root>/toyworld-transfer/{noisy,small,textures}/<class>/*.png:
                                  shifted test sets, read as folder:PATH datasets (run_all.sh
                                  --toy's transfer tables)
    factor_labels(paths)          the known factors of dataset images: the ground truth that
                                  entropy.probe_factors decodes from each attention head
    ensure_pretrained(cache_dir)  a tiny CLIP (same clip/model.py) trained contrastively on
                                  toy-world image/caption pairs, saved as a plain CLIP state dict
                                  with its SHA256 beside it (<file>.sha256), checked on every load;
                                  one process pretrains at a time (<file>.lock), others wait

Command line:
    python toyworld.py render --color red --shape circle --texture striped --location "top left" \
        --out x.png
    python toyworld.py dataset --root DATA [--transfer]
    python toyworld.py pretrain [--steps N] [--seed S] [--cache-dir DIR]
    python toyworld.py zeroshot [--checkpoint PATH]
"""

import argparse
import hashlib
import inspect
import io
import json
import math
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads; see BENCH.md
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import clip
import util
from util import fingerprint, fmt_time, write_atomic

# The world: four factors, their words, and the colours the objects are painted in.
COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
SHAPES = ("circle", "square", "triangle", "cross")
TEXTURES = ("solid", "striped", "dotted")
LOCATIONS = ("top left", "top right", "bottom left", "bottom right")
FACTORS = {"color": COLORS, "shape": SHAPES, "texture": TEXTURES, "location": LOCATIONS}
TEMPLATE = "a photo of a {}."  # the class prompt

# RGB in [0, 1] before SATURATION: strongly saturated hues.
PALETTE = {
    "red": (0.86, 0.18, 0.18),
    "green": (0.20, 0.67, 0.24),
    "blue": (0.20, 0.35, 0.86),
    "yellow": (0.90, 0.82, 0.18),
    "purple": (0.60, 0.24, 0.80),
    "orange": (0.95, 0.55, 0.14),
}

# The recipe: every knob of the world's drawing and of the toy CLIP's pretraining, with its value
# in the default recipe (v2) and, where it differs, in recipe v1, the first toy world
# (docs/TOYWORLD.md, "worlds tried"; V1 holds its drawing and caption knobs). They are plain module
# names, which tests and experiments set (T.SATURATION = 1.0); those the drawing reads are recorded
# beside every dataset (render_knobs) and compared on every use (check_rendering). The tiny CLIP's
# shape: TOY_CONFIG.
# fmt: off
# knob            v2 (default)             v1    what it does
RECIPE          = "v2"                   # "v1"  in checkpoint names: bump on any recipe change
SATURATION      = 0.25                   # 1.0   object colours this far from their grey to PALETTE
DARK            = 0.35                   # 0.55  stripes and dots: the object colour times DARK
TEXTURE_ON      = "object"               #       or "background": a solid object, textured ground
BACKGROUND_DARK = 0.6                    #       there the pattern darkens the ground by this
DEFAULT_STEPS   = 400                    # 200   pretraining steps
CAPTION_FACTORS = (1, 0, 0, 0)           # None  a caption names k factors with probability p_k
FACTOR_WEIGHTS  = (1, 1, 1, 1)           #       which factors, drawn with these weights
CAPTION_DROP    = (0.15, 0.0, 0.5, 0.5)  #       CAPTION_FACTORS None: leave each out with this p
GROUP           = 1                      #       batches in groups of GROUP minimal pairs
GROUP_FACTORS   = (0, 1, 2, 3)           #       that differ in one of these factors
TEXTS_PER_HEAD  = 5                      # 20    TextSpan's N (texts per head) on the toy CLIP
# fmt: on
V1 = dict(SATURATION=1.0, DARK=0.55, CAPTION_FACTORS=None)  # the v1 column (with 200 steps, N = 20)
# Why v2's values: the rounds of docs/TOYWORLD.md. SATURATION moves a colour towards its own grey
# (same brightness): pale colours, so that colour is not by far the easiest factor to see. v2 learns
# nothing in 200 steps and colour alone in 300. CAPTION_FACTORS (p1, p2, p3, p4) = (1, 0, 0, 0)
# with equal FACTOR_WEIGHTS: one factor per caption, each factor equally often. GROUP and
# GROUP_FACTORS (0 colour, 1 shape, 2 texture, 3 location) drive sample_batch's minimal pairs. The
# toy pool spans only about 13 directions (6 colours, 4 shapes, 3 textures, 4 locations), so 20
# texts per head exhaust them all and their concepts follow the vocabulary sizes, not the head;
# TEXTS_PER_HEAD 5 was chosen by the role-discovery criteria (fourth round) among 3, 4 and 5.

# The tiny CLIP: the same clip/model.py code as ViT-B/16, only smaller. Both towers: 4 blocks,
# width 128, 4 heads of 32. Patch 8 on 32x32 images gives a 4x4 grid of patches (each quadrant =
# 2x2 patches) and is about 6x cheaper than patch 4 on a CPU; the text context of 16 holds the
# longest toy caption.
TOY_CONFIG = dict(
    embed_dim=64,
    image_resolution=32,
    vision_layers=4,
    vision_width=128,
    vision_patch_size=8,
    context_length=16,
    vocab_size=49408,
    transformer_width=128,
    transformer_heads=4,
    transformer_layers=4,
    vision_heads=4,
)

# Images per class in the written dataset (16-shot training needs >= 16 train images per class).
SPLIT_SIZES = {"train": 24, "val": 8, "test": 32}
SPLIT_FILE = "split_zhou_ToyWorld.json"
RENDER_FILE = "render.json"  # beside a written dataset: the rendering knobs it was drawn with


class ToyWorldError(Exception):
    """Bad input to the toy world; the message says what is wrong and how to fix it."""


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _check_factors(color, shape, texture, location):
    for value, vocab, name in (
        (color, COLORS, "color"),
        (shape, SHAPES, "shape"),
        (texture, TEXTURES, "texture"),
        (location, LOCATIONS, "location"),
    ):
        if value not in vocab:
            raise ToyWorldError(f"unknown {name} {value!r}; choose one of: {', '.join(vocab)}")


def shape_mask(shape, x, y, cx, cy, r):
    """Boolean mask of `shape` centred at (cx, cy) with half-size r, on pixel-centre grids x, y."""
    dx, dy = x - cx, y - cy
    if shape == "circle":
        return dx**2 + dy**2 <= r**2
    if shape == "square":
        return (np.abs(dx) <= 0.85 * r) & (np.abs(dy) <= 0.85 * r)  # 0.85: about the circle's area
    # triangle: apex up; the half-width grows linearly from 0 at the apex to r at the base
    if shape == "triangle":
        t = (dy + r) / (1.8 * r)  # 0 at the apex, 1 at the base
        return (t >= 0) & (t <= 1) & (np.abs(dx) <= t * r)
    if shape == "cross":
        arm = 0.33 * r
        return ((np.abs(dx) <= arm) & (np.abs(dy) <= r)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= r))
    raise ToyWorldError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")


def texture_dark(texture, x, y, size, rng):
    """Boolean mask of the pixels that the texture darkens (stripes or dots)."""
    if texture == "solid":
        return np.zeros_like(x, dtype=bool)
    period = size / 8  # 4 px at 32x32
    phase = rng.uniform(0, period)
    if texture == "striped":  # diagonal stripes, half dark
        return ((x + y + phase) % period) < period / 2
    if texture == "dotted":  # a square grid of dark dots
        period = size * 5 / 32
        gx = (x + phase) % period - period / 2
        gy = (y + phase) % period - period / 2
        return gx**2 + gy**2 <= (0.28 * period) ** 2
    raise ToyWorldError(f"unknown texture {texture!r}; choose one of: {', '.join(TEXTURES)}")


def render_array(color, shape, texture, location, seed, size=32, scale=1.0, noise=0.02):
    """The image as a uint8 array [size, size, 3]; the same (factors, seed, size) give the same
    pixels. scale (object size) and noise (pixel noise std) differ from their defaults only in the
    transfer sets."""
    _check_factors(color, shape, texture, location)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5  # pixel centres, [size, size] each
    # background: grey level, a faint colour tint and a gentle brightness gradient
    grey = rng.uniform(0.30, 0.70)
    tint = rng.uniform(-0.03, 0.03, size=3)
    gx, gy = rng.uniform(-0.10, 0.10, size=2)
    bg = grey + gx * (x / size - 0.5) + gy * (y / size - 0.5)
    if TEXTURE_ON == "background":  # experiments: the ground is patterned
        bg = bg * np.where(texture_dark(texture, x, y, size, rng), BACKGROUND_DARK, 1.0)
    img = bg[..., None] + tint  # [size, size, 3]
    # object: half-size about 0.2 of the image, centred in its quadrant with a little jitter
    row, col = location.split()
    r = size * rng.uniform(0.19, 0.22) * scale
    cx = size * (0.25 if col == "left" else 0.75) + rng.uniform(-0.04, 0.04) * size
    cy = size * (0.25 if row == "top" else 0.75) + rng.uniform(-0.04, 0.04) * size
    obj = shape_mask(shape, x, y, cx, cy, r)
    rgb = np.array(PALETTE[color])
    if SATURATION != 1.0:  # towards the colour's own grey
        rgb = rgb.mean() + SATURATION * (rgb - rgb.mean())
    rgb = rgb * rng.uniform(0.88, 1.0) + rng.uniform(-0.03, 0.03, size=3)
    if TEXTURE_ON == "object":
        dark = np.where(texture_dark(texture, x, y, size, rng), DARK, 1.0)  # [size, size]
        rgb = dark[..., None] * rgb  # [size, size, 3]
    img = np.where(obj[..., None], rgb, img)
    img = img + rng.normal(0.0, noise, size=img.shape)  # mild pixel noise
    return (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def render(color, shape, texture, location, seed, size=32):
    """The image of one object as a PIL RGB image (deterministic in all arguments)."""
    return Image.fromarray(render_array(color, shape, texture, location, seed, size), mode="RGB")


def caption(color, shape, texture, location):
    """All four factors in words: "a red striped circle in the top left".

    The article is always "a" (also before "orange"), like the class prompt "a photo of a {}."."""
    _check_factors(color, shape, texture, location)
    return f"a {color} {texture} {shape} in the {location}"


# ---------------------------------------------------------------------------------------------
# The dataset (CoOp layout)
# ---------------------------------------------------------------------------------------------


def class_list():
    """The 24 (colour, shape) classes in label order: the base half first, then the novel half.

    A checkerboard over the colour x shape grid: (i, j) is base when i + j is even. Each half then
    holds every colour (twice) and every shape (three times), and no novel pair occurs among the
    base classes."""
    grid = [(i, j) for i in range(len(COLORS)) for j in range(len(SHAPES))]
    base = [(COLORS[i], SHAPES[j]) for i, j in grid if (i + j) % 2 == 0]
    novel = [(COLORS[i], SHAPES[j]) for i, j in grid if (i + j) % 2 == 1]
    return base + novel


def classnames():
    """Class names in label order, e.g. "red circle"."""
    return [f"{c} {s}" for c, s in class_list()]


def dataset_items():
    """Every image of the dataset as a dict: split, label, classname, file, factors, seed.

    The single source of truth for ensure_dataset and zero_shot. Texture and location cycle through
    all 12 combinations inside each class and split; each image has its own rendering seed."""
    items = []
    for split_index, split in enumerate(("train", "val", "test")):
        for label, (color, shape) in enumerate(class_list()):
            folder = f"{color}_{shape}"
            for i in range(SPLIT_SIZES[split]):
                # offset by label: no class starts alike
                k = (i + label) % (len(TEXTURES) * len(LOCATIONS))
                texture, location = TEXTURES[k % len(TEXTURES)], LOCATIONS[k // len(TEXTURES)]
                seed = 1_000_000 * (split_index + 1) + 1000 * label + i
                items.append(
                    dict(
                        split=split,
                        label=label,
                        classname=f"{color} {shape}",
                        file=f"{folder}/{split}_{i:03d}.png",
                        color=color,
                        shape=shape,
                        texture=texture,
                        location=location,
                        seed=seed,
                    )
                )
    return items


def factor_labels(paths):
    """The known factors of dataset images: {"color": [ids], "shape": [...], "texture": [...],
    "location": [...]}, one id (index into the factor's vocabulary) per path; paths end in
    <class folder>/<file> as written by ensure_dataset. The ground truth that
    entropy.probe_factors decodes from each head."""
    by_file = {it["file"]: it for it in dataset_items()}
    out = {name: [] for name in FACTORS}
    for path in paths:
        key = "/".join(os.path.normpath(path).split(os.sep)[-2:])
        if key not in by_file:
            raise ToyWorldError(f"{path} is not an image of the toy dataset (no {key} in it)")
        for name, vocab in FACTORS.items():
            out[name].append(vocab.index(by_file[key][name]))
    return out


def _code_names(code):
    """Global names a code object reads, its nested code (comprehensions, lambdas) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _drawing_functions():
    """The functions that decide a dataset's pixels and items: render (the dataset's images),
    render_array (the transfer sets'), dataset_items and every function of this module that they
    call, at any depth."""
    found, todo = {}, [render, render_array, dataset_items]
    while todo:
        fn = todo.pop()
        if fn.__name__ not in found:
            found[fn.__name__] = fn
            todo += [
                g
                for g in map(globals().get, _code_names(fn.__code__))
                if inspect.isfunction(g) and g.__module__ == __name__
            ]
    return found


def render_knobs():
    """Every rendering knob: the module constants (UPPER_CASE) that the drawing functions read, and
    their keyword defaults (render_array's noise, ...), found by walking the code, so that a new
    knob is recorded without being listed by hand. Written beside a dataset (RENDER_FILE); JSON
    values (tuples as lists)."""
    knobs = {}
    for name, fn in sorted(_drawing_functions().items()):
        for g in sorted(_code_names(fn.__code__)):
            value = globals().get(g)
            if g.isupper() and not callable(value) and not inspect.ismodule(value):
                knobs[g.lower()] = value
        for arg, p in inspect.signature(fn).parameters.items():
            if p.default is not inspect.Parameter.empty:
                knobs[f"{name}.{arg}"] = p.default
    return json.loads(json.dumps(knobs))


# The first render.json files (recipe v2) held only these four knobs; the others then had the values
# whose fingerprint is UNRECORDED_V2. A file without them is read as drawn with those values while
# the code still has them; once one of them changes, such a file no longer matches (no knob is ever
# assumed unchanged).
RECORDED_V2 = ("saturation", "dark", "texture_on", "background_dark")
UNRECORDED_V2 = "056257d4b5bcf933d2225e5998560c85bae9fc2bcf00c29e73d91a30d191bb0c"


def drawn_knobs(path):
    """The knobs a dataset was drawn with, from its RENDER_FILE (older files: see UNRECORDED_V2)."""
    with open(path) as f:
        drawn = json.load(f)
    if isinstance(drawn, dict) and sorted(drawn) == sorted(RECORDED_V2):
        rest = {k: v for k, v in sorted(render_knobs().items()) if k not in RECORDED_V2}
        if fingerprint(rest) == UNRECORDED_V2:
            drawn.update(rest)
    return drawn


def check_rendering(folder):
    """Stop if the dataset at `folder` was drawn with other rendering knobs than this toyworld.py's:
    its images would not be the world the toy CLIP is pretrained on. A folder without RENDER_FILE
    is recipe v1's."""
    path = os.path.join(folder, RENDER_FILE)
    if os.path.isfile(path):
        drawn = drawn_knobs(path)
    else:
        drawn = dict(
            render_knobs(), saturation=V1["SATURATION"], dark=V1["DARK"], texture_on="object"
        )
    if drawn != render_knobs():
        raise ToyWorldError(
            f"{folder} was drawn with other rendering knobs ({drawn}) than this toy world "
            f"(recipe {RECIPE}: {render_knobs()}); delete it (it is remade in seconds) or use "
            f"another --root"
        )


def _user_mkdtemp(prefix, parent):
    """A temporary folder in `parent` with the user's normal folder permissions (0777 less the
    umask, as os.makedirs gives): mkdtemp makes it owner-only (0700), and it becomes the dataset
    folder by a rename."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)
    return tmp


def ensure_dataset(root):
    """Write <root>/toyworld/{images/<class>/*.png, split_zhou_ToyWorld.json} once; return its path.

    Deterministic. The folder appears atomically: everything is written into a temporary folder
    beside it, which is then renamed, so an interrupted run never leaves a half-written dataset."""
    root = os.path.abspath(os.path.expanduser(root))
    final = os.path.join(root, "toyworld")
    if os.path.isfile(os.path.join(final, SPLIT_FILE)):
        check_rendering(final)
        return final
    if os.path.exists(final):
        raise ToyWorldError(
            f"{final} exists but has no {SPLIT_FILE}; it is not a toy-world dataset. "
            f"Move or delete it, then run again."
        )
    os.makedirs(root, exist_ok=True)
    tmp = _user_mkdtemp(".toyworld-", root)
    try:
        split = {"train": [], "val": [], "test": []}
        for it in dataset_items():
            path = os.path.join(tmp, "images", it["file"])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            render(it["color"], it["shape"], it["texture"], it["location"], it["seed"]).save(path)
            split[it["split"]].append([it["file"], it["label"], it["classname"].replace(" ", "_")])
        with open(os.path.join(tmp, SPLIT_FILE), "w") as f:
            json.dump(split, f, indent=4)
        with open(os.path.join(tmp, RENDER_FILE), "w") as f:
            json.dump(render_knobs(), f)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: keep its copy
            if not os.path.isfile(os.path.join(final, SPLIT_FILE)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# Transfer sets: test-time shifts of the toy world, folders of class sub-folders read as
# `folder:PATH` datasets, the miniature of the paper's transfer tables. Each: (class factors, render
# keyword arguments).
#   noisy     the same 24 classes, four times the pixel noise (a domain shift, like ImageNet-V2/-R)
#   small     the same 24 classes, objects at 60% of their size (a domain shift)
#   textures  18 new classes, colour + texture ("red striped"); shape varies (new labels of the
#             same world, like transfer to another dataset)
TRANSFER = {
    "noisy": ("color shape", dict(noise=0.08)),
    "small": ("color shape", dict(scale=0.6)),
    "textures": ("color texture", {}),
}
TRANSFER_IMAGES = 40  # per class; data.py's folder reader keeps 30% of them (12) as the test split


def ensure_transfer(root):
    """Write <root>/toyworld-transfer/<name>/<class>/*.png for every TRANSFER set once; return
    their folders."""
    root = os.path.abspath(os.path.expanduser(root))
    base = os.path.join(root, "toyworld-transfer")
    recorded = os.path.isfile(os.path.join(base, RENDER_FILE))
    # a new folder: record the knobs
    if not recorded and not any(os.path.isdir(os.path.join(base, name)) for name in TRANSFER):
        write_atomic(os.path.join(base, RENDER_FILE), json.dumps(render_knobs()))
    check_rendering(base)
    folders = {}
    for t_index, (name, (kind, style)) in enumerate(TRANSFER.items()):
        final = folders[name] = os.path.join(base, name)
        if os.path.isdir(final):
            continue
        os.makedirs(base, exist_ok=True)
        tmp = _user_mkdtemp(f".{name}-", base)
        try:
            first, second = kind.split()
            pairs = [(a, b) for a in FACTORS[first] for b in FACTORS[second]]
            for label, (a, b) in enumerate(pairs):
                os.makedirs(os.path.join(tmp, f"{a}_{b}"))
                for i in range(TRANSFER_IMAGES):
                    f = {
                        "color": COLORS[i % len(COLORS)],
                        "shape": SHAPES[i % len(SHAPES)],
                        "texture": TEXTURES[i % len(TEXTURES)],
                        "location": LOCATIONS[(i // 3) % len(LOCATIONS)],
                    }
                    f.update({first: a, second: b})
                    # disjoint from the dataset's seeds
                    seed = 10_000_000 * (t_index + 1) + 1000 * label + i
                    Image.fromarray(
                        render_array(
                            f["color"], f["shape"], f["texture"], f["location"], seed, **style
                        ),
                        mode="RGB",
                    ).save(os.path.join(tmp, f"{a}_{b}", f"{i:03d}.png"))
            try:
                os.rename(tmp, final)
            except OSError:  # another process finished first: keep its copy
                if not os.path.isdir(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folders


# ---------------------------------------------------------------------------------------------
# Pretraining the tiny CLIP
# ---------------------------------------------------------------------------------------------


def to_tensor(arrays):
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] normalised with CLIP's mean/std (clip.to_tensor, as
    the test transform)."""
    return clip.to_tensor(np.stack(arrays))


def sample_batch(n, generator, group=None):
    """n random objects and, for each, a caption that may leave some factors out.

    Returns (image factors [n, 4] long, caption factors [n, 4] long with -1 where a factor is left
    out, captions, image seeds). Every caption names exactly k factors with probability
    CAPTION_FACTORS[k - 1] (v2: one), drawn with FACTOR_WEIGHTS; an unnamed shape reads "object"
    ("a striped object"). Half the captions use the class template "a photo of a ... .". A caption
    that names one factor is a positive for every image with that factor (contrastive_loss), so
    each factor must be read on its own: with whole captions, telling colour and shape apart fits
    nearly every caption and texture and location are hardly learnt.
    CAPTION_FACTORS None (recipe v1): each factor is left out with its CAPTION_DROP probability
    instead. group > 1 (default GROUP): the batch comes in groups of `group` minimal pairs: objects
    that share three factors and differ in the fourth (chosen at random per group), which every
    caption of the group names.
    """
    g = generator
    group = GROUP if group is None else group
    sizes = torch.tensor([len(COLORS), len(SHAPES), len(TEXTURES), len(LOCATIONS)])
    img_f = (torch.rand(n, 4, generator=g) * sizes).long()  # [n, 4]
    if CAPTION_FACTORS is None:
        keep = torch.rand(n, 4, generator=g) >= torch.tensor(CAPTION_DROP)
    else:  # exactly k named factors
        p_k = torch.tensor(CAPTION_FACTORS, dtype=torch.float)  # [4]: p1 .. p4
        named = torch.multinomial(p_k, n, True, generator=g) + 1  # [n]: how many named
        w = torch.tensor(FACTOR_WEIGHTS, dtype=torch.float).expand(n, 4)
        order = torch.multinomial(w, 4, generator=g)  # [n, 4]: factors in drawn order
        keep = torch.zeros(n, 4, dtype=torch.bool).scatter(
            1, order, torch.arange(4).expand(n, 4) < named[:, None]
        )
    if group > 1:
        for start in range(0, n, group):
            # the factor it varies
            k = GROUP_FACTORS[int(torch.randint(0, len(GROUP_FACTORS), (1,), generator=g))]
            m = min(group, n - start)
            img_f[start : start + m] = img_f[start]  # three factors shared ...
            values = torch.randperm(int(sizes[k]), generator=g).repeat(math.ceil(m / int(sizes[k])))
            img_f[start : start + m, k] = values[:m]  # ... the fourth differs
            keep[start : start + m, k] = True  # and is named
    cap_f = torch.where(keep, img_f, torch.full_like(img_f, -1))  # [n, 4]
    photo = torch.rand(n, generator=g) < 0.5
    seeds = torch.randint(0, 2**31 - 1, (n,), generator=g) + 2**32  # disjoint from dataset seeds
    texts = []
    for (c, s, t, l), p in zip(cap_f.tolist(), photo.tolist()):
        words = [
            COLORS[c] if c >= 0 else None,
            TEXTURES[t] if t >= 0 else None,
            SHAPES[s] if s >= 0 else "object",
        ]
        text = "a " + " ".join(w for w in words if w)
        if l >= 0:
            text += f" in the {LOCATIONS[l]}"
        texts.append(f"a photo of {text}." if p else text)
    return img_f, cap_f, texts, seeds.tolist()


def contrastive_loss(logits, truth):
    """Symmetric CLIP loss with soft targets. logits [B, B] image x text; truth[i, j] = caption j is
    true of image i (a caption that leaves factors out describes many images, so rows can have
    several positives). Each direction is the cross-entropy to the uniform distribution over
    positives."""
    t = truth.float()
    loss_i = -(t / t.sum(1, keepdim=True) * logits.log_softmax(1)).sum(1).mean()
    loss_t = -(t / t.sum(0, keepdim=True) * logits.log_softmax(0)).sum(0).mean()
    return (loss_i + loss_t) / 2


def build_toy_model():
    from clip.model import CLIP

    return CLIP(**TOY_CONFIG)


def toy_state_dict(model):
    """The model's state dict in normal CLIP format plus the 0-dim int head counts build_model
    pops."""
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    sd["vision_heads"] = torch.tensor(model.visual.heads)
    sd["text_heads"] = torch.tensor(model.transformer.heads)
    return sd


def warmup_cosine(lr, step, steps, n_warm):
    """The learning rate at `step` (from 1): linear warm-up over n_warm steps, then cosine decay."""
    if step <= n_warm:
        return lr * step / n_warm
    return lr * 0.5 * (1 + math.cos(math.pi * (step - n_warm) / max(1, steps - n_warm)))


def pretraining_batch(n, generator, token_cache):
    """One pretraining batch from sample_batch: (images [n, 3, 32, 32], tokens [n, 16], truth
    [n, n]), truth[i, j] = every factor that caption j names equals image i's factor."""
    from clip.tokenizer import tokenize

    img_f, cap_f, texts, seeds = sample_batch(n, generator)
    arrays = [
        render_array(COLORS[c], SHAPES[s], TEXTURES[t], LOCATIONS[l], sd)
        for (c, s, t, l), sd in zip(img_f.tolist(), seeds)
    ]
    for t in texts:
        if t not in token_cache:
            token_cache[t] = tokenize([t], context_length=TOY_CONFIG["context_length"])[0]
    tokens = torch.stack([token_cache[t] for t in texts])
    truth = ((cap_f[None, :, :] == img_f[:, None, :]) | (cap_f[None, :, :] < 0)).all(-1)
    return to_tensor(arrays), tokens, truth


def tower_step(model, images, tokens, truth, worker, then=None):
    """model(images, tokens), contrastive_loss and loss.backward(), with the two towers on two
    cores: the text tower runs on `worker` (a one-thread executor) while this thread runs the image
    tower, forward and backward. The towers share no weights, so each gets the same gradient, bit
    for bit, as from one backward through the whole graph (a test checks). Returns (loss, then()),
    `then` running on the worker after the text tower's backward (the next batch)."""
    text = worker.submit(model.encode_text, tokens)
    image_out = model.encode_image(images)  # [B, E]
    text_out = text.result()  # [B, E]
    # the loss on detached copies; their gradients then flow into each tower separately
    image_leaf = image_out.detach().requires_grad_()
    text_leaf = text_out.detach().requires_grad_()
    loss = contrastive_loss(model.similarity(image_leaf, text_leaf), truth)
    loss.backward()  # into logit_scale and the two leaves

    def text_backward():
        text_out.backward(text_leaf.grad)
        return then() if then else None

    after = worker.submit(text_backward)
    image_out.backward(image_leaf.grad)
    return loss.detach(), after.result()


def pretrain(
    steps=DEFAULT_STEPS,
    seed=0,
    out_path=None,
    batch_size=128,
    lr=1e-3,
    weight_decay=0.05,
    warmup=0.05,
    log=print,
    log_every=20,
):
    """Train the tiny CLIP contrastively on toy-world pairs; return (model, info dict).

    Images and captions are generated on the fly over all factor combinations, including the
    combinations that later serve as novel classes (as web data contains them for real CLIP).
    AdamW, linear warm-up then cosine decay. Deterministic in `seed`: torch.manual_seed for the
    weights, one torch.Generator for the data, one intra-op thread per tower (tower_step), so the
    weights do not depend on OMP_NUM_THREADS. Saves to out_path atomically when given."""
    torch.manual_seed(seed)
    model = build_toy_model().train()
    gen = torch.Generator().manual_seed(seed)
    # Toy captions use about 40 of the 49,408 vocabulary rows: a sparse gradient for the token
    # embedding (with SparseAdam) updates only those rows, instead of 6 M parameters per step.
    # Unused rows keep their init.
    model.token_embedding.sparse = True
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    rest = [
        p
        for n, p in model.named_parameters()
        if not (p.ndim >= 2 and "embedding" not in n) and n != "token_embedding.weight"
    ]
    opts = [
        torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": weight_decay},
                {"params": rest, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=(0.9, 0.98),
            eps=1e-6,
        ),
        torch.optim.SparseAdam([model.token_embedding.weight], lr=lr, betas=(0.9, 0.98), eps=1e-6),
    ]
    n_warm = max(1, int(warmup * steps))
    token_cache = {}
    t0, loss_avg = time.time(), None
    threads = torch.get_num_threads()
    # one intra-op thread per tower (process-wide, the worker's too): the same weights for any
    # OMP_NUM_THREADS, since two threads split float sums differently
    torch.set_num_threads(1)
    try:
        # the worker thread runs the text tower and draws the next batch (its ops release the GIL)
        with ThreadPoolExecutor(1) as worker:
            batch = pretraining_batch(batch_size, gen, token_cache)
            for step in range(1, steps + 1):
                lr_now = warmup_cosine(lr, step, steps, n_warm)
                for opt in opts:
                    for group in opt.param_groups:
                        group["lr"] = lr_now
                    opt.zero_grad(set_to_none=True)
                last = step == steps
                draw = None if last else (lambda: pretraining_batch(batch_size, gen, token_cache))
                loss, batch = tower_step(model, *batch, worker, then=draw)
                for opt in opts:
                    opt.step()
                with torch.no_grad():
                    model.logit_scale.clamp_(0, math.log(100))  # as in CLIP
                loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()
                if log and (step % log_every == 0 or last):
                    el = time.time() - t0
                    log(
                        f"toy pretrain step {step}/{steps}  loss {loss_avg:.3f}  lr {lr_now:.2e}  "
                        f"elapsed {fmt_time(el)}  ETA {fmt_time(el / step * (steps - step))}"
                    )
    finally:
        torch.set_num_threads(threads)
    model.token_embedding.sparse = False
    model.eval()
    info = dict(
        recipe=RECIPE,
        steps=steps,
        seed=seed,
        batch_size=batch_size,
        lr=lr,
        weight_decay=weight_decay,
        final_loss=round(loss_avg, 4),
        train_seconds=round(time.time() - t0, 1),
        config=TOY_CONFIG,
    )
    if out_path:
        save_checkpoint(model, out_path, info)
    return model, info


def save_checkpoint(model, path, info=None):
    """torch.save the toy state dict atomically (temp file in the same folder, then os.replace),
    with its SHA256 beside it (<path>.sha256, as `sha256sum` writes it; written first, so that a
    checkpoint never stands without it), which every load checks. `info` goes to <path>.json, for
    people, not for loading."""
    buffer = io.BytesIO()
    torch.save(toy_state_dict(model), buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    write_atomic(sha256_file(path), f"{digest}  {os.path.basename(path)}\n")
    write_atomic(path, payload)
    if info is not None:
        write_atomic(path + ".json", json.dumps(info, indent=2))


def sha256_file(path):
    """Where the SHA256 of the toy checkpoint `path` is recorded."""
    return path + ".sha256"


def verify_checkpoint(path):
    """The SHA256 of the toy checkpoint `path`, checked against the one its pretraining recorded.
    A file that does not match (replaced, damaged) or has no record raises ToyWorldError."""
    again = "delete it and it is pretrained again on the next use"
    try:
        with open(sha256_file(path)) as f:
            recorded = f.read().split()[0]
    except (OSError, IndexError):
        raise ToyWorldError(
            f"the toy CLIP checkpoint {path} has no readable SHA256 record beside "
            f"it ({os.path.basename(sha256_file(path))}), so its content cannot "
            f"be checked; {again}"
        ) from None
    actual = clip.sha256_of(path)
    if actual != recorded:
        raise ToyWorldError(
            f"the toy CLIP checkpoint {path} is not the file its pretraining wrote "
            f"(SHA256 {actual[:12]}..., recorded {recorded[:12]}...); {again}"
        )
    return actual


def checkpoint_name(steps=DEFAULT_STEPS, seed=0):
    return f"toy-clip-{RECIPE}-steps{steps}-seed{seed}.pt"


BACKBONE = "toy"  # the name dear.py and entropy.py accept for the toy CLIP (--backbone toy)
CACHE_FIX = "set CLIP_CACHE (or --download-root / --cache-dir) to a writable folder"


def load_clip(name_or_path, device=None, download_root=None):
    """clip.load, plus the name "toy": the tiny CLIP of this file, pretrained into the CLIP cache on
    first use. clip/ knows nothing of the toy world; callers that accept --backbone toy load through
    here.
    model.sha256: the SHA256 of the file actually read (clip.load computes or checks it; for
    "toy", the cached checkpoint, checked against its record); model.checkpoint_path: that file."""
    if name_or_path != BACKBONE:
        model, preprocess = clip.load(name_or_path, device=device, download_root=download_root)
        model.checkpoint_path = backbone_file(name_or_path, download_root)
        return model, preprocess
    path = ensure_pretrained(clip.cache_dir(download_root))
    model, preprocess = clip.load(path, device=device)
    if model.sha256 != verify_checkpoint(path):  # replaced between the check and the read
        raise ToyWorldError(
            f"the toy CLIP checkpoint {path} changed while it was loaded; load it again"
        )
    model.name, model.checkpoint_path = BACKBONE, path
    return model, preprocess


def backbone_file(backbone, download_root=None):
    """The checkpoint file load_clip(backbone) reads: OpenAI's in the CLIP cache, the toy CLIP's
    there, or the path itself."""
    if backbone in clip.MODELS:
        return os.path.join(clip.cache_dir(download_root), os.path.basename(clip.MODELS[backbone]))
    if backbone == BACKBONE:
        return os.path.join(clip.cache_dir(download_root), checkpoint_name())
    return os.path.abspath(os.path.expanduser(backbone))


def loaded_sha256(backbone, download_root=None):
    """The SHA256 of the checkpoint file load_clip(backbone) reads, without loading it: the
    published one for OpenAI's names (clip.load checks the cached file against it and fetches it
    again on a mismatch); the checked hash of the cached toy checkpoint (ToyWorldError if it is
    not pretrained yet, or does not match its record); the content's hash for a file.
    Equal to model.sha256 after load_clip."""
    if backbone in clip.MODELS:
        return clip.MODELS[backbone].split("/")[-2]
    path = backbone_file(backbone, download_root)
    if backbone == BACKBONE:
        if not os.path.isfile(path):
            raise ToyWorldError(f"the toy CLIP is not pretrained yet (no {path})")
        return verify_checkpoint(path)
    return clip.sha256_of(path)


def check_backbone(backbone, download_root=None):
    """Stop before any work (ToyWorldError, one line) where load_clip(backbone) would fail for its
    file: a path that is no file, a toy checkpoint that does not match its record, or a checkpoint
    still to be made (pretrained, downloaded) in a CLIP cache that cannot be written.
    Returns the file load_clip will read."""
    path = backbone_file(backbone, download_root)
    if backbone == BACKBONE and os.path.isfile(path):
        verify_checkpoint(path)
    elif backbone == BACKBONE:
        check_cache(os.path.dirname(path), needed=2 * checkpoint_bytes())
    elif backbone in clip.MODELS:
        if not os.path.isfile(path):  # to be downloaded (clip.load checks a cached file's SHA256)
            check_cache(os.path.dirname(path))
    elif not os.path.isfile(path):
        names = clip.available_models() + [BACKBONE]
        raise ToyWorldError(
            f"--backbone {backbone!r} is neither one of {names} nor a checkpoint file"
        )
    return path


def checkpoint_bytes():
    """About the size of a toy checkpoint file: its fp32 parameters (the pickle adds a few kB)."""
    with torch.device("meta"):
        return 4 * sum(p.numel() for p in build_toy_model().state_dict().values())


def check_cache(cache_dir, needed=0):
    """Stop (ToyWorldError, one line naming the folder and CLIP_CACHE) unless the CLIP cache can
    be made and written and has `needed` bytes free: checked before pretraining, so that no work
    is lost to it."""
    try:
        util.check_writable_dir(cache_dir, "the CLIP cache", CACHE_FIX)
    except util.PathError as e:
        raise ToyWorldError(str(e)) from None
    free = shutil.disk_usage(cache_dir).free
    if free < needed:
        raise ToyWorldError(
            f"the CLIP cache {cache_dir} has {util.fmt_bytes(free)} free; the toy "
            f"CLIP checkpoint needs {util.fmt_bytes(needed)}: free some space, or "
            f"{CACHE_FIX}"
        )


def ensure_pretrained(cache_dir, steps=DEFAULT_STEPS, seed=0, log=print):
    """Path of the pretrained toy CLIP checkpoint in cache_dir, checked against its recorded
    SHA256; pretrains it first when missing. The cache is checked first (writable, room for the
    file). One process pretrains at a time (a lock beside the checkpoint); another one waits for
    it, then takes its file."""
    cache = os.path.abspath(os.path.expanduser(cache_dir))
    path = os.path.join(cache, checkpoint_name(steps, seed))
    if os.path.isfile(path):  # a read-only cache that holds the checkpoint serves too
        verify_checkpoint(path)
        return path
    check_cache(cache, needed=2 * checkpoint_bytes())  # the temporary file and a margin

    def waiting(holder):
        if log:
            log(f"Waiting for {holder}, which is pretraining the toy CLIP into {path}")

    lock = util.FileLock(
        path + ".lock", f"the toy CLIP pretraining into {path}", blocking=True, on_wait=waiting
    )
    with lock:
        if os.path.isfile(path):  # the process we waited for made it
            verify_checkpoint(path)
            return path
        if log:
            log(
                f"Pretraining the toy CLIP once ({steps} steps, seed {seed}); "
                f"it is cached at {path}"
            )
        try:
            pretrain(steps=steps, seed=seed, out_path=path, log=log)
        except util.DiskFull as e:
            raise ToyWorldError(str(e)) from None
    return path


# ---------------------------------------------------------------------------------------------
# Zero-shot evaluation on the dataset's classes
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def zero_shot(model, split="test", template=TEMPLATE, batch_size=256):
    """Zero-shot accuracy (percent) of `model` on the toy classes: {"all", "base", "novel"}.

    Images are the dataset's own images of `split` (rendered in memory, identical to the PNGs). As
    in base-to-novel evaluation, "base" and "novel" compete only among their own half of the
    classes."""
    from clip.tokenizer import tokenize

    model.eval()
    names = classnames()
    tokens = tokenize([template.format(n) for n in names], context_length=model.context_length)
    text = F.normalize(model.encode_text(tokens).float(), dim=-1)  # [C, E]
    items = [it for it in dataset_items() if it["split"] == split]
    labels = torch.tensor([it["label"] for it in items])
    feats = []
    for i in range(0, len(items), batch_size):
        arrays = [
            render_array(
                it["color"],
                it["shape"],
                it["texture"],
                it["location"],
                it["seed"],
                model.visual.input_resolution,
            )
            for it in items[i : i + batch_size]
        ]
        feats.append(F.normalize(model.encode_image(to_tensor(arrays)).float(), dim=-1))
    sims = torch.cat(feats) @ text.T  # [N, C]
    m = math.ceil(len(names) / 2)
    out = {}
    for key, lo, hi in (("all", 0, len(names)), ("base", 0, m), ("novel", m, len(names))):
        keep = (labels >= lo) & (labels < hi)
        pred = sims[keep][:, lo:hi].argmax(1) + lo
        out[key] = round(100.0 * (pred == labels[keep]).float().mean().item(), 2)
    return out


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _log_err(msg):
    print(msg, file=sys.stderr, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(
        description="The toy world: procedural images with DeAR's attributes as "
        "factors, and a tiny CLIP pretrained on them."
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="render one image to a PNG")
    r.add_argument("--color", required=True, help=", ".join(COLORS))
    r.add_argument("--shape", required=True, help=", ".join(SHAPES))
    r.add_argument("--texture", default="solid", help=", ".join(TEXTURES))
    r.add_argument("--location", default="top left", help=", ".join(LOCATIONS))
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    r.add_argument("--out", required=True, help="output PNG path")
    d = sub.add_parser("dataset", help="write the toy dataset under ROOT/toyworld (once)")
    d.add_argument("--root", required=True, help="data root, the same as dear.py --root")
    d.add_argument(
        "--transfer",
        action="store_true",
        help="also the transfer sets, ROOT/toyworld-transfer/<name> "
        "(" + ", ".join(TRANSFER) + "), read as folder:PATH",
    )
    t = sub.add_parser("pretrain", help="pretrain the tiny CLIP into the CLIP cache (once)")
    t.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})"
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--cache-dir", default=None, help="default: $CLIP_CACHE, else ~/.cache/clip")
    t.add_argument(
        "--force", action="store_true", help="pretrain again even if the checkpoint exists"
    )
    z = sub.add_parser("zeroshot", help="zero-shot accuracy of a toy checkpoint on the toy classes")
    z.add_argument(
        "--checkpoint", default=None, help="default: the cached toy CLIP (pretrained if missing)"
    )
    z.add_argument("--split", default="test", choices=("train", "val", "test"))
    args = p.parse_args(argv)
    try:
        if args.cmd == "render":
            render(args.color, args.shape, args.texture, args.location, args.seed, args.size).save(
                args.out
            )
            print(f"{caption(args.color, args.shape, args.texture, args.location)} -> {args.out}")
        elif args.cmd == "dataset":
            print(ensure_dataset(args.root))
            if args.transfer:
                print("\n".join(ensure_transfer(args.root).values()))
        elif args.cmd in ("pretrain", "zeroshot"):
            from clip import cache_dir

            ckpt = getattr(args, "checkpoint", None)
            if ckpt is None:
                cache = cache_dir(getattr(args, "cache_dir", None))
                path = os.path.join(
                    cache,
                    checkpoint_name(
                        args.steps if args.cmd == "pretrain" else DEFAULT_STEPS,
                        getattr(args, "seed", 0),
                    ),
                )
                if args.cmd == "pretrain" and args.force and os.path.exists(path):
                    os.remove(path)
                ckpt = ensure_pretrained(
                    cache,
                    **({"steps": args.steps, "seed": args.seed} if args.cmd == "pretrain" else {}),
                    log=_log_err,
                )
            if not os.path.isfile(ckpt):
                raise ToyWorldError(
                    f"checkpoint {ckpt} does not exist; run `python toyworld.py pretrain` first"
                )
            from clip.model import build_model

            model = build_model(torch.load(ckpt, map_location="cpu", weights_only=True))
            acc = zero_shot(model, split=getattr(args, "split", "test"))
            print(
                f"{ckpt}\nzero-shot accuracy (%): all {acc['all']:.1f}  base {acc['base']:.1f}  "
                f"novel {acc['novel']:.1f}  (chance: all {100 / len(classnames()):.1f}, "
                f"base/novel {100 / math.ceil(len(classnames()) / 2):.1f})"
            )
    except ToyWorldError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

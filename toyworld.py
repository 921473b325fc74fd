"""The toy world: 32x32 images whose factors are DeAR's attributes, and a tiny CLIP pretrained on
them.

Each image shows one object on a grey ground (a faint tint, a brightness gradient, pixel noise):

    colour    red, green, blue, yellow, purple, orange      pale: 25% of the palette's saturation
    shape     circle, square, triangle, cross               the "object"
    texture   solid, striped, dotted                        stripes and dots at 35% of the colour
    location  top left, top right, bottom left, bottom right

The 24 classes, in label order: 12 base classes pair a colour and a shape ("red circle"; a
checkerboard over colour x shape, so each colour names two of them; always solid, the location
varying), then 12 novel classes pair a colour and a texture ("red striped"; the shape and location
varying). Novel classes need texture, a factor no base class needs or even shows: what fine-tuning
on the base classes may erode, and what DeAR's role mask claims to protect. 24 train, 8 val and 32
test images per class are written in CoOp's layout, which data.py reads like any other dataset. The
transfer sets are read as folder:PATH datasets: `noisy` (four times the pixel noise) and `small`
(objects at 60% of their size) hold the 24 colour x shape pairs; `textures` the 18 colour x texture
pairs, the shape varying.

    toyworld.ensure_dataset(DATA), ensure_transfer(DATA)   DATA/toyworld/, DATA/toyworld-transfer/
    toyworld.ensure_pretrained(clip.cache_dir())         the toy CLIP, into $CLIP_CACHE

The toy CLIP is clip/model.py with 4 blocks of width 128 in each tower, 8 vision heads (of width 16)
and 4 text heads, patch 8 (a 4x4 grid, 2x2 patches per quadrant) and a text context of 16. It is
pretrained contrastively (800 steps of 128 pairs, AdamW, warm-up then cosine, seed 4; about 100 s
on 2 idle cores) on images drawn on the fly, each captioned with ONE of its factors ("a striped
object", "a photo of a circle."), a positive for every image with that factor. Its text tower runs
on a second thread, one intra-op thread per tower, so the weights are the same for any
OMP_NUM_THREADS. The texts describing a head come from text_pool(); its few words span only about 13
directions, so TextSpan takes 5 texts per head here (TEXTS_PER_HEAD), not 20; with 5 texts a head's
concept entropy takes one of six values, so the toy's thresholds lie between them (THRESHOLDS).

Recipe v3 was chosen on criteria written before it was chosen (one pipeline check had run DeAR once
on a candidate; no DeAR number was used): blocks 3-4 hold an attribute head for each of colour,
shape, texture and location; a block holds two roles or more; no head sits on a threshold; zero-shot
novel accuracy >= 60%; then the most attribute heads whose ground-truth probe (roles.md) names the
same factor, the most generalization heads, the fewest steps, the lowest seed. Rounds: 9 heads of
width 16 with quantile thresholds (seeds 0-7, 5-7 texts): 7 to 14 of 18 heads on a threshold in
every candidate, hence THRESHOLDS; 8 heads, 400 steps, seeds 0-15: seed 9 alone meets the criteria
(4 of 8 attribute heads confirmed); 600 steps, seeds 0-5: seed 1 (4 of 9); 800 steps, seeds 0-5:
seeds 4 (7 of 9) and 5 (6 of 6). Chosen: 800 steps, seed 4. Zero-shot: base 99.0%, novel 95.6%
(chance 8.3%). Recipe v2 (4 heads, 24 colour x shape classes, 400 steps) and its history: git log.

RECIPE names the checkpoint and marks the written folders: change it whenever what is drawn or how
the CLIP is pretrained changes, so that no stale file is ever reused.
"""

import functools
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# before torch loads OpenMP: idle threads sleep (shared CPUs)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
from PIL import Image

import clip
import data
from clip.model import CLIP

BACKBONE = "toy"  # --backbone toy
RECIPE = "v3"
TEMPLATE = "a photo of a {}."
TEXTS_PER_HEAD = 5
# Concept Entropy's thresholds in bits: with 5 texts on 4 concepts, a head's entropy is one of six
# values (0, 0.72, 0.97, 1.37, 1.52, 1.92), and the quantiles of 16 heads land on tied heads; these
# lie between the values instead: specialist <= 1.45 (3 texts or more on one concept), mixed
# (2 + 2 + 1), generalization >= 1.7 (texts on all four concepts)
THRESHOLDS = (1.45, 1.7)
STEPS = 800
SEED = 4  # of the pretraining: the recipe's rounds chose it (see above)
COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
SHAPES = ("circle", "square", "triangle", "cross")
TEXTURES = ("solid", "striped", "dotted")
LOCATIONS = ("top left", "top right", "bottom left", "bottom right")
FACTORS = {"color": COLORS, "shape": SHAPES, "texture": TEXTURES, "location": LOCATIONS}
PALETTE = {"red": (0.86, 0.18, 0.18), "green": (0.20, 0.67, 0.24), "blue": (0.20, 0.35, 0.86),
           "yellow": (0.90, 0.82, 0.18), "purple": (0.60, 0.24, 0.80), "orange": (0.95, 0.55, 0.14)}
TOY_CONFIG = dict(embed_dim=64, image_resolution=32, vision_layers=4, vision_width=128,
                  vision_patch_size=8, context_length=16, vocab_size=49408, transformer_width=128,
                  transformer_heads=4, transformer_layers=4, vision_heads=8)
# the head counts a checkpoint carries beside its weights, and its record (ensure_pretrained)
HEADS = dict(vision_heads=TOY_CONFIG["vision_heads"], text_heads=TOY_CONFIG["transformer_heads"])
SATURATION = 0.25  # pale objects, so that colour is not by far the easiest factor to see
DARK = 0.35  # stripes and dots: the object's colour times DARK
SPLIT_SIZES = {"train": 24, "val": 8, "test": 32}  # images per class; 16-shot training needs >= 16
SPLIT_FILE = "split_zhou_ToyWorld.json"
# name: (the factor paired with colour in a class, the drawing's shift)
TRANSFER = {"noisy": ("shape", {"noise": 0.08}), "small": ("shape", {"scale": 0.6}),
            "textures": ("texture", {})}
TRANSFER_IMAGES = 40  # per class; data.py's folder reader keeps 30% (12) as the test split


# ---------------------------------------------------------------------------------------------
# Drawing


def shape_mask(shape, x, y, cx, cy, r):
    """Boolean mask of `shape` centred at (cx, cy) with half-size r, on pixel-centre grids x, y."""
    dx, dy = x - cx, y - cy
    if shape == "circle":
        return dx**2 + dy**2 <= r**2
    if shape == "square":  # half-side 0.85 r: about the circle's area
        return (np.abs(dx) <= 0.85 * r) & (np.abs(dy) <= 0.85 * r)
    if shape == "triangle":  # apex up, height 1.8 r, base 2 r
        t = (dy + r) / (1.8 * r)  # 0 at the apex, 1 at the base
        return (t >= 0) & (t <= 1) & (np.abs(dx) <= t * r)
    if shape == "cross":
        arm = 0.33 * r
        return ((np.abs(dx) <= arm) & (np.abs(dy) <= r)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= r))
    raise ValueError(f"unknown shape {shape!r}")


def texture_mask(texture, x, y, size, rng):
    """Boolean mask of the pixels the texture darkens: diagonal stripes (half dark) or a grid of
    dots."""
    if texture == "solid":
        return np.zeros_like(x, dtype=bool)
    period = size / 8  # 4 px at 32x32
    phase = rng.uniform(0, period)
    if texture == "striped":
        return ((x + y + phase) % period) < period / 2
    if texture == "dotted":
        period = size * 5 / 32
        gx, gy = ((v + phase) % period - period / 2 for v in (x, y))
        return gx**2 + gy**2 <= (0.28 * period) ** 2
    raise ValueError(f"unknown texture {texture!r}")


def render(color, shape, texture, location, seed, size=32, scale=1.0, noise=0.02):
    """One image, uint8 [size, size, 3]; the same arguments give the same pixels. scale (object
    size) and noise (pixel noise std) are the transfer sets' shifts."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5  # pixel centres, [size, size] each
    # the ground: a grey level, a faint colour tint and a gentle brightness gradient
    grey = rng.uniform(0.30, 0.70)
    tint = rng.uniform(-0.03, 0.03, size=3)
    gx, gy = rng.uniform(-0.10, 0.10, size=2)
    # [size, size, 3]
    img = (grey + gx * (x / size - 0.5) + gy * (y / size - 0.5))[..., None] + tint
    # the object: half-size about 0.2 of the image, centred in its quadrant with a little jitter
    row, col = location.split()
    r = size * rng.uniform(0.19, 0.22) * scale
    cx = size * (0.25 if col == "left" else 0.75) + rng.uniform(-0.04, 0.04) * size
    cy = size * (0.25 if row == "top" else 0.75) + rng.uniform(-0.04, 0.04) * size
    rgb = np.array(PALETTE[color])
    rgb = rgb.mean() + SATURATION * (rgb - rgb.mean())  # towards the colour's own grey
    rgb = rgb * rng.uniform(0.88, 1.0) + rng.uniform(-0.03, 0.03, size=3)
    # [size, size, 3]
    rgb = np.where(texture_mask(texture, x, y, size, rng), DARK, 1.0)[..., None] * rgb
    img = np.where(shape_mask(shape, x, y, cx, cy, r)[..., None], rgb, img)
    img = img + rng.normal(0.0, noise, size=img.shape)
    return (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def caption(color=None, shape=None, texture=None, location=None):
    """The named factors in words: "a red striped circle in the top left", "a striped object"."""
    text = "a " + " ".join(w for w in (color, texture, shape or "object") if w)
    return text + (f" in the {location}" if location else "")


def text_pool():
    """(text, concept) pairs in the toy world's words: the descriptions Concept Entropy gives the
    toy CLIP."""
    templates = {"color": ("{}", "a {} object", "something {}", "the color {}", "a {} thing",
                           "painted {}"), "shape": ("{}", "a {}", "a photo of a {}", "a {} shape",
            "the outline of a {}", "a small {}"), "texture": ("{}", "a {} object", "something {}",
            "a {} pattern", "a {} thing", "a {} surface"),
                 "location": ("in the {}", "an object in the {}", "something in the {}", "the {}",
            "a thing in the {}", "placed in the {}")}
    return [(t.format(w), c) for c, words in FACTORS.items() for t in templates[c] for w in words]


# ---------------------------------------------------------------------------------------------
# The dataset (CoOp layout) and the transfer sets


def class_list():
    """The 24 classes in label order: the 12 base classes pair a colour and a shape ("red circle",
    (i + j) even on the colour x shape grid; always solid), the 12 novel ones a colour and a texture
    ("red striped", any shape): novel classes need texture, which no base class does."""
    base = [(c, s) for i, c in enumerate(COLORS) for j, s in enumerate(SHAPES) if (i + j) % 2 == 0]
    return base + [(c, t) for c in COLORS for t in TEXTURES[1:]]


def dataset_items():
    """Every image of the dataset: (split, label, file, (colour, shape, texture, location),
    seed)."""
    items = []
    for s, split in enumerate(SPLIT_SIZES):
        for label, (color, second) in enumerate(class_list()):
            for i in range(SPLIT_SIZES[split]):
                k = (i + label) % 16  # the free factors cycle, offset per class
                # base: solid, the location cycling; novel: the shape and the location cycling
                # through their 16 pairs
                factors = ((color, second, "solid", LOCATIONS[k % 4]) if second in SHAPES
                           else (color, SHAPES[k % 4], second, LOCATIONS[k // 4]))
                seed = 1_000_000 * (s + 1) + 1000 * label + i
                items.append((split, label, f"{color}_{second}/{split}_{i:03d}.png", factors, seed))
    return items


def factor_labels(paths):
    """{factor: LongTensor of value indices} of dataset images, found by their last two path
    parts."""
    by_file = {file: factors for _, _, file, factors, _ in dataset_items()}
    rows = [by_file["/".join(os.path.normpath(p).split(os.sep)[-2:])] for p in paths]
    factors = enumerate(FACTORS.items())
    return {name: torch.tensor([vocab.index(f[k]) for f in rows]) for k, (name, vocab) in factors}


def write_folder(folder, images, files=()):
    """Write `images` ((relative path, uint8 array) pairs) and `files` ((name, text) pairs) into
    `folder` once, all at once (data.atomic_write), marked with the recipe; refuse any other
    folder there."""
    mark = os.path.join(folder, f"recipe-{RECIPE}")
    if os.path.isfile(mark):
        return folder
    if os.path.exists(folder):
        raise data.UserError(f"{folder}: not toy world {RECIPE}; delete it (remade in seconds)")

    def write(tmp):
        for file, pixels in images:
            os.makedirs(os.path.dirname(os.path.join(tmp, file)), exist_ok=True)
            Image.fromarray(pixels).save(os.path.join(tmp, file))
        for name, text in [*files, (os.path.basename(mark), RECIPE)]:
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)

    os.makedirs(os.path.dirname(folder), exist_ok=True)
    try:
        return data.atomic_write(folder, write)
    except OSError:  # another process wrote it first
        if not os.path.isfile(mark):
            raise
        return folder


def ensure_dataset(root):
    """<root>/toyworld/{images/<class>/*.png, split_zhou_ToyWorld.json}, written once; returns
    the folder."""
    items = dataset_items()
    split = {s: [[file, label, file.split("/")[0]] for s2, label, file, _, _ in items if s2 == s]
             for s in SPLIT_SIZES}
    images = ((f"images/{file}", render(*factors, seed)) for _, _, file, factors, seed in items)
    folder = os.path.join(os.path.abspath(os.path.expanduser(root)), "toyworld")
    return write_folder(folder, images, [(SPLIT_FILE, json.dumps(split, indent=4))])


def transfer_images():
    """(set/class/file, pixels) of every transfer set: the class's two factors, the others
    cycling."""
    for t, (name, (second, shift)) in enumerate(TRANSFER.items()):
        for label, (a, b) in enumerate((a, b) for a in COLORS for b in FACTORS[second]):
            for i in range(TRANSFER_IMAGES):
                f = dict(color=a, shape=SHAPES[i % 4], texture=TEXTURES[i % 3],
                         location=LOCATIONS[(i // 3) % 4]) | {second: b}
                seed = 10_000_000 * (t + 1) + 1000 * label + i  # above every dataset seed
                yield f"{name}/{a}_{b}/{i:03d}.png", render(**f, seed=seed, **shift)


def ensure_transfer(root):
    """<root>/toyworld-transfer/<set>/<class>/*.png, written once; returns the sets as
    folder:PATH names."""
    folder = write_folder(os.path.join(os.path.abspath(os.path.expanduser(root)),
                                       "toyworld-transfer"), transfer_images())
    return ["folder:" + os.path.join(folder, name) for name in TRANSFER]


# ---------------------------------------------------------------------------------------------
# Pretraining the tiny CLIP


def to_tensor(arrays):
    """uint8 images [B, H, W, 3] -> [B, 3, H, W], normalised as clip's preprocess does."""
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous().float().div(255)
    return (x - torch.tensor(clip.MEAN).view(3, 1, 1)) / torch.tensor(clip.STD).view(3, 1, 1)


def sample_batch(n, g):
    """n random objects and a caption for each that names one of its factors, drawn from
    generator g.

    Returns (image factors [n, 4], caption factors [n, 4] with -1 for an unnamed factor,
    captions, image seeds). Half the captions take the class template's form ("a photo of a
    circle."). A caption naming one factor is a positive for every image with it, so each factor
    must be read on its own: with whole captions, colour and shape fit nearly every caption and
    texture and location are hardly learnt."""
    sizes = torch.tensor([len(v) for v in FACTORS.values()])
    img_f = (torch.rand(n, 4, generator=g) * sizes).long()  # [n, 4]
    # recipe v2 drew how many factors a caption names (always one); the draw stays, and so do its
    # weights
    torch.multinomial(torch.tensor([1.0, 0, 0, 0]), n, True, generator=g)
    # [n, 1]: first of a random order
    named = torch.multinomial(torch.ones(n, 4), 4, generator=g)[:, :1]
    cap_f = torch.full_like(img_f, -1).scatter(1, named, img_f.gather(1, named))  # [n, 4]
    photo = torch.rand(n, generator=g) < 0.5
    seeds = torch.randint(0, 2**31 - 1, (n,), generator=g) + 2**32  # above every dataset seed
    texts = [caption(*factor_words(f)) for f in cap_f.tolist()]
    texts = [f"a photo of {text}." if p else text for text, p in zip(texts, photo.tolist())]
    return img_f, cap_f, texts, seeds.tolist()


def factor_words(indices):
    """Value indices of the four factors -> their words (None for -1, a factor not named)."""
    return [v[k] if k >= 0 else None for v, k in zip(FACTORS.values(), indices)]


@functools.lru_cache(maxsize=None)
def tokens_of(text):
    return clip.tokenize([text], context_length=TOY_CONFIG["context_length"])[0]


def pretraining_batch(n, g):
    """(images [n, 3, 32, 32], tokens [n, 16], truth [n, n]): truth[i, j] = caption j is true of
    image i."""
    img_f, cap_f, texts, seeds = sample_batch(n, g)
    images = [render(*factor_words(f), seed) for f, seed in zip(img_f.tolist(), seeds)]
    truth = ((cap_f[None] == img_f[:, None]) | (cap_f[None] < 0)).all(-1)  # [n, n]
    return to_tensor(images), torch.stack([tokens_of(t) for t in texts]), truth


def contrastive_loss(logits, truth):
    """CLIP's symmetric loss with soft targets: logits [B, B] image x text, each direction the
    cross-entropy to the uniform distribution over a row's (column's) positives."""
    t = truth.float()
    one_way = lambda d: -(t / t.sum(d, keepdim=True) * logits.log_softmax(d)).sum(d).mean()
    return (one_way(1) + one_way(0)) / 2  # image -> text, text -> image


def warmup_cosine(lr, step, steps, n_warm):
    """The learning rate at `step` (from 1): linear warm-up over n_warm steps, then cosine decay
    to 0."""
    if step <= n_warm:
        return lr * step / n_warm
    return lr * 0.5 * (1 + math.cos(math.pi * (step - n_warm) / max(1, steps - n_warm)))


def tower_step(model, images, tokens, truth, worker, then=None):
    """The loss and loss.backward() with the text tower on `worker` (a one-thread executor)
    beside the image tower here: the towers share no weights, so the gradients are those of one
    backward, bit for bit. Returns (loss, then()), `then` (the next batch) run on the worker
    after the text backward."""
    text = worker.submit(model.encode_text, tokens)
    image_out = model.encode_image(images)  # [B, E]
    text_out = text.result()  # [B, E]
    image_leaf, text_leaf = image_out.detach().requires_grad_(), text_out.detach().requires_grad_()
    loss = contrastive_loss(model.similarity(image_leaf, text_leaf), truth)
    loss.backward()  # into logit_scale and the two leaves, then from each leaf into its tower

    def text_backward():
        text_out.backward(text_leaf.grad)
        return then() if then else None

    after = worker.submit(text_backward)
    image_out.backward(image_leaf.grad)
    return loss.detach(), after.result()


def pretrain(steps=STEPS, seed=SEED, batch_size=128, lr=1e-3, log=print):
    """The toy CLIP trained contrastively on pairs drawn on the fly (novel combinations included,
    as web data holds them for real CLIP); deterministic in `seed`. Returns the model in eval
    mode."""
    torch.manual_seed(seed)
    model = CLIP(**TOY_CONFIG).train()
    g = torch.Generator().manual_seed(seed)
    # Captions use about 40 of the 49,408 token rows: a sparse gradient (SparseAdam) updates only
    # those.
    model.token_embedding.sparse = True
    params = [(n, p) for n, p in model.named_parameters() if n != "token_embedding.weight"]
    # weight decay on the weight matrices, not on the embeddings, biases and gains
    groups = [{"params": [p for n, p in params if (p.ndim >= 2 and "embedding" not in n) == decay],
               "weight_decay": 0.05 if decay else 0.0} for decay in (True, False)]
    adam = dict(lr=lr, betas=(0.9, 0.98), eps=1e-6)
    opts = [torch.optim.AdamW(groups, **adam),
            torch.optim.SparseAdam([model.token_embedding.weight], **adam)]
    n_warm, t0, avg = max(1, int(0.05 * steps)), time.time(), None
    threads = torch.get_num_threads()
    # one thread per tower, for any OMP_NUM_THREADS: two would sum floats otherwise
    torch.set_num_threads(1)
    try:
        # the text tower and the next batch (their ops release the GIL)
        with ThreadPoolExecutor(1) as worker:
            batch = pretraining_batch(batch_size, g)
            for step in range(1, steps + 1):
                draw = None if step == steps else lambda: pretraining_batch(batch_size, g)
                loss, batch = tower_step(model, *batch, worker, then=draw)
                for opt in opts:
                    for group in opt.param_groups:
                        group["lr"] = warmup_cosine(lr, step, steps, n_warm)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    model.logit_scale.clamp_(0, math.log(100))  # as CLIP
                avg = loss.item() if avg is None else 0.9 * avg + 0.1 * loss.item()
                if step % 20 == 0 or step == steps:
                    seconds = time.time() - t0
                    log(f"toy CLIP step {step}/{steps}  loss {avg:.3f}  {seconds:.0f} s, "
                        f"{seconds / step * (steps - step):.0f} s to go")
    finally:
        torch.set_num_threads(threads)
    model.token_embedding.sparse = False
    return model.eval()


def checkpoint_name(steps=STEPS):
    return f"toy-clip-{RECIPE}-steps{steps}.pt"


def ensure_pretrained(cache_dir, log=print, steps=STEPS):
    """Path of the pretrained toy CLIP (a state dict clip.load reads) in cache_dir, pretrained
    once when missing. A record beside it (.json) keeps its SHA256 and head counts; a file that
    disagrees with it is pretrained again."""
    path = os.path.join(os.path.expanduser(cache_dir), checkpoint_name(steps))
    record = path.removesuffix(".pt") + ".json"
    try:
        made = {"sha256": data.sha256_file(path), **HEADS}
        if data.read_json(record, {"sha256": str}, "") == made:
            return path
    except (data.UserError, OSError):
        pass  # none there, or not what was recorded: pretrained (again)
    with torch.device("meta"):  # the checkpoint's size, before the work: its fp32 weights
        size = 4 * sum(p.numel() for p in CLIP(**TOY_CONFIG).parameters())
    data.writable_folder(os.path.dirname(path), size + 2**20)
    log(f"Pretraining the toy CLIP once ({steps} steps, a minute or two) into {path}")
    model = pretrain(steps, log=log)
    # build_model cannot infer 8 heads of width 16 from the shapes: the state dict carries them
    state = dict(model.state_dict(), **{k: torch.tensor(v) for k, v in HEADS.items()})
    data.write_torch(path, state)
    data.write_json(record, {"sha256": data.sha256_file(path), **HEADS})
    return path


if __name__ == "__main__":
    print("toyworld.py is a library: `python dear.py --dataset toyworld` writes the toy world and "
          "pretrains its CLIP", file=sys.stderr)
    sys.exit(2)

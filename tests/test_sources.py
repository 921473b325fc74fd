"""The code's tables and hand-ported rules against the official sources, restated here as data
(never read from the code's own tables). Sources, cited as repository@commit path:
KaiyangZhou/CoOp@ff61507, yunncheng/MMRL@27d8821, KaiyangZhou/Dassl.pytorch@c61a1b5,
openai/CLIP@d05afc4. The toy world's rows are the project's own choice and are not checked."""

import functools
import gzip
import html
import json
import math
import os

import ftfy
import numpy as np
import pytest
import regex
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torchvision.transforms import InterpolationMode

import clip
import data
import dear
from clip.tokenizer import clean_text, get_tokenizer

# CoOp@ff61507 configs/datasets/<key>.yaml (DATASET.NAME) and datasets/*.py (dataset_dir,
# image_dir; StanfordCars: paths relative to dataset_dir) and DATASETS.md: the label source
COOP = {
    "imagenet": ("ImageNet", "imagenet", "images", "classnames.txt"),
    "caltech101": ("Caltech101", "caltech-101", "101_ObjectCategories",
                   "split_zhou_Caltech101.json"),
    "oxford_pets": ("OxfordPets", "oxford_pets", "images", "split_zhou_OxfordPets.json"),
    "stanford_cars": ("StanfordCars", "stanford_cars", "", "split_zhou_StanfordCars.json"),
    "oxford_flowers": ("OxfordFlowers", "oxford_flowers", "jpg", "split_zhou_OxfordFlowers.json"),
    "food101": ("Food101", "food-101", "images", "split_zhou_Food101.json"),
    "fgvc_aircraft": ("FGVCAircraft", "fgvc_aircraft", "images", "variants.txt"),
    "sun397": ("SUN397", "sun397", "SUN397", "split_zhou_SUN397.json"),
    "dtd": ("DescribableTextures", "dtd", "images", "split_zhou_DescribableTextures.json"),
    "eurosat": ("EuroSAT", "eurosat", "2750", "split_zhou_EuroSAT.json"),
    "ucf101": ("UCF101", "ucf101", "UCF-101-midframes", "split_zhou_UCF101.json"),
    "imagenetv2": ("ImageNetV2", "imagenetv2", "imagenetv2-matched-frequency-format-val",
                   "classnames.txt"),
    "imagenet_sketch": ("ImageNetSketch", "imagenet-sketch", "images", "classnames.txt"),
    "imagenet_a": ("ImageNetA", "imagenet-adversarial", "imagenet-a", "classnames.txt"),
    "imagenet_r": ("ImageNetR", "imagenet-rendition", "imagenet-r", "classnames.txt")}
RENAMES = {  # CoOp@ff61507 datasets/caltech101.py and datasets/eurosat.py NEW_CNAMES, every entry
    "caltech101": {"airplanes": "airplane", "Faces": "face", "Leopards": "leopard",
                   "Motorbikes": "motorbike"},
    "eurosat": {"AnnualCrop": "Annual Crop Land", "Forest": "Forest",
                "HerbaceousVegetation": "Herbaceous Vegetation Land", "Highway": "Highway or Road",
                "Industrial": "Industrial Buildings", "Pasture": "Pasture Land",
                "PermanentCrop": "Permanent Crop Land", "Residential": "Residential Buildings",
                "River": "River", "SeaLake": "Sea or Lake"}}
# MMRL@27d8821 base_to_novel.sh / few_shot.sh and cross_datasets.sh: the datasets and xd targets
B2N = {"dtd", "eurosat", "ucf101", "oxford_flowers", "oxford_pets", "fgvc_aircraft", "caltech101",
       "food101", "stanford_cars", "sun397", "imagenet"}
XD_TARGETS = B2N - {"imagenet"} | {"imagenet_a", "imagenet_r", "imagenet_sketch", "imagenetv2"}
# MMRL@27d8821 configs/trainers/<file>.yaml: MAX_EPOCH, TRAIN_X.BATCH_SIZE, WARMUP_EPOCH, LR; all
# files: RRCROP_SCALE (0.5, 1), WARMUP_CONS_LR 1e-5, ALPHA 0.7, REP_DIM 512, no WEIGHT_DECAY
# (Dassl@c61a1b5 dassl/config/defaults.py: 5e-4)
YAML = {"MMRL/vit_b16": (10, 4, 1, 0.001), "MMRL/vit_b16_imagenet": (5, 32, 1, 0.001),
        "MMRLpp/vit_b16_few_shot": (100, 32, 1, 0.002), "MMRLpp/vit_b16_imagenet": (5, 32, 1,
        0.001), "MMRL/vit_b16_cross_datasets": (1, 32, 0, 0.001)}
# MMRL@27d8821 scripts/mmrl/base2new_train.sh, scripts/mmrlpp/few_shot.sh (ImageNet: *_imagenet),
# scripts/mmrlpp/cross_datasets_train.sh (source ImageNet)
CFG = {("b2n", False): "MMRL/vit_b16", ("b2n", True): "MMRL/vit_b16_imagenet",
       ("fewshot", False): "MMRLpp/vit_b16_few_shot", ("fewshot", True): "MMRLpp/vit_b16_imagenet",
       ("xd", True): "MMRL/vit_b16_cross_datasets"}  # key: (protocol, ImageNet)
# MMRL@27d8821 trainers/config.py, MMRLpp, tasks B2N and FS: DATASET.NAME -> (BETA, REG_WEIGHT)
MMRLPP_B2N_FS = {"ImageNet": (0.9, 0.2), "FGVCAircraft": (0.9, 2.0), "UCF101": (0.9, 3.0),
                 "DescribableTextures": (0.9, 7.0), "OxfordPets": (0.7, 0.01),
                 "StanfordCars": (0.7, 6.0), "Caltech101": (0.6, 3.0), "SUN397": (0.5, 3.0),
                 "OxfordFlowers": (0.4, 7.0), "EuroSAT": (0.2, 0.01), "Food101": (0.1, 1.0)}
# ... task CD: the ImageNet source (BETA, REG_WEIGHT) and each target's test-time BETA
MMRLPP_CD_SOURCE = (0.9, 0.1)
MMRLPP_CD_BETA = {"ImageNetV2": 0.9, "ImageNetR": 0.9, "ImageNetA": 0.8, "ImageNetSketch": 0.7,
                  "FGVCAircraft": 0.9, "UCF101": 0.9, "SUN397": 0.7, "OxfordPets": 0.6,
                  "Caltech101": 0.6, "DescribableTextures": 0.5, "OxfordFlowers": 0.4,
                  "StanfordCars": 0.3, "EuroSAT": 0.3, "Food101": 0.3}
# openai/CLIP@d05afc4 clip/clip.py _transform
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def test_dataset_rows_protocol_lists_and_xd_target_beta():
    """Every dataset's CoOp name, folder and image folder (CoOp@ff61507 datasets/*.py); the b2n
    datasets and the xd targets of an ImageNet source (MMRL@27d8821 *.sh), each evaluated with its
    row of MMRL++'s task-CD table (trainers/config.py)."""
    rows = {k: s[:3] for k, s in data.DATASETS.items() if k != "toyworld"}
    assert rows == {k: r[:3] for k, r in COOP.items()}
    assert sorted(data.B2N_DATASETS) == sorted(B2N)
    assert sorted(data.DG_TARGETS) == sorted(XD_TARGETS - B2N)
    c = dear.resolve(dear.Config(dataset="imagenet", protocol="xd"))
    assert sorted(c.targets) == sorted(XD_TARGETS)
    assert {t: dear.eval_beta(c, t) for t in XD_TARGETS} == {
        t: MMRLPP_CD_BETA[COOP[t][0]] for t in XD_TARGETS}


@pytest.mark.parametrize("protocol,dataset", [
    *[(p, d) for p in ("b2n", "fewshot") for d in sorted(B2N)], ("xd", "imagenet")])
def test_recipe_defaults(protocol, dataset):
    """A run's defaults: the schedule of the config file MMRL's scripts use, (beta, lambda_reg)
    from MMRL++'s trainers/config.py, the yaml's crop scale, warm-up lr, alpha and width."""
    c = dear.resolve(dear.Config(dataset=dataset, protocol=protocol))
    file = CFG[protocol, dataset == "imagenet"]
    assert (c.epochs, c.batch_size, c.warmup_epochs, c.lr) == YAML[file]
    source = MMRLPP_CD_SOURCE if protocol == "xd" else MMRLPP_B2N_FS[COOP[dataset][0]]
    assert (c.beta, c.lambda_reg) == source
    assert (c.crop_scale, c.warmup_lr, c.weight_decay, c.alpha_cls, c.rep_dim) == (
        0.5, 1e-5, 5e-4, 0.7, 512)


RAW = ["2012 Tesla Model S Sedan", "apple_pie", "Apply_Eye_Makeup", "outdoor apartment_building",
       "737-300", "hard-leaved pocket orchid", "class 10", "yin_yang", "A300B4", "banded",
       "Cessna 172", "x 11"]
RAW_NAMES = {"caltech101": RAW[:8] + list(RENAMES["caltech101"]),
             "eurosat": list(RENAMES["eurosat"]) + RAW[:2]}


def coop_layout(root, name):
    """`name` at CoOp's paths (COOP), 12 classes (A and R: 11 of the 12 wnids of classnames.txt),
    folders made in reverse order, a hidden folder beside the class folders, a .DS_Store in each;
    file k-<split>: class k. Returns {split: [(file stem, k)]}."""
    _, folder, images, labels = COOP[name]
    top, raw, out = os.path.join(root, folder), RAW_NAMES.get(name, RAW), {}
    for k in reversed([k for k in range(12) if k != 5 or name not in ("imagenet_a", "imagenet_r")]):
        if labels.startswith("split_zhou"):
            files = [(s, f"{raw[k]}/{k}-{s}.jpg") for s in ("train", "val", "test")]
        elif labels == "variants.txt":
            files = [(s, f"{k}-{s}.jpg") for s in ("train", "val", "test")]
        elif name == "imagenet":
            files = [(s, f"{s}/n{k:08d}/{k}-{s}.JPEG") for s in ("train", "val")]
        else:
            files = [("test", f"{k if name == 'imagenetv2' else f'n{k:08d}'}/{k}-test.jpeg")]
        for s, rel in files:
            out.setdefault(s, []).append((rel, k, raw[k]))
            hidden = os.path.join(os.path.dirname(os.path.dirname(rel)), ".ipynb_checkpoints")
            for path in (rel, os.path.join(hidden, os.path.basename(rel))):
                path = os.path.join(top, images, path)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                for f in (path, os.path.join(os.path.dirname(path), ".DS_Store")):
                    open(f, "w").close()
    open(os.path.join(top, images, "README.txt"), "w").close()
    split = {labels: json.dumps({s: [list(e) for e in v] for s, v in out.items()})}
    text = {f"images_variant_{s}.txt": "".join(f"{r[:-4]} {c}\n" for r, _, c in v)
            for s, v in out.items()} | {"variants.txt": "".join(f"{c}\n" for c in raw),
            "classnames.txt": "".join(f"n{k:08d} {c}\n" for k, c in enumerate(raw))}
    for file, body in (text | (split if labels.startswith("split_zhou") else {})).items():
        with open(os.path.join(top, file), "w") as f:
            f.write(body)
    return {s: [(os.path.splitext(os.path.basename(r))[0], k) for r, k, _ in v]
            for s, v in out.items()}


@pytest.mark.parametrize("name", sorted(COOP))
def test_readers_on_coop_layouts(tmp_path, name):
    """CoOp@ff61507 datasets/*.py on its DATASETS.md layout: 12 classes; labels from the split
    file, variants.txt's order, sorted wnid folders (A, R: of those present) or V2's folder
    numbers; hidden entries and README.txt ignored; names renamed (NEW_CNAMES) and '_' read as
    ' ' (trainers/zsclip.py); ImageNet's val set is its test set."""
    want = coop_layout(str(tmp_path), name)
    ds = data.build_dataset(name, str(tmp_path))
    names = [RENAMES.get(name, {}).get(c, c).replace("_", " ") for c in RAW_NAMES.get(name, RAW)]
    keys = sorted({k for items in want.values() for _, k in items})
    label = {k: i for i, k in enumerate(keys)}
    assert ds.classnames == [names[k] for k in keys]
    prefix = os.path.join(str(tmp_path), *COOP[name][1:3], "")
    for got, s in ((ds.train, "train"), (ds.test, "val" if name == "imagenet" else "test")):
        assert all(p.startswith(prefix) and ".ipynb" not in p for p, _, _ in got)
        stems = sorted((os.path.splitext(os.path.basename(p))[0], y, c) for p, y, c in got)
        assert stems == sorted((f, label[k], names[k]) for f, k in want.get(s, []))


VOCAB = os.path.join(clip.__path__[0], "bpe_simple_vocab_16e6.txt.gz")
SPECIAL = ("<|startoftext|>", "<|endoftext|>")
# openai/CLIP@d05afc4 clip/simple_tokenizer.py: a word is a special token, a contraction, a run of
# letters, ONE number character, or a run of other non-space characters (module regex, IGNORECASE)
WORD = regex.compile(r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}"
                     r"|[^\s\p{L}\p{N}]+", regex.IGNORECASE)


@functools.lru_cache
def reference_vocab():
    """openai/CLIP@d05afc4 clip/simple_tokenizer.py ids: 256 byte symbols (printable Latin-1 first,
    as themselves; the 68 others chr(256 + n)), those + "</w>", merges 1..48894, SOT, EOT."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in keep]
    sym = {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(rest)}}
    with gzip.open(VOCAB, "rt", encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:48895]]
    units = [sym[b] for b in keep + rest]
    vocab = units + [u + "</w>" for u in units] + ["".join(m) for m in merges] + list(SPECIAL)
    return sym, {t: i for i, t in enumerate(vocab)}, {m: r for r, m in enumerate(merges)}


def reference_clean(text):
    """ftfy.fix_text, html.unescape twice, whitespace runs to one space, strip, lower-case."""
    return regex.sub(r"\s+", " ", html.unescape(html.unescape(ftfy.fix_text(text)))).strip().lower()


def reference_encode(text):
    """BPE per word: its UTF-8 bytes as symbols, "</w>" on the last; merge the adjacent pair of
    lowest rank, every occurrence left to right, until no pair has a rank."""
    sym, ids, ranks = reference_vocab()
    out = []
    for word in WORD.findall(reference_clean(text)):
        w = [word] if word in SPECIAL else [sym[b] for b in word.encode("utf-8")]
        w[-1] += "" if word in SPECIAL else "</w>"
        while len(w) > 1 and (best := min(zip(w, w[1:]), key=lambda p: ranks.get(p, math.inf))
                              ) in ranks:
            i, merged = 0, []
            while i < len(w):
                pair = tuple(w[i:i + 2]) == best
                merged.append("".join(w[i:i + 1 + pair]))
                i += 1 + pair
            w = merged
        out += [ids[s] for s in w]
    return out


TOKEN_CASES = {  # text: the nearest wrong rule, which gives other pieces
    "2012 Tesla Model S": "a run of digits as one word (\\p{N}+)",
    "m\u00b2 \u00bd \u0663": "ASCII digits only: \u00b2 \u00bd \u0663 are \\p{N}",
    "it's they'll we're i've i'm he'd can't": "no contractions: the apostrophe on its own",
    "A Photo OF a CAT": "no lower-casing",
    "cafe\u0301 na\u00efve": "no ftfy: a combining accent (NFC) is a piece of its own",
    "caf\u00c3\u00a9 \uff26\uff55\uff4c\uff4c": "no ftfy: mojibake and full-width letters kept",
    "<b> &amp;amp; c": "one html.unescape (ftfy leaves the HTML of a text with '<')",
    "\u6771\u4eac cr\u00e8me": "bytes 0x80-0xa0 as Latin-1 characters (no such symbol)",
    "a\u00a0 photo\t\n of": "whitespace: only ' ' collapsed (clean_text)",
    "hello!!! (a/b)...": "one piece per punctuation character",
    "x<|endoftext|>y": "special tokens not matched first"}


@pytest.mark.parametrize("text", TOKEN_CASES)
def test_tokenizer_follows_openai_rules(text):
    """openai/CLIP@d05afc4 clip/simple_tokenizer.py (basic_clean, whitespace_clean, the word
    pattern, bpe) and clip.py tokenize, restated above: the cleaned text and the ids."""
    ids = reference_encode(text)
    assert clean_text(text) == reference_clean(text)
    assert get_tokenizer().encode(text) == ids
    assert clip.tokenize(text)[0].tolist() == [49406] + ids + [49407] + [0] * (75 - len(ids))


def test_tokenize_counts_tokens_and_keeps_eot():
    """openai/CLIP@d05afc4 clip/clip.py tokenize: SOT (49406), the ids, EOT (49407), zeros to 77;
    longer: RuntimeError (callers ported from CoOp/MMRL catch it), or cut to 77 with EOT last. A
    digit is a token ("1</w>" = 256 + 49 - 33)."""
    ids = reference_vocab()[1]
    assert [len(ids), ids[SPECIAL[0]], ids[SPECIAL[1]], ids["1</w>"]] == [49408, 49406, 49407, 272]
    assert clip.tokenize("1" * 75)[0].tolist() == [49406] + [272] * 75 + [49407]
    with pytest.raises(RuntimeError, match="context length 77"):
        clip.tokenize("1" * 76)
    cut = clip.tokenize(["a", "12 " * 40], truncate=True).tolist()
    assert cut == [[49406, 320, 49407] + [0] * 74, [49406] + [272, 273] * 37 + [272, 49407]]


def openai_preprocess(image, n):
    """openai/CLIP@d05afc4 clip/clip.py _transform with PIL only: the shorter side to n, the
    longer to int(n * long / short), bicubic, in the image's own mode; the centre n x n at
    round((size - n) / 2) (torchvision center_crop, Python's round); RGB; /255; (x - MEAN) / STD."""
    w, h = image.size
    size = (n, int(n * h / w)) if w <= h else (int(n * w / h), n)
    image = image.resize(size, Image.BICUBIC)
    left, top = round((size[0] - n) / 2), round((size[1] - n) / 2)
    x = np.asarray(image.crop((left, top, left + n, top + n)).convert("RGB"), np.float32) / 255
    return torch.from_numpy((x - np.float32(MEAN)) / np.float32(STD)).permute(2, 0, 1)


@pytest.mark.parametrize("w,h,mode", [  # smaller than 32, crop at round(1.5) = 2 (floor: 1)
    (22, 20, "RGB"), (30, 63, "RGB"),  # portrait 32x67: top round(17.5) = 18
    (101, 40, "RGB"), (37, 45, "L"), (45, 37, "RGBA"), (40, 27, "P")])
def test_clip_transform_is_openai_preprocess(w, h, mode):
    """clip.transform(32) equals the PIL statement above within 1e-5 (one uint8 level is >0.014);
    RGBA (premultiplied) and P (nearest) resize differently from RGB: RGB comes after the crop."""
    image = Image.fromarray(np.random.default_rng(w * h).integers(0, 256, (h, w, 4), np.uint8))
    image = image.convert(mode) if mode != "P" else image.convert("RGB").convert("P")
    got, want = clip.transform(32)(image), openai_preprocess(image, 32)
    assert want.shape == (3, 32, 32) and torch.allclose(got, want, atol=1e-5, rtol=0)


def test_train_transform_is_dassl_random_resized_crop(monkeypatch):
    """Dassl@c61a1b5 dassl/data/transforms/transforms.py with MMRL's configs: RandomResizedCrop(n,
    scale=(crop_scale, 1), torchvision's ratio (3/4, 4/3) and antialias, bicubic),
    RandomHorizontalFlip() (p 0.5), ToTensor, Normalize(CLIP's mean, std). 400 crops of a
    300x200 image: area in [0.3, 1] of it, aspect w/h in [3/4, 4/3], each range spanned."""
    t = data.train_transform(32, 0.3)
    crop, flip, to_tensor, norm = t.transforms  # in this order
    assert type(to_tensor).__name__ == "ToTensor"
    assert (crop.size, crop.scale, crop.ratio, crop.interpolation, crop.antialias) == (
        (32, 32), (0.3, 1.0), (3 / 4, 4 / 3), InterpolationMode.BICUBIC, True)
    assert flip.p == 0.5 and (tuple(norm.mean), tuple(norm.std)) == (MEAN, STD)
    boxes, flips, real_crop, real_flip = [], [], TF.resized_crop, TF.hflip
    monkeypatch.setattr(TF, "resized_crop", lambda img, i, j, h, w, *a, **k: boxes.append(
        (h, w, a)) or real_crop(img, i, j, h, w, *a, **k))
    monkeypatch.setattr(TF, "hflip", lambda img: flips.append(1) or real_flip(img))
    image = Image.new("RGB", (300, 200), (200, 30, 90))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = torch.stack([t(image) for _ in range(400)])
    area, aspect = [h * w / 60000 for h, w, _ in boxes], [w / h for h, w, _ in boxes]
    assert all(a == ((32, 32), InterpolationMode.BICUBIC) for _, _, a in boxes)
    assert 0.29 < min(area) < 0.33 and max(area) <= 1
    assert 0.74 < min(aspect) < 0.8 and 1.3 < max(aspect) < 1.345
    assert 0.4 < len(flips) / 400 < 0.6
    want = torch.from_numpy((np.float32([200, 30, 90]) / 255 - np.float32(MEAN)) / np.float32(STD))
    assert torch.allclose(out, want[None, :, None, None].expand_as(out), atol=1e-5)

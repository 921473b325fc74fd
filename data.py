"""The CoOp benchmark datasets, read from the layout of CoOp's DATASETS.md under --root, and folder:PATH datasets.

A split is a list of (path, label, classname). Few-shot subsets are the ones Dassl draws for the same seed, cached in
<dataset>/split_fewshot/; base/novel classes are CoOp's. `python data.py check|download --help` for the CLI.
"""

import argparse
import collections
import hashlib
import json
import math
import os
import random
import shutil
import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from PIL import Image


class UserError(Exception):
    """A mistake the user can fix (a missing dataset, an unknown name, ...): main() prints it on one line."""


class Spec(NamedTuple):
    coop: str  # CoOp's DATASET.NAME; the json reader reads <folder>/split_zhou_<coop>.json
    folder: str  # under --root
    images: str  # split paths are relative to <folder>/<images>
    reader: str  # json | fgvc | imagenet | variant | v2 | folder
    template: str


PHOTO = "a photo of a {}."
DATASETS = {
    "imagenet": Spec("ImageNet", "imagenet", "images", "imagenet", PHOTO),
    "caltech101": Spec("Caltech101", "caltech-101", "101_ObjectCategories", "json", PHOTO),
    "oxford_pets": Spec("OxfordPets", "oxford_pets", "images", "json", "a photo of a {}, a type of pet."),
    "stanford_cars": Spec("StanfordCars", "stanford_cars", "", "json", PHOTO),
    "oxford_flowers": Spec("OxfordFlowers", "oxford_flowers", "jpg", "json", "a photo of a {}, a type of flower."),
    "food101": Spec("Food101", "food-101", "images", "json", "a photo of {}, a type of food."),
    "fgvc_aircraft": Spec("FGVCAircraft", "fgvc_aircraft", "images", "fgvc", "a photo of a {}, a type of aircraft."),
    "sun397": Spec("SUN397", "sun397", "SUN397", "json", PHOTO),
    "dtd": Spec("DescribableTextures", "dtd", "images", "json", "{} texture."),
    "eurosat": Spec("EuroSAT", "eurosat", "2750", "json", "a centered satellite photo of {}."),
    "ucf101": Spec("UCF101", "ucf101", "UCF-101-midframes", "json", "a photo of a person doing {}."),
    "imagenetv2": Spec("ImageNetV2", "imagenetv2", "imagenetv2-matched-frequency-format-val", "v2", PHOTO),
    "imagenet_sketch": Spec("ImageNetSketch", "imagenet-sketch", "images", "variant", PHOTO),
    "imagenet_a": Spec("ImageNetA", "imagenet-adversarial", "imagenet-a", "variant", PHOTO),
    "imagenet_r": Spec("ImageNetR", "imagenet-rendition", "imagenet-r", "variant", PHOTO),
    "toyworld": Spec("ToyWorld", "toyworld", "images", "json", PHOTO),
}
FOLDER = Spec("folder", "", "", "folder", PHOTO)
B2N_DATASETS = ("imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101",
                "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101")  # fmt: skip
DG_TARGETS = ("imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r")
TEST_ONLY = ("variant", "v2")
# classnames.txt is CLIP's ImageNet list, which names two pairs of classes alike (openai/CLIP#235); CoOp keeps them
CLIP_NAMES = ("imagenet", "variant", "v2")
RENAMES = {  # CoOp's datasets/caltech101.py and eurosat.py: raw class name -> the name put in the prompt
    "caltech101": {"airplanes": "airplane", "Faces": "face", "Leopards": "leopard", "Motorbikes": "motorbike"},
    "eurosat": {"AnnualCrop": "Annual Crop Land", "HerbaceousVegetation": "Herbaceous Vegetation Land",
                "Highway": "Highway or Road", "Industrial": "Industrial Buildings", "Pasture": "Pasture Land",
                "PermanentCrop": "Permanent Crop Land", "Residential": "Residential Buildings",
                "SeaLake": "Sea or Lake"},
}  # fmt: skip
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
FEWSHOT_DIR = "split_fewshot"
FEWSHOT_FORMAT, IMAGENET_FORMAT = "dear-fewshot/1", "dear-imagenet/1"  # cache formats, kept from earlier versions


@dataclass
class Dataset:
    name: str
    train: list  # [(path, label, classname)]
    val: list
    test: list
    classnames: list  # label order
    template: str
    warnings: list = field(default_factory=list)

    @property
    def shots_per_class(self):
        """Training images per class (index = label); fewer than --shots where a class has fewer (CoOp keeps all)."""
        counts = collections.Counter(y for _, y, _ in self.train)
        return [counts[k] for k in range(len(self.classnames))]


# ----------------------------------------------------------------------------- files


def list_dirs(folder):
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def list_images(folder):
    """Image file names, sorted (os.listdir's order differs between machines)."""
    return sorted(f for f in os.listdir(folder) if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS))


def write_json(path, obj):
    """Write whole or not at all; a read-only dataset folder only costs the cache."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except OSError as e:
        print(f"note: cannot write {path} ({e.strerror})", file=sys.stderr)


def cached(path, key, make):
    """The JSON document at path when it was made for `key` (a dict), else {**key, **make()}, stored there."""
    try:
        with open(path) as f:
            doc = json.load(f)
        if isinstance(doc, dict) and all(doc.get(k) == v for k, v in key.items()):
            return doc
    except (OSError, ValueError):
        pass
    doc = {**key, **make()}
    write_json(path, doc)
    return doc


def sha256_json(obj):
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()


# ----------------------------------------------------------------------------- readers
# Each returns (image folder, {"train"|"val"|"test": [(path relative to it, label, raw class name)]}).


def read_split(path):
    """A CoOp split file: {"train"|"val"|"test": [[relative path, label, classname], ...]}."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except ValueError as e:
        raise UserError(f"{path} is not a split file ({e}): download it again") from None
    return {k: [(p, int(y), c) for p, y, c in doc[k]] for k in ("train", "val", "test")}


def read_json(spec, folder):
    return os.path.join(folder, spec.images), read_split(os.path.join(folder, f"split_zhou_{spec.coop}.json"))


def read_fgvc(spec, folder):
    """FGVCAircraft: label = line of the variant in variants.txt; images_variant_<split>.txt lines: '<id> <variant>'."""
    with open(os.path.join(folder, "variants.txt")) as f:
        label = {v: i for i, v in enumerate(line.strip() for line in f if line.strip())}
    split = {}
    for s in ("train", "val", "test"):
        with open(os.path.join(folder, f"images_variant_{s}.txt")) as f:
            rows = [line.strip().split(" ", 1) for line in f if line.strip()]
        split[s] = [(f"{image}.jpg", label[v], v) for image, v in rows]
    return os.path.join(folder, "images"), split


def read_classnames(folder):
    """classnames.txt (CoOp's DATASETS.md): '<wnid> <class name>' per line, in sorted-wnid order."""
    with open(os.path.join(folder, "classnames.txt")) as f:
        return dict(line.strip().split(" ", 1) for line in f if line.strip())


def list_classes(image_dir, names, prefix=""):
    """The files of every sorted wnid folder; label = the folder's index (CoOp's rule)."""
    wnids = list_dirs(image_dir)
    return [
        (f"{prefix}{w}/{f}", y, names[w]) for y, w in enumerate(wnids) for f in list_images(os.path.join(image_dir, w))
    ]


def read_imagenet(spec, folder):
    """ImageNet: the official val set is the test (and val) set. Listed once into preprocessed.json; files are
    sorted by name, unlike Dassl's os.listdir order, so few-shot subsets are the same on every machine."""
    names, image_dir = read_classnames(folder), os.path.join(folder, "images")
    with open(os.path.join(folder, "classnames.txt"), "rb") as f:
        key = {"format": IMAGENET_FORMAT, "classnames_sha256": hashlib.sha256(f.read()).hexdigest()}

    def make():
        print(f"listing {image_dir} (once)", file=sys.stderr)
        return {s: list_classes(os.path.join(image_dir, s), names, f"{s}/") for s in ("train", "val")}

    doc = cached(os.path.join(folder, "preprocessed.json"), key, make)
    test = [tuple(x) for x in doc["val"]]
    return image_dir, {"train": [tuple(x) for x in doc["train"]], "val": test, "test": test}


def read_variant(spec, folder):
    """ImageNet-Sketch/-A/-R: sorted wnid folders (A and R hold 200 of the 1000), names from classnames.txt."""
    image_dir = os.path.join(folder, spec.images)
    return image_dir, {"train": [], "val": [], "test": list_classes(image_dir, read_classnames(folder))}


def read_v2(spec, folder):
    """ImageNetV2: folder k (0..999, in numeric order) holds class k, the k-th line of classnames.txt."""
    names, image_dir = list(read_classnames(folder).values()), os.path.join(folder, spec.images)
    ks = sorted(int(d) for d in list_dirs(image_dir) if d.isdigit())
    test = [(f"{k}/{f}", k, names[k]) for k in ks for f in list_images(os.path.join(image_dir, str(k)))]
    return image_dir, {"train": [], "val": [], "test": test}


def read_folder(spec, folder):
    """folder:PATH: one sub-folder per class, split 50/20/30 per class once (seed 1), kept in PATH/split_folder.json
    so that adding images later does not change it; every class keeps at least one test image."""
    path = os.path.join(folder, "split_folder.json")
    if os.path.exists(path):
        return folder, read_split(path)
    rng, split = random.Random(1), {"train": [], "val": [], "test": []}
    classes = [c for c in list_dirs(folder) if c != FEWSHOT_DIR]
    if not classes:
        raise UserError(f"{folder} has no class sub-folders")
    for label, c in enumerate(classes):
        images = [f"{c}/{f}" for f in list_images(os.path.join(folder, c))]
        if len(images) < 2:
            raise UserError(f"{folder}/{c} holds {len(images)} image(s); a class needs 2 (to train on, to test on)")
        rng.shuffle(images)
        n_train = max(1, round(0.5 * len(images)))
        n_val = min(round(0.2 * len(images)), len(images) - n_train - 1)
        parts = {"train": images[:n_train], "val": images[n_train : n_train + n_val], "test": images[n_train + n_val :]}
        for s, part in parts.items():
            split[s] += [(p, label, c) for p in part]
    write_json(path, split)
    return folder, split


READERS = {"json": read_json, "fgvc": read_fgvc, "imagenet": read_imagenet, "variant": read_variant, "v2": read_v2,
           "folder": read_folder}  # fmt: skip


# ----------------------------------------------------------------------------- few-shot and base/novel


def fewshot_sample(items, k, rng):
    """Dassl's generate_fewshot_dataset (KaiyangZhou/Dassl.pytorch, dassl/data/datasets/base_dataset.py): group by
    label in order of first appearance, rng.sample k per class; a class with fewer than k keeps all (no draw)."""
    groups = {}
    for item in items:
        groups.setdefault(item[1], []).append(item)
    return [item for g in groups.values() for item in (rng.sample(g, k) if len(g) >= k else g)]


def fewshot_split(folder, split, shots, seed, sample_val=True):
    """(train, val) with `shots` per class (val: min(shots, 4)): CoOp seeds Python's random once, then samples train
    and val from that one stream. Cached in <folder>/split_fewshot/ for exactly these lists, shots and seed."""
    source = {"train": split["train"], "val": split["val"] if sample_val else []}
    key = {"format": FEWSHOT_FORMAT, "shots": shots, "seed": seed, "split_sha256": sha256_json(source)}

    def make():
        rng = random.Random(seed)
        train = fewshot_sample(source["train"], shots, rng)
        return {"train": train, "val": fewshot_sample(source["val"], min(shots, 4), rng)}

    doc = cached(os.path.join(folder, FEWSHOT_DIR, f"shot_{shots}-seed_{seed}.json"), key, make)
    return [tuple(x) for x in doc["train"]], [tuple(x) for x in doc["val"]] if sample_val else split["val"]


def subsample_classes(train, val, test, subsample="all"):
    """CoOp's subsample_classes: of the sorted labels of train (of test for test-only sets) the first ceil(n/2) are
    base, the rest novel; the chosen labels are renumbered from 0 in every split."""
    if subsample == "all":
        return train, val, test
    labels = sorted({y for _, y, _ in train or test})
    m = math.ceil(len(labels) / 2)
    relabel = {y: i for i, y in enumerate({"base": labels[:m], "novel": labels[m:]}[subsample])}
    return tuple([(p, relabel[y], c) for p, y, c in items if y in relabel] for items in (train, val, test))


# ----------------------------------------------------------------------------- build_dataset


def dataset_folder(name, root):
    """The folder a dataset is read from: PATH of folder:PATH, else <root>/<its CoOp folder>."""
    if name.startswith("folder:"):
        return os.path.abspath(os.path.expanduser(name.removeprefix("folder:")))
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}, or folder:PATH")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), DATASETS[name].folder)


def build_dataset(name, root, shots=-1, seed=1, subsample="all"):
    """One dataset: its splits (`shots` per class when >= 1), class names in label order, template.
    subsample: all | base | novel. Test-only sets (the ImageNet variants) have no train/val and ignore shots."""
    folder, spec = dataset_folder(name, root), DATASETS.get(name, FOLDER)
    fix = f"; get it with: python data.py download {name} --root {root}" if name in DATASETS else ""
    try:
        image_dir, split = READERS[spec.reader](spec, folder)
        for p in [items[i][0] for items in split.values() if items for i in (0, -1)]:  # a half-unpacked dataset
            open(os.path.join(image_dir, p), "rb").close()
    except FileNotFoundError as e:
        raise UserError(f"{name}: {e.filename} not found{fix}") from None
    if shots >= 1 and spec.reader not in TEST_ONLY:
        split["train"], split["val"] = fewshot_split(folder, split, shots, seed, sample_val=spec.reader != "imagenet")
    renames = RENAMES.get(name, {})
    split = {s: [(os.path.join(image_dir, p), y, renames.get(c, c).replace("_", " ")) for p, y, c in split[s]]
             for s in split}  # fmt: skip
    train, val, test = subsample_classes(split["train"], split["val"], split["test"], subsample)
    if not test:
        raise UserError(f"{name} ({subsample} classes) has no test images")
    names = {}
    for _, y, c in train + val + test:
        names.setdefault(y, c)
    ds = Dataset(name, train, val, test, [names[y] for y in range(len(names))], spec.template)
    if spec.reader not in CLIP_NAMES:
        check_prompts(ds.classnames, ds.template)
    ds.warnings = dataset_warnings(ds, shots, spec.reader in TEST_ONLY)
    for w in ds.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return ds


def check_prompts(classnames, template):
    """Two classes whose prompts the tokenizer reads alike would be one class to the model."""
    from clip.tokenizer import clean_text

    seen = {}
    for c in classnames:
        prompt = clean_text(template.format(c))
        if prompt in seen:
            raise UserError(f"classes {seen[prompt]!r} and {c!r} give the same prompt {prompt!r}")
        seen[prompt] = c


def dataset_warnings(ds, shots, test_only):
    """What makes a result less than it seems."""
    out, counts = [], ds.shots_per_class
    if len(ds.classnames) == 1:
        out.append(f"{ds.name} has one class: its accuracy is 100% by construction")
    short = [k for k, n in enumerate(counts) if n < shots]
    if short and not test_only:
        n = f"{len(short)} of {len(counts)}"
        out.append(f"--shots {shots}: {n} classes have fewer images and keep all, as in CoOp ({min(counts)} at least)")
    return out


# ----------------------------------------------------------------------------- images


def to_rgb(image):
    """Any PIL image as 8-bit RGB; 16-bit grayscale is scaled by 1/257 (65535 -> 255): PIL's convert clips at 255."""
    if image.mode.startswith("I;16") or (image.mode == "I" and image.getextrema()[1] > 255):
        image = Image.fromarray(np.clip(np.round(np.asarray(image, dtype=np.float64) / 257), 0, 255).astype(np.uint8))
    return image.convert("RGB")


def train_transform(size=224, min_scale=0.5):
    """Dassl's training pipeline with MMRL's crop scale, on an RGB image."""
    import clip
    from torchvision import transforms as T

    crop = T.RandomResizedCrop(size, scale=(min_scale, 1.0), interpolation=T.InterpolationMode.BICUBIC)
    return T.Compose([crop, T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(clip.MEAN, clip.STD)])


def test_transform(size=224):
    """CLIP's preprocess, on an RGB image."""
    import clip
    from torchvision import transforms as T

    resize = T.Resize(size, interpolation=T.InterpolationMode.BICUBIC)
    return T.Compose([resize, T.CenterCrop(size), T.ToTensor(), T.Normalize(clip.MEAN, clip.STD)])


class ImageList:
    """(path, label, ...) items -> (transform(RGB image), label): a map-style dataset for torch's DataLoader."""

    def __init__(self, items, transform):
        self.items, self.transform = list(items), transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i][:2]
        with Image.open(path) as image:
            return self.transform(to_rgb(image)), label


# ----------------------------------------------------------------------------- downloads

VGG = "https://www.robots.ox.ac.uk/~vgg/data"
HF = "https://huggingface.co/datasets/torchgeo/eurosat/resolve/c877bcd43f099cd0196738f714544e355477f3fd"
DRIVE = "https://drive.usercontent.google.com/download?export=download&confirm=t&id="
NAMES = "drive:1-61f_ol79pViBFDG_IDlUQSwoLcn2XXF"  # CoOp's imagenet/classnames.txt (CLIP's names)
# (dataset, URL or drive:ID, MD5 (torchvision's tables) or "", saved as, done when this exists ("": the file itself)).
# An archive is unpacked where it is saved, then deleted. Drive IDs: CoOp's DATASETS.md.
SOURCES = [
    ("eurosat", f"{HF}/EuroSAT.zip", "c8fa014336c82ac7804f0398fcb19387", "eurosat/EuroSAT.zip", "eurosat/2750"),
    ("dtd", f"{VGG}/dtd/download/dtd-r1.0.1.tar.gz", "fff73e5086ae6bdbea199a49dfb8a4c1", "dtd-r1.0.1.tar.gz",
     "dtd/images"),
    ("oxford_pets", f"{VGG}/pets/data/images.tar.gz", "5c4f3ee8e5d25df40f4fd59a7f44e54c", "oxford_pets/images.tar.gz",
     "oxford_pets/images"),
    ("oxford_pets", f"{VGG}/pets/data/annotations.tar.gz", "95a8c909bbe2e81eed6a22bccdf3f68f",
     "oxford_pets/annotations.tar.gz", "oxford_pets/annotations"),
    ("oxford_flowers", f"{VGG}/flowers/102/102flowers.tgz", "52808999861908f626f3c1f4e79d11fa",
     "oxford_flowers/102flowers.tgz", "oxford_flowers/jpg"),
    ("oxford_flowers", f"{VGG}/flowers/102/imagelabels.mat", "e0620be6f572b9609742df49c70aed4d",
     "oxford_flowers/imagelabels.mat", ""),
    ("oxford_flowers", "drive:1AkcxCXeK_RCGCEC_GvmWxjcjaNhu-at0", "", "oxford_flowers/cat_to_name.json", ""),
    ("food101", "http://data.vision.ee.ethz.ch/cvl/food-101.tar.gz", "85eeb15f3717b99a5da872d97d918f87",
     "food-101.tar.gz", "food-101/images"),
    ("fgvc_aircraft", f"{VGG}/fgvc-aircraft/archives/fgvc-aircraft-2013b.tar.gz", "", "fgvc-aircraft-2013b.tar.gz",
     "fgvc_aircraft/variants.txt"),
    ("sun397", "http://vision.princeton.edu/projects/2010/SUN/SUN397.tar.gz", "8ca2778205c41d23104230ba66911c7a",
     "sun397/SUN397.tar.gz", "sun397/SUN397"),
    ("ucf101", "drive:10Jqome3vtUA2keJkNanAiFpgbyC9Hc2O", "", "ucf101/UCF-101-midframes.zip",
     "ucf101/UCF-101-midframes"),
    ("imagenet", NAMES, "", "imagenet/classnames.txt", ""),
    ("imagenetv2", "https://s3-us-west-2.amazonaws.com/imagenetv2public/imagenetv2-matched-frequency.tar.gz", "",
     "imagenetv2/imagenetv2-matched-frequency.tar.gz", "imagenetv2/imagenetv2-matched-frequency-format-val"),
    ("imagenetv2", NAMES, "", "imagenetv2/classnames.txt", ""),
    ("imagenet_sketch", NAMES, "", "imagenet-sketch/classnames.txt", ""),
    ("imagenet_a", "https://people.eecs.berkeley.edu/~hendrycks/imagenet-a.tar", "",
     "imagenet-adversarial/imagenet-a.tar", "imagenet-adversarial/imagenet-a"),
    ("imagenet_a", NAMES, "", "imagenet-adversarial/classnames.txt", ""),
    ("imagenet_r", "https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar", "",
     "imagenet-rendition/imagenet-r.tar", "imagenet-rendition/imagenet-r"),
    ("imagenet_r", NAMES, "", "imagenet-rendition/classnames.txt", ""),
]  # fmt: skip
SPLITS = {  # Drive IDs of CoOp's split files (DATASETS.md)
    "caltech101": "1hyarUivQE36mY6jSomru6Fjd-JzwcCzN",
    "oxford_pets": "1501r8Ber4nNKvmlFVQZ8SeUHTcdTTEqs",
    "stanford_cars": "1ObCFbaAgVu0I-k_Au-gIUcefirdAuizT",
    "oxford_flowers": "1Pp0sRXzZFZq15zVOzKjKBu4A9i01nozT",
    "food101": "1QK0tGi096I0Ba6kggatX1ee6dJFIcEJl",
    "sun397": "1y2RD81BYuiyvebdN-JymPfyWYcd8_MUq",
    "dtd": "1u3_QfB467jqHgNXC00UIzbLZRQCg2S7x",
    "eurosat": "1Ip7yaCWFi0eaOFUGga0lUdVi_DDQth1o",
    "ucf101": "1I0S0q91hJfsV9Gf4xDIjgDq4AqBNJb1y",
}
MANUAL = {  # images without a stable public URL
    "imagenet": "ImageNet from https://image-net.org into imagenet/images/{train,val}/<wnid>/",
    "imagenet_sketch": "https://github.com/HaohanWang/ImageNet-Sketch into imagenet-sketch/images/<wnid>/",
    "caltech101": "101_ObjectCategories.tar.gz (in caltech-101.zip of https://data.caltech.edu/records/mzrjq-6wc02) "
    "into caltech-101/101_ObjectCategories/",
    "stanford_cars": "cars_train/, cars_test/ into stanford_cars/ (the original links are dead: KaiyangZhou/CoOp#61)",
    "toyworld": "python toyworld.py dataset --root DATA",
}
ARCHIVES = (".zip", ".tar", ".tar.gz", ".tgz")


def fetch(url, md5, path):
    """Download url to path, checked against its MD5 when known. A Drive file that Google holds back (no answer, or
    a web page instead of the file: quota, region) is left to fetch by hand, as CoOp's DATASETS.md says."""
    from torchvision.datasets.utils import download_url

    folder, file = os.path.split(path)
    if not url.startswith("drive:"):
        try:
            download_url(url, folder, file, md5 or None)
        except RuntimeError:  # download_url's MD5 check
            raise UserError(f"{path} does not have the MD5 {md5} of {url}: run the command again") from None
        return True
    file_id = url.removeprefix("drive:")
    try:
        download_url(DRIVE + file_id, folder, file)
        with open(path, "rb") as f:
            if f.read(1) != b"<":
                return True
        os.remove(path)
    except OSError:
        pass
    print(f"fetch by hand: https://drive.google.com/file/d/{file_id}/view and save it as {path}", file=sys.stderr)
    return False


def download(name, root):
    """Fetch and unpack what has a public URL for one dataset; say what to fetch by hand."""
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    root = os.path.abspath(os.path.expanduser(root))
    spec, rows = DATASETS[name], [s[1:] for s in SOURCES if s[0] == name]
    if name in SPLITS:
        rows.append((f"drive:{SPLITS[name]}", "", f"{spec.folder}/split_zhou_{spec.coop}.json", ""))
    for url, md5, path, done in rows:
        path, done = os.path.join(root, path), os.path.join(root, done or path)
        unpacking = done != path and os.path.exists(path)  # an archive left by an interrupted unpack
        if os.path.exists(done) and not unpacking:
            continue
        print(f"fetching {url} -> {path}", file=sys.stderr)
        if not fetch(url, md5, path) or not path.endswith(ARCHIVES):
            continue
        try:  # tar: PEP 706's "data" filter refuses absolute names, links out of the target and devices; zip takes
            # no filter (Python docs), and its unpacker skips absolute and '..' names
            shutil.unpack_archive(path, os.path.dirname(path), filter=None if path.endswith(".zip") else "data")
        except Exception:  # a cut-off or damaged archive: the next run downloads it again
            os.remove(path)
            raise
        os.remove(path)
        if name == "fgvc_aircraft":  # the archive's fgvc-aircraft-2013b/data is CoOp's fgvc_aircraft/
            os.replace(os.path.join(root, "fgvc-aircraft-2013b", "data"), os.path.join(root, "fgvc_aircraft"))
    if name in MANUAL:
        print(f"by hand: {MANUAL[name]} (under {root})", file=sys.stderr)


# ----------------------------------------------------------------------------- CLI


def positive(text):
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text} is not >= 1")
    return int(text)


def check(name, root, shots, seed, subsample, open_images):
    ds = build_dataset(name, root, shots, seed, subsample)
    print(f"{name}: {dataset_folder(name, root)}")
    print(
        f"  {len(ds.classnames)} classes ({subsample}), train {len(ds.train)}, val {len(ds.val)}, test {len(ds.test)}"
    )
    print(f"  prompt: {ds.template.format(ds.classnames[0])}")
    if open_images:
        paths = list(dict.fromkeys(p for p, _, _ in ds.train + ds.val + ds.test))
        for path in paths:
            with Image.open(path) as image:
                to_rgb(image)  # decodes it
        print(f"  opened {len(paths)} images")


def main(argv=None):
    epilog = f"datasets: {', '.join(DATASETS)}, or folder:PATH (one sub-folder per class)"
    parser = argparse.ArgumentParser(
        description="Check or download the CoOp datasets (DATASETS.md layout).", epilog=epilog
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check_p = sub.add_parser("check", help="read datasets and print a summary of each")
    check_p.add_argument("--shots", type=positive, default=-1, help="training images per class (default: all)")
    check_p.add_argument("--seed", type=int, default=1)
    check_p.add_argument("--subsample", choices=["all", "base", "novel"], default="all")
    check_p.add_argument("--open", action="store_true", help="also open every image")
    down_p = sub.add_parser("download", help="download datasets into --root")
    for p in (check_p, down_p):
        p.add_argument("names", nargs="+", metavar="NAME")
        p.add_argument("--root", default="data", help="the folder that holds the datasets (default: data)")
    args = parser.parse_args(argv)
    failed = False
    for name in args.names:  # each dataset's error, so that one run names all that is missing
        try:
            if args.command == "check":
                check(name, args.root, args.shots, args.seed, args.subsample, args.open)
            else:
                download(name, args.root)
        except (UserError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

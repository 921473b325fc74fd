"""The CoOp benchmark datasets, read from the folders researchers already have.

Point --root at the folder that holds the datasets in the layout of CoOp's DATASETS.md
(imagenet/, caltech-101/, oxford_pets/, eurosat/, ...). Each dataset is a list of items
(path, label, classname) per split, read from the published split files:

    split_zhou_<Name>.json = {"train": [[relative path, label, classname], ...], "val":
    [...], "test": [...]}

Few-shot subsets are the ones CoOp/Dassl draw for the same seed (see `fewshot_sample`), cached as
portable JSON in <dataset folder>/split_fewshot/shot_{K}-seed_{S}.json. Base/novel classes follow
CoOp's `subsample_classes`. A folder:PATH dataset is split once (`read_folder`); the split is kept
in PATH/split_folder.json, or under `cache_dir()` when PATH is read-only, and a folder that changed
since is refused. Transforms are Dassl's / CLIP's (16-bit images scaled to 8 bit). `python data.py
--help` shows the CLI; `check` also opens every image.

Used by dear.py, train.py, runs.py, entropy.py and toyworld.py (and run_all.sh's dataset check). It
imports util.py, and download.py for `python data.py download`; it knows nothing of the toy world,
which toyworld.py writes in the CoOp layout and data.py then reads like any other dataset.
"""

import argparse
import dataclasses
import difflib
import hashlib
import math
import os
import random
import re
import sys
import time

import numpy as np
from PIL import Image

from util import fingerprint, progress, read_json, write_json_atomic

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
CHECK_LIMIT = 1000  # paths per split checked up front; the rest fail clearly when loaded
CUSTOM_SPLIT_SEED = 1  # folder:PATH datasets are split once, with this seed, and the split is kept
FOLDER_SPLIT = "split_folder.json"
FEWSHOT_FORMAT = "dear-fewshot/1"
FEWSHOT_DIR = "split_fewshot"  # the few-shot cache's folder, beside a dataset's split
IMAGENET_FORMAT = "dear-imagenet/1"
COOP_GUIDE = "https://github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md"


class DataError(Exception):
    """Bad data on disk or bad arguments; the message says what is wrong and how to fix it.

    A DataLoader worker's DataError comes back to the main process rebuilt from torch's text
    "Caught DataError in DataLoader worker process 0.\nOriginal Traceback ...\ndata.DataError:
    <message>"; only <message> is kept, so the user sees one clear line naming the file, not the
    worker's traceback."""

    def __init__(self, message=""):
        if (
            isinstance(message, str)
            and message.startswith("Caught DataError")
            and "Traceback" in message
        ):
            message = re.split(r"^(?:\w+\.)*DataError: ", message, flags=re.M)[-1].strip()
        super().__init__(message)


# ----------------------------------------------------------------------------- the dataset table

CALTECH_RENAMES = {
    "airplanes": "airplane",
    "Faces": "face",
    "Leopards": "leopard",
    "Motorbikes": "motorbike",
}
EUROSAT_RENAMES = {  # folder -> name CoOp uses (the published split JSON already stores these)
    "AnnualCrop": "Annual Crop Land",
    "Forest": "Forest",
    "HerbaceousVegetation": "Herbaceous Vegetation Land",
    "Highway": "Highway or Road",
    "Industrial": "Industrial Buildings",
    "Pasture": "Pasture Land",
    "PermanentCrop": "Permanent Crop Land",
    "Residential": "Residential Buildings",
    "River": "River",
    "SeaLake": "Sea or Lake",
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """Where one dataset sits under --root and how to read it."""

    name: str  # CLI name
    coop_name: str  # CoOp's DATASET.NAME
    folder: str  # dataset folder under --root
    images: str  # split paths are relative to <folder>/<images> ("" = the folder itself)
    split: str  # split file name ("" for readers with their own files)
    template: str  # the hand-written prompt template, one '{}'
    reader: str = "json"  # json | fgvc | imagenet | variant | v2 | toyworld | folder
    drive: str = ""  # Google Drive id of the split JSON (CoOp DATASETS.md)
    # class-name clean-up applied after reading
    renames: dict = dataclasses.field(default_factory=dict)
    test_only: bool = False

    def layout(self):
        """The expected files, for error messages."""
        f = self.folder
        if self.reader == "fgvc":
            return f"{f}/images/*.jpg, {f}/variants.txt, {f}/images_variant_{{train,val,test}}.txt"
        if self.reader == "imagenet":
            return (
                f"{f}/images/train/<wnid>/*.JPEG, {f}/images/val/<wnid>/*.JPEG, {f}/classnames.txt"
            )
        if self.reader == "v2":
            return (
                f"{f}/{self.images}/{{0..999}}/*.jpeg, {f}/classnames.txt (copied from imagenet/)"
            )
        if self.reader == "variant":
            return f"{f}/{self.images}/<wnid>/*, {f}/classnames.txt (copied from imagenet/)"
        if self.reader == "folder":
            return f"{f}/<class name>/<image files>"
        images = (
            f"{f}/{self.images}/..." if self.images else f"{f}/cars_train/..., {f}/cars_test/..."
        )
        return f"{images} images, {f}/{self.split}"


PHOTO = "a photo of a {}."
SPECS = [
    Spec("imagenet", "ImageNet", "imagenet", "images", "", PHOTO, reader="imagenet"),
    Spec(
        "caltech101",
        "Caltech101",
        "caltech-101",
        "101_ObjectCategories",
        "split_zhou_Caltech101.json",
        PHOTO,
        drive="1hyarUivQE36mY6jSomru6Fjd-JzwcCzN",
        renames=CALTECH_RENAMES,
    ),
    Spec(
        "oxford_pets",
        "OxfordPets",
        "oxford_pets",
        "images",
        "split_zhou_OxfordPets.json",
        "a photo of a {}, a type of pet.",
        drive="1501r8Ber4nNKvmlFVQZ8SeUHTcdTTEqs",
    ),
    Spec(
        "stanford_cars",
        "StanfordCars",
        "stanford_cars",
        "",
        "split_zhou_StanfordCars.json",
        PHOTO,
        drive="1ObCFbaAgVu0I-k_Au-gIUcefirdAuizT",
    ),
    Spec(
        "oxford_flowers",
        "OxfordFlowers",
        "oxford_flowers",
        "jpg",
        "split_zhou_OxfordFlowers.json",
        "a photo of a {}, a type of flower.",
        drive="1Pp0sRXzZFZq15zVOzKjKBu4A9i01nozT",
    ),
    Spec(
        "food101",
        "Food101",
        "food-101",
        "images",
        "split_zhou_Food101.json",
        "a photo of {}, a type of food.",
        drive="1QK0tGi096I0Ba6kggatX1ee6dJFIcEJl",
    ),
    Spec(
        "fgvc_aircraft",
        "FGVCAircraft",
        "fgvc_aircraft",
        "images",
        "",
        "a photo of a {}, a type of aircraft.",
        reader="fgvc",
    ),
    Spec(
        "sun397",
        "SUN397",
        "sun397",
        "SUN397",
        "split_zhou_SUN397.json",
        PHOTO,
        drive="1y2RD81BYuiyvebdN-JymPfyWYcd8_MUq",
    ),
    Spec(
        "dtd",
        "DescribableTextures",
        "dtd",
        "images",
        "split_zhou_DescribableTextures.json",
        "{} texture.",
        drive="1u3_QfB467jqHgNXC00UIzbLZRQCg2S7x",
    ),
    Spec(
        "eurosat",
        "EuroSAT",
        "eurosat",
        "2750",
        "split_zhou_EuroSAT.json",
        "a centered satellite photo of {}.",
        drive="1Ip7yaCWFi0eaOFUGga0lUdVi_DDQth1o",
        renames=EUROSAT_RENAMES,
    ),
    Spec(
        "ucf101",
        "UCF101",
        "ucf101",
        "UCF-101-midframes",
        "split_zhou_UCF101.json",
        "a photo of a person doing {}.",
        drive="1I0S0q91hJfsV9Gf4xDIjgDq4AqBNJb1y",
    ),
    Spec(
        "imagenetv2",
        "ImageNetV2",
        "imagenetv2",
        "imagenetv2-matched-frequency-format-val",
        "",
        PHOTO,
        reader="v2",
        test_only=True,
    ),
    Spec(
        "imagenet_sketch",
        "ImageNetSketch",
        "imagenet-sketch",
        "images",
        "",
        PHOTO,
        reader="variant",
        test_only=True,
    ),
    Spec(
        "imagenet_a",
        "ImageNetA",
        "imagenet-adversarial",
        "imagenet-a",
        "",
        PHOTO,
        reader="variant",
        test_only=True,
    ),
    Spec(
        "imagenet_r",
        "ImageNetR",
        "imagenet-rendition",
        "imagenet-r",
        "",
        PHOTO,
        reader="variant",
        test_only=True,
    ),
    Spec(
        "toyworld",
        "ToyWorld",
        "toyworld",
        "images",
        "split_zhou_ToyWorld.json",
        PHOTO,
        reader="toyworld",
    ),
]
DATASETS = {s.name: s for s in SPECS}
B2N_DATASETS = (
    "imagenet",
    "caltech101",
    "oxford_pets",
    "stanford_cars",
    "oxford_flowers",
    "food101",
    "fgvc_aircraft",
    "sun397",
    "dtd",
    "eurosat",
    "ucf101",
)
DG_TARGETS = ("imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r")
CLASSNAMES_DRIVE = "1-61f_ol79pViBFDG_IDlUQSwoLcn2XXF"  # imagenet/classnames.txt (CLIP's names)


@dataclasses.dataclass
class Dataset:
    """One dataset: items are (path, label, classname);
    classnames[label] is the name put in the template."""

    name: str
    train: list
    val: list
    test: list
    classnames: list
    template: str
    folder: str = ""
    split_file: str = ""  # folder:PATH datasets: where their split is kept
    # also printed when the dataset is built
    warnings: list = dataclasses.field(default_factory=list)

    @property
    def num_classes(self):
        return len(self.classnames)

    @property
    def shots_per_class(self):
        """Training images per class (index = label): the real shots, which are fewer than --shots
        for a class that has fewer images (CoOp keeps all of them)."""
        counts = [0] * self.num_classes
        for _, y, _ in self.train:
            counts[y] += 1
        return counts


def list_images(folder):
    """Image file names in a folder, sorted (so the order is the same on every machine)."""
    return sorted(
        f
        for f in os.listdir(folder)
        if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)
    )


def list_dirs(folder):
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def need(path, what, spec, hint=""):
    """Stop with one clear message when a file or folder the reader needs is missing."""
    if not os.path.exists(path):
        raise DataError(
            f"{what} not found: {path}\nExpected layout under --root: {spec.layout()}\n"
            f"{hint or 'See ' + COOP_GUIDE}"
        )


def download_hint(spec, root):
    hint = f"Get it with: python data.py download {spec.name} --root {root}"
    if spec.drive:
        hint += (
            f"\nor fetch it by hand from https://drive.google.com/file/d/{spec.drive}/view"
            f" and save it as {os.path.join(root, spec.folder, spec.split)}"
        )
    return hint


# ----------------------------------------------------------------------------- readers
# Each reader returns (image_dir, {"train": [...], "val": [...], "test": [...]}) with items
# (relative path, label, raw classname); build_dataset joins the paths and cleans the names.


def read_split_json(path, fix=""):
    """A CoOp split file: {"train"/"val"/"test": [[relative path, label, classname], ...]}.
    fix: what to do about a broken one (default: download it again, the fix for CoOp's files)."""
    fix = fix or f"download it again (see {COOP_GUIDE})"
    data = read_json(path)
    if data is None:
        raise DataError(
            f"split file {path} is not valid JSON (cut off, or an HTML page saved in "
            f"its place?); {fix}"
        )
    out = {}
    try:
        for key in ("train", "val", "test"):
            out[key] = [(str(p), int(y), str(c)) for p, y, c in data[key]]
    except (TypeError, KeyError, ValueError) as e:
        raise DataError(
            f"malformed split file {path} ({type(e).__name__}: {e}); expected a JSON "
            f"object with 'train', 'val', 'test' lists of [relative path, label, "
            f"classname]; {fix}"
        ) from None
    return out


def read_json_dataset(spec, folder, root):
    need(folder, f"{spec.coop_name} folder", spec)
    path = os.path.join(folder, spec.split)
    need(path, f"{spec.coop_name} split file", spec, download_hint(spec, root))
    return os.path.join(folder, spec.images), read_split_json(path)


def read_fgvc(spec, folder, root):
    """FGVCAircraft: label = line index in variants.txt;
    images_variant_<split>.txt lines are '<id> <variant>'."""
    need(folder, "FGVCAircraft folder", spec)
    need(os.path.join(folder, "variants.txt"), "FGVCAircraft variants.txt", spec)
    with open(os.path.join(folder, "variants.txt")) as f:
        variants = [line.strip() for line in f if line.strip()]
    label_of = {v: i for i, v in enumerate(variants)}
    split = {}
    for key in ("train", "val", "test"):
        path = os.path.join(folder, f"images_variant_{key}.txt")
        need(path, "FGVCAircraft split file", spec)
        split[key] = []
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                image_id, variant = line.strip().split(" ", 1)
                if variant not in label_of:
                    raise DataError(
                        f"{path}: variant '{variant}' is not in variants.txt; the files come from "
                        f"different releases (use fgvc-aircraft-2013b/data for both)."
                    )
                split[key].append((image_id + ".jpg", label_of[variant], variant))
    return os.path.join(folder, "images"), split


def read_classnames(path, spec):
    """classnames.txt: '<wnid> <class name with spaces>' per line, in sorted-wnid order."""
    need(
        path,
        "classnames.txt",
        spec,
        f"Download it from https://drive.google.com/file/d/{CLASSNAMES_DRIVE}/view "
        f"(CoOp DATASETS.md) and save it as {path}",
    )
    names = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                wnid, _, name = line.strip().partition(" ")
                names[wnid] = name
    return names


def list_wnid_folders(image_dir, names, spec, prefix="", what=""):
    """Items of every sorted class folder, label = index in that order (CoOp's rule); files sorted
    by name. Paths are prefix + '<wnid>/<file>'; `what` turns on a progress line."""
    items, folders, t0 = [], list_dirs(image_dir), time.time()
    for label, wnid in enumerate(folders):
        if wnid not in names:
            raise DataError(
                f"folder {os.path.join(image_dir, wnid)} has no entry in classnames.txt; "
                f"expected layout: {spec.layout()}"
            )
        items += [
            (f"{prefix}{wnid}/{im}", label, names[wnid])
            for im in list_images(os.path.join(image_dir, wnid))
        ]
        if what and ((label + 1) % 50 == 0 or label + 1 == len(folders)):
            progress(what, label + 1, len(folders), t0)
    return items


def read_imagenet(spec, folder, root):
    """ImageNet: labels by sorted wnid folder; the official val set is the test (and val) set.

    The file list is cached in preprocessed.json (relative paths). Unlike Dassl (os.listdir order),
    files are sorted by name within each class folder, so few-shot subsets are the same on every
    machine."""
    need(folder, "ImageNet folder", spec)
    names_path = os.path.join(folder, "classnames.txt")
    names = read_classnames(names_path, spec)
    with open(names_path, "rb") as f:
        names_sha = hashlib.sha256(f.read()).hexdigest()
    image_dir, cache_path = (
        os.path.join(folder, "images"),
        os.path.join(folder, "preprocessed.json"),
    )
    cache = read_json(cache_path)
    if not (
        isinstance(cache, dict)
        and cache.get("format") == IMAGENET_FORMAT
        and cache.get("classnames_sha256") == names_sha
    ):
        cache = {"format": IMAGENET_FORMAT, "classnames_sha256": names_sha}
        for key in ("train", "val"):
            need(os.path.join(image_dir, key), f"ImageNet {key} folder", spec)
            cache[key] = list_wnid_folders(
                os.path.join(image_dir, key),
                names,
                spec,
                prefix=f"{key}/",
                what=f"listing ImageNet {key}",
            )
        write_json_atomic(cache_path, cache)
    test = [tuple(x) for x in cache["val"]]
    return image_dir, {"train": [tuple(x) for x in cache["train"]], "val": test, "test": test}


def read_variant(spec, folder, root):
    """ImageNet-Sketch/-A/-R: sorted wnid folders (A and R hold 200 of the 1000),
    names from classnames.txt."""
    need(folder, f"{spec.coop_name} folder", spec)
    names = read_classnames(os.path.join(folder, "classnames.txt"), spec)
    image_dir = os.path.join(folder, spec.images)
    need(image_dir, f"{spec.coop_name} image folder", spec)
    return image_dir, {"train": [], "val": [], "test": list_wnid_folders(image_dir, names, spec)}


def read_v2(spec, folder, root):
    """ImageNetV2: folder k holds class k, the k-th line of classnames.txt."""
    need(folder, "ImageNetV2 folder", spec)
    wnids = list(read_classnames(os.path.join(folder, "classnames.txt"), spec).items())
    image_dir = os.path.join(folder, spec.images)
    need(image_dir, "ImageNetV2 image folder", spec)
    test = []
    for k in sorted((int(d) for d in list_dirs(image_dir) if d.isdigit())):
        if k >= len(wnids):
            raise DataError(
                f"{image_dir}/{k} has no line {k} in "
                f"classnames.txt; expected layout: {spec.layout()}"
            )
        test += [
            (f"{k}/{im}", k, wnids[k][1]) for im in list_images(os.path.join(image_dir, str(k)))
        ]
    return image_dir, {"train": [], "val": [], "test": test}


def cache_dir():
    """Where data.py keeps what it cannot keep beside a dataset: $DEAR_CACHE, else ~/.cache/dear."""
    return os.path.abspath(
        os.path.expanduser(os.environ.get("DEAR_CACHE") or os.path.join("~", ".cache", "dear"))
    )


def folder_cache(folder):
    """The cache folder of a folder:PATH dataset, keyed by its resolved path (two folders named pets
    differ)."""
    real = os.path.realpath(folder)
    key = hashlib.sha256(real.encode()).hexdigest()[:12]
    return os.path.join(cache_dir(), "folders", f"{os.path.basename(real) or 'root'}-{key}")


def folder_split_file(folder):
    """The split file of a folder dataset: PATH/split_folder.json, else the cache's;
    None before the first run."""
    for path in (
        os.path.join(folder, FOLDER_SPLIT),
        os.path.join(folder_cache(folder), FOLDER_SPLIT),
    ):
        if os.path.isfile(path):
            return path
    return None


def list_class_folders(folder):
    """{class folder: its image paths relative to folder, sorted}. split_fewshot/ is the few-shot
    cache (`fewshot_split`), so no class may have that name: one holding images is refused."""
    listing = {
        c: [f"{c}/{im}" for im in list_images(os.path.join(folder, c))] for c in list_dirs(folder)
    }
    if listing.pop(FEWSHOT_DIR, None):
        raise DataError(
            f"{os.path.join(folder, FEWSHOT_DIR)} holds images, but {FEWSHOT_DIR} is "
            f"the name of the few-shot cache's folder, not a class name data.py can "
            f"use: rename that class folder (e.g. to {FEWSHOT_DIR}_class; the '_' reads "
            f"as a space in its class name)"
        )
    return listing


def nested_images(class_dir):
    """Image files in the sub-folders of a class folder (any depth): paths relative to class_dir."""
    out = []
    for top in list_dirs(class_dir):
        for here, dirs, files in os.walk(os.path.join(class_dir, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            out += [
                os.path.relpath(os.path.join(here, f), class_dir)
                for f in sorted(files)
                if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)
            ]
    return out


def some(paths, n=3):
    """The first n paths, ", "-joined, with ", ..." when there are more."""
    return ", ".join(paths[:n]) + (", ..." if len(paths) > n else "")


def nested_warning(folder, listing):
    """A warning naming the images in sub-folders of class folders (they are not read), or ""."""
    nested = [os.path.join(c, p) for c in listing for p in nested_images(os.path.join(folder, c))]
    if not nested:
        return ""
    return (
        f"{len(nested)} image(s) in sub-folders of the class folders of {folder} are left out "
        f"({some(nested)}): a class is the images directly in its folder; move them up into it "
        f"to use them"
    )


def bad_entry(path):
    """Why a listed image path is not a readable file ("a broken symbolic link (to X)", "a folder,
    not an image file", "missing"), or "" when it is one."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"a broken symbolic link (to {os.readlink(path)})"
    if os.path.isdir(path):
        return "a folder, not an image file"
    return "" if os.path.isfile(path) else "missing"


def check_entries(folder, listing):
    """Stop, naming them, when listed image names are broken links or folders (x.png/): a new split
    would list them and fail on each run."""
    bad = [
        (p, why)
        for paths in listing.values()
        for p in paths
        for why in [bad_entry(os.path.join(folder, p))]
        if why
    ]
    if bad:
        named = "; ".join(f"{os.path.join(folder, p)} is {why}" for p, why in bad[:3])
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise DataError(
            f"{len(bad)} entries of {folder} have image names but are not image files: "
            f"{named}{more}. Fix or remove them, then run again"
        )


def class_counts(folder, listing):
    """Stop when class folders have fewer than 2 images (one to train on, one to test on), naming
    them; say where the images of an empty one are when they sit in sub-folders."""
    small = [(c, len(images)) for c, images in listing.items() if len(images) < 2]
    for c, n in small:
        path, nested = os.path.join(folder, c), nested_images(os.path.join(folder, c))
        if n == 0 and nested:
            raise DataError(
                f"class folder {path} holds no images directly; its {len(nested)} "
                f"image(s) are in sub-folders ({some(nested)}): move them up into "
                f"{path}, one folder per class"
            )
    if small:
        counts = some([f"{c}: {n}" for c, n in small], 5)
        raise DataError(
            f"{len(small)} class folder(s) of {folder} hold fewer than 2 images "
            f"({counts}; images are {', '.join(IMAGE_EXTENSIONS)}); a folder dataset "
            f"needs at least 2 per class (one to train on, one to test on): add images, "
            f"or remove those folders"
        )


def check_folder_unchanged(folder, path, split, listing):
    """Stop when the class folders or images on disk differ from those the kept split lists."""
    stored = {p for items in split.values() for p, _, _ in items}
    now = {p for paths in listing.values() for p in paths}
    old_classes = {c for items in split.values() for _, _, c in items}
    added, removed = sorted(now - stored), sorted(stored - now)
    new_classes, gone_classes = (
        sorted(set(listing) - old_classes),
        sorted(old_classes - set(listing)),
    )
    if not (added or removed or new_classes or gone_classes):
        return

    def some(paths):
        return ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")

    changes = (
        ([f"class folders added: {some(new_classes)}"] if new_classes else [])
        + ([f"class folders gone: {some(gone_classes)}"] if gone_classes else [])
        + ([f"{len(added)} image(s) added ({some(added)})"] if added else [])
        + ([f"{len(removed)} image(s) gone ({some(removed)})"] if removed else [])
    )
    only_removed = removed and not (added or new_classes or gone_classes)
    raise DataError(
        f"{folder} no longer matches its split {path}: {'; '.join(changes)}.\nThe split was drawn "
        f"once (seed {CUSTOM_SPLIT_SEED}) and is kept so that results stay comparable. Restore the "
        f"folder as it was, or delete {path} to split the folder anew (a new shuffle: results from "
        "before and after are not comparable)"
        + (
            ", or delete the gone images' entries from it to keep the rest of the split"
            if only_removed
            else ""
        )
        + "."
    )


def write_folder_split(folder, split):
    """Keep the split in PATH/split_folder.json, or in the cache when PATH cannot be written;
    return where."""
    path = os.path.join(folder, FOLDER_SPLIT)
    try:
        write_json_atomic(path, split, indent=4)
        return path
    except OSError as e:
        fallback = os.path.join(folder_cache(folder), FOLDER_SPLIT)
        try:
            write_json_atomic(fallback, split, indent=4)
        except OSError as e2:
            raise DataError(
                f"cannot keep the split of {folder}: neither {path} ({e.strerror or e}) nor "
                f"{fallback} ({e2.strerror or e2}) can be written; set $DEAR_CACHE to a writable "
                "folder"
            ) from None
        print(
            f"note: {folder} is not writable ({e.strerror or e}); its split is kept in {fallback}",
            file=sys.stderr,
        )
        return fallback


def read_folder(spec, folder, root):
    """folder:PATH: one sub-folder per class; split 50/20/30 per class once (seed CUSTOM_SPLIT_SEED)
    and kept (`folder_split_file`); a folder whose classes or images changed since is refused
    (`check_folder_unchanged`)."""
    if not os.path.isdir(folder):
        raise DataError(f"folder dataset not found: {folder}\nExpected layout: {spec.layout()}")
    listing = list_class_folders(folder)
    path = folder_split_file(folder)
    if path:
        split = read_split_json(path, fix=f"delete {path} to split the folder anew (a new shuffle)")
        check_folder_unchanged(folder, path, split, listing)
        return folder, split
    if not listing:
        raise DataError(f"{folder} has no class sub-folders.\nExpected layout: {spec.layout()}")
    class_counts(folder, listing)
    check_entries(folder, listing)
    rng, split = random.Random(CUSTOM_SPLIT_SEED), {"train": [], "val": [], "test": []}
    for label, (c, images) in enumerate(listing.items()):
        images = list(images)
        rng.shuffle(images)
        n_train = max(1, round(0.5 * len(images)))
        n_val = min(round(0.2 * len(images)), len(images) - n_train - 1)  # >= 1 test image
        for key, part in (
            ("train", images[:n_train]),
            ("val", images[n_train : n_train + n_val]),
            ("test", images[n_train + n_val :]),
        ):
            split[key] += [(p, label, c) for p in part]
    path = write_folder_split(folder, split)
    print(f"wrote the {len(listing)}-class split of {folder} to {path}", file=sys.stderr)
    return folder, split


READERS = {
    "json": read_json_dataset,
    "toyworld": read_json_dataset,
    "fgvc": read_fgvc,
    "imagenet": read_imagenet,
    "variant": read_variant,
    "v2": read_v2,
    "folder": read_folder,
}


# -------------------------------------------------------------------------- few-shot and base/novel


def fewshot_sample(items, k, rng):
    """Dassl's generate_fewshot_dataset: group by label in first-appearance order, then per class
    rng.sample(group, k); a class with fewer than k items keeps all of them (no rng call)."""
    groups = {}
    for item in items:
        groups.setdefault(item[1], []).append(item)
    out = []
    for group in groups.values():
        out += rng.sample(group, k) if len(group) >= k else group
    return out


def fewshot_split(folder, split, shots, seed, sample_val=True):
    """(train, val) with `shots` per class (val: min(shots, 4)),
    the same subsets as CoOp for this seed.

    CoOp seeds Python's random with the seed, then samples train and val in that order from one
    stream; random.Random(seed) is that stream without touching the global one. The result is cached
    as JSON (relative paths) and reused only when it was drawn from exactly these train and val
    lists, with these shots and this seed (a file copied under another name is not taken for another
    draw)."""
    source = {"train": split["train"], "val": split["val"] if sample_val else []}
    sha = fingerprint(source)
    path = os.path.join(folder, FEWSHOT_DIR, f"shot_{shots}-seed_{seed}.json")
    cache = read_json(path)
    drawn = {"format": FEWSHOT_FORMAT, "shots": shots, "seed": seed, "split_sha256": sha}
    if isinstance(cache, dict) and all(cache.get(k) == v for k, v in drawn.items()):
        train = [tuple(x) for x in cache["train"]]
        return train, ([tuple(x) for x in cache["val"]] if sample_val else split["val"])
    rng = random.Random(seed)
    train = fewshot_sample(split["train"], shots, rng)
    val = fewshot_sample(split["val"], min(shots, 4), rng) if sample_val else split["val"]
    cache = {
        "format": FEWSHOT_FORMAT,
        "shots": shots,
        "seed": seed,
        "split_sha256": sha,
        "train": train,
        "val": val if sample_val else [],
    }
    try:
        write_json_atomic(path, cache)
    except (
        OSError
    ) as e:  # a read-only dataset folder: sampling is cheap, so go on without the cache
        print(f"note: could not cache the few-shot subset at {path} ({e})", file=sys.stderr)
    return train, val


def subsample_classes(train, val, test, subsample="all"):
    """CoOp's base/novel split: sorted labels of `train` (of `test` for test-only sets), the first
    ceil(n/2) are base, the rest novel; the chosen labels are renumbered from 0 in every split."""
    if subsample == "all":
        return train, val, test
    labels = sorted({y for _, y, _ in (train or test)})
    m = math.ceil(len(labels) / 2)
    selected = labels[:m] if subsample == "base" else labels[m:]
    relabel = {y: i for i, y in enumerate(selected)}
    return tuple(
        [(p, relabel[y], c) for p, y, c in items if y in relabel] for items in (train, val, test)
    )


def check_files(items, what, spec):
    """Check that a deterministic, evenly spaced sample (<= CHECK_LIMIT) of the listed images
    exists.

    Checking all 1.3M ImageNet paths takes minutes on network disks; the unchecked rest fail with a
    DataError naming the file when the loader reaches them."""
    for path, _, _ in items[:: max(1, len(items) // CHECK_LIMIT)]:
        if not os.path.isfile(path):
            why = bad_entry(path)
            if why != "missing":  # a broken link or a folder: splitting anew would list it again
                raise DataError(
                    f"image listed in the {what} split is {why}: {path}; fix it, or "
                    f"remove it (and its entry from the split file)"
                )
            if spec.reader == "folder":  # your own folder: no download to redo
                raise DataError(
                    f"image listed in the {what} split is missing on disk: {path}; restore it, or "
                    f"split the folder anew by deleting {spec.split} (a new shuffle)"
                )
            raise DataError(
                f"image listed in the {what} split is missing on disk: {path}\n"
                f"Expected layout under --root: {spec.layout()} (an incomplete download or "
                f"extraction? re-extract the images, see {COOP_GUIDE})"
            )


def suggest(name):
    """An unknown-name message with the closest known names."""
    aliases = {s.coop_name.lower(): s.name for s in SPECS}
    aliases.update({s.folder.lower(): s.name for s in SPECS})
    key = name.lower().replace("-", "_")
    if key in aliases or key in DATASETS:
        close = [aliases.get(key, key)]
    else:
        close = [
            aliases.get(c, c)
            for c in difflib.get_close_matches(key, list(DATASETS) + list(aliases), n=3)
        ]
    hint = f" Did you mean: {', '.join(dict.fromkeys(close))}?" if close else ""
    return (
        f"unknown dataset '{name}'.{hint} Known: {', '.join(DATASETS)}, or folder:PATH for a "
        "folder with one sub-folder per class."
    )


# ----------------------------------------------------------------------------- build_dataset


def dataset_folder(name, root):
    """The absolute folder `build_dataset` reads a dataset from: a folder:PATH dataset's own path,
    else <root>/<its CoOp folder> (an unknown name: <root>/<name>)."""
    if name.startswith("folder:"):
        path = name[len("folder:") :]
        if not path.strip():  # "" would read (and write split files into) the current directory
            raise DataError(
                "--dataset folder: needs a path after the colon (folder:PATH, a folder "
                "with one sub-folder per class); it is empty (an unset variable?)"
            )
        return os.path.abspath(os.path.expanduser(path))
    spec = DATASETS.get(name)
    return os.path.join(
        os.path.abspath(os.path.expanduser(str(root))), spec.folder if spec else name
    )


def build_dataset(name, root, shots=-1, seed=1, subsample="all"):
    """Read one dataset: its splits (few-shot when shots >= 1), class names and template.

    name: a key of DATASETS or "folder:PATH"; root: the folder holding the CoOp datasets;
    subsample: "all", "base" or "novel" ("new" is accepted, as in CoOp); shots=-1 keeps every image.
    Test-only sets (the ImageNet variants) have empty train/val and ignore shots."""
    subsample = {"new": "novel"}.get(subsample, subsample)
    if subsample not in ("all", "base", "novel"):
        raise DataError(f"subsample must be 'all', 'base' or 'novel', not {subsample!r}")
    if not isinstance(shots, int) or (shots < 1 and shots != -1):
        raise DataError(
            f"shots must be a positive number of images per class, or -1 for all; got {shots!r}"
        )
    folder = dataset_folder(name, root)
    if name.startswith("folder:"):
        spec = Spec(name, "folder", folder, "", "split_folder.json", PHOTO, reader="folder")
    elif name in DATASETS:
        spec, root = DATASETS[name], os.path.abspath(os.path.expanduser(str(root)))
        if spec.reader == "toyworld" and not os.path.isfile(os.path.join(folder, spec.split)):
            raise DataError(
                f"the toy world is not generated under {root}; make it with `python toyworld.py "
                f"dataset --root {root}` (dear.py and entropy.py do this on first use)"
            )
        elif not os.path.isdir(root):
            raise DataError(
                f"data root not found: {root}\nPass --root DATA, the folder that holds the CoOp "
                f"datasets; {name} is expected as DATA/{spec.layout()} (see {COOP_GUIDE})"
            )
    else:
        raise DataError(suggest(name))

    image_dir, split = READERS[spec.reader](spec, folder, root)
    split_file = folder_split_file(folder) if spec.reader == "folder" else ""
    if (
        split_file
    ):  # the split (and its few-shot cache) may live in the cache when the folder is read-only
        spec = dataclasses.replace(spec, split=split_file)
    if subsample != "all":
        labels = {y for _, y, _ in (split["train"] or split["test"])}
        if len(labels) == 1:
            raise DataError(
                f"base-to-novel needs at least 2 classes (base: the first half, novel: the rest); "
                f"{name} has 1. Use --subsample all, or a dataset with more classes."
            )
    read = dict(split)  # as read, before few-shot sampling
    if shots >= 1 and not spec.test_only:
        cache = os.path.dirname(split_file) if split_file else folder
        split["train"], split["val"] = fewshot_split(
            cache, split, shots, seed, sample_val=spec.reader != "imagenet"
        )

    def finish(items):  # absolute paths; clean names (CoOp's renames, '_' -> ' ')
        return [
            (os.path.join(image_dir, p), y, spec.renames.get(c, c).replace("_", " "))
            for p, y, c in items
        ]

    train, val, test = subsample_classes(
        *(finish(split[k]) for k in ("train", "val", "test")), subsample
    )
    for what, items in (("train", train), ("val", val), ("test", test)):
        check_files(items, what, spec)
    names = {}
    for _, y, c in train + val + test:
        names.setdefault(y, c)
    if not names:
        raise DataError(f"{folder} lists no images; expected layout: {spec.layout()}")
    missing = [y for y in range(max(names) + 1) if y not in names]
    if missing:
        raise DataError(
            f"labels {missing[:5]} have no items in {folder}; the split file is inconsistent"
        )
    classnames = [names[y] for y in range(len(names))]
    check_test_split(read, test, name, split_file)
    ds = Dataset(name, train, val, test, classnames, spec.template, folder, split_file)
    ds.warnings = dataset_warnings(ds, shots, subsample, spec.test_only)
    if spec.reader == "folder":
        ds.warnings += [w for w in [nested_warning(folder, list_class_folders(folder))] if w]
    for w in ds.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return ds


def check_test_split(split, test, name, split_file):
    """Stop when there is nothing to test on: an empty test split (e.g. after --subsample), or, in
    the split of a folder dataset (split: as read, before few-shot sampling), a class without a test
    image (its accuracy would never be measured)."""
    if not test:
        fix = (
            f"delete {split_file} to split the folder anew"
            if split_file
            else "check the split file"
        )
        raise DataError(f"{name} has an empty test split: there is nothing to evaluate on; {fix}")
    if split_file:
        tested = {c for _, _, c in split["test"]}
        untested = sorted({c for k in ("train", "val") for _, _, c in split[k]} - tested)
        if untested:
            raise DataError(
                f"the split {split_file} gives {len(untested)} class(es) no test image "
                f"({some(untested)}); delete it to split the folder anew (every class "
                f"with 2 or more images then gets one)"
            )


def dataset_warnings(ds, shots, subsample, test_only):
    """What makes a result less than it seems: a one-class split,
    fewer images than --shots asks for."""
    out, part = [], "" if subsample == "all" else f" ({subsample} classes)"
    if ds.num_classes == 1:
        out.append(
            f"{ds.name}{part} has only one class ({ds.classnames[0]}): every prediction is that "
            "class, so its accuracy is 100% by construction"
        )
    counts = ds.shots_per_class
    short = [k for k, n in enumerate(counts) if n < shots]
    if shots >= 1 and not test_only and short:
        k = min(short, key=lambda k: counts[k])
        out.append(
            f"--shots {shots}: {len(short)} of {ds.num_classes} classes{part} have fewer training "
            f"images (fewest: {ds.classnames[k]}, {counts[k]}); they keep all they have, as in "
            f"CoOp, so the real shots per class are {min(counts)}..{max(counts)}"
        )
    return out


# --------------------------------------------------------------------------- transforms and loaders


def to_rgb(image):
    """Any PIL image as 8-bit RGB. 16-bit grayscale ("I;16..." modes, and "I" holding values above
    255) is scaled to 8 bit, v / 257 (65535 -> 255): PIL's own convert clips every value above 255,
    i.e. to white."""
    if image.mode.startswith("I;16") or (image.mode == "I" and image.getextrema()[1] > 255):
        levels = np.asarray(image, dtype=np.float64) / 257.0  # [H, W], 0..255
        image = Image.fromarray(np.clip(np.round(levels), 0, 255).astype(np.uint8))
    return image.convert("RGB")


# Aspect ratios RandomResizedCrop draws from (torchvision's default, as Dassl's train pipeline).
CROP_RATIO = (3 / 4, 4 / 3)


def random_crop_box(width, height, min_scale, ratio=CROP_RATIO):
    """(top, left, h, w) of a random crop: torchvision's RandomResizedCrop.get_params, with the same
    draws from torch's RNG. Up to 10 tries of an area fraction in (min_scale, 1) and a log-uniform
    aspect ratio; a box that does not fit is drawn again, and after 10 misses the centre crop of the
    largest box the ratio range allows is taken."""
    import torch

    area = width * height
    log_ratio = torch.log(torch.tensor(ratio))  # float32, as torchvision's
    for _ in range(10):
        target = area * torch.empty(1).uniform_(min_scale, 1.0).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,)).item()
            left = torch.randint(0, width - w + 1, size=(1,)).item()
            return top, left, h, w
    if width / height < min(ratio):  # too tall for every ratio: full width
        w, h = width, int(round(width / min(ratio)))
    elif width / height > max(ratio):  # too wide: full height
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TrainTransform:
    """Dassl's train pipeline with MMRL's crop scale: RGB, RandomResizedCrop(size,
    scale=(min_scale, 1), bicubic), a horizontal flip with probability 1/2 (torch.rand(1) < 0.5),
    CLIP's mean/std. Written with PIL and torch, not torchvision (see clip.to_tensor); equal to
    torchvision's pipeline bit for bit from the same RNG state (tests/test_data.py)."""

    def __init__(self, size=224, min_scale=0.5):
        self.size, self.min_scale = size, min_scale

    def __call__(self, image):  # PIL image -> [3, size, size]
        import clip  # imported on first use: listing folders needs no torch
        import torch

        image = to_rgb(image)
        top, left, h, w = random_crop_box(*image.size, self.min_scale)
        image = image.crop((left, top, left + w, top + h))
        if image.size != (self.size, self.size):
            image = image.resize((self.size, self.size), Image.BICUBIC)
        if torch.rand(1) < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return clip.to_tensor(image, CLIP_MEAN, CLIP_STD)


class EvalTransform:
    """CLIP's preprocess after RGB: the shorter side to `size` (bicubic), the central size x size,
    CLIP's mean/std (clip.resize, clip.center_crop, clip.to_tensor)."""

    def __init__(self, size=224):
        self.size = size

    def __call__(self, image):  # PIL image -> [3, size, size]
        import clip

        image = clip.center_crop(clip.resize(to_rgb(image), self.size), self.size)
        return clip.to_tensor(image, CLIP_MEAN, CLIP_STD)


def train_transform(size=224, min_scale=0.5):
    """The training pipeline (TrainTransform)."""
    return TrainTransform(size, min_scale)


def test_transform(size=224):
    """The evaluation pipeline: CLIP's preprocess (EvalTransform)."""
    return EvalTransform(size)


class ImageList:
    """Items (path, label, ...) + transform -> (image tensor [3, size, size], label); a map-style
    dataset for torch's DataLoader (which needs only __len__ and __getitem__)."""

    def __init__(self, items, transform=None):
        self.items, self.transform = list(items), transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i][0], self.items[i][1]
        image = open_image(path)
        return (self.transform(image) if self.transform else image), label


def open_image(path):
    """An image file as 8-bit RGB, decoded now (so a truncated file fails here, not later); any
    failure is a DataError naming the file."""
    try:
        with Image.open(path) as im:
            return to_rgb(im)
    except FileNotFoundError:
        raise DataError(
            f"image listed in the split is missing on disk: {path}; restore it, or "
            f"re-extract the dataset it came from"
        ) from None
    except Image.DecompressionBombError as e:  # PIL refuses images above 2 x Image.MAX_IMAGE_PIXELS
        raise DataError(
            f"image {path} is too large to open safely ({e}); shrink it, or replace it"
        ) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(
            f"cannot read image {path} ({e}); the file is corrupt or not an image: "
            f"replace it with a good copy"
        ) from None


def check_images(ds):
    """Open (decode) every image of a dataset once, with a progress line; then stop,
    listing the unreadable ones."""
    # ImageNet: val is test
    paths = list(dict.fromkeys(p for p, _, _ in ds.train + ds.val + ds.test))
    bad, t0, every = [], time.time(), max(1, len(paths) // 100)
    for i, path in enumerate(paths):
        try:
            open_image(path)
        except DataError as e:
            bad.append(str(e))
        if (i + 1) % every == 0 or i + 1 == len(paths):
            progress(f"opening the images of {ds.name}", i + 1, len(paths), t0)
    if bad:
        more = f"\n(and {len(bad) - 10} more)" if len(bad) > 10 else ""
        raise DataError(
            f"{len(bad)} of {len(paths)} images of {ds.name} cannot be read:\n"
            + "\n".join(bad[:10])
            + more
        )
    return len(paths)


def make_loader(items, transform, batch_size, shuffle, num_workers=0, seed=None, drop_last=None):
    """A DataLoader over ImageList(items, transform).

    seed fixes the shuffling order (and the workers' augmentation seeds) through a private
    generator; with num_workers=0 augmentation draws from torch's global RNG, which the training
    script seeds. drop_last defaults to Dassl's train rule: drop the last partial batch when
    shuffling a set that holds at least one full batch."""
    import torch

    dataset = ImageList(items, transform)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    if drop_last is None:
        drop_last = bool(shuffle) and len(dataset) >= batch_size
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        generator=generator,
        drop_last=drop_last,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )


# --------------------------------------------------------------------------- checking many datasets


def check_root(names, root):
    """Stop once, before any dataset is read, when the data root that the named datasets need is
    missing (folder:PATH datasets and the generated toy world do not count: they say what they need
    themselves)."""
    root = os.path.abspath(os.path.expanduser(str(root)))
    needs = [n for n in names if n in DATASETS and DATASETS[n].reader != "toyworld"]
    if needs and not os.path.isdir(root):
        raise DataError(
            f"data root not found: {root} (needed by {', '.join(needs)})\nPass --root DATA, the "
            "folder that holds the CoOp datasets; fill it with `python data.py download "
            f"{needs[0]} --root DATA` (layout: {COOP_GUIDE})"
        )


def check_datasets(names, root, shots=-1, seed=1, subsample="all", open_images=False, report=print):
    """Read each dataset (and open its images when open_images), calling report(name, dataset or
    None, error message or None) for each; return the errors {name: message}. A missing root is one
    DataError."""
    check_root(names, root)
    errors = {}
    for name in names:
        try:
            ds = build_dataset(name, root, shots, seed, subsample)
            if open_images:
                check_images(ds)
            report(name, ds, None)
        except DataError as e:
            errors[name] = str(e)
            report(name, None, str(e))
    return errors


# ----------------------------------------------------------------------------- CLI


def summary(ds, shots, seed, subsample):
    counts = f"train {len(ds.train)} | val {len(ds.val)} | test {len(ds.test)}"
    lines = [
        f"{ds.name}: {ds.folder}",
        f"classes: {ds.num_classes}"
        + (f" ({subsample})" if subsample != "all" else "")
        + (
            f", base {math.ceil(ds.num_classes / 2)} / novel {ds.num_classes // 2}"
            if subsample == "all"
            else ""
        ),
        counts + (f"   ({shots} shots, seed {seed})" if shots >= 1 else ""),
        f"template: {ds.template}",
        f"first classes: {', '.join(ds.classnames[:5])}",
        f"example prompt: {ds.template.format(ds.classnames[0])}",
    ]
    if ds.split_file:
        lines.append(f"split kept in: {ds.split_file}")
    return "\n".join(lines)


def main(argv=None):
    names = "\n".join(f"  {s.name:<16} {s.coop_name:<20} DATA/{s.folder}" for s in SPECS)
    parser = argparse.ArgumentParser(
        description="CoOp benchmark datasets for DeAR: check a dataset on disk or download it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"datasets (name, CoOp name, folder):\n{names}\n  folder:PATH      any folder with "
        "one sub-folder per class\n\nexamples:\n  python data.py check eurosat --root DATA "
        "--shots 16 --subsample base\n  python data.py download eurosat --root DATA\nlayout: "
        f"{COOP_GUIDE}",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="read datasets, open every image, print a summary (classes, split sizes, template)",
    )
    check.add_argument(
        "names",
        nargs="+",
        metavar="name",
        help="dataset names (see `python data.py --help`) or folder:PATH",
    )
    check.add_argument(
        "--no-images", action="store_true", help="only read the split lists; do not open the images"
    )
    check.add_argument("--root", default="data", help="folder holding the datasets (default: data)")
    check.add_argument(
        "--shots", type=int, default=None, help="training images per class, >= 1 (default: all)"
    )
    check.add_argument("--seed", type=int, default=1)
    check.add_argument("--subsample", default="all", choices=["all", "base", "novel", "new"])
    down = sub.add_parser("download", help="download a dataset (and its split file) into --root")
    down.add_argument("name", help="dataset name")
    down.add_argument("--root", default="data", help="folder holding the datasets (default: data)")
    down.add_argument(
        "--mirror", help="base URL of a mirror holding the archives under their original file names"
    )
    down.add_argument("--gdrive-url", help="replacement for Google Drive's download endpoint")
    args = parser.parse_args(argv)

    import download  # the helper module that fetches and unpacks archives

    try:
        if args.command == "check":
            if args.shots is not None and args.shots < 1:  # dear.py's rule and words
                raise DataError(f"--shots must be >= 1, got {args.shots}")
            args.shots = -1 if args.shots is None else args.shots  # build_dataset's "all images"

            def report(name, ds, error):
                if ds:
                    print(summary(ds, args.shots, args.seed, args.subsample), flush=True)
                else:
                    print(f"error: {error}", file=sys.stderr, flush=True)

            if check_datasets(
                args.names,
                args.root,
                args.shots,
                args.seed,
                args.subsample,
                open_images=not args.no_images,
                report=report,
            ):
                return 2
        else:
            if args.name not in DATASETS:
                raise DataError(suggest(args.name))
            download.download_dataset(
                DATASETS[args.name], args.root, mirror=args.mirror, gdrive_url=args.gdrive_url
            )
    except (DataError, download.DownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

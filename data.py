"""Files and datasets: the project's error type, file readers and writer; the CoOp benchmark
datasets, read from the layout of CoOp's DATASETS.md under --root, and folder:PATH datasets.

A split is a list of (path, label, classname). Few-shot subsets are the ones Dassl draws for the
same seed, cached in <dataset>/split_fewshot/; base/novel classes are CoOp's.
`python data.py check|download --help` for the command line.
"""

import argparse
import collections
import csv
import errno
import glob
import hashlib
import io
import json
import math
import os
import pathlib
import random
import shutil
import signal
import stat
import string
import sys
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads sleep

import numpy as np
from PIL import Image

# ------------------------------------------------------------------------------ errors and files
# The project's mechanisms against silently wrong results, each used everywhere: one error type for
# what a user can fix; one reader per kind of file (JSON, torch, text, image) that refuses what it
# cannot use in one line naming the file, what is wrong and what to do; one writer that puts a file
# or folder in place whole or not at all; one handler around every script's main.

DEFAULT_ROOT = os.environ.get("DATA", "data")  # every script's --root


class UserError(Exception):
    """A mistake the user can fix (a missing dataset, a bad flag, an unusable file): one line,
    exit status 2."""

    def __init__(self, message):
        # a DataLoader worker's error arrives as its whole traceback, the message on its last line
        super().__init__(str(message).rstrip().rpartition("UserError: ")[2])


def text(value):
    """An argparse type: a string that is not empty (a path, a name, a template, a list); also a
    schema (mismatch)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty value; give one, or leave the flag out")
    return value


text.kind, text.what = str, "a string that is not empty"


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as a UserError (one line, through guarded), and an option without
    a type of its own taking `text`: an empty string is never a path, a name or a template."""

    def add_argument(self, *args, **kw):
        if kw.get("action", "store") in ("store", "append") and "type" not in kw:
            kw["type"] = text
        return super().add_argument(*args, **kw)

    def error(self, message):
        raise UserError(f"{message} (see --help)")


def number(kind, ok, what):
    """An argparse type: a finite `kind` (int or float) with ok(value); also a schema (mismatch)."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.kind, parse.what = (int, float) if kind is float else int, what
    return parse


def interrupted(signum, frame):
    """SIGTERM (what SLURM and `timeout` send) as Ctrl-C: every `finally` runs, so every temporary
    file goes."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def uncaught(kind, value, tb, hook=sys.excepthook):
    """Ctrl-C before a script's main (during its imports): one line, not a traceback."""
    if not issubclass(kind, KeyboardInterrupt):
        return hook(kind, value, tb)
    print("\ninterrupted", file=sys.stderr)


# every script imports this file before torch: from here on, SIGTERM and Ctrl-C are handled alike
if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, interrupted)
sys.excepthook = uncaught


def guarded(main, *args, interrupted="interrupted"):
    """A script's main(*args): a UserError or an OSError as one line and exit status 2; Ctrl-C or
    SIGTERM as one line and 130 or 143, with no temporary file left (atomic_write removes its own).
    Any other exception is a bug: its traceback shows."""
    try:
        return main(*args)
    except KeyboardInterrupt as e:
        print(f"\n{interrupted}", file=sys.stderr)
        sys.exit(128 + (signal.SIGTERM if e.args == ("SIGTERM",) else signal.SIGINT))
    except (UserError, OSError) as e:
        print(f"error: {e if isinstance(e, UserError) else os_error(e)}", file=sys.stderr)
        sys.exit(2)


NEXT_STEP = {
    errno.ENOSPC: "free some space there, or write elsewhere (--out, CLIP_CACHE), and run it again",
    errno.EDQUOT: "free some of your quota there, or write elsewhere, and run it again",
    errno.EROFS: "it is read-only: write elsewhere (--out, CLIP_CACHE)",
    errno.EACCES: "choose a place you may use (--out, --root, CLIP_CACHE)",
    errno.ELOOP: "a symbolic link is not followed there: remove it"}


def os_error(e):
    """An OSError in one line: the path, what the system said and, where it helps, the next step."""
    where = f"{e.filename}: " if e.filename else ""
    step = NEXT_STEP.get(e.errno)
    return where + (e.strerror or str(e)) + (f"; {step}" if step else "")


def first_line(e, width=80):
    """What a library's error says, in one line of at most width characters: its first line, or
    its kind where it says nothing (torch's EOFError on an empty file)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:width]


def remove(path):
    """Delete a file or a folder tree, if there is one (never through a link)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def remove_leftovers(path, tag):
    """Delete what a killed process left of its work on path (`<path>.<tag><pid>`, pid gone)."""
    for p in glob.glob(glob.escape(path) + f".{tag}*"):
        pid = p.rpartition(f".{tag}")[2]
        # Linux's table of processes; without one (another system) nothing is known gone
        if pid.isdigit() and os.path.isdir("/proc/self") and not os.path.exists(f"/proc/{pid}"):
            remove(p)


def atomic_write(path, write):
    """write(tmp) makes a file or folder at the temporary name tmp, which then replaces path: path
    is whole or absent, and a link at path is replaced, never written through. tmp is removed
    after any failure, Ctrl-C or SIGTERM (and the next call removes what a kill left); an OS error
    names path."""
    remove_leftovers(path, "tmp")
    tmp = f"{path}.tmp{os.getpid()}"
    remove(tmp)
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        if e.filename in (None, tmp) and e.errno is not None:  # a write that failed (a full disk)
            raise OSError(e.errno, e.strerror, path) from None
        raise
    finally:
        remove(tmp)
    return path


def write_text(path, text):
    return atomic_write(path, lambda tmp: pathlib.Path(tmp).write_text(text, encoding="utf-8"))


def write_json(path, doc):
    return write_text(path, json.dumps(doc, indent=1))


def write_torch(path, obj):
    """torch.save(obj) to path, through Python's own writes, so that a full disk is an OSError
    naming path (torch's file writer raises a RuntimeError that names nothing)."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write(path, lambda tmp: pathlib.Path(tmp).write_bytes(buffer.getbuffer()))


def writable_folder(path, size=0):
    """path, made if missing, once `size` bytes can be written there (the largest file the work
    will write): checked before the work, not found unusable after it. posix_fallocate takes the
    blocks for real, so a full disk or a file size limit (ulimit -f) says so here."""
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path) as f:
        try:  # not on every system or file system: then the empty file is the check
            if size and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise OSError(e.errno, f"{e.strerror} (the work writes {size:,} bytes)", path)
        return path


def makedirs_below(top, path):
    """Make the folder path (under top) with its parents; a link among them below top is refused:
    what is written there stays inside top."""
    parts = os.path.relpath(path, top).split(os.sep)
    for p in (os.path.join(top, *parts[: i + 1]) for i in range(len(parts))):
        if os.path.islink(p):
            raise UserError(f"{p} is a symbolic link; remove it (nothing is written through it)")
    os.makedirs(path, exist_ok=True)
    return path


def open_regular(path, flags):
    """os.open of a regular file (made if flags ask), never through a link, never blocking: a FIFO
    or a device there is refused, not waited on."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)  # a link: ELOOP (os_error)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{path}: not a regular file; remove it (a file of ours, made again)")
    return fd


def regular(path, fix):
    """path, if it names a regular file (a FIFO would block its reader for ever)."""
    try:
        if stat.S_ISREG(os.stat(path).st_mode):
            return path
    except FileNotFoundError:
        raise UserError(f"{path}: not found; {fix}") from None
    raise UserError(f"{path}: not a regular file; {fix}")


def read_text(path, fix):
    """A UTF-8 text file's lines, stripped, blank ones dropped; a file with none is refused."""
    try:
        with open(regular(path, fix), encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip()]
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    if not lines:
        raise UserError(f"{path}: no lines (empty or blank); {fix}")
    return lines


def read_json(path, schema, fix):
    """The JSON document at path, checked against schema (mismatch)."""
    try:
        with open(regular(path, fix), encoding="utf-8") as f:
            doc = json.load(f)
    except ValueError as e:  # not JSON, or not UTF-8
        raise UserError(f"{path}: not a JSON file ({e}); {fix}") from None
    if wrong := mismatch(doc, schema):
        raise UserError(f"{path}: {wrong}; {fix}")
    return doc


def mismatch(value, schema, at="the document"):
    """What in value does not fit schema, or "". A schema is a type (float: a finite number; int:
    not a bool), slice(lo, hi) (a finite number in [lo, hi]), a string (that string), a flag's
    type (number or text: what the flag would take), None, a tuple of alternatives, [s] (a list
    of s), [s1, s2, ...] (a list of these), or {key: s} (an object with these keys, "key?" when
    optional, and perhaps others)."""
    if isinstance(schema, tuple):
        wrong = [mismatch(value, s, at) for s in schema]
        if all(isinstance(s, str) for s in schema) and "" not in wrong:  # choices
            return f"{at} = {json.dumps(value)[:40]} is not one of {', '.join(schema)}"
        return "" if "" in wrong else wrong[0]
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{at} is not an object"
        for key, s in schema.items():
            k = key.removesuffix("?")
            if k not in value and k == key:
                return f"{at} lacks {k!r}"
            if k in value and (wrong := mismatch(value[k], s, f"{at}[{k!r}]")):
                return wrong
        return ""
    if isinstance(schema, list):
        if not isinstance(value, list) or (len(schema) > 1 and len(value) != len(schema)):
            return f"{at} is not a list" + (f" of {len(schema)}" if len(schema) > 1 else "")
        pairs = enumerate(zip(value, schema if len(schema) > 1 else schema * len(value)))
        return next(filter(None, (mismatch(v, s, f"{at}[{i}]") for i, (v, s) in pairs)), "")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(schema, str):
        return "" if value == schema else f"{at} = {json.dumps(value)[:40]} is not {schema!r}"
    if hasattr(schema, "what"):  # a flag's type: what the flag would take from this value's text
        try:
            ok = isinstance(value, schema.kind) and not isinstance(value, bool)
            ok = ok and schema(str(value)) == value
        except argparse.ArgumentTypeError:
            ok = False
        return "" if ok else f"{at} = {json.dumps(value)[:40]} is not {schema.what}"
    if schema is None:
        ok = value is None
    elif isinstance(schema, slice):
        ok = number and math.isfinite(value) and schema.start <= value <= schema.stop
    elif schema is float:
        ok = number and math.isfinite(value)
    else:
        ok = isinstance(value, schema) and (schema is not int or not isinstance(value, bool))
    names = {None: "null", float: "a finite number", int: "a whole number", str: "a string",
             bool: "true or false", dict: "an object", list: "a list"}
    span = isinstance(schema, slice) and f"a number in [{schema.start}, {schema.stop}]"
    return "" if ok else f"{at} = {json.dumps(value)[:40]} is not {span or names[schema]}"


def read_torch(path, fix, schema=None):
    """What torch.save wrote at path, weights only (no code runs), checked against schema
    (mismatch) if given; a cut-off or foreign file is refused."""
    import pickle

    import torch

    try:
        obj = torch.load(regular(path, fix), map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise UserError(f"{path}: not a whole torch file ({first_line(e)}); {fix}") from None
    if schema is not None and (wrong := mismatch(obj, schema)):
        raise UserError(f"{path}: {wrong}; {fix}")
    return obj


def open_image(path, fix="remove it from the dataset, or replace it"):
    """A readable image as 8-bit RGB (to_rgb); a file that is not one is refused with its path."""
    try:
        with Image.open(regular(path, fix)) as image:
            return to_rgb(image)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"{path}: not a readable image ({e}); {fix}") from None


def sha256_file(path):
    with open(regular(path, "a regular file is needed here"), "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ------------------------------------------------------------------------------ the datasets


# A dataset's
#   coop: CoOp's DATASET.NAME; the json reader reads <folder>/split_zhou_<coop>.json
#   folder: under --root
#   images: split paths are relative to <folder>/<images>
#   reader: json | fgvc | imagenet | variant | v2 | folder
#   template: CoOp's (trainers/zsclip.py CUSTOM_TEMPLATES)
Spec = collections.namedtuple("Spec", "coop folder images reader template")


PHOTO = "a photo of a {}."
TYPE = "a photo of a {{}}, a type of {}."
ACTION = "a photo of a person doing {}."
V2 = "imagenetv2-matched-frequency-format-val"
DATASETS = {
    "imagenet": Spec("ImageNet", "imagenet", "images", "imagenet", PHOTO),
    "caltech101": Spec("Caltech101", "caltech-101", "101_ObjectCategories", "json", PHOTO),
    "oxford_pets": Spec("OxfordPets", "oxford_pets", "images", "json", TYPE.format("pet")),
    "stanford_cars": Spec("StanfordCars", "stanford_cars", "", "json", PHOTO),
    "oxford_flowers": Spec("OxfordFlowers", "oxford_flowers", "jpg", "json", TYPE.format("flower")),
    "food101": Spec("Food101", "food-101", "images", "json", "a photo of {}, a type of food."),
    "fgvc_aircraft": Spec("FGVCAircraft", "fgvc_aircraft", "images", "fgvc",
                          TYPE.format("aircraft")),
    "sun397": Spec("SUN397", "sun397", "SUN397", "json", PHOTO),
    "dtd": Spec("DescribableTextures", "dtd", "images", "json", "{} texture."),
    "eurosat": Spec("EuroSAT", "eurosat", "2750", "json", "a centered satellite photo of {}."),
    "ucf101": Spec("UCF101", "ucf101", "UCF-101-midframes", "json", ACTION),
    "imagenetv2": Spec("ImageNetV2", "imagenetv2", V2, "v2", PHOTO),
    "imagenet_sketch": Spec("ImageNetSketch", "imagenet-sketch", "images", "variant", PHOTO),
    "imagenet_a": Spec("ImageNetA", "imagenet-adversarial", "imagenet-a", "variant", PHOTO),
    "imagenet_r": Spec("ImageNetR", "imagenet-rendition", "imagenet-r", "variant", PHOTO),
    "toyworld": Spec("ToyWorld", "toyworld", "images", "json", PHOTO)}
FOLDER = Spec("folder", "", "", "folder", PHOTO)
B2N_DATASETS = ("imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers",
                "food101", "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101")
DG_TARGETS = ("imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r")
TEST_ONLY = ("variant", "v2")
# classnames.txt is CLIP's ImageNet list, which names two pairs of classes alike (openai/CLIP#235);
# CoOp keeps them
CLIP_NAMES = ("imagenet", "variant", "v2")
# CoOp's datasets/caltech101.py and eurosat.py: raw class name -> the name put in the prompt
RENAMES = {
    "caltech101": {"airplanes": "airplane", "Faces": "face", "Leopards": "leopard",
                   "Motorbikes": "motorbike"},
    "eurosat": {"AnnualCrop": "Annual Crop Land", "Highway": "Highway or Road",
                "HerbaceousVegetation": "Herbaceous Vegetation Land", "Pasture": "Pasture Land",
                "Industrial": "Industrial Buildings", "PermanentCrop": "Permanent Crop Land",
                "Residential": "Residential Buildings", "SeaLake": "Sea or Lake"}}
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
FEWSHOT_DIR = "split_fewshot"  # CoOp's; hidden in a folder:PATH dataset (.split_fewshot)
FEWSHOT_FORMAT = "dear-fewshot/1"  # the caches' formats, kept from earlier versions
IMAGENET_FORMAT = "dear-imagenet/1"


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
        """Training images per class (index = label); fewer than --shots where a class has fewer
        (CoOp keeps all)."""
        counts = collections.Counter(y for _, y, _ in self.train)
        return [counts[k] for k in range(len(self.classnames))]


# ------------------------------------------------------------------------------ readers
# Each returns (image folder, {"train"|"val"|"test": [(path relative to it, label, raw class
# name)]}); fix: what the user does about a file that is missing or unusable.

ROW = [str, int, str]  # [relative path, label, class name]


def list_dirs(folder):
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def list_images(folder):
    """Image file names, sorted (os.listdir's order differs between machines)."""
    names = [f for f in os.listdir(folder) if not f.startswith(".")]
    return sorted(f for f in names if f.lower().endswith(IMAGE_EXTENSIONS))


def cached(path, key, make):
    """The train and val lists of the JSON document at path when it was made for `key` (a dict);
    else {**key, **make()}, stored there."""
    try:
        doc = read_json(path, {"train": [ROW], "val": [ROW]}, "")
        if all(doc.get(k) == v for k, v in key.items()):
            return {s: [tuple(row) for row in doc[s]] for s in ("train", "val")}
    except UserError:
        pass  # none there, or not usable: made again
    return keep(path, {**key, **make()})


def keep(path, doc):
    """doc, written to path as JSON if possible: a read-only dataset folder costs only the time to
    make it again."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, doc)
    except OSError as e:
        print(f"note: cannot keep {path} ({os_error(e)})", file=sys.stderr)
    return doc


def read_split(path, fix):
    """A CoOp split file: {"train"|"val"|"test": [[relative path, label, classname], ...]}."""
    doc = read_json(path, {"train": [ROW], "val": [ROW], "test": [ROW]}, fix)
    return {k: [tuple(row) for row in doc[k]] for k in ("train", "val", "test")}


def read_coop(spec, folder, fix):
    split = read_split(os.path.join(folder, f"split_zhou_{spec.coop}.json"), fix)
    return os.path.join(folder, spec.images), split


def read_fgvc(spec, folder, fix):
    """FGVCAircraft: label = line of the variant in variants.txt; images_variant_<split>.txt
    lines: '<id> <variant>'."""
    label = {v: i for i, v in enumerate(read_text(os.path.join(folder, "variants.txt"), fix))}
    split = {}
    for s in ("train", "val", "test"):
        path = os.path.join(folder, f"images_variant_{s}.txt")
        rows = [line.split(" ", 1) for line in read_text(path, fix)]
        if bad := [" ".join(r) for r in rows if len(r) < 2 or r[1] not in label]:
            raise UserError(f"{path}: {bad[0]!r} is not '<image id> <variant>'; {fix}")
        split[s] = [(f"{image}.jpg", label[v], v) for image, v in rows]
    return os.path.join(folder, "images"), split


def read_classnames(folder, fix):
    """classnames.txt (CoOp's DATASETS.md): '<wnid> <class name>' per line, in sorted-wnid order."""
    path = os.path.join(folder, "classnames.txt")
    rows = [line.split(" ", 1) for line in read_text(path, fix)]
    if any(len(r) < 2 for r in rows):
        raise UserError(f"{path}: a line is not '<wnid> <class name>'; {fix}")
    return dict(rows)


def list_classes(image_dir, names, prefix=""):
    """The files of every sorted wnid folder; label = the folder's index (CoOp's rule)."""
    return [(f"{prefix}{w}/{f}", y, names.get(w, w)) for y, w in enumerate(list_dirs(image_dir))
            for f in list_images(os.path.join(image_dir, w))]


def read_imagenet(spec, folder, fix):
    """ImageNet: the official val set is the test (and val) set. Listed once into
    preprocessed.json; files are sorted by name, unlike Dassl's os.listdir order, so that few-shot
    subsets are the same on every machine."""
    names = read_classnames(folder, fix)
    image_dir = os.path.join(folder, "images")
    names_sha256 = sha256_file(os.path.join(folder, "classnames.txt"))
    key = {"format": IMAGENET_FORMAT, "classnames_sha256": names_sha256}

    def make():
        print(f"listing {image_dir} (once)", file=sys.stderr)
        return {s: list_classes(os.path.join(image_dir, s), names, f"{s}/")
                for s in ("train", "val")}

    doc = cached(os.path.join(folder, "preprocessed.json"), key, make)
    return image_dir, {"train": doc["train"], "val": doc["val"], "test": doc["val"]}


def read_variant(spec, folder, fix):
    """ImageNet-Sketch/-A/-R: sorted wnid folders (A and R hold 200 of the 1000), names from
    classnames.txt."""
    image_dir = os.path.join(folder, spec.images)
    test = list_classes(image_dir, read_classnames(folder, fix))
    return image_dir, {"train": [], "val": [], "test": test}


def read_v2(spec, folder, fix):
    """ImageNetV2: folder k (0..999, in numeric order) holds class k, the k-th line of
    classnames.txt."""
    names = list(read_classnames(folder, fix).values())
    image_dir = os.path.join(folder, spec.images)
    ks = sorted(int(d) for d in list_dirs(image_dir) if d.isdigit() and int(d) < len(names))
    test = [(f"{k}/{f}", k, names[k]) for k in ks
            for f in list_images(os.path.join(image_dir, str(k)))]
    return image_dir, {"train": [], "val": [], "test": test}


def read_folder(spec, folder, fix):
    """folder:PATH: one sub-folder per class, split 50/20/30 per class once (seed 1), kept in
    PATH/split_folder.json so that adding images later does not change it; every class keeps at
    least one test image. Hidden folders are not classes; a class's own sub-folders are not read
    (dataset_warnings counts their images)."""
    path = os.path.join(folder, "split_folder.json")
    classes = list_dirs(folder)
    if os.path.lexists(path):
        split = read_split(path, "delete it, and the folder is split anew")
        kept = sorted({c for items in split.values() for _, _, c in items})
        if kept != classes:
            raise UserError(f"{path} splits the classes {kept}, but the folder holds {classes}; "
                            "delete it, and the folder is split anew")
        return folder, split
    if not classes:
        raise UserError(f"{folder}: no class folders; put each class's images in a folder")
    rng = random.Random(1)
    split = {"train": [], "val": [], "test": []}
    for label, c in enumerate(classes):
        images = [f"{c}/{f}" for f in list_images(os.path.join(folder, c))]
        if len(images) < 2:
            raise UserError(f"{folder}/{c}: {len(images)} image(s); a class needs 2 (one to train "
                            "on, one to test on)")
        rng.shuffle(images)
        # train: half, at least one; then val: a fifth, leaving at least one to test on
        n_train = max(1, round(0.5 * len(images)))
        cut = n_train + min(round(0.2 * len(images)), len(images) - n_train - 1)
        for s, part in zip(split, (images[:n_train], images[n_train:cut], images[cut:])):
            split[s] += [(p, label, c) for p in part]
    return folder, keep(path, split)


READERS = {"json": read_coop, "fgvc": read_fgvc, "imagenet": read_imagenet, "variant": read_variant,
           "v2": read_v2, "folder": read_folder}


# ------------------------------------------------------------------------------ few-shot, classes


def fewshot_sample(items, k, rng):
    """Dassl's generate_fewshot_dataset (KaiyangZhou/Dassl.pytorch,
    dassl/data/datasets/base_dataset.py): group by label in order of first appearance, rng.sample
    k per class; a class with fewer than k keeps all (no draw)."""
    groups = {}
    for item in items:
        groups.setdefault(item[1], []).append(item)
    return [item for g in groups.values() for item in (rng.sample(g, k) if len(g) >= k else g)]


def fewshot_split(cache, split, shots, seed, sample_val=True):
    """(train, val) with `shots` per class (val: min(shots, 4)): CoOp seeds Python's random once,
    then samples train and val from that one stream. Cached in the folder `cache` for exactly these
    lists, shots and seed."""
    source = {"train": split["train"], "val": split["val"] if sample_val else []}
    key = {"format": FEWSHOT_FORMAT, "shots": shots, "seed": seed}
    key["split_sha256"] = hashlib.sha256(json.dumps(source).encode()).hexdigest()

    def make():
        rng = random.Random(seed)
        train = fewshot_sample(source["train"], shots, rng)
        return {"train": train, "val": fewshot_sample(source["val"], min(shots, 4), rng)}

    doc = cached(os.path.join(cache, f"shot_{shots}-seed_{seed}.json"), key, make)
    return doc["train"], doc["val"] if sample_val else split["val"]


def subsample_classes(train, val, test, subsample="all"):
    """CoOp's subsample_classes: of the sorted labels of train (of test for test-only sets) the
    first ceil(n/2) are base, the rest novel; the chosen labels are renumbered from 0 in every
    split."""
    if subsample == "all":
        return train, val, test
    labels = sorted({y for _, y, _ in train or test})
    m = math.ceil(len(labels) / 2)
    relabel = {y: i for i, y in enumerate({"base": labels[:m], "novel": labels[m:]}[subsample])}
    return tuple([(p, relabel[y], c) for p, y, c in items if y in relabel]
                 for items in (train, val, test))


# ------------------------------------------------------------------------------ build_dataset


def dataset_folder(name, root):
    """The folder a dataset is read from: PATH of folder:PATH, else <root>/<its CoOp folder>."""
    if name.startswith("folder:"):
        path = name.removeprefix("folder:")
        if not path.strip():
            raise UserError("folder: needs a path, as folder:PATH (a folder of class folders)")
        return os.path.abspath(os.path.expanduser(path))
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}, or folder:PATH")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), DATASETS[name].folder)


def how_to_get(name, root):
    """What to do about a missing or unusable file of a dataset."""
    if name == "toyworld":
        return "dear.py --dataset toyworld writes it (delete a damaged one first)"
    if name in DATASETS:
        return f"get it with: python data.py download {name} --root {root}"
    return "a folder dataset holds one folder of images per class"


def build_dataset(name, root, shots=-1, seed=1, subsample="all"):
    """One dataset: its splits (`shots` per class when >= 1), class names in label order,
    template. subsample: all | base | novel. Test-only sets (the ImageNet variants) have no
    train/val and ignore shots."""
    folder = dataset_folder(name, root)
    spec = DATASETS.get(name, FOLDER)
    fix = how_to_get(name, root)
    try:
        image_dir, split = READERS[spec.reader](spec, folder, fix)
        # a half-unpacked dataset lacks the end of a split
        for p, _, _ in [row for items in split.values() for row in items[:1] + items[-1:]]:
            regular(os.path.join(image_dir, p), fix)
    except FileNotFoundError as e:  # a missing folder
        raise UserError(f"{e.filename}: not found; {fix}") from None
    labels = {y for items in split.values() for _, y, _ in items}
    if labels != set(range(len(labels))) and spec.reader not in TEST_ONLY:
        raise UserError(f"{name}: the labels are not 0..{len(labels) - 1}, one per class; {fix}")
    if shots >= 1 and spec.reader not in TEST_ONLY:
        # hidden in a folder dataset, whose folders are classes
        cache = os.path.join(folder, ("." if spec.reader == "folder" else "") + FEWSHOT_DIR)
        sample_val = spec.reader != "imagenet"
        split["train"], split["val"] = fewshot_split(cache, split, shots, seed, sample_val)
    renames = RENAMES.get(name, {})
    split = {s: [(os.path.join(image_dir, p), y, renames.get(c, c).replace("_", " "))
                 for p, y, c in items] for s, items in split.items()}
    train, val, test = subsample_classes(split["train"], split["val"], split["test"], subsample)
    if not test:
        raise UserError(f"{name} ({subsample} classes) has no test images")
    # each label's class name where it first appears (reversed: the first one is written last)
    first = {y: c for _, y, c in reversed(train + val + test)}
    ds = Dataset(name, train, val, test, [first[y] for y in sorted(first)], spec.template)
    if spec.reader not in CLIP_NAMES:
        check_prompts(ds.classnames, ds.template)
    # images in a class folder's sub-folders (at any depth), which read_folder does not read
    classes = list_dirs(folder) if spec.reader == "folder" else []
    below = [d for c in classes for d, _, _ in list(os.walk(os.path.join(folder, c)))[1:]]
    nested = sum(len(list_images(d)) for d in below)
    ds.warnings = dataset_warnings(ds, shots, spec.reader in TEST_ONLY, nested)
    for w in ds.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return ds


def check_prompts(classnames, template):
    """A template with one {} and nothing else in braces; at least one class; two classes whose
    prompts the tokenizer reads alike would be one class to the model."""
    from clip.tokenizer import clean_text

    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    if fields != [""] or "{}" not in template:
        raise UserError(f"template {template!r}: it needs exactly one {{}} for the class name "
                        "(and no other braces)")
    if not classnames:
        raise UserError("no class names")
    seen = {}
    for c in classnames:
        prompt = clean_text(template.format(c))
        if prompt in seen:
            raise UserError(f"classes {seen[prompt]!r} and {c!r} give the same prompt {prompt!r}")
        seen[prompt] = c


def dataset_warnings(ds, shots, test_only, nested=0):
    """What makes a result less than it seems."""
    out = []
    counts = ds.shots_per_class
    if nested:
        out.append(f"{ds.name}: {nested} images in sub-folders of class folders are not read (only "
                   "a class folder's own images are)")
    if len(ds.classnames) == 1:
        out.append(f"{ds.name} has one class: its accuracy is 100% by construction")
    short = [k for k, n in enumerate(counts) if n < shots]
    if short and not test_only:
        out.append(f"--shots {shots}: {len(short)} of {len(counts)} classes have fewer images and "
                   f"keep all, as in CoOp ({min(counts)} at least)")
    return out


# ------------------------------------------------------------------------------ images


def to_rgb(image):
    """Any PIL image as 8-bit RGB; PIL's convert clips at 255, so 16-bit grayscale is scaled by
    1/257 (65535 -> 255) and floating point (mode F) by 255 if its values are in [0, 1]; other
    float values are refused (their scale is unknown)."""
    levels = np.asarray(image, dtype=np.float64) if image.mode in ("I", "F") else None
    if image.mode.startswith("I;16") or (image.mode == "I" and levels.max() > 255):
        levels = np.round(np.asarray(image, dtype=np.float64) / 257)
    elif image.mode == "F" and np.isfinite(levels).all() and 0 <= levels.min() <= levels.max() <= 1:
        levels = np.round(levels * 255)
    elif image.mode == "F":
        raise ValueError("floating-point pixels outside [0, 1]")
    else:
        return image.convert("RGB")
    return Image.fromarray(np.clip(levels, 0, 255).astype(np.uint8)).convert("RGB")


def train_transform(size, min_scale):
    """Dassl's training pipeline with MMRL's crop scale, on an RGB image."""
    import clip
    from torchvision import transforms as T

    bicubic = T.InterpolationMode.BICUBIC
    crop = T.RandomResizedCrop(size, scale=(min_scale, 1.0), interpolation=bicubic)
    flip = T.RandomHorizontalFlip()
    return T.Compose([crop, flip, T.ToTensor(), T.Normalize(clip.MEAN, clip.STD)])


class ImageList:
    """(path, label, ...) items -> (transform(RGB image), label): a map-style dataset for torch's
    DataLoader."""

    def __init__(self, items, transform):
        self.items = list(items)
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i][:2]
        return self.transform(open_image(path)), label


# ------------------------------------------------------------------------------ downloads

# assets/downloads.csv, a row per file: dataset, URL (drive:ID: Google Drive, CoOp's DATASETS.md),
# MD5 (torchvision's tables) or "", saved as, done when this exists ("": the file itself); or, for
# images without a stable public URL, what to fetch by hand. An archive is unpacked where it is
# saved, then deleted.
with open(pathlib.Path(__file__).parent / "assets" / "downloads.csv", encoding="utf-8") as f:
    SOURCES = [tuple(row.values()) for row in csv.DictReader(f)]
DRIVE = "https://drive.usercontent.google.com/download?export=download&confirm=t&id="
ARCHIVES = (".zip", ".tar", ".tar.gz", ".tgz")


def fetch(url, md5, path):
    """Download url to path under a temporary name, renamed only once its MD5 (when known) holds.
    A Drive file that Google holds back (no answer, or a web page instead of the file: quota,
    region) is left to fetch by hand, as CoOp's DATASETS.md says: False."""
    from torchvision.datasets.utils import download_url

    drive = url.startswith("drive:")

    def get(tmp):
        download_url(DRIVE + url[6:] if drive else url, *os.path.split(tmp), md5 or None)
        with open(tmp, "rb") as f:
            if drive and f.read(1) == b"<":
                raise OSError("Google Drive sent a web page, not the file")

    try:
        atomic_write(path, get)
        return True
    except RuntimeError:  # download_url's MD5 check
        raise UserError(f"{path}: not the MD5 {md5} of {url}; run the command again") from None
    except OSError:
        if not drive:
            raise
    print(f"fetch by hand: https://drive.google.com/file/d/{url[6:]}/view, as {path}",
          file=sys.stderr)
    return False


def unpack(archive):
    """Unpack archive beside itself whole or not at all, then delete it: into a temporary folder
    first (gone after any failure or Ctrl-C), whose entries then move in. tar: PEP 706's "data"
    filter refuses absolute names, links out of the target and devices; zip takes no filter
    (Python docs), and its unpacker skips absolute and '..' names."""
    remove_leftovers(archive, "unpacking")
    tmp = f"{archive}.unpacking{os.getpid()}"
    bad = (shutil.ReadError, tarfile.TarError, zipfile.BadZipFile, EOFError, ValueError, zlib.error)
    try:
        shutil.unpack_archive(archive, tmp, filter=None if archive.endswith(".zip") else "data")
        for name in sorted(os.listdir(tmp)):
            dest = os.path.join(os.path.dirname(archive), name)
            if os.path.lexists(dest):
                raise UserError(f"{dest} is in the way of {archive}: move it, then run again")
            os.replace(os.path.join(tmp, name), dest)
    except bad as e:
        remove(archive)
        why = f"{archive} cannot be unpacked safely and whole ({first_line(e)}); deleted: run again"
        raise UserError(why) from None
    finally:
        remove(tmp)
    remove(archive)


def download(name, root):
    """Fetch and unpack what has a public URL for one dataset; say what to fetch by hand."""
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    root = os.path.abspath(os.path.expanduser(root))
    for _, url, md5, path, done, by_hand in [s for s in SOURCES if s[0] == name]:
        if by_hand:
            print(f"by hand: {by_hand} (under {root})", file=sys.stderr)
            continue
        path = os.path.join(root, path)
        done = os.path.join(root, done or path)
        unpacking = done != path and os.path.exists(path)  # an archive whose unpacking was cut off
        if os.path.exists(done) and not unpacking:
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not unpacking:
            print(f"fetching {url} -> {path}", file=sys.stderr)
        if not (unpacking or fetch(url, md5, path)) or not path.endswith(ARCHIVES):
            continue
        unpack(path)
        if name == "fgvc_aircraft":  # the archive's fgvc-aircraft-2013b/data: CoOp's fgvc_aircraft/
            os.replace(os.path.join(root, "fgvc-aircraft-2013b", "data"), os.path.join(root, name))


# ------------------------------------------------------------------------------ command line


def check(name, root, shots, seed, subsample, open_images):
    ds = build_dataset(name, root, shots, seed, subsample)
    sizes = f"train {len(ds.train)}, val {len(ds.val)}, test {len(ds.test)}"
    print(f"{name}: {dataset_folder(name, root)}")
    print(f"  {len(ds.classnames)} classes ({subsample}), {sizes}")
    print(f"  prompt: {ds.template.format(ds.classnames[0])}")
    if open_images:
        paths = list(dict.fromkeys(p for p, _, _ in ds.train + ds.val + ds.test))
        for path in paths:
            open_image(path)
        print(f"  opened {len(paths)} images")


POSITIVE = number(int, lambda v: v >= 1, "a whole number >= 1")
COUNT = number(int, lambda v: v >= 0, "a count >= 0")


def check_or_download(argv):
    epilog = f"datasets: {', '.join(DATASETS)}, or folder:PATH (one sub-folder per class)"
    parser = Parser(description="Check or download the CoOp datasets, in CoOp's layout.",
                    epilog=epilog)
    sub = parser.add_subparsers(dest="command", required=True)
    check_p = sub.add_parser("check", help="read datasets and print a summary of each")
    check_p.add_argument("--shots", type=POSITIVE, default=-1, help="per class (default: all)")
    check_p.add_argument("--seed", type=POSITIVE, default=1, help="of the few-shot subset")
    check_p.add_argument("--subsample", choices=["all", "base", "novel"], default="all",
                         help="the classes, or their base or novel half (default: all)")
    check_p.add_argument("--open", action="store_true", help="also open every image")
    for p in (check_p, sub.add_parser("download", help="download datasets into --root")):
        p.add_argument("names", nargs="+", metavar="NAME", help="see data.py --help")
        p.add_argument("--root", default=DEFAULT_ROOT, help="the datasets ($DATA, else data)")
    args = parser.parse_args(argv)
    failed = False
    for name in args.names:  # each dataset's error on its line: one call names all that is missing
        try:
            if args.command == "check":
                check(name, args.root, args.shots, args.seed, args.subsample, args.open)
            else:
                download(name, args.root)
        except (UserError, OSError) as e:
            print(f"error: {e if isinstance(e, UserError) else os_error(e)}", file=sys.stderr)
            failed = True
    return 2 if failed else 0


def main(argv=None):
    return guarded(check_or_download, argv)


if __name__ == "__main__":
    sys.exit(main())

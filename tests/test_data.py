"""data.py and download.py: every CoOp reader on tiny fake datasets in the real layouts, few-shot
subsets equal to Dassl's, base/novel, folder datasets and their kept split, transforms (16-bit
images), loaders, bad input, downloads from a local HTTP server, and archives built to each
path-escape attack."""

import collections
import hashlib
import http.server
import io
import json
import os
import random
import re
import shutil
import stat
import tarfile
import threading
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

import data
import download


def make_image(path, seed=0, size=(12, 10)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def write_split(path, image_dir, entries):
    """entries: {split: [(relative path, label, classname)]};
    writes the images and the JSON (indent 4, as Dassl)."""
    for n, (rel, _, _) in enumerate(e for items in entries.values() for e in items):
        make_image(os.path.join(image_dir, rel), seed=n)
    with open(path, "w") as f:
        json.dump({k: [list(e) for e in v] for k, v in entries.items()}, f, indent=4)


def interleave(per_class):
    """Items of several classes in a mixed order (labels not grouped),
    as in the real split files."""
    out, rng = [], random.Random(0)
    for items in per_class:
        out += items
    rng.shuffle(out)
    return out


# ------------------------------------------------------------------------------------------ layouts
# One builder per CoOp layout. Each returns (classnames as the model sees them, (n_train, n_val,
# n_test)).

SIZES = {"train": 5, "val": 3, "test": 2}

# name: (raw classnames as stored in the split JSON, relative path of image i of class c)
JSON_LAYOUTS = {
    "caltech101": (
        ["accordion", "Leopards", "yin_yang"],
        lambda c, s, i: f"{c}/image_{s}{i:04d}.jpg",
    ),
    "oxford_pets": (
        ["abyssinian", "american_bulldog", "yorkshire_terrier"],
        lambda c, s, i: f"{c}_{s}{i}.jpg",
    ),
    "stanford_cars": (
        ["2012 AM General Hummer SUV", "2012 Acura RL Sedan", "2012 Tesla Model S Sedan"],
        lambda c, s, i: f"cars_{'test' if s == 'test' else 'train'}/{len(c):02d}{s}{i:05d}.jpg",
    ),
    "oxford_flowers": (
        ["pink primrose", "hard-leaved pocket orchid", "canterbury bells"],
        lambda c, s, i: f"image_{c[:4]}{s}{i:05d}.jpg",
    ),
    "food101": (["apple_pie", "baby_back_ribs", "baklava"], lambda c, s, i: f"{c}/{s}{i}.jpg"),
    "sun397": (
        ["abbey", "outdoor apartment_building", "airplane_cabin"],
        lambda c, s, i: f"{c[0]}/{c.replace(' ', '_')}/sun_{s}{i}.jpg",
    ),
    "dtd": (["banded", "blotchy", "braided"], lambda c, s, i: f"{c}/{c}_{s}{i:04d}.jpg"),
    "eurosat": (
        ["Annual Crop Land", "Forest", "SeaLake"],
        lambda c, s, i: f"{c.replace(' ', '')}/{c}_{s}{i}.jpg",
    ),
    "ucf101": (
        ["Apply_Eye_Makeup", "Archery", "Baby_Crawling"],
        lambda c, s, i: f"{c}/v_{s}_g{i:02d}.jpg",
    ),
}
CLEAN = {"Leopards": "leopard", "SeaLake": "Sea or Lake"}  # CoOp's renames, then '_' -> ' '


def build_json_layout(root, name):
    spec = data.DATASETS[name]
    raw, rel = JSON_LAYOUTS[name]
    folder = os.path.join(root, spec.folder)
    entries = {
        s: interleave([[(rel(c, s, i), y, c) for i in range(n)] for y, c in enumerate(raw)])
        for s, n in SIZES.items()
    }
    write_split(os.path.join(folder, spec.split), os.path.join(folder, spec.images), entries)
    return [CLEAN.get(c, c).replace("_", " ") for c in raw], (15, 9, 6)


def build_fgvc(root, name):
    folder = os.path.join(root, "fgvc_aircraft")
    variants = ["707-320", "727-200", "A300B4"]
    os.makedirs(os.path.join(folder, "images"))
    with open(os.path.join(folder, "variants.txt"), "w") as f:
        f.write("\n".join(variants) + "\n")
    n = 0
    for s, k in SIZES.items():
        with open(os.path.join(folder, f"images_variant_{s}.txt"), "w") as f:
            for i in range(k):
                for v in reversed(variants):  # file order differs from label order
                    n += 1
                    make_image(os.path.join(folder, "images", f"{1000000 + n}.jpg"), seed=n)
                    f.write(f"{1000000 + n} {v}\n")
    return variants, (15, 9, 6)


WNIDS = {
    "n01440764": "tench",
    "n01443537": "goldfish",
    "n01484850": "great white shark",
    "n01491361": "tiger shark",
    "n01494475": "hammerhead shark",
}


def write_classnames(folder, wnids=WNIDS):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "classnames.txt"), "w") as f:
        f.write("".join(f"{w} {c}\n" for w, c in wnids.items()))


def build_imagenet(root, name):
    folder = os.path.join(root, "imagenet")
    write_classnames(folder)
    for w in list(WNIDS)[:3]:
        for i in range(5):
            make_image(os.path.join(folder, "images", "train", w, f"{w}_{9 - i}.JPEG"), seed=i)
        for i in range(2):
            make_image(
                os.path.join(folder, "images", "val", w, f"ILSVRC2012_val_{w}{i}.JPEG"), seed=i
            )
    return ["tench", "goldfish", "great white shark"], (15, 6, 6)


def build_variant(root, name):
    spec = data.DATASETS[name]
    folder = os.path.join(root, spec.folder)
    write_classnames(folder)
    image_dir = os.path.join(folder, spec.images)
    if name == "imagenetv2":
        keep = [0, 1, 2]
        for k in keep:
            for i in range(3):
                make_image(os.path.join(image_dir, str(k), f"{i}abc.jpeg"), seed=i)
        return ["tench", "goldfish", "great white shark"], (0, 0, 9)
    # A and R hold a subset of the 1000 classes (here 2 of 5) and a README.txt beside the folders
    keep = ["n01443537", "n01494475"] if name in ("imagenet_a", "imagenet_r") else list(WNIDS)[:3]
    for w in keep:
        for i in range(3):
            make_image(os.path.join(image_dir, w, f"{i}.jpg"), seed=i)
    with open(os.path.join(image_dir, "README.txt"), "w") as f:
        f.write("not a class\n")
    return [WNIDS[w] for w in keep], (0, 0, 3 * len(keep))


BUILDERS = {
    **{n: build_json_layout for n in JSON_LAYOUTS},
    "fgvc_aircraft": build_fgvc,
    "imagenet": build_imagenet,
    "imagenetv2": build_variant,
    "imagenet_sketch": build_variant,
    "imagenet_a": build_variant,
    "imagenet_r": build_variant,
}
TEMPLATES = {
    "oxford_pets": "a photo of a {}, a type of pet.",
    "oxford_flowers": "a photo of a {}, a type of flower.",
    "food101": "a photo of {}, a type of food.",
    "fgvc_aircraft": "a photo of a {}, a type of aircraft.",
    "dtd": "{} texture.",
    "eurosat": "a centered satellite photo of {}.",
    "ucf101": "a photo of a person doing {}.",
}


def test_every_benchmark_dataset_has_a_builder_here():
    assert set(BUILDERS) == set(data.DATASETS) - {"toyworld"}
    assert set(data.B2N_DATASETS) | set(data.DG_TARGETS) == set(BUILDERS)
    assert (
        len(data.B2N_DATASETS) == 11
        and data.B2N_DATASETS[0] == "imagenet"
        and data.B2N_DATASETS[-1] == "ucf101"
    )


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_reader_gives_classnames_counts_template(tmp_path, name):
    classnames, counts = BUILDERS[name](str(tmp_path), name)
    ds = data.build_dataset(name, str(tmp_path))
    assert ds.classnames == classnames
    assert (len(ds.train), len(ds.val), len(ds.test)) == counts
    assert ds.template == TEMPLATES.get(name, "a photo of a {}.") and ds.template.count("{}") == 1
    for path, label, classname in ds.train + ds.val + ds.test:
        assert os.path.isfile(path) and os.path.isabs(path)
        assert classname == ds.classnames[label]  # every item agrees with the label -> name table
    test_labels = sorted({y for _, y, _ in ds.test})
    assert test_labels == list(range(len(classnames)))


def test_label_order_follows_split_json_not_folder_names(tmp_path):
    # EuroSAT labels come from the JSON: class 2 is "Sea or Lake" even though the JSON stores its
    # raw folder name
    build_json_layout(str(tmp_path), "eurosat")
    ds = data.build_dataset("eurosat", str(tmp_path))
    assert [c for _, y, c in ds.test if y == 2][0] == "Sea or Lake"
    assert all("SeaLake" in p for p, y, _ in ds.test if y == 2)


def test_imagenet_sorted_files_and_relative_cache(tmp_path):
    build_imagenet(str(tmp_path), "imagenet")
    ds = data.build_dataset("imagenet", str(tmp_path))
    first = [os.path.basename(p) for p, y, _ in ds.train if y == 0]
    assert first == sorted(first)  # sorted by name, not os.listdir order
    assert ds.val == ds.test  # the official val set is ImageNet's test (and val) set, as in CoOp
    cache = os.path.join(tmp_path, "imagenet", "preprocessed.json")
    text = open(cache).read()
    assert str(tmp_path) not in text and '"train/n01440764/n01440764_5.JPEG"' in text
    # the cache is used: a new image is not seen until classnames.txt (or the cache) changes
    make_image(os.path.join(tmp_path, "imagenet", "images", "train", "n01440764", "zzz.JPEG"))
    assert len(data.build_dataset("imagenet", str(tmp_path)).train) == 15
    write_classnames(os.path.join(tmp_path, "imagenet"), {**WNIDS, "n09999999": "new class"})
    assert len(data.build_dataset("imagenet", str(tmp_path)).train) == 16


def test_imagenet_fewshot_samples_train_only(tmp_path):
    build_imagenet(str(tmp_path), "imagenet")
    ds = data.build_dataset("imagenet", str(tmp_path), shots=2, seed=3)
    assert len(ds.train) == 6 and ds.val == ds.test and len(ds.test) == 6


# ----------------------------------------------------------------------------------------- few-shot


def dassl_fewshot(train, val, k, seed):
    """Dassl's generate_fewshot_dataset as CoOp calls it, restated: global random seeded once,
    train with k, then val with min(k, 4), defaultdict grouping, all items of a small class."""
    random.seed(seed)
    out = []
    for items, n in ((train, k), (val, min(k, 4))):
        tracker = collections.defaultdict(list)
        for item in items:
            tracker[item[1]].append(item)
        sampled = []
        for label in tracker:
            group = tracker[label]
            sampled.extend(random.sample(group, n) if len(group) >= n else group)
        out.append(sampled)
    return out


def build_uneven_dtd(root, train_sizes=(6, 7, 1, 5, 9), val_sizes=(5, 3, 4, 2, 6)):
    names = ["banded", "blotchy", "braided", "bubbly", "bumpy"]
    folder = os.path.join(root, "dtd")
    entries = {
        "train": interleave(
            [
                [(f"{c}/{c}_t{i}.jpg", y, c) for i in range(n)]
                for y, (c, n) in enumerate(zip(names, train_sizes))
            ]
        ),
        "val": interleave(
            [
                [(f"{c}/{c}_v{i}.jpg", y, c) for i in range(n)]
                for y, (c, n) in enumerate(zip(names, val_sizes))
            ]
        ),
        "test": [(f"{c}/{c}_s{i}.jpg", y, c) for y, c in enumerate(names) for i in range(2)],
    }
    write_split(
        os.path.join(folder, "split_zhou_DescribableTextures.json"),
        os.path.join(folder, "images"),
        entries,
    )
    return entries, os.path.join(folder, "images")


@pytest.mark.parametrize("shots,seed", [(1, 1), (4, 1), (4, 2), (5, 3), (16, 1)])
def test_fewshot_equals_dassl(tmp_path, shots, seed):
    entries, image_dir = build_uneven_dtd(str(tmp_path))
    ds = data.build_dataset("dtd", str(tmp_path), shots=shots, seed=seed)
    want_train, want_val = dassl_fewshot(entries["train"], entries["val"], shots, seed)
    assert [os.path.relpath(p, image_dir) for p, _, _ in ds.train] == [p for p, _, _ in want_train]
    assert [os.path.relpath(p, image_dir) for p, _, _ in ds.val] == [p for p, _, _ in want_val]
    assert len(ds.test) == 10  # the test set is never subsampled
    counts = collections.Counter(y for _, y, _ in ds.train)
    assert counts == {y: min(shots, n) for y, n in enumerate((6, 7, 1, 5, 9))}


def test_fewshot_cache_is_portable_reused_and_rebuilt(tmp_path):
    root = tmp_path / "a"
    entries, _ = build_uneven_dtd(str(root))
    first = data.build_dataset("dtd", str(root), shots=2, seed=1)
    cache_path = root / "dtd" / "split_fewshot" / "shot_2-seed_1.json"
    cache = json.loads(cache_path.read_text())
    assert str(tmp_path) not in cache_path.read_text()  # relative paths only
    # reused, also after the whole data folder moved: mark the cache and see the mark come back
    cache["train"] = cache["train"][:1]
    cache_path.write_text(json.dumps(cache))
    shutil.move(str(root), str(tmp_path / "b"))
    moved = data.build_dataset("dtd", str(tmp_path / "b"), shots=2, seed=1)
    assert len(moved.train) == 1
    # a changed split file makes the cache stale: it is rebuilt from the new lists
    split_path = tmp_path / "b" / "dtd" / "split_zhou_DescribableTextures.json"
    split = json.loads(split_path.read_text())
    split["train"] = split["train"][1:]
    split_path.write_text(json.dumps(split))
    rebuilt = data.build_dataset("dtd", str(tmp_path / "b"), shots=2, seed=1)
    want, _ = dassl_fewshot([tuple(e) for e in split["train"]], split["val"], 2, 1)
    assert [p.split("images/")[1] for p, _, _ in rebuilt.train] == [e[0] for e in want]
    assert len(first.train) == 9


def test_fewshot_cache_key_covers_the_val_list_and_the_draw(tmp_path):
    """The cached subsets are reused only for the very train and val lists (and shots, seed) they
    were drawn from: a split file whose val list alone changed redraws val (a key over train only
    kept the stale val), and a cache file copied under another seed's name is not taken for that
    seed's draw."""
    entries, image_dir = build_uneven_dtd(str(tmp_path))
    data.build_dataset("dtd", str(tmp_path), shots=2, seed=1)
    split_path = tmp_path / "dtd" / "split_zhou_DescribableTextures.json"
    split = json.loads(split_path.read_text())
    split["val"] = split["val"][3:]  # train unchanged
    split_path.write_text(json.dumps(split))
    ds = data.build_dataset("dtd", str(tmp_path), shots=2, seed=1)
    want_train, want_val = dassl_fewshot(entries["train"], [tuple(e) for e in split["val"]], 2, 1)
    assert [os.path.relpath(p, image_dir) for p, _, _ in ds.val] == [p for p, _, _ in want_val]
    assert [os.path.relpath(p, image_dir) for p, _, _ in ds.train] == [p for p, _, _ in want_train]
    cache = tmp_path / "dtd" / "split_fewshot"
    shutil.copy(cache / "shot_2-seed_1.json", cache / "shot_2-seed_2.json")
    ds2 = data.build_dataset("dtd", str(tmp_path), shots=2, seed=2)
    want2, _ = dassl_fewshot(entries["train"], [tuple(e) for e in split["val"]], 2, 2)
    assert [os.path.relpath(p, image_dir) for p, _, _ in ds2.train] == [p for p, _, _ in want2]
    assert want2 != want_train  # the seeds draw other subsets


def test_fewshot_sample_groups_by_first_appearance_and_spends_no_draw_on_small_classes():
    """Unequal classes in a label order that is not sorted (7, 2, 5): the output follows first
    appearance (not sorted labels), a class with fewer than k items keeps them all without drawing,
    so the next class's draw is the one the stream gives after the first class; k items exactly are
    drawn (rng.sample reorders)."""
    order = [(7, 0), (2, 0), (5, 0), (7, 1), (5, 1), (2, 1), (7, 2), (5, 2), (7, 3), (7, 4)]
    items = [(f"{y}-{i}", y) for y, i in order]  # 5, 2 and 3 items
    out = data.fewshot_sample(items, 3, random.Random(4))
    assert [y for _, y in out] == [7, 7, 7, 2, 2, 5, 5, 5]
    rng = random.Random(4)
    sevens = rng.sample([it for it in items if it[1] == 7], 3)
    fives = rng.sample([it for it in items if it[1] == 5], 3)  # 3 of 3: drawn, so reordered
    assert out == sevens + [("2-0", 2), ("2-1", 2)] + fives
    assert fives != [it for it in items if it[1] == 5]  # a draw, not the items as listed
    assert data.fewshot_sample(items, 3, random.Random(5)) != out  # another seed, other subsets


def test_subsample_classes_ranks_sorted_labels_and_renumbers_them():
    """Labels 9, 0, 5, 2, 7 (not contiguous, not in order): base = the ceil(5/2) = 3 smallest (0, 2,
    5), novel = 7, 9, renumbered by rank in every split; a first-appearance or floor rule gives
    other classes."""
    train = [(f"t{y}", y, f"c{y}") for y in (9, 0, 5, 2, 7)]
    test = [(f"s{y}", y, f"c{y}") for y in (7, 2, 9, 0, 5, 2)]
    base = data.subsample_classes(train, [], test, "base")
    novel = data.subsample_classes(train, [], test, "novel")
    assert base[0] == [("t0", 0, "c0"), ("t5", 2, "c5"), ("t2", 1, "c2")]
    assert base[2] == [("s2", 1, "c2"), ("s0", 0, "c0"), ("s5", 2, "c5"), ("s2", 1, "c2")]
    assert novel[0] == [("t9", 1, "c9"), ("t7", 0, "c7")]
    assert novel[2] == [("s7", 0, "c7"), ("s9", 1, "c9")]
    assert data.subsample_classes(train, [], test, "all") == (train, [], test)


def test_fewshot_leaves_global_random_alone(tmp_path):
    build_uneven_dtd(str(tmp_path))
    random.seed(123)
    expected = random.random()
    random.seed(123)
    data.build_dataset("dtd", str(tmp_path), shots=2, seed=1)
    assert random.random() == expected


# ------------------------------------------------------------------------------------- base / novel


def test_base_novel_split_and_relabel(tmp_path):
    build_uneven_dtd(str(tmp_path))  # 5 classes: base = 0,1,2 (ceil(5/2)), novel = 3,4
    full = data.build_dataset("dtd", str(tmp_path))
    base = data.build_dataset("dtd", str(tmp_path), subsample="base")
    novel = data.build_dataset("dtd", str(tmp_path), subsample="novel")
    assert base.classnames == full.classnames[:3] and novel.classnames == full.classnames[3:]
    assert {y for _, y, _ in novel.train + novel.val + novel.test} == {0, 1}  # relabelled from 0
    assert [p for p, _, _ in novel.test] == [p for p, y, _ in full.test if y >= 3]
    assert len(base.train) + len(novel.train) == len(full.train)
    # CoOp's name
    assert data.build_dataset("dtd", str(tmp_path), subsample="new").test == novel.test
    fs_base = data.build_dataset("dtd", str(tmp_path), shots=4, seed=1, subsample="base")
    fs_all = data.build_dataset("dtd", str(tmp_path), shots=4, seed=1)
    # few-shot first, then the class split
    assert fs_base.train == [it for it in fs_all.train if it[1] < 3]


def test_base_novel_on_test_only_set(tmp_path):
    build_variant(str(tmp_path), "imagenet_sketch")
    novel = data.build_dataset("imagenet_sketch", str(tmp_path), shots=16, subsample="novel")
    assert novel.classnames == ["great white shark"] and len(novel.test) == 3 and novel.train == []


# ------------------------------------------------------------------------------ custom and toyworld


def test_custom_folder_split_is_deterministic_and_kept(tmp_path):
    for copy in ("one", "two"):
        for c in ("red_apple", "pear", "plum"):
            for i in range(10):
                make_image(str(tmp_path / copy / c / f"{i:02d}.png"), seed=i)
    a = data.build_dataset(f"folder:{tmp_path / 'one'}", None, shots=-1)
    b = data.build_dataset(f"folder:{tmp_path / 'two'}", None)
    assert a.classnames == ["pear", "plum", "red apple"] and a.template == "a photo of a {}."
    assert (len(a.train), len(a.val), len(a.test)) == (15, 6, 9)  # 50/20/30 per class
    assert [os.path.relpath(p, tmp_path / "one") for p, _, _ in a.test] == [
        os.path.relpath(p, tmp_path / "two") for p, _, _ in b.test
    ]
    assert (tmp_path / "one" / "split_folder.json").exists() and a.split_file == str(
        tmp_path / "one" / "split_folder.json"
    )
    # later runs reuse the written split
    again = data.build_dataset(f"folder:{tmp_path / 'one'}", None, shots=2)
    assert len(again.train) == 6 and sum(len(s) for s in (a.train, a.val, a.test)) == 30
    assert data.build_dataset(f"folder:{tmp_path / 'one'}", None).test == a.test


def fruit_folder(folder, classes=("pear", "plum", "red_apple"), n=10):
    for c in classes:
        for i in range(n):
            make_image(str(folder / c / f"{i:02d}.png"), seed=i)
    return f"folder:{folder}"


@pytest.mark.parametrize(
    "change,words",
    [
        ("image added", ["1 image(s) added (plum/99.png)"]),
        ("image gone", ["1 image(s) gone (pear/03.png)", "delete the gone images' entries"]),
        (
            "class added",
            [
                "class folders added: kiwi",
                "3 image(s) added (kiwi/00.png, kiwi/01.png, kiwi/02.png)",
            ],
        ),
        (
            "class gone",
            [
                "class folders gone: plum",
                "10 image(s) gone (plum/00.png, plum/01.png, plum/02.png, ...)",
            ],
        ),
    ],
)
def test_folder_that_changed_since_its_split_is_refused(tmp_path, change, words):
    name = fruit_folder(tmp_path / "fruit")
    first = data.build_dataset(name, None)
    split_file = str(tmp_path / "fruit" / "split_folder.json")
    if change == "image added":
        make_image(str(tmp_path / "fruit" / "plum" / "99.png"))
    elif change == "image gone":
        os.remove(tmp_path / "fruit" / "pear" / "03.png")
    elif change == "class added":
        for i in range(3):
            make_image(str(tmp_path / "fruit" / "kiwi" / f"{i:02d}.png"), seed=i)
    else:
        shutil.move(str(tmp_path / "fruit" / "plum"), str(tmp_path / "plum"))
    with pytest.raises(data.DataError) as err:
        data.build_dataset(name, None, shots=2)
    msg = str(err.value)
    for w in words + [
        f"no longer matches its split {split_file}",
        f"delete {split_file}",
        "new shuffle",
        "Restore",
    ]:
        assert w in msg, (w, msg)
    # not advice for CoOp's datasets
    assert "CoOp" not in msg and "download" not in msg and "github" not in msg
    if change == "class gone":  # restoring the folder brings the kept split back, unchanged
        shutil.move(str(tmp_path / "plum"), str(tmp_path / "fruit" / "plum"))
        assert data.build_dataset(name, None).test == first.test
    else:  # deleting the split file splits the folder as it is now
        os.remove(split_file)
        n = {"image added": 31, "image gone": 29, "class added": 33}[change]
        ds = data.build_dataset(name, None)
        assert len(ds.train) + len(ds.val) + len(ds.test) == n


def test_read_only_folder_keeps_its_split_in_the_cache(tmp_path, monkeypatch, capsys):
    """A folder that refuses writes (root ignores chmod, so the refusal is simulated) is split into
    $DEAR_CACHE/folders/<name>-<first 12 hex of SHA256 of the resolved path>/, and said so."""
    monkeypatch.setenv("DEAR_CACHE", str(tmp_path / "cache"))
    real_write = data.write_json_atomic
    locked = [str(tmp_path / "a" / "pets"), str(tmp_path / "b" / "pets")]

    def write(path, *args, **kw):
        if any(os.path.abspath(path).startswith(f + os.sep) for f in locked):
            raise PermissionError(13, "Permission denied", path)
        return real_write(path, *args, **kw)

    monkeypatch.setattr(data, "write_json_atomic", write)
    split_files = []
    for folder in locked:
        name = fruit_folder(tmp_path / folder, n=4)
        ds = data.build_dataset(name, None, shots=1)
        key = hashlib.sha256(os.path.realpath(folder).encode()).hexdigest()[:12]
        want = str(tmp_path / "cache" / "folders" / f"pets-{key}" / "split_folder.json")
        assert (
            ds.split_file == want
            and os.path.isfile(want)
            and not os.path.exists(os.path.join(folder, "split_folder.json"))
        )
        assert os.path.isfile(
            os.path.join(os.path.dirname(want), "split_fewshot", "shot_1-seed_1.json")
        )
        err = capsys.readouterr().err
        assert f"its split is kept in {want}" in err and "could not cache" not in err
        # reused
        assert data.build_dataset(name, None).test == data.build_dataset(name, None, shots=1).test
        split_files.append(want)
    assert split_files[0] != split_files[1]  # two folders named pets keep two splits
    # the cached split is checked like any other
    make_image(str(tmp_path / "a" / "pets" / "pear" / "99.png"))
    with pytest.raises(data.DataError, match="no longer matches its split " + split_files[0]):
        data.build_dataset(f"folder:{locked[0]}", None)


def test_split_and_fewshot_files_get_the_users_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        name = fruit_folder(tmp_path / "fruit", n=4)
        data.build_dataset(name, None, shots=1)
    finally:
        os.umask(old)
    for path in (
        tmp_path / "fruit" / "split_folder.json",
        tmp_path / "fruit" / "split_fewshot" / "shot_1-seed_1.json",
    ):
        # 0666 less the umask, as open() would
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644, path


def test_one_class_base_to_novel_and_one_class_splits(tmp_path, capsys):
    one = fruit_folder(tmp_path / "one", classes=("pear",), n=4)
    for part in ("base", "novel"):
        with pytest.raises(
            data.DataError, match=r"base-to-novel needs at least 2 classes .*has 1\."
        ):
            data.build_dataset(one, None, subsample=part)
    assert data.build_dataset(one, None).warnings == [
        f"{one} has only one class (pear): every prediction is "
        "that class, so its accuracy is 100% by construction"
    ]
    three = fruit_folder(tmp_path / "three", n=4)  # base: pear, plum; novel: red apple alone
    novel = data.build_dataset(three, None, subsample="novel")
    assert novel.classnames == ["red apple"] and len(novel.warnings) == 1
    assert "(novel classes) has only one class (red apple)" in novel.warnings[0]
    assert "warning: " + novel.warnings[0] in capsys.readouterr().err
    assert data.build_dataset(three, None, subsample="base").warnings == []


def test_shots_above_what_a_class_has_warn_and_real_shots_are_kept(tmp_path):
    build_uneven_dtd(str(tmp_path))  # train images per class: 6, 7, 1, 5, 9
    ds = data.build_dataset("dtd", str(tmp_path), shots=8, seed=1)
    assert ds.shots_per_class == [6, 7, 1, 5, 8]  # min(8, n) by hand
    assert ds.warnings == [
        "--shots 8: 4 of 5 classes have fewer training images (fewest: braided, 1); they keep "
        "all they have, as in CoOp, so the real shots per class are 1..8"
    ]
    assert data.build_dataset("dtd", str(tmp_path), shots=1, seed=1).warnings == []
    # bubbly 5, bumpy 9
    novel = data.build_dataset("dtd", str(tmp_path), shots=6, seed=1, subsample="novel")
    assert novel.shots_per_class == [5, 6] and "1 of 2 classes (novel classes)" in novel.warnings[0]


def test_toyworld_is_read_through_the_json_machinery(tmp_path):
    """data.py only reads the toy world (toyworld.py writes it);
    until then it names the command that makes it."""
    root = tmp_path / "new_root"
    with pytest.raises(data.DataError, match="python toyworld.py dataset"):
        data.build_dataset("toyworld", str(root), shots=2, seed=1)
    folder = os.path.join(root, "toyworld")
    entries = {
        s: [
            (f"{c}/{s}_{i}.png", y, c)
            for y, c in enumerate(["red_circle", "blue_square"])
            for i in range(3)
        ]
        for s in ("train", "val", "test")
    }
    write_split(
        os.path.join(folder, "split_zhou_ToyWorld.json"), os.path.join(folder, "images"), entries
    )
    ds = data.build_dataset("toyworld", str(root), shots=2, seed=1)
    assert ds.classnames == ["red circle", "blue square"] and ds.template == "a photo of a {}."
    assert len(ds.train) == 4 and len(ds.test) == 6
    assert (root / "toyworld" / "split_fewshot" / "shot_2-seed_1.json").exists()


# ------------------------------------------------------------------------------ transforms, loaders


def test_transforms_shapes_normalisation_and_determinism():
    image = Image.new("L", (60, 40), color=128)  # grayscale and not square
    x = data.test_transform(32)(image)
    assert x.shape == (3, 32, 32)
    want = (128 / 255 - torch.tensor(data.CLIP_MEAN)) / torch.tensor(data.CLIP_STD)
    assert torch.allclose(x.mean(dim=(1, 2)), want, atol=1e-5)
    assert torch.equal(x, data.test_transform(32)(image))
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    aug = data.train_transform(32)
    torch.manual_seed(0)
    a = aug(rgb)
    torch.manual_seed(0)
    b = aug(rgb)
    c = aug(rgb)
    assert a.shape == (3, 32, 32) and torch.equal(a, b) and not torch.equal(a, c)


def _normalise(pil):
    x = torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0).permute(2, 0, 1)  # [3, H, W]
    mean, std = torch.tensor(data.CLIP_MEAN), torch.tensor(data.CLIP_STD)
    return (x - mean[:, None, None]) / std[:, None, None]


def test_test_transform_resizes_the_shorter_side_then_crops_the_centre():
    """On a 60x40 image of noise with a bright left edge, CLIP's preprocess (shorter side to 32,
    bicubic, then the central 32x32) is matched by hand; a squash to 32x32, a crop without resize, a
    bilinear resize and a corner crop each give other pixels (on a uniform grey image they all
    agree)."""
    pixels = np.random.default_rng(3).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    pixels[:, :10] = 255  # cut away by the centre crop
    image = Image.fromarray(pixels)
    x = data.test_transform(32)(image)
    want = _normalise(image.resize((48, 32), Image.BICUBIC).crop((8, 0, 40, 32)))
    assert torch.allclose(x, want, atol=1e-5)
    wrong = {
        "squash": image.resize((32, 32), Image.BICUBIC),
        "crop only": image.crop((14, 4, 46, 36)),
        "bilinear": image.resize((48, 32), Image.BILINEAR).crop((8, 0, 40, 32)),
        "left crop": image.resize((48, 32), Image.BICUBIC).crop((0, 0, 32, 32)),
    }
    for rule, pil in wrong.items():
        assert (x - _normalise(pil)).abs().max() > 0.1, rule


def test_train_transform_is_a_seeded_random_resized_crop_with_its_scale_and_a_flip():
    """The train pipeline redone by hand from the same torch RNG: RandomResizedCrop's box drawn with
    scale (min_scale, 1) and ratio (3/4, 4/3), a bicubic resize of that box, then a flip when
    torch.rand(1) < 0.5. On a non-uniform image a wrong scale (0.08, torchvision's default),
    interpolation or flip rule gives other pixels."""
    from torchvision import transforms as TV
    from torchvision.transforms import functional as F

    image = Image.fromarray(np.random.default_rng(4).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    flips = set()
    for seed in range(6):
        for min_scale in (0.7, 0.3):
            torch.manual_seed(seed)
            x = data.train_transform(32, min_scale=min_scale)(image)
            torch.manual_seed(seed)
            box = TV.RandomResizedCrop.get_params(
                image, scale=(min_scale, 1.0), ratio=(3 / 4, 4 / 3)
            )
            crop = F.resized_crop(image, *box, [32, 32], interpolation=TV.InterpolationMode.BICUBIC)
            flip = bool(torch.rand(1) < 0.5)
            flips.add(flip)
            want = _normalise(crop.transpose(Image.FLIP_LEFT_RIGHT) if flip else crop)
            assert torch.allclose(x, want, atol=1e-5), (seed, min_scale)
            h, w = box[2], box[3]
            assert min_scale * 0.99 <= h * w / (40 * 60) <= 1.0  # the area the scale allows
            torch.manual_seed(seed)
            other = TV.RandomResizedCrop.get_params(image, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
            assert other != box or min_scale == 0.08
    assert flips == {True, False}  # both branches were seen


def test_pipelines_equal_torchvisions_bit_for_bit():
    """data.py's pipelines are written with PIL and torch; torchvision's own transforms are the
    statement of what they must do. Bit for bit, from the same RNG state, on noise images of several
    modes and shapes: 44x40 (the resized side is 35.2 -> 35, a rounding resize gives 36, and the
    centre crop's odd margin 3 starts at round(1.5) = 2, a floor at 1), 61x40, a square, 200x7 and
    7x200 (no box fits in 10 tries: the fallback crop, full height or full width)."""
    from torchvision import transforms as TV

    bicubic = TV.InterpolationMode.BICUBIC
    norm = [TV.ToTensor(), TV.Normalize(data.CLIP_MEAN, data.CLIP_STD)]
    rgb = [TV.Lambda(data.to_rgb)]
    fallbacks = set()
    for w, h in ((44, 40), (61, 40), (33, 33), (200, 7), (7, 200)):
        pixels = np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8)
        for mode in ("RGB", "L", "P"):
            image = Image.fromarray(pixels).convert(mode)
            want = TV.Compose(rgb + [TV.Resize(32, bicubic), TV.CenterCrop(32)] + norm)(image)
            assert torch.equal(data.test_transform(32)(image), want), (w, h, mode)
            for seed in range(4):
                for min_scale in (0.08, 0.5):
                    crop = TV.RandomResizedCrop(32, scale=(min_scale, 1.0), interpolation=bicubic)
                    tv = TV.Compose(rgb + [crop, TV.RandomHorizontalFlip()] + norm)
                    torch.manual_seed(seed)
                    want = tv(image)
                    torch.manual_seed(seed)
                    ours = data.train_transform(32, min_scale=min_scale)(image)
                    assert torch.equal(ours, want), (w, h, mode, seed, min_scale)
                    torch.manual_seed(seed)
                    if 7 in data.random_crop_box(w, h, min_scale)[2:]:  # (h, w) of the box
                        fallbacks.add((w, h))
    assert fallbacks == {(200, 7), (7, 200)}  # the fallback crop was taken, both ways
    # a box as wide (or as tall) as the image is taken, not drawn again: 10x10, scale (0.9, 1)
    full, square = 0, Image.new("RGB", (10, 10))
    for seed in range(20):
        torch.manual_seed(seed)
        want = TV.RandomResizedCrop.get_params(square, scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3))
        torch.manual_seed(seed)
        assert data.random_crop_box(10, 10, 0.9) == want, seed
        full += 10 in want[2:]
    assert full > 0


def make_items(tmp_path, n=10):
    items = []
    for i in range(n):
        path = str(tmp_path / f"img{i}.png")
        make_image(path, seed=i, size=(20, 16))
        items.append((path, i, f"class {i}"))
    return items


def test_loader_shuffle_is_seeded_and_batches_have_shape(tmp_path):
    items = make_items(tmp_path)
    order = lambda seed: [
        y.tolist() for _, y in data.make_loader(items, data.test_transform(16), 4, True, seed=seed)
    ]
    assert order(0) == order(0) and order(0) != order(1)
    # drop_last on train, as Dassl
    assert len(order(0)) == 2 and sorted(sum(order(0), [])) != list(range(10))
    batches = list(data.make_loader(items, data.test_transform(16), 4, shuffle=False))
    assert [b[0].shape[0] for b in batches] == [4, 4, 2] and batches[0][0].shape == (4, 3, 16, 16)
    assert torch.cat([b[1] for b in batches]).tolist() == list(range(10))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_image_raises_data_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "bad.jpg"
    good = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
        good, "JPEG"
    )
    path.write_bytes(b"not an image at all" if damage == "garbage" else good.getvalue()[:400])
    with pytest.raises(data.DataError, match="bad.jpg"):
        data.ImageList([(str(path), 0, "x")], data.test_transform(16))[0]
    if damage == "garbage":  # a worker process re-raises it as the same type, with only the message
        with pytest.raises(data.DataError) as here:
            data.ImageList([(str(path), 0, "x")], data.test_transform(16))[0]
        with pytest.raises(data.DataError) as err:
            next(
                iter(
                    data.make_loader(
                        [(str(path), 0, "x")], data.test_transform(16), 1, False, num_workers=1
                    )
                )
            )
        assert str(err.value) == str(here.value) and str(here.value).startswith(
            f"cannot read image {path} ("
        )
        # one line, not the worker's traceback
        assert "\n" not in str(err.value) and "Traceback" not in str(err.value)


def test_too_large_image_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "huge.png"
    make_image(str(path), size=(20, 16))  # 320 pixels
    # PIL refuses above twice this: a decompression bomb
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(
        data.DataError, match=f"image {path} is too large to open safely .*320 pixels"
    ):
        data.ImageList([(str(path), 0, "x")])[0]


def test_16_bit_images_are_scaled_to_8_bit(tmp_path):
    # 8-bit: 0, 100, 255, 50
    levels = np.array([[0, 257 * 100], [65535, 257 * 50 + 100]], dtype=np.uint16)
    want = np.array([[0, 100], [255, 50]], dtype=np.uint8)
    path = tmp_path / "deep.png"
    Image.fromarray(levels).save(path)
    with Image.open(path) as im:
        assert im.mode.startswith("I")  # how PIL opens a 16-bit grayscale PNG
    rgb = np.asarray(data.ImageList([(str(path), 0, "x")])[0][0])
    assert rgb.shape == (2, 2, 3) and all((rgb[..., k] == want).all() for k in range(3))
    wide = Image.fromarray(levels.astype(np.int32))  # mode "I", as older PIL opens 16-bit PNGs
    assert wide.mode == "I" and (np.asarray(data.to_rgb(wide))[..., 0] == want).all()
    # "I" holding 8-bit levels
    small = Image.fromarray(np.array([[0, 100], [255, 50]], dtype=np.int32))
    assert (np.asarray(data.to_rgb(small))[..., 1] == want).all()


# ---------------------------------------------------------------------------------------- bad input


def test_bad_input_each_stops_with_one_clear_error(tmp_path):
    root = str(tmp_path)
    cases = [
        (
            lambda: data.build_dataset("eurosat", root + "/missing"),
            ["data root not found", "missing", "--root"],
        ),
        (lambda: data.build_dataset("eurosat", root), ["EuroSAT folder not found", "eurosat/2750"]),
        (lambda: data.build_dataset("oxford_pets", root, shots=0), ["shots", "-1"]),
        (lambda: data.build_dataset("oxford_pets", root, shots=-3), ["shots"]),
        (lambda: data.build_dataset("dtd", root, subsample="half"), ["subsample"]),
        (
            lambda: data.build_dataset("euro_sat", root),
            ["unknown dataset", "Did you mean: eurosat"],
        ),
        (lambda: data.build_dataset("DescribableTextures", root), ["Did you mean: dtd"]),
        (lambda: data.build_dataset(f"folder:{root}/nope", root), ["folder dataset not found"]),
    ]
    for call, words in cases:
        with pytest.raises(data.DataError) as err:
            call()
        for w in words:
            assert w in str(err.value), (w, str(err.value))
    os.makedirs(tmp_path / "eurosat" / "2750")
    with pytest.raises(data.DataError) as err:
        data.build_dataset("eurosat", root)
    msg = str(err.value)
    assert "split_zhou_EuroSAT.json" in msg and "1Ip7yaCWFi0eaOFUGga0lUdVi_DDQth1o" in msg
    assert "python data.py download eurosat" in msg


def test_malformed_split_and_missing_image(tmp_path):
    build_json_layout(str(tmp_path), "food101")
    split_path = tmp_path / "food-101" / "split_zhou_Food101.json"
    os.remove(tmp_path / "food-101" / "images" / "baklava" / "test1.jpg")
    with pytest.raises(data.DataError, match="missing on disk: .*baklava/test1.jpg"):
        data.build_dataset("food101", str(tmp_path))
    split_path.write_text('{"train": [["a.jpg", 0]], "val": [], "test": []}')
    with pytest.raises(data.DataError, match="malformed split file"):
        data.build_dataset("food101", str(tmp_path))


def test_large_splits_check_a_sample_then_fail_at_load(tmp_path, monkeypatch):
    # 15 train items: checks items 0, 7, 14 with a limit of 2
    build_json_layout(str(tmp_path), "food101")
    monkeypatch.setattr(data, "CHECK_LIMIT", 2)
    ds = data.build_dataset("food101", str(tmp_path))
    os.remove(ds.train[3][0])
    # not in the checked sample: building still works
    ds = data.build_dataset("food101", str(tmp_path))
    with pytest.raises(data.DataError, match="missing on disk"):
        data.ImageList(ds.train)[3]
    os.remove(ds.train[7][0])
    with pytest.raises(data.DataError, match="missing on disk"):
        data.build_dataset("food101", str(tmp_path))


def test_fgvc_unknown_variant(tmp_path):
    build_fgvc(str(tmp_path), "fgvc_aircraft")
    with open(tmp_path / "fgvc_aircraft" / "images_variant_test.txt", "a") as f:
        f.write("1234567 Concorde\n")
    with pytest.raises(data.DataError, match="Concorde"):
        data.build_dataset("fgvc_aircraft", str(tmp_path))


def test_cli_check_and_errors(tmp_path, capsys):
    build_json_layout(str(tmp_path), "eurosat")
    assert (
        data.main(
            ["check", "eurosat", "--root", str(tmp_path), "--shots", "2", "--subsample", "base"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "classes: 2 (base)" in out and "train 4 | val 4 | test 4" in out
    assert "a centered satellite photo of Annual Crop Land." in out
    assert data.main(["check", "eurosat", "--root", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data root not found") and "Traceback" not in err
    with pytest.raises(SystemExit):
        data.main(["--help"])
    assert "imagenet_a" in capsys.readouterr().out


def test_cli_check_opens_every_image(tmp_path, capsys):
    build_json_layout(str(tmp_path), "eurosat")  # 30 images
    assert data.main(["check", "eurosat", "--root", str(tmp_path)]) == 0
    assert "opening the images of eurosat 30/30" in capsys.readouterr().err
    ds = data.build_dataset("eurosat", str(tmp_path))
    bad = ds.test[-1][0]
    with open(bad, "wb") as f:
        f.write(b"not an image")
    # the lists alone look fine
    assert data.main(["check", "eurosat", "--root", str(tmp_path), "--no-images"]) == 0
    capsys.readouterr()
    assert data.main(["check", "eurosat", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: 1 of 30 images of eurosat cannot be read:\ncannot read image {bad} (" in err
    assert "Traceback" not in err


def test_check_on_a_missing_root_says_so_once(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert data.main(["check", "eurosat", "dtd", "food101", "--root", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("data root not found") == 1 and err.startswith(
        f"error: data root not found: {missing} (needed by eurosat, dtd, food101)"
    )
    with pytest.raises(data.DataError, match="data root not found"):
        data.check_root(["caltech101"], missing)
    data.check_root([f"folder:{tmp_path}", "toyworld"], missing)  # these do not live under --root
    build_json_layout(str(tmp_path), "eurosat")
    seen = []
    errors = data.check_datasets(
        ["eurosat", "dtd"], str(tmp_path), report=lambda n, ds, e: seen.append((n, bool(ds)))
    )
    assert (
        seen == [("eurosat", True), ("dtd", False)]
        and list(errors) == ["dtd"]
        and "dtd" in errors["dtd"]
    )


# ------------------------------------------------------------------------------- hostile folders


def test_small_classes_each_get_a_test_image_or_stop(tmp_path, capsys):
    """3 images per class: 2 train, 0 val, 1 test (the 50/20/30 rule gave 2/1/0: an empty test
    split, "0.00% of 0"); 2 images: 1/0/1; 1 image: nothing to test on, so the split stops and names
    the class."""
    name = fruit_folder(tmp_path / "three", n=3)
    ds = data.build_dataset(name, None)
    assert (len(ds.train), len(ds.val), len(ds.test)) == (6, 0, 3)
    assert sorted(y for _, y, _ in ds.test) == [0, 1, 2]
    two = data.build_dataset(fruit_folder(tmp_path / "two", n=2), None)
    assert (len(two.train), len(two.val), len(two.test)) == (3, 0, 3)
    one = fruit_folder(tmp_path / "one", classes=("pear", "plum"), n=1)
    with pytest.raises(
        data.DataError,
        match=r"2 class folder\(s\) of .*one hold fewer than 2 "
        r"images \(pear: 1, plum: 1; .*at least 2 per class",
    ):
        data.build_dataset(one, None)
    assert not os.path.exists(tmp_path / "one" / "split_folder.json")  # nothing written
    assert data.main(["check", one, "--no-images"]) == 2  # data.py check says it too
    assert "at least 2 per class" in capsys.readouterr().err


def test_a_kept_split_without_test_images_stops(tmp_path, capsys):
    """A split kept from before (2/1/0 for 3 images) is refused, naming the file to delete, in
    data.py check too."""
    name = fruit_folder(tmp_path / "fruit", n=3)
    split_file = tmp_path / "fruit" / "split_folder.json"
    items = [
        (f"{c}/{i:02d}.png", y, c)
        for y, c in enumerate(("pear", "plum", "red_apple"))
        for i in range(3)
    ]
    split = {
        "train": [e for e in items if e[0].endswith(("00.png", "01.png"))],
        "val": [e for e in items if e[0].endswith("02.png")],
        "test": [],
    }
    split_file.write_text(json.dumps(split))
    for subsample in ("all", "novel"):
        with pytest.raises(data.DataError, match=f"empty test split.*delete {split_file}"):
            data.build_dataset(name, None, subsample=subsample)
    split["test"], split["val"] = split["val"][:1], split["val"][1:]  # pear tested, the rest not
    split_file.write_text(json.dumps(split))
    with pytest.raises(
        data.DataError, match=f"{split_file} gives 2 class.*no test image .plum, red_apple."
    ):
        data.build_dataset(name, None)
    assert data.main(["check", name, "--no-images"]) == 2
    assert "no test image" in capsys.readouterr().err


def test_images_in_sub_folders_are_named(tmp_path, capsys):
    name = fruit_folder(tmp_path / "fruit", n=4)
    for i in range(2):
        make_image(str(tmp_path / "fruit" / "plum" / "old" / f"{i}.png"), seed=i)
    ds = data.build_dataset(name, None)
    assert len(ds.train) + len(ds.val) + len(ds.test) == 12  # the nested two are not read ...
    want = (
        f"2 image(s) in sub-folders of the class folders of {tmp_path / 'fruit'} are left out "
        f"(plum/old/0.png, plum/old/1.png)"
    )
    assert [w for w in ds.warnings if w.startswith(want)]  # ... and named
    assert "move them up" in ds.warnings[-1]
    assert "warning: " + want in capsys.readouterr().err
    # a class whose images all sit in a sub-folder: say where they are, not "no images"
    for i in range(3):
        make_image(str(tmp_path / "more" / "kiwi" / "2020" / f"{i}.png"), seed=i)
    fruit_folder(tmp_path / "more", classes=("pear",), n=4)
    with pytest.raises(data.DataError) as err:
        data.build_dataset(f"folder:{tmp_path / 'more'}", None)
    assert (
        f"class folder {tmp_path / 'more' / 'kiwi'} holds no images directly; its 3 image(s) are "
        "in sub-folders (2020/0.png, 2020/1.png, 2020/2.png): move them up" in str(err.value)
    )


def test_a_class_named_like_the_fewshot_cache_is_refused(tmp_path):
    """split_fewshot/ is where the few-shot subsets are cached: a class of that name was dropped
    from the split and got the cache files written among its images."""
    name = fruit_folder(tmp_path / "fruit", classes=("pear", "split_fewshot"), n=4)
    with pytest.raises(
        data.DataError,
        match=r"split_fewshot holds images, but split_fewshot is the "
        r"name of the few-shot cache's folder.*rename that "
        r"class folder",
    ):
        data.build_dataset(name, None, shots=1)
    assert not os.path.exists(tmp_path / "fruit" / "split_folder.json")
    assert sorted(os.listdir(tmp_path / "fruit" / "split_fewshot")) == [
        f"0{i}.png" for i in range(4)
    ]
    os.rename(tmp_path / "fruit" / "split_fewshot", tmp_path / "fruit" / "fig")  # the fix named
    assert data.build_dataset(name, None, shots=1).classnames == ["fig", "pear"]
    assert (tmp_path / "fruit" / "split_fewshot" / "shot_1-seed_1.json").exists()  # the cache
    assert data.build_dataset(name, None, shots=1).classnames == ["fig", "pear"]


def test_an_empty_folder_path_is_refused(tmp_path, monkeypatch):
    """`--dataset folder:$UNSET` read the current directory and wrote its split there."""
    fruit_folder(tmp_path, n=4)
    monkeypatch.chdir(tmp_path)
    for name in ("folder:", "folder:  "):
        with pytest.raises(
            data.DataError, match=r"folder: needs a path .*empty \(an unset variable\?\)"
        ):
            data.build_dataset(name, None)
    assert not os.path.exists(tmp_path / "split_folder.json")


def test_a_truncated_folder_split_says_delete_it(tmp_path):
    name = fruit_folder(tmp_path / "fruit", n=4)
    data.build_dataset(name, None)
    split_file = tmp_path / "fruit" / "split_folder.json"
    split_file.write_text(split_file.read_text()[:40])  # cut off
    for text in (split_file.read_text(), '{"train": [["a.png", 0]], "val": [], "test": []}'):
        split_file.write_text(text)
        with pytest.raises(data.DataError) as err:
            data.build_dataset(name, None)
        assert f"delete {split_file} to split the folder anew" in str(err.value)
        assert "download" not in str(err.value) and "github" not in str(err.value)


@pytest.mark.parametrize("kind", ["broken link", "folder"])
def test_entries_named_like_images_that_are_not_files_are_named(tmp_path, kind):
    """A broken symlink or a folder called x.png: re-splitting would list it again, so the message
    names the entry and says to fix or remove it, before any split is written."""
    name = fruit_folder(tmp_path / "fruit", n=4)
    bad = tmp_path / "fruit" / "plum" / "x.png"
    if kind == "broken link":
        os.symlink(str(tmp_path / "gone.png"), bad)
        why = f"a broken symbolic link (to {tmp_path / 'gone.png'})"
    else:
        bad.mkdir()
        why = "a folder, not an image file"
    with pytest.raises(data.DataError) as err:
        data.build_dataset(name, None)
    assert f"{bad} is {why}" in str(err.value) and "Fix or remove them" in str(err.value)
    assert "split" not in str(err.value)
    assert not os.path.exists(tmp_path / "fruit" / "split_folder.json")
    # a split kept from before that lists it: name it the same way, not "split anew"
    split = {
        "train": [["plum/x.png", 0, "plum"], ["plum/00.png", 0, "plum"]],
        "val": [],
        "test": [[f"plum/0{i}.png", 0, "plum"] for i in (1, 2, 3)],
    }
    shutil.rmtree(tmp_path / "fruit" / "pear")
    shutil.rmtree(tmp_path / "fruit" / "red_apple")
    (tmp_path / "fruit" / "split_folder.json").write_text(json.dumps(split))
    with pytest.raises(data.DataError) as err:
        data.build_dataset(name, None)
    assert f"image listed in the train split is {why}: {bad}; fix it, or remove" in str(err.value)
    assert "anew" not in str(err.value)


def test_cli_refuses_shots_below_one_like_dear_py(tmp_path, capsys):
    build_json_layout(str(tmp_path), "eurosat")
    for shots in ("-1", "0"):
        args = ["check", "eurosat", "--root", str(tmp_path), "--no-images", "--shots", shots]
        assert data.main(args) == 2
        err = capsys.readouterr().err
        assert err == f"error: --shots must be >= 1, got {shots}\n"
    assert data.main(["check", "eurosat", "--root", str(tmp_path), "--no-images"]) == 0  # all
    assert "train 15 | val 9 | test 6" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- downloads


class Server:
    """A local HTTP server with fixed routes: path -> (content type, body[, announced length])."""

    def __init__(self):
        self.routes = {}
        routes = self.routes

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                path, _, query = self.path.partition("?")
                key = path + ("?" + query.split("&")[0] if path.startswith("/drive") else "")
                if key not in routes:
                    self.send_error(404)
                    return
                kind, body, *length = routes[key]
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(length[0] if length else len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # a short poll: shutdown() waits for the loop to look (0.5 s by default, per test)
        serve = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        serve.start()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def zip_bytes(files):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
    return buf.getvalue()


def tar_bytes(files, links=()):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            t.addfile(info, io.BytesIO(body))
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            t.addfile(info)
    return buf.getvalue()


def png_bytes(seed):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
        buf, "PNG"
    )
    return buf.getvalue()


def fake_eurosat(server):
    """EuroSAT.zip (2750/<class>/*.jpg) and its split JSON, served like the real sources."""
    files, entries = {}, {"train": [], "val": [], "test": []}
    for y, (folder, name) in enumerate([("AnnualCrop", "Annual Crop Land"), ("Forest", "Forest")]):
        for s, n in SIZES.items():
            for i in range(n):
                files[f"2750/{folder}/{folder}_{s}{i}.jpg"] = png_bytes(i)
                entries[s].append([f"{folder}/{folder}_{s}{i}.jpg", y, name])
    archive = zip_bytes(files)
    server.routes["/files/EuroSAT.zip"] = ("application/zip", archive)
    split_id = data.DATASETS["eurosat"].drive
    server.routes[f"/drive?id={split_id}"] = ("application/json", json.dumps(entries).encode())
    return archive


def test_download_eurosat_end_to_end(tmp_path, server):
    archive = fake_eurosat(server)
    sources = {
        "eurosat": [
            download.Source(
                url=server.url + "/files/EuroSAT.zip",
                md5=hashlib.md5(archive).hexdigest(),
                extract_to="eurosat",
                creates="eurosat/2750",
            )
        ]
    }
    drive = server.url + "/drive"
    download.download_dataset(
        data.DATASETS["eurosat"], str(tmp_path), sources=sources, gdrive_url=drive
    )
    ds = data.build_dataset("eurosat", str(tmp_path), shots=2)
    assert ds.classnames == ["Annual Crop Land", "Forest"] and len(ds.test) == 4
    # archive removed after unpacking, no .part left
    assert os.listdir(tmp_path / ".downloads") == []
    server.routes.clear()  # a second run finds everything present and downloads nothing
    download.download_dataset(
        data.DATASETS["eurosat"], str(tmp_path), sources=sources, gdrive_url=drive
    )


def test_cli_download_with_mirror(tmp_path, server, monkeypatch):
    fake_eurosat(server)
    monkeypatch.setitem(
        download.SOURCES,
        "eurosat",
        [
            download.Source(
                url="https://example.invalid/some/path/EuroSAT.zip",
                extract_to="eurosat",
                creates="eurosat/2750",
            )
        ],
    )
    assert (
        data.main(
            [
                "download",
                "eurosat",
                "--root",
                str(tmp_path),
                "--mirror",
                server.url + "/files",
                "--gdrive-url",
                server.url + "/drive",
            ]
        )
        == 0
    )
    assert len(data.build_dataset("eurosat", str(tmp_path)).train) == 10


def test_tampered_archive_is_rejected_and_nothing_unpacked(tmp_path, server):
    archive = fake_eurosat(server)
    server.routes["/files/EuroSAT.zip"] = ("application/zip", archive[:-10] + b"0123456789")
    src = download.Source(
        url=server.url + "/files/EuroSAT.zip",
        md5=hashlib.md5(archive).hexdigest(),
        extract_to="eurosat",
    )
    with pytest.raises(download.DownloadError, match="MD5"):
        download.fetch_source(src, str(tmp_path))
    assert not (tmp_path / "eurosat").exists() and os.listdir(tmp_path / ".downloads") == []


def test_cut_off_unpack_is_not_taken_for_a_finished_download(tmp_path, server, monkeypatch):
    archive = fake_eurosat(server)  # 20 images under 2750/
    src = download.Source(
        url=server.url + "/files/EuroSAT.zip",
        md5=hashlib.md5(archive).hexdigest(),
        extract_to="eurosat",
        creates="eurosat/2750",
    )
    real, calls = zipfile.ZipFile._extract_member, []

    def cut_off(self, *args, **kwargs):  # the unpack stops (Ctrl-C, full disk) after 5 members
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "_extract_member", cut_off)
    with pytest.raises(KeyboardInterrupt):
        download.fetch_source(src, str(tmp_path))
    # nothing half-done in place
    assert len(calls) == 6 and not (tmp_path / "eurosat" / "2750").exists()
    monkeypatch.setattr(zipfile.ZipFile, "_extract_member", real)
    download.fetch_source(src, str(tmp_path))  # the rerun unpacks again, from scratch
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "eurosat" / "2750") for f in fs]
    assert len(files) == 20 and os.listdir(tmp_path / ".downloads") == []


def test_unpack_merges_into_existing_folders_and_moves(tmp_path, server):
    server.routes["/files/dtd.tar.gz"] = (
        "application/gzip",
        tar_bytes({"dtd/images/banded/x.jpg": b"1", "dtd/labels/all.txt": b"2"}),
    )
    server.routes["/files/fgvc.tar.gz"] = (
        "application/gzip",
        tar_bytes({"fgvc-2013b/data/variants.txt": b"3", "fgvc-2013b/evaluation.m": b"4"}),
    )
    (tmp_path / "dtd").mkdir()
    # already there: kept
    (tmp_path / "dtd" / "split_zhou_DescribableTextures.json").write_text("{}")
    download.fetch_source(
        download.Source(url=server.url + "/files/dtd.tar.gz", extract_to=".", creates="dtd/images"),
        str(tmp_path),
    )
    download.fetch_source(
        download.Source(
            url=server.url + "/files/fgvc.tar.gz",
            extract_to=".",
            creates="fgvc_aircraft/variants.txt",
            move=("fgvc-2013b/data", "fgvc_aircraft"),
        ),
        str(tmp_path),
    )
    assert sorted(os.listdir(tmp_path / "dtd")) == [
        "images",
        "labels",
        "split_zhou_DescribableTextures.json",
    ]
    assert (tmp_path / "dtd" / "images" / "banded" / "x.jpg").read_bytes() == b"1"
    assert (tmp_path / "fgvc_aircraft" / "variants.txt").read_bytes() == b"3"
    assert (tmp_path / "fgvc-2013b" / "evaluation.m").read_bytes() == b"4"
    assert os.listdir(tmp_path / ".downloads") == []


def test_cut_off_download_is_rejected(tmp_path, server):
    server.routes["/files/a.tar.gz"] = ("application/gzip", b"x" * 100, 5000)
    with pytest.raises(download.DownloadError, match="again"):
        download.fetch_url(server.url + "/files/a.tar.gz", str(tmp_path / "a.tar.gz"))
    assert os.listdir(tmp_path) == []


def zip_with_symlink(name, target):
    """A zip whose member carries the symlink mode bits (as `zip --symlinks` writes),
    body = the link target."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("ok.txt", b"1")
        info = zipfile.ZipInfo(name)
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        z.writestr(info, target)
    return buf.getvalue()


def tar_members(entries):
    """A tar from (name, kind, body or link target) in order; kind:
    file | dir | sym | hard | fifo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, kind, arg in entries:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(arg)
                t.addfile(info, io.BytesIO(arg))
                continue
            info.type = {
                "dir": tarfile.DIRTYPE,
                "sym": tarfile.SYMTYPE,
                "hard": tarfile.LNKTYPE,
                "fifo": tarfile.FIFOTYPE,
            }[kind]
            info.linkname = arg
            t.addfile(info)
    return buf.getvalue()


# Each attack: (archive bytes given the test folder, the expected refusal). The target folder is
# T/x, so T/xy is a sibling whose path starts with the target's: a plain string-prefix test takes it
# for inside.
ATTACKS = {
    "zip-dotdot": (
        lambda T: zip_bytes({"ok.txt": b"1", "../evil.txt": b"2"}),
        r"member \.\./evil\.txt climbs out of the target folder",
    ),
    "zip-sibling": (
        lambda T: zip_bytes({"ok.txt": b"1", "../xy/evil.txt": b"2"}),
        r"member \.\./xy/evil\.txt climbs out of the target folder",
    ),
    "zip-absolute": (
        lambda T: zip_bytes({"ok.txt": b"1", f"{T}/xy/evil.txt": b"2"}),
        r"member /.*/xy/evil\.txt has an absolute path",
    ),
    "zip-symlink": (lambda T: zip_with_symlink("link", "../xy"), r"member link is a symbolic link"),
    "tar-dotdot": (
        lambda T: tar_bytes({"ok.txt": b"1", "sub/../../evil.txt": b"2"}),
        r"member sub/\.\./\.\./evil\.txt climbs out of the target folder",
    ),
    "tar-sibling": (
        lambda T: tar_bytes({"ok.txt": b"1", "../xy/evil.txt": b"2"}),
        r"member \.\./xy/evil\.txt climbs out of the target folder",
    ),
    "tar-absolute": (
        lambda T: tar_bytes({"ok.txt": b"1", f"{T}/xy/evil.txt": b"2"}),
        r"member /.*/xy/evil\.txt has an absolute path",
    ),
    "tar-symlink-out": (
        lambda T: tar_bytes({"ok.txt": b"1"}, links=[("link", "../xy")]),
        r"link link -> \.\./xy climbs out of the target folder",
    ),
    "tar-symlink-absolute": (
        lambda T: tar_bytes({"ok.txt": b"1"}, links=[("link", f"{T}/xy")]),
        r"link link -> /.*/xy has an absolute path",
    ),
    # y -> "." and x -> "y/.." both look inside by name, but on disk x is the target's parent:
    # x/xy/evil.txt would be written outside. The check refuses the link that steps through another
    # link.
    "tar-symlink-chain": (
        lambda T: tar_members(
            [
                ("ok.txt", "file", b"1"),
                ("y", "sym", "."),
                ("x", "sym", "y/.."),
                ("x/xy/evil.txt", "file", b"2"),
            ]
        ),
        r"link x -> y/\.\. goes through the link y of the same archive",
    ),
    "tar-through-link": (
        lambda T: tar_members(
            [
                ("ok.txt", "file", b"1"),
                ("d", "sym", "sub"),
                ("sub", "dir", ""),
                ("d/evil.txt", "file", b"2"),
            ]
        ),
        r"member d/evil\.txt goes through the link d of the same archive",
    ),
    "tar-hardlink-out": (
        lambda T: tar_members([("ok.txt", "file", b"1"), ("h", "hard", "../xy/secret.txt")]),
        r"link h -> \.\./xy/secret\.txt climbs out of the target folder",
    ),
    "tar-hardlink-via-symlink": (
        lambda T: tar_members(
            [("ok.txt", "file", b"1"), ("s", "sym", "."), ("h", "hard", "s/../xy/secret.txt")]
        ),
        r"link h -> s/\.\./xy/secret\.txt goes through the link s",
    ),
    "tar-pipe": (
        lambda T: tar_members([("ok.txt", "file", b"1"), ("pipe", "fifo", "")]),
        r"member pipe is a device or pipe",
    ),
}


@pytest.mark.parametrize("kind", sorted(ATTACKS))
def test_escaping_archive_is_refused_by_its_own_check(tmp_path, monkeypatch, kind):
    """Refused by name, before anything is unpacked:
    the stdlib's extraction (and its own filter) never runs."""
    make, refusal = ATTACKS[kind]
    (tmp_path / "xy").mkdir()
    (tmp_path / "xy" / "secret.txt").write_bytes(b"secret")
    archive = tmp_path / "archive.bin"
    archive.write_bytes(make(str(tmp_path)))

    def never(*args, **kwargs):
        raise AssertionError("extraction started before the archive was refused")

    monkeypatch.setattr(tarfile.TarFile, "extractall", never)
    monkeypatch.setattr(zipfile.ZipFile, "extractall", never)
    target = tmp_path / "x"
    with pytest.raises(download.DownloadError, match=f"^{re.escape(str(archive))}: {refusal}"):
        download.safe_extract(str(archive), str(target))
    assert not target.exists() and sorted(os.listdir(tmp_path / "xy")) == ["secret.txt"]
    assert not (tmp_path / "evil.txt").exists()


def test_inside_is_a_folder_test_not_a_string_prefix():
    assert download._inside("/data/x", "/data/x/y") and download._inside("/data/x", "/data/x")
    assert not download._inside("/data/x", "/data/xy") and not download._inside(
        "/data/x", "/data/xy/z"
    )
    assert not download._inside("/data/x", "/data") and not download._inside(
        "/data/x", "/data/x/../xy"
    )


def test_safe_extract_keeps_an_honest_tar(tmp_path):
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(
        tar_bytes(
            {"dtd/images/banded/x.jpg": b"1"}, links=[("dtd/images/alias.jpg", "banded/x.jpg")]
        )
    )
    download.safe_extract(str(archive), str(tmp_path / "t"))
    assert (tmp_path / "t" / "dtd" / "images" / "alias.jpg").read_bytes() == b"1"
    # `tar -C dir .` style names, a link up to a folder inside, a hard link to a member
    archive.write_bytes(
        tar_members(
            [
                (".", "dir", ""),
                ("./d", "dir", ""),
                ("./d/a.txt", "file", b"2"),
                ("./d/e", "dir", ""),
                ("./d/e/up", "sym", ".."),
                ("./h.txt", "hard", "d/a.txt"),
            ]
        )
    )
    download.safe_extract(str(archive), str(tmp_path / "u"))
    assert (tmp_path / "u" / "d" / "e" / "up" / "a.txt").read_bytes() == b"2"
    assert (tmp_path / "u" / "h.txt").read_bytes() == b"2"


def test_google_drive_confirm_page_then_file(tmp_path, server):
    page = (
        '<html><form id="download-form" action="/drive2" method="get"><input type="hidden" '
        'name="id" value="BIG"><input type="hidden" name="export" value="download"><input '
        'type="hidden" name="confirm" value="t"><input type="hidden" name="uuid" '
        'value="u-1&amp;2"></form></html>'
    )
    server.routes["/drive?id=BIG"] = ("text/html; charset=utf-8", page.encode())
    server.routes["/drive2?id=BIG"] = ("application/octet-stream", b"the big file")
    dest = tmp_path / "big.bin"
    download.fetch_drive("BIG", str(dest), gdrive_url=server.url + "/drive")
    assert dest.read_bytes() == b"the big file"
    server.routes["/drive?id=BLOCKED"] = ("text/html", b"<html>Quota exceeded</html>")
    with pytest.raises(download.DownloadError, match="drive.google.com/file/d/BLOCKED/view"):
        download.fetch_drive("BLOCKED", str(tmp_path / "x.json"), gdrive_url=server.url + "/drive")


# ------------------------------------------------------------------ mutation survivors (mutate.sh)


def test_folder_split_messages_name_the_folder(tmp_path, capsys):
    """The first run says on stderr how many classes it split and where the split went; a changed
    folder's refusal starts with the folder's own path; a folder without class sub-folders says
    so."""
    folder = tmp_path / "fruit"
    data.build_dataset(fruit_folder(folder), None)
    split_file = folder / "split_folder.json"
    assert f"wrote the 3-class split of {folder} to {split_file}" in capsys.readouterr().err
    make_image(str(folder / "plum" / "99.png"))
    with pytest.raises(data.DataError) as err:
        data.build_dataset(f"folder:{folder}", None)
    assert str(err.value).startswith(f"{folder} no longer matches its split {split_file}")
    (tmp_path / "bare").mkdir()
    with pytest.raises(data.DataError, match=r"bare has no class sub-folders\.\nExpected layout"):
        data.build_dataset(f"folder:{tmp_path / 'bare'}", None)


def test_fewshot_split_samples_val_by_default(tmp_path):
    """fewshot_split(folder, split, shots, seed): val is sampled too (min(shots, 4) per class)
    unless sample_val=False, which keeps the val list as it is."""
    train = [(f"t{i}.png", i % 2, f"c{i % 2}") for i in range(12)]
    val = [(f"v{i}.png", i % 2, f"c{i % 2}") for i in range(10)]
    split = {"train": train, "val": val}
    got_train, got_val = data.fewshot_split(str(tmp_path / "a"), split, 2, 1)
    assert len(got_train) == 4 and len(got_val) == 4 and set(got_val) <= set(val)
    kept = data.fewshot_split(str(tmp_path / "b"), split, 2, 1, sample_val=False)[1]
    assert kept == val
    # the second call of each reads the cache: the same val as the draw (sampled, or the list kept)
    assert data.fewshot_split(str(tmp_path / "a"), split, 2, 1) == (got_train, got_val)
    assert data.fewshot_split(str(tmp_path / "b"), split, 2, 1, sample_val=False)[1] == val


def test_fewshot_split_without_a_writable_cache_says_so_and_goes_on(tmp_path, monkeypatch, capsys):
    def refuse(path, *a, **k):
        raise OSError("read-only")

    monkeypatch.setattr(data, "write_json_atomic", refuse)
    split = {"train": [(f"t{i}.png", i % 2, "c") for i in range(6)], "val": []}
    assert len(data.fewshot_split(str(tmp_path), split, 1, 1)[0]) == 2
    path = tmp_path / data.FEWSHOT_DIR / "shot_1-seed_1.json"
    err = capsys.readouterr().err
    assert f"note: could not cache the few-shot subset at {path} (read-only)" in err


def test_subsample_classes_keeps_all_by_default():
    items = [("a.png", 0, "a"), ("b.png", 1, "b"), ("c.png", 2, "c")]
    assert data.subsample_classes(items, items[:1], items) == (items, items[:1], items)


def test_transform_default_size_is_clip_224():
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    assert data.train_transform()(image).shape == (3, 224, 224)
    assert data.test_transform()(image).shape == (3, 224, 224)


def test_to_rgb_scales_mode_i_above_255_and_clips_outside_16_bit():
    """Mode "I" holding 256 is scaled (256 / 257 -> 1, not PIL's clip to 255); values outside
    0..65535 clip to 0 and 255 (a wrap-around through uint8 would give 254 and 0 or 16)."""
    just_above = np.array([[0, 256]], dtype=np.int32)  # its maximum is 256
    assert (np.asarray(data.to_rgb(Image.fromarray(just_above)))[..., 0] == [0, 1]).all()
    levels = np.array([[0, 256], [-514, 65792]], dtype=np.int32)
    got = np.asarray(data.to_rgb(Image.fromarray(levels)))[..., 0]
    assert (got == np.array([[0, 1], [0, 255]], dtype=np.uint8)).all()
    above = np.array([[70000, 257 * 7]], dtype=np.int32)  # 272 before the clip
    assert (np.asarray(data.to_rgb(Image.fromarray(above)))[..., 2] == [255, 7]).all()


# Equivalent mutants (mutate.sh), one line each:
# fewshot_split: "train"/"val" keys of the fingerprinted source renamed (4 mutants): labels
#   inside the hash only; this code alone writes and reads the cache, so any names draw and reuse
#   alike.
# fewshot_split: val fingerprinted also when sample_val is False: a new val list redraws train from
#   the same seed, the same subsets (only the cache file is rewritten).
# fewshot_split: the cache stores val when sample_val is False: a cache hit then returns
#   split["val"].
# to_rgb: np.asarray without dtype=np.float64 (2 mutants): the division by 257.0 is float64 anyway.
# to_rgb: .astype(None) instead of uint8: a float image of whole values 0..255 converts to the same
#   RGB bytes.
# random_crop_box: uniform_'s upper bound dropped (its default is 1.0); randint without its low 0
#   (the default, the same draw, 2 mutants); 0 <= w, 1 < w, 0 <= h, 1 < h: a drawn box is at least
#   sqrt(0.08 area / (4/3)) wide, never 0 or 1 pixel on the images of the tests (4 mutants); the
#   fallback's <= / >= at exactly ratio 3/4 or 4/3, `width * height` for its elif and `w, h = None`
#   in its last branch: only an image whose ratio lies inside (3/4, 4/3) reaches that branch, and
#   such an image never misses 10 draws (4 mutants).
# TrainTransform/EvalTransform: resize's resample BICUBIC -> None or left out (Pillow's default for
#   RGB is BICUBIC); to_tensor's std left out (clip.STD holds the same values as CLIP_STD);
#   torch.rand(1) <= 0.5 (only a draw of exactly 0.5 differs); __init__ default sizes (mutmut keeps
#   the original signature).

"""data.py and download.py: every CoOp reader on tiny fake datasets in the real layouts, few-shot subsets
equal to Dassl's, base/novel, transforms, loaders, bad input, and downloads from a local HTTP server."""
import collections
import hashlib
import http.server
import io
import json
import os
import random
import shutil
import sys
import tarfile
import threading
import types
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
    """entries: {split: [(relative path, label, classname)]}; writes the images and the JSON (indent 4, as Dassl)."""
    for n, (rel, _, _) in enumerate(e for items in entries.values() for e in items):
        make_image(os.path.join(image_dir, rel), seed=n)
    with open(path, "w") as f:
        json.dump({k: [list(e) for e in v] for k, v in entries.items()}, f, indent=4)


def interleave(per_class):
    """Items of several classes in a mixed order (labels not grouped), as in the real split files."""
    out, rng = [], random.Random(0)
    for items in per_class:
        out += items
    rng.shuffle(out)
    return out


# ------------------------------------------------------------------------------------------- layouts
# One builder per CoOp layout. Each returns (classnames as the model sees them, (n_train, n_val, n_test)).

SIZES = {"train": 5, "val": 3, "test": 2}

JSON_LAYOUTS = {  # name: (raw classnames as stored in the split JSON, relative path of image i of class c)
    "caltech101": (["accordion", "Leopards", "yin_yang"], lambda c, s, i: f"{c}/image_{s}{i:04d}.jpg"),
    "oxford_pets": (["abyssinian", "american_bulldog", "yorkshire_terrier"], lambda c, s, i: f"{c}_{s}{i}.jpg"),
    "stanford_cars": (["2012 AM General Hummer SUV", "2012 Acura RL Sedan", "2012 Tesla Model S Sedan"],
                      lambda c, s, i: f"cars_{'test' if s == 'test' else 'train'}/{len(c):02d}{s}{i:05d}.jpg"),
    "oxford_flowers": (["pink primrose", "hard-leaved pocket orchid", "canterbury bells"],
                       lambda c, s, i: f"image_{c[:4]}{s}{i:05d}.jpg"),
    "food101": (["apple_pie", "baby_back_ribs", "baklava"], lambda c, s, i: f"{c}/{s}{i}.jpg"),
    "sun397": (["abbey", "outdoor apartment_building", "airplane_cabin"],
               lambda c, s, i: f"{c[0]}/{c.replace(' ', '_')}/sun_{s}{i}.jpg"),
    "dtd": (["banded", "blotchy", "braided"], lambda c, s, i: f"{c}/{c}_{s}{i:04d}.jpg"),
    "eurosat": (["Annual Crop Land", "Forest", "SeaLake"], lambda c, s, i: f"{c.replace(' ', '')}/{c}_{s}{i}.jpg"),
    "ucf101": (["Apply_Eye_Makeup", "Archery", "Baby_Crawling"], lambda c, s, i: f"{c}/v_{s}_g{i:02d}.jpg"),
}
CLEAN = {"Leopards": "leopard", "SeaLake": "Sea or Lake"}  # CoOp's renames, then '_' -> ' '


def build_json_layout(root, name):
    spec = data.DATASETS[name]
    raw, rel = JSON_LAYOUTS[name]
    folder = os.path.join(root, spec.folder)
    entries = {s: interleave([[(rel(c, s, i), y, c) for i in range(n)] for y, c in enumerate(raw)])
               for s, n in SIZES.items()}
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


WNIDS = {"n01440764": "tench", "n01443537": "goldfish", "n01484850": "great white shark",
         "n01491361": "tiger shark", "n01494475": "hammerhead shark"}


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
            make_image(os.path.join(folder, "images", "val", w, f"ILSVRC2012_val_{w}{i}.JPEG"), seed=i)
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


BUILDERS = {**{n: build_json_layout for n in JSON_LAYOUTS}, "fgvc_aircraft": build_fgvc, "imagenet": build_imagenet,
            "imagenetv2": build_variant, "imagenet_sketch": build_variant, "imagenet_a": build_variant,
            "imagenet_r": build_variant}
TEMPLATES = {"oxford_pets": "a photo of a {}, a type of pet.", "oxford_flowers": "a photo of a {}, a type of flower.",
             "food101": "a photo of {}, a type of food.", "fgvc_aircraft": "a photo of a {}, a type of aircraft.",
             "dtd": "{} texture.", "eurosat": "a centered satellite photo of {}.",
             "ucf101": "a photo of a person doing {}."}


def test_every_benchmark_dataset_has_a_builder_here():
    assert set(BUILDERS) == set(data.DATASETS) - {"toyworld"}
    assert set(data.B2N_DATASETS) | set(data.DG_TARGETS) == set(BUILDERS)
    assert len(data.B2N_DATASETS) == 11 and data.B2N_DATASETS[0] == "imagenet" and data.B2N_DATASETS[-1] == "ucf101"


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
    # EuroSAT labels come from the JSON: class 2 is "Sea or Lake" even though the JSON stores its raw folder name
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


# ------------------------------------------------------------------------------------------- few-shot

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
    entries = {"train": interleave([[(f"{c}/{c}_t{i}.jpg", y, c) for i in range(n)]
                                    for y, (c, n) in enumerate(zip(names, train_sizes))]),
               "val": interleave([[(f"{c}/{c}_v{i}.jpg", y, c) for i in range(n)]
                                  for y, (c, n) in enumerate(zip(names, val_sizes))]),
               "test": [(f"{c}/{c}_s{i}.jpg", y, c) for y, c in enumerate(names) for i in range(2)]}
    write_split(os.path.join(folder, "split_zhou_DescribableTextures.json"), os.path.join(folder, "images"), entries)
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


def test_fewshot_leaves_global_random_alone(tmp_path):
    build_uneven_dtd(str(tmp_path))
    random.seed(123)
    expected = random.random()
    random.seed(123)
    data.build_dataset("dtd", str(tmp_path), shots=2, seed=1)
    assert random.random() == expected


# ------------------------------------------------------------------------------------------- base / novel

def test_base_novel_split_and_relabel(tmp_path):
    build_uneven_dtd(str(tmp_path))  # 5 classes: base = 0,1,2 (ceil(5/2)), novel = 3,4
    full = data.build_dataset("dtd", str(tmp_path))
    base = data.build_dataset("dtd", str(tmp_path), subsample="base")
    novel = data.build_dataset("dtd", str(tmp_path), subsample="novel")
    assert base.classnames == full.classnames[:3] and novel.classnames == full.classnames[3:]
    assert {y for _, y, _ in novel.train + novel.val + novel.test} == {0, 1}  # relabelled from 0
    assert [p for p, _, _ in novel.test] == [p for p, y, _ in full.test if y >= 3]
    assert len(base.train) + len(novel.train) == len(full.train)
    assert data.build_dataset("dtd", str(tmp_path), subsample="new").test == novel.test  # CoOp's name
    fs_base = data.build_dataset("dtd", str(tmp_path), shots=4, seed=1, subsample="base")
    fs_all = data.build_dataset("dtd", str(tmp_path), shots=4, seed=1)
    assert fs_base.train == [it for it in fs_all.train if it[1] < 3]  # few-shot first, then the class split


def test_base_novel_on_test_only_set(tmp_path):
    build_variant(str(tmp_path), "imagenet_sketch")
    novel = data.build_dataset("imagenet_sketch", str(tmp_path), shots=16, subsample="novel")
    assert novel.classnames == ["great white shark"] and len(novel.test) == 3 and novel.train == []


# ------------------------------------------------------------------------------------------- custom and toyworld

def test_custom_folder_split_is_deterministic_and_kept(tmp_path):
    for copy in ("one", "two"):
        for c in ("red_apple", "pear", "plum"):
            for i in range(10):
                make_image(str(tmp_path / copy / c / f"{i:02d}.png"), seed=i)
    a = data.build_dataset(f"folder:{tmp_path / 'one'}", None, shots=-1)
    b = data.build_dataset(f"folder:{tmp_path / 'two'}", None)
    assert a.classnames == ["pear", "plum", "red apple"] and a.template == "a photo of a {}."
    assert (len(a.train), len(a.val), len(a.test)) == (15, 6, 9)  # 50/20/30 per class
    assert [os.path.relpath(p, tmp_path / "one") for p, _, _ in a.test] == \
        [os.path.relpath(p, tmp_path / "two") for p, _, _ in b.test]
    assert (tmp_path / "one" / "split_folder.json").exists()
    make_image(str(tmp_path / "one" / "plum" / "99.png"))  # later runs reuse the written split
    again = data.build_dataset(f"folder:{tmp_path / 'one'}", None, shots=2)
    assert len(again.train) == 6 and sum(len(s) for s in (a.train, a.val, a.test)) == 30
    assert data.build_dataset(f"folder:{tmp_path / 'one'}", None).test == a.test


def test_toyworld_is_read_through_the_json_machinery(tmp_path):
    """data.py only reads the toy world (toyworld.py writes it); until then it names the command that makes it."""
    root = tmp_path / "new_root"
    with pytest.raises(data.DataError, match="python toyworld.py dataset"):
        data.build_dataset("toyworld", str(root), shots=2, seed=1)
    folder = os.path.join(root, "toyworld")
    entries = {s: [(f"{c}/{s}_{i}.png", y, c) for y, c in enumerate(["red_circle", "blue_square"])
                   for i in range(3)] for s in ("train", "val", "test")}
    write_split(os.path.join(folder, "split_zhou_ToyWorld.json"), os.path.join(folder, "images"), entries)
    ds = data.build_dataset("toyworld", str(root), shots=2, seed=1)
    assert ds.classnames == ["red circle", "blue square"] and ds.template == "a photo of a {}."
    assert len(ds.train) == 4 and len(ds.test) == 6
    assert (root / "toyworld" / "split_fewshot" / "shot_2-seed_1.json").exists()


# ------------------------------------------------------------------------------------------- transforms, loaders

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


def make_items(tmp_path, n=10):
    items = []
    for i in range(n):
        path = str(tmp_path / f"img{i}.png")
        make_image(path, seed=i, size=(20, 16))
        items.append((path, i, f"class {i}"))
    return items


def test_loader_shuffle_is_seeded_and_batches_have_shape(tmp_path):
    items = make_items(tmp_path)
    order = lambda seed: [y.tolist() for _, y in data.make_loader(items, data.test_transform(16), 4, True, seed=seed)]
    assert order(0) == order(0) and order(0) != order(1)
    assert len(order(0)) == 2 and sorted(sum(order(0), [])) != list(range(10))  # drop_last on train, as Dassl
    batches = list(data.make_loader(items, data.test_transform(16), 4, shuffle=False))
    assert [b[0].shape[0] for b in batches] == [4, 4, 2] and batches[0][0].shape == (4, 3, 16, 16)
    assert torch.cat([b[1] for b in batches]).tolist() == list(range(10))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_image_raises_data_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "bad.jpg"
    good = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(good, "JPEG")
    path.write_bytes(b"not an image at all" if damage == "garbage" else good.getvalue()[:400])
    with pytest.raises(data.DataError, match="bad.jpg"):
        data.ImageList([(str(path), 0, "x")], data.test_transform(16))[0]
    if damage == "garbage":  # a worker process re-raises it as the same type, message intact
        with pytest.raises(data.DataError, match="bad.jpg"):
            next(iter(data.make_loader([(str(path), 0, "x")], data.test_transform(16), 1, False, num_workers=1)))


# ------------------------------------------------------------------------------------------- bad input

def test_bad_input_each_stops_with_one_clear_error(tmp_path):
    root = str(tmp_path)
    cases = [
        (lambda: data.build_dataset("eurosat", root + "/missing"), ["data root not found", "missing", "--root"]),
        (lambda: data.build_dataset("eurosat", root), ["EuroSAT folder not found", "eurosat/2750"]),
        (lambda: data.build_dataset("oxford_pets", root, shots=0), ["shots", "-1"]),
        (lambda: data.build_dataset("oxford_pets", root, shots=-3), ["shots"]),
        (lambda: data.build_dataset("dtd", root, subsample="half"), ["subsample"]),
        (lambda: data.build_dataset("euro_sat", root), ["unknown dataset", "Did you mean: eurosat"]),
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
    build_json_layout(str(tmp_path), "food101")  # 15 train items: checks items 0, 7, 14 with a limit of 2
    monkeypatch.setattr(data, "CHECK_LIMIT", 2)
    ds = data.build_dataset("food101", str(tmp_path))
    os.remove(ds.train[3][0])
    ds = data.build_dataset("food101", str(tmp_path))  # not in the checked sample: building still works
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
    assert data.main(["check", "eurosat", "--root", str(tmp_path), "--shots", "2", "--subsample", "base"]) == 0
    out = capsys.readouterr().out
    assert "classes: 2 (base)" in out and "train 4 | val 4 | test 4" in out
    assert "a centered satellite photo of Annual Crop Land." in out
    assert data.main(["check", "eurosat", "--root", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data root not found") and "Traceback" not in err
    with pytest.raises(SystemExit):
        data.main(["--help"])
    assert "imagenet_a" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- downloads

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
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


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
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, "PNG")
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
    sources = {"eurosat": [download.Source(url=server.url + "/files/EuroSAT.zip",
                                           md5=hashlib.md5(archive).hexdigest(), extract_to="eurosat",
                                           creates="eurosat/2750")]}
    drive = server.url + "/drive"
    download.download_dataset(data.DATASETS["eurosat"], str(tmp_path), sources=sources, gdrive_url=drive)
    ds = data.build_dataset("eurosat", str(tmp_path), shots=2)
    assert ds.classnames == ["Annual Crop Land", "Forest"] and len(ds.test) == 4
    assert os.listdir(tmp_path / ".downloads") == []  # archive removed after unpacking, no .part left
    server.routes.clear()  # a second run finds everything present and downloads nothing
    download.download_dataset(data.DATASETS["eurosat"], str(tmp_path), sources=sources, gdrive_url=drive)


def test_cli_download_with_mirror(tmp_path, server, monkeypatch):
    fake_eurosat(server)
    monkeypatch.setitem(download.SOURCES, "eurosat", [download.Source(
        url="https://example.invalid/some/path/EuroSAT.zip", extract_to="eurosat", creates="eurosat/2750")])
    assert data.main(["download", "eurosat", "--root", str(tmp_path), "--mirror", server.url + "/files",
                      "--gdrive-url", server.url + "/drive"]) == 0
    assert len(data.build_dataset("eurosat", str(tmp_path)).train) == 10


def test_tampered_archive_is_rejected_and_nothing_unpacked(tmp_path, server):
    archive = fake_eurosat(server)
    server.routes["/files/EuroSAT.zip"] = ("application/zip", archive[:-10] + b"0123456789")
    src = download.Source(url=server.url + "/files/EuroSAT.zip", md5=hashlib.md5(archive).hexdigest(),
                          extract_to="eurosat")
    with pytest.raises(download.DownloadError, match="MD5"):
        download.fetch_source(src, str(tmp_path))
    assert not (tmp_path / "eurosat").exists() and os.listdir(tmp_path / ".downloads") == []


def test_cut_off_download_is_rejected(tmp_path, server):
    server.routes["/files/a.tar.gz"] = ("application/gzip", b"x" * 100, 5000)
    with pytest.raises(download.DownloadError, match="again"):
        download.fetch_url(server.url + "/files/a.tar.gz", str(tmp_path / "a.tar.gz"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["zip-dotdot", "tar-dotdot", "tar-absolute", "tar-symlink-out"])
def test_path_escaping_archive_is_refused(tmp_path, kind):
    bodies = {"zip-dotdot": zip_bytes({"ok.txt": b"1", "../evil.txt": b"2"}),
              "tar-dotdot": tar_bytes({"ok.txt": b"1", "sub/../../evil.txt": b"2"}),
              "tar-absolute": tar_bytes({"ok.txt": b"1", str(tmp_path / "evil.txt"): b"2"}),
              "tar-symlink-out": tar_bytes({"ok.txt": b"1"}, links=[("link", "../../evil.txt")])}
    archive = tmp_path / "archive.bin"
    archive.write_bytes(bodies[kind])
    target = tmp_path / "target"
    with pytest.raises(download.DownloadError, match="outside|link"):
        download.safe_extract(str(archive), str(target))
    assert not (tmp_path / "evil.txt").exists() and not (target / "ok.txt").exists()  # checked before writing


def test_safe_extract_keeps_an_honest_tar(tmp_path):
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(tar_bytes({"dtd/images/banded/x.jpg": b"1"}, links=[("dtd/images/alias.jpg", "banded/x.jpg")]))
    download.safe_extract(str(archive), str(tmp_path / "t"))
    assert (tmp_path / "t" / "dtd" / "images" / "alias.jpg").read_bytes() == b"1"


def test_google_drive_confirm_page_then_file(tmp_path, server):
    page = ('<html><form id="download-form" action="/drive2" method="get">'
            '<input type="hidden" name="id" value="BIG"><input type="hidden" name="export" value="download">'
            '<input type="hidden" name="confirm" value="t"><input type="hidden" name="uuid" value="u-1&amp;2">'
            '</form></html>')
    server.routes["/drive?id=BIG"] = ("text/html; charset=utf-8", page.encode())
    server.routes["/drive2?id=BIG"] = ("application/octet-stream", b"the big file")
    dest = tmp_path / "big.bin"
    download.fetch_drive("BIG", str(dest), gdrive_url=server.url + "/drive")
    assert dest.read_bytes() == b"the big file"
    server.routes["/drive?id=BLOCKED"] = ("text/html", b"<html>Quota exceeded</html>")
    with pytest.raises(download.DownloadError, match="drive.google.com/file/d/BLOCKED/view"):
        download.fetch_drive("BLOCKED", str(tmp_path / "x.json"), gdrive_url=server.url + "/drive")

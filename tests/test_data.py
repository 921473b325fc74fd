"""data.py: every reader on a tiny fake dataset in its real layout, few-shot subsets equal to
Dassl's, base/novel, folder datasets and their kept split, class names, images and transforms,
downloads from a local HTTP server, the CLI."""

import collections
import contextlib
import hashlib
import io
import json
import os
import pathlib
import random
import re
import tarfile
import zipfile

import numpy as np
import pytest
from PIL import Image

import data


def make_image(path, seed=0):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (10, 12, 3), np.uint8)).save(path)


def write_split(path, image_dir, entries):
    """entries: {split: [(relative path, label, classname)]}: the images and CoOp's split JSON."""
    for n, (rel, _, _) in enumerate(e for items in entries.values() for e in items):
        make_image(os.path.join(image_dir, rel), seed=n)
    pathlib.Path(path).write_text(json.dumps(entries, indent=4))


def interleave(per_class):  # the items of several classes mixed, as in the real split files
    out = [item for items in per_class for item in items]
    random.Random(0).shuffle(out)
    return out


# ------------------------------------------------------------------------------------ fake layouts
# Each builder writes one dataset under root: (class names as the model sees them, split sizes).

SIZES = {"train": 5, "val": 3, "test": 2}
JSON_LAYOUTS = {  # raw class names as the split JSON stores them -> the names put in the prompt
    "caltech101": {"accordion": "accordion", "Leopards": "leopard", "yin_yang": "yin yang"},
    "oxford_pets": {"abyssinian": "abyssinian", "american_bulldog": "american bulldog"},
    "stanford_cars": {"2012 Tesla Model S Sedan": "2012 Tesla Model S Sedan",
                      "2012 Acura RL": "2012 Acura RL"},
    "oxford_flowers": {"pink primrose": "pink primrose",
                       "hard-leaved pocket orchid": "hard-leaved pocket orchid"},
    "food101": {"apple_pie": "apple pie", "baklava": "baklava"},
    "sun397": {"abbey": "abbey", "outdoor apartment_building": "outdoor apartment building"},
    "dtd": {"banded": "banded", "blotchy": "blotchy"},
    "eurosat": {"AnnualCrop": "Annual Crop Land", "Forest": "Forest", "SeaLake": "Sea or Lake"},
    "ucf101": {"Apply_Eye_Makeup": "Apply Eye Makeup", "Archery": "Archery"},
    "toyworld": {"red_circle": "red circle", "blue_square": "blue square"}}


def build_json(root, name):
    spec, raw = data.DATASETS[name], list(JSON_LAYOUTS[name])
    folder = os.path.join(root, spec.folder)
    entries = {s: interleave([[(f"{c[:3]}{y}/{s}{i}.jpg", y, c) for i in range(n)] for y,
                              c in enumerate(raw)]) for s, n in SIZES.items()}
    write_split(os.path.join(folder, f"split_zhou_{spec.coop}.json"),
                os.path.join(folder, spec.images), entries)
    return list(JSON_LAYOUTS[name].values()), tuple(n * len(raw) for n in SIZES.values())


def build_fgvc(root, name):
    folder, variants = os.path.join(root, "fgvc_aircraft"), ["707-320", "Cessna 172", "A300B4"]
    n = 0
    for s, k in SIZES.items():  # file order is not label order
        rows = [(1000000 + (n := n + 1), v) for _ in range(k) for v in reversed(variants)]
        for i, _ in rows:
            make_image(os.path.join(folder, "images", f"{i}.jpg"), seed=i - 1000000)
        text = "".join(f"{i} {v}\n" for i, v in rows)
        pathlib.Path(folder, f"images_variant_{s}.txt").write_text(text)
    pathlib.Path(folder, "variants.txt").write_text("\n".join(variants) + "\n")
    return variants, (15, 9, 6)


# CLIP's ImageNet names hold two pairs of equal names (openai/CLIP#235): CoOp and data.py keep them
WNIDS = {f"n0{i:07d}": name for i, name in enumerate(["tench", "great white shark", "sunglasses",
                                                      "sunglasses", "jay"])}


def write_classnames(folder):  # called after the images, which make the folder
    pathlib.Path(folder, "classnames.txt").write_text("".join(f"{w} {WNIDS[w]}\n" for w in WNIDS))


def build_imagenet(root, name):
    folder = os.path.join(root, "imagenet")
    for w in WNIDS:
        for s, n in (("train", 5), ("val", 2)):
            for i in range(n):
                make_image(os.path.join(folder, "images", s, w, f"{w}_{9 - i}.JPEG"), seed=i)
    write_classnames(folder)
    return list(WNIDS.values()), (25, 10, 10)


def build_variant(root, name):
    folder = os.path.join(root, data.DATASETS[name].folder)
    image_dir = os.path.join(folder, data.DATASETS[name].images)
    if name == "imagenetv2":  # folders 0..11: sorted as strings, 10 and 11 would come before 2
        for k in range(12):
            make_image(os.path.join(image_dir, str(k), f"{k}abc.jpeg"), seed=k)
        for other in ("12", "extra"):  # no class of classnames.txt: not read
            make_image(os.path.join(image_dir, other, "0.jpeg"))
        text = "".join(f"n{k:08d} class {k}\n" for k in range(12))
        pathlib.Path(folder, "classnames.txt").write_text(text)
        return [f"class {k}" for k in range(12)], (0, 0, 12)
    # A and R: 200 of the 1000
    keep = list(WNIDS)[1:4] if name in ("imagenet_a", "imagenet_r") else list(WNIDS)
    for w in keep:
        for i in range(3):
            make_image(os.path.join(image_dir, w, f"{i}.jpg"), seed=i)
    write_classnames(folder)
    pathlib.Path(image_dir, "README.txt").write_text("not a class\n")
    return [WNIDS[w] for w in keep], (0, 0, 3 * len(keep))


BUILDERS = {**dict.fromkeys(JSON_LAYOUTS, build_json), "fgvc_aircraft": build_fgvc,
            "imagenet": build_imagenet, **dict.fromkeys(data.DG_TARGETS, build_variant)}
TEMPLATES = {  # CoOp's trainers/zsclip.py CUSTOM_TEMPLATES; the rest are "a photo of a {}."
    "oxford_pets": "a photo of a {}, a type of pet.", "food101": "a photo of {}, a type of food.",
    "oxford_flowers": "a photo of a {}, a type of flower.", "dtd": "{} texture.",
    "fgvc_aircraft": "a photo of a {}, a type of aircraft.",
    "eurosat": "a centered satellite photo of {}.", "ucf101": "a photo of a person doing {}."}


def test_tables():
    assert set(BUILDERS) == set(data.DATASETS)
    assert data.B2N_DATASETS[0] == "imagenet" and len(data.B2N_DATASETS) == 11
    assert set(data.B2N_DATASETS) | set(data.DG_TARGETS) | {"toyworld"} == set(data.DATASETS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_reader(tmp_path, capsys, name):
    classnames, sizes = BUILDERS[name](str(tmp_path), name)
    ds = data.build_dataset(name, str(tmp_path))
    assert ds.classnames == classnames and (len(ds.train), len(ds.val), len(ds.test)) == sizes
    assert ds.template == TEMPLATES.get(name, "a photo of a {}.")
    for path, label, classname in ds.train + ds.val + ds.test:
        assert os.path.isabs(path) and os.path.isfile(path) and classname == ds.classnames[label]
        assert name != "imagenetv2" or os.path.basename(os.path.dirname(path)) == str(label)
    assert sorted({y for _, y, _ in ds.test}) == list(range(len(classnames)))
    if name == "imagenet":  # files sorted by name; the official val set is the test (and val) set
        first = [os.path.basename(p) for p, y, _ in ds.train if y == 0]
        assert first == sorted(first) and ds.val == ds.test
        assert capsys.readouterr().err == f"listing {tmp_path / 'imagenet' / 'images'} (once)\n"
        few = data.build_dataset("imagenet", str(tmp_path), shots=2, seed=3)  # few-shot: train only
        assert capsys.readouterr().err == ""  # its preprocessed.json
        assert few.train == dassl_fewshot(ds.train, [], 2, 3)[0] and few.val == few.test == ds.test


# ---------------------------------------------------------------------------------------- few-shot
def dassl_fewshot(train, val, k, seed):
    """Dassl's generate_fewshot_dataset as CoOp calls it, restated: the global random seeded once,
    train with k, then val with min(k, 4), defaultdict grouping, all the items of a small class."""
    random.seed(seed)
    out = []
    for items, n in ((train, k), (val, min(k, 4))):
        tracker = collections.defaultdict(list)
        for item in items:
            tracker[item[1]].append(tuple(item))
        out.append([it for g in tracker.values() for it in (random.sample(g, n) if len(g) >= n
                                                             else g)])
    return out


def build_uneven_dtd(root, train_sizes=(6, 7, 1, 5, 9), val_sizes=(5, 3, 4, 2, 6)):
    names = ["banded", "blotchy", "braided", "bubbly", "bumpy"]
    per_class = lambda s, sizes: interleave([[(f"{c}/{s}{i}.jpg", y, c) for i in range(sizes[y])]
                                             for y, c in enumerate(names)])
    entries = {"train": per_class("t", train_sizes), "val": per_class("v", val_sizes),
               "test": [(f"{c}/s{i}.jpg", y, c) for y, c in enumerate(names) for i in range(2)]}
    image_dir = os.path.join(root, "dtd", "images")
    write_split(f"{root}/dtd/split_zhou_DescribableTextures.json", image_dir, entries)
    return entries, image_dir


def rel(items, image_dir):
    return [(os.path.relpath(p, image_dir), y, c) for p, y, c in items]


@pytest.mark.parametrize("shots", [1, 4, 5, 16])
def test_fewshot_equals_dassl(tmp_path, shots):
    entries, image_dir = build_uneven_dtd(str(tmp_path))
    for _ in range(2):  # drawn, then read back from the cache, for several seeds side by side
        for seed in (1, 2, 3):
            ds = data.build_dataset("dtd", str(tmp_path), shots=shots, seed=seed)
            want = dassl_fewshot(entries["train"], entries["val"], shots, seed)
            assert [rel(ds.train, image_dir), rel(ds.val, image_dir)] == want and len(ds.test) == 10
            assert ds.shots_per_class == [min(shots, n) for n in (6, 7, 1, 5, 9)]
            assert bool(ds.warnings) == (shots > 1)  # a class with fewer than --shots images: named
    assert os.path.isfile(tmp_path / "dtd" / "split_fewshot" / f"shot_{shots}-seed_3.json")


def test_fewshot_cache_follows_the_split_and_unkept_costs_a_note(tmp_path, capsys, monkeypatch):
    """A changed split: drawn anew; a read-only dataset folder: made each time, with a note."""
    entries, image_dir = build_uneven_dtd(str(tmp_path))
    data.build_dataset("dtd", str(tmp_path), shots=2, seed=1)
    path = tmp_path / "dtd" / "split_zhou_DescribableTextures.json"
    split = json.loads(path.read_text())
    path.write_text(json.dumps({**split, "val": split["val"][3:]}))
    ds = data.build_dataset("dtd", str(tmp_path), shots=2, seed=1)
    assert rel(ds.val, image_dir) == dassl_fewshot(entries["train"], split["val"][3:], 2, 1)[1]

    def full(path, doc):
        raise OSError(28, "No space left on device", path)
    monkeypatch.setattr(data, "write_json", full)
    capsys.readouterr()
    assert len(data.build_dataset("dtd", str(tmp_path), shots=2, seed=2).train) == 9  # 1 + 4 x 2
    cache = tmp_path / "dtd" / "split_fewshot" / "shot_2-seed_2.json"
    assert capsys.readouterr().err.startswith(f"note: cannot keep {cache} ({cache}: No space")


# ------------------------------------------------------------------------------------- base / novel
def test_base_novel_ranks_sorted_labels_after_few_shot(tmp_path):
    """Labels 10, 0, 5, 2, 7: base = the ceil(5/2) = 3 smallest (0, 2, 5), novel = 7, 10,
    renumbered by rank."""
    train = [(f"t{y}", y, f"c{y}") for y in (10, 0, 5, 2, 7)]
    test = [(f"s{y}", y, f"c{y}") for y in (7, 2, 10, 0, 5)]
    base, novel = (data.subsample_classes(train, [], test, s) for s in ("base", "novel"))
    assert base[0] == [("t0", 0, "c0"), ("t5", 2, "c5"), ("t2", 1, "c2")]
    assert novel[2] == [("s7", 0, "c7"), ("s10", 1, "c10")]
    assert data.subsample_classes(train, [], test, "all") == (train, [], test)
    build_uneven_dtd(str(tmp_path))
    full = data.build_dataset("dtd", str(tmp_path), shots=4, seed=2)
    base, novel = (data.build_dataset("dtd", str(tmp_path), 4, 2, s) for s in ("base", "novel"))
    assert base.classnames == full.classnames[:3] and novel.classnames == full.classnames[3:]
    assert base.train == [it for it in full.train if it[1] < 3]  # few-shot first, then the split
    assert novel.test == [(p, y - 3, c) for p, y, c in full.test if y >= 3]
    build_variant(str(tmp_path), "imagenet_a")  # a test-only set: classes from its test split
    a = data.build_dataset("imagenet_a", str(tmp_path), shots=16, subsample="novel")
    assert a.classnames == ["sunglasses"] and len(a.test) == 3 and a.train == []


# ----------------------------------------------------------------------------- folders, class names
def fruit_folder(folder, counts=(10, 2, 3)):
    for c, n in zip(("pear", "plum", "red_apple"), counts):
        for i in range(n):
            make_image(str(folder / c / f"{i:02d}.png"), seed=i)
    return f"folder:{folder}"


def test_folder_split_is_kept(tmp_path):
    name = fruit_folder(tmp_path / "fruit")
    ds = data.build_dataset(name, None)
    assert ds.classnames == ["pear", "plum", "red apple"] and ds.template == "a photo of a {}."
    n = [[sum(y == k for _, y, _ in s) for s in (ds.train, ds.val, ds.test)] for k in range(3)]
    assert n == [[5, 2, 3], [1, 0, 1], [2, 0, 1]]  # 50/20/30, every class keeps a test image
    again = data.build_dataset(name, None, shots=2)  # the few-shot cache's folder is not a class
    make_image(str(tmp_path / "fruit" / "plum" / "new.png"))  # the split is kept
    assert again.classnames == ds.classnames and data.build_dataset(name, None).test == ds.test
    os.remove(tmp_path / "fruit" / "split_folder.json")
    os.remove(tmp_path / "fruit" / "plum" / "new.png")
    assert data.build_dataset(name, None).train == ds.train  # split anew: the same draw (seed 1)
    other = data.build_dataset(fruit_folder(tmp_path / "copy"), None)  # the same files elsewhere
    assert rel(other.test, tmp_path / "copy") == rel(ds.test, tmp_path / "fruit")  # the same split


@pytest.mark.parametrize("a,b", [("Red_Apple", "red apple"), ("salt & pepper", "salt &amp; pepper"),
                                 ("a  b", "a b")])
def test_equal_prompts_are_refused(tmp_path, a, b):
    for path in (tmp_path / c / f"{i}.png" for c in (a, b) for i in range(2)):
        make_image(str(path))
    a = a.replace("_", " ")  # a folder's '_' reads as a space
    with pytest.raises(data.UserError,
                       match=re.escape(f"classes {a!r} and {b!r} give the same prompt")):
        data.build_dataset(f"folder:{tmp_path}", None)


def test_16_bit_and_float_images_are_scaled_to_8_bit(tmp_path):
    levels = np.array([[0, 257 * 100], [65535, 257 * 50 + 100]], dtype=np.uint16)
    want = np.array([[0, 100], [255, 50]], dtype=np.uint8)
    Image.fromarray(levels).save(tmp_path / "deep.png")
    image, label = data.ImageList([(str(tmp_path / "deep.png"), 3, "x")], np.asarray)[0]
    assert label == 3 and image.shape == (2, 2, 3) and (image == want[..., None]).all()
    wide = Image.fromarray(levels.astype(np.int32))  # mode "I", as older PIL opens 16-bit PNGs
    assert (np.asarray(data.to_rgb(wide))[..., 0] == want).all()
    small = Image.fromarray(want.astype(np.int32))  # mode "I" holding 8-bit levels: kept
    assert (np.asarray(data.to_rgb(small))[..., 1] == want).all()
    edge = Image.fromarray(np.array([[0, 255, 256]], dtype=np.int32))  # 256: not 8-bit
    assert np.asarray(data.to_rgb(edge))[0, :, 2].tolist() == [0, 1, 1]
    f = Image.fromarray(np.array([[0.0, 1.0], [0.8, 0.2]], dtype=np.float32))  # mode F, in [0, 1]
    assert np.asarray(data.to_rgb(f))[..., 0].tolist() == [[0, 255], [204, 51]]  # 0.8: 204, not 205
    with pytest.raises(ValueError, match=r"floating-point pixels outside \[0, 1\]"):
        data.to_rgb(Image.fromarray(np.array([[1.5]], dtype=np.float32)))


# -------------------------------------------------------------------------------------- errors, CLI
def half_unpacked(root):
    build_json(root, "eurosat")
    with open(os.path.join(root, "eurosat", "split_zhou_EuroSAT.json")) as f:
        last = json.load(f)["test"][-1][0]  # the end of a split: what a cut-off unpack lacks
    os.remove(os.path.join(root, "eurosat", "2750", last))
    return {"last": last}


@pytest.mark.parametrize("name,setup,words", [
    ("nope", None, "unknown dataset 'nope'; known: imagenet, caltech101,"),
    ("eurosat", None, "{root}/eurosat/split_zhou_EuroSAT.json: not found; get it with: python "
     "data.py download eurosat --root {root}"),
    ("imagenet_r", None, "{root}/imagenet-rendition/classnames.txt: not found; get it with"),
    ("eurosat", half_unpacked, "{root}/eurosat/2750/{last}: not found; get it with"),
    ("folder:{root}/fruit", lambda r: fruit_folder(pathlib.Path(r) / "fruit", (3, 1)) and None,
     "{root}/fruit/plum: 1 image(s)"),
    ("fgvc_aircraft", lambda r: build_fgvc(r, "") and open(os.path.join(
        r, "fgvc_aircraft", "images_variant_train.txt"), "a").write("1 X\n2 Y\n") and None,
     "{root}/fgvc_aircraft/images_variant_train.txt: '1 X' is not '<image id> <variant>'"),
    ("eurosat", lambda r: open(os.path.join(r, "eurosat"), "w").close(),  # an OS error
     "{root}/eurosat/split_zhou_EuroSAT.json: Not a directory")])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, name, setup, words):
    root = str(tmp_path)
    fill = {"root": root, **((setup and setup(root)) or {})}
    assert data.main(["check", name.format(**fill), "--root", root]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + words.format(**fill)) and err.count("\n") == 1


def test_cli_check(tmp_path, capsys, monkeypatch):
    build_json(str(tmp_path / "data"), "eurosat")
    assert data.main(["check", "eurosat", "--root", str(tmp_path / "data"), "--shots", "2",
                      "--seed", "3", "--open"]) == 0
    out = capsys.readouterr().out
    assert "3 classes (all), train 6, val 6, test 6" in out and "opened 18 images" in out
    assert "prompt: a centered satellite photo of Annual Crop Land." in out
    # the defaults: --root $DATA, else data; --seed 1; --subsample: CoOp's first half (rounded up)
    monkeypatch.setattr(data, "DEFAULT_ROOT", "data")
    monkeypatch.chdir(tmp_path)
    assert data.main(["check", "eurosat", "--shots", "2", "--subsample", "base"]) == 0
    assert "2 classes (base), train 4, val 4, test 4" in capsys.readouterr().out
    cache = tmp_path / "data" / "eurosat" / "split_fewshot"
    assert sorted(os.listdir(cache)) == ["shot_2-seed_1.json", "shot_2-seed_3.json"]
    with pytest.raises(SystemExit) as e:
        data.main(["check", "eurosat", "--shots", "0"])
    assert e.value.code == 2
    capsys.readouterr()
    assert data.main(["check", "nope", "eurosat", "dtd"]) == 2
    errors = capsys.readouterr().err.splitlines()  # each error on its line
    assert len(errors) == 2 and errors[0].startswith("error: unknown dataset 'nope'")
    assert "dtd/split_zhou" in errors[1]


# ---------------------------------------------------------------------------------------- downloads
def fake_eurosat(routes, url, monkeypatch, md5=None):
    """EuroSAT.zip (2750/<class>/*) and its split JSON on 'Drive', served like the real sources."""
    buf, entries = io.BytesIO(), {"train": [], "val": [], "test": []}
    with zipfile.ZipFile(buf, "w") as z:
        for y, folder, name in [(0, "AnnualCrop", "Annual Crop Land"), (1, "Forest", "Forest")]:
            for s, n in SIZES.items():
                for i in range(n):
                    Image.new("RGB", (8, 8), (i, y, 0)).save(image := io.BytesIO(), "PNG")
                    z.writestr(f"2750/{folder}/{s}{i}.png", image.getvalue())
                    entries[s].append([f"{folder}/{s}{i}.png", y, name])
    routes["/EuroSAT.zip"] = archive = buf.getvalue()
    routes["/drive?id=SPLIT"] = json.dumps(entries).encode()
    md5 = md5 or hashlib.md5(archive).hexdigest()
    split = ("eurosat", "drive:SPLIT", "", "eurosat/split_zhou_EuroSAT.json", "", "")
    zipped = ("eurosat", f"{url}/EuroSAT.zip", md5, "eurosat/EuroSAT.zip", "eurosat/2750", "")
    monkeypatch.setattr(data, "SOURCES", [split, zipped])  # a file first: the archive still comes
    monkeypatch.setattr(data, "DRIVE", f"{url}/drive?id=")


def test_download_refuses_a_wrong_md5_names_held_back_files(tmp_path, server, monkeypatch, capsys):
    routes, url = server
    fake_eurosat(routes, url, monkeypatch, md5="0" * 32)
    routes["/drive?id=SPLIT"] = b"<!DOCTYPE html><html>quota exceeded</html>"
    bad = tmp_path / "bad"
    with pytest.raises(data.UserError,
                       match="EuroSAT.zip: not the MD5 0{32} of .*; run the command again"):
        data.download("eurosat", str(bad))
    assert not os.path.exists(bad / "eurosat" / "2750")
    monkeypatch.setattr(data, "SOURCES", data.SOURCES[:1])
    data.download("eurosat", str(bad))
    drive = "https://drive.google.com/file/d/SPLIT/view"
    assert f"fetch by hand: {drive}, as " in capsys.readouterr().err
    assert not os.path.exists(bad / "eurosat" / "split_zhou_EuroSAT.json")
    fake_eurosat(routes, url, monkeypatch)  # served right: fetched and unpacked
    assert data.main(["download", "eurosat", "--root", str(tmp_path)]) == 0
    ds = data.build_dataset("eurosat", str(tmp_path), shots=2)
    assert ds.classnames == ["Annual Crop Land", "Forest"] and len(ds.test) == len(ds.train) == 4
    assert sorted(os.listdir(tmp_path / "eurosat")) == ["2750", "split_fewshot",
                                                        "split_zhou_EuroSAT.json"]
    # the archive of a cut-off unpack: never mixed in
    (tmp_path / "eurosat" / "EuroSAT.zip").write_bytes(routes["/EuroSAT.zip"])
    with pytest.raises(data.UserError, match="2750 is in the way of .*EuroSAT.zip: move it"):
        data.download("eurosat", str(tmp_path))
    os.rename(tmp_path / "eurosat" / "2750", tmp_path / "moved")
    routes.clear()  # nothing is fetched again: the archive is unpacked
    data.download("eurosat", str(tmp_path))
    assert (tmp_path / "eurosat" / "2750" / "Forest" / "test1.png").is_file()
    assert not (tmp_path / "eurosat" / "EuroSAT.zip").exists()


def test_fgvc_download_moves_its_data_folder_to_coops_name(tmp_path, server, monkeypatch, capsys):
    """fgvc-aircraft-2013b/data/ becomes fgvc_aircraft/ (DATASETS.md; the archive's README and
    evaluation code stay where unpacked); a source to fetch by hand is said, the next fetched."""
    routes, url = server
    build_fgvc(str(tmp_path / "made"), "fgvc_aircraft")
    with tarfile.open(tmp_path / "fgvc.tar.gz", "w:gz") as t:
        t.add(tmp_path / "made" / "fgvc_aircraft", "fgvc-aircraft-2013b/data")
    routes["/fgvc.tar.gz"] = (tmp_path / "fgvc.tar.gz").read_bytes()
    row = next(s for s in data.SOURCES if s[0] == "fgvc_aircraft")
    by_hand = ("fgvc_aircraft", "", "", "", "", "a note")
    monkeypatch.setattr(data, "SOURCES", [by_hand, (row[0], f"{url}/fgvc.tar.gz", *row[2:])])
    data.download("fgvc_aircraft", str(tmp_path / "root"))
    err = capsys.readouterr().err
    assert f"by hand: a note (under {tmp_path / 'root'})" in err
    assert f"fetching {url}/fgvc.tar.gz -> {tmp_path / 'root'}/fgvc-aircraft-2013b.tar.gz" in err
    assert sorted(os.listdir(tmp_path / "root")) == ["fgvc-aircraft-2013b", "fgvc_aircraft"]
    assert data.build_dataset("fgvc_aircraft", str(tmp_path / "root")).classnames == [
        "707-320", "Cessna 172", "A300B4"]


@pytest.mark.parametrize("member,refused", [
    (("../evil.txt", "file", ""), True), (("link", "sym", "../.."), True),
    (("hard", "hard", "{out}/secret.txt"), True),
    (("{out}/evil.txt", "file", ""), False)])  # the filter strips the leading '/': it lands inside
def test_an_archive_escaping_its_folder_is_refused(tmp_path, server, monkeypatch, member, refused):
    """a.tar.gz: ok.txt and member (name, kind, link target; {out}: a folder outside the root)."""
    (out := tmp_path / "outside").mkdir()
    (out / "secret.txt").write_text("secret")
    with tarfile.open(fileobj=(buf := io.BytesIO()), mode="w:gz") as t:
        for name, kind, target in [("ok.txt", "file", ""), member]:
            info = tarfile.TarInfo(name.format(out=out))
            info.type = dict(file=tarfile.REGTYPE, sym=tarfile.SYMTYPE, hard=tarfile.LNKTYPE)[kind]
            info.linkname, info.size = target.format(out=out), 2 if kind == "file" else 0
            t.addfile(info, io.BytesIO(b"hi") if kind == "file" else None)
    server[0]["/a.tar.gz"] = buf.getvalue()
    monkeypatch.setattr(data, "SOURCES", [("dtd", f"{server[1]}/a.tar.gz", "", "dtd/a.tar.gz",
                                           "dtd/images", "")])
    with (pytest.raises(data.UserError, match="a.tar.gz cannot be unpacked safely and whole")
          if refused else contextlib.nullcontext()):
        data.download("dtd", str(tmp_path / "root"))
    assert refused or os.path.isfile(tmp_path / "root" / "dtd" / str(out).lstrip("/") / "evil.txt")
    assert sorted(os.listdir(out)) == ["secret.txt"]
    assert not os.path.exists(tmp_path / "root" / "evil.txt")
    assert not os.path.exists(tmp_path / "root" / "dtd" / "a.tar.gz")  # a rerun fetches it again

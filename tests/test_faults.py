"""Faults a user can trigger, by class, against the mechanisms that refuse them (data.py's first
section): one reader per kind of file refuses each kind of bad file in one line that names it; every
write is whole or absent after a failure or Ctrl-C; an OS error reads as its path and the next step;
every script's main turns these into one line and an exit status, and a bug keeps its traceback."""

import errno
import json
import os
import pathlib
import re
import shutil

import pytest
import torch
from PIL import Image

import bench
import data
import dear
import entropy
import tables
import toyworld
from conftest import tiny_state_dict
from test_data import fake_eurosat
from test_run import argv

DROP = object()  # an edit that deletes the key


@pytest.fixture(scope="module")
def run(world, tmp_path_factory):
    """A finished one-epoch run of the tiny CLIP: its folder."""
    args = argv(world, tmp_path_factory.mktemp("out"), "--epochs 1")
    dear.main(args)
    return pathlib.Path(dear.run_dir(dear.resolve(dear.parse_args(args)))[0])


def built(run):
    """The run's model, its optimiser and GradScaler, its config: what checkpoint.pt loads into."""
    c = dear.resolve(dear.Config(**dear.read_config(run)["config"]))
    model = dear.build(c, lambda line: None, run / "roles.json")[0]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return model, opt, torch.amp.GradScaler("cpu", enabled=False), c


def checkpoint(run, path):
    model, opt, scaler, c = built(run)
    torch.save({"model": model.trainable_state(), "opt": opt.state_dict(),
                "scaler": scaler.state_dict(), "epoch": 1, "precision": c.precision}, path)


def without(d, key):
    return {k: v for k, v in d.items() if k != key}


def edited(doc, keys, value):
    inner = doc
    for k in keys[:-1]:
        inner = inner[k]
    if value is DROP:
        del inner[keys[-1]]
    else:
        inner[keys[-1]] = value
    return doc


# Each kind of file the project reads back: (how it is made from the finished run, its reader,
# {kind of fault: (the edit, words of the refusal)}). JSON edits are (keys, value); torch edits
# change the loaded object.
NAN = float("nan")
FILES = {
    "config.json": (
        lambda run, p: shutil.copy(run / "config.json", p),
        lambda p: dear.read_config(p.parent),
        {"lacks a key": ((("inputs", "backbone_sha256"), DROP), "lacks 'backbone_sha256'"),
         "a string for a count": ((("config", "shots"), "16"), "is not a whole number"),
         "not finite": ((("config", "beta"), NAN), "is not a finite number"),
         "out of range": ((("config", "beta"), 2.0), "--beta: '2.0' is not in [0, 1]"),
         "from another version": ((("config", "pool"), 3), "'pool' is not a recorded setting")}),
    "results.json": (
        lambda run, p: shutil.copy(run / "results.json", p),
        dear.read_results,
        {"lacks a key": ((("evals",), DROP), "lacks 'evals'"),
         "a string for a count": ((("evals", 0, "n"), "16"), "is not a whole number"),
         "not finite": ((("evals", 0, "accuracy"), NAN), "is not a number in [0, 100]"),
         "out of range": ((("evals", 1, "accuracy"), 150), "= 150 is not a number in [0, 100]"),
         "a setting out of range": ((("config", "beta"), 2.0), "--beta: '2.0' is not in [0, 1]")}),
    "roles.json": (
        lambda run, p: shutil.copy(run / "roles.json", p),
        entropy.read_roles,
        {"lacks a key": ((("num_heads",), DROP), "lacks 'num_heads'"),
         "a string for a count": ((("heads", 0, "head"), "0"), "is not a whole number"),
         "not finite": ((("heads", 2, "entropy"), NAN), "is not a finite number"),
         "out of range": ((("heads", 1, "layer"), 9), "block 9 head 1 is not one of its heads")}),
    "split_folder.json": (
        lambda run, p: shutil.copy(os.path.join(dear.read_config(run)["inputs"]
                                                ["dataset_folder"], p.name), p),
        lambda p: data.read_split(str(p), "delete it"),
        {"lacks a key": ((("test",), DROP), "lacks 'test'"),
         "a string for a count": ((("train", 3, 1), "0"), "[3][1] = \"0\" is not a whole number")}),
    "model.pt": (
        lambda run, p: shutil.copy(run / "model.pt", p),
        lambda p: built(p.parent)[0].load_trainable(data.read_torch(p, "train it again"), p),
        {"lacks a key": (lambda sd: without(sd, "R"), "does not fit this model"),
         "a string for a tensor": (lambda sd: dict(sd, R="0"), "does not fit this model"),
         "not finite": (lambda sd: dict(sd, R=sd["R"] * NAN), "does not fit this model"),
         "out of range": (lambda sd: dict(sd, R=sd["R"][:2]), "R is [2, 512]")}),
    "checkpoint.pt": (
        checkpoint,
        lambda p: dear.resume(p, *built(p.parent)),
        {"lacks a key": (lambda ck: without(ck, "epoch"), "lacks 'epoch'"),
         "a string for a count": (lambda ck: dict(ck, epoch="1"), "is not a whole number"),
         "not finite": (lambda ck: dict(ck, model=dict(ck["model"], w=ck["model"]["w"] * NAN)),
                        "does not fit this model"),
         "out of range": (lambda ck: dict(ck, epoch=3), "holds epoch 3, not one of 1..1")}),
    "backbone.pt": (
        lambda run, p: torch.save(tiny_state_dict(vision_width=32, text_width=32), p),
        lambda p: dear.load_backbone(str(p), "cpu"),
        {"lacks a key": (lambda sd: without(sd, "ln_final.weight"), "not a ViT CLIP checkpoint"),
         "lacks its head counts": (lambda sd: without(sd, "vision_heads"),
                                   "width 32 is not a multiple of 64")}),
    "classes.txt": (lambda run, p: p.write_text("red\ngreen\n"),
                    lambda p: data.read_text(str(p), "one class a line"), {}),
    "image.png": (lambda run, p: Image.new("RGB", (8, 8)).save(p), data.open_image, {}),
}
# every kind of file: what may stand in its place
ANY = {"missing": "not found", "a FIFO": "not a regular file", "a folder": "not a regular file",
       "cut off": "", "not UTF-8": ""}
CUT = {".json": "not a JSON file", ".pt": "not a", ".txt": "", ".png": "not a readable image"}
BINARY = {".json": "not a JSON file", ".pt": "not a", ".txt": "not UTF-8 text",
          ".png": "not a readable image"}
CASES = [(name, kind) for name, (_, _, edits) in FILES.items() for kind in [*ANY, *edits]
         if (name, kind) != ("classes.txt", "cut off")]  # half a text file is still text


@pytest.mark.parametrize("name, kind", CASES)
def test_every_reader_refuses_each_kind_of_bad_file_in_one_line_naming_it(run, tmp_path, name,
        kind):
    make, read, edits = FILES[name]
    path = tmp_path / name
    make(run, path)
    for f in ("config.json", "roles.json", "model.pt"):  # what built() reads beside the file
        if f != name:
            shutil.copy(run / f, tmp_path / f)
    read(path)  # as made, it reads
    ext = path.suffix
    if kind in ("missing", "a FIFO", "a folder"):
        path.unlink()
        {"a FIFO": os.mkfifo, "a folder": os.mkdir}.get(kind, lambda p: None)(path)
    elif kind == "cut off":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "not UTF-8":
        path.write_bytes(b"\xff\xfe\x00" + path.read_bytes())
    elif ext == ".json":
        keys, value = edits[kind][0]
        path.write_text(json.dumps(edited(json.loads(path.read_text()), keys, value)))
    else:
        torch.save(edits[kind][0](torch.load(path, weights_only=True)), path)
    words = ANY.get(kind) or {"cut off": CUT, "not UTF-8": BINARY}.get(kind, {}).get(ext)
    words = words if kind in ANY else edits[kind][1]
    with pytest.raises((data.UserError, FileNotFoundError)) as e:
        read(path)
    message = str(e.value)
    assert str(path) in message and words in message and "\n" not in message, message
    assert not message.endswith("None")  # a next step, where the reader gives one


def test_a_bad_image_in_a_loader_process_is_one_line(tmp_path):
    """X1: the worker's traceback arrives as a UserError whose message is its last line."""
    (tmp_path / "bad.png").write_bytes(b"not an image")
    images = data.ImageList([(str(tmp_path / "bad.png"), 0)], lambda im: 0)
    with pytest.raises(data.UserError) as e:
        list(torch.utils.data.DataLoader(images, num_workers=1))
    assert str(e.value).startswith(f"{tmp_path / 'bad.png'}: not a readable image")
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------ writes


def failing_replace(monkeypatch, suffix, fault):
    """os.replace raises fault when it would put a file ending in suffix in place."""
    real = os.replace

    def replace(src, dst, *a, **k):
        if str(dst).endswith(suffix):
            raise fault
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)


def debris(*folders):
    return [p for f in folders for p in pathlib.Path(f).rglob("*")
            if ".tmp" in p.name or ".unpacking" in p.name]


def write_explain(tmp, monkeypatch, server):
    rows = [("a.png", Image.new("RGB", (8, 8)), torch.rand(6, 4), ["CLS"] * 6, [[0]] * 6)]
    dear.draw_explain(rows, str(tmp / "sheet.png"))


def write_download(tmp, monkeypatch, server):
    fake_eurosat(*server, monkeypatch)
    data.download("eurosat", str(tmp))


def write_toy_clip(tmp, monkeypatch, server):
    monkeypatch.setattr(toyworld, "pretrain", lambda *a, **k: torch.nn.Linear(1, 1))
    toyworld.ensure_pretrained(str(tmp), log=lambda line: None)


# every kind of write: (how to make it (None: a run of dear.py), the file whose placing fails)
WRITES = {
    "run: roles": (None, "roles.json"), "run: report": (None, "roles.png"),
    "run: config": (None, "config.json"), "run: checkpoint": (None, "checkpoint.pt"),
    "run: weights": (None, "model.pt"), "run: results": (None, "results.json"),
    "explain sheet": (write_explain, "sheet.png"),
    "tables": (lambda tmp, *a: tables.tables(["--out", str(tmp)]), "tables.md"),
    "download": (write_download, "EuroSAT.zip"), "unpacking": (write_download, "2750"),
    "toy world": (lambda tmp, *a: toyworld.write_folder(str(tmp / "w"), [], [("a", "b")]), "w"),
    "toy CLIP": (write_toy_clip, ".pt"),
}


@pytest.mark.parametrize("fault", ["disk full", "Ctrl-C"])
@pytest.mark.parametrize("what", WRITES)
def test_every_write_is_whole_or_absent_after_a_full_disk_or_ctrl_c(world, tmp_path, monkeypatch,
        capsys, server, what, fault):
    make, target = WRITES[what]
    error = OSError(errno.ENOSPC, "No space left on device")
    cache = os.environ["CLIP_CACHE"]
    before = set(debris(cache))
    failing_replace(monkeypatch, target, KeyboardInterrupt() if fault == "Ctrl-C" else error)
    with pytest.raises((KeyboardInterrupt, OSError, SystemExit)) as e:
        if make is None:
            dear.main(argv(world, tmp_path, "--epochs 1"))
        else:
            make(tmp_path, monkeypatch, server)
    monkeypatch.undo()
    assert not debris(tmp_path) and set(debris(cache)) == before
    assert not [p for p in tmp_path.rglob("*" + target) if p.is_file()]
    if make is None and fault == "disk full":  # through dear.py's main: one line, the next step
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and target in err, err
        assert "No space left on device; free some space there" in err
    elif make is None:
        assert e.value.code == 130 and "--resume" in capsys.readouterr().err
    elif fault == "disk full" and what != "unpacking":
        assert target in e.value.filename  # the path, for the one line main prints


# ------------------------------------------------------------------------------ each main


MAINS = {"dear.py": (dear, "call"), "data.py": (data, "check_or_download"),
         "entropy.py": (entropy, "roles_of"), "tables.py": (tables, "tables"),
         "bench.py": (bench, "bench")}
RAISED = {"a user error": (data.UserError("x.json: not a JSON file; fix it"), 2,
                           "error: x.json: not a JSON file; fix it"),
          "a read-only place": (OSError(errno.EROFS, "Read-only file system", "/r/a"), 2,
                                "error: /r/a: Read-only file system; it is read-only: write "
                                "elsewhere (--out, CLIP_CACHE)"),
          "no permission": (PermissionError(errno.EACCES, "Permission denied", "/r"), 2,
                            "error: /r: Permission denied; choose a place you may use"),
          "Ctrl-C": (KeyboardInterrupt(), 130, "")}


@pytest.mark.parametrize("raised", RAISED)
@pytest.mark.parametrize("script", MAINS)
def test_every_main_turns_user_errors_os_errors_and_ctrl_c_into_one_line(monkeypatch, capsys,
        script, raised):
    module, inner = MAINS[script]
    exc, code, line = RAISED[raised]

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(module, inner, fail)
    with pytest.raises(SystemExit) as e:
        module.main([])
    err = capsys.readouterr().err.strip()
    assert e.value.code == code and len(err.splitlines()) == 1 and err.startswith(line), err
    monkeypatch.setattr(module, inner, lambda *a: {}["a bug"])  # a bug keeps its traceback
    with pytest.raises(KeyError):
        module.main([])


# ------------------------------------------------------------------------------ check before work


def test_an_unusable_clip_cache_is_found_before_the_toy_pretraining(tmp_path, monkeypatch):
    """X3: a cache below a file stops the call before minutes of pretraining, not after."""
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(toyworld, "pretrain", lambda *a, **k: pytest.fail("pretrained"))
    with pytest.raises(NotADirectoryError) as e:
        toyworld.ensure_pretrained(str(tmp_path / "file" / "cache"), log=lambda line: None)
    assert "file" in e.value.filename
    with pytest.raises(OSError, match="/proc/self/"):  # a folder that takes no files: even root's
        data.writable_folder("/proc/self")


# folder:PATH datasets as users lay them out: (folders and their images, what is read or said)
LAYOUTS = {
    "a class named split_fewshot": ({"split_fewshot": 4, "red": 4},
                                    ("classes", ["red", "split fewshot"])),
    "images in a class's sub-folder": ({"red": 4, "red/old": 3, "blue": 4},
                                       ("warns", "3 images in sub-folders of class folders")),
    "a hidden folder": ({".thumbnails": 4, "red": 4, "blue": 4}, ("classes", ["blue", "red"])),
    "an empty path": ({}, ("refused", "folder: needs a path")),
    "a class of one image": ({"red": 1, "blue": 4}, ("refused", "red: 1 image(s); a class needs")),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_folder_datasets_keep_their_classes_and_the_caches_apart(tmp_path, capsys, layout):
    """X7: every class folder is a class, the caches are hidden, nested images are counted."""
    folders, (what, expect) = LAYOUTS[layout]
    for name, n in folders.items():
        os.makedirs(tmp_path / name)
        for i in range(n):
            Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / name / f"{i}.png")
    spec = "folder:" if layout == "an empty path" else f"folder:{tmp_path}"
    if what == "refused":
        with pytest.raises(data.UserError, match=re.escape(expect)):
            data.build_dataset(spec, "", shots=1)
        return
    ds = data.build_dataset(spec, "", shots=1)
    if what == "classes":
        assert sorted(ds.classnames) == expect
        assert sorted(os.listdir(tmp_path)) == sorted([*folders, ".split_fewshot",
                                                       "split_folder.json"])
    else:
        assert ds.warnings == [f"folder:{tmp_path}: {expect} are not read (only a class "
                               "folder's own images are)"]
        assert capsys.readouterr().err == f"warning: {ds.warnings[0]}\n"


@pytest.mark.parametrize("name, advice", [
    ("toyworld", "dear.py --dataset toyworld writes it"),
    ("eurosat", "python data.py download eurosat --root"),
    ("imagenet_a", "python data.py download imagenet_a --root")])
def test_the_advice_names_what_fixes_it(tmp_path, name, advice):
    """X8: a generated dataset is written again, a downloaded one downloaded."""
    with pytest.raises(data.UserError, match=advice):
        data.build_dataset(name, str(tmp_path))

"""Faults a user can trigger, by class, against the mechanisms that refuse them (data.py's first
section): one reader per kind of file refuses each kind of bad file in one line that names it; every
write is whole or absent after a failure or Ctrl-C; an OS error reads as its path and the next step;
every script's main turns these into one line and an exit status, and a bug keeps its traceback."""

import errno
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

import bench
import data
import dear
import entropy
import predict
import runs
import tables
import toyworld
from conftest import CLASSES, ROOT, tiny_state_dict
from test_data import fake_eurosat
from test_run import DROP, argv, edit_json, folder_of

@pytest.fixture(scope="module")
def run(world, tmp_path_factory):
    """A finished one-epoch run of the tiny CLIP: its folder."""
    args = argv(world, tmp_path_factory.mktemp("out"), "--epochs 1")
    dear.main(args)
    return pathlib.Path(folder_of(args))


def built(run):
    """The run's model, its optimiser and GradScaler, its config: what checkpoint.pt loads into."""
    c = dear.resolve(dear.Config(**runs.read_config(run, dear.CONFIG)["config"]))
    model = dear.build(c, lambda line: None, run / "roles.json")[0]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return model, opt, torch.amp.GradScaler("cpu", enabled=False), c


def checkpoint(run, path):
    model, opt, scaler, c = built(run)
    torch.save({"model": model.trainable_state(), "opt": opt.state_dict(),
                "scaler": scaler.state_dict(), "epoch": 1, "precision": c.precision}, path)


def resumed(path):
    with runs.RunFolder(str(path.parent), str(path.parent)) as folder:
        return folder.resume(*built(path.parent)[:3], "fp32", 1)


def without(d, key):
    return {k: v for k, v in d.items() if k != key}


# Each kind of file the project reads back: (how it is made from the finished run (None: the
# run's own), its reader, {kind of fault: (the edit, words of the refusal)}). JSON edits are
# (keys, value); torch edits change the loaded object.
FILES = {
    "config.json": (None, lambda p: runs.read_config(p.parent, dear.CONFIG), {
        "lacks a key": ((("inputs", "backbone_sha256"), DROP), "lacks 'backbone_sha256'"),
        "a string for a count": ((("config", "shots"), "16"), "is not a whole number"),
        "not finite": ((("config", "beta"), np.nan), "['beta'] = NaN is not in [0, 1]"),
        "out of range": ((("config", "beta"), 2.0), "['beta'] = 2.0 is not in [0, 1]"),
        "a boolean for a count": ((("config", "epochs"), True), "= true is not a whole number"),
        "from another version": ((("config", "pool"), 3), "'pool' is not a setting of this")}),
    "results.json": (None, lambda p: runs.read_results(p, dear.CONFIG), {
        "lacks a key": ((("evals",), DROP), "lacks 'evals'"),
        "a string for a count": ((("evals", 0, "n"), "16"), "is not a whole number"),
        "not finite": ((("evals", 0, "accuracy"), np.nan), "is not a number in [0, 100]"),
        "out of range": ((("evals", 1, "accuracy"), 150), "= 150 is not a number in [0, 100]"),
        "a setting out of range": ((("config", "beta"), 2.0), "['beta'] = 2.0 is not in [0, 1]"),
        "from another version": ((("config", "pool"), 3), "'pool' is not a setting of this"),
        "no HM": ((("hm",), DROP), "its hm is not the HM of its base and novel")}),
    "roles.json": (None, entropy.read_roles, {
        "lacks a key": ((("num_heads",), DROP), "lacks 'num_heads'"),
        "a string for a count": ((("heads", 0, "head"), "0"), "is not a whole number"),
        "not finite": ((("heads", 2, "entropy"), np.nan), "is not a finite number"),
        "out of range": ((("heads", 1, "layer"), 9), "block 9 head 1 is not one of its heads")}),
    "split_folder.json": (
        lambda run, p: shutil.copy(os.path.join(runs.read_config(run, dear.CONFIG)["inputs"]
                                                ["dataset_folder"], p.name), p),
        lambda p: data.read_split(str(p), "delete it"),
        {"lacks a key": ((("test",), DROP), "lacks 'test'"),
         "a string for a count": ((("train", 3, 1), "0"), "[3][1] = \"0\" is not a whole number")}),
    "model.pt": (
        None, lambda p: built(p.parent)[0].load_trainable(data.read_torch(p, "train it again"), p),
        {"lacks a key": (lambda sd: without(sd, "R"), "does not fit this model"),
         "a string for a tensor": (lambda sd: dict(sd, R="0"), "does not fit this model"),
         "not finite": (lambda sd: dict(sd, R=sd["R"] * np.nan), "does not fit this model"),
         "out of range": (lambda sd: dict(sd, R=sd["R"][:2]), "R is [2, 512]")}),
    "checkpoint.pt": (checkpoint, resumed, {
        "lacks a key": (lambda ck: without(ck, "epoch"), "lacks 'epoch'"),
        "a string for a count": (lambda ck: dict(ck, epoch="1"), "is not a whole number"),
        "not finite": (lambda ck: dict(ck, model=dict(ck["model"], w=ck["model"]["w"] * np.nan)),
                       "does not fit this model"),
        "out of range": (lambda ck: dict(ck, epoch=3), "holds epoch 3, not one of 1..1")}),
    "backbone.pt": (lambda run, p: torch.save(tiny_state_dict(vision_width=32, text_width=32), p),
                    lambda p: runs.load_backbone(str(p), "cpu"), {
        "lacks a key": (lambda sd: without(sd, "ln_final.weight"), "not a ViT CLIP checkpoint"),
        "lacks its head counts": (lambda sd: without(sd, "vision_heads"),
                                  "width 32 is not a multiple of 64")}),
    "classes.txt": (lambda run, p: p.write_text("red\ngreen\n"),
                    lambda p: data.read_text(str(p), "one class a line"), {}),
    "image.png": (lambda run, p: Image.new("RGB", (8, 8)).save(p), data.open_image, {})}
CUT = {".json": "not a JSON file", ".pt": "not a", ".txt": "", ".png": "not a readable image"}
# every kind of file: what may stand in its place (the words, or by the file's extension)
ANY = {"missing": "not found", "a FIFO": "not a regular file", "a folder": "not a regular file",
       "cut off": CUT, "not UTF-8": {**CUT, ".txt": "not UTF-8 text"},
       "empty": {**CUT, ".txt": "no lines", ".pt": "(EOFError);"}}
CASES = [(name, kind) for name, (_, _, edits) in FILES.items() for kind in [*ANY, *edits]
         if (name, kind) not in (("classes.txt", "cut off"),  # half a text file is still text
                                 ("checkpoint.pt", "missing"))]  # none: nothing to resume


@pytest.mark.parametrize("name, kind", CASES)
def test_every_reader_refuses_each_bad_file_in_one_line_naming_it(run, tmp_path, name, kind):
    make, read, edits = FILES[name]
    path, ext = tmp_path / name, (tmp_path / name).suffix
    for f in ("config.json", "roles.json", "model.pt"):  # what built() reads beside the file
        shutil.copy(run / f, tmp_path / f)
    (make or (lambda run, p: shutil.copy(run / name, p)))(run, path)
    read(path)  # as made, it reads
    if kind in ("missing", "a FIFO", "a folder"):
        path.unlink()
        {"a FIFO": os.mkfifo, "a folder": os.mkdir}.get(kind, lambda p: None)(path)
    elif kind in ("cut off", "not UTF-8", "empty"):
        b = path.read_bytes()
        path.write_bytes({"cut off": b[: len(b) // 2], "empty": b""}.get(kind, b"\xff\xfe\x00" + b))
    elif ext == ".json":
        edit_json(path, *edits[kind][0])
    else:
        torch.save(edits[kind][0](torch.load(path, weights_only=True)), path)
    words = edits[kind][1] if kind in edits else ANY[kind]
    words = words[ext] if isinstance(words, dict) else words
    with pytest.raises((data.UserError, FileNotFoundError)) as e:
        read(path)
    message = str(e.value)
    assert str(path) in message and words in message and "\n" not in message, message
    assert not message.endswith("None")  # a next step, where the reader gives one


def test_a_bad_image_in_a_loader_process_is_one_line(tmp_path):
    """X1: the worker's traceback arrives as a UserError whose message is its last line."""
    (bad := tmp_path / "bad.png").write_bytes(b"not an image")
    images = data.ImageList([(str(bad), 0)], lambda im: 0)
    with pytest.raises(data.UserError) as e:
        list(torch.utils.data.DataLoader(images, num_workers=1))
    assert str(e.value).startswith(f"{bad}: not a readable image") and "\n" not in str(e.value)


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


# every kind of write: (how to make it (None: a run of dear.py), the file whose placing fails)
WRITES = {
    **{f"run: {f}": (None, f) for f in ["roles.json", "roles.png", "mask.png", "config.json",
                                        "checkpoint.pt", "model.pt", "results.json"]},
    "explain sheet": (lambda tmp: predict.draw_explain(
        ["a.png"], [Image.new("RGB", (8, 8))], torch.rand(1, 6, 4), [[0]] * 6, None,
        {"cls": 1.0}, str(tmp / "sheet.png")), "sheet.png"),
    "tables": (lambda tmp: tables.tables(["--out", str(tmp)]), "tables.md"),
    "download": (lambda tmp: data.download("eurosat", str(tmp)), "EuroSAT.zip"),
    "unpacking": (lambda tmp: data.download("eurosat", str(tmp)), "2750"),
    "toy world": (lambda tmp: toyworld.write_folder(str(tmp / "w"), [], [("a", "b")]), "w"),
    "toy CLIP": (lambda tmp: toyworld.ensure_pretrained(str(tmp), log=lambda line: None), ".pt")}


@pytest.mark.parametrize("fault", ["disk full", "Ctrl-C", "SIGTERM"])
@pytest.mark.parametrize("what", WRITES)
def test_each_write_is_whole_or_absent(world, tmp_path, monkeypatch, capsys, server, what, fault):
    make, target = WRITES[what]
    fake_eurosat(*server, monkeypatch)  # the downloads' source, and a toy CLIP pretrained at once
    monkeypatch.setattr(toyworld, "pretrain", lambda *a, **k: torch.nn.Linear(1, 1))
    before = set(debris(cache := os.environ["CLIP_CACHE"]))
    failing_replace(monkeypatch, target, {  # as data.interrupted raises
        "disk full": OSError(errno.ENOSPC, "No space left on device"),
        "Ctrl-C": KeyboardInterrupt(), "SIGTERM": KeyboardInterrupt("SIGTERM")}[fault])
    with pytest.raises((KeyboardInterrupt, OSError, SystemExit)) as e:
        make(tmp_path) if make else dear.main(argv(world, tmp_path, "--epochs 1"))
    monkeypatch.undo()
    assert not debris(tmp_path) and set(debris(cache)) == before
    assert not [p for p in tmp_path.rglob("*" + target) if p.is_file()]
    if make is None and fault == "disk full":  # through dear.py's main: one line, the next step
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and target in err, err
        assert "No space left on device; free some space there" in err
    elif make is None:
        code = 143 if fault == "SIGTERM" else 130
        assert e.value.code == code and "--resume" in capsys.readouterr().err
    elif fault == "disk full" and what != "unpacking":
        assert target in e.value.filename  # the path, for the one line main prints


# ------------------------------------------------------------------------------ each main


MAINS = {"dear.py": (dear, "call"), "predict.py": (predict, "predict"),
         "data.py": (data, "check_or_download"), "entropy.py": (entropy, "roles_of"),
         "tables.py": (tables, "tables"), "bench.py": (bench, "bench")}
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
def test_mains_say_user_and_os_errors_and_ctrl_c_in_one_line(monkeypatch, capsys, script, raised):
    (module, inner), (exc, code, line) = MAINS[script], RAISED[raised]
    monkeypatch.setattr(module, inner, lambda *a, **k: (_ for _ in ()).throw(exc))
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
    monkeypatch.setattr(runs, "load_backbone", lambda *a: pytest.fail("the backbone loaded first"))
    with pytest.raises(data.UserError, match="file: not a JSON file"):  # a --roles of no roles
        dear.run(dear.Config("toyworld", roles=str(tmp_path / "file")))
    with pytest.raises(NotADirectoryError):  # --roles-only's --out, before the roles
        dear.roles_only(dear.resolve(dear.Config("toyworld", out=str(tmp_path / "file"))))


# folder:PATH datasets as users lay them out: (folders and their images, what is read or said)
LAYOUTS = {
    "a class named split_fewshot": ({"split_fewshot": 4, "red": 4},
                                    ("classes", ["red", "split fewshot"])),
    "images in a class's sub-folder": ({"red": 4, "red/old": 3, "blue": 4},
                                       ("warns", "3 images in sub-folders of class folders")),
    "a hidden folder": ({".thumbnails": 4, "red": 4, "blue": 4}, ("classes", ["blue", "red"])),
    "a class of one image": ({"red": 1, "blue": 4}, ("refused", "red: 1 image(s); a class needs")),
    "an empty path": ({}, ("refused", "folder: needs a path"))}


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
        assert set(os.listdir(tmp_path)) == {*folders, ".split_fewshot", "split_folder.json"}
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


# ------------------------------------------------------------------------- round five, by class
# Each class of the fifth hostile pass: a table of its cases against the one mechanism closing it.

# an empty value is never a path, name, template, list or output (data.Parser's text type):
# {main: (the arguments it needs besides, its flags)}
EMPTY = {dear.main: (["--protocol", "xd"], "--out --root --backbone --targets --dataset --roles"),
         predict.main: (["--load", "RUN", "a.png"], "--load --template --classes --explain"),
         entropy.main: (["--dataset", "dtd"], "--texts --out"), tables.main: ([], "--out"),
         bench.main: ([], "--out"), data.main: (["check", "dtd"], "--root")}


@pytest.mark.parametrize("main, flag", [(m, f) for m, (_, fs) in EMPTY.items() for f in fs.split()])
def test_an_empty_value_is_refused_with_the_flags_name(main, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(EMPTY[main][0] + [flag, ""])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: argument {flag}: an empty value; give one, or " \
        "leave the flag out (see --help)\n"


def edit_run(run, tmp, what):
    """A copy of the finished run, with one input it recorded changed."""
    shutil.copytree(run, copy := tmp / "copy")
    if what == "its weights":
        state = torch.load(copy / "model.pt")
        torch.save(dict(state, R=state["R"] + 1), copy / "model.pt")
    elif what == "its roles":
        edit_json(copy / "roles.json", ("heads", 0, "role"), "mixed")
        edit_json(copy / "roles.json", ("heads", 0, "attribute"), None)
    elif what == "its roles, gone (the cache's differ)":  # what a cache changed since would show
        os.remove(copy / "roles.json")
        edit_json(copy / "config.json", ("inputs", "roles_sha256"), "0" * 64)
    elif what == "its backbone":
        edit_json(copy / "config.json", ("inputs", "backbone_sha256"), "0" * 64)
    elif what == "its results, a setting out of range":  # read at every use, as config.json
        edit_json(copy / "results.json", ("config", "beta"), 2.0)
    return copy


@pytest.mark.parametrize("use", ["--eval-only", "predict"])
@pytest.mark.parametrize("what, says", [
    ("its weights", "model_sha256"), ("its roles", "roles_sha256"),
    ("its roles, gone (the cache's differ)", "roles_sha256"), ("its backbone", "backbone_sha256"),
    ("its results, a setting out of range", "['beta'] = 2.0 is not in [0, 1]")])
def test_a_run_is_used_only_with_its_recorded_inputs(run, world, tmp_path, capsys, use, what, says):
    copy, shapes = edit_run(run, tmp_path, what), f"folder:{world / 'shapes'}"
    if use == "predict":
        main, args = predict.main, [data.build_dataset(shapes, "").test[0][0]]
    else:
        main, args = dear.main, ["--dataset", shapes, "--eval-only", "--workers", "0"]
    with pytest.raises(SystemExit):
        main(args + ["--load", str(copy)])
    head, tail = ((f"{copy / 'results.json'}: ", runs.FIX_RESULTS) if what.startswith("its res")
                  else (f"{copy}: not the inputs it was run with", "restore them (its roles.json "
                        "and model.pt), or run it again"))
    line = (err := capsys.readouterr().err).splitlines()[-1]  # after the roles' log lines
    assert line.startswith(f"error: {head}") and says in line and line.endswith(f"; {tail}"), err
    assert not (copy / "eval").exists() or not list((copy / "eval").rglob("results.json"))


def test_a_folder_datasets_split_follows_its_class_folders(world, tmp_path):
    shutil.copytree(world / "shapes", tmp_path / "shapes")
    data.build_dataset(f"folder:{tmp_path / 'shapes'}", "")  # writes split_folder.json
    shutil.copytree(tmp_path / "shapes" / CLASSES[0], tmp_path / "shapes" / "a new class")
    with pytest.raises(data.UserError, match="split_folder.json splits the classes .* but the "
                       "folder holds .*'a new class'.*; delete it, and the folder is split anew"):
        data.build_dataset(f"folder:{tmp_path / 'shapes'}", "")


@pytest.mark.parametrize("link", ["log.txt", "the run folder's parent"])
def test_no_write_goes_through_a_link_in_the_out_tree(world, tmp_path, capsys, link):
    (target := tmp_path / "precious").mkdir()
    (target / "log.txt").write_text("keep me")
    folder = pathlib.Path(folder_of(args := argv(world, tmp_path / "out", "--epochs 1")))
    at, to = (folder / link, target / link) if link == "log.txt" else (folder.parent, target)
    at.parent.mkdir(parents=True)
    os.symlink(to, at)
    with pytest.raises(SystemExit):
        dear.main(args)
    assert "symbolic link" in capsys.readouterr().err
    assert os.listdir(target) == ["log.txt"] and (target / "log.txt").read_text() == "keep me"


def test_a_kill_leaves_nothing_and_its_leftovers_go_on_the_next_write(tmp_path, monkeypatch):
    """SIGTERM (and Ctrl-C) during a write: the process says one line and exits 143 (130), its
    temporary file gone; a file a killed process left (its pid gone) goes at the next write of
    the same path, one of a live process stays."""
    script = ("import sys, time, data; data.guarded(data.atomic_write, sys.argv[1], lambda tmp: "
              "open(tmp, 'w').write('x') and time.sleep(60))")
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        p = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "a.json")], cwd=ROOT,
                             stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
        while not list(tmp_path.glob("a.json.tmp*")):
            time.sleep(0.05)
        p.send_signal(sig)
        assert p.wait(30) == code and p.stderr.read().strip().splitlines() == ["interrupted"]
        assert os.listdir(tmp_path) == []
    for name in ("x.tmp.tmp999999999", "b.zip.unpacking999999999", f"x.tmp.tmp{os.getppid()}"):
        (tmp_path / name).mkdir()
    data.write_json(tmp_path / "x.tmp", {})  # a name with the tag inside: the pid is after the last
    with pytest.raises(data.UserError):
        data.unpack(str(tmp_path / "b.zip"))
    assert sorted(os.listdir(tmp_path)) == ["x.tmp", f"x.tmp.tmp{os.getppid()}"]
    # a system without /proc cannot tell a dead pid: its leftover stays
    (tmp_path / "a.json.tmp999999999").mkdir()
    monkeypatch.setattr(os.path, "isdir", lambda p, isdir=os.path.isdir: p != "/proc/self"
                        and isdir(p))
    data.write_json(tmp_path / "a.json", {})
    assert (tmp_path / "a.json.tmp999999999").exists()
    monkeypatch.setattr(data, "read_text", lambda *a: (_ for _ in ()).throw(FileNotFoundError()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # nor cpuinfo: platform's name
    assert (env := runs.environment()) == dict(env, python=platform.python_version(), device=(
        platform.processor() or platform.machine()), cudnn=torch.backends.cudnn.version())


def default_signals():
    """A child's SIGINT as a terminal's (a shell's background job would have it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_the_imports_is_one_line():
    p = subprocess.Popen([sys.executable, "dear.py", "--help"], cwd=ROOT, stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, text=True, preexec_fn=default_signals)
    while "libtorch" not in open(f"/proc/{p.pid}/maps").read():  # importing torch, after data
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    p.wait(30)
    assert p.stderr.read().strip() == "interrupted"


@pytest.mark.parametrize("where", ["toy CLIP", "a run", "ulimit -f"])
def test_the_space_the_work_writes_is_proven_first(world, tmp_path, monkeypatch, capsys, where):
    """The bytes of the largest file the work writes, taken for real (posix_fallocate) before
    minutes of pretraining or training: a full disk or a file size limit stops the call there,
    naming the user's folder."""
    full = OSError(errno.ENOSPC, "No space left on device")
    if where == "ulimit -f":  # the checkpoint's 30 MB against a limit of 1 MB
        script = ("import sys, data, toyworld; toyworld.pretrain = None; "
                  "data.guarded(toyworld.ensure_pretrained, sys.argv[1])")
        done = subprocess.run(["bash", "-c", f"ulimit -f 1000; {sys.executable} -c \"{script}\" "
                               f"{tmp_path}"], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and "File too large (the work writes" in done.stderr
        return
    unsupported = OSError(errno.EOPNOTSUPP, "Operation not supported")  # then the empty file
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(unsupported))
    assert data.writable_folder(str(tmp_path / "any"), 10**15) == str(tmp_path / "any")
    monkeypatch.delattr(os, "posix_fallocate")  # another system
    assert data.writable_folder(str(tmp_path / "any"), 10**15) == str(tmp_path / "any")
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(full), False)
    with pytest.raises((SystemExit, OSError)) as e:
        if where == "toy CLIP":
            monkeypatch.setattr(toyworld, "pretrain", lambda *a, **k: pytest.fail("pretrained"))
            toyworld.ensure_pretrained(str(tmp_path), log=lambda line: None)
        else:
            monkeypatch.setattr(dear, "train", lambda *a: pytest.fail("trained"))
            dear.main(argv(world, tmp_path, "--epochs 1"))
    said = capsys.readouterr().err if where == "a run" else str(e.value)
    assert "No space left on device (the work writes" in said and str(tmp_path) in said
    assert "free some space there" in said if where == "a run" else e.value.errno == errno.ENOSPC


def test_a_seed_at_the_top_of_its_range_draws_batches(world, tmp_path):
    c = dear.settings(*dear.parse_args(argv(world, tmp_path, "--seed 4294967295")))
    assert len(dear.batches(10, 3, c)) == 10 // c.batch_size  # its derived seeds: no overflow


@pytest.mark.parametrize("what, says", [
    ("two {}", "template 'a {} of a {}.': it needs exactly one {}"),
    ("a named field", "template 'a {name}.': it needs exactly one {}"),
    ("no class names", "names.txt: no lines"), ("a recorded J beyond the depth", "--J 7: "),
    ("a recorded run without tokens", "has no attribute tokens to explain"),
    ("a float image in [0, 1]", None), ("a float image in [0, 255]", "floating-point pixels")])
def test_values_are_checked_before_the_model_loads(run, tmp_path, capsys, monkeypatch, what, says):
    pixels = np.full((8, 8), 0.5 if "[0, 1]" in what else 200.0, np.float32)
    Image.fromarray(pixels, mode="F").save(image := tmp_path / "f.tiff")
    args = ["--load", str(run), "--explain", str(sheet := tmp_path / "new" / "s.png"), str(image)]
    if "field" in what or "{}" in what:
        args += ["--template", "a {} of a {}." if "{}" in what else "a {name}."]
    elif what == "no class names":
        (tmp_path / "names.txt").write_text("\n\n")
        args += ["--classes", str(tmp_path / "names.txt")]
    elif "recorded" in what:  # --explain on it: refused unless it has tokens
        shutil.copytree(run, tmp_path / "copy")
        key, value = ("J", 7) if "J" in what else ("attr_tokens", False)
        edit_json(tmp_path / "copy" / "config.json", ("config", key), value)
        args[1] = str(tmp_path / "copy")
    if says is None:
        assert predict.main(args)[0]["top5"] and sheet.exists()  # classified, in a new folder
        return
    monkeypatch.setattr(dear, "load_run", lambda *a: pytest.fail("the model loaded first"))
    with pytest.raises(SystemExit):
        predict.main(args)
    assert says in capsys.readouterr().err and not sheet.parent.exists()


def test_reads_never_block_on_a_fifo(world, tmp_path, capsys, monkeypatch):
    """A FIFO where a run's lock or the toy checkpoint is expected: refused, or made again, never
    waited on."""
    folder = pathlib.Path(folder_of(args := argv(world, tmp_path, "--epochs 1")))
    folder.mkdir(parents=True)
    os.mkfifo(folder / ".lock")
    with pytest.raises(SystemExit):
        dear.main(args)
    assert ".lock: not a regular file" in capsys.readouterr().err
    os.mkfifo(tmp_path / toyworld.checkpoint_name())
    monkeypatch.setattr(toyworld, "pretrain", lambda *a, **k: torch.nn.Linear(1, 1))
    path = toyworld.ensure_pretrained(str(tmp_path), log=lambda line: None)
    assert os.path.isfile(path)

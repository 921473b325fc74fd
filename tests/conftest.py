"""Shared test helpers: a tiny random CLIP built the same way a real checkpoint is loaded.

`tiny_clip(...)` makes a CLIP with small towers, takes its state dict, adds the two 0-dim
head-count entries that tiny checkpoints carry (head counts of a width that is not a multiple
of 64 cannot be inferred from shapes), and rebuilds it through `clip.model.build_model`, so
every test exercises the real loading path. The vocabulary has the real 49,408 entries, so
`clip.tokenize` output can be fed straight in.
"""

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile

# Idle OpenMP threads sleep instead of spinning (BENCH.md, "Sharing the CPU"): set before torch
# loads, and inherited by every subprocess a test starts; a user's own OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One intra-op thread per test process unless you set OMP_NUM_THREADS: the tests' models are tiny
# (a second thread adds CPU time, not speed), and the toy CLIP pretrains in a process of its own
# beside the tests (conftest's PRETRAIN; its two towers on two threads whatever this says).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Make the repository root importable (clip/, data.py, toyworld.py, ...) however pytest is run.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from clip.model import CLIP, build_model  # noqa: E402


def tiny_state_dict(
    seed=0,
    vision_layers=4,
    vision_width=64,
    vision_heads=4,
    patch=8,
    resolution=32,
    text_layers=2,
    text_width=64,
    text_heads=4,
    embed_dim=32,
    context_length=77,
    vocab_size=49408,
):
    """A random CLIP state dict with OpenAI's key names plus 'vision_heads'/'text_heads' entries."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(seed)
        model = CLIP(
            embed_dim=embed_dim,
            image_resolution=resolution,
            vision_layers=vision_layers,
            vision_width=vision_width,
            vision_patch_size=patch,
            context_length=context_length,
            vocab_size=vocab_size,
            transformer_width=text_width,
            transformer_heads=text_heads,
            transformer_layers=text_layers,
            vision_heads=vision_heads,
        )
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["vision_heads"] = torch.tensor(vision_heads)
    sd["text_heads"] = torch.tensor(text_heads)
    return sd


def tiny_clip(
    seed=0,
    vision_layers=4,
    vision_width=64,
    vision_heads=4,
    patch=8,
    resolution=32,
    text_layers=2,
    text_width=64,
    text_heads=4,
    embed_dim=32,
    context_length=77,
):
    """A random tiny CLIP (fp32, eval mode) built through build_model from a state dict."""
    sd = tiny_state_dict(
        seed=seed,
        vision_layers=vision_layers,
        vision_width=vision_width,
        vision_heads=vision_heads,
        patch=patch,
        resolution=resolution,
        text_layers=text_layers,
        text_width=text_width,
        text_heads=text_heads,
        embed_dim=embed_dim,
        context_length=context_length,
    )
    return build_model(sd)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA device; skipped where there is none (select: -m cuda)"
    )


@pytest.fixture
def tiny_model():
    """The default tiny CLIP: ViT 4 blocks x 4 heads, width 64, 32x32 images, patch 8;
    text 2 blocks."""
    return tiny_clip()


# The toy CLIP's pretraining (the slowest fixture) starts in a process of its own as soon as the
# collected tests are known to need it, and runs beside the tests before the first that does; the
# fixture then waits for it.
PRETRAIN = """
import os, sys, threading
import toyworld
# stdin is a pipe from the test session: at its end (the session is over, however it ended) stop too
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(1)), daemon=True).start()
toyworld.ensure_pretrained(sys.argv[1], log=lambda line: print(line, flush=True))
"""
_pretraining = {}  # "proc", "cache", "log", "folder", "saved": the pretraining of this session

# The quick start's two commands (DeAR, then --method zeroshot), through dear.py's main in a process
# of their own, started as soon as the toy CLIP is ready (saved: at collection; pretrained: after
# the first test to end after it), so that they run beside the other tests; the test that reads
# their results (fixture toy_demo) waits.
# argv: folder (data/, runs/ and clip_cache/, a copy of the toy CLIP's cache: roles of its own).
DEMO = """
import os, sys, threading
import dear
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(1)), daemon=True).start()
folder = sys.argv[1]
os.environ["CLIP_CACHE"] = os.path.join(folder, "clip_cache")
common = ["--dataset", "toyworld", "--root", os.path.join(folder, "data")]
common += ["--out", os.path.join(folder, "runs"), "--workers", "0"]
dear.main(common)
dear.main(common + ["--method", "zeroshot"])
"""
_demo = {}  # "wanted", "proc", "log", "folder": the quick start of this session

# A toy CLIP pretrained by an earlier session on this machine is reused while nothing that decides
# its weights has changed: these files, torch's and numpy's versions and the CPU's vector
# instructions (the key below; not the thread count: toyworld.pretrain uses one per tower).
# DEAR_TEST_CACHE: the folder (default ~/.cache/dear/tests); set it empty to pretrain every time.
# A clean machine (CI) pretrains, as a new user's first run does.
TOY_INPUTS = (
    "toyworld.py",
    "clip/model.py",
    "clip/tokenizer.py",
    "clip/bpe_simple_vocab_16e6.txt.gz",
)
# the checkpoint and what toyworld.save_checkpoint writes beside it
TOY_FILES = ("", ".sha256", ".json")


def toy_key(root=ROOT):
    """16 hex digits of SHA256 over what decides the default toy CLIP's weights."""
    import numpy as np

    h = hashlib.sha256()
    for name in TOY_INPUTS:
        with open(os.path.join(root, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    cpu = torch.backends.cpu.get_cpu_capability()
    versions = f"torch {torch.__version__} numpy {np.__version__}"
    h.update(f"{versions} {cpu} {platform.machine()}".encode())
    return h.hexdigest()[:16]


def saved_pretraining():
    """The folder of this key's saved toy CLIP (it may not exist yet), or None when turned off."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "dear", "tests")
    root = os.environ.get("DEAR_TEST_CACHE", default)
    return os.path.join(root, "toy-clip-" + toy_key()) if root else None


def save_pretraining(cache, lines, saved):
    """Copy the checkpoint files and the log to `saved`, all at once (a folder renamed into place);
    a folder that cannot be written is left alone: the next session pretrains again."""
    import toyworld

    try:
        os.makedirs(os.path.dirname(saved), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".saving-", dir=os.path.dirname(saved))
    except OSError:
        return
    try:
        name = toyworld.checkpoint_name()
        for suffix in TOY_FILES:
            shutil.copy2(os.path.join(cache, name + suffix), tmp)
        with open(os.path.join(tmp, "log.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        os.rename(tmp, saved)  # fails if another session saved it first: theirs is the same
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def pytest_collection_modifyitems(session, config, items):
    """The tests that need the toy CLIP run last (in their own order): the others run on one core
    while it pretrains on the other, instead of waiting for it at the first that needs it."""
    items.sort(key=lambda item: "toy_pretraining" in getattr(item, "fixturenames", ()))


def pytest_collection_finish(session):
    names = [getattr(item, "fixturenames", ()) for item in session.items]
    _demo["wanted"] = any("toy_demo" in f for f in names)
    if not any("toy_pretraining" in f for f in names):
        return
    import toyworld

    folder = tempfile.mkdtemp(prefix="toy-pretraining-")
    cache, saved = os.path.join(folder, "clip_cache"), saved_pretraining()
    _pretraining.update(cache=cache, folder=folder, saved=saved)
    name = toyworld.checkpoint_name()
    if saved and all(os.path.isfile(os.path.join(saved, name + x)) for x in TOY_FILES):
        os.makedirs(cache)
        for suffix in TOY_FILES:  # a copy: the tests write roles and runs into their CLIP cache
            shutil.copy2(os.path.join(saved, name + suffix), cache)
        with open(os.path.join(saved, "log.txt")) as f:
            _pretraining["lines"] = f.read().splitlines()
        start_demo(cache)  # the toy CLIP is there: the quick start runs beside every test
        return
    _pretraining.update(start_script(PRETRAIN, cache, folder))


def start_script(script, arg, folder):
    """Run `script` (PRETRAIN, DEMO) with argument `arg` in a Python process of its own, its output
    in folder/log.txt; its stdin is a pipe from this session, whose end stops it."""
    log = open(os.path.join(folder, "log.txt"), "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", script, arg],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return dict(proc=proc, log=log)


def wait_script(state, what):
    """Wait for start_script's process; its log lines (one failure message naming `what`)."""
    proc, log = state["proc"], state["log"]
    proc.wait()
    log.seek(0)
    lines = log.read().splitlines()
    assert proc.returncode == 0, f"{what} failed:\n" + "\n".join(lines[-20:])
    return lines


def stop_script(state):
    """At the session's end (stopped early: -x, Ctrl-C): leave no start_script process running."""
    proc = state.get("proc")
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    state["log"].close()


def pytest_runtest_logfinish(nodeid, location):
    """After each test: once the toy CLIP's pretraining has ended well, start the quick start."""
    proc = _pretraining.get("proc")
    if proc is not None and "proc" not in _demo and proc.poll() == 0:
        start_demo(_pretraining["cache"])


def pytest_sessionfinish(session):
    stop_script(_demo)
    if not _pretraining:
        return
    stop_script(_pretraining)
    shutil.rmtree(_pretraining["folder"], ignore_errors=True)


@pytest.fixture(scope="session")
def toy_pretraining(tmp_path_factory):
    """(cache folder, log lines): the toy CLIP, pretrained once per test session (or saved by an
    earlier one, TOY_INPUTS) with the default recipe (what `toyworld.load_clip("toy")` and
    `python dear.py --dataset toyworld` use), and what pretraining logged."""
    if not _pretraining:  # not started at collection (a plugin or a direct call): pretrain here
        import toyworld

        cache, lines = tmp_path_factory.mktemp("clip_cache"), []
        toyworld.ensure_pretrained(str(cache), log=lines.append)
        return str(cache), lines
    if "lines" not in _pretraining:  # pretrained in this session
        lines = wait_script(_pretraining, "toy pretraining")
        _pretraining["lines"] = lines
        if _pretraining["saved"]:
            save_pretraining(_pretraining["cache"], lines, _pretraining["saved"])
    return _pretraining["cache"], _pretraining["lines"]


@pytest.fixture(scope="session")
def toy_cache(toy_pretraining):
    """The CLIP cache folder holding the default toy CLIP; shared by the end-to-end tests."""
    start_demo(toy_pretraining[0])
    return toy_pretraining[0]


def start_demo(cache, wanted=False):
    """Start the quick start (DEMO) on a copy of the toy CLIP: once per session, if a collected test
    wants it (or `wanted`)."""
    if "proc" in _demo or not (wanted or _demo.get("wanted")):
        return
    import toyworld

    folder = tempfile.mkdtemp(prefix="toy-demo-")
    os.makedirs(os.path.join(folder, "clip_cache"))
    name = toyworld.checkpoint_name()
    for suffix in TOY_FILES:
        shutil.copy2(os.path.join(cache, name + suffix), os.path.join(folder, "clip_cache"))
    _demo.update(start_script(DEMO, folder, folder), folder=folder)


@pytest.fixture(scope="session")
def toy_demo(toy_cache):
    """(folder, log lines) of the quick start's two runs (DEMO): folder/runs, folder/clip_cache."""
    start_demo(toy_cache, wanted=True)  # if not started yet (no test asked for toy_cache before)
    lines = wait_script(_demo, "the toy quick start")
    yield _demo["folder"], lines
    shutil.rmtree(_demo["folder"], ignore_errors=True)

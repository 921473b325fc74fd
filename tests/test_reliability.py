"""Faults of the machine around a run: full disks, unusable folders, over-long names, locks that
outlive their process, two pretrainings at once, and a toy CLIP checkpoint replaced in the cache.
Each ends in one line that names the file and the fix, before any work is lost."""

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import clip
import toyworld as T
import util
from conftest import ROOT, tiny_clip


def _run(code, *args):
    """A separate Python process running `code` with the repository importable."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _wait_for(path, timeout=60):
    end = time.time() + timeout
    while not (os.path.exists(path) and open(path).read()):
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.05)
    return open(path).read()


# ------------------------------------------------------------------------------------ a full disk


def _full_disk(monkeypatch, code=errno.ENOSPC, over=0):
    """Writes of over `over` bytes through util.write_atomic fail as on a full disk (or quota)."""
    real = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            if len(data) > over:
                raise OSError(code, os.strerror(code))
            return self.f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(util.os, "fdopen", lambda fd, mode: Full(real(fd, mode)))


@pytest.mark.parametrize(
    "code, says", [(errno.ENOSPC, "the disk is full"), (errno.EDQUOT, "quota")]
)
def test_a_full_disk_names_the_file_and_the_bytes_and_keeps_the_old_file(
    tmp_path, monkeypatch, code, says
):
    path = tmp_path / "roles.json"
    path.write_text("the old roles")
    _full_disk(monkeypatch, code)
    with pytest.raises(util.DiskFull) as e:
        util.write_atomic(str(path), "x" * 5000)
    msg = str(e.value)
    assert isinstance(e.value, OSError) and e.value.errno == code
    assert str(path) in msg and "5000 bytes" in msg and says in msg and "free" in msg
    assert "\n" not in msg and "Errno" not in msg
    assert path.read_text() == "the old roles"
    assert os.listdir(tmp_path) == ["roles.json"]  # no temporary file left


def test_a_full_cache_during_toy_pretraining_names_the_checkpoint(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    path = cache / T.checkpoint_name()

    def pretrain(steps, seed, out_path, log):  # what pretraining ends with: saving the checkpoint
        T.save_checkpoint(tiny_clip(), out_path)

    monkeypatch.setattr(T, "pretrain", pretrain)
    _full_disk(monkeypatch, over=1000)  # the SHA256 record fits, the checkpoint does not
    with pytest.raises(T.ToyWorldError) as e:
        T.ensure_pretrained(str(cache), log=None)
    assert str(path) in str(e.value) and "the disk is full" in str(e.value) and "MB" in str(e.value)
    assert not path.exists()


# ------------------------------------------------------------------------- folders a user chose


def test_a_cache_under_a_file_stops_before_any_pretraining(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setattr(T, "pretrain", lambda *a, **k: pytest.fail("pretrained before the check"))
    monkeypatch.setenv("CLIP_CACHE", str(blocker / "x"))
    with pytest.raises(T.ToyWorldError) as e:
        T.load_clip("toy")
    msg = str(e.value)
    assert f"{blocker / 'x'} cannot be used ({blocker} is a file, not a folder)" in msg
    assert "CLIP_CACHE" in msg
    with pytest.raises(util.PathError, match="set X"):  # the check itself, for any folder
        util.check_writable_dir(str(blocker / "x" / "y"), "the output folder", "set X")
    util.check_writable_dir(str(tmp_path / "new" / "deeper"), "the output folder", "set X")
    assert (tmp_path / "new" / "deeper").is_dir() and not os.listdir(tmp_path / "new" / "deeper")


def test_a_cache_without_room_for_the_checkpoint_stops_before_pretraining(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "pretrain", lambda *a, **k: pytest.fail("pretrained without room"))
    monkeypatch.setattr(T.shutil, "disk_usage", lambda p: type("Usage", (), {"free": 10**6})())
    room = r"has 1\.0 MB free; the toy CLIP checkpoint needs 6\d\.\d MB"
    with pytest.raises(T.ToyWorldError, match=room):
        T.ensure_pretrained(str(tmp_path / "cache"), log=None)


def test_a_name_over_the_limit_is_counted_in_bytes(tmp_path):
    util.check_path_names(str(tmp_path / ("a" * 255) / "b"))  # 255 bytes: allowed
    with pytest.raises(util.PathError) as e:
        util.check_path_names(str(tmp_path / ("a" * 256)), "choose a shorter --out")
    msg = str(e.value)
    assert msg.startswith(f"a folder name in {tmp_path}")
    assert "is 256 bytes; the limit is 255" in msg
    assert msg.endswith("(NAME_MAX): choose a shorter --out")
    assert e.value.errno == errno.ENAMETOOLONG
    with pytest.raises(util.PathError, match="is 300 bytes"):  # 150 characters, 300 bytes
        util.check_path_names(str(tmp_path / ("é" * 150) / "run"), "choose a shorter dataset name")


# ------------------------------------------------------------------------- the toy checkpoint


def _fake_toy_checkpoint(cache, seed=0):
    """A tiny CLIP saved where the toy CLIP is cached, as pretraining saves it (SHA256 too)."""
    path = os.path.join(cache, T.checkpoint_name())
    T.save_checkpoint(tiny_clip(seed=seed), path)
    return path


def test_the_loaded_toy_checkpoint_is_checked_and_its_own_hash_is_reported(tmp_path, monkeypatch):
    cache = str(tmp_path)
    path = _fake_toy_checkpoint(cache)
    monkeypatch.setattr(T, "pretrain", lambda *a, **k: pytest.fail("pretrained again"))
    model, _ = T.load_clip("toy", download_root=cache)
    content = hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert model.sha256 == T.loaded_sha256("toy", cache) == content
    assert model.checkpoint_path == path
    assert content != hashlib.sha256(T.checkpoint_name().encode()).hexdigest()  # not the recipe's
    record = f"{content}  {os.path.basename(path)}\n"  # as sha256sum writes it (and -c reads it)
    assert open(T.sha256_file(path)).read() == record
    # another checkpoint put in its place is refused, with the fix
    torch.save(T.toy_state_dict(tiny_clip(seed=1)), path)
    for load in (
        lambda: T.load_clip("toy", download_root=cache),
        lambda: T.loaded_sha256("toy", cache),
    ):
        with pytest.raises(T.ToyWorldError) as e:
            load()
        assert f"checkpoint {path} is not the file its pretraining wrote" in str(e.value)
        assert "delete it and it is pretrained again" in str(e.value)
    os.remove(T.sha256_file(path))  # a checkpoint without its record cannot be checked
    with pytest.raises(T.ToyWorldError, match="no readable SHA256 record beside it.*delete it"):
        T.load_clip("toy", download_root=cache)
    os.remove(path)  # deleting it, as the message says, pretrains it again

    def pretrain(steps, seed, out_path, log):
        T.save_checkpoint(tiny_clip(seed=2), out_path)

    monkeypatch.setattr(T, "pretrain", pretrain)
    assert T.load_clip("toy", download_root=cache)[0].sha256 == T.verify_checkpoint(path)


def test_loaded_sha256_of_a_file_and_of_openais_names(tmp_path):
    other = tmp_path / "mine.pt"
    torch.save(T.toy_state_dict(tiny_clip(seed=3)), other)
    model, _ = T.load_clip(str(other))
    content = hashlib.sha256(other.read_bytes()).hexdigest()
    assert T.loaded_sha256(str(other)) == model.sha256 == content
    published = clip.MODELS["ViT-B/16"].split("/")[-2]  # clip.load checks the cached file by it
    assert T.loaded_sha256("ViT-B/16") == published


_PRETRAIN = """
import os, sys, time
import toyworld as T
cache, marks = sys.argv[1:3]
real = T.pretrain
def pretrain(*a, **k):  # hold the checkpoint back until the other process has asked for it too
    open(os.path.join(marks, "A-in"), "w").write("1")
    while not os.path.exists(os.path.join(marks, "B-asking")):
        time.sleep(0.05)
    time.sleep(1.0)
    return real(*a, **k)
T.pretrain = pretrain
path = T.ensure_pretrained(cache, steps=1, log=lambda m: print(m, flush=True))
print("checkpoint", T.verify_checkpoint(path))
"""


def test_two_processes_pretrain_the_toy_clip_once(tmp_path, monkeypatch):
    cache, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    a = _run(_PRETRAIN, cache, marks)  # pretrains (1 step), slowly
    _wait_for(str(marks / "A-in"), timeout=300)
    monkeypatch.setattr(T, "pretrain", lambda *a, **k: pytest.fail("pretrained a second time"))
    (marks / "B-asking").write_text("1")
    lines = []
    path = T.ensure_pretrained(str(cache), steps=1, log=lines.append)  # waits, then takes A's file
    out = a.communicate(timeout=300)[0]
    assert a.returncode == 0, out
    assert f"checkpoint {T.verify_checkpoint(path)}" in out
    assert len(lines) == 1 and path in lines[0]
    assert lines[0].startswith(f"Waiting for pid {a.pid} on ")  # the live holder, by the kernel


# ------------------------------------------------------------------------- the per-process lock


_HOLD = """
import os, sys, time
import util
lock_path, ready, fake = sys.argv[1], sys.argv[2], int(sys.argv[3])
lock = util.FileLock(lock_path, "the run folder").acquire()
if fake:  # the file names a process that is gone
    lock.file.seek(0)
    lock.file.truncate()
    lock.file.write(f"pid {fake} on elsewhere, started then")
    lock.file.flush()
child = os.fork()
if child == 0:  # a DataLoader worker: it inherits the open lock file
    time.sleep(300)
    os._exit(0)
util.write_atomic(ready, str(child))
time.sleep(300)
"""


def test_the_lock_ends_with_its_process_though_a_forked_worker_lives_on(tmp_path):
    lock_path = str(tmp_path / ".lock")
    holder = _run(_HOLD, lock_path, tmp_path / "ready", 0)
    child = int(_wait_for(str(tmp_path / "ready")))
    try:
        with pytest.raises(util.LockHeld) as e:
            util.FileLock(lock_path, "the run folder").acquire()
        assert f"the run folder is in use by pid {holder.pid} on " in str(e.value)
        assert e.value.holder.startswith(f"pid {holder.pid} on ") and "started" in e.value.holder
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # the orphaned worker still holds the descriptor ...
        with util.FileLock(lock_path, "the run folder") as lock:  # ... and the lock is free at once
            assert open(lock_path).read().startswith(f"pid {os.getpid()} on ")
        assert lock.file is None
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_held_lock_names_its_live_holder_and_a_dead_recorded_pid(tmp_path):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(gone.stdout)  # a process that has ended
    lock_path = str(tmp_path / ".lock")
    holder = _run(_HOLD, lock_path, tmp_path / "ready", dead)
    child = int(_wait_for(str(tmp_path / "ready")))
    try:
        with pytest.raises(util.LockHeld) as e:
            util.FileLock(lock_path, "the run folder").acquire()
        assert e.value.holder == (
            f"pid {holder.pid}; {lock_path} names pid {dead}, which is no longer running"
        )
    finally:
        holder.kill()
        holder.wait()
        os.kill(child, signal.SIGKILL)


_TRY = """
import sys, util
try:
    util.FileLock(sys.argv[1], "x").acquire()
    print("free")
except util.LockHeld as e:
    print("held by", e.holder)
"""


def test_a_second_lock_in_the_same_process_is_refused_and_keeps_the_first(tmp_path):
    lock_path = str(tmp_path / ".lock")
    with util.FileLock(lock_path, "the run folder"):
        for blocking in (False, True):  # POSIX locks never exclude their own process: this must
            with pytest.raises(util.LockHeld, match=rf"by pid {os.getpid()} \(this process\)"):
                util.FileLock(lock_path, "the run folder", blocking=blocking).acquire()
        out = _run(_TRY, lock_path).communicate(timeout=120)[0]
        assert out.startswith(f"held by pid {os.getpid()} on "), out  # the refusal kept the lock
    assert _run(_TRY, lock_path).communicate(timeout=120)[0] == "free\n"


def test_check_backbone_stops_before_any_work_where_loading_would_fail(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for name in ("toy", "ViT-B/16"):  # to be made in a cache under a file
        with pytest.raises(T.ToyWorldError, match=f"{blocker / 'x'} cannot be used.*CLIP_CACHE"):
            T.check_backbone(name, str(blocker / "x"))
    with pytest.raises(T.ToyWorldError, match="neither one of"):
        T.check_backbone(str(tmp_path / "missing.pt"))
    cache = tmp_path / "cache"
    path = _fake_toy_checkpoint(str(cache))
    assert T.check_backbone("toy", str(cache)) == path
    with open(path, "ab") as f:
        f.write(b"\0")  # damaged
    with pytest.raises(T.ToyWorldError, match="is not the file its pretraining wrote"):
        T.check_backbone("toy", str(cache))
    (cache / "ViT-B-16.pt").write_bytes(b"")  # OpenAI's file, cached (clip.load checks its hash)
    monkeypatch.setattr(util, "check_writable_dir", lambda *a: pytest.fail("checked for writing"))
    assert T.check_backbone("ViT-B/16", str(cache)) == str(cache / "ViT-B-16.pt")  # no write check

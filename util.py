"""Small helpers shared by every script above clip/: atomic writes, JSON reads, the duration format
and the progress line of long loops.

Used by data.py, download.py, toyworld.py, entropy.py, dear.py, train.py, tables.py and bench.py.
This is the bottom of the project (it imports nothing from it); the vendored clip/ package sits
beside it and does not use it, so that clip/ stays a stand-alone copy of OpenAI's package. Byte
downloads with a checksum live in clip/ (`clip.stream`, the one download loop), which download.py
reuses for the dataset archives.
"""

import errno
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path, payload):
    """Write bytes or text to a temporary file beside `path`, then rename: a reader never sees half
    a file. The file gets the user's normal permissions (0666 less the umask), like a file opened
    with open(). A full disk (or quota) raises DiskFull, naming `path` and the bytes it needed."""
    data = payload.encode("utf-8") if isinstance(payload, str) else payload
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + os.path.basename(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes files owner-only (0600)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno in DiskFull.ERRNOS:
            raise DiskFull(path, len(data), e) from None
        raise


def write_json_atomic(path, obj, indent=None):
    write_atomic(path, json.dumps(obj, indent=indent))


def read_json(path):
    """A parsed JSON file, or None when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def fingerprint(obj):
    """SHA256 of an object's canonical JSON: ties a cache to the exact lists it was made from."""
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()


def fmt_time(seconds):
    """Seconds as 1m05s, or 1h02m past an hour: the one duration format of the progress lines."""
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def progress(what, done, total, start):
    """One progress line on stderr, rewritten in place, with speed and ETA."""
    elapsed = max(time.time() - start, 1e-6)
    eta = (total - done) * elapsed / max(done, 1)
    sys.stderr.write(
        f"\r{what} {done}/{total} ({done / elapsed:.1f}/s, ETA {fmt_time(eta)})   "
        + ("\n" if done >= total else "")
    )
    sys.stderr.flush()


# ----------------------------------------------------------------------------------------------
# Paths a user chose, full disks, and the per-process file lock


class DiskFull(OSError):
    """A write failed for want of space (ENOSPC) or quota (EDQUOT). str() is one line naming the
    file, the bytes it needed and the space left, so each caller's one-line error says where."""

    ERRNOS = (errno.ENOSPC, errno.EDQUOT)

    def __init__(self, path, needed, cause=None):
        code = getattr(cause, "errno", None) or errno.ENOSPC
        super().__init__(code, os.strerror(code))
        self.path, self.needed = os.path.abspath(path), needed

    def __str__(self):
        try:
            free = f", {fmt_bytes(shutil.disk_usage(os.path.dirname(self.path)).free)} free there"
        except OSError:
            free = ""
        why = "the disk quota is exceeded" if self.errno == errno.EDQUOT else "the disk is full"
        return (
            f"cannot write {self.path}: {why} (it needs {fmt_bytes(self.needed)}{free}); "
            "free some space on that disk, or write elsewhere, and rerun"
        )


class PathError(OSError):
    """A folder the user chose (a cache, --out) cannot be used. str() is one line: the path,
    why, and the fix."""

    def __str__(self):
        return self.strerror or super().__str__()  # without OSError's "[Errno N]" prefix


def fmt_bytes(n):
    """Bytes for people: 512 bytes, 26.3 MB (decimal units, as df -H)."""
    if n < 10**4:
        return f"{n} bytes"
    return f"{n / 10**6:.1f} MB" if n < 10**9 else f"{n / 10**9:.2f} GB"


def name_max(path):
    """The file system's limit on one file or folder name, in bytes (NAME_MAX), read at the deepest
    folder of `path` that exists; 255 (Linux, macOS) where it cannot be read."""
    folder = path
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_path_names(path, fix="choose a shorter --out"):
    """Raise PathError unless every file or folder name in `path` fits the file system's limit
    (NAME_MAX, in bytes of the file system encoding, not in characters). `fix`: what to do."""
    path = os.path.abspath(os.path.expanduser(path))
    limit = name_max(path)
    for name in path.split(os.sep):
        size = len(os.fsencode(name))
        if size > limit:
            raise PathError(
                errno.ENAMETOOLONG,
                f"a folder name in {path} is {size} bytes; the limit is {limit} (NAME_MAX): {fix}",
            )


def _first_existing(path):
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def check_writable_dir(path, what, fix):
    """Raise PathError (one line naming the path, why, and `fix`) unless folder `path` exists or
    can be made and a file can be written in it: a check before long work whose result goes there.
    what: the folder's role ("the CLIP cache"); fix: e.g. "set CLIP_CACHE to a writable folder"."""
    path = os.path.abspath(os.path.expanduser(path))
    check_path_names(path, fix)
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        found = _first_existing(path)
        why = e.strerror or str(e)
        if not os.path.isdir(found):
            why = f"{found} is a file, not a folder"
        raise PathError(e.errno, f"{what} {path} cannot be used ({why}); {fix}") from None


class LockHeld(RuntimeError):
    """FileLock found its lock taken. .holder: the live holder ("pid N on HOST, started T")."""

    def __init__(self, what, holder):
        super().__init__(f"{what} is in use by {holder}; wait for it to finish")
        self.what, self.holder = what, holder


# (st_dev, st_ino) of each lock file held here -> who (POSIX locks never exclude their owner)
_HELD = {}


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _lock_owner(fd):
    """The pid that holds a POSIX lock on open file `fd` (fcntl F_GETLK), or None where unknown.
    The struct flock layout (short, short, off_t, off_t, pid_t) is read as 64-bit Linux's."""
    import fcntl
    import struct

    if not sys.platform.startswith("linux") or struct.calcsize("P") != 8:
        return None
    # the whole file, as lockf locks it; 28 bytes of fields, padded to the struct's 32
    query = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0) + bytes(4)
    try:
        kind, _, _, _, pid = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, query)[:28])
    except OSError:
        return None
    return None if kind == fcntl.F_UNLCK else pid


class FileLock:
    """An exclusive lock on file `path` (created if missing), owned by the process that took it.

    A POSIX record lock (fcntl.lockf), not flock: forked children (DataLoader workers) do not
    inherit it, so it ends with its process even while orphaned workers keep the descriptor, and
    the kernel names the live holder (F_GETLK). The file records "pid N on HOST, started T".
    what: what the lock guards, for messages. blocking=False: a taken lock raises LockHeld naming
    its holder; blocking=True: wait for it, after calling on_wait(holder) once. A second FileLock
    on the same file in the same process raises LockHeld in both modes (a POSIX lock cannot
    exclude its own process). A context manager, or acquire() / release().
    Caution: a POSIX lock is released when its process closes ANY descriptor of the file, so
    nothing else in the process may open the lock file while it is held."""

    def __init__(self, path, what, blocking=False, on_wait=None):
        self.path, self.what = os.path.abspath(path), what
        self.blocking, self.on_wait = blocking, on_wait
        self.file, self.key = None, None

    def _held_here(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return _HELD.get((st.st_dev, st.st_ino))

    def _holder(self, f):
        """Who holds the lock, from the kernel's answer and the text the holder wrote."""
        f.seek(0)
        recorded = f.read().strip()
        owner = _lock_owner(f.fileno())
        parts = recorded.split()
        said = int(parts[1]) if parts[:1] == ["pid"] and parts[1:2] and parts[1].isdigit() else None
        if owner is None or owner == said:
            return recorded or "another process"
        gone = ""
        if said and not _alive(said):
            gone = f"; {self.path} names pid {said}, which is no longer running"
        return f"pid {owner}{gone}"

    def acquire(self):
        import fcntl  # POSIX

        here = self._held_here()
        if here is not None:  # opening and closing the file again would drop our own lock
            raise LockHeld(self.what, here)
        f = open(self.path, "a+")
        try:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                holder = self._holder(f)
                if not self.blocking:
                    raise LockHeld(self.what, holder) from None
                if self.on_wait:
                    self.on_wait(holder)
                fcntl.lockf(f, fcntl.LOCK_EX)
        except BaseException:
            f.close()  # releases nothing of ours: the lock was not taken
            raise
        f.seek(0)
        f.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        f.flush()
        st = os.fstat(f.fileno())
        self.file, self.key = f, (st.st_dev, st.st_ino)
        _HELD[self.key] = f"pid {os.getpid()} (this process)"
        return self

    def release(self):
        if self.file is not None:
            _HELD.pop(self.key, None)
            self.file.close()  # closing the descriptor releases the POSIX lock
            self.file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False

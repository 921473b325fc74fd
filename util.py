"""Small helpers shared by every script above clip/: atomic writes, JSON reads, the duration format and
the progress line of long loops.

Used by data.py, download.py, toyworld.py, entropy.py, dear.py, train.py, tables.py and bench.py. This is
the bottom of the project (it imports nothing from it); the vendored clip/ package sits beside it and
does not use it, so that clip/ stays a stand-alone copy of OpenAI's package. Byte downloads with a
checksum live in clip/ (`clip.stream`, the one download loop), which download.py reuses for the dataset
archives.
"""
import hashlib
import json
import os
import sys
import tempfile
import time


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path, payload):
    """Write bytes or text to a temporary file beside `path`, then rename: a reader never sees half a file.
    The file gets the user's normal permissions (0666 less the umask), like a file opened with open()."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload.encode("utf-8") if isinstance(payload, str) else payload)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes files owner-only (0600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
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
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def progress(what, done, total, start):
    """One progress line on stderr, rewritten in place, with speed and ETA."""
    elapsed = max(time.time() - start, 1e-6)
    eta = (total - done) * elapsed / max(done, 1)
    sys.stderr.write(f"\r{what} {done}/{total} ({done / elapsed:.1f}/s, ETA {fmt_time(eta)})   "
                     + ("\n" if done >= total else ""))
    sys.stderr.flush()

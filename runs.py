"""Run folders and run inputs: what makes a run the run it says it is.

A run folder is a run's identity. Everything that changes a result must either change the folder's name or
stop the run before it reuses, resumes or mixes someone else's work:

  - `inputs`: the inputs that flags do not spell out — the resolved dataset folder, the backbone checkpoint's
    SHA256, the content hash of a --roles file. Their short hashes go into the folder name (see dear.run_dir),
    and all of them are recorded in config.json.
  - `check_same`: a finished or interrupted run is reused only if its config.json matches the current one
    field by field; otherwise the run stops and names the differences.
  - `RunLock`: one process writes a run folder at a time; a second one stops and names the first.
  - `pin_roles`: the head roles a run used are copied into its folder (roles.json) with their SHA256 and probe,
    so --eval-only and --resume use the run's own roles, whatever the roles cache holds later.

It also holds what a run reads besides its flags: the backbone (`load_clip`, "toy" included), the head roles
(`load_roles`: --roles, or the cache, where entropy.py computes them on first use) and the datasets of its
protocol (`build_eval_sets`, every one checked before anything is written).

Used by dear.py only; imports clip, data, entropy, toyworld, train (for RunError) and util.
"""
import errno
import hashlib
import json
import os
import socket
import time

import clip
import data
import entropy
import toyworld
from train import RunError
from util import read_json, write_atomic

# Fields of the config that do not change a result: where it is written, how fast, and what to do with an
# existing folder. Every other field of config.json must match for a run folder to be reused.
BOOKKEEPING = ("out", "workers", "eval_batch_size", "device", "eval_only", "load", "resume", "force", "roles_only")
# Fields compared through `inputs` instead (by content: two paths to the same data are the same run), and what a
# run found out itself (the resolved J, the roles it pinned).
BY_CONTENT = ("root", "backbone", "roles", "resolved", "roles_used")

_sha_cache = {}


def file_sha256(path: str) -> str:
    """SHA256 of a file's content, remembered per (path, size, mtime) so that run_all.sh's one process that
    names hundreds of runs reads each checkpoint once."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _sha_cache:
        _sha_cache[key] = clip.sha256_of(path)
    return _sha_cache[key]


def short(digest: str) -> str:
    return digest[:8]


def dataset_folder(name: str, root: str) -> str:
    """The folder a dataset is read from (data.dataset_folder), resolved (symlinks too): its identity."""
    return os.path.realpath(data.dataset_folder(name, root))


def backbone_sha256(backbone: str) -> str:
    """The checkpoint's SHA256: from the download URL for OpenAI's names (clip.load checks it), from the
    recipe's file name for the toy CLIP (the recipe fixes its weights), from the content for a file."""
    if backbone in clip.MODELS:
        return clip.MODELS[backbone].split("/")[-2]
    if backbone == toyworld.BACKBONE:
        return hashlib.sha256(toyworld.checkpoint_name().encode()).hexdigest()
    path = os.path.expanduser(backbone)
    if not os.path.isfile(path):
        raise RunError(f"--backbone {backbone!r} is neither one of {clip.available_models() + [toyworld.BACKBONE]} "
                       "nor a checkpoint file")
    return file_sha256(path)


def roles_sha256(path: str) -> str:
    if not os.path.isfile(path):
        raise RunError(f"--roles {path}: no such file; give a roles.json written by entropy.py")
    return file_sha256(path)


def inputs(cfg, targets=()) -> dict:
    """What the run reads that its flags do not spell out. `targets`: the xd target dataset names."""
    found = {"dataset_folder": dataset_folder(cfg.dataset, cfg.root),
             "backbone_sha256": backbone_sha256(cfg.backbone),
             "roles_file_sha256": roles_sha256(cfg.roles) if cfg.roles else None}
    if targets:
        found["target_folders"] = {t: dataset_folder(t, cfg.root) for t in targets}
    return found


def comparable(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in BOOKKEEPING + BY_CONTENT}


def check_same(rdir: str, current: dict, what: str):
    """Stop unless rdir/config.json describes the same run as `current` (BOOKKEEPING fields aside).
    `what`: "finished" or "interrupted", for the message."""
    path = os.path.join(rdir, "config.json")
    saved = read_json(path)
    if saved is None:
        raise RunError(f"{rdir} holds a {what} run but no readable config.json, so it cannot be told apart "
                       "from another run; pass --force to redo it, or choose another --out")
    a, b = comparable(saved), comparable(current)
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        shown = "; ".join(f"{k}: {a.get(k)!r} there, {b.get(k)!r} now" for k in diff[:4])
        raise RunError(f"{rdir} holds a {what} run of a different configuration ({shown}"
                       f"{'; ...' if len(diff) > 4 else ''}); pass --force to replace it, or choose another --out")


class RunLock:
    """An exclusive lock on a run folder (an flock on rdir/.lock, released by the OS even if the process dies).
    A second process on the same folder stops with a message naming the first."""

    def __init__(self, rdir: str):
        self.path = os.path.join(rdir, ".lock")
        self.file = None

    def __enter__(self):
        import fcntl  # POSIX; the lock is what keeps two runs from interleaving one folder
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise RunError(f"{os.path.dirname(self.path)} is being written by {holder}; wait for it to finish "
                           "(a second identical run would only repeat it)") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
        self.file.flush()
        return self

    def __exit__(self, *exc):
        self.file.close()  # closing releases the flock
        return False


def pin_roles(source: str, rdir: str, probe=None) -> dict:
    """Copy the roles file a run uses to rdir/roles.json; returns what config.json records about it."""
    with open(source, "rb") as f:
        payload = f.read()
    write_atomic(os.path.join(rdir, "roles.json"), payload)
    doc = json.loads(payload)
    return {"source": os.path.abspath(source), "file": "roles.json", "sha256": hashlib.sha256(payload).hexdigest(),
            "probe": doc.get("probe", probe)}


# ----------------------------------------------------------------------------------------------
# What a run reads: the backbone, the head roles, the datasets of its protocol


def load_clip(backbone, device):
    """clip.load, with its errors (no network, wrong checksum, not a checkpoint) as one clear RunError."""
    try:
        return toyworld.load_clip(backbone, device=device)  # clip.load, plus "toy" (the toy world's tiny CLIP)
    except (RuntimeError, ValueError, OSError) as e:
        raise RunError(f"cannot load the CLIP backbone {backbone!r}: {e}") from e


def load_roles(cfg, model, device, log):
    """The roles of every head of blocks J..L, and the file they came from: --roles, or the cache, where
    entropy.py computes them once (probe images: ImageNet's test split if present under --root, as TextSpan
    does, else all training images of the run's dataset: never the test images a run is evaluated on)."""
    L = model.visual.transformer.layers
    layers = list(range(cfg.J, L + 1))
    path = cfg.roles
    try:
        if path is None:
            def cached(probe, split):  # the cache folder is named by everything that changes the roles
                pool = "toy" if toyworld.BACKBONE in (model.name, probe[:3]) else None  # the toy CLIP knows toy words
                return entropy.default_roles_path(model, layers, clip.cache_dir(), probe, split=split, pool=pool), pool

            probe, split = "imagenet", "test"
            path, pool = cached(probe, split)
            if not os.path.exists(path):  # no ImageNet roles yet: is ImageNet there to probe (reads its listing)?
                try:
                    data.build_dataset("imagenet", cfg.root)
                except data.DataError:
                    probe, split = cfg.dataset, "train"  # never the test images the model is evaluated on
                    path, pool = cached(probe, split)
            if not os.path.exists(path):  # entropy.run writes there too
                log(f"no head roles cached for {model.name} blocks {cfg.J}..{L}: computing them once with "
                    f"entropy.py on the {split} images of {probe!r} -> {path}")
                path = entropy.run(cfg.backbone, probe, cfg.root, layers=layers, out_dir=os.path.dirname(path),
                                   device=str(device), pool=pool, split=split)
        roles = read_roles(path, model, layers)
    except (ValueError, OSError) as e:  # entropy's errors (bad roles file, too few probe images) are ValueErrors
        raise RunError(f"head roles: {e}") from e
    log(f"head roles: {path}")
    return roles, path


def read_roles(path, model, layers):
    """A roles file, checked against the backbone (model name, depth, heads, blocks)."""
    return entropy.load_roles(path, model_name=model.name, num_layers=model.visual.transformer.layers,
                              num_heads=model.visual.transformer.heads, layers=layers)


def build_dataset(name, root, *args):
    """data.build_dataset; the toy world (data.py only reads it) is generated on first use. A dataset that is
    not there at all gets the command that downloads it and the offline quick start."""
    if name == "toyworld":
        toyworld.ensure_dataset(root)
    try:
        return data.build_dataset(name, root, *args)
    except data.DataError as e:
        if name in data.DATASETS and not os.path.isdir(dataset_folder(name, root)):
            raise RunError(f"{e}\nGet it with:  python data.py download {name} --root {root}\nOr try DeAR offline "
                           "first:  python dear.py --dataset toyworld  (a generated toy world, minutes on a CPU)") from e
        raise


def xd_targets(cfg):
    """xd: the target datasets, --targets or the 4 ImageNet variants and the other 10 datasets."""
    if cfg.protocol != "xd":
        return []
    return [t for t in cfg.targets.split(",") if t] or \
        [t for t in data.DG_TARGETS + data.B2N_DATASETS if t != cfg.dataset]


def build_eval_sets(cfg):
    """(train dataset or None, [(dataset, logits rule)]) for the protocol; reads every split up front so a missing
    dataset stops the run before any long work."""
    if cfg.protocol == "b2n":
        base = build_dataset(cfg.dataset, cfg.root, cfg.shots, cfg.seed, "base")
        novel = build_dataset(cfg.dataset, cfg.root, cfg.shots, cfg.seed, "novel")
        return base, [(base, "base", "fused"), (novel, "novel", cfg.novel_logits)]
    source = build_dataset(cfg.dataset, cfg.root, cfg.shots, cfg.seed, "all")
    evals = [(source, "all", "fused")]
    missing = []
    for name in xd_targets(cfg):
        try:
            evals.append((build_dataset(name, cfg.root), "all", cfg.novel_logits))
        except (data.DataError, RunError) as e:
            missing.append(f"  {name}: {str(e).splitlines()[0]}")
    if missing:
        raise RunError("target datasets missing (pass --targets to choose fewer):\n" + "\n".join(missing))
    return source, evals

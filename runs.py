"""Runs: one run of a method from its Config to results.json, in a folder that is its identity.

`run(cfg, make_model, make_loss)` is the whole of a run: resolve the config, name the run folder,
stop or reuse if it is taken, load the backbone, the head roles and the datasets, build the model,
train it (train.train, with the method's loss), evaluate every split of the protocol and write
results.json. The method itself is handed in from above (dear.py: `make_model` builds the DeAR model
of a config, `make_loss` gives its loss in train.train's form), so this file knows nothing of tokens
or masks.

A run folder is a run's identity. Everything that changes a result must either change the folder's
name or stop the run before it reuses, resumes or mixes someone else's work:

  - `run_dir` / `variant_name`: the folder is named after the method flags that differ from the
    defaults and the short hashes of the inputs that flags do not spell out.
  - `inputs`: those inputs - the resolved dataset folder, the backbone checkpoint's SHA256, the
    content hash of a --roles file; all of them are recorded in config.json.
  - `check_same`: a finished or interrupted run is reused only if its config.json matches the
    current one field by field (the precisions used included: amp is fp16 on CUDA, fp32 on a CPU);
    otherwise the run stops and names the differences.
  - `RunLock`: one process writes a run folder at a time; a second one stops and names the first.
  - `pin_roles`: the head roles a run used are copied into its folder (roles.json) with their SHA256
    and probe, so --eval-only and --resume use the run's own roles, whatever the roles cache holds
    later.

It also holds what a run reads besides its flags: the backbone (`load_clip`, "toy" included), the
head roles (`load_roles`: --roles, or the cache, where entropy.py computes them on first use) and
the datasets of its protocol (`build_eval_sets`, every one checked before anything is written).

Used by dear.py; imports clip, config, data, entropy, toyworld, train and util.
"""

import dataclasses
import hashlib
import json
import os
import time

import torch

import clip
import data
import entropy
import roles_report
import toyworld
from config import Config, default_J, eval_beta, resolve
from train import (
    RunError,
    atomic_save,
    evaluate,
    pick_device,
    resolve_precision,
    seed_everything,
    train,
)
import util
from util import read_json, write_atomic

# Every Config field has one way to keep two different runs apart (the guard test walks Config's
# fields): NAME_FIELDS and VARIANT_FIELDS name the folder, BY_CONTENT fields are compared through
# `inputs` (by content: two paths to the same data are the same run), COMPARED fields are compared
# field by field before a folder is reused, and BOOKKEEPING fields change no result (each with the
# reason).
NAME_FIELDS = ("dataset", "protocol", "method", "shots", "seed")  # <protocol>/<dataset>/<method>-..
BOOKKEEPING = {
    "out": "where the runs are written, not what they compute",
    "workers": "data-loading processes: batches are seeded by (seed, epoch, image), not by worker",
    "eval_batch_size": "evaluation batches: the same images, the same per-image logits",
    "device": "where it runs; the precision actually used is recorded (resolved) and named",
    "eval_only": "what to do: an evaluation gets its own folder under the evaluated run",
    "load": "the evaluated run: its model and roles are read from there",
    "resume": "what to do with an interrupted folder",
    "force": "what to do with a taken folder",
    "roles_only": "what to do: the roles stage writes no run folder",
}
BY_CONTENT = ("root", "backbone", "roles", "resolved", "roles_used")  # + what a run found out
COMPARED = {"targets": "xd: the target datasets evaluated; a different list asks for another --out"}

_sha_cache = {}
FRESH_S = 2.0  # a file changed this recently may change again within one clock tick: not cached


def file_sha256(path: str) -> str:
    """SHA256 of a file's content, remembered per (path, inode, size, mtime, ctime) so that
    run_all.sh's one process that names hundreds of runs reads each checkpoint once. A file
    rewritten in place keeps its inode and maybe its size and mtime, but its ctime moves; a file
    changed within FRESH_S seconds of the hashing is never remembered (two writes within one tick of
    the file system's clock look the same)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _sha_cache:
        return _sha_cache[key]
    digest = clip.sha256_of(path)
    if time.time() - max(st.st_mtime, st.st_ctime) > FRESH_S:
        _sha_cache[key] = digest
    return digest


def short(digest: str) -> str:
    return digest[:8]


def dataset_folder(name: str, root: str) -> str:
    """The folder a dataset is read from (data.dataset_folder), resolved (symlinks too):
    its identity."""
    return os.path.realpath(data.dataset_folder(name, root))


def backbone_sha256(backbone: str) -> str:
    """The checkpoint's SHA256: from the download URL for OpenAI's names (clip.load checks it), from
    the recipe's file name for the toy CLIP (the recipe fixes its weights), from the content for a
    file."""
    if backbone in clip.MODELS:
        return clip.MODELS[backbone].split("/")[-2]
    if backbone == toyworld.BACKBONE:
        return hashlib.sha256(toyworld.checkpoint_name().encode()).hexdigest()
    path = os.path.expanduser(backbone)
    if not os.path.isfile(path):
        raise RunError(
            f"--backbone {backbone!r} is neither one of "
            f"{clip.available_models() + [toyworld.BACKBONE]} nor a checkpoint file"
        )
    return file_sha256(path)


def roles_sha256(path: str) -> str:
    if not os.path.isfile(path):
        raise RunError(f"--roles {path}: no such file; give a roles.json written by entropy.py")
    return file_sha256(path)


# ----------------------------------------------------------------------------------------------
# Naming: one folder per distinct run

# The Config fields that name a variant when they differ from the defaults of the dataset and
# protocol.
VARIANT_FIELDS = (
    "backbone",
    "J",
    "beta",
    "lambda_reg",
    "lambda_fusion",
    "alpha_cls",
    "rep_dim",
    "mask",
    "attr_tokens",
    "novel_logits",
    "target_beta",
    "epochs",
    "batch_size",
    "lr",
    "crop_scale",
    "precision",
    "eval_precision",
    "roles_control",
    "warmup_epochs",
    "warmup_lr",
    "weight_decay",
)
# A zero-shot run (frozen CLIP, no tokens, no training) depends on these of them only; the others
# are neither in its name nor compared, so `--method zeroshot --epochs 1` is the one zero-shot run.
ZEROSHOT_FIELDS = ("backbone", "precision", "eval_precision")
ZEROSHOT_IGNORES = tuple(f for f in VARIANT_FIELDS if f not in ZEROSHOT_FIELDS) + ("roles",)


def variant_name(c: Config) -> str:
    """A short name for the non-default method flags, so each ablation gets its own run folder.
    Files are named by content: a checkpoint or a roles file gets the first 8 hex digits of its
    SHA256 in the name."""
    c, base = resolve(c), resolve(Config(dataset=c.dataset, protocol=c.protocol))
    fields = ZEROSHOT_FIELDS if c.method == "zeroshot" else VARIANT_FIELDS
    parts = [f"{f}-{getattr(c, f)}" for f in fields if getattr(c, f) != getattr(base, f)]
    known = clip.available_models() + [toyworld.BACKBONE]
    if c.backbone != base.backbone and c.backbone not in known:  # a checkpoint file
        name = os.path.splitext(os.path.basename(c.backbone))[0]
        parts[0] = f"backbone-{name}-{short(backbone_sha256(c.backbone))}"
    parts = [p.replace("/", "-") for p in parts]
    if c.roles and c.method != "zeroshot":
        parts.append("roles-" + short(roles_sha256(c.roles)))
    return "_".join(parts) or "default"


MAX_VARIANT = 160  # bytes of a variant in a folder name (a file system allows 255 for a name)


def run_dir(c: Config) -> str:
    """<out>/<protocol>/<dataset>/<method>-<variant>-shots<K>-seed<S>: one folder per distinct run.
    A variant longer than MAX_VARIANT bytes is cut and ends in "~" and 8 hex digits of its SHA256
    (results.json records it whole)."""
    variant = variant_name(c)
    if len(variant.encode()) > MAX_VARIANT:
        cut = variant.encode()[: MAX_VARIANT - 9].decode(errors="ignore")
        variant = f"{cut}~{short(hashlib.sha256(variant.encode()).hexdigest())}"
    name = f"{c.method}-{variant}-shots{c.shots}-seed{c.seed}"
    return os.path.join(c.out, c.protocol, dataset_tag(c.dataset), name)


def dataset_tag(name: str) -> str:
    """A folder name for a dataset; "folder:PATH" datasets are named after their folder and a short
    hash of its resolved path, so two folders with the same last name never share runs."""
    if name.startswith("folder:"):
        path = dataset_folder(name, None)
        return f"folder-{os.path.basename(path)}-{short(hashlib.sha256(path.encode()).hexdigest())}"
    return name


def inputs(cfg, targets=()) -> dict:
    """What the run reads that its flags do not spell out. `targets`:
    the xd target dataset names."""
    found = {
        "dataset_folder": dataset_folder(cfg.dataset, cfg.root),
        "backbone_sha256": backbone_sha256(cfg.backbone),
        "roles_file_sha256": roles_sha256(cfg.roles) if cfg.roles else None,
    }
    if targets:
        found["target_folders"] = {t: dataset_folder(t, cfg.root) for t in targets}
    return found


def comparable(config: dict) -> dict:
    """The part of a config.json that must match for a folder to be reused."""
    drop = tuple(BOOKKEEPING) + BY_CONTENT
    if config.get("method") == "zeroshot":
        drop += ZEROSHOT_IGNORES
    kept = {k: v for k, v in config.items() if k not in drop}
    if isinstance(kept.get("targets"), str):  # "a,b" (a Config made in code) is the list [a, b]
        kept["targets"] = [t for t in kept["targets"].split(",") if t]
    return kept


ABSENT = "(absent)"


def differences(saved: dict, current: dict) -> list:
    """[(field, there, now)] where two comparable configs differ; a field only one side has differs
    too (a missing field is not the same as None)."""
    a, b = comparable(saved), comparable(current)
    return [
        (k, a.get(k, ABSENT), b.get(k, ABSENT))
        for k in sorted(set(a) | set(b))
        if k not in a or k not in b or a[k] != b[k]
    ]


def check_same(rdir: str, current: dict, what: str, saved=None):
    """Stop unless rdir/config.json (or `saved`, a config recorded elsewhere) describes the same run
    as `current` (BOOKKEEPING fields aside). `what`: "finished" or "interrupted", for the message.
    """
    path = os.path.join(rdir, "config.json")
    saved = read_json(path) if saved is None else saved
    a = "an" if what[0] in "aeiou" else "a"
    if not isinstance(saved, dict):
        raise RunError(
            f"{rdir} holds {a} {what} run but no readable config.json, so it cannot be told apart "
            "from another run; choose another --out, or pass --force to redo it"
        )
    diff = differences(saved, current)
    if diff:
        shown = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, a, b in diff[:4])
        raise RunError(
            f"{rdir} holds {a} {what} run of a different configuration ({shown}"
            f"{'; ...' if len(diff) > 4 else ''}); choose another --out to keep both, "
            "or pass --force to replace it (its results are deleted)"
        )


class RunLock:
    """An exclusive lock on a run folder: util.FileLock on rdir/.lock, a POSIX lock of this process
    (released by the OS when it dies; forked DataLoader workers do not keep it). A second process on
    the same folder stops with a message naming the first."""

    def __init__(self, rdir: str):
        self.path = os.path.join(rdir, ".lock")
        self.lock = util.FileLock(self.path, rdir)

    def __enter__(self):
        try:
            self.lock.acquire()
        except util.LockHeld as e:
            raise RunError(
                f"{os.path.dirname(self.path)} is being written by {e.holder}; wait for it to "
                "finish (a second identical run would only repeat it)"
            ) from None
        return self

    def __exit__(self, *exc):
        self.lock.release()
        return False


def pin_roles(source: str, rdir: str, probe=None) -> dict:
    """Copy the roles file a run uses to rdir/roles.json, with its readable forms beside it
    (roles.md and roles.png, drawn from the copy); returns what config.json records about it."""
    with open(source, "rb") as f:
        payload = f.read()
    doc = json.loads(payload)
    write_atomic(os.path.join(rdir, "roles.md"), roles_report.render_markdown(doc))
    roles_report.render_png(doc, os.path.join(rdir, "roles.png"))
    write_atomic(os.path.join(rdir, "roles.json"), payload)
    return {
        "source": os.path.abspath(source),
        "file": "roles.json",
        "sha256": hashlib.sha256(payload).hexdigest(),
        "probe": doc.get("probe", probe),
    }


# ----------------------------------------------------------------------------------------------
# What a run reads: the backbone, the head roles, the datasets of its protocol


# The errors a user can fix (dear.py prints them as one line and exits with status 2): a bad flag or
# run folder, a dataset, the toy world, a full disk, a path that cannot be used.
USER_ERRORS = (RunError, data.DataError, toyworld.ToyWorldError, util.DiskFull, util.PathError)


def check_backbone(backbone):
    """Before any work: the file the backbone needs exists, or can be made (pretrained, downloaded)
    in a CLIP cache that can be written (toyworld.check_backbone), else one line naming the fix."""
    try:
        toyworld.check_backbone(backbone)
    except toyworld.ToyWorldError as e:
        raise RunError(str(e)) from None
    except OSError as e:  # util.PathError: the cache is under a file, or cannot be written
        raise RunError(str(e)) from None


def toy_threads(backbone, device):
    """One intra-op thread for the toy CLIP on a CPU unless OMP_NUM_THREADS says otherwise: its
    matrices (88 x 128 for a batch of 4) are too small for a second thread to pay, which only wakes
    and waits (BENCH.md, the quick start's training; the same numbers either way). Its pretraining
    sets its own threads (toyworld.pretrain)."""
    toy_on_cpu = backbone == toyworld.BACKBONE and device.type == "cpu"
    if toy_on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def load_clip(backbone, device, log=None):
    """clip.load, with its errors (no network, wrong checksum, not a checkpoint) as one clear
    RunError. log: where the toy CLIP's first pretraining reports (the run's log.txt), else stdout.
    """
    try:
        if backbone == toyworld.BACKBONE and log is not None:  # pretrain (once) into the run's log
            toyworld.ensure_pretrained(clip.cache_dir(), log=log)
        # clip.load, plus "toy" (the toy world's tiny CLIP)
        return toyworld.load_clip(backbone, device=device)
    except (RuntimeError, ValueError, OSError) as e:
        raise RunError(f"cannot load the CLIP backbone {backbone!r}: {e}") from e


def load_roles(cfg, model, device, log):
    """The roles of every head of blocks J..L, and the file they came from: --roles, or the cache,
    where entropy.py computes them once (probe images: ImageNet's test split if present under
    --root, as TextSpan does, else all training images of the run's dataset: never the test images a
    run is evaluated on)."""
    L = model.visual.transformer.layers
    layers = list(range(cfg.J, L + 1))
    path = cfg.roles
    try:
        if path is None:

            def cached(
                probe, split
            ):  # the cache folder is named by everything that changes the roles
                # the toy CLIP knows toy words
                pool = "toy" if toyworld.BACKBONE in (model.name, probe[:3]) else None
                return entropy.default_roles_path(
                    model, layers, clip.cache_dir(), probe, split=split, pool=pool
                ), pool

            probe, split = "imagenet", "test"
            path, pool = cached(probe, split)
            if not os.path.exists(
                path
            ):  # no ImageNet roles yet: is ImageNet there to probe (reads its listing)?
                try:
                    data.build_dataset("imagenet", cfg.root)
                except data.DataError:
                    probe, split = (
                        cfg.dataset,
                        "train",
                    )  # never the test images the model is evaluated on
                    path, pool = cached(probe, split)
            if not os.path.exists(path):  # entropy.run writes there too
                log(
                    f"no head roles cached for {model.name} blocks {cfg.J}..{L}: computing them "
                    f"once with entropy.py on the {split} images of {probe!r} -> {path}"
                )
                path = entropy.run(
                    cfg.backbone,
                    probe,
                    cfg.root,
                    layers=layers,
                    out_dir=os.path.dirname(path),
                    device=str(device),
                    pool=pool,
                    split=split,
                    caller="dear.py",
                )
        roles = read_roles(path, model, layers)
    except (
        ValueError,
        OSError,
    ) as e:  # entropy's errors (bad roles file, too few probe images) are ValueErrors
        raise RunError(f"head roles: {e}") from e
    log(f"head roles: {path}")
    return roles, path


def read_roles(path, model, layers):
    """A roles file, checked against the backbone (model name, depth, heads, blocks, and the SHA256
    of the checkpoint it was computed on, where the file records one)."""
    try:
        visual = model.visual.transformer
        roles = entropy.load_roles(
            path,
            model_name=model.name,
            num_layers=visual.layers,
            num_heads=visual.heads,
            layers=layers,
        )
    except ValueError as e:
        raise RunError(f"head roles: {e}") from None
    made_for = (read_json(path) or {}).get("checkpoint_sha256")
    loaded = getattr(model, "sha256", None)  # clip.load: the SHA256 of the file it read
    if made_for and loaded and made_for != loaded:
        raise RunError(
            f"roles file {path} was computed for the checkpoint with SHA256 {made_for}, "
            f"but the backbone {model.name} loaded has SHA256 {loaded}; delete the file "
            "or give roles made for this checkpoint"
        )
    return roles


def build_dataset(name, root, *args):
    """data.build_dataset; the toy world (data.py only reads it) is generated on first use. A
    dataset that is not there at all gets the command that downloads it and the offline quick
    start."""
    if name == "toyworld":
        toyworld.ensure_dataset(root)
    try:
        return data.build_dataset(name, root, *args)
    except data.DataError as e:
        if name in data.DATASETS and not os.path.isdir(dataset_folder(name, root)):
            raise RunError(
                f"{e}\nGet it with:  python data.py download {name} --root {root}\nOr try DeAR "
                "offline first:  python dear.py --dataset toyworld  (a generated toy world, "
                "minutes on a CPU)"
            ) from e
        raise


def xd_targets(cfg):
    """xd: the target datasets, --targets or the 4 ImageNet variants and the other 10 datasets.
    cfg.targets is a list of names (the command line: --targets repeated; a folder:PATH target is
    taken whole, commas and all) or one comma-separated string."""
    if cfg.protocol != "xd":
        return []
    given = cfg.targets.split(",") if isinstance(cfg.targets, str) else list(cfg.targets)
    default = [t for t in data.DG_TARGETS + data.B2N_DATASETS if t != cfg.dataset]
    return [t for t in given if t] or default


def split_targets(values) -> list:
    """--targets as given (the flag may be repeated): a value that starts with folder: is one
    target, taken whole; any other value is a comma-separated list of names."""
    found = []
    for value in values:
        found += [value] if value.startswith("folder:") else [t for t in value.split(",") if t]
    return found


def build_eval_sets(cfg):
    """(train dataset or None, [(dataset, logits rule)]) for the protocol; reads every split up
    front so a missing dataset stops the run before any long work."""
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
            missing.append((name, str(e).splitlines()[0]))
    if missing:  # one line: which, the first reason, the fix
        names = ", ".join(n for n, _ in missing)
        raise RunError(
            f"{len(missing)} xd target dataset(s) missing under --root {cfg.root}: "
            f"{names} (first: {missing[0][1]}); get them with python data.py download "
            "NAME, or pass --targets to choose fewer"
        )
    return source, evals


# ----------------------------------------------------------------------------------------------
# One run


class Interrupted(Exception):
    """Ctrl-C, with what was kept: the CLI prints the message and exits with status 130."""


def harmonic_mean(base: float, novel: float) -> float:
    return 2 * base * novel / (base + novel) if base + novel > 0 else 0.0


def eval_only_config(cfg: Config) -> Config:
    """--eval-only --load RUN: the method flags of the finished run RUN (its config.json), on
    --dataset / --protocol. The seed comes along: --roles-control random shuffles the roles by it.
    """
    saved = read_json(os.path.join(cfg.load or "", "config.json"))
    has_model = bool(cfg.load) and os.path.exists(os.path.join(cfg.load, "model.pt"))
    if not has_model or not isinstance(saved, dict):
        raise RunError(
            "--eval-only needs --load RUN_DIR, a finished run folder holding model.pt and "
            f"config.json (got {cfg.load!r})"
        )
    return dataclasses.replace(cfg, **{k: saved[k] for k in EVAL_CARRIES if k in saved})


# What --eval-only takes from the evaluated run: everything that builds its model (the rest, such as
# --precision, --novel-logits or --target-beta, is the evaluation's own choice).
EVAL_CARRIES = (
    "backbone",
    "J",
    "beta",
    "rep_dim",
    "mask",
    "attr_tokens",
    "alpha_cls",
    "roles",
    "method",
    "roles_control",
    "seed",
)
SEED_MAX = 2**32 - 1  # numpy's seed range (the few-shot sampler and the workers use numpy)


def check_flags(cfg: Config):
    """The checks of a resolved Config that config.resolve leaves to a run, made before any work."""
    if not 0 <= cfg.seed <= SEED_MAX:
        raise RunError(f"--seed must lie in 0..{SEED_MAX} (numpy's seed range), got {cfg.seed}")
    if cfg.warmup_epochs < 0:
        raise RunError(f"--warmup-epochs must be >= 0, got {cfg.warmup_epochs}")
    if cfg.eval_batch_size < 1:
        raise RunError(f"--eval-batch-size must be >= 1, got {cfg.eval_batch_size}")
    if cfg.protocol != "xd" and xd_targets(dataclasses.replace(cfg, protocol="xd")) != xd_targets(
        dataclasses.replace(cfg, protocol="xd", targets="")
    ):
        raise RunError(
            f"--targets applies to --protocol xd only (--protocol {cfg.protocol} "
            f"evaluates {cfg.dataset} itself); drop --targets, or add --protocol xd"
        )
    try:
        device = pick_device(cfg.device)
    except RuntimeError as e:
        raise RunError(
            f"--device {cfg.device!r} is not a device torch knows ({type(e).__name__}); "
            "use auto, cpu, cuda or cuda:N"
        ) from None
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and device.index is not None and device.index >= count:
        raise RunError(
            f"--device {cfg.device}: this machine has {torch.cuda.device_count()} CUDA "
            "device(s); use cuda:0 .. or auto"
        )


def check_name_length(rdir: str):
    """Stop before any work if a folder name of rdir is longer than the file system allows."""
    limit = util.name_max(os.path.abspath(rdir))  # NAME_MAX where the folder will be
    for part in rdir.split(os.sep):
        if len(part.encode()) > limit:
            raise RunError(
                f"the run folder name {part[:48]}... is {len(part.encode())} bytes, "
                f"over the {limit} the file system allows for one name; shorten it (a "
                "shorter --out or dataset folder name)"
            )


NO_SPACE = util.DiskFull.ERRNOS  # a full disk or quota


def disk_error(e: OSError, path: str, size: int, then: str) -> RunError:
    """A write that failed, as one line naming the file, what is wrong, the space needed and the
    fix."""
    why = "no space left on the device" if e.errno in NO_SPACE else (e.strerror or str(e))
    need = max(1, size // 2**20)
    return RunError(
        f"cannot write {path}: {why} (about {need} MB needed); free some space or "
        f"choose another --out, then {then}"
    )


def save(obj, path: str, as_json=False, then="rerun the same command"):
    """train.atomic_save, a failed write as one line (disk_error)."""
    try:
        atomic_save(obj, path, as_json=as_json)
    except OSError as e:
        size = len(json.dumps(obj)) if as_json else state_bytes(obj)
        raise disk_error(e, path, size, then) from None


def state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


RUN_FILES = (
    "results.json",
    "model.pt",
    "checkpoint.pt",
    "roles.json",
    "roles.md",
    "roles.png",
    "config.json",
)  # results.json first: once it is gone the folder holds no finished run


def retire(rdir: str):
    """--force: delete what the folder's run wrote, results first,
    before anything new is written."""
    for name in RUN_FILES:
        if os.path.exists(os.path.join(rdir, name)):
            os.remove(os.path.join(rdir, name))


def finished(rdir: str, results_path: str, ckpt: str, config: dict) -> dict:
    """The results of a finished run, if rdir holds one of `config`; else a RunError saying what to
    do. results.json is written last and records the config it was made with ("identity"); both it
    and config.json must match."""
    if os.path.exists(ckpt):
        raise RunError(
            f"{rdir} holds results.json beside an interrupted run's checkpoint.pt (an "
            "interrupted restart?), so its results may be another run's; pass --force "
            "to start it over"
        )
    results = read_json(results_path)
    if not isinstance(results, dict):
        raise RunError(f"{results_path} is not readable; delete it, or pass --force to redo it")
    check_same(rdir, config, "finished")
    if "identity" in results:  # results.json written by this version: its own record must match too
        check_same(rdir, config, "finished", saved=results["identity"])
    print(f"done already: {results_path} (pass --force to redo)")
    return results


def load_trained(model, load: str, device):
    """--eval-only: the trained weights of the run `load` into model; every key must match."""
    path = os.path.join(load, "model.pt")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated file or not a checkpoint
        raise RunError(
            f"{path} cannot be read ({type(e).__name__}); it is not a model.pt "
            "written by a finished run"
        ) from None
    want = set(model.trainable_state())
    missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
    if missing or unexpected:
        raise RunError(
            f"{path} does not fit the model of {load}: missing keys {missing[:3]}, "
            f"unexpected keys {unexpected[:3]} ({len(missing)} and {len(unexpected)} in "
            "all; a 'module.' prefix?); give the model.pt this run wrote"
        )
    try:
        model.load_state_dict(state, strict=False)  # the trainable part, its keys checked above
    except RuntimeError as e:
        why = str(e).splitlines()[-1].strip()
        raise RunError(f"{path} does not fit the model of {load}: {why}") from None


def export_roles(cfg: Config) -> str:
    """--roles-only: compute (or find) the head roles a run would use and copy roles.json/.md/.png
    to <out>/roles/J<J or "default">/, the folder the tables read. Returns that folder."""
    try:
        cfg = resolve(cfg)
    except ValueError as e:
        raise RunError(str(e)) from None
    check_flags(cfg)
    check_backbone(cfg.backbone)
    device = pick_device(cfg.device)
    model, _ = load_clip(cfg.backbone, device, log=lambda msg: print(msg, flush=True))
    dest = os.path.join(cfg.out, "roles", f"J{cfg.J or 'default'}")
    cfg = dataclasses.replace(cfg, J=cfg.J or default_J(model.visual.transformer.layers))
    _, path = load_roles(cfg, model, device, lambda msg: print(msg, flush=True))
    for name in ("roles.json", "roles.md", "roles.png"):
        source = os.path.join(os.path.dirname(path), name)
        if os.path.exists(source):
            with open(source, "rb") as f:
                write_atomic(os.path.join(dest, name), f.read())
    print(f"roles copied to {dest}")
    return dest


def run(cfg: Config, make_model, make_loss, log_to_stdout=True) -> dict:
    """One run: train (unless zero-shot or --eval-only), evaluate, write results.json. Returns the
    results.

    make_model(clip_model, roles, cfg) -> the model (a DeAR module); make_loss(cfg) ->
    loss_fn(model, out, labels), the loss train.train minimises. The run folder (run_dir) is the
    run's identity: a finished run is reused, and an interrupted one resumed, only when its config
    (flags and `inputs`: dataset folder, checkpoint and roles hashes) matches."""
    if cfg.eval_only:
        cfg = eval_only_config(cfg)
    try:
        cfg = resolve(cfg)
        check_flags(cfg)
        check_backbone(cfg.backbone)
        variant = variant_name(cfg)  # named before J is resolved against the backbone's depth
        config = dict(dataclasses.asdict(cfg), inputs=inputs(cfg, xd_targets(cfg)))
    except ValueError as e:
        raise RunError(str(e)) from e
    if cfg.eval_only:
        rdir = os.path.join(cfg.load, "eval", f"{cfg.protocol}-{dataset_tag(cfg.dataset)}")
    else:
        rdir = run_dir(cfg)
    check_name_length(rdir)
    results_path, ckpt = os.path.join(rdir, "results.json"), os.path.join(rdir, "checkpoint.pt")
    device = pick_device(cfg.device)
    cfg = dataclasses.replace(
        cfg,
        precision=resolve_precision(cfg.precision, device),  # amp: fp16/32
        eval_precision=resolve_precision(cfg.eval_precision, device),
    )
    # the precisions used are part of the identity: amp on a CPU (fp32) is not amp on CUDA (fp16)
    config["precisions"] = {"train": cfg.precision, "eval": cfg.eval_precision}
    if os.path.exists(results_path) and not cfg.force:
        return finished(rdir, results_path, ckpt, config)
    train_ds, evals = build_eval_sets(cfg)  # every dataset checked before anything is written
    try:
        os.makedirs(rdir, exist_ok=True)
        lock = RunLock(rdir).__enter__()
    except OSError as e:
        raise RunError(
            f"cannot write the run folder {rdir} ({e.strerror}); choose a writable --out"
        ) from None
    try:
        return _run_locked(
            cfg,
            config,
            variant,
            rdir,
            results_path,
            ckpt,
            device,
            train_ds,
            evals,
            make_model,
            make_loss,
            log_to_stdout,
        )
    finally:
        lock.__exit__(None, None, None)


def take_folder(cfg, config, rdir, results_path, ckpt):
    """Holding the lock, before anything is written: --force retires the old run (results first); an
    interrupted run continues only with --resume and the same config; a fresh start drops a stale
    pinned roles copy (it takes the roles of now)."""
    if cfg.force:
        retire(rdir)
    elif os.path.exists(results_path):  # finished by another process since run() looked
        raise RunError(f"{rdir} was finished meanwhile by another process; rerun to reuse it")
    if os.path.exists(ckpt) and not cfg.resume:
        raise RunError(
            f"{rdir} holds an interrupted run; pass --resume to continue it or --force to "
            "start over"
        )
    if os.path.exists(ckpt):
        check_same(rdir, config, "interrupted")
    pinned = os.path.join(rdir, "roles.json")
    if not os.path.exists(ckpt) and os.path.exists(pinned):
        os.remove(pinned)  # a fresh start takes the roles of now; a resumed run keeps its own
    if cfg.eval_only and os.path.exists(os.path.join(cfg.load, "roles.json")):
        with open(os.path.join(cfg.load, "roles.json"), "rb") as f:  # the evaluated model's roles
            write_atomic(pinned, f.read())
    return pinned


def _run_locked(
    cfg,
    config,
    variant,
    rdir,
    results_path,
    ckpt,
    device,
    train_ds,
    evals,
    make_model,
    make_loss,
    log_to_stdout,
):
    """The body of `run`, holding the run folder's lock."""
    pinned = take_folder(cfg, config, rdir, results_path, ckpt)
    log_file = open(os.path.join(rdir, "log.txt"), "a")

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        log_file.write(line + "\n")
        log_file.flush()
        if log_to_stdout:
            print(line, flush=True)

    try:
        log(
            f"{cfg.method} | {cfg.protocol} | {cfg.dataset} | {cfg.shots} shots | seed {cfg.seed} "
            f"| {device} -> {rdir}"
        )
        clip_model, _ = load_clip(cfg.backbone, device, log=log)
        toy_threads(cfg.backbone, device)
        L = clip_model.visual.transformer.layers
        J = cfg.J or default_J(L)
        if not 1 <= J <= L:
            raise RunError(
                f"--J {J} is beyond the backbone: {cfg.backbone} has {L} blocks, so J must lie "
                f"in 1..{L}"
            )
        cfg = dataclasses.replace(cfg, J=J)
        use_tokens = cfg.method == "dear" and cfg.attr_tokens
        roles, roles_used = None, None
        if use_tokens and cfg.mask != "none":
            if os.path.exists(
                pinned
            ):  # resumed or evaluated: the run's own roles, whatever the cache
                roles, source = read_roles(pinned, clip_model, list(range(J, L + 1))), pinned
                log(f"head roles: the run's own copy {pinned}")
            else:
                roles, source = load_roles(cfg, clip_model, device, log)
            roles_used = pin_roles(source, rdir)
        if roles is not None and cfg.roles_control != "none":
            roles = control_roles(roles, cfg, log)
        # here, after anything that may draw random numbers (pretraining, roles)
        seed_everything(cfg.seed)
        try:
            model = make_model(clip_model, roles, cfg).to(device)
        except ValueError as e:
            raise RunError(str(e)) from e
        if cfg.eval_only:
            load_trained(model, cfg.load, device)  # before anything of this evaluation is written
        resolved = {
            "J": cfg.J,
            "precision": cfg.precision,
            "backbone_sha256": getattr(clip_model, "sha256", None),
        }  # of the file loaded
        config = dict(config, resolved=resolved, roles_used=roles_used)
        save(config, os.path.join(rdir, "config.json"), as_json=True)
        t0, stats = time.time(), None  # stats: train.train's report (None: no training, or none)
        if cfg.method == "dear" and not cfg.eval_only:
            log(
                f"train: {len(train_ds.train)} images, {len(train_ds.classnames)} classes, "
                f"{cfg.epochs} epochs, batch {cfg.batch_size}, beta {cfg.beta}, lambda_reg "
                f"{cfg.lambda_reg}, J {cfg.J}, mask {cfg.mask}"
            )
            stats = train_checked(model, train_ds, cfg, device, rdir, log, make_loss(cfg), ckpt)
            model_pt = os.path.join(rdir, "model.pt")
            save(model.trainable_state(), model_pt, then="rerun with --resume")
        train_s, t1 = time.time() - t0, time.time()
        results = {
            "method": cfg.method,
            "protocol": cfg.protocol,
            "dataset": cfg.dataset,
            "backbone": cfg.backbone,
            "shots": cfg.shots,
            "seed": cfg.seed,
            "variant": variant,
            "config": dataclasses.asdict(cfg),
            "inputs": config["inputs"],
            "roles_used": roles_used,
            "precisions": config["precisions"],
            "evals": [],
        }
        if stats is not None:  # what train.train reports, e.g. the steps the GradScaler skipped
            results["train"] = stats
        if (
            train_ds is not None and cfg.method == "dear" and not cfg.eval_only
        ):  # the shots each class had
            counts = train_ds.shots_per_class
            results["train_shots"] = {
                "asked": cfg.shots,
                "min": min(counts),
                "max": max(counts),
                "per_class": counts,
            }
        datasets = [ds for ds in [train_ds] + [e[0] for e in evals] if ds is not None]
        # each once
        results["warnings"] = list(dict.fromkeys(w for ds in datasets for w in ds.warnings))
        for ds, split, rule in evals:
            beta = eval_beta(cfg, ds.name)  # xd targets: MMRL++'s test-time beta
            model.set_beta(beta)
            r = evaluate(
                model,
                ds.test,
                ds.classnames,
                ds.template,
                cfg,
                device,
                logits=rule,
                log=log,
                name=f"{ds.name}/{split}",
            )
            results["evals"].append({"dataset": ds.name, "split": split, "beta": beta, **r})
            log(f"{ds.name} {split}: {r['accuracy']:.2f}% of {r['n']} ({rule} logits, beta {beta})")
        if cfg.protocol == "b2n":
            results["hm"] = harmonic_mean(
                results["evals"][0]["accuracy"], results["evals"][1]["accuracy"]
            )
            log(f"HM {results['hm']:.2f}")
        if use_tokens:
            results["fusion_weights"] = model.fusion_weights()
        results["timing"] = {"train_s": train_s, "eval_s": time.time() - t1}
        results["identity"] = config  # the config.json it was made with: "done already" compares it
        save(results, results_path, as_json=True, then="rerun the same command (the model is kept)")
        if os.path.exists(ckpt):
            os.remove(ckpt)
        log(f"wrote {results_path}")
        return results
    except KeyboardInterrupt:
        if os.path.exists(ckpt):
            raise Interrupted(
                f"interrupted: the last checkpoint is kept in {ckpt}; rerun the same command "
                "with --resume"
            ) from None
        raise Interrupted(
            "interrupted before the first checkpoint: nothing was kept to resume; rerun the "
            "same command to start again"
        ) from None
    finally:
        log_file.close()


def train_checked(model, train_ds, cfg, device, rdir, log, loss_fn, ckpt):
    """train.train (returns its report); a checkpoint that cannot be written (a full disk) as one
    line naming it."""
    try:
        return train(model, train_ds, cfg, device, rdir, log, loss_fn)
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        size = 3 * state_bytes(model.trainable_state())  # weights + AdamW's two moments
        then = "rerun with --resume (the last checkpoint written is kept)"
        raise disk_error(e, ckpt, size, then) from None


def control_roles(roles, cfg, log):
    """--roles-control random | oracle: the roles a control run uses instead
    (entropy.control_roles)."""
    try:
        roles = entropy.control_roles(roles, cfg.roles_control, cfg.seed)
    except ValueError as e:
        raise RunError(str(e)) from e
    log(
        f"roles control {cfg.roles_control}: "
        + "; ".join(
            f"block {b}: "
            + " ".join(
                h["role"][0].upper() + (":" + h["attribute"] if h["attribute"] else "")
                for h in heads
            )
            for b, heads in sorted(roles.items())
        )
    )
    return roles

"""Runs: one run of a method from its Config to results.json, in a folder that is its identity.

`run(cfg, make_model, make_loss)` is the whole of a run: resolve the config, name the run folder, stop
or reuse if it is taken, load the backbone, the head roles and the datasets, build the model, train it
(train.train, with the method's loss), evaluate every split of the protocol and write results.json.
The method itself is handed in from above (dear.py: `make_model` builds the DeAR model of a config,
`make_loss` gives its loss in train.train's form), so this file knows nothing of tokens or masks.

A run folder is a run's identity. Everything that changes a result must either change the folder's name
or stop the run before it reuses, resumes or mixes someone else's work:

  - `run_dir` / `variant_name`: the folder is named after the method flags that differ from the defaults
    and the short hashes of the inputs that flags do not spell out.
  - `inputs`: those inputs - the resolved dataset folder, the backbone checkpoint's SHA256, the content
    hash of a --roles file; all of them are recorded in config.json.
  - `check_same`: a finished or interrupted run is reused only if its config.json matches the current
    one field by field (the precisions used included: amp is fp16 on CUDA, fp32 on a CPU);
    otherwise the run stops and names the differences.
  - `RunLock`: one process writes a run folder at a time; a second one stops and names the first.
  - `pin_roles`: the head roles a run used are copied into its folder (roles.json) with their SHA256 and
    probe, so --eval-only and --resume use the run's own roles, whatever the roles cache holds later.

It also holds what a run reads besides its flags: the backbone (`load_clip`, "toy" included), the head
roles (`load_roles`: --roles, or the cache, where entropy.py computes them on first use) and the datasets
of its protocol (`build_eval_sets`, every one checked before anything is written).

Used by dear.py; imports clip, config, data, entropy, toyworld, train and util.
"""
import dataclasses
import errno
import hashlib
import json
import os
import socket
import time

import torch

import clip
import data
import entropy
import toyworld
from config import Config, default_J, eval_beta, resolve
from train import (RunError, atomic_save, evaluate, pick_device, resolve_precision, seed_everything,
                   train)
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



# ----------------------------------------------------------------------------------------------
# Naming: one folder per distinct run

# The Config fields that name a variant when they differ from the defaults of the dataset and protocol.
VARIANT_FIELDS = ("backbone", "J", "beta", "lambda_reg", "lambda_fusion", "alpha_cls", "rep_dim", "mask",
                  "attr_tokens", "novel_logits", "target_beta", "epochs", "batch_size", "lr",
                  "crop_scale", "precision", "eval_precision", "roles_control")


def variant_name(c: Config) -> str:
    """A short name for the non-default method flags, so each ablation gets its own run folder. Files are
    named by content: a checkpoint or a roles file gets the first 8 hex digits of its SHA256 in the name."""
    c, base = resolve(c), resolve(Config(dataset=c.dataset, protocol=c.protocol))
    parts = [f"{f}-{getattr(c, f)}" for f in VARIANT_FIELDS if getattr(c, f) != getattr(base, f)]
    known = clip.available_models() + [toyworld.BACKBONE]
    if c.backbone != base.backbone and c.backbone not in known:  # a checkpoint file
        name = os.path.splitext(os.path.basename(c.backbone))[0]
        parts[0] = f"backbone-{name}-{short(backbone_sha256(c.backbone))}"
    parts = [p.replace("/", "-") for p in parts]
    if c.roles:
        parts.append("roles-" + short(roles_sha256(c.roles)))
    return "_".join(parts) or "default"


def run_dir(c: Config) -> str:
    """<out>/<protocol>/<dataset>/<method>-<variant>-shots<K>-seed<S>: one folder per distinct run."""
    name = f"{c.method}-{variant_name(c)}-shots{c.shots}-seed{c.seed}"
    return os.path.join(c.out, c.protocol, dataset_tag(c.dataset), name)


def dataset_tag(name: str) -> str:
    """A folder name for a dataset; "folder:PATH" datasets are named after their folder and a short hash
    of its resolved path, so two folders with the same last name never share runs."""
    if name.startswith("folder:"):
        path = dataset_folder(name, None)
        return f"folder-{os.path.basename(path)}-{short(hashlib.sha256(path.encode()).hexdigest())}"
    return name


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


# ----------------------------------------------------------------------------------------------
# One run


class Interrupted(Exception):
    """Ctrl-C, with what was kept: the CLI prints the message and exits with status 130."""


def harmonic_mean(base: float, novel: float) -> float:
    return 2 * base * novel / (base + novel) if base + novel > 0 else 0.0


def eval_only_config(cfg: Config) -> Config:
    """--eval-only --load RUN: the method flags of the finished run RUN (its config.json), on
    --dataset / --protocol."""
    saved = read_json(os.path.join(cfg.load or "", "config.json"))
    if not cfg.load or not os.path.exists(os.path.join(cfg.load, "model.pt")) or saved is None:
        raise RunError("--eval-only needs --load RUN_DIR, a finished run folder holding model.pt and "
                       f"config.json (got {cfg.load!r})")
    method_fields = ("backbone", "J", "beta", "rep_dim", "mask", "attr_tokens", "alpha_cls", "roles",
                     "method", "roles_control")
    return dataclasses.replace(cfg, **{k: saved[k] for k in method_fields if k in saved})


def export_roles(cfg: Config) -> str:
    """--roles-only: compute (or find) the head roles a run would use and copy roles.json/.md/.png to
    <out>/roles/J<J or "default">/, the folder the tables read. Returns that folder."""
    cfg = resolve(cfg)
    device = pick_device(cfg.device)
    model, _ = load_clip(cfg.backbone, device)
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
    """One run: train (unless zero-shot or --eval-only), evaluate, write results.json. Returns the results.

    make_model(clip_model, roles, cfg) -> the model (a DeAR module); make_loss(cfg) -> loss_fn(model, out,
    labels), the loss train.train minimises. The run folder (run_dir) is the run's identity: a finished
    run is reused, and an interrupted one resumed, only when its config.json (flags and `inputs`: dataset
    folder, checkpoint and roles hashes) matches."""
    if cfg.eval_only:
        cfg = eval_only_config(cfg)
    try:
        cfg = resolve(cfg)
        variant = variant_name(cfg)  # named before J is resolved against the backbone's depth
        config = dict(dataclasses.asdict(cfg), inputs=inputs(cfg, xd_targets(cfg)))
    except ValueError as e:
        raise RunError(str(e)) from e
    if cfg.eval_only:
        rdir = os.path.join(cfg.load, "eval", f"{cfg.protocol}-{dataset_tag(cfg.dataset)}")
    else:
        rdir = run_dir(cfg)
    results_path, ckpt = os.path.join(rdir, "results.json"), os.path.join(rdir, "checkpoint.pt")
    device = pick_device(cfg.device)
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device),  # amp: fp16/32
                              eval_precision=resolve_precision(cfg.eval_precision, device))
    # the precisions used are part of the identity: amp on a CPU (fp32) is not amp on CUDA (fp16)
    config["precisions"] = {"train": cfg.precision, "eval": cfg.eval_precision}
    if os.path.exists(results_path) and not cfg.force:
        check_same(rdir, config, "finished")
        print(f"done already: {results_path} (pass --force to redo)")
        return read_json(results_path)
    train_ds, evals = build_eval_sets(cfg)  # every dataset checked before anything is written
    try:
        os.makedirs(rdir, exist_ok=True)
        lock = RunLock(rdir).__enter__()
    except OSError as e:
        raise RunError(f"cannot write the run folder {rdir} ({e.strerror}); choose a writable --out") \
            from None
    try:
        return _run_locked(cfg, config, variant, rdir, results_path, ckpt, device, train_ds, evals,
                           make_model, make_loss, log_to_stdout)
    finally:
        lock.__exit__(None, None, None)


def _run_locked(cfg, config, variant, rdir, results_path, ckpt, device, train_ds, evals, make_model,
                make_loss, log_to_stdout):
    """The body of `run`, holding the run folder's lock."""
    pinned = os.path.join(rdir, "roles.json")
    if os.path.exists(ckpt) and cfg.force:
        os.remove(ckpt)
    elif os.path.exists(ckpt) and not cfg.resume:
        raise RunError(f"{rdir} holds an interrupted run; pass --resume to continue it or --force to "
                       "start over")
    elif os.path.exists(ckpt):
        check_same(rdir, config, "interrupted")
    if not os.path.exists(ckpt) and os.path.exists(pinned):
        os.remove(pinned)  # a fresh start takes the roles of now; a resumed run keeps its own
    if cfg.eval_only and os.path.exists(os.path.join(cfg.load, "roles.json")):
        with open(os.path.join(cfg.load, "roles.json"), "rb") as f:  # the evaluated model's roles
            write_atomic(pinned, f.read())
    log_file = open(os.path.join(rdir, "log.txt"), "a")

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        log_file.write(line + "\n")
        log_file.flush()
        if log_to_stdout:
            print(line, flush=True)

    try:
        log(f"{cfg.method} | {cfg.protocol} | {cfg.dataset} | {cfg.shots} shots | seed {cfg.seed} | "
            f"{device} -> {rdir}")
        clip_model, _ = load_clip(cfg.backbone, device)
        L = clip_model.visual.transformer.layers
        J = cfg.J or default_J(L)
        if not 1 <= J <= L:
            raise RunError(f"--J {J} is beyond the backbone: {cfg.backbone} has {L} blocks, so J must lie "
                           f"in 1..{L}")
        cfg = dataclasses.replace(cfg, J=J)
        use_tokens = cfg.method == "dear" and cfg.attr_tokens
        roles, roles_used = None, None
        if use_tokens and cfg.mask != "none":
            if os.path.exists(pinned):  # resumed or evaluated: the run's own roles, whatever the cache
                roles, source = read_roles(pinned, clip_model, list(range(J, L + 1))), pinned
                log(f"head roles: the run's own copy {pinned}")
            else:
                roles, source = load_roles(cfg, clip_model, device, log)
            roles_used = pin_roles(source, rdir)
        if roles is not None and cfg.roles_control != "none":
            roles = control_roles(roles, cfg, log)
        seed_everything(cfg.seed)  # here, after anything that may draw random numbers (pretraining, roles)
        try:
            model = make_model(clip_model, roles, cfg).to(device)
        except ValueError as e:
            raise RunError(str(e)) from e
        config = dict(config, resolved={"J": cfg.J, "precision": cfg.precision}, roles_used=roles_used)
        atomic_save(config, os.path.join(rdir, "config.json"), as_json=True)
        t0, stats = time.time(), None  # stats: train.train's report (None: no training, or none)
        if cfg.eval_only:
            state = torch.load(os.path.join(cfg.load, "model.pt"), map_location=device, weights_only=True)
            model.load_state_dict(state, strict=False)
        elif cfg.method == "dear":
            log(f"train: {len(train_ds.train)} images, {len(train_ds.classnames)} classes, {cfg.epochs} "
                f"epochs, batch {cfg.batch_size}, beta {cfg.beta}, lambda_reg {cfg.lambda_reg}, J {cfg.J}, "
                f"mask {cfg.mask}")
            stats = train(model, train_ds, cfg, device, rdir, log, make_loss(cfg))
            atomic_save(model.trainable_state(), os.path.join(rdir, "model.pt"))
        train_s, t1 = time.time() - t0, time.time()
        results = {"method": cfg.method, "protocol": cfg.protocol, "dataset": cfg.dataset,
                   "backbone": cfg.backbone, "shots": cfg.shots, "seed": cfg.seed, "variant": variant,
                   "config": dataclasses.asdict(cfg), "inputs": config["inputs"],
                   "roles_used": roles_used, "precisions": config["precisions"], "evals": []}
        if stats is not None:  # what train.train reports, e.g. the steps the GradScaler skipped
            results["train"] = stats
        if train_ds is not None and cfg.method == "dear" and not cfg.eval_only:  # the shots each class had
            counts = train_ds.shots_per_class
            results["train_shots"] = {"asked": cfg.shots, "min": min(counts), "max": max(counts),
                                      "per_class": counts}
        datasets = [ds for ds in [train_ds] + [e[0] for e in evals] if ds is not None]
        results["warnings"] = list(dict.fromkeys(w for ds in datasets for w in ds.warnings))  # each once
        for ds, split, rule in evals:
            beta = eval_beta(cfg, ds.name)  # xd targets: MMRL++'s test-time beta
            model.set_beta(beta)
            r = evaluate(model, ds.test, ds.classnames, ds.template, cfg, device, logits=rule, log=log,
                         name=f"{ds.name}/{split}")
            results["evals"].append({"dataset": ds.name, "split": split, "beta": beta, **r})
            log(f"{ds.name} {split}: {r['accuracy']:.2f}% of {r['n']} ({rule} logits, beta {beta})")
        if cfg.protocol == "b2n":
            results["hm"] = harmonic_mean(results["evals"][0]["accuracy"], results["evals"][1]["accuracy"])
            log(f"HM {results['hm']:.2f}")
        if use_tokens:
            results["fusion_weights"] = model.fusion_weights()
        results["timing"] = {"train_s": train_s, "eval_s": time.time() - t1}
        atomic_save(results, results_path, as_json=True)
        if os.path.exists(ckpt):
            os.remove(ckpt)
        log(f"wrote {results_path}")
        return results
    except KeyboardInterrupt:
        if os.path.exists(ckpt):
            raise Interrupted(f"interrupted: the last checkpoint is kept in {ckpt}; rerun the same command "
                              "with --resume") from None
        raise Interrupted("interrupted before the first checkpoint: nothing was kept to resume; rerun the "
                          "same command to start again") from None
    finally:
        log_file.close()


def control_roles(roles, cfg, log):
    """--roles-control random | oracle: the roles a control run uses instead (entropy.control_roles)."""
    try:
        roles = entropy.control_roles(roles, cfg.roles_control, cfg.seed)
    except ValueError as e:
        raise RunError(str(e)) from e
    log(f"roles control {cfg.roles_control}: " + "; ".join(
        f"block {b}: " + " ".join(h["role"][0].upper() + (":" + h["attribute"] if h["attribute"] else "")
                                  for h in heads) for b, heads in sorted(roles.items())))
    return roles

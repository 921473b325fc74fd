"""A run's folder and what it records; the flags each kind of call reads; the backbone a run loads.

dear.py's loop reaches this file in a few calls; entropy.py loads its backbone here too. Nothing
here imports torch at the top, so tables.py reads results without it.

A run folder is a run's identity. config.json records the resolved settings, the inputs by content
(the dataset's lists of images, the checkpoint's and the roles' SHA256) and where the run ran;
results.json adds the results and the weights' SHA256. Every use of a run checks what it recorded
against what it is about to use: reuse and --resume the whole record (RunFolder.finished),
--eval-only and predict the backbone, the roles and the weights (check_use).
"""

import fcntl
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import time
import urllib.error

import data
from data import UserError

# --------------------------------------------------------------------------- the flags a call reads
# A flag the user gives to a call that does not read it is refused, whatever its value: a DeAR run
# reads every flag but these three; the other calls read only their own.
NOT_TRAINING = ("eval_only", "load", "roles_only")
PLACE = ("root", "workers", "eval_batch_size", "device")  # where and how fast: never recorded
READS = {"zeroshot": ("dataset", "protocol", "method", "backbone", "targets", "eval_precision",
                      "out", "resume", "force", *PLACE),
         "eval-only": ("dataset", "protocol", "targets", "target_beta", "eval_precision",
                       "eval_only", "load", "force", *PLACE),
         "roles-only": ("dataset", "backbone", "J", "out", "roles_only", *PLACE)}
XD_ONLY = ("targets", "target_beta")


def reads(call, name):
    """Whether a call ("dear", "zeroshot", "eval-only" or "roles-only") reads a field's flag."""
    return name not in NOT_TRAINING if call == "dear" else name in READS[call]


def refuse_unread(call, given, protocol, recorded):
    """given: {field: its flag} of the flags the user gave; call: "dear" (train, then evaluate),
    "zeroshot", "eval-only" or "roles-only"; recorded: the fields a run records (--eval-only takes
    them from the run it loads)."""
    what = {"dear": "a DeAR run", "zeroshot": "--method zeroshot"}.get(call, "--" + call)
    for name, flag in given.items():
        why = "it takes the run's own" if call == "eval-only" and name in recorded else "drop it"
        if not reads(call, name):
            raise UserError(f"{flag} is not read by {what}: {why}")
        if name in XD_ONLY and protocol != "xd":
            raise UserError(f"{flag} is read by --protocol xd only: drop it, or add it")
    if "resume" in given and "force" in given:
        raise UserError("--resume continues a run and --force restarts it: give one of them")


# ------------------------------------------------------------------------------ records
# config.json: {"config": the settings, "inputs", "env", "classes", "template"}; results.json:
# {"config", "inputs", "env", "variant", "changed", "evals", ...}. The settings' schema is dear.py's
# (every field as its flag takes it); tables.py checks the ones it reads (RUN_CONFIG).

INPUTS = dict(dataset_folder=str, data_sha256=str, backbone_sha256=str, roles_sha256=(str, None))
RUN_CONFIG = dict(dataset=str, protocol=("b2n", "fewshot", "xd"), method=("dear", "zeroshot"),
                  backbone=str, shots=data.POSITIVE, seed=int, eval_only=bool, targets=[str])
ACCURACY = slice(0, 100)
READOUTS = {"fused": ACCURACY, "class": ACCURACY, "image": ACCURACY, "text": ACCURACY}
EVAL = {"dataset": str, "split": ("base", "novel", "all"), "beta": (slice(0, 1), None),
        "accuracy": ACCURACY, "n": int, "logits": ("fused", "cls"), "precision": str,
        "per_class": [{"class": str, "accuracy": ACCURACY, "n": int}], "readouts": READOUTS}
RESULTS = {"inputs": INPUTS, "env": dict, "variant": str, "changed": dict, "evals": [EVAL],
           "train": (dict, None), "hm?": ACCURACY, "warnings": [str], "model_sha256": (str, None)}
FIX_RESULTS = "--force redoes the run"


def read_config(run, config, fix="give a run folder that has finished"):
    """A run folder's config.json, checked: config is the schema of its settings."""
    path = os.path.join(run, "config.json")
    schema = {"config": config, "inputs": INPUTS, "env": dict, "classes": [str], "template": str}
    return exact(path, data.read_json(path, schema, fix), config, fix)


def read_results(path, config=None):
    """A results.json, checked: its schema, and its evaluations against its own settings (the
    datasets and splits the protocol evaluates, once each; b2n's HM). config: the settings' schema
    (None: RUN_CONFIG, the settings tables.py reads, others allowed)."""
    doc = data.read_json(path, {**RESULTS, "config": config or RUN_CONFIG}, FIX_RESULTS)
    if config:
        exact(path, doc, config, FIX_RESULTS)
    c = doc["config"]
    want = [(c["dataset"], s) for s in (("base", "novel") if c["protocol"] == "b2n" else ("all",))]
    want += [(t, "all") for t in c.get("targets") or []] if c["protocol"] == "xd" else []
    got = [(e["dataset"], e["split"]) for e in doc["evals"]]
    if got != want:
        raise UserError(f"{path}: evaluates {got or 'nothing'}, but its config asks for {want}; "
                        f"{FIX_RESULTS}")
    if c["protocol"] == "b2n":
        b, n = (e["accuracy"] for e in doc["evals"])
        if abs(doc.get("hm", -1) - harmonic_mean(b, n)) > 1e-6:
            raise UserError(f"{path}: its hm is not the HM of its base and novel; {FIX_RESULTS}")
    return doc


def exact(path, doc, config, fix):
    """doc, if its settings are exactly the fields of this version."""
    if extra := sorted(set(doc["config"]) - set(config)):
        raise UserError(f"{path}: config {extra[0]!r} is not a setting of this version; {fix}")
    return doc


def harmonic_mean(b, n):
    return 2 * b * n / (b + n) if b + n > 0 else 0.0


def check_use(run, config, now):
    """A finished run about to be used (--eval-only, predict): what it recorded by content
    (backbone_sha256, roles_sha256 in config.json; model_sha256 in results.json) against what this
    call loaded, `now` (the same keys). Returns the run's config.json."""
    doc = read_config(run, config)
    done = read_results(os.path.join(run, "results.json"), config)
    was = {**doc["inputs"], "model_sha256": done["model_sha256"]}
    if differ := [f"{k} {was[k]} recorded, {v} found" for k, v in now.items() if was[k] != v]:
        raise UserError(f"{run}: not the inputs it was run with ({'; '.join(differ)}); restore "
                        "them (its roles.json and model.pt), or run it again")
    return doc


def inputs(dataset_folder, items, backbone_sha256, roles):
    """What a run reads, by content: its dataset's folder and image lists (items: anything that
    holds them, JSON-able), the checkpoint's SHA256, the roles file's (None: no roles)."""
    return {"dataset_folder": os.path.realpath(dataset_folder), "data_sha256": sha256_json(items),
            "backbone_sha256": backbone_sha256, "roles_sha256": roles and data.sha256_file(roles)}


def differences(record, doc):
    """The settings and inputs in which a recorded doc differs from this call's record."""
    now = {f"{g}.{k}": v for g in ("config", "inputs") for k, v in record[g].items()}
    was = {f"{g}.{k}": v for g in ("config", "inputs") for k, v in doc[g].items()}
    keys = [k for k in dict.fromkeys([*now, *was]) if was.get(k) != now.get(k)]
    return "; ".join(f"{k}: {was.get(k)!r} -> {now.get(k)!r}" for k in keys[:4])


def sha256_json(doc):
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


# ------------------------------------------------------------------------------ the run folder


def run_dir(c, changed):
    """(the run's folder, its variant): OUT/<protocol>/<dataset>/<method>-<variant>-shots<K>-
    seed<S>/, the variant `default` or the flags that differ from the dataset's defaults
    (`changed`: `mask-none_J-7`), a long part (a path) cut and hashed, and so a long variant (a
    folder name has at most 255 bytes); a folder:PATH dataset named by its folder and its path's
    hash; --eval-only: RUN/eval/<protocol>-<dataset>/. c: a final dear.Config."""
    parts = [f"{k}-{v}" for k, v in changed.items()]
    short = [p if len(p) < 40 else p[:20] + sha256_json(p)[:8] for p in parts]
    variant = "_".join(short).replace("/", "-") or "default"
    if len(variant) > 120:
        variant = variant[:111] + "_" + sha256_json(variant)[:8]
    tag = c.dataset
    if c.dataset.startswith("folder:"):
        path = data.dataset_folder(c.dataset, c.root)
        tag = f"folder-{os.path.basename(path)}-{sha256_json(path)[:8]}"
    if c.eval_only:
        return os.path.join(c.load, "eval", f"{c.protocol}-{tag}"), variant
    name = f"{c.method}-{variant}-shots{c.shots}-seed{c.seed}"
    return os.path.join(c.out, c.protocol, tag, name), variant


class RunFolder:
    """A run's folder, held by one process (flock), with its log. It holds a finished run
    (results.json), an interrupted one (checkpoint.pt) or nothing; force clears it first. No
    folder on the way from top down to it, and no file in it, is followed through a link: a link
    there is refused, never written through."""

    FILES = ("results.json", "checkpoint.pt", "model.pt", "roles.json", "roles.md", "roles.png",
             "mask.png", "config.json")

    def __init__(self, path, top, force=False, resume=False):
        self.path, self.resuming = path, resume
        data.makedirs_below(top, path)
        self.fd = data.open_regular(self.file(".lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise UserError(f"{path} is being written by another process") from None
        for name in self.FILES if force else ():
            data.remove(self.file(name))
        self.log_fd = data.open_regular(self.file("log.txt"), os.O_WRONLY | os.O_CREAT
                                        | os.O_APPEND)
        self.env = environment()
        self.log(f"{path} | " + " ".join(f"{k} {v}" for k, v in self.env.items()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.log_fd)
        os.close(self.fd)

    def file(self, name):
        return os.path.join(self.path, name)

    def log(self, msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        os.write(self.log_fd, (line + "\n").encode())
        print(line, flush=True)

    def finished(self, record, config):
        """The folder's results if it holds a finished run of this record (config and inputs);
        None if it holds nothing, or an interrupted run to resume. A run of another record (in
        config.json or results.json) stops the call."""
        done = os.path.lexists(self.file("results.json"))
        interrupted = os.path.lexists(self.file("checkpoint.pt"))
        if interrupted and not (done or self.resuming):
            raise UserError(f"{self.path}: an interrupted run; the same command with --resume "
                            "goes on, with --force starts it again")
        if not (done or (interrupted and self.resuming)):
            return None
        docs = [read_config(self.path, config, FIX_RESULTS)]
        docs += [read_results(self.file("results.json"), config)] if done else []
        for doc in docs:
            if diff := differences(record, doc):
                raise UserError(f"{self.path} holds a run of another config ({diff}); use another "
                                "--out, or --force")
        return docs[-1] if done else None

    def begin(self, record, roles, model, classes, template):
        """Before the work: the space for the largest file the run writes (checkpoint.pt: the
        trainable values and AdamW's two moments of each), a new run's roles.json copied in, its
        config.json (with the classes and template predict reads)."""
        trained = [p for p in model.parameters() if p.requires_grad]
        data.writable_folder(self.path, 3 * sum(p.nbytes for p in trained) + 2**20)
        if roles and os.path.realpath(roles) != os.path.realpath(self.file("roles.json")):
            data.atomic_write(self.file("roles.json"), lambda tmp: shutil.copyfile(roles, tmp))
        data.write_json(self.file("config.json"), dict(record, classes=classes, template=template))

    def end(self, results):
        """results.json, last: the run is finished; its checkpoint goes."""
        data.write_json(self.file("results.json"), results)
        data.remove(self.file("checkpoint.pt"))
        self.log(f"wrote {self.file('results.json')}")
        return results

    def checkpoint(self, model, opt, scaler, epoch, precision):
        """checkpoint.pt at an epoch's end: the trainable weights, AdamW's and the GradScaler's
        states."""
        state = {"model": model.trainable_state(), "opt": opt.state_dict(),
                 "scaler": scaler.state_dict(), "epoch": epoch, "precision": precision}
        data.write_torch(self.file("checkpoint.pt"), state)

    def resume(self, model, opt, scaler, precision, epochs):
        """checkpoint.pt (if the folder holds one) into the model, the optimiser and the
        GradScaler; returns the epochs it holds (0: none)."""
        path = self.file("checkpoint.pt")
        if not os.path.lexists(path):
            return 0
        fix = "--force starts the run again"
        state = data.read_torch(path, fix, CHECKPOINT)
        if state["precision"] != precision:
            raise UserError(f"{path}: of --precision {state['precision']}; resume with it, or "
                            "--force")
        if not 1 <= state["epoch"] <= epochs:
            raise UserError(f"{path}: holds epoch {state['epoch']}, not one of 1..{epochs}; {fix}")
        model.load_trainable(state["model"], path)
        try:
            opt.load_state_dict(state["opt"])
            scaler.load_state_dict(state["scaler"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise UserError(f"{path}: its optimiser state does not fit ({e}); {fix}") from None
        self.log(f"resuming from {path} at epoch {state['epoch'] + 1}")
        return state["epoch"]


CHECKPOINT = {"model": dict, "opt": dict, "scaler": dict, "epoch": int, "precision": str}


class Progress:
    """The training log: loss, ce, lr, the steps the GradScaler skipped, an ETA, at two steps an
    epoch (up to every 50th) and its last: the only waits for the device."""

    def __init__(self, log, epochs, steps, start, opt, precision):
        self.log, self.epochs, self.steps, self.start = log, epochs, steps, start
        self.opt, self.precision = opt, precision
        self.every = max(1, min(50, steps // 2))
        self.done, self.t0 = 0, time.time()  # the steps taken, and since when

    def skipped(self, steps):
        """Of `steps` so far, those AdamW did not take (its own count leaves the skipped out)."""
        param = self.opt.param_groups[0]["params"][0]
        return steps - int(self.opt.state[param].get("step", 0))

    def step(self, epoch, step, loss, ce, lr, scaled):
        self.done += 1
        if (step + 1) % self.every and step + 1 != self.steps:
            return
        value = loss.item()
        if not math.isfinite(value) and not scaled:  # nothing skips such a step: stop
            to = "--precision fp32" if self.precision == "bf16" else "a lower --lr"
            when = f"by epoch {epoch + 1}, step {step + 1}"
            raise UserError(f"the loss became {value} {when}; try {to}")
        skipped = self.skipped(epoch * self.steps + step + 1)
        left = (self.epochs - self.start) * self.steps - self.done
        eta = (time.time() - self.t0) / self.done * left
        self.log(f"epoch {epoch + 1}/{self.epochs} step {step + 1}/{self.steps} loss {value:.4f} "
                 f"ce {ce.item():.3f} lr {lr:.2e}" + (f" skipped {skipped}" if skipped else "")
                 + f" eta {eta:.0f}s")


# ------------------------------------------------------------------------------ where it ran


def environment():
    """Where a run ran: versions, the device, the code's commit and whether it had changes."""
    import torch
    import torchvision

    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        done = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True)
        return done.stdout.strip()

    try:
        info = data.read_text("/proc/cpuinfo", "")
    except (UserError, OSError):  # no /proc (not Linux), or an empty one
        info = []
    names = [line.split(":")[1].strip() for line in info if line.startswith("model name")]
    cpu = names[0] if names else (platform.processor() or platform.machine())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu
    return dict(python=platform.python_version(), torch=torch.__version__,
                torchvision=torchvision.__version__, cuda=torch.version.cuda, device=device,
                cudnn=torch.backends.cudnn.version(), git_commit=git("rev-parse", "HEAD") or None,
                git_dirty=bool(git("status", "--porcelain")))


# ------------------------------------------------------------------------------ the backbone


def device(name, bf16=False):
    """--device: auto is CUDA where there is one, else the CPU; a device this machine lacks (or a
    GPU without bfloat16, when bf16 is asked for) is refused here, before any work."""
    import torch

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise UserError(f"--device {name!r}: choose auto, cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    chosen = ("cuda" if count else "cpu") if name == "auto" else name
    if chosen.startswith("cuda") and (torch.device(chosen).index or 0) >= count:
        raise UserError(f"--device {chosen}: this machine has {count} CUDA devices")
    if bf16 and chosen.startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise UserError("--precision bf16: this GPU has no bfloat16; use fp16")
    return chosen


def load_backbone(name, device, log=print):
    """A frozen CLIP with .name and .sha256: clip.load for OpenAI's names and checkpoint files;
    "toy": the toy world's tiny CLIP, pretrained into the CLIP cache on first use."""
    import pickle

    import torch

    import clip
    import toyworld

    fix = "pass ViT-B/32, ViT-B/16, ViT-L/14, ViT-L/14@336px, toy or a ViT CLIP checkpoint file"
    if name == toyworld.BACKBONE:
        path = toyworld.ensure_pretrained(clip.cache_dir(), log)
    else:
        path = name if name in clip.MODELS else data.regular(name, fix)
    if name == toyworld.BACKBONE and str(device) == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the toy CLIP's matrices are too small for a second thread to pay
    try:
        model, _ = clip.load(path, device=device)
    except (RuntimeError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as e:
        why = data.first_line(e, 100)
        raise UserError(f"{path}: not a ViT CLIP checkpoint ({why}); {fix}") from None
    except urllib.error.URLError as e:  # offline, or refused: the file, and where it goes
        raise UserError(f"{clip.MODELS[name]}: {e.reason}; save it in {clip.cache_dir()}") from None
    try:
        clip.tokenizer.get_tokenizer()  # the BPE vocabulary, checked before any work
    except ValueError as e:
        raise UserError(f"{e}; restore clip/ from the repository") from None
    model.name = name
    return model

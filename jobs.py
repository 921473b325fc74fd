"""jobs.py: what run_all.sh does with its job list. run_all.sh says which tables there are and
which dear.py jobs fill them; this file does the rest, in one Python process:

  name_jobs      ask dear.py where each job writes (its own run_dir()) and which insertion layer J
                 needs head roles, so skipping and de-duplicating use exactly dear.py's folder names
  plan           drop jobs that write an earlier job's folder; add one roles job per J
  check          look for every dataset the stages need, and name all missing ones at once
  OutLock        one run_all.sh per output folder
  Scheduler      run the jobs: one per GPU slot (GPUS="0 1 ..."), or one after another
  main           the order of it all: list, or make the toy world, check, lock, roles, runs, tables

Called only by run_all.sh (`bash run_all.sh --help` is the user's documentation); its command line
is run_all.sh's private interface. Messages start with "run_all.sh:": that is what the user ran.
"""

import argparse
import errno
import importlib.util
import io
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads; see BENCH.md
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
from contextlib import redirect_stdout
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
PLAIN = re.compile(r"[A-Za-z0-9_./:=,@+%-]+")  # words that need no shell quotes


class Stop(Exception):
    """A fault the user can fix: one line on stderr, exit 2."""


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM (a BaseException, so that no `except Exception` swallows it)."""


def quote(*words):
    """One shell command line, as run_all.sh's quote() writes it: plain words as they are, the rest
    quoted."""
    out = []
    for w in words:
        if PLAIN.fullmatch(w):
            out.append(w)
        elif "\n" in w:  # $'...\n...'
            escaped = w.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
            out.append("$'" + escaped + "'")
        else:  # 'it'\''s'
            out.append("'" + w.replace("'", "'\\''") + "'")
    return " ".join(out)


# ------------------------------------------------------------------------------------------------
# Naming: which folder each job writes, and which J it needs head roles for


@dataclass
class Job:
    stage: str  # roles, b2n, xd, fewshot, ablations
    cmd: str  # one shell command line
    run_dir: str  # "" when unknown (dear.py then says what is wrong when the job runs)
    J: str = "-"  # the insertion layer whose roles the run needs; "-": the backbone's default
    roles: bool = False
    index: int = 0  # position in run_all.sh's list (names the log of a job without a folder)


def load_dear(path):
    """The dear.py at `path` (run_all.sh's DEAR_PY) as a module; its folder goes on sys.path."""
    path = os.path.abspath(path)
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("dear", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def name_job(dear, flags):
    """(J, needs roles, run folder) of one job's dear.py flags; ("-", False, "") for a job that
    dear.py refuses."""
    try:
        c = dear.resolve(dear.parse_args(shlex.split(flags)))
        roles = c.method == "dear" and c.attr_tokens and c.mask != "none"
        return ("-" if c.J is None else str(c.J)), bool(roles), dear.run_dir(c)
    except BaseException:  # argparse exits on a bad line: dear.py says what is wrong when it runs
        return "-", False, ""


def name_jobs(dear, launcher, specs):
    """specs [(stage, dear.py flags)] -> [Job]."""
    jobs = []
    for i, (stage, flags) in enumerate(specs):
        J, roles, rdir = name_job(dear, flags)
        jobs.append(Job(stage, f"{launcher} {flags}", rdir, J, roles, i))
    return jobs


def plan(jobs, roles_flags):
    """(roles jobs, runs): runs without those that write an earlier run's folder (e.g. "--J 9" is
    the default run); one roles job per J that some run needs (only when roles_flags, the roles
    command line (before --J, after it), is given)."""
    seen, runs = set(), []
    for job in jobs:
        if job.run_dir and job.run_dir in seen:
            continue
        seen.add(job.run_dir)
        runs.append(job)
    if roles_flags is None:
        return [], runs
    js = {job.J for job in runs if job.roles} if runs else {"-"}  # roles alone: the default J
    before, after = roles_flags
    roles = []
    for j in sorted(js, key=lambda j: -1 if j == "-" else int(j)):
        name = "Jdefault" if j == "-" else f"J{j}"
        cmd = before + ("" if j == "-" else f" --J {j}") + (f" {after}" if after else "")
        roles.append(Job("roles", cmd, name, j))
    return roles, runs


# ------------------------------------------------------------------------------------------------
# The dataset check: every dataset the stages need, all missing ones at once, before any GPU time


def plural(n):
    return f"{n} dataset" + "s" * (n != 1)


def check(names, root, full, err=sys.stderr):
    """True when every dataset is there. "full" (--check): one line per dataset and every fix;
    else one summary with the fix of the first missing one."""
    import data  # here: the listing needs no torch, and --list needs no data.py

    where = os.path.abspath(os.path.expanduser(root))
    made_elsewhere = any(n == "toyworld" or n.startswith("folder:") for n in names)
    if not os.path.isdir(where) and not made_elsewhere:  # no root: say so once, not per dataset
        print(
            f"data root not found: {where}, so the {plural(len(names))} the stages need are all "
            "missing",
            file=err,
        )
        if full:
            print("where each one goes under --root DATA:", file=err)
            for n in names:
                print(f"  {n:<16} DATA/{data.DATASETS[n].layout()}", file=err)
        print(
            "Pass --root DATA, the folder that holds the datasets in the layout of CoOp's "
            "DATASETS.md.",
            file=err,
        )
        return False
    missing = []
    for name in names:
        try:
            data.build_dataset(name, root)
            if full:
                print(f"  ok       {name}", flush=True)
        except data.DataError as e:
            if full:
                print(f"  MISSING  {name}", flush=True)
            missing.append((name, "    " + str(e).replace("\n", "\n    ")))
    if not missing:
        return True
    summary = f"{len(missing)} of {plural(len(names))} missing under --root {root}"
    if full:  # every missing dataset with its fix
        print(f"\n{summary}:\n\n" + "\n\n".join(f"{n}:\n{fix}" for n, fix in missing), file=err)
    else:  # a summary: which ones, and the fix of the first
        listed = ", ".join(n for n, _ in missing)
        print(f"{summary}: {listed}\nThe first, {missing[0][0]}:\n" + missing[0][1], file=err)
    return False


def next_steps(full, here, python, root):
    """Where to go after a failed check: the full list, the download command, the offline demo.
    `here`: the folder of run_all.sh as the user typed it ("" for the current one)."""
    lines, data_py, at_root = [""], here + "data.py", quote("--root", root)
    if not full:
        lines.append(f"  every dataset with its fix:  bash {here}run_all.sh --check {at_root}")
    get = quote(python, data_py, "download")
    lines += [
        f"  get a dataset:               {get} NAME {at_root}   "
        f"({quote(python, data_py)} --help lists the names)",
        f"  try it offline first:        bash {here}run_all.sh --smoke --out smoke   "
        "(the toy world on the CPU, no download)",
        "  or leave stages out with --skip (e.g. --skip xd,fewshot)",
    ]
    return "\n".join(lines)


def check_data(args, full):
    """The check with its header and its next steps; True when every dataset is there."""
    if not args.dataset:
        return True
    print(f"checking {len(args.dataset)} dataset(s) under {args.root}", flush=True)
    try:
        ok = check(args.dataset, args.root, full)
    except Exception:
        traceback.print_exc()
        print(
            "run_all.sh: the dataset check itself failed (see above); --no-check skips it",
            file=sys.stderr,
        )
        return False
    if not ok:
        print(next_steps(full, args.here, args.python, args.root), file=sys.stderr)
    return ok


def make_toyworld(kind, root, pretrain):
    """The toy world is generated, not downloaded: write it (once) under root before the check looks
    for it; --toy also the transfer sets and (pretrain) the toy CLIP, once, before parallel jobs
    need it."""
    import toyworld

    try:
        with redirect_stdout(io.StringIO()):  # the folders it prints are not news
            rc = toyworld.main(["dataset", "--root", root] + ["--transfer"] * (kind == "toy"))
        if rc == 0 and pretrain:
            rc = toyworld.main(["pretrain"])
    except Exception:
        traceback.print_exc()
        rc = 1
    if rc != 0:
        raise SystemExit(2)


# ------------------------------------------------------------------------------------------------
# One run_all.sh per output folder


class OutLock:
    """An flock on OUT/.run_all.lock, released by the OS when the process ends however it ends. A
    second run_all.sh on the same --out stops at once, naming the first (both would run the same
    jobs and write the same logs). The jobs do not inherit it (Python's files are not inherited)."""

    def __init__(self, out):
        self.out, self.path, self.file = out, os.path.join(out, ".run_all.lock"), None

    def __enter__(self):
        import fcntl  # POSIX

        try:
            os.makedirs(self.out, exist_ok=True)
            self.file = open(self.path, "a+")
        except OSError as e:
            raise Stop(
                f"cannot write to --out {self.out} ({e.strerror}); choose a writable --out"
            ) from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise Stop(
                f"{self.out} is in use by another run_all.sh ({holder}); wait for it to "
                "finish, or choose another --out"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(
            f"pid {os.getpid()} on {socket.gethostname()}, "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S')}"
        )
        self.file.flush()
        return self

    def __exit__(self, *exc):
        self.file.close()  # closing releases the flock
        return False


# ------------------------------------------------------------------------------------------------
# Running: one job per GPU slot, or one after another


def fmt_s(s):
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def below(out, path):
    """path without its leading "OUT/"."""
    return path[len(out) + 1 :] if path.startswith(out + "/") else path


def log_name(out, d):
    """OUT/logs/<run folder below OUT, '/' -> '__'>.log"""
    return os.path.join(out, "logs", below(out, d).replace("/", "__") + ".log")


def last_lines(path, n=5):
    """The last n lines of a log, as `tail -n 5` shows them."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    lines = text.split("\n")
    return lines[:-1][-n:] if text.endswith("\n") else lines[-n:]


@dataclass
class Task:
    name: str  # what the progress lines call it
    cmd: str
    log: str
    done: str  # a file that exists once the job has finished; "": always run


class Scheduler:
    """Runs Tasks in slots and prints one line per event, and the running totals after each."""

    def __init__(self, slots):
        self.slots = slots or [""]  # "": sequential, dear.py picks the device
        self.parallel = bool(slots)
        self.start = time.time()
        self.n_done = self.n_skip = self.n_failed = self.n_left = self.n_running = 0
        self.failed = []  # "NAME  (log: LOG)"

    def summary(self):
        print(
            f"[{time.strftime('%H:%M:%S')}] done {self.n_done} (skipped {self.n_skip}) | running "
            f"{self.n_running} | failed {self.n_failed} | left {self.n_left} | elapsed "
            f"{fmt_s(int(time.time() - self.start))}"
        )

    def finished(self, task, rc):
        if rc == 0:
            self.n_done += 1
            print(f"ok      {task.name}")
            return True
        self.n_failed += 1
        self.failed.append(f"{task.name}  (log: {task.log})")
        print(f"FAILED  {task.name} (log: {task.log}); last lines:")
        for line in last_lines(task.log):
            print("    " + line)
        return False

    def launch(self, task, slot):
        os.makedirs(os.path.dirname(task.log), exist_ok=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=slot) if self.parallel else None
        with open(task.log, "wb") as log:
            return subprocess.Popen(
                ["bash", "-c", task.cmd], stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def run(self, tasks):
        """True when every task finished (or was done already)."""
        queue, ok = list(tasks), True
        self.n_left = len(queue)
        running = {}  # slot index -> (task, Popen)
        while queue or running:
            for k, slot in enumerate(self.slots):
                if k in running and running[k][1].poll() is not None:  # done: the slot is free
                    task, proc = running.pop(k)
                    self.n_running -= 1
                    ok = self.finished(task, proc.returncode) and ok
                    self.summary()
                while k not in running and queue:  # the next job in it
                    task = queue.pop(0)
                    self.n_left -= 1
                    if task.done and os.path.exists(task.done):
                        self.n_done += 1
                        self.n_skip += 1
                        print(f"skip (done) {task.name}")
                        continue
                    gpu = f" on GPU {slot}" if slot else ""
                    print(f"start   {task.name}{gpu}  (log: {task.log})")
                    if self.parallel:
                        running[k] = (task, self.launch(task, slot))
                        self.n_running += 1
                    else:
                        ok = self.run_here(task) and ok
            if running:
                time.sleep(0.1)
        return ok

    def run_here(self, task):
        """One job in the foreground: Ctrl-C reaches dear.py, which keeps its checkpoint; this
        process waits for it to end (as bash waits for its foreground job) and only then stops."""
        self.n_running = 1
        self.summary()
        proc, stop = self.launch(task, ""), None
        while proc.returncode is None:
            try:
                proc.wait()
            except Interrupted as e:
                stop = e
        ok = self.finished(task, proc.returncode)
        self.n_running = 0
        self.summary()
        if stop:
            raise stop
        return ok


# ------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(prog="jobs.py", description="run_all.sh's runner (see its --help)")
    p.add_argument("mode", choices=("run", "list", "check"))
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--python", required=True, help="the python of the jobs (for messages)")
    p.add_argument("--dear", required=True, help="the dear.py to ask for run folders")
    p.add_argument("--launcher", required=True, help="PYTHON DEAR_PY, shell-quoted")
    p.add_argument("--here", default="", help="run_all.sh's folder as typed, for messages")
    # values may start with "-": run_all.sh passes every option as --name=VALUE
    p.add_argument("--job", action="append", default=[], help="STAGE<tab>FLAGS (shell-quoted)")
    p.add_argument("--roles-before", help="the roles stage: a roles command line before --J ...")
    p.add_argument("--roles-after", default="", help="... and after it (run_all.sh's -- flags)")
    p.add_argument("--dataset", action="append", default=[], help="a dataset the stages need")
    p.add_argument("--toyworld", choices=("smoke", "toy"), help="make the toy world first")
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--tables", action="store_true", help="run tables.py at the end")
    return p.parse_args(argv)


def interrupt(signum, frame):
    raise Interrupted()


def main(argv=None):
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # in order with the jobs' and tables.py's output
    args.dataset = list(dict.fromkeys(args.dataset))  # each once, in order
    specs = [job.split("\t", 1) for job in args.job]  # [(stage, flags)]
    try:
        jobs = name_jobs(load_dear(args.dear), args.launcher, specs) if specs else []
    except Exception:
        traceback.print_exc()
        print(
            f"run_all.sh: could not ask {args.dear} for its run folders (see the error above)",
            file=sys.stderr,
        )
        return 2
    roles_flags = None if args.roles_before is None else (args.roles_before, args.roles_after)
    roles, runs = plan(jobs, roles_flags)
    if args.mode == "list":  # roles jobs first: they must finish before the others start
        for job in roles + runs:
            print(job.cmd)
        if roles:
            print(
                f"# the first {len(roles)} line(s) compute head roles: run them before the others",
                file=sys.stderr,
            )
        return 0
    if args.mode == "check":
        if args.toyworld:
            make_toyworld(args.toyworld, args.root, pretrain=False)
        return 0 if check_data(args, full=True) else 2
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        with OutLock(args.out):
            return run(args, roles, runs)
    except Stop as e:
        print(f"run_all.sh: {e}", file=sys.stderr)
        return 2
    except Interrupted:
        print()
        print(
            "interrupted: rerun the same command; finished runs are skipped, interrupted ones "
            "resume",
            file=sys.stderr,
        )
        return 130


def run(args, roles, runs):
    if args.toyworld:
        make_toyworld(args.toyworld, args.root, pretrain=args.toyworld == "toy")
    if args.check and not check_data(args, full=False):
        return 2
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    gpus = os.environ.get("GPUS", "")
    s = Scheduler(gpus.split())
    print(
        f"run_all.sh: {len(roles)} roles job(s), {len(runs)} run(s) -> {args.out} "
        f"(GPUs: {gpus or 'none, sequential'})"
    )
    if roles:
        print("== roles")
        folders = [f"{args.out}/roles/{job.run_dir}" for job in roles]  # run_dir: J<J>
        tasks = [
            Task(f"roles/{job.run_dir}", job.cmd, log_name(args.out, d), f"{d}/roles.json")
            for job, d in zip(roles, folders)
        ]
        if not s.run(tasks):
            print(
                "the roles stage failed: every run needs the head roles; see the log above",
                file=sys.stderr,
            )
            return 1
    if runs:
        print("== runs")
        tasks = [
            Task(
                f"{job.stage}: {below(args.out, job.run_dir)}",
                job.cmd,
                log_name(args.out, job.run_dir or f"{args.out}/unnamed-{job.index}"),
                job.run_dir and os.path.join(job.run_dir, "results.json"),
            )
            for job in runs
        ]
        s.run(tasks)
    if args.tables:
        print("== tables")
        rc = subprocess.call([args.python, os.path.join(HERE, "tables.py"), "--out", args.out])
        if rc != 0:
            return rc
    s.summary()
    if s.failed:
        print("failed runs (rerun the same command to retry them):")
        for line in s.failed:
            print("  " + line)
        return 1
    print(f"all done; tables: {args.out}/tables/tables.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

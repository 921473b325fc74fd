"""run_all.sh: the job list of every table, stage selection, GPU queues, the lock, failed jobs,
--smoke.

Every test but the last runs run_all.sh with a stand-in PYTHON (FAKE below) that records its
arguments instead of training, so they take seconds.
"""

import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_ALL = os.path.join(ROOT, "run_all.sh")
B2N = ("imagenet caltech101 oxford_pets stanford_cars oxford_flowers food101 fgvc_aircraft sun397 "
       "dtd eurosat ucf101").split()
DG = ["imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r"]
ABLATIONS = [(f,) for f in ("--mask generalization-only", "--mask none", "--no-attr-tokens",
                             "--lambda-fusion 0", "--J 7", "--J 11", "--beta 0.5", "--beta 0.7",
                             "--beta 0.9", "--novel-logits cls", "--roles-control random",
                             "--tokens mmrl")]
# the toy world's transfer sets as toyworld.ensure_transfer names them (commas and spaces kept)
TRANSFER = ["folder:/t/noisy,1", "folder:/t/small sets", "folder:/t/textures"]

FAKE = f"""#!{sys.executable}
import json, os, sys, time
args, env = sys.argv[1:], os.environ
with open(env["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"args": args, "gpu": env.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
if args[0] == "-c":  # torch.cuda.is_available(), or the toy world's transfer sets
    print(env.get("FAKE_CUDA", "False") if "cuda" in args[1] else "\\n".join({TRANSFER!r}))
dear = args[0].endswith("dear.py")
while dear and "FAKE_WAIT" in env and not os.path.exists(env["FAKE_WAIT"]):
    time.sleep(0.05)
check = args[0].endswith("data.py") and "FAKE_CHECK_FAILS" in env  # a dataset is missing
sys.exit(check or dear and env.get("FAKE_FAIL") in args)
"""


@pytest.fixture
def run(tmp_path):
    """run(*args, **env): run_all.sh in tmp_path with the stand-in PYTHON -> CompletedProcess
    with .calls."""
    (tmp_path / "python").write_text(FAKE)
    (tmp_path / "python").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "GPUS"}
    base.update(PYTHON=str(tmp_path / "python"), FAKE_LOG=str(tmp_path / "calls.jsonl"))

    def run(*args, wait=True, **env):
        cmd = ["bash", RUN_ALL, *args]
        kw = dict(cwd=tmp_path, env=dict(base, **env), stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True)
        if not wait:
            return subprocess.Popen(cmd, **kw)
        p, log = subprocess.run(cmd, timeout=60, **kw), tmp_path / "calls.jsonl"
        p.calls = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        log.unlink(missing_ok=True)
        return p

    return run


def job(args):
    """The flags of one dear.py job, order aside: ("--dataset dtd", "--mask none", ...)."""
    assert args[0].endswith("dear.py"), args
    flags, i = [], 1
    while i < len(args):
        has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        flags.append(" ".join(args[i : i + 1 + has_value]))
        i += 1 + has_value
    return tuple(sorted(flags))


def listed(p):
    assert p.returncode == 0, p.stderr
    return [job(shlex.split(line)[1:]) for line in p.stdout.splitlines()]


def stage_of(j):
    if "--roles-only" in j:
        return "roles"
    protocol = next(f.split()[1] for f in j if f.startswith("--protocol "))
    plain = ("--dataset", "--protocol", "--seed", "--shots", "--method", "--targets", "--root",
             "--out", "--backbone", "--resume")
    return "ablations" if any(f.split()[0] not in plain for f in j) else protocol


def test_list_covers_every_table(run):
    want, common = Counter(), ("--root DATA", "--out OUT", "--backbone ViT-B/16")
    add = lambda *flags: want.update([tuple(sorted(common + flags))])
    for J in (9, 7, 11):
        add("--roles-only", f"--J {J}", "--dataset imagenet")
    xd = ("--dataset imagenet", "--protocol xd", "--resume") + tuple(f"--targets {t}"
                                                                     for t in DG + B2N[1:])
    for run_flags in [("--method zeroshot",)] + [(f"--seed {s}",) for s in (1, 2, 3)]:
        add(*xd, *run_flags)
    for s in (1, 2, 3):  # MMRL's class-only logits on the xd targets
        add(*xd, f"--seed {s}", "--novel-logits cls")
    for ds in B2N:
        for protocol, shots in (("b2n", [None]), ("fewshot", [1, 2, 4, 8, 16])):
            add(f"--dataset {ds}", f"--protocol {protocol}", "--method zeroshot", "--resume")
            for k, s in itertools.product(shots, (1, 2, 3)):
                add(f"--dataset {ds}", f"--protocol {protocol}", f"--seed {s}", "--resume",
                    *[f"--shots {k}"] * bool(k))
    for ds, ablation, s in itertools.product(("dtd", "eurosat", "oxford_flowers"), ABLATIONS,
                                             (1, 2, 3)):
        add(f"--dataset {ds}", "--protocol b2n", f"--seed {s}", "--resume", *ablation)
    jobs = listed(p := run("--list", "--root", "DATA", "--out", "OUT"))
    assert Counter(jobs) == want
    assert [stage_of(j) for j in jobs[:3]] == ["roles"] * 3 and "first 3 line(s)" in p.stderr
    assert Counter(map(stage_of, jobs)) == dict(roles=3, b2n=11 + 33, xd=4, fewshot=11 + 165,
                                                ablations=108 + 3)
    assert p.calls == []  # listing runs nothing


def test_toy_transfer_sets_reach_dear_py_as_separate_targets(run):
    p = run("--toy", "--list", "--out", "OUT")
    xd = [shlex.split(line)[1:] for line in p.stdout.splitlines() if "--protocol xd" in line]
    assert len(xd) == 1 + 5 + 5  # zero-shot, seeds 1-5, seeds 1-5 with --novel-logits cls
    for args in xd:
        assert [args[i + 1] for i, a in enumerate(args) if a == "--targets"] == TRANSFER
        assert {"--root OUT/data", "--backbone toy", "--device cpu"} <= set(job(args))
    brakes = ("--lambda-reg 0", "--lambda-fusion 0", "--lr 1e-2")  # the claim's, without them
    for j in listed(p):  # every job on the toy's own schedule (the quick start's, for b2n)
        schedule = [f for f in j if f.split()[0] in ("--epochs", "--lr", "--batch-size")]
        assert not schedule or set(brakes) <= set(j) and schedule == ["--lr 1e-2"], j
    roles = [f for j in listed(p) if "--roles-only" in j for f in j if f.startswith("--J ")]
    assert sorted(roles) == ["--J 2", "--J 3", "--J 4"]


@pytest.mark.parametrize("args, stages", [(["--stages", "b2n,xd"], dict(b2n=22, xd=2)), (["--skip",
        "roles,fewshot,ablations"], dict(b2n=22, xd=2)), (["--stages", "roles"], dict(roles=1)),
                                          (["--stages", "roles,ablations", "--skip", "tables"],
        dict(roles=3, ablations=36 + 1)), (["--stages", "fewshot"], dict(fewshot=11 + 55))])
def test_stages_and_skip_choose_the_jobs(run, args, stages):
    assert Counter(map(stage_of, listed(run("--list", "--seeds", "1", *args)))) == stages


@pytest.mark.parametrize("args, says", [
    ("--stages b2n,tabels", "unknown stage tabels"), ("--stages ,", "leave no stage to run"),
    ("--skip roles,b2n,xd,fewshot,ablations,tables", "leave no stage to run"),
    ("--smoke --seeds 2", "--smoke runs seed 1 only"), ("--smoke --toy", "two presets"),
    ("--list --check", "--list and --check: choose one"), ("--root --list", "--root needs a value"),
    ("--out ''", "--out needs a value"), ("--seeds 1,2", "--seeds '1,2': whole numbers")])
def test_what_run_all_would_ignore_or_override_is_refused(run, args, says):
    p = run(*shlex.split(args))
    assert p.returncode == 2 and p.stderr.startswith("run_all.sh: ") and says in p.stderr
    assert len(p.stderr.splitlines()) == 1 and p.calls == []


def test_gpus_without_cuda_or_a_failed_dataset_check_stop_before_any_job(run):
    p = run("--stages", "b2n", GPUS="0 1", FAKE_CUDA="False")
    assert p.returncode != 0 and len(p.stderr.splitlines()) == 1 and "CUDA" in p.stderr
    assert not [c for c in p.calls if c["args"][0] != "-c"]  # nothing else ran
    p = run("--stages", "b2n", "--seeds", "1", FAKE_CHECK_FAILS="1")
    assert p.returncode == 2 and [c["args"][0] for c in p.calls][-1].endswith("data.py")
    assert not [c for c in p.calls if c["args"][0].endswith("dear.py")]


def test_one_queue_per_gpu_round_robin(run, tmp_path):
    order = listed(run("--list", "--stages", "b2n", "--seeds", "1"))
    p = run("--stages", "b2n", "--seeds", "1", GPUS="3 5", FAKE_CUDA="True")
    assert p.returncode == 0, p.stderr
    gpu = {job(c["args"]): c["gpu"] for c in p.calls if c["args"][0].endswith("dear.py")}
    assert len(p.calls) == 2 + len(order)  # the CUDA and dataset checks, then each job once
    assert gpu == {j: "35"[i % 2] for i, j in enumerate(order)}
    assert (tmp_path / "runs" / "gpu3.log").read_text().count("== ") == 11


def test_a_failed_job_is_named_the_others_go_on_and_the_exit_status_says_so(run):
    p = run("--stages", "b2n,tables", "--seeds", "1", FAKE_FAIL="eurosat")
    failed = [line for line in p.stderr.splitlines() if line.startswith("FAILED ")]
    assert p.returncode == 1 and len(failed) == 2 and all("--dataset eurosat" in f for f in failed)
    ran = [c["args"][0] for c in p.calls]
    assert sum(a.endswith("dear.py") for a in ran) == 22 and ran[-1].endswith("tables.py")
    assert ran[0].endswith("data.py")  # the datasets are checked before any job


def test_the_out_lock_refuses_a_second_run_all_and_never_follows_a_link(run, tmp_path):
    first = run("--stages", "b2n", "--seeds", "1", wait=False, FAKE_WAIT=str(tmp_path / "go"))
    calls = tmp_path / "calls.jsonl"
    while not calls.exists() or "dear.py" not in calls.read_text():
        time.sleep(0.05)  # the first one runs a job
    second = run("--stages", "tables")
    (tmp_path / "go").touch()
    assert first.wait(timeout=60) == 0 and second.returncode == 2
    assert second.stderr == ("run_all.sh: runs is in use by another run_all.sh; wait for it, or "
                             "choose another --out\n")
    assert not [c for c in second.calls if c["args"][0].endswith("tables.py")]
    calls.unlink(missing_ok=True)  # the first one's
    (tmp_path / "runs" / ".lock").unlink()
    (tmp_path / "runs" / ".lock").symlink_to(tmp_path / "elsewhere")
    p = run("--stages", "tables")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and p.calls == []
    assert not (tmp_path / "elsewhere").exists()


def test_smoke_runs_every_stage_on_the_toy_world(smoke):
    """`bash run_all.sh --smoke` with the real code (about a minute, started by conftest beside
    the other tests once the toy CLIP is there): every stage, every table."""
    out, p = smoke
    assert p.returncode == 0, open(out.parent / "smoke.log").read()[-3000:]
    found = [json.loads(f.read_text()) for f in out.glob("*/*/*/results.json")]
    assert len(found) == 7  # b2n 2, xd 2, fewshot 2, ablations 1
    # DeAR trains one epoch past its warm-up (at the warm-up's lr alone it stays near zero-shot)
    assert {(r["config"]["epochs"], r["config"]["warmup_epochs"]) for r in found
            if r["config"]["method"] == "dear" and r["config"]["protocol"] != "xd"} == {(2, 1)}
    assert (out / "roles" / "J3" / "roles.json").exists() and (out / "tables/tables.md").exists()

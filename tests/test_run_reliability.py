"""Run reliability (runs.py): no run returns, mixes or reuses the wrong thing; every setting that
changes a result reaches its consumer and keeps two different runs apart; every fault a user can
make ends in one line that names the fix (exit 2), before any work where it can be known before.

Each test says which plausible wrong rule it rules out. The tiny CLIP and the 6-colour folder
dataset come from test_dear.py's `world` fixture (no toy pretraining here)."""

import dataclasses
import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.nn.functional as F

import clip
import config
import dear
import entropy
import runs
import toyworld
import train
from dear import K, role_mask
from test_dear import cli, fake_roles_doc, world  # noqa: F401  (world is a fixture)
from test_runs import stop_message, write_roles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def only_result(folder):
    (path,) = folder.rglob("results.json")
    return path, json.loads(path.read_text())


def no_training(monkeypatch):
    """Make any training attempt fail loudly: a check that must come before any work did not."""

    def trained(*a, **k):
        raise AssertionError("training started before the flags were checked")

    monkeypatch.setattr(runs, "train", trained)


def xd_args(world, out, roles, *targets):
    return cli(
        world,
        out,
        "--protocol",
        "xd",
        "--epochs",
        "1",
        "--roles",
        roles,
        *[x for t in targets for x in ("--targets", t)],
    )


# ------------------------------------------------------------------ issue 25: silent wrong results


def test_an_interrupted_force_never_leaves_the_old_results_to_count_as_done(
    world, tmp_path, capsys, monkeypatch
):
    """Wrong rule ruled out: --force retires only checkpoint.pt, so an interrupted forced restart
    leaves the old results.json beside the new config.json, and the new command then reports the old
    numbers."""
    import shutil

    for name in ("t1", "t2"):  # two xd target lists: one run folder, two configurations
        shutil.copytree(world[0] / "colors", tmp_path / name)
    roles = write_roles(tmp_path / "roles.json", world[1])
    old = xd_args(world, tmp_path / "runs", roles, f"folder:{tmp_path / 't1'}")
    new = xd_args(world, tmp_path / "runs", roles, f"folder:{tmp_path / 't2'}")
    dear.main(old)
    results, _ = only_result(tmp_path / "runs")

    def interrupted(model, ds, cfg, device, rdir, log, loss_fn):  # a first checkpoint, then Ctrl-C
        torch.save({"model": {}}, os.path.join(rdir, "checkpoint.pt"))
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "train", interrupted)
    stop_message(new + ["--force"], capsys, code=130)
    assert not results.exists() and not (results.parent / "model.pt").exists()  # retired first
    for args in (new, old):  # neither command is answered with the old run's numbers
        err = stop_message(args, capsys)
        assert "done already" not in capsys.readouterr().out and "interrupted run" in err


def test_results_count_as_done_only_beside_their_own_config(world, tmp_path, capsys):
    """Wrong rule ruled out: "done" = results.json exists and config.json matches. A results.json
    beside a checkpoint, or recording another config than config.json, is no finished run of this
    config."""
    roles = write_roles(tmp_path / "roles.json", world[1])
    args = cli(world, tmp_path / "runs", "--protocol", "fewshot", "--epochs", "1", "--roles", roles)
    dear.main(args)
    results, done = only_result(tmp_path / "runs")
    assert done["identity"] == json.loads((results.parent / "config.json").read_text())
    # as if results.json had been made by another configuration
    done["identity"]["lambda_fusion"] = 5.0
    results.write_text(json.dumps(done))
    err = stop_message(args, capsys)
    assert "different configuration" in err and "lambda_fusion" in err and "--out" in err
    done["identity"]["lambda_fusion"] = 1.0
    results.write_text(json.dumps(done))
    # the state an interrupted restart used to leave
    (results.parent / "checkpoint.pt").write_bytes(b"")
    assert "checkpoint.pt" in stop_message(args, capsys)


def test_eval_only_refuses_a_model_whose_keys_do_not_match(world, tmp_path, capsys):
    """Wrong rule ruled out: load_state_dict(strict=False) ignores every key of a model.pt saved
    with a `module.` prefix and evaluates the untrained model."""
    roles = write_roles(tmp_path / "roles.json", world[1])
    dear.main(
        cli(world, tmp_path / "runs", "--protocol", "fewshot", "--epochs", "1", "--roles", roles)
    )
    results, _ = only_result(tmp_path / "runs")
    model_pt = results.parent / "model.pt"
    state = torch.load(model_pt)
    torch.save({"module." + k: v for k, v in state.items()}, model_pt)
    capsys.readouterr()  # what the training run said (alone, it first writes the folder's split)
    err = stop_message(
        cli(
            world,
            tmp_path / "runs",
            "--eval-only",
            "--load",
            str(results.parent),
            "--protocol",
            "fewshot",
        ),
        capsys,
    )
    assert "missing keys" in err and "module." in err and len(err.strip().splitlines()) == 1
    assert not (results.parent / "eval").exists() or not list(
        (results.parent / "eval").rglob("results.json")
    )


def test_roles_computed_for_another_checkpoint_are_refused(world, tmp_path, capsys):
    """Wrong rule ruled out: the roles file's checkpoint_sha256 is recorded but never compared."""
    doc = fake_roles_doc(model_name=world[1])
    doc["checkpoint_sha256"] = "ab" * 32
    (tmp_path / "roles.json").write_text(json.dumps(doc))
    err = stop_message(
        cli(world, tmp_path / "runs", "--roles", str(tmp_path / "roles.json")), capsys
    )
    assert (
        "ab" * 32 in err
        and runs.file_sha256(world[1]) in err
        and len(err.strip().splitlines()) == 1
    )
    # roles made for this checkpoint are taken
    doc["checkpoint_sha256"] = runs.file_sha256(world[1])
    (tmp_path / "roles.json").write_text(json.dumps(doc))
    dear.main(
        cli(
            world,
            tmp_path / "runs",
            "--protocol",
            "fewshot",
            "--epochs",
            "1",
            "--roles",
            str(tmp_path / "roles.json"),
        )
    )
    results, done = only_result(tmp_path / "runs")
    resolved = json.loads((results.parent / "config.json").read_text())["resolved"]
    # the file loaded
    assert resolved["backbone_sha256"] == runs.file_sha256(world[1]) and done["evals"]


# ----------------------------------------------------------------- issue 25: one line, before work


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--seed", str(2**40)], "numpy's seed range"),
        (["--seed", "-1"], "numpy's seed range"),
        (["--device", "tpu"], "not a device torch knows"),
        (["--eval-batch-size", "0"], "--eval-batch-size must be >= 1"),
        (["--warmup-epochs", "-1"], "--warmup-epochs must be >= 0"),
        (["--targets", "dtd"], "--targets applies to --protocol xd only"),
    ],
)
def test_bad_flags_stop_before_any_work(world, tmp_path, capsys, monkeypatch, flags, says):
    """Wrong rules ruled out: numpy's ValueError on a seed outside 0..2**32-1, torch's RuntimeError
    on an unknown device, the evaluation's ValueError after the whole training, --targets silently
    ignored."""
    no_training(monkeypatch)
    err = stop_message(cli(world, tmp_path / "runs", *flags), capsys)
    assert says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # nothing written


# (field, a value on the edge that passes, the nearest value past it, what the message says):
# each bound is pinned on both sides, so > for >=, a dropped check or a message naming another
# flag fails.
EDGES = [
    ("J", 1, 0, "--J counts blocks from 1"),
    ("lr", 1e-9, 0.0, "--lr must be positive"),
    ("warmup_lr", 1e-9, 0.0, "--warmup-lr must be positive"),
    ("weight_decay", 0.0, -1e-9, "--weight-decay"),
    ("lambda_reg", 0.0, -1e-9, "--lambda-reg"),
    ("lambda_fusion", 0.0, -1e-9, "--lambda-fusion"),
    ("shots", 1, 0, "--shots must be >= 1"),
    ("workers", 0, -1, "--workers must be >= 0"),
    ("beta", 0.0, -1e-9, "--beta must lie in [0, 1]"),
    ("beta", 1.0, 1 + 1e-9, "--beta must lie in [0, 1]"),
    ("alpha_cls", 1e-9, 0.0, "--alpha-cls must lie in (0, 1)"),
    ("alpha_cls", 1 - 1e-9, 1.0, "--alpha-cls must lie in (0, 1)"),
    ("epochs", 1, 0, "--epochs and --batch-size must be >= 1"),
    ("batch_size", 1, 0, "--epochs and --batch-size must be >= 1"),
    ("crop_scale", 1e-9, 0.0, "--crop-scale must lie in (0, 1]"),
    ("crop_scale", 1.0, 1 + 1e-9, "--crop-scale must lie in (0, 1]"),
]


@pytest.mark.parametrize("field, edge, past, says", EDGES)
def test_each_number_is_refused_just_past_its_bound(field, edge, past, says):
    filled = config.resolve(dear.Config(dataset="eurosat"))
    config.check_numbers(dataclasses.replace(filled, **{field: edge}))
    with pytest.raises(ValueError, match=re.escape(says)):
        config.check_numbers(dataclasses.replace(filled, **{field: past}))


@pytest.mark.parametrize(
    "field",
    [
        "beta",
        "lambda_reg",
        "lambda_fusion",
        "alpha_cls",
        "lr",
        "warmup_lr",
        "weight_decay",
        "crop_scale",
    ],
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_each_float_flag_must_be_finite_and_is_named(field, value):
    """Wrong rules ruled out: a NaN let through (every comparison with NaN is False, so a range
    check alone passes or fails by accident), and a message naming another flag."""
    filled = config.resolve(dear.Config(dataset="eurosat"))
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{flag} must be a finite number, got {value}$"):
        config.check_numbers(dataclasses.replace(filled, **{field: value}))


def enospc_for(name, real):
    def save(obj, path, *a, **k):
        if os.path.basename(path) == name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path, *a, **k)

    return save


@pytest.mark.parametrize("name", ["checkpoint.pt", "results.json"])
def test_a_full_disk_names_the_file_and_the_fix(world, tmp_path, capsys, monkeypatch, name):
    """Wrong rule ruled out: OSError [Errno 28] as a traceback with no path."""
    roles = write_roles(tmp_path / "roles.json", world[1])
    # the checkpoints
    monkeypatch.setattr(train, "atomic_save", enospc_for(name, train.atomic_save))
    monkeypatch.setattr(runs, "atomic_save", enospc_for(name, runs.atomic_save))  # config, results
    # the folder's split, written (and said) once, first
    runs.build_dataset(world[2], str(world[0]))
    capsys.readouterr()
    err = stop_message(
        cli(world, tmp_path / "runs", "--protocol", "fewshot", "--roles", roles), capsys
    )
    assert (
        name in err
        and "no space left" in err
        and "MB needed" in err
        and len(err.strip().splitlines()) == 1
    )
    assert ("--resume" in err) == (name == "checkpoint.pt")


def test_a_folder_name_over_the_limit_is_called_too_long(world, tmp_path, capsys, monkeypatch):
    """Wrong rule ruled out: ENAMETOOLONG answered with "choose a writable --out". A long variant is
    cut and hashed instead (the consumer test below has one); a long dataset folder name cannot be.
    """
    import shutil

    long_folder = tmp_path / ("d" * 245)  # a legal name; its run folder tag adds to it
    shutil.copytree(world[0] / "colors", long_folder)
    no_training(monkeypatch)
    args = cli(world, tmp_path / "runs", "--dataset", f"folder:{long_folder}")
    err = stop_message(args, capsys)
    assert (
        "bytes, over the 255" in err and "writable" not in err and not (tmp_path / "runs").exists()
    )
    flags = {f: NON_DEFAULT[f] for f in runs.VARIANT_FIELDS if f != "attr_tokens"}
    rdir = runs.run_dir(dear.Config(dataset="eurosat", **flags))
    name = os.path.basename(rdir)
    assert len(name.encode()) <= 255 and "~" in name
    assert rdir != runs.run_dir(dear.Config(dataset="eurosat", **dict(flags, weight_decay=0.02)))


def test_a_comma_in_an_xd_target_path_and_repeated_targets(world, tmp_path):
    """Wrong rule ruled out: --targets split at every comma, so a folder with a comma cannot be a
    target."""
    import shutil

    odd = tmp_path / "a,b"
    shutil.copytree(world[0] / "colors", odd)
    cfg = dear.parse_args(
        cli(
            world,
            tmp_path / "r",
            "--protocol",
            "xd",
            "--targets",
            f"folder:{odd}",
            "--targets",
            "dtd,eurosat",
        )
    )
    assert runs.xd_targets(cfg) == [f"folder:{odd}", "dtd", "eurosat"]
    cfg = dataclasses.replace(cfg, targets=[f"folder:{odd}"])
    _, evals = runs.build_eval_sets(dear.resolve(cfg))
    assert [ds.name for ds, _, _ in evals][1:] == [f"folder:{odd}"]
    # one string: as before
    code = dear.parse_args(["--protocol", "xd", "--targets", "dtd,eurosat"])
    assert runs.xd_targets(code) == runs.xd_targets(
        dataclasses.replace(code, targets="dtd,eurosat")
    )


def test_a_missing_xd_target_stops_with_one_line(world, tmp_path, capsys, monkeypatch):
    """Wrong rule ruled out: a missing target skipped (or listed over many lines)."""
    roles = write_roles(tmp_path / "roles.json", world[1])
    no_training(monkeypatch)
    err = stop_message(
        xd_args(world, tmp_path / "runs", roles, f"folder:{tmp_path / 'gone'}", "dtd"), capsys
    )
    assert len(err.strip().splitlines()) == 1 and "2 xd target dataset(s) missing" in err
    assert f"folder:{tmp_path / 'gone'}" in err and "dtd" in err and "--targets" in err


LOCK_HOLDER = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import runs
runs.RunLock(sys.argv[2]).__enter__()
child = os.fork()  # a data-loading worker, say
if child == 0:
    time.sleep(60)
    os._exit(0)
open(sys.argv[3], "w").write(str(child))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_lock_dies_with_its_process_not_with_its_workers(tmp_path):
    """Wrong rule ruled out: an flock shared with forked workers, which an orphaned worker keeps
    after the run's process was SIGKILLed, so the rerun is refused naming a dead pid."""
    rdir, pidfile = tmp_path / "run", tmp_path / "child"
    rdir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", LOCK_HOLDER, ROOT, str(rdir), str(pidfile)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL
    child = int(pidfile.read_text())
    try:
        os.kill(child, 0)  # the orphaned worker is still alive ...
        with runs.RunLock(str(rdir)):  # ... and the folder is free
            pass
    finally:
        os.kill(child, signal.SIGKILL)


# --------------------------------------------------------------------- issue 25: newcomer friction


def test_a_run_folder_has_roles_md_and_png_and_the_json_line_has_hm(world, tmp_path, capsys):
    roles = write_roles(tmp_path / "roles.json", world[1])
    dear.main(cli(world, tmp_path / "runs", "--epochs", "1", "--roles", roles))
    results, done = only_result(tmp_path / "runs")
    assert (results.parent / "roles.md").read_text().strip() and (
        results.parent / "roles.png"
    ).stat().st_size
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["hm"] == round(done["hm"], 2) and len(line) == 3


def test_help_names_the_environment(capsys):
    with pytest.raises(SystemExit):
        dear.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "CLIP_CACHE" in out and "DEAR_CACHE" in out and "DATA" in out


def test_zero_shot_runs_are_named_without_the_training_schedule(tmp_path):
    """Wrong rule ruled out: a zero-shot run named (and compared) by an --epochs it never uses."""
    plain = dear.Config(dataset="eurosat", method="zeroshot", out=str(tmp_path))
    for flags in ({"epochs": 1}, {"lr": 0.01, "batch_size": 8}, {"lambda_reg": 0.3}):
        assert runs.run_dir(dataclasses.replace(plain, **flags)) == runs.run_dir(plain)
        assert (
            runs.differences(
                dataclasses.asdict(dataclasses.replace(plain, **flags)), dataclasses.asdict(plain)
            )
            == []
        )
    assert "zeroshot-default-" in runs.run_dir(plain)
    assert runs.run_dir(dataclasses.replace(plain, precision="bf16")) != runs.run_dir(plain)


def test_the_toy_pretraining_is_logged_into_the_run(world, tmp_path, monkeypatch):
    """Wrong rule ruled out: toyworld's pretraining lines go to stdout only (log=print)."""

    def ensure_pretrained(cache_dir, log=print, **kw):  # stands in for the 2-minute pretraining
        if log:
            log("Pretraining the toy CLIP once (stand-in)")
        # with the SHA256 record a real pretraining writes beside it
        path = str(tmp_path / "toy.pt")
        with open(world[1], "rb") as f:
            payload = f.read()
        with open(path, "wb") as f:
            f.write(payload)
        with open(toyworld.sha256_file(path), "w") as f:
            f.write(f"{clip.sha256_of(path)}  toy.pt\n")
        return path

    monkeypatch.setattr(toyworld, "ensure_pretrained", ensure_pretrained)
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "cache"))
    roles = write_roles(tmp_path / "roles.json", "toy")
    dear.main(cli(world, tmp_path / "runs", "--backbone", "toy", "--method", "zeroshot"))
    dear.main(cli(world, tmp_path / "runs", "--backbone", "toy", "--roles", roles, "--epochs", "1"))
    for log in (tmp_path / "runs").rglob("log.txt"):
        assert "Pretraining the toy CLIP once" in log.read_text()


# ----------------------------------------------------------------------- issue 21, theme 1: wiring

# Every Config field and where a test shows it reaches its consumer (the guard below fails on a
# field that is in no list): a new field needs a test and a line here.
CONSUMERS = {
    "dataset": "test_dear.test_cli_b2n_end_to_end (the folder dataset's splits)",
    "root": "test_runs.test_a_finished_run_is_reused_only_when_its_config_matches",
    "protocol": "test_dear.test_cli_xd_records_the_beta_of_every_evaluation",
    "method": "test_dear.test_cli_b2n_end_to_end (zeroshot: no fusion weights)",
    "shots": "test_runs.test_roles_are_pinned_to_the_run_and_eval_only_uses_them (train_shots)",
    "targets": "test_a_comma_in_an_xd_target_path_and_repeated_targets",
    "backbone": "test_roles_computed_for_another_checkpoint_are_refused (the file loaded)",
    "roles": "test_runs.test_roles_are_pinned_to_the_run_and_eval_only_uses_them",
    "target_beta": "test_dear.test_cli_xd_records_the_beta_of_every_evaluation",
    "eval_batch_size": "test_bad_flags_stop_before_any_work",
    **{
        f: "test_every_setting_reaches_its_consumer"
        for f in (
            "seed",
            "J",
            "beta",
            "lambda_reg",
            "lambda_fusion",
            "alpha_cls",
            "rep_dim",
            "mask",
            "novel_logits",
            "roles_control",
            "epochs",
            "batch_size",
            "warmup_epochs",
            "crop_scale",
            "lr",
            "warmup_lr",
            "weight_decay",
            "precision",
        )
    },
    "attr_tokens": "test_dear.test_without_tokens_equals_frozen_clip",
    "eval_precision": "test_precision.test_evaluate_runs_in_fp32_unless_asked (dtypes inside "
    "evaluate); test_runs.test_the_precision_used_is_part_of_a_runs_identity",
}


def test_every_config_field_keeps_runs_apart_or_says_why_not():
    """The guard: a new Config field must name the folder, be compared before reuse, or be
    bookkeeping with a reason; and unless it is bookkeeping, a test must show it reaches its
    consumer."""
    fields = [f.name for f in dataclasses.fields(config.Config)]
    kept_apart = (
        set(runs.NAME_FIELDS) | set(runs.VARIANT_FIELDS) | set(runs.BY_CONTENT) | set(runs.COMPARED)
    )
    for name in fields:
        assert (name in kept_apart) != (name in runs.BOOKKEEPING), name  # exactly one of the two
        assert name in runs.BOOKKEEPING or name in CONSUMERS, (
            f"{name}: no test shows it reaches its consumer"
        )
    assert all(len(why) > 20 for why in runs.BOOKKEEPING.values())
    compared = runs.comparable({name: 0 for name in fields})
    assert set(compared) == set(fields) - set(runs.BOOKKEEPING) - set(runs.BY_CONTENT)


# A distinct non-default value for every field that names a variant (one that no default shares).
NON_DEFAULT = {
    "backbone": "ViT-L/14",
    "J": 7,
    "beta": 0.35,
    "lambda_reg": 0.3,
    "lambda_fusion": 2.0,
    "alpha_cls": 0.6,
    "rep_dim": 24,
    "mask": "generalization-only",
    "attr_tokens": False,
    "novel_logits": "cls",
    "target_beta": "source",
    "epochs": 3,
    "batch_size": 3,
    "lr": 0.004,
    "crop_scale": 0.7,
    "precision": "bf16",
    "eval_precision": "fp16",
    "roles_control": "random",
    "warmup_epochs": 2,
    "warmup_lr": 2e-4,
    "weight_decay": 0.01,
}


@pytest.mark.parametrize("field", runs.VARIANT_FIELDS)
def test_each_method_setting_changes_the_run_folder(field, tmp_path):
    base = dear.Config(dataset="eurosat", out=str(tmp_path))
    other = dataclasses.replace(base, **{field: NON_DEFAULT[field]})
    assert runs.run_dir(other) != runs.run_dir(base)
    compared = (
        [] if field in runs.BY_CONTENT else [(field, NON_DEFAULT[field], getattr(base, field))]
    )
    assert runs.differences(dataclasses.asdict(other), dataclasses.asdict(base)) == compared


def test_every_setting_reaches_its_consumer(world, tmp_path, monkeypatch):
    """One b2n run with distinct non-default values; each consumer sees its own value (a swap of any
    two, or a default left in place, changes what is seen). The loss is checked against a hand
    computation: CE + 0.3 * (reg_img + reg_txt) + 2.0 * fusion (both weights 1.0 could not tell them
    apart)."""
    seen = {"lr": [], "batches": [], "logits": [], "precision": set()}
    real_adamw, real_transform, real_batches = (
        torch.optim.AdamW,
        train.data.train_transform,
        train.epoch_batches,
    )
    real_lr_at, real_evaluate, real_train = train.lr_at, runs.evaluate, runs.train

    def adamw(params, **kw):
        seen["adamw"] = kw
        return real_adamw(params, **kw)

    def transform(size, min_scale):
        seen["crop_scale"] = min_scale
        return real_transform(size, min_scale=min_scale)

    def batches(n, batch_size, seed):
        seen["batches"].append((batch_size, seed))
        return real_batches(n, batch_size, seed)

    def lr_at(epoch, cfg):
        seen["lr"].append((epoch, real_lr_at(epoch, cfg)))
        return seen["lr"][-1][1]

    def evaluate(model, items, classnames, template, cfg, *a, logits="fused", **kw):
        seen["logits"].append(logits)
        seen["precision"].add(("eval", cfg.precision))
        return real_evaluate(model, items, classnames, template, cfg, *a, logits=logits, **kw)

    def training(model, ds, cfg, device, rdir, log, loss_fn):
        seen["loss_fn"] = loss_fn
        seen["precision"].add(("train", cfg.precision))
        return real_train(model, ds, cfg, device, rdir, log, loss_fn)

    def make_model(clip_model, roles, cfg):
        seen["model"], seen["roles"] = dear.make_model(clip_model, roles, cfg), roles
        return seen["model"]

    monkeypatch.setattr(torch.optim, "AdamW", adamw)
    monkeypatch.setattr(train.data, "train_transform", transform)
    monkeypatch.setattr(train, "epoch_batches", batches)
    monkeypatch.setattr(train, "lr_at", lr_at)
    monkeypatch.setattr(runs, "evaluate", evaluate)
    monkeypatch.setattr(runs, "train", training)
    roles_file = write_roles(tmp_path / "roles.json", world[1])
    flags = [
        "--seed",
        "7",
        "--J",
        "3",
        "--beta",
        "0.35",
        "--lambda-reg",
        "0.3",
        "--lambda-fusion",
        "2.0",
        "--alpha-cls",
        "0.6",
        "--rep-dim",
        "24",
        "--mask",
        "generalization-only",
        "--novel-logits",
        "cls",
        "--roles-control",
        "random",
        "--epochs",
        "3",
        "--batch-size",
        "3",
        "--warmup-epochs",
        "2",
        "--crop-scale",
        "0.7",
        "--lr",
        "0.004",
        "--warmup-lr",
        "2e-4",
        "--weight-decay",
        "0.01",
        "--precision",
        "bf16",
        "--roles",
        roles_file,
    ]
    runs.run(dear.parse_args(cli(world, tmp_path / "runs", *flags)), make_model, dear.make_loss)
    model = seen["model"]
    # the model: J, beta, rep_dim, the initial alpha_cls, the mask variant over the seeded control
    # roles
    file_roles = entropy.load_roles(roles_file)
    assert seen["roles"] == entropy.control_roles({l: file_roles[l] for l in (3, 4)}, "random", 7)
    assert model.J == 3 and model.tokens.R.shape == (K, 24)
    P = model.clip.visual.num_patches
    assert torch.equal(model.mask_0, role_mask(seen["roles"][3], P, "generalization-only"))
    assert not torch.equal(model.mask_0, role_mask(seen["roles"][3], P, "role"))
    # the optimiser and the schedule: 2 warm-up epochs at 2e-4, then the cosine from 0.004 over 3
    # epochs
    assert seen["adamw"]["weight_decay"] == 0.01 and seen["adamw"]["lr"] == 0.004
    assert dict(seen["lr"]) == {0: 2e-4, 1: 2e-4, 2: pytest.approx(0.004 * (1 + math.cos(0)) / 2)}
    assert seen["crop_scale"] == 0.7
    assert [s for b, s in seen["batches"] if s >= 7000] == [7000, 7001, 7002]  # seed * 1000 + epoch
    assert {b for b, _ in seen["batches"]} == {3}
    assert seen["logits"] == ["fused", "cls"] and seen["precision"] == {
        ("train", "bf16"),
        ("eval", "bf16"),
    }
    assert model.beta == 0.35  # b2n: both evaluations with the run's beta
    results, done = only_result(tmp_path / "runs")
    # cut, recorded whole
    assert "weight_decay-0.01" in done["variant"] and "~" in results.parent.name
    # the loss through the run's own loss_fn, on hand-set features and fusion weights
    torch.manual_seed(0)
    out = {
        "fused": torch.randn(4, 3),
        "f_cls": torch.randn(4, 8),
        "f0": torch.randn(4, 8),
        "t": torch.randn(3, 8),
    }
    labels = torch.tensor([0, 2, 1, 2])
    stub = types.SimpleNamespace(
        t0=torch.randn(3, 8), alpha=lambda: torch.tensor([0.55, 0.2, 0.1, 0.1, 0.05])
    )
    total, parts = seen["loss_fn"](stub, out, labels)
    cos = lambda a, b: (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))  # noqa: E731
    ce = F.cross_entropy(out["fused"], labels).item()
    reg = (1 - cos(out["f_cls"], out["f0"]).mean() + 1 - cos(out["t"], stub.t0).mean()).item()
    fusion = -math.log(0.55)
    assert total.item() == pytest.approx(ce + 0.3 * reg + 2.0 * fusion, rel=1e-5)
    # the weights swapped
    assert total.item() != pytest.approx(ce + 2.0 * reg + 0.3 * fusion, rel=1e-3)


def test_eval_only_carries_the_model_settings_and_the_roles_seed(world, tmp_path, monkeypatch):
    """Wrong rule ruled out: --eval-only rebuilds the model from the evaluation's own flags (the
    defaults) or shuffles --roles-control random by the evaluation's --seed instead of the run's."""
    built = []

    def make_model(clip_model, roles, cfg):
        built.append((roles, dataclasses.replace(cfg)))
        return dear.make_model(clip_model, roles, cfg)

    roles_file = write_roles(tmp_path / "roles.json", world[1])
    trained = cli(
        world,
        tmp_path / "runs",
        "--protocol",
        "fewshot",
        "--epochs",
        "1",
        "--seed",
        "7",
        "--beta",
        "0.35",
        "--rep-dim",
        "24",
        "--alpha-cls",
        "0.6",
        "--mask",
        "generalization-only",
        "--roles-control",
        "random",
        "--roles",
        roles_file,
    )
    runs.run(dear.parse_args(trained), make_model, dear.make_loss)
    results, _ = only_result(tmp_path / "runs")
    evaluated = cli(
        world,
        tmp_path / "runs",
        "--protocol",
        "fewshot",
        "--eval-only",
        "--load",
        str(results.parent),
        "--seed",
        "2",
    )
    runs.run(dear.parse_args(evaluated), make_model, dear.make_loss)
    (roles_a, a), (roles_b, b) = built
    assert roles_b == roles_a
    carried = ("J", "beta", "rep_dim", "alpha_cls", "mask", "roles_control", "seed", "backbone")
    assert {f: getattr(b, f) for f in carried} == {f: getattr(a, f) for f in carried}
    assert (b.beta, b.rep_dim, b.seed) == (0.35, 24, 7)


def test_resume_refuses_other_settings(world, tmp_path, capsys, monkeypatch):
    """--resume carries the run's settings: an interrupted run resumes only under its own config (a
    field in the name goes to another folder; one compared by value is refused)."""
    roles = write_roles(tmp_path / "roles.json", world[1])
    args = cli(world, tmp_path / "runs", "--protocol", "fewshot", "--roles", roles)

    def interrupted(model, ds, cfg, device, rdir, log, loss_fn):
        torch.save({"model": {}}, os.path.join(rdir, "checkpoint.pt"))
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "train", interrupted)
    stop_message(args, capsys, code=130)
    (config_path,) = (tmp_path / "runs").rglob("config.json")
    saved = json.loads(config_path.read_text())
    saved["crop_scale"] = 0.9
    config_path.write_text(json.dumps(saved))
    err = stop_message(args + ["--resume"], capsys)
    assert "interrupted run of a different configuration" in err and "crop_scale" in err


# --------------------------------------------------------------------- issue 21, theme 4: identity


def test_a_file_rewritten_in_place_gets_its_new_hash(tmp_path, monkeypatch):
    """Wrong rule ruled out: a hash cached by (path, size, mtime): a same-size rewrite within the
    clock's granularity (mtime set back here) keeps the old hash. Every hash is remembered here
    (FRESH_S)."""
    monkeypatch.setattr(runs, "FRESH_S", -math.inf)
    path = tmp_path / "model.pt"
    path.write_bytes(b"A" * 64)
    first = runs.file_sha256(str(path))
    stamp = os.stat(path)
    time.sleep(0.05)  # past one tick of the kernel's coarse clock, which stamps ctime
    with open(path, "r+b") as f:  # in place: the same inode and size
        f.write(b"B" * 64)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # and the same mtime
    assert (os.stat(path).st_ino, os.stat(path).st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns)
    assert runs.file_sha256(str(path)) != first


def test_a_fresh_file_is_never_remembered(tmp_path):
    """Within FRESH_S of its last change a file may change again unseen, even its ctime:
    not cached."""
    path = tmp_path / "roles.json"
    path.write_text("{}")
    runs.file_sha256(str(path))
    assert not any(k[0] == str(path) for k in runs._sha_cache)


def test_a_field_only_one_side_has_is_a_difference():
    """Wrong rule ruled out: a.get(k) != b.get(k), which takes a missing field for None."""
    assert runs.differences({"lr": 0.1, "crop_scale": None}, {"lr": 0.1}) == [
        ("crop_scale", None, runs.ABSENT)
    ]
    assert runs.differences({"lr": 0.1}, {"lr": 0.1, "new_knob": None}) == [
        ("new_knob", runs.ABSENT, None)
    ]
    # bookkeeping is not compared
    assert runs.differences({"lr": 0.1, "out": "a"}, {"lr": 0.1}) == []


def test_force_starts_over_with_the_current_roles(world, tmp_path, monkeypatch):
    """Wrong rule ruled out: --force reusing the run's pinned roles.json instead of the roles of
    now."""
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "cache"))
    model, _ = runs.load_clip(world[1], "cpu")
    cached = runs.entropy.default_roles_path(
        model, [3, 4], runs.clip.cache_dir(), world[2], split="train", pool=None
    )
    os.makedirs(os.path.dirname(cached))
    write_roles(__import__("pathlib").Path(cached), model.name)
    args = cli(world, tmp_path / "runs", "--protocol", "fewshot", "--epochs", "1")
    dear.main(args)
    # the cache holds new roles
    write_roles(__import__("pathlib").Path(cached), model.name, flip=True)
    dear.main(args + ["--force"])
    _, done = only_result(tmp_path / "runs")
    assert done["roles_used"]["sha256"] == runs.file_sha256(cached)


def test_without_imagenet_the_roles_probe_is_the_training_split(world, tmp_path, monkeypatch):
    """Wrong rule ruled out: the fallback probe reads the run's own test images."""
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "cache"))
    asked = []

    def compute(backbone, probe, root, split, **kw):
        asked.append((probe, split))
        raise ValueError("stop here")

    monkeypatch.setattr(runs.entropy, "run", compute)
    model, _ = runs.load_clip(world[1], "cpu")
    cfg = dear.resolve(dear.Config(dataset=world[2], root=str(world[0]), backbone=world[1], J=3))
    with pytest.raises(runs.RunError):
        runs.load_roles(cfg, model, torch.device("cpu"), log=lambda msg: None)
    assert asked == [(world[2], "train")]


# ---------------------------------------------------------------- the reuse checks, one by one


def test_zero_shot_configs_compare_only_what_a_zero_shot_run_depends_on():
    """Wrong rule ruled out: for a zero-shot run, comparing by ZEROSHOT_IGNORES alone (the
    bookkeeping fields then count); the schedule is ignored, the precision is not."""
    a = dataclasses.asdict(dear.Config(method="zeroshot"))
    b = dict(a, out="elsewhere", workers=7, eval_batch_size=3, epochs=9, lr=0.5)
    assert runs.differences(a, b) == []
    assert runs.differences(a, dict(a, precision="bf16")) == [("precision", "amp", "bf16")]


def test_targets_written_as_a_string_compare_as_their_list():
    """A Config made in code holds targets "a,b"; config.json from the command line holds the list.
    Wrong rules ruled out: the string compared as is, split on spaces, or kept under another key."""
    assert runs.comparable({"targets": "dtd,eurosat"}) == {"targets": ["dtd", "eurosat"]}
    assert runs.comparable({"targets": ""}) == {"targets": []}
    assert runs.differences({"targets": "dtd,eurosat"}, {"targets": ["dtd", "eurosat"]}) == []
    assert runs.differences({"targets": "dtd"}, {"targets": ["dtd", "eurosat"]}) == [
        ("targets", ["dtd"], ["dtd", "eurosat"])
    ]


def test_check_same_names_up_to_four_differences_and_the_fixes(tmp_path):
    rdir = str(tmp_path)
    with pytest.raises(runs.RunError) as e:
        runs.check_same(rdir, {}, "finished")  # no config.json
    assert str(e.value) == (
        f"{rdir} holds a finished run but no readable config.json, so it cannot be told apart "
        "from another run; choose another --out, or pass --force to redo it"
    )
    now = {"beta": 0.1, "epochs": 1, "J": 2, "lr": 0.1, "seed": 1}
    four = dict(now, beta=0.2, epochs=2, J=3, lr=0.2)
    with pytest.raises(runs.RunError) as e:
        runs.check_same(rdir, now, "finished", saved=four)
    assert str(e.value) == (
        f"{rdir} holds a finished run of a different configuration (J: 3 there, 2 now; "
        "beta: 0.2 there, 0.1 now; epochs: 2 there, 1 now; lr: 0.2 there, 0.1 now); choose "
        "another --out to keep both, or pass --force to replace it (its results are deleted)"
    )
    with pytest.raises(runs.RunError) as e:  # a fifth: named by "...", not shown
        runs.check_same(rdir, now, "finished", saved=dict(four, seed=2))
    assert "lr: 0.2 there, 0.1 now; ...); choose another --out" in str(e.value)
    assert "seed" not in str(e.value)


def test_finished_reuses_only_results_beside_their_own_config(tmp_path, capsys):
    """results.json beside a checkpoint, unreadable, or made with another config (in config.json or
    in its own identity record): one line each, naming the finished run and the fix."""
    rdir = tmp_path / "run"
    rdir.mkdir()
    results, ckpt = rdir / "results.json", rdir / "checkpoint.pt"
    config = {"lr": 0.1, "seed": 1}
    (rdir / "config.json").write_text(json.dumps(config))

    def stop():
        with pytest.raises(runs.RunError) as e:
            runs.finished(str(rdir), str(results), str(ckpt), config)
        return str(e.value)

    results.write_text("{not json")
    assert stop() == f"{results} is not readable; delete it, or pass --force to redo it"
    results.write_text(json.dumps({"identity": dict(config, lr=0.2), "evals": {}}))
    assert stop().startswith(f"{rdir} holds a finished run of a different configuration (lr: 0.2")
    ckpt.write_bytes(b"")
    assert stop() == (
        f"{rdir} holds results.json beside an interrupted run's checkpoint.pt (an interrupted "
        "restart?), so its results may be another run's; pass --force to start it over"
    )
    ckpt.unlink()
    (rdir / "config.json").write_text(json.dumps(dict(config, seed=2)))
    assert stop().startswith(f"{rdir} holds a finished run of a different configuration (seed: 2")
    (rdir / "config.json").write_text(json.dumps(config))
    results.write_text(json.dumps({"identity": config, "evals": {}}))
    assert runs.finished(str(rdir), str(results), str(ckpt), config)["evals"] == {}
    assert capsys.readouterr().out == f"done already: {results} (pass --force to redo)\n"


# Mutation testing: `./mutate.sh runs.py` (its scope: the identity, naming and reuse checks) and
# `./mutate.sh config.py check_numbers` leave no survivor, so no equivalent mutant is listed here.

"""dear.py's recipe, training loop, run folder and command line, on a tiny CLIP and a small
folder dataset."""

import collections
import dataclasses
import fcntl
import hashlib
import itertools
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import time
import types

import pytest
import torch
import torchvision

import clip
import data
import dear
import entropy
import predict
import runs
from conftest import CLASSES, ROOT

def argv(world, out, extra=""):
    return ["--dataset", f"folder:{world / 'shapes'}", "--root", str(world), "--backbone",
            str(world / "tiny.pt"), "--out", str(out), "--shots", "4", "--epochs", "2",
            "--batch-size", "4", "--workers", "0", "--J", "3"] + shlex.split(extra)


def folder_of(args):
    c = dear.settings(*dear.parse_args(args))
    return runs.run_dir(c, dear.changed_flags(c))[0]


def run(world, out, extra="", capsys=None):
    results = dear.main(argv(world, out, extra))
    return results, folder_of(argv(world, out, extra))


def logged(rdir):
    """(epoch, step, skipped, eta) of each training line in a run's log.txt."""
    line = (r"epoch (\d+)/\d+ step (\d+)/\d+ loss \S+ ce \S+ lr [\d.e+-]+(?: skipped (\d+))?"
            r" eta (\d+)s$")
    log = open(os.path.join(rdir, "log.txt")).read()
    return [tuple(int(v or 0) for v in m) for m in re.findall(line, log, re.M)]


DROP = object()  # an edit that deletes the key


def edit_json(path, keys, value):
    """The value at keys in the JSON file at path set to value (DROP: deleted)."""
    doc = inner = json.loads(path.read_text())
    for k in keys[:-1]:
        inner = inner[k]
    inner[keys[-1]] = value
    if value is DROP:
        del inner[keys[-1]]
    path.write_text(json.dumps(doc))


def fails(capsys, words, args, main=dear.main):
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and words in err, err
    return err


def test_b2n_run_writes_its_folder_and_reuses_it_only_for_its_own_config(world, tmp_path, capsys):
    results, rdir = run(world, tmp_path)
    last = {e["dataset"] + "/" + e["split"]: round(e["accuracy"], 2) for e in results["evals"]}
    last["hm"] = round(results["hm"], 2)
    assert capsys.readouterr().out.splitlines()[-1] == json.dumps(last)  # the run's one line
    assert results["train_shots"] == [4] * 6  # 4 images of each of the 6 base classes
    b, n = (e["accuracy"] for e in results["evals"])
    assert [e["split"] for e in results["evals"]] == ["base", "novel"]
    assert results["hm"] == pytest.approx(2 * b * n / (b + n))
    for name in ("config.json", "roles.json", "roles.md", "roles.png", "mask.png", "log.txt",
                 "model.pt", "results.json"):
        assert os.path.isfile(os.path.join(rdir, name)), name
    assert not os.path.exists(os.path.join(rdir, "checkpoint.pt"))
    env = results["env"]
    git = [subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout.strip()
           for a in (["rev-parse", "HEAD"], ["status", "--porcelain"])]  # outside git: None, False
    cpus = [line.split(":")[1].strip() for line in open("/proc/cpuinfo") if "model name" in line]
    assert (env["torchvision"], env["cuda"], env["git_commit"], env["git_dirty"]) == (
        torchvision.__version__, torch.version.cuda, git[0] or None, bool(git[1]))
    assert env["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else cpus[0])
    assert env["torch"] in open(os.path.join(rdir, "log.txt")).readline()
    assert (results["inputs"]["roles_sha256"] == hashlib.sha256(open(os.path.join(rdir,
            "roles.json"), "rb").read()).hexdigest())
    capsys.readouterr()
    again, _ = run(world, tmp_path)
    assert "done already" in capsys.readouterr().out and again == results
    # the same folder recorded with another checkpoint: named, refused, not reused
    config, saved = pathlib.Path(rdir, "config.json"), pathlib.Path(rdir, "results.json")
    edit_json(config, ("inputs", "backbone_sha256"), "0" * 64)
    fails(capsys, "backbone_sha256", argv(world, tmp_path))
    edit_json(saved, ("evals", 0, "accuracy"), 150.0)
    edit_json(config, ("inputs",), again["inputs"])
    fails(capsys, "= 150.0 is not a number in [0, 100]", argv(world, tmp_path))
    forced, _ = run(world, tmp_path, "--force")  # clears the folder, and runs again
    assert "done already" not in capsys.readouterr().out and forced["evals"] == results["evals"]


# ------------------------------------------------------------------------------ wiring


def watch(monkeypatch):
    """What each run handed its consumers: the built models (and their state when built), the
    optimiser's group at every step, the loss's weights and beta, every DataLoader, the dtype of
    the first vision MLP's output in training and evaluation, every evaluation."""
    seen = collections.defaultdict(list)
    real_model, real_loss, real_evaluate = dear.DeAR, dear.dear_loss, dear.evaluate

    def model(*args, **kwargs):
        m = real_model(*args, **kwargs)
        seen["model"].append(m)
        seen["init"].append({k: v.clone() for k, v in m.trainable_state().items()})
        fc = m.clip.visual.transformer.resblocks[0].mlp.c_fc
        set_classes, encode_classes = m.set_classes, m.encode_classes
        m.set_classes = lambda *a: seen["classes"].append(a) or set_classes(*a)
        m.encode_classes = lambda: seen["encodes"].append(m.training) or encode_classes()
        fc.register_forward_hook(lambda mod, i, out: seen["dtype", m.training].append(out.dtype))
        return m

    class AdamW(torch.optim.AdamW):
        def step(self, *args, **kwargs):
            seen["step"].append({k: v for k, v in self.param_groups[0].items() if k != "params"})
            return super().step(*args, **kwargs)

    class DataLoader(torch.utils.data.DataLoader):
        def __init__(self, dataset, *args, **kwargs):
            seen["loader"].append((dataset, kwargs))
            super().__init__(dataset, *args, **kwargs)

    def loss(out, labels, t0, alpha, lambda_reg, lambda_fusion):
        seen["loss"].append((lambda_reg, lambda_fusion, seen["model"][-1].beta))
        return real_loss(out, labels, t0, alpha, lambda_reg, lambda_fusion)

    def evaluate(model, ds, split, c, rule="fused", *args):
        encodes, out = len(seen["encodes"]), real_evaluate(model, ds, split, c, rule, *args)
        seen["eval"].append(dict(rule=rule, beta=model.beta, classes=ds.classnames, items=ds.test,
                                 template=ds.template, readouts=out["readouts"],
                                 encodes=len(seen["encodes"]) - encodes))
        return out

    monkeypatch.setattr(dear, "DeAR", model)
    monkeypatch.setattr(torch.optim, "AdamW", AdamW)
    monkeypatch.setattr(torch.utils.data, "DataLoader", DataLoader)
    monkeypatch.setattr(dear, "dear_loss", loss)
    monkeypatch.setattr(dear, "evaluate", evaluate)
    return seen


spy = pytest.fixture(watch, name="spy")
loaders = lambda seen, kind: [(d, k) for d, k in seen["loader"] if type(d) is kind]
P = 16  # the tiny CLIP's patches
TRAIN = ("--shots 3 --seed 7 --J 4 --beta 0.35 --lambda-reg 0.3 --lambda-fusion 0.25 "
         "--alpha-cls 0.4 --rep-dim 16 --tokens mmrl --mask generalization-only --roles-control "
         "random --epochs 3 --batch-size 5 --warmup-epochs 2 --lr 0.002 --warmup-lr 0.0003 "
         "--weight-decay 0.02 --crop-scale 0.7 --eval-batch-size 7 --workers 1 --device cpu "
         "--precision bf16 --eval-precision bf16 --novel-logits cls")
# Every field of Config: where its value must arrive, observed there (in the objects the run built
# and handed on, not in a folder name): the observation, on the run with TRAIN's flags (r: its
# results, s: what the spy saw, w: the world, roles: the roles file's, by block).
WIRING = {
    "dataset": lambda r, s, w, roles: s["eval"][0]["classes"] == CLASSES[:6],
    "root": "test_bad_input_is_one_line_and_exit_2",
    "protocol": "test_xd_and_zero_shot_runs_read_their_own_flags",
    "method": "test_xd_and_zero_shot_runs_read_their_own_flags",
    "shots": lambda r, s, w, roles: len(loaders(s, dear.SeededImages)[0][0]) == 6 * 3,
    "seed": lambda r, s, w, roles: sorted(loaders(s, dear.SeededImages)[0][0].items) == sorted(
        data.build_dataset(f"folder:{w / 'shapes'}", "", 3, 7, "base").train) and torch.equal(
        s["init"][0]["R"], torch.randn(5, 16, generator=torch.Generator().manual_seed(7)) * 0.02),
    "backbone": lambda r, s, w, roles: s["model"][0].clip.sha256 == data.sha256_file(w / "tiny.pt"),
    "targets": "test_xd_and_zero_shot_runs_read_their_own_flags",
    "out": lambda r, s, w, roles: r["path"].startswith(r["out"]),
    "J": lambda r, s, w, roles: s["model"][0].blocks == range(3, 4),
    "beta": lambda r, s, w, roles: {b for _, _, b in s["loss"]} == {0.35},
    "lambda_reg": lambda r, s, w, roles: {x for x, _, _ in s["loss"]} == {0.3},
    "lambda_fusion": lambda r, s, w, roles: {x for _, x, _ in s["loss"]} == {0.25},
    "alpha_cls": lambda r, s, w, roles: abs(s["init"][0]["w"].softmax(0)[0] - 0.4) < 1e-6,
    "rep_dim": lambda r, s, w, roles: s["model"][0].R.shape == (5, 16),
    "tokens": lambda r, s, w, roles: s["model"][0].kind == "mmrl" and s["init"][0][
        "F_v.weight"].dim() == 3,
    "mask": lambda r, s, w, roles: torch.equal(s["model"][0].masks[0], dear.role_mask(
        s["model"][0].roles[0], P, "generalization-only")) and not torch.equal(
        s["model"][0].masks[0], dear.role_mask(s["model"][0].roles[0], P)),
    "attr_tokens": "test_xd_and_zero_shot_runs_read_their_own_flags",
    "novel_logits": lambda r, s, w, roles: [e["rule"] for e in s["eval"]] == ["fused", "cls"]
    and (e := r["evals"][1])["accuracy"] == e["readouts"]["class"] == pytest.approx(sum(
        p["accuracy"] * p["n"] for p in e["per_class"]) / e["n"]),  # over 3 batches of 7
    "target_beta": "test_xd_and_zero_shot_runs_read_their_own_flags",
    "roles": lambda r, s, w, roles: sorted(map(str, s["model"][0].roles[0])) == sorted(
        map(str, roles[4])),
    "roles_control": lambda r, s, w, roles: s["model"][0].roles[0] == entropy.control_roles(
        roles, "random", 7)[4] != roles[4],
    "epochs": lambda r, s, w, roles: len(s["step"]) == 3 * (18 // 5) == r["train"]["steps"]
    and r["train"]["skipped_steps"] == 0,  # bf16: nothing skips a step
    "batch_size": lambda r, s, w, roles: {len(b) for b in loaders(s, dear.SeededImages)[0][1][
        "batch_sampler"]} == {5},
    "warmup_epochs": lambda r, s, w, roles: [g["lr"] for g in s["step"][::3]] == [3e-4, 3e-4, 2e-3],
    "lr": lambda r, s, w, roles: s["step"][-1]["lr"] == 2e-3,
    "warmup_lr": lambda r, s, w, roles: s["step"][0]["lr"] == 3e-4,
    "weight_decay": lambda r, s, w, roles: {g["weight_decay"] for g in s["step"]} == {0.02},
    "crop_scale": lambda r, s, w, roles: loaders(s, dear.SeededImages)[0][0].transform.transforms[
        0].scale == (0.7, 1.0),
    "eval_batch_size": lambda r, s, w, roles: {k["batch_size"] for _, k in loaders(
        s, data.ImageList)} == {7} and [e["encodes"] for e in s["eval"]] == [1, 1],  # t once
    "workers": lambda r, s, w, roles: {k["num_workers"] for _, k in s["loader"]} == {1},
    "device": lambda r, s, w, roles: s["model"][0].w.device.type == "cpu",
    "precision": lambda r, s, w, roles: set(s["dtype", True]) == {torch.bfloat16},
    "eval_precision": lambda r, s, w, roles: set(s["dtype", False]) == {torch.bfloat16},
    "eval_only": "test_eval_only_predict_rebuild_a_run",
    "load": "test_eval_only_predict_rebuild_a_run",
    "resume": "test_resume_ends_as_an_uninterrupted_run_any_workers",
    "force": "test_b2n_run_writes_its_folder_and_reuses_it_only_for_its_own_config",
    "roles_only": "test_roles_only_writes_the_roles_of_its_J"}


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory):
    """The run with TRAIN's flags and a roles file set by hand: (results, run folder, what the spy
    saw, the roles file's roles)."""
    tmp = tmp_path_factory.mktemp("trained")
    # the tiny CLIP's roles file, its heads' roles set by hand: per block an attribute head of
    # colour, a generalization head, an attribute head of shape, a mixed head
    c = dear.settings(*dear.parse_args(argv(world, tmp)))
    doc = json.load(open(dear.build(c, lambda line: None)[1]))
    kinds = [("attribute", "color"), ("generalization", None), ("attribute", "shape"),
             ("mixed", None)]
    for e in doc["heads"]:
        e["role"], e["attribute"] = kinds[e["head"]]
    (tmp / "roles.json").write_text(json.dumps(doc))
    roles = entropy.load_roles(str(tmp / "roles.json"))
    args = argv(world, tmp / "out", f"{TRAIN} --roles {tmp / 'roles.json'}")
    with pytest.MonkeyPatch.context() as mp:
        seen = watch(mp)
        results = dear.main(args)
    rdir = folder_of(args)
    return dict(results, path=rdir, out=str(tmp / "out")), rdir, seen, roles


def test_every_setting_reaches_its_consumer(world, trained):
    """Every row of WIRING, in one test (the run is built once); a field without a row fails, a
    row that names a test points to one that exists."""
    assert set(WIRING) == set(dear.FIELDS)
    results, _, seen, roles = trained
    missed = [field for field, check in WIRING.items()
              if not (callable(globals().get(check)) if isinstance(check, str)
                      else check(results, seen, world, roles))]
    assert not missed
    # 3 steps an epoch: each one logged (steps // 2 = 1)
    assert [(e, s) for e, s, *_ in logged(trained[1])] == list(itertools.product((1, 2, 3),
                                                                                 (1, 2, 3)))


def test_xd_and_zero_shot_runs_read_their_own_flags(world, tmp_path, spy, monkeypatch):
    """--protocol xd: the source's "all" split and each --targets, each target at its table beta,
    or the source's with --target-beta source; --method zeroshot and --no-attr-tokens: frozen
    CLIP, nothing trained."""
    os.symlink(world / "shapes", tmp_path / "again")  # the same images, another dataset
    target = f"folder:{tmp_path / 'again'}"
    monkeypatch.setitem(dear.XD_TARGET_BETA, target, 0.15)
    xd = f"--protocol xd --epochs 1 --beta 0.6 --targets {target}"
    r = dear.main(argv(world, tmp_path, xd))
    assert [(e["dataset"], e["split"], e["beta"]) for e in r["evals"]] == [
        (f"folder:{world / 'shapes'}", "all", 0.6), (target, "all", 0.15)]
    assert [e["beta"] for e in spy["eval"]] == [0.6, 0.15]
    trained = next(d.items for d, _ in spy["loader"] if isinstance(d, dear.SeededImages))
    assert trained == data.build_dataset(r["evals"][0]["dataset"], "", 4, 1).train  # shots, seed
    dear.main(argv(world, tmp_path, xd + " --target-beta source"))
    assert [e["beta"] for e in spy["eval"][2:]] == [0.6, 0.6]
    steps = len(spy["step"])
    for flags in ("--method zeroshot", "--no-attr-tokens"):
        spy["model"].clear()
        args = argv(world, tmp_path, flags)
        if "zeroshot" in flags:  # it reads no training flag
            args = args[:8] + args[14:16] + args[18:]
            assert "--epochs" not in args and "--J" not in args
        r = dear.main(args)
        assert not spy["model"][0].use_tokens and len(spy["step"]) == steps
        assert r["train"] == (None if "zeroshot" in flags else {"steps": 0, "trainable": 0})
        assert r["inputs"]["roles_sha256"] is None  # no roles computed or read
        assert [(e["split"], e["beta"]) for e in r["evals"]] == [("base", None), ("novel", None)]
        # predict on it: the class logits alone, at weight 1 (and no model.pt to read)
        image = data.build_dataset(f"folder:{world / 'shapes'}", "").test[0][0]
        evidence = predict.main(["--load", folder_of(args), image])[0]["evidence"]
        assert list(evidence) == ["cls"] and evidence["cls"]["alpha"] == 1.0


def test_roles_only_writes_the_roles_of_its_J(world, tmp_path, capsys):
    dear.main(["--roles-only", "--backbone", str(world / "tiny.pt"), "--dataset",
               f"folder:{world / 'shapes'}", "--out", str(tmp_path), "--J", "4", "--workers", "0"])
    assert entropy.read_roles(str(tmp_path / "roles" / "J4" / "roles.json"))["layers"] == [4]
    assert capsys.readouterr().out.endswith(f"roles copied to {tmp_path / 'roles' / 'J4'}\n")


# every flag a call does not read (runs.READS) is refused, given at any value (its default too),
# with one line that names it
MODES = {"dear": "", "zeroshot": "--method zeroshot", "eval-only": "--eval-only --load RUN",
         "roles-only": "--roles-only"}
VALUES = dict(shots="3", seed="7", targets="dtd", J="4", beta="0.3", lambda_reg="0.3",
              rep_dim="16", roles="r.json", epochs="3", batch_size="5", warmup_epochs="2", lr="0.1",
              crop_scale="0.7", workers="1", backbone="b", load="RUN")


@pytest.mark.parametrize("mode", MODES)
def test_each_call_refuses_every_flag_it_does_not_read_whatever_its_value(mode):
    for name, f in dear.FIELDS.items():
        if name in ("method", "eval_only", "roles_only"):  # these choose the call
            continue
        for value in {VALUES.get(name), None if f.default is None else str(f.default)} - {None}:
            flag = dear.flag(name)
            cfg, given = dear.parse_args(shlex.split(MODES[mode]) + [flag] + [value] * (f.type
                                                                                   is not bool))
            xd = name in ("targets", "target_beta")
            if runs.reads(mode, name) and not xd:
                runs.refuse_unread(mode, given, cfg.protocol, dear.RECORDED)
                continue
            what = {"dear": "a DeAR run", "zeroshot": "--method zeroshot"}.get(mode, f"--{mode}")
            says = (" is read by --protocol xd only: drop it, or add it" if runs.reads(mode, name)
                    else f" is not read by {what}: (it takes the run's own|drop it)")
            with pytest.raises(data.UserError, match=re.escape(flag) + says + "$"):
                runs.refuse_unread(mode, given, cfg.protocol, dear.RECORDED)


# what a rebuilt model must carry from the run it loads: (the observation, on the rebuilt model m
# and the trained one t)
CARRIED = {
    "J, tokens, rep_dim": lambda m, t: (m.blocks, m.kind, m.R.shape) == (t.blocks, t.kind,
                                                                        t.R.shape),
    "beta": lambda m, t: m.beta == t.beta == 0.35,
    "roles (file, control, seed)": lambda m, t: m.roles == t.roles,
    "mask": lambda m, t: torch.equal(m.masks, t.masks),
    "weights": lambda m, t: all(torch.equal(v, t.trainable_state()[k])
                                for k, v in m.trainable_state().items())}


@pytest.mark.parametrize("mode", ["eval-only", "predict"])
def test_eval_only_predict_rebuild_a_run(world, trained, spy, tmp_path, capsys, monkeypatch, mode):
    """--eval-only evaluates the run's model with its logits rules on the call's dataset; predict
    names the run's classes (base and novel) in the run's template, or --classes; both mask with
    the run's own roles.json (the file it was given has gone)."""
    results, rdir, seen, _ = trained
    config = json.load(open(os.path.join(rdir, "config.json")))
    config["template"] = "a blurry photo of a {}."  # not the dataset's: read from the run
    data.write_json(os.path.join(rdir, "config.json"), config)
    os.rename(config["config"]["roles"], tmp_path / "moved.json")
    try:
        if mode == "eval-only":
            dear.main(["--dataset", f"folder:{world / 'shapes'}", "--root", str(world), "--workers",
                       "0", "--eval-only", "--load", str(rdir), "--force"])  # the rest from the run
            assert [e["rule"] for e in spy["eval"]] == ["fused", "cls"]
            assert spy["classes"][0][1] == "a photo of a {}."  # the dataset's own
        else:
            sheets = []
            monkeypatch.setattr(predict, "draw_explain", lambda *a: sheets.append(a))
            image = data.build_dataset(f"folder:{world / 'shapes'}", "").test[0][0]
            capsys.readouterr()
            report = predict.main(["--load", rdir, image, "--explain", "x.png"])
            out, err = capsys.readouterr()
            assert spy["classes"] == [(CLASSES, "a blurry photo of a {}.")]
            assert out.startswith(f"{image}: {report[0]['top5'][0][0]} ") and "wrote x.png" in err
            assert "\n  by logit set: cls " in out
            top = report[0]["top5"][0]
            titles, _, _, heads, roles, _, path = sheets[0]
            assert (titles, path) == ([f"{image}: {top[0]} {top[1]:.0%}"], "x.png")
            assert report[0]["image"] == image and len(report[0]["top5"]) == 5
            assert roles == spy["model"][0].roles[-1]  # the last block's, for the tiles' labels
            mixed = [h for h, r in enumerate(roles) if r["role"] == "mixed"]
            assert heads[1:] == [[h for h, r in enumerate(roles) if r["attribute"] == a] or mixed
                                 for a in dear.ATTRIBUTES]
            (tmp_path / "names.txt").write_text("red\ngreen\n")
            again = predict.main(["--load", rdir, image, "--classes",
                               str(tmp_path / "names.txt"), "--json"])
            assert spy["classes"][-1] == (["red", "green"], "a blurry photo of a {}.")
            assert json.loads(capsys.readouterr().out) == again
    finally:
        os.rename(tmp_path / "moved.json", config["config"]["roles"])
    for what, check in CARRIED.items():
        assert check(spy["model"][0], seen["model"][0]), what


def test_every_recorded_difference_stops_reuse_and_resume(world, trained, tmp_path, capsys):
    """A finished run is reused, an interrupted one resumed, only if everything recorded in
    config.json and results.json (config and inputs) equals the call's: each edit below is named
    in the refusal."""
    _, rdir, _, _ = trained
    roles = pathlib.Path(trained[0]["out"]).parent / "roles.json"
    args = argv(world, tmp_path / "out", f"{TRAIN} --roles {roles}")
    edits = [("config.json", "config", "beta", 0.5), ("config.json", "config", "seed", 2),
             ("config.json", "inputs", "dataset_folder", "/elsewhere"),
             ("config.json", "inputs", "roles_sha256", "0" * 64),
             ("results.json", "config", "lambda_reg", 9.0),
             ("results.json", "inputs", "backbone_sha256", "0" * 64)]
    for state, (file, group, key, value) in itertools.product(("finished", "interrupted"), edits):
        if state == "interrupted" and file == "results.json":
            continue
        copy = tmp_path / "out" / os.path.relpath(rdir, trained[0]["out"])
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        shutil.copytree(rdir, copy)
        if state == "interrupted":
            os.remove(copy / "results.json")
            (copy / "checkpoint.pt").write_bytes(b"")
        edit_json(copy / file, (group, key), value)
        fails(capsys, f"{group}.{key}: ", args + ["--resume"] * (state == "interrupted"))


def test_resume_ends_as_an_uninterrupted_run_any_workers(world, tmp_path, monkeypatch, capsys):
    """... and the log: steps 3 and 6 of 6 each epoch (every steps // 2), the ETA by the time per
    step so far times the steps left in this call, 0 s at its end."""
    clock = itertools.count(0, 100).__next__  # 100 s at each reading: the ETAs logged are exact
    for module in (dear, runs):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(time=clock,
                                                                  strftime=time.strftime))
    _, full = run(world, tmp_path / "a", "--epochs 3")
    etas = [500, 400, 300, 200, 100, 0]  # 100 s a reading: 100 k / (3 k) * (18 - 3 k)
    assert logged(full) == [(e, s, 0, eta) for (e, s), eta in
                            zip(itertools.product((1, 2, 3), (3, 6)), etas)]
    real = dear.lr_at

    def interrupt(epoch, c):
        if epoch == 2:
            raise KeyboardInterrupt
        return real(epoch, c)

    monkeypatch.setattr(dear, "lr_at", interrupt)
    with pytest.raises(SystemExit):
        run(world, tmp_path / "b", "--epochs 3 --workers 2")
    monkeypatch.setattr(dear, "lr_at", real)
    assert "--resume" in capsys.readouterr().err
    fails(capsys, "--resume", argv(world, tmp_path / "b", "--epochs 3"))
    _, resumed = run(world, tmp_path / "b", "--epochs 3 --resume")
    a, b = (torch.load(os.path.join(d, "model.pt")) for d in (full, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert f"resuming from {os.path.join(resumed, 'checkpoint.pt')} at epoch 3" in open(
        os.path.join(resumed, "log.txt")).read()
    assert logged(resumed)[-2:] == [(3, 3, 0, 100), (3, 6, 0, 0)]  # 100 / 3 * (6 - 3)


BAD = [("--beta 2", "--beta"), ("--beta nan", "--beta"), ("--lr 0", "--lr"),
       ("--alpha-cls 1", "--alpha-cls"), ("--shots 0", "--shots"), ("--mask diagonal", "--mask"),
       ("--seed -1", "--seed"), ("--crop-scale 0", "--crop"), ("--lambda-reg inf", "--lambda-reg"),
       ("--J 0", "--J"), ("--rep-dim 0", "--rep-dim"), ("--device cuda", "CUDA"),
       ("--J 9", "--J 9"), ("--dataset nosuchset", "nosuchset"),
       ("--eval-only", "--eval-only needs --load RUN"),
       ("--seed 4294967296", "--seed: '4294967296' is not a seed in [0, 2^32)"),
       ("--protocol xd --targets dtd,dtd", "'dtd' is empty, the source or named twice"),
       ("--protocol xd --targets folder:x --targets dtd --dataset dtd", "'dtd' is empty, the"),
       ("--resume --force", "--resume continues a run and --force restarts it"),
       ("--dataset eurosat --root {tmp}/elsewhere", "{tmp}/elsewhere/eurosat")]  # under --root


@pytest.mark.parametrize("flags, says", BAD)
def test_bad_input_is_one_line_and_exit_2(world, tmp_path, capsys, flags, says):
    if says == "CUDA" and torch.cuda.is_available():
        pytest.skip("CUDA is available")
    flags, says = flags.format(tmp=tmp_path), says.format(tmp=tmp_path)
    args = argv(world, tmp_path, flags)
    if "nosuchset" in flags:
        args = args[2:] + ["--dataset", "nosuchset"]
    fails(capsys, says, ["--eval-only", "--dataset", "toyworld"] if "needs" in says else args)
    assert not os.path.exists(tmp_path / "b2n") or says in ("--J 9", "CUDA")


def test_a_nonfinite_loss_stops_fp32_is_skipped_under_fp16(world, tmp_path, monkeypatch, capsys):
    real, calls = dear.dear_loss, []

    def poisoned(out, *a):
        total, parts = real(out, *a)
        calls.append(1)
        return (total * math.nan if len(calls) == poison else total), parts

    poison = 2
    monkeypatch.setattr(dear, "dear_loss", poisoned)
    err = fails(capsys, "the loss became nan by epoch 1",
                argv(world, tmp_path / "a", "--epochs 1 --precision fp32"))
    assert "try a lower --lr" in err and not list((tmp_path / "a").rglob("checkpoint.pt"))
    calls.clear()
    fails(capsys, "try --precision fp32", argv(world, tmp_path / "d",
                                               "--epochs 1 --precision bf16"))
    calls.clear()
    # the last step: the runs agree on all before it (fp16 skips its first steps too)
    poison = 12
    results, rdir = run(world, tmp_path / "b", "--epochs 2 --precision fp16")
    monkeypatch.setattr(dear, "dear_loss", real)
    clean, _ = run(world, tmp_path / "c", "--epochs 2 --precision fp16")
    assert results["train"]["skipped_steps"] == clean["train"]["skipped_steps"] + 1
    # the log counts them as it goes: the last line the run's count
    assert logged(rdir)[-1][:3] == (2, 6, results["train"]["skipped_steps"])
    assert results["config"]["precision"] == "fp16"


def test_one_process_per_run_folder_and_the_lock_never_follows_a_link(world, tmp_path, capsys):
    rdir = folder_of(argv(world, tmp_path))
    os.makedirs(rdir)
    with open(os.path.join(rdir, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        fails(capsys, "another process", argv(world, tmp_path))
    os.remove(os.path.join(rdir, ".lock"))
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    os.symlink(target, os.path.join(rdir, ".lock"))
    fails(capsys, ".lock", argv(world, tmp_path))
    assert target.read_text() == "keep me"


def test_lr_schedule_and_xd_target_beta_by_hand():
    c = dear.resolve(dear.Config(dataset="dtd", protocol="fewshot", epochs=4, lr=2.0,
                                 warmup_lr=0.5))
    assert [dear.lr_at(e, c) for e in range(4)] == pytest.approx([0.5, 2.0,
            1.0 + math.cos(math.pi / 4), 1.0])
    x = dear.resolve(dear.Config(dataset="imagenet", protocol="xd", beta=0.55))
    assert (x.beta, x.lambda_reg, x.epochs, x.warmup_epochs) == (0.55, 0.1, 1, 0)
    assert [dear.eval_beta(x, d) for d in ("imagenet", "dtd", "imagenet_a", "folder:x")] == [0.55,
            0.5, 0.8, 0.55]
    assert dear.eval_beta(dataclasses.replace(x, target_beta="source"), "dtd") == 0.55
    targets = "--protocol xd --targets folder:a,b --targets dtd,eurosat --dataset imagenet".split()
    assert dear.resolve(dear.parse_args(targets)[0]).targets == ["folder:a,b", "dtd", "eurosat"]


@pytest.mark.parametrize("protocol, dataset, want", [
    # (epochs, batch, lr, warm-up epochs, crop scale): the README's rows "epochs / batch / lr" and
    # "augmentation"; the toy's rows are ours (its backbone: toy), the others MMRL's and MMRL++'s
    ("b2n", "toyworld", (20, 4, 1e-3, 1, 1.0)), ("fewshot", "toyworld", (50, 32, 1e-3, 1, 1.0)),
    ("b2n", "dtd", (10, 4, 1e-3, 1, 0.5)), ("fewshot", "dtd", (100, 32, 2e-3, 1, 0.5)),
    ("b2n", "imagenet", (5, 32, 1e-3, 1, 0.5)), ("xd", "imagenet", (1, 32, 1e-3, 0, 0.5))])
def test_default_schedules_as_the_readme_says_and_the_run_named_default(protocol, dataset, want):
    readme = " ".join(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split())
    assert "toy b2n 20 epochs, toy few-shot 50 at 1e-3" in readme and "(toy: scale 1," in readme
    c = dear.resolve(dear.Config(dataset=dataset, protocol=protocol))
    assert (c.epochs, c.batch_size, c.lr, c.warmup_epochs, c.crop_scale) == want
    assert c.backbone == ("toy" if dataset == "toyworld" else "ViT-B/16")
    folder = runs.run_dir(c, dear.changed_flags(c))[0]
    assert os.path.basename(os.path.normpath(folder)) == f"dear-default-shots{c.shots}-seed1"


def test_epochs_reshuffle_and_reseed_and_the_readouts_read_each_side_alone(world, tmp_path, spy):
    """The batches of epoch 2 are another shuffle of the same images than epoch 1's, with other
    seeds for their crops (a fixed per-image seed would crop alike every epoch). The readouts, on
    the trained run's novel split, by hand from frozen CLIP's own encoders: image = the trained
    f_cls against encode_text's class features; text = encode_image's feature against the trained
    class features; class = the class logits; fused = the reported accuracy. One pass over the
    images: one loader per evaluation."""
    results, rdir = run(world, tmp_path, "--epochs 2 --crop-scale 0.5")
    samplers = [k["batch_sampler"] for d, k in loaders(spy, dear.SeededImages)]
    first, second = ([i for batch in b for i, _ in batch] for b in samplers)
    seeds = [{i: s for batch in b for i, s in batch} for b in samplers]
    assert sorted(first) == sorted(second) and first != second
    assert all(seeds[0][i] != seeds[1][i] for i in first)
    model = spy["model"][0]
    novel = data.build_dataset(f"folder:{world / 'shapes'}", "", 4, 1, "novel")
    x = torch.stack([clip.transform(32)(data.open_image(p)) for p, _, _ in novel.test])
    y = torch.tensor([label for _, label, _ in novel.test])
    m, prompts = model.clip, [novel.template.format(c) for c in novel.classnames]
    with torch.no_grad():
        model.set_classes(novel.classnames, novel.template)
        t = model.encode_classes()
        out = model(x, t=t)
        frozen_text = torch.nn.functional.normalize(m.encode_text(clip.tokenize(prompts)), dim=-1)
        frozen_image = torch.nn.functional.normalize(m.encode_image(x), dim=-1)
    right = lambda scores: 100 * float((scores.argmax(-1) == y).float().mean())
    want = {"fused": right(out["fused"]), "class": right(out["logits"][:, 0]),
            "image": right(out["f_cls"] @ frozen_text.t()), "text": right(frozen_image @ t.t())}
    got = results["evals"][1]["readouts"]
    assert got == pytest.approx(want) and got["fused"] == results["evals"][1]["accuracy"]
    assert len(set(want.values())) > 1  # the sides differ here: the comparison means something
    assert [k.get("batch_size") for _, k in loaders(spy, data.ImageList)].count(100) == 2


def test_toy_quick_start_beats_zero_shot_on_the_novel_classes(quick_start):
    """The README's quick start, offline (run by conftest beside the other tests): DeAR on the toy
    world keeps the base classes (zero-shot's 98.96) and beats zero-shot on the novel ones by at
    least 1 point (seed 1: +1.83, 97.40 vs 95.57, 7 of 384 images; other CPUs' rounding moved one
    image a split before); J = 3 of 4; the roles and the mask were drawn into the run."""
    out, p = quick_start
    assert p.returncode == 0, open(out.parent.parent / "quick_start.log").read()[-3000:]
    deAR = json.load(open(out / "b2n/toyworld/dear-default-shots16-seed1/results.json"))
    zero = json.load(open(out / "b2n/toyworld/zeroshot-default-shots16-seed1/results.json"))
    assert deAR["config"]["J"] == 3
    assert deAR["evals"][0]["accuracy"] >= zero["evals"][0]["accuracy"] - 0.3
    assert deAR["evals"][1]["accuracy"] >= zero["evals"][1]["accuracy"] + 1
    assert deAR["hm"] > zero["hm"]
    for name in ("roles.png", "mask.png"):
        assert os.path.exists(out / "b2n/toyworld/dear-default-shots16-seed1" / name)
    assert all(set(e["readouts"]) == {"fused", "class", "image", "text"} for e in deAR["evals"])
    # the toy's roles can test the claim: an expert of every toy attribute, two roles in a block,
    # no head at a threshold, every head's ablation cost
    doc = json.load(open(out / "b2n/toyworld/dear-default-shots16-seed1/roles.json"))
    heads, t = doc["heads"], doc["thresholds"]
    assert {e["attribute"] for e in heads} >= {"color", "shape", "texture", "location"}
    assert any(len({e["role"] for e in heads if e["layer"] == b}) >= 2 for b in doc["layers"])
    assert all(e["entropy"] not in (t["low"], t["high"]) and "ablation" in e for e in heads)

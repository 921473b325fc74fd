"""A run folder is a run's identity (runs.py, runs.run): no run silently returns, mixes or reuses
another's work, and every fault a user can make ends in one clear line (exit 2), never a
traceback."""

import json
import os
import pathlib
import shutil

import pytest
import torch

import config
import dear
import toyworld
import runs
from test_dear import cli, fake_roles_doc, world  # noqa: F401  (world is a fixture)


def stop_message(args, capsys, code=2):
    """Run the CLI, expect it to stop with `code`; return what it printed on stderr."""
    with pytest.raises(SystemExit) as stop:
        dear.main(args)
    err = capsys.readouterr().err
    assert stop.value.code == code, err
    assert "Traceback" not in err
    return err


def write_roles(path, model_name, flip=False):
    doc = fake_roles_doc(model_name=model_name)
    if flip:  # another roles file: the first head of every block is mixed instead of generalization
        for h in doc["heads"]:
            if h["head"] == 0:
                h["role"] = "mixed"
    path.write_text(json.dumps(doc))
    return str(path)


# ---------------------------------------------------------------------------------------- A1: names


def test_folder_datasets_with_the_same_name_get_different_run_folders(tmp_path):
    (tmp_path / "a" / "pets").mkdir(parents=True)
    (tmp_path / "b" / "pets").mkdir(parents=True)
    a = runs.run_dir(dear.Config(dataset=f"folder:{tmp_path / 'a' / 'pets'}", backbone="ViT-B/16"))
    b = runs.run_dir(dear.Config(dataset=f"folder:{tmp_path / 'b' / 'pets'}", backbone="ViT-B/16"))
    assert a != b and "folder-pets-" in a
    # the same folder by another path: the same runs
    (tmp_path / "link").symlink_to(tmp_path / "a" / "pets")
    assert (
        runs.run_dir(dear.Config(dataset=f"folder:{tmp_path / 'link'}", backbone="ViT-B/16")) == a
    )


def test_roles_files_and_checkpoints_are_named_by_content(tmp_path):
    for d in ("x", "y", "z"):
        (tmp_path / d).mkdir()
    one = write_roles(tmp_path / "x" / "roles.json", "m")
    other = write_roles(tmp_path / "y" / "roles.json", "m", flip=True)
    same = shutil.copy(one, tmp_path / "z" / "roles.json")
    name = lambda **kw: runs.run_dir(dear.Config(dataset="eurosat", **kw))  # noqa: E731
    assert name(roles=one) != name(roles=other)  # both files are called roles.json
    assert name(roles=one) == name(roles=same)  # same content, other path
    ckpt_a, ckpt_b = tmp_path / "x" / "clip.pt", tmp_path / "y" / "clip.pt"
    torch.save({"w": torch.zeros(2)}, ckpt_a)
    torch.save({"w": torch.ones(2)}, ckpt_b)
    assert name(backbone=str(ckpt_a)) != name(backbone=str(ckpt_b))


def test_a_finished_run_is_reused_only_when_its_config_matches(world, tmp_path, capsys):
    root, ckpt, dataset = world
    args = cli(
        world,
        tmp_path / "runs",
        "--protocol",
        "fewshot",
        "--epochs",
        "1",
        "--roles",
        write_roles(tmp_path / "roles.json", ckpt),
    )
    dear.main(args)
    (rdir,) = (tmp_path / "runs").rglob("results.json")
    config = json.loads((rdir.parent / "config.json").read_text())
    assert config["inputs"]["dataset_folder"] == os.path.realpath(dataset[len("folder:") :])
    assert config["inputs"]["backbone_sha256"] == runs.file_sha256(ckpt)
    capsys.readouterr()
    dear.main(args)
    assert "done already" in capsys.readouterr().out
    # as if the folder had been read from another place
    config["inputs"]["dataset_folder"] = "/elsewhere/colors"
    (rdir.parent / "config.json").write_text(json.dumps(config))
    err = stop_message(args, capsys)
    assert "different configuration" in err and "inputs" in err and "--force" in err


# --------------------------------------------------------------------------------- A2: roles pinned


def test_roles_are_pinned_to_the_run_and_eval_only_uses_them(world, tmp_path, capsys):
    root, ckpt, dataset = world
    roles = write_roles(tmp_path / "roles.json", ckpt)
    dear.main(
        cli(
            world,
            tmp_path / "runs",
            "--protocol",
            "fewshot",
            "--epochs",
            "1",
            "--roles",
            roles,
            "--shots",
            "16",
        )
    )
    (results,) = (tmp_path / "runs").rglob("results.json")
    rdir = results.parent
    done = json.loads(results.read_text())
    # 20 images a class, split 50/20/30: 10 training images, fewer than the 16 shots asked for,
    # and it says so
    assert {k: done["train_shots"][k] for k in ("asked", "min", "max")} == {
        "asked": 16,
        "min": 10,
        "max": 10,
    }
    assert any("--shots 16" in w for w in done["warnings"])
    used = done["roles_used"]
    assert used["sha256"] == runs.file_sha256(roles) == runs.file_sha256(rdir / "roles.json")
    assert json.loads((rdir / "config.json").read_text())["roles_used"] == used
    write_roles(tmp_path / "roles.json", ckpt, flip=True)  # the roles file changes after training
    dear.main(
        cli(world, tmp_path / "runs", "--eval-only", "--load", str(rdir), "--protocol", "fewshot")
    )
    (again,) = (rdir / "eval").rglob("results.json")
    # the run's own roles
    assert json.loads(again.read_text())["roles_used"]["sha256"] == used["sha256"]


# ----------------------------------------------------------------------------------- A5: one writer


def test_a_second_identical_run_stops_while_the_first_holds_the_folder(world, tmp_path, capsys):
    args = cli(world, tmp_path / "runs", "--method", "zeroshot")
    rdir = runs.run_dir(dear.parse_args(args))
    os.makedirs(rdir)
    with runs.RunLock(rdir):
        err = stop_message(args, capsys)
    assert "is being written by pid" in err and str(os.getpid()) in err
    dear.main(args)  # the lock is gone with its holder
    assert os.path.exists(os.path.join(rdir, "results.json"))


# -------------------------------------------------------------------------------- B: one clear line


def test_faults_stop_with_one_line(world, tmp_path, capsys):
    root, ckpt, dataset = world
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "choose a writable --out" in stop_message(
        cli(world, blocker / "runs", "--method", "zeroshot"), capsys
    )
    assert "beyond the backbone" in stop_message(cli(world, tmp_path / "r", "--J", "7"), capsys)
    assert "finite" in stop_message(cli(world, tmp_path / "r", "--lr", "nan"), capsys)
    assert "finite" in stop_message(cli(world, tmp_path / "r", "--beta", "inf"), capsys)
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    (empty / "model.pt").write_bytes(b"")
    assert "config.json" in stop_message(
        cli(world, tmp_path / "r", "--eval-only", "--load", str(empty)), capsys
    )


def test_a_damaged_checkpoint_asks_for_force(world, tmp_path, capsys, monkeypatch):
    roles = write_roles(tmp_path / "roles.json", world[1])
    args = cli(world, tmp_path / "runs", "--protocol", "fewshot", "--roles", roles)
    real = runs.train

    def interrupted(
        model, ds, cfg, device, rdir, log, loss_fn
    ):  # a checkpoint is written, then Ctrl-C
        torch.save({"model": {}}, os.path.join(rdir, "checkpoint.pt"))
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "train", interrupted)
    assert "--resume" in stop_message(args, capsys, code=130)
    monkeypatch.setattr(runs, "train", real)
    (ckpt,) = (tmp_path / "runs").rglob("checkpoint.pt")
    ckpt.write_bytes(b"\x00 half a checkpoint")
    err = stop_message(args + ["--resume"], capsys)
    assert "cannot be resumed" in err and "--force" in err


def test_ctrl_c_before_any_checkpoint_promises_nothing(world, tmp_path, capsys, monkeypatch):
    def pretraining(
        *a, **k
    ):  # Ctrl-C while the backbone is made (the toy CLIP's first pretraining)
        raise KeyboardInterrupt

    monkeypatch.setattr(toyworld, "load_clip", pretraining)
    err = stop_message(cli(world, tmp_path / "runs"), capsys, code=130)
    assert "nothing was kept" in err and "--resume" not in err


# --------------------------------------------------------------------------------- D: first contact


def test_a_missing_dataset_names_the_download_and_the_offline_demo(tmp_path, capsys):
    err = stop_message(
        ["--dataset", "eurosat", "--root", str(tmp_path), "--out", str(tmp_path / "runs")], capsys
    )
    assert (
        f"python data.py download eurosat --root {tmp_path}" in err and "--dataset toyworld" in err
    )
    assert len(err.strip().splitlines()) <= 6


def test_default_workers_fit_the_machine():
    assert 0 < dear.resolve(dear.Config()).workers <= min(4, config.available_cpus())


def test_cached_imagenet_roles_are_used_without_reading_imagenet(world, tmp_path, monkeypatch):
    """Once roles probed on ImageNet are cached, a run takes them without listing ImageNet again."""
    root, ckpt, dataset = world
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "cache"))
    model, _ = runs.load_clip(ckpt, "cpu")
    path = runs.entropy.default_roles_path(
        model, [3, 4], runs.clip.cache_dir(), "imagenet", split="test", pool=None
    )
    os.makedirs(os.path.dirname(path))
    write_roles(pathlib.Path(path), model.name)

    def build_dataset(name, *args, **kwargs):
        assert name != "imagenet", "ImageNet was read although its roles are cached"
        return real(name, *args, **kwargs)

    real = runs.data.build_dataset
    monkeypatch.setattr(runs.data, "build_dataset", build_dataset)
    cfg = dear.resolve(dear.Config(dataset=dataset, root=str(root), backbone=ckpt, J=3))
    _, used = runs.load_roles(cfg, model, torch.device("cpu"), log=lambda msg: None)
    assert used == path


# ------------------------------------------------------------------------------------- E: precision


def test_the_precision_used_is_part_of_a_runs_identity(world, tmp_path, capsys, monkeypatch):
    """--precision amp is fp32 on a CPU and fp16 on CUDA: the same command on the other device finds
    the run folder taken by a run of another precision, and stops instead of reusing or resuming it.
    Both precisions are recorded; asking for a half-precision evaluation gets its own folder."""
    root, ckpt, dataset = world
    args = cli(
        world,
        tmp_path / "runs",
        "--protocol",
        "fewshot",
        "--epochs",
        "1",
        "--roles",
        write_roles(tmp_path / "roles.json", ckpt),
    )
    dear.main(args)
    (results,) = (tmp_path / "runs").rglob("results.json")
    done = json.loads(results.read_text())
    assert done["precisions"] == {"train": "fp32", "eval": "fp32"}
    assert (done["config"]["precision"], done["config"]["eval_precision"]) == ("fp32", "fp32")
    assert (
        json.loads((results.parent / "config.json").read_text())["precisions"] == done["precisions"]
    )
    real = runs.resolve_precision

    def on_cuda(precision, device):  # what amp resolves to on a CUDA device
        return "fp16" if precision == "amp" else real(precision, device)

    monkeypatch.setattr(runs, "resolve_precision", on_cuda)
    capsys.readouterr()
    err = stop_message(args, capsys)  # a finished run of another precision: not "done already"
    assert "different configuration" in err and "precisions" in err and "fp16" in err
    # now as an interrupted run: its checkpoint is not resumed in another precision
    results.unlink()
    torch.save({"model": {}}, results.parent / "checkpoint.pt")
    err = stop_message(args + ["--resume"], capsys)
    assert "holds an interrupted run of a different configuration" in err and "precisions" in err
    monkeypatch.setattr(runs, "resolve_precision", real)
    bf16 = runs.run_dir(dear.parse_args(args + ["--eval-precision", "bf16"]))
    assert bf16 != str(results.parent) and "eval_precision-bf16" in bf16


def test_the_toy_clip_trains_on_one_thread_unless_the_user_says_otherwise(monkeypatch):
    threads = torch.get_num_threads()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for backbone, device, want in (
            ("ViT-B/16", cpu, 2),  # a real CLIP keeps torch's choice
            ("toy", cuda, 2),  # nothing to do with CPU threads
            ("toy", cpu, 1),
        ):
            torch.set_num_threads(2)
            runs.toy_threads(backbone, device)
            assert torch.get_num_threads() == want, (backbone, device)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own setting wins
        torch.set_num_threads(2)
        runs.toy_threads("toy", cpu)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)

"""dear.py's recipe, training loop, run folder and command line, on a tiny CLIP and a small
folder dataset."""

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shlex

import pytest
import torch
from PIL import Image

import dear
from conftest import tiny_state_dict

# more than ten folders, names with spaces
CLASSES = [f"class {i:02d} with spaces" for i in range(12)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny CLIP checkpoint file and a folder dataset of 12 classes whose colour is the class."""
    root = tmp_path_factory.mktemp("world")
    torch.save(tiny_state_dict(text_layers=4), root / "tiny.pt")
    gen = torch.Generator().manual_seed(0)
    for k, name in enumerate(CLASSES):
        os.makedirs(root / "shapes" / name)
        colour = torch.rand(3, generator=gen) * 255
        for i in range(10):
            pixels = (colour + torch.randn(32, 32, 3, generator=gen) * 20).clamp(0,
                    255).byte().numpy()
            Image.fromarray(pixels).save(root / "shapes" / name / f"{i}.png")
    return root


def argv(world, out, extra=""):
    return ["--dataset", f"folder:{world / 'shapes'}", "--root", str(world), "--backbone",
            str(world / "tiny.pt"), "--out", str(out), "--shots", "4", "--epochs", "2",
            "--batch-size", "4", "--workers", "0", "--J", "3"] + shlex.split(extra)


def eval_argv(world, rdir, extra=""):
    """An --eval-only call: the dataset and where to read, the rest from the run."""
    return ["--dataset", f"folder:{world / 'shapes'}", "--root", str(world), "--workers", "0",
            "--eval-only", "--load", str(rdir)] + shlex.split(extra)


def run(world, out, extra="", capsys=None):
    results = dear.main(argv(world, out, extra))
    return results, dear.run_dir(dear.resolve(dear.parse_args(argv(world, out, extra))))[0]


def fails(capsys, words, args):
    with pytest.raises(SystemExit) as e:
        dear.main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and words in err, err
    return err


def test_b2n_run_writes_its_folder_and_reuses_it_only_for_its_own_config(world, tmp_path, capsys):
    results, rdir = run(world, tmp_path)
    b, n = (e["accuracy"] for e in results["evals"])
    assert [e["split"] for e in results["evals"]] == ["base", "novel"]
    assert results["hm"] == pytest.approx(2 * b * n / (b + n))
    for name in ("config.json", "roles.json", "roles.md", "roles.png", "log.txt", "model.pt",
                 "results.json"):
        assert os.path.isfile(os.path.join(rdir, name)), name
    assert not os.path.exists(os.path.join(rdir, "checkpoint.pt"))
    env = results["env"]
    assert {"python", "torch", "torchvision", "cuda", "cudnn", "device", "git_commit",
            "git_dirty"} <= set(env)
    assert env["torch"] in open(os.path.join(rdir, "log.txt")).readline()
    assert (results["inputs"]["roles_sha256"] == hashlib.sha256(open(os.path.join(rdir,
            "roles.json"), "rb").read()).hexdigest())
    capsys.readouterr()
    again, _ = run(world, tmp_path)
    assert "done already" in capsys.readouterr().out and again == results
    # the same folder recorded with another checkpoint: named, refused, not reused
    config = json.load(open(os.path.join(rdir, "config.json")))
    config["inputs"]["backbone_sha256"] = "0" * 64
    json.dump(config, open(os.path.join(rdir, "config.json"), "w"))
    fails(capsys, "backbone_sha256", argv(world, tmp_path))
    results_path = os.path.join(rdir, "results.json")
    r = json.load(open(results_path))
    r["evals"][0]["accuracy"] = 150.0
    json.dump(r, open(results_path, "w"))
    json.dump(dict(config, inputs=again["inputs"]), open(os.path.join(rdir, "config.json"), "w"))
    fails(capsys, "= 150.0 is not a number in [0, 100]", argv(world, tmp_path))


def test_settings_reach_the_built_model_and_eval_only_takes_the_runs_own(world, tmp_path,
        monkeypatch, capsys):
    built = []
    real = dear.DeAR
    monkeypatch.setattr(dear, "DeAR", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    results, rdir = run(world, tmp_path,
                        "--tokens mmrl --alpha-cls 0.4 --beta 0.35 --seed 7 --epochs 1")
    m = built[-1]
    assert (m.kind, m.beta, m.blocks, m.use_tokens) == ("mmrl", 0.35, range(2, 4), True)
    assert "tokens-mmrl" in rdir and "beta-0.35" in rdir and "seed" not in results["changed"]
    assert {"tokens": "mmrl", "alpha_cls": 0.4, "beta": 0.35,
            "epochs": 1}.items() <= results["changed"].items()
    trained = torch.load(os.path.join(rdir, "model.pt"))
    assert results["fusion_weights"]["cls"] == pytest.approx(trained["w"].softmax(0)[0].item())
    ev = dear.main(eval_argv(world, rdir, "--protocol fewshot"))
    m = built[-1]
    assert (m.kind, m.beta, m.use_tokens) == ("mmrl", 0.35, True) and torch.equal(m.w.detach(),
            trained["w"])
    assert ev["config"]["seed"] == 7 and os.path.isdir(os.path.join(rdir, "eval"))
    _, rdir0 = run(world, tmp_path, "--no-attr-tokens")
    dear.main(eval_argv(world, rdir0))
    assert not built[-1].use_tokens and not any(p.requires_grad for p in built[-1].parameters())
    torch.save({"w": torch.zeros(6)}, os.path.join(rdir, "model.pt"))
    fails(capsys, "does not fit", eval_argv(world, rdir))


def test_resume_ends_with_the_weights_of_an_uninterrupted_run_whatever_the_workers(world, tmp_path,
        monkeypatch, capsys):
    _, full = run(world, tmp_path / "a", "--epochs 3")
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
    assert "resuming" in open(os.path.join(resumed, "log.txt")).read()


BAD = [("--beta 2", "--beta"), ("--beta nan", "--beta"), ("--lr 0", "--lr"),
       ("--alpha-cls 1", "--alpha-cls"), ("--shots 0", "--shots"), ("--mask diagonal", "--mask"),
       ("--seed -1", "--seed"), ("--crop-scale 0", "--crop"), ("--lambda-reg inf", "--lambda-reg"),
       ("--J 0", "--J"), ("--rep-dim 0", "--rep-dim"), ("--device cuda", "CUDA"),
       ("--J 9", "--J 9"), ("--dataset nosuchset", "nosuchset"), ("--eval-only", "--eval-only")]


@pytest.mark.parametrize("flags, says", BAD)
def test_bad_input_is_one_line_and_exit_2(world, tmp_path, capsys, flags, says):
    if says == "CUDA" and torch.cuda.is_available():
        pytest.skip("CUDA is available")
    args = argv(world, tmp_path, flags)
    if flags.startswith("--dataset"):
        args = args[2:] + ["--dataset", "nosuchset"]
    fails(capsys, says, args)
    assert not os.path.exists(tmp_path / "b2n") or says in ("--J 9", "CUDA")


def test_a_nonfinite_loss_stops_fp32_and_is_skipped_and_counted_under_fp16(world, tmp_path,
        monkeypatch, capsys):
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
    # late in the second epoch, once the scale has settled (fp16 skips its first steps too)
    poison = 11
    results, _ = run(world, tmp_path / "b", "--epochs 2 --precision fp16")
    monkeypatch.setattr(dear, "dear_loss", real)
    clean, _ = run(world, tmp_path / "c", "--epochs 2 --precision fp16")
    assert results["train"]["skipped_steps"] == clean["train"]["skipped_steps"] + 1
    assert results["config"]["precision"] == "fp16"


def test_one_process_per_run_folder_and_the_lock_never_follows_a_link(world, tmp_path, capsys):
    rdir = dear.run_dir(dear.resolve(dear.parse_args(argv(world, tmp_path))))[0]
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
    targets = ["--protocol", "xd", "--targets", "folder:a,b", "--targets", "dtd,eurosat"]
    assert dear.resolve(dear.parse_args(targets)).targets == ["folder:a,b", "dtd", "eurosat"]


# MMRL++'s tables (yunncheng/MMRL trainers/config.py), typed again from its per-dataset overrides:
# (beta, lambda_reg)
MMRLPP = {"imagenet": (0.9, 0.2), "fgvc_aircraft": (0.9, 2), "ucf101": (0.9, 3), "dtd": (0.9, 7),
          "oxford_pets": (0.7, 0.01), "stanford_cars": (0.7, 6), "caltech101": (0.6, 3),
          "sun397": (0.5, 3), "oxford_flowers": (0.4, 7), "eurosat": (0.2, 0.01),
          "food101": (0.1, 1), "folder:x": (0.9, 1.0)}
TARGET_BETA = {"imagenetv2": 0.9, "imagenet_r": 0.9, "imagenet_a": 0.8, "imagenet_sketch": 0.7,
               "fgvc_aircraft": 0.9, "ucf101": 0.9, "sun397": 0.7, "oxford_pets": 0.6,
               "caltech101": 0.6, "dtd": 0.5, "oxford_flowers": 0.4, "stanford_cars": 0.3,
               "eurosat": 0.3, "food101": 0.3}


@pytest.mark.parametrize("dataset", MMRLPP)
def test_recipe_rows_restated(dataset):
    """Every row of the MMRL++ tables and of the schedules (MMRL's vit_b16*, MMRL++'s
    vit_b16_few_shot)."""
    imagenet = dataset == "imagenet"
    b2n, fewshot = (dear.resolve(dear.Config(dataset=dataset, protocol=p)) for p in ("b2n",
            "fewshot"))
    assert (b2n.beta, b2n.lambda_reg) == (fewshot.beta, fewshot.lambda_reg) == MMRLPP[dataset]
    assert (b2n.epochs, b2n.batch_size, b2n.warmup_epochs,
            b2n.lr) == ((5, 32) if imagenet else (10, 4)) + (1, 1e-3)
    assert (fewshot.epochs, fewshot.lr) == ((5, 1e-3) if imagenet else (100,
            2e-3)) and fewshot.batch_size == 32
    xd = dear.resolve(dear.Config(dataset="imagenet", protocol="xd"))
    assert dear.eval_beta(xd, dataset) == TARGET_BETA.get(dataset, 0.9) or dataset == "imagenet"


def test_xd_variants_get_their_test_time_beta():
    xd = dear.resolve(dear.Config(dataset="imagenet", protocol="xd", beta=0.55))
    assert {t: dear.eval_beta(xd, t) for t in TARGET_BETA} == TARGET_BETA and dear.eval_beta(xd,
            "imagenet") == 0.55


def test_predict_agrees_with_the_evaluation_and_explains(world, tmp_path, capsys):
    results, rdir = run(world, tmp_path, "--protocol fewshot")
    items = dear.data.build_dataset(f"folder:{world / 'shapes'}", str(world)).test[:6]
    report = dear.main(["predict", "--load", rdir, "--explain", str(tmp_path / "x.png"),
                        *[p for p, _, _ in items]])
    c = dear.resolve(dear.Config(**json.load(open(os.path.join(rdir, "config.json")))["config"]))
    model, _ = dear.build(c, print, os.path.join(rdir, "roles.json"),
                          os.path.join(rdir, "model.pt"))
    r = dear.evaluate(model, items, CLASSES, "a photo of a {}.",
                      dear.resolve(dear.Config(workers=0, device="cpu")))
    right = sum(rep["top5"][0][0] == cls for rep, (_, _, cls) in zip(report, items))
    assert sum(k["accuracy"] * k["n"] for k in r["per_class"]) / 100 == pytest.approx(right)
    assert all(sum(p for _, p in rep["top5"]) <= 1 + 1e-3 for rep in report)
    assert report[0]["evidence"]["cls"]["alpha"] == pytest.approx(results["fusion_weights"]["cls"],
            abs=1e-4)
    assert Image.open(tmp_path / "x.png").size[0] == 7 * 160 + 90


def test_attention_maps_equal_the_weights_computed_by_hand(world):
    """The explain maps are the last block's attention of CLS (all heads) and of each token (its
    expert heads) on the patches; a head a token is masked from contributes nothing."""
    # fmt: off
    heads = [("attribute", "color"), ("generalization", None), ("attribute", "shape"),
             ("mixed", None)]
    roles = {l: [{"role": r, "attribute": a} for r, a in heads] for l in (3, 4)}
    # fmt: on
    model = dear.DeAR(dear.clip.model.build_model(tiny_state_dict(text_layers=4)), roles, J=3)
    images = torch.randn(2, 3, 32, 32)
    maps, heads = model.attention_maps(images)
    x = model.token_blocks(model.frozen_prefix(images), stop=1)  # the input of block 4
    block = model.clip.visual.transformer.resblocks[3]
    _, w = block.attn(block.ln_1(x), attn_mask=model.mask(1), need_weights=True)  # [B, H, T, T]
    # color, shape: experts; texture: mixed
    assert heads[1] == [0] and heads[2] == [2] and heads[3] == [3]
    assert torch.allclose(maps[:, 1], w[:, 0, 1, 6:], atol=1e-6) and torch.allclose(maps[:, 0],
            w[:, :, 0, 6:].mean(1))
    # masked heads: nothing
    assert w[:, 1, 1:6, 6:].abs().max() == 0 and w[:, 0, 2, 6:].abs().max() == 0


def test_toy_quick_start_beats_zero_shot(quick_start):
    """The README's quick start, offline (run by conftest beside the other tests): DeAR on the
    toy world beats the toy CLIP's zero-shot row by 3 base points and in HM; J = 3 of 4; the
    roles were computed into the run."""
    out, p = quick_start
    assert p.returncode == 0, open(out.parent.parent / "quick_start.log").read()[-3000:]
    deAR = json.load(open(out / "b2n/toyworld/dear-default-shots16-seed1/results.json"))
    zero = json.load(open(out / "b2n/toyworld/zeroshot-default-shots16-seed1/results.json"))
    assert deAR["config"]["J"] == 3
    assert deAR["evals"][0]["accuracy"] >= zero["evals"][0]["accuracy"] + 3
    assert deAR["hm"] > zero["hm"]
    assert os.path.exists(out / "b2n/toyworld/dear-default-shots16-seed1/roles.png")

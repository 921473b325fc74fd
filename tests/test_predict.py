"""predict.py: classifying a user's images with a finished run, the evidence, the explain sheet and
its maps, on the tiny CLIP and a small folder dataset (and on the quick start's toy run)."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import clip
import data
import dear
import predict
import runs
import toyworld
from conftest import CLASSES, tiny_state_dict
from test_run import fails, run


@pytest.fixture(scope="module")
def fewshot(world, tmp_path_factory):
    """A few-shot run on the 12 folder classes: (its results, folder, model rebuilt, test items)."""
    results, rdir = run(world, tmp_path_factory.mktemp("fewshot"), "--protocol fewshot")
    c = dear.resolve(dear.Config(**runs.read_config(rdir, dear.CONFIG)["config"]))
    model = dear.build(c, print, os.path.join(rdir, "roles.json"), os.path.join(rdir, "model.pt"))
    test = data.build_dataset(f"folder:{world / 'shapes'}", str(world)).test
    return results, rdir, model[0], test


def test_predict_agrees_with_the_model_and_names_each_logit_sets_first(fewshot, tmp_path, capsys):
    """The top 5 by the fused logits (softmax), and for each logit set the class it alone ranks
    first, as the rebuilt model computes them; --json: JSON alone on stdout, the sheet's line on
    stderr."""
    results, rdir, model, test = fewshot
    paths = [p for p, _, _ in test[:6]]
    report = predict.main(["--load", rdir, "--json", "--explain", str(tmp_path / "x.png"), *paths])
    out, err = capsys.readouterr()
    assert json.loads(out) == report and err.endswith(f"wrote {tmp_path / 'x.png'}\n")
    x = torch.stack([clip.transform(32)(data.open_image(p)) for p in paths])
    model.set_classes(CLASSES, "a photo of a {}.")
    with torch.no_grad():
        logits = model(x)["logits"]  # [6, 1+K, 12]
    probs = (logits * model.alpha()[None, :, None]).sum(1).softmax(-1)  # fused, by hand
    keys = ["cls", *dear.ATTRIBUTES]
    for i, rep in enumerate(report):
        assert [n for n, _ in rep["top5"]] == [CLASSES[j] for j in probs[i].topk(5).indices]
        assert [p for _, p in rep["top5"]] == pytest.approx(probs[i].topk(5).values.tolist(),
                                                            abs=1e-5)
        tops = [CLASSES[j] for j in logits[i].argmax(-1)]
        assert [rep["evidence"][k]["top"] for k in keys] == tops
    assert len({rep["evidence"][k]["top"] for rep in report for k in keys}) > 1  # sets differ
    alpha = results["fusion_weights"]
    assert {k: v["alpha"] for k, v in report[0]["evidence"].items()} == pytest.approx(alpha)
    (tmp_path / "notes.txt").write_text("not an image")  # the advice: no dataset to fix here
    fails(capsys, "; pass image files", ["--load", rdir, str(tmp_path / "notes.txt")], predict.main)


@pytest.mark.parametrize("name, why", [
    ("mine.jpg", "give a new .png name"), ("photo.png", "give a new .png name, or a sheet this"),
    ("input", "give a new .png name"), ("sheet.png", None),
    ("notes.png", "give a new .png name, or a sheet this")])  # a user's file, not an image
def test_the_sheet_is_written_only_where_the_user_meant(fewshot, tmp_path, capsys, name, why):
    """--explain takes a new .png, or a sheet it wrote before; never an image given to classify
    (`--explain mine.jpg red.png` took the JPEG as the sheet's name), never a user's file."""
    rdir, image = fewshot[1], fewshot[3][0][0]
    Image.new("RGB", (8, 8), "red").save(tmp_path / "photo.png")
    (tmp_path / "notes.png").write_text("my notes")
    before = open(image, "rb").read()
    path = image if name == "input" else str(tmp_path / name)
    args = ["--load", rdir, "--explain", path, image]
    if why is None:  # a sheet written before is written again
        predict.main(args)
        assert Image.open(path).text["Software"] == predict.SHEET
        predict.main(args)
    else:
        fails(capsys, why, args, predict.main)
        assert open(image, "rb").read() == before
        assert (tmp_path / "notes.png").read_text() == "my notes"


def test_the_sheet_shows_the_crop_the_model_saw_on_its_patch_grid(fewshot, tmp_path):
    """A 96 x 32 image, a red disc at its left edge: CLIP's preprocess keeps the centre 32 x 32,
    so the sheet's image tile shows no red. Each map tile: the patch grid drawn in white, its
    colour from its own largest patch (the top of the scale), the crop in grey beneath."""
    rdir = fewshot[1]
    wide = np.full((32, 96, 3), 128, np.uint8)
    yy, xx = np.mgrid[:32, :96]
    wide[(yy - 16) ** 2 + (xx - 10) ** 2 < 64] = (230, 20, 20)
    Image.fromarray(wide).save(tmp_path / "wide.png")
    predict.main(["--load", rdir, "--explain", str(tmp_path / "s.png"), str(tmp_path / "wide.png")])
    page = np.asarray(Image.open(tmp_path / "s.png").convert("RGB"), dtype=int)
    T = predict.TILE
    assert (np.abs(page[32 : 32 + T, :T] - 128) <= 2).all()  # grey: the disc was cropped away
    tiles = (page.shape[1] - 110) // T  # the image, then a tile per map with heads
    assert tiles >= 2
    for x0 in range(T, tiles * T, T):
        tile = page[32 : 32 + T, x0 : x0 + T]
        assert (tile[:, T // 4] == 255).all() and (tile[T // 2] == 255).all()  # the 4 x 4 grid
        top = 0.35 * 128 + 0.65 * predict.HEAT[-1]  # the tile's own top patch: the scale's top
        assert np.abs(tile - top).sum(-1).min() <= 4


def test_attention_maps_equal_the_weights_computed_by_hand(world):
    """The explain maps are the last block's attention of CLS (all heads) and of each token (its
    expert heads) on the patches; a head a token is masked from contributes nothing."""
    heads = [("attribute", "color"), ("generalization", None), ("attribute", "shape"),
             ("mixed", None)]
    roles = {b: [{"role": r, "attribute": a} for r, a in heads] for b in (3, 4)}
    model = dear.DeAR(clip.model.build_model(tiny_state_dict(text_layers=4)), roles, J=3)
    images = torch.randn(2, 3, 32, 32)
    maps, heads = predict.attention_maps(model, images)
    x = model.token_blocks(model.frozen_prefix(images), stop=1)  # the input of block 4
    block = model.clip.visual.transformer.resblocks[3]
    _, w = block.attn(block.ln_1(x), attn_mask=model.mask(1), need_weights=True)  # [B, H, T, T]
    assert heads[1] == [0] and heads[2] == [2] and heads[3] == [3]  # experts; texture: mixed
    assert torch.allclose(maps[:, 1], w[:, 0, 1, 6:], atol=1e-6)
    assert torch.allclose(maps[:, 0], w[:, :, 0, 6:].mean(1))
    assert w[:, 1, 1:6, 6:].abs().max() == 0 and w[:, 0, 2, 6:].abs().max() == 0  # masked heads
    # no mixed head: a token without an expert has no head and an empty map; no roles: all mixed
    roles[4][3] = {"role": "generalization", "attribute": None}
    maps, heads = predict.attention_maps(dear.DeAR(model.clip, roles, J=3), images)
    assert heads[3] == [] and maps[:, 3].abs().max() == 0
    maps, heads = predict.attention_maps(dear.DeAR(model.clip, None, J=3, mask="none"), images)
    assert heads[1:] == [[0, 1, 2, 3]] * 5 and maps.isfinite().all()


def test_the_colour_tokens_map_finds_the_object_on_the_quick_start_run(quick_start):
    """--explain's maps mean something: on the toy test images (the object in one quadrant of a
    4 x 4 patch grid) the colour token's map peaks in the object's quadrant far more often than
    chance (1/4)."""
    out, p = quick_start
    assert p.returncode == 0
    rdir = out / "b2n/toyworld/dear-default-shots16-seed1"
    c = dear.resolve(dear.Config(**runs.read_config(rdir, dear.CONFIG)["config"], device="cpu"))
    model = dear.build(c, lambda line: None, rdir / "roles.json", rdir / "model.pt")[0]
    ds = data.build_dataset("toyworld", str(out.parent / "data"), subsample="novel")
    items = ds.test[::4]  # 96 images
    images = torch.stack([clip.transform(32)(data.open_image(f)) for f, _, _ in items])
    maps, heads = predict.attention_maps(model, images)  # [B, 1+K, 16]
    peak = maps[:, 1].argmax(-1)  # the colour token's
    quadrant = (peak // 4 >= 2) * 2 + (peak % 4 >= 2)  # top left, top right, bottom left, right
    where = toyworld.factor_labels([f for f, _, _ in items])["location"]
    assert heads[1] and (quadrant == where).float().mean() > 0.5

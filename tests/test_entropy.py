"""Tests of entropy.py: the head decomposition, TextSpan, concept entropy, roles, the roles file and the CLI."""
import json
import math
import os
import re

import pytest
import torch
from PIL import Image

import entropy
from entropy import CONCEPTS, EntropyError, RolesError


# ---------------------------------------------------------------------------------------------- decomposition

def perturb_ln_post(model, seed=0):
    """Give ln_post a non-trivial weight and bias, so the test sees the LayerNorm treatment."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.visual.ln_post.weight.copy_(1 + 0.5 * torch.randn(model.visual.width, generator=g))
        model.visual.ln_post.bias.copy_(0.3 * torch.randn(model.visual.width, generator=g))
    return model


@pytest.mark.parametrize("layers", [[1, 2, 3, 4], [2, 3], [4]])
def test_heads_mlps_and_biases_add_up_to_the_image_embedding(tiny_model, layers):
    model = perturb_ln_post(tiny_model)
    images = torch.randn(6, 3, 32, 32)
    parts = entropy.decompose(model, images, layers)
    assert parts["heads"].shape == (6, len(layers), 4, 32)  # [B, nL, H, E]
    with torch.no_grad():
        embedding = model.encode_image(images)
    torch.testing.assert_close(entropy.sum_parts(parts), embedding, atol=1e-5, rtol=1e-5)
    # no single part explains the embedding: the heads matter
    assert parts["heads"].abs().sum() > 0.01 * embedding.abs().sum()


def test_head_contributions_do_not_depend_on_which_other_blocks_are_analysed(tiny_model):
    images = torch.randn(4, 3, 32, 32)
    alone = entropy.head_contributions(tiny_model, images, [3])
    together = entropy.head_contributions(tiny_model, images, [1, 2, 3, 4])
    torch.testing.assert_close(alone[:, 0], together[:, 2], atol=1e-6, rtol=1e-5)


def test_head_contributions_are_in_units_of_the_normalised_embedding(tiny_model):
    images = torch.randn(4, 3, 32, 32)
    parts = entropy.decompose(tiny_model, images, [1, 2, 3, 4])
    scaled = entropy.head_contributions(tiny_model, images, [1, 2, 3, 4])
    norm = entropy.sum_parts(parts).norm(dim=-1)  # [B]
    torch.testing.assert_close(scaled * norm.view(-1, 1, 1, 1), parts["heads"], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- TextSpan

def planted(N=400, E=64, T=300, picks=(17, 123, 250, 5), scales=(4.0, 3.0, 2.0, 1.0), noise=0.02, seed=0):
    """Contributions made of known text directions (largest variance first) plus small noise."""
    g = torch.Generator().manual_seed(seed)
    texts = torch.nn.functional.normalize(torch.randn(T, E, generator=g), dim=-1)
    coeffs = torch.randn(N, len(picks), generator=g) * torch.tensor(scales)  # [N, k]
    contributions = coeffs @ texts[list(picks)] + noise * torch.randn(N, E, generator=g) + 5.0  # offset: centring
    return contributions, texts


def test_textspan_recovers_planted_texts_in_order_of_variance():
    contributions, texts = planted()
    assert entropy.textspan(contributions, texts, n=4, rank=80) == [17, 123, 250, 5]
    # a rank that still holds the planted span gives the same answer
    assert entropy.textspan(contributions, texts, n=4, rank=8) == [17, 123, 250, 5]


def test_textspan_never_picks_a_text_twice_and_starts_with_the_planted_ones():
    contributions, texts = planted()
    picks = entropy.textspan(contributions, texts, n=20, rank=64)
    assert len(picks) == len(set(picks)) == 20
    assert picks[:4] == [17, 123, 250, 5]


def test_textspan_stops_clearly_with_too_few_images():
    contributions, texts = planted(N=10)
    with pytest.raises(EntropyError, match="at least n \\+ 1 = 21 probe images"):
        entropy.textspan(contributions, texts, n=20)
    with pytest.raises(EntropyError, match="needs rank >= n"):
        entropy.textspan(contributions, texts, n=5, rank=3)


# ---------------------------------------------------------------------------------------------- entropy, roles

def test_concept_entropy_of_known_distributions():
    assert entropy.concept_entropy([1.0] + [0.0] * 11) == 0.0
    assert entropy.concept_entropy([0.5, 0.5]) == pytest.approx(1.0)
    assert entropy.concept_entropy([1 / 12] * 12) == pytest.approx(math.log2(12))
    assert entropy.concept_entropy({"color": 0.25, "shape": 0.25, "animal": 0.5}) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        entropy.concept_entropy([0.5, 0.6])


def test_concept_distribution_counts_shares_of_a_heads_texts():
    P = entropy.concept_distribution(["color"] * 15 + ["shape"] * 5)
    assert list(P) == list(CONCEPTS)
    assert P["color"] == 0.75 and P["shape"] == 0.25 and sum(P.values()) == pytest.approx(1.0)
    assert entropy.concept_entropy(P) == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))


def test_roles_by_thresholds_and_the_other_specialist_rule():
    low, high = 1.0, 2.0
    assert entropy.assign_role(0.5, {"texture": 0.9, "animal": 0.1}, low, high) == \
        {"role": "attribute", "attribute": "texture"}
    assert entropy.assign_role(1.0, {"animal": 0.8, "color": 0.2}, low, high) == \
        {"role": "specialist", "attribute": None, "concept": "animal"}  # low entropy, not one of the five
    assert entropy.assign_role(1.5, {"color": 1.0}, low, high)["role"] == "mixed"
    assert entropy.assign_role(2.0, {"color": 1.0}, low, high)["role"] == "generalization"
    # a tie for the dominant concept goes to the concept listed first (attributes before the others)
    assert entropy.assign_role(1.0, {"animal": 0.5, "location": 0.5}, low, high)["attribute"] == "location"


def test_default_thresholds_are_the_tertiles_of_the_heads_entropies():
    low, high = entropy.default_thresholds([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert (low, high) == pytest.approx((2.0, 4.0))


# ---------------------------------------------------------------------------------------------- text pools

def test_builtin_pool_covers_the_12_concepts_with_unique_descriptions():
    texts, labels = entropy.default_pool()
    assert 1000 <= len(texts) <= 3000
    assert len({t.lower() for t in texts}) == len(texts)
    counts = {c: labels.count(c) for c in CONCEPTS}
    assert min(counts.values()) >= 50, counts
    assert set(labels) == set(CONCEPTS)


def test_toy_pool_speaks_the_toy_worlds_words():
    toyworld = pytest.importorskip("toyworld")
    texts, labels = entropy.toy_pool()
    assert set(labels) == {"color", "shape", "texture", "location"}
    for word in toyworld.COLORS + toyworld.SHAPES + toyworld.LOCATIONS:
        assert any(word in t for t in texts), word
    assert len(set(texts)) == len(texts)


@pytest.mark.parametrize("content, message", [
    ("a red car\n\na dog\n", "line 2: empty description"),
    ("a red car\na dog\nA red car\n", "line 3: 'A red car' repeats line 1"),
    ("colour\ta red car\n", "unknown concept 'colour'"),
])
def test_bad_text_pools_are_refused_with_the_line(tmp_path, content, message):
    path = tmp_path / "pool.txt"
    path.write_text(content)
    with pytest.raises(EntropyError, match=message):
        entropy.read_pool(str(path))


def test_user_texts_get_the_concept_of_the_nearest_centroid():
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(3, 16, generator=g), dim=-1)
    ref = torch.cat([centres[i] + 0.1 * torch.randn(10, 16, generator=g) for i in range(3)])
    ref_labels = ["color"] * 10 + ["animal"] * 10 + ["scene"] * 10
    queries = centres[[2, 0, 1]] + 0.05 * torch.randn(3, 16, generator=g)
    assert entropy.label_by_centroid(queries, ref, ref_labels) == ["scene", "color", "animal"]


# ---------------------------------------------------------------------------------------------- roles file

def make_doc(layers=(3, 4), H=4, model="tiny"):
    roles = [("attribute", "color"), ("generalization", None), ("mixed", None), ("specialist", None)]
    heads = []
    for i, layer in enumerate(layers):
        for h in range(H):
            role, attribute = roles[(h + i) % len(roles)]
            P = {c: 0.0 for c in CONCEPTS}
            P["color" if role != "specialist" else "animal"] = 1.0
            entry = {"layer": layer, "head": h, "entropy": 0.25 * (h + i), "P": P, "texts": ["a red object"],
                     "role": role, "attribute": attribute}
            if role == "specialist":
                entry["concept"] = "animal"
            heads.append(entry)
    return {"format": entropy.FORMAT, "model": model, "checkpoint_sha256": "0" * 64, "num_layers": 4,
            "num_heads": H, "layers": list(layers), "probe": {"dataset": "toy", "split": "test", "images": 8},
            "texts_per_head": 1, "rank": 80, "concepts": list(CONCEPTS),
            "thresholds": {"low": 0.3, "high": 0.6}, "heads": heads}


def test_roles_round_trip(tmp_path):
    doc = make_doc()
    path = entropy.write_outputs(doc, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["roles.json", "roles.md", "roles.png"]  # no temp files left
    roles = entropy.load_roles(path, model_name="tiny", num_layers=4, num_heads=4, layers=[3, 4])
    assert sorted(roles) == [3, 4] and all(len(r) == 4 for r in roles.values())
    for entry in doc["heads"]:
        got = roles[entry["layer"]][entry["head"]]
        assert (got["role"], got["attribute"]) == (entry["role"], entry["attribute"])
    assert roles[3][3]["concept"] == "animal"
    md = (tmp_path / "roles.md").read_text()
    assert "| 3 | A:color 0.00 | G 0.25 | M 0.50 | S:animal 0.75 |" in md


def corrupt(doc, what):
    if what == "format":
        doc["format"] = "something-else/1"
    elif what == "role":
        doc["heads"][1]["role"] = "boss"
    elif what == "attribute":
        doc["heads"][0]["attribute"] = None
    elif what == "attribute-on-mixed":
        doc["heads"][2]["attribute"] = "shape"
    elif what == "head-missing":
        del doc["heads"][5]
    elif what == "head-twice":
        doc["heads"][5] = dict(doc["heads"][4])
    return doc


@pytest.mark.parametrize("what, kwargs, message", [
    ("format", {}, "not a roles file of format 'dear-roles/1'"),
    (None, {"model_name": "ViT-B/16"}, "computed for 'tiny', not 'ViT-B/16'"),
    (None, {"num_layers": 12}, "num_layers = 4, the model has 12"),
    (None, {"num_heads": 12}, "num_heads = 4, the model has 12"),
    (None, {"layers": [2, 3, 4]}, "blocks \\[2\\] are needed"),
    ("role", {}, "unknown role 'boss'"),
    ("attribute", {}, "an attribute head needs an attribute"),
    ("attribute-on-mixed", {}, "a mixed head must have attribute null"),
    ("head-missing", {}, "lacks 1 heads, e.g. block 4 head 1"),
    ("head-twice", {}, "listed twice"),
])
def test_load_roles_refuses_bad_files_clearly(tmp_path, what, kwargs, message):
    path = tmp_path / "roles.json"
    path.write_text(json.dumps(corrupt(make_doc(), what)))
    with pytest.raises(RolesError, match=message):
        entropy.load_roles(str(path), **kwargs)


def test_load_roles_on_a_missing_or_broken_file(tmp_path):
    with pytest.raises(RolesError, match="does not exist"):
        entropy.load_roles(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(RolesError, match="not readable JSON"):
        entropy.load_roles(str(tmp_path / "bad.json"))


def test_png_is_a_grid_of_blocks_by_heads_coloured_by_role(tmp_path):
    doc = make_doc(layers=(2, 3, 4), H=4)
    entropy.write_outputs(doc, str(tmp_path))
    img = Image.open(tmp_path / "roles.png").convert("RGB")
    assert img.size == (max(entropy.LEFT + 4 * entropy.CELL, 480) + 8,
                        entropy.TOP + 3 * entropy.CELL + entropy.LEGEND)
    for entry in doc["heads"]:
        x0, y0 = entropy.cell_origin(doc["layers"].index(entry["layer"]), entry["head"])
        corner = (x0 + entropy.CELL - 6, y0 + entropy.CELL - 6)  # inside the cell, away from its text
        assert img.getpixel(corner) == entropy.ROLE_COLORS[entry["role"]]


def test_default_roles_path_and_layer_parsing(tmp_path):
    path = entropy.default_roles_path("ViT-B/16", [9, 10, 11, 12], str(tmp_path))
    assert path == os.path.join(str(tmp_path), "roles", "ViT-B-16_L9-12", "roles.json")
    assert entropy.parse_layers(None, 12) == [9, 10, 11, 12]
    assert entropy.parse_layers(None, 2) == [1, 2]
    assert entropy.parse_layers("9-10,12", 12) == [9, 10, 12]
    with pytest.raises(EntropyError, match="has 4 blocks"):
        entropy.parse_layers("3-6", 4)


# ---------------------------------------------------------------------------------------------- command line

@pytest.fixture
def fake_world(tmp_path, monkeypatch, tiny_model):
    """A two-class image folder (12 test images after data.py's split) and clip.load returning the tiny model."""
    clip = pytest.importorskip("clip")
    pytest.importorskip("data")
    g = torch.Generator().manual_seed(0)
    folder = tmp_path / "images"
    for c, name in enumerate(["red", "blue"]):
        (folder / name).mkdir(parents=True)
        for i in range(20):
            pixels = (torch.rand(32, 32, 3, generator=g) * 128).byte()
            pixels[..., c * 2] += 100  # the two classes differ in colour
            Image.fromarray(pixels.numpy()).save(folder / name / f"{i:02d}.png")
    tiny_model.name, tiny_model.sha256 = "tiny", "ab" * 32
    monkeypatch.setattr(clip, "load", lambda *a, **k: (tiny_model, None))
    return tmp_path, f"folder:{folder}"


def test_cli_writes_roles_json_md_and_png(fake_world, capsys):
    root, dataset = fake_world
    out = root / "out"
    rc = entropy.main(["--backbone", "tiny", "--dataset", dataset, "--root", str(root), "--out", str(out),
                       "--pool", "toy", "--n", "5", "--rank", "16", "--max-images", "10", "--batch-size", "4",
                       "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["roles.json", "roles.md", "roles.png"]
    doc = json.loads((out / "roles.json").read_text())
    assert doc["model"] == "tiny" and doc["checkpoint_sha256"] == "ab" * 32
    assert doc["layers"] == [1, 2, 3, 4] and doc["num_heads"] == 4 and len(doc["heads"]) == 16
    assert doc["probe"]["images"] == 10 and doc["probe"]["split"] == "test"
    low, high = doc["thresholds"]["low"], doc["thresholds"]["high"]
    toy_texts, toy_labels = entropy.toy_pool()
    concept_of = dict(zip(toy_texts, toy_labels))
    for head in doc["heads"]:
        assert len(head["texts"]) == len(set(head["texts"])) == 5
        # the stored P and entropy follow from the stored texts, and the role from the thresholds
        assert head["P"] == pytest.approx(entropy.concept_distribution([concept_of[t] for t in head["texts"]]))
        assert head["entropy"] == pytest.approx(entropy.concept_entropy(head["P"]), abs=1e-4)
        want = entropy.assign_role(head["entropy"], head["P"], low, high)
        assert (head["role"], head["attribute"]) == (want["role"], want["attribute"])
    roles = entropy.load_roles(str(out / "roles.json"), model_name="tiny", num_layers=4, num_heads=4)
    assert sum(h["role"] == "generalization" for r in roles.values() for h in r) >= 1  # the top tertile


@pytest.mark.parametrize("extra, message", [
    (["--low", "2", "--high", "1"], "--low 2.0 is above --high 1.0"),
    (["--layers", "3-6"], "the backbone has 4 blocks"),
    (["--n", "30"], "at least n \\+ 1 = 31 probe images"),
    (["--texts", "DUP"], "repeats line 1"),
])
def test_cli_bad_input_exits_2_with_one_message(fake_world, capsys, extra, message):
    root, dataset = fake_world
    if "DUP" in extra:
        (root / "dup.txt").write_text("a red thing\na red thing\n")
        extra = ["--texts", str(root / "dup.txt")]
    rc = entropy.main(["--dataset", dataset, "--root", str(root), "--out", str(root / "out"), "--pool", "toy",
                       "--device", "cpu"] + extra)
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("entropy.py: error: ") and sum("error" in line for line in lines) == 1
    assert re.search(message, lines[-1]), err
    assert not (root / "out").exists()


def test_cli_without_images_exits_2(fake_world, capsys):
    root, _ = fake_world
    (root / "empty").mkdir()
    rc = entropy.main(["--dataset", f"folder:{root / 'empty'}", "--root", str(root), "--device", "cpu"])
    assert rc == 2 and "error" in capsys.readouterr().err

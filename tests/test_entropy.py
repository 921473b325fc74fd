"""Tests of entropy.py: the PRS decomposition, TextSpan against a restatement of the official
algorithm, concept entropy and roles, the controls, the roles file, the cache and the report."""

import json
import math
import os
import random
import types

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn.functional import normalize

import clip
import data
import dear
import entropy
import runs
import toyworld
from conftest import reviewed, tiny_clip
from entropy import CONCEPTS


def perturbed(seed=0, blocks=4):
    """A tiny CLIP (4 heads, width 64, E = 32) whose ln_post, biases and eps are not the identity
    / zero / tiny that the random init leaves, so every term of the PRS shares shows."""
    model = tiny_clip(seed=seed, vision_layers=blocks)
    visual, g = model.visual, torch.Generator().manual_seed(seed)
    with torch.no_grad():
        visual.ln_post.weight.copy_(1 + 0.5 * torch.randn(64, generator=g))
        visual.ln_post.bias.copy_(0.3 * torch.randn(64, generator=g))
        visual.ln_post.eps = 0.5  # var + eps inside the root, not var - eps or var alone
        for block in visual.transformer.resblocks:
            block.attn.out_proj.bias.copy_(0.5 * torch.randn(64, generator=g))
            block.attn.in_proj_bias.copy_(0.2 * torch.randn(192, generator=g))
    model.name, model.sha256 = "tiny", "ab" * 32
    return model


# ------------------------------------------------------------------------------ decomposition

@pytest.mark.parametrize("layers", [[1, 2, 3, 4], [2, 3], [4]])
def test_the_parts_add_up_to_the_image_embedding(layers):
    model, images = perturbed(), torch.randn(5, 3, 32, 32)
    heads, rest = entropy.decompose(model, images, layers)
    assert heads.shape == (5, len(layers), 4, 32) and rest.shape == (5, 32)  # [B, nL, H, E], [B, E]
    with torch.no_grad():
        embedding = model.encode_image(images)
    torch.testing.assert_close(heads.sum((1, 2)) + rest, embedding, atol=1e-5, rtol=1e-5)
    assert heads.abs().sum() > 0.01 * embedding.abs().sum()  # the heads matter
    scaled, whole = entropy.head_contributions(model, images, layers)  # over the embedding's norm
    torch.testing.assert_close(scaled * embedding.norm(dim=-1).view(-1, 1, 1, 1), heads, atol=1e-6,
                               rtol=1e-5)
    torch.testing.assert_close(whole, normalize(embedding, dim=-1))


def test_one_head_by_hand_as_textspans_prs_logger():
    """Block 3 (1-based), head 1, from the description of TextSpan's prs_hook.py: the head's
    attention at CLS through its out_proj columns, plus out_proj.bias / H; minus mean(r) /
    ((2L+1) H) with L = 4, all blocks of the model (only blocks 2-3 are analysed); times
    ln_post.weight / std(r); plus ln_post.bias / ((2L+1) H); @ proj; divided by the norm of the
    image embedding."""
    model = perturbed()
    visual, blocks = model.visual, model.visual.transformer.resblocks
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    L, H, D, hs, b, h = 4, 4, 64, 16, 2, 1  # b: 0-based index of block 3
    with torch.no_grad():
        x = visual.embed(images)
        for block in blocks[:b]:
            x = block(x)
        attn, y = blocks[b].attn, blocks[b].ln_1(x)
        W, c = attn.in_proj_weight, attn.in_proj_bias
        cols = slice(h * hs, (h + 1) * hs)  # head h's rows of W_q, W_k, W_v and columns of W_O
        q, k, v = (y @ W.view(3, D, D)[i, cols].T + c.view(3, D)[i, cols] for i in range(3))
        a = torch.softmax((q[:, :1] @ k.mT)[:, 0] / math.sqrt(hs), dim=-1)  # CLS row [B, T]
        head = (a[:, :, None] * v).sum(1) @ attn.out_proj.weight[:, cols].T + attn.out_proj.bias / H
        for block in blocks[b:]:
            x = block(x)
        r, mean = x[:, 0], x[:, 0].mean(-1, keepdim=True)  # [B, D], [B, 1]
        std = (((r - mean) ** 2).mean(-1, keepdim=True) + visual.ln_post.eps).sqrt()
        n, w, beta = 2 * L + 1, visual.ln_post.weight, visual.ln_post.bias
        norm = model.encode_image(images).norm(dim=-1, keepdim=True)
        want = ((head - mean / (n * H)) * w / std + beta / (n * H)) @ visual.proj / norm
    got = entropy.head_contributions(model, images, [2, 3])[0]  # block 3: the second analysed
    torch.testing.assert_close(got[:, 1, h], want, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------- TextSpan

def textspan_by_hand(data, texts, n, rank, departure=None):
    """TextSpan's `replace_with_iterative_removal` restated in numpy: SVD of the raw
    contributions, texts projected onto the top-`rank` right singular vectors, then the
    contributions centred; n times: pick the text whose projection has the largest std across
    images, remove its direction from the contributions and every text. departure: one of two
    plausible ones, "centre_first" or "no_deflation"."""
    data, texts = np.asarray(data, dtype=np.float64), np.asarray(texts, dtype=np.float64)
    if departure == "centre_first":
        data = data - data.mean(0)
    vh = np.linalg.svd(data, full_matrices=False)[2][:rank]  # [r, E]
    texts = texts @ vh.T @ vh
    data, picks = data - data.mean(0), []
    for _ in range(n):
        scores = (data @ texts.T).std(0)
        if departure == "no_deflation":
            scores[picks] = -1
        picks.append(int(np.argmax(scores)))
        if departure != "no_deflation":
            t = texts[picks[-1]]
            data, texts = (m - np.outer(m @ t / (t @ t), t) for m in (data, texts))
    return picks


def stream(contributions, sizes):
    """GramStatistics of contributions [N, ...] fed in batches of the given sizes (cycled)."""
    stats = entropy.GramStatistics(contributions.shape[1:-1], contributions.shape[-1])
    i, k = 0, 0
    while i < len(contributions):
        stats.add(contributions[i : i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return stats


@pytest.mark.parametrize("N, E, n, rank", [(60, 12, 5, 6), (8, 12, 3, 10)])  # 8 < 10: 8 directions
def test_textspan_picks_what_textspans_iterative_removal_picks(N, E, n, rank):
    differs = {"centre_first": 0, "no_deflation": 0}
    for seed in range(6):
        # contributions with unequal variances and a sizeable mean (as real heads have); 40 random
        # unit texts in few dimensions, far from orthogonal
        g = np.random.default_rng(seed)
        c = g.normal(size=(N, E)) * np.linspace(3, 0.2, E) @ np.linalg.qr(g.normal(size=(E, E)))[0]
        texts, contributions = g.normal(size=(40, E)), c + 4 * g.normal(size=E)
        texts /= np.linalg.norm(texts, axis=1, keepdims=True)
        want = textspan_by_hand(contributions, texts, n, rank)
        for sizes in ([N], [3, 1, 5]):  # all contributions at once, streamed in uneven batches
            stats = stream(torch.tensor(contributions), sizes)
            got = entropy.textspan_from_statistics(*stats.head(()), torch.tensor(texts), n, rank)
            assert got == want, (seed, sizes)
        for departure in differs:
            differs[departure] += textspan_by_hand(contributions, texts, n, rank, departure) != want
    if N > rank:
        assert min(differs.values()) >= 3, differs  # the data tell both departures from TextSpan


def test_streamed_statistics_are_those_of_the_stored_contributions():
    """Uneven batches of contributions with a mean 1000x their spread: count, mean, centred scatter
    and uncentred Gram equal numpy's fp64 on the whole matrix (fp32 sums would be off by ~1e-4)."""
    g = np.random.default_rng(3)
    C = g.normal(size=(61, 2, 3, 5)) * g.uniform(0.5, 2, size=5) + 1000 * g.normal(size=(2, 3, 5))
    stats = stream(torch.tensor(C, dtype=torch.float32).double(), [7, 1, 13, 2])
    C = torch.tensor(C, dtype=torch.float32).double().numpy()
    for li, h in np.ndindex(2, 3):
        (count, mean, scatter), c = stats.head((li, h)), C[:, li, h]
        centred = c - c.mean(0)
        assert count == 61
        np.testing.assert_allclose(mean.numpy(), c.mean(0), rtol=1e-12)
        np.testing.assert_allclose(scatter.numpy(), centred.T @ centred, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose((scatter + count * torch.outer(mean, mean)).numpy(), c.T @ c,
                                   rtol=1e-12)


def test_compute_roles_on_streamed_images_equals_the_stored_path_by_hand(monkeypatch):
    """23 images in batches of 5 against every image's contributions stored in one array:
    TextSpan restated on each head's matrix, entropy by hand, thresholds the 1/3 and 2/3 linear
    quantiles; the ground-truth probe on the stored contributions; each head's mean-ablation
    (TextSpan's: its contribution replaced by its mean over the images) by hand, in points of
    zero-shot accuracy against 3 class features."""
    model = perturbed()
    # 40 texts with random unit embeddings (encode_texts replaced), their concepts unequal
    vectors = normalize(torch.randn(40, 32, generator=torch.Generator().manual_seed(0)), dim=-1)
    texts = [f"text {j}" for j in range(40)]
    concepts = [CONCEPTS[j % 7] if j < 28 else "color" for j in range(40)]
    monkeypatch.setattr(entropy, "encode_texts",
                        lambda model, batch: vectors[[texts.index(t) for t in batch]])
    images = torch.randn(23, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    stored, whole = entropy.head_contributions(model, images, [3, 4])  # [23, 2, 4, E], [23, E]
    # 3 classes along three images' departures from the mean, each image labelled by them: every
    # head's departure matters, unequally
    classes = normalize(whole[:3] - whole.mean(0), dim=-1)
    labels = (whole @ classes.t()).argmax(-1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels),
                                         batch_size=5)
    factors = {"parity": [i % 2 for i in range(23)]}  # ground truth; folds drawn by the seed
    options = dict(n=4, rank=6, low=None, high=None, seed=5)
    doc = entropy.compute_roles(model, loader, (texts, concepts), [3, 4], options, classes,
                                factors, lambda line: None)
    decoded = entropy.probe_factors(stored, factors, seed=5)["accuracy"]["parity"]
    assert [e["decoding"]["parity"] for e in doc["heads"]] == decoded[0] + decoded[1]
    right = lambda f: 100 * float(((f @ classes.t()).argmax(-1) == labels).float().mean())
    assert (doc["ablation"]["zero_shot"], doc["ablation"]["images"]) == (round(right(whole), 4), 23)
    costs = [right(whole) - right(whole - stored[:, li, h] + stored[:, li, h].mean(0))
             for li in range(2) for h in range(4)]
    assert [e["ablation"] for e in doc["heads"]] == pytest.approx(costs, abs=1e-3)
    assert len(set(costs)) > 2 and min(costs) > 0  # they differ: the comparison means something
    for role, v in doc["ablation"]["by_role"].items():
        mine = [c for c, e in zip(costs, doc["heads"]) if e["role"] == role]
        assert v == {"mean": pytest.approx(sum(mine) / len(mine), abs=1e-3), "heads": len(mine)}
    stored, want = stored.double().numpy(), {}
    for li, h in np.ndindex(2, 4):  # blocks 3 + li
        picks = textspan_by_hand(stored[:, li, h], vectors.double().numpy(), n=4, rank=6)
        shares = [sum(concepts[j] == c for j in picks) / 4 for c in CONCEPTS]
        want[3 + li, h] = ([texts[j] for j in picks], dict(zip(CONCEPTS, shares)),
                           round(-sum(p * math.log2(p) for p in shares if p > 0), 4))
    low, high = np.quantile([H for *_, H in want.values()], [1 / 3, 2 / 3])
    assert doc["thresholds"] == {"low": round(low, 4), "high": round(high, 4)}
    assert doc["concepts"] == list(CONCEPTS)
    for e in doc["heads"]:
        assert (e["texts"], e["P"], e["entropy"]) == want[e["layer"], e["head"]]
        assert e["role"] == entropy.assign_role(e["entropy"], e["P"], low, high)["role"]
    assert len({tuple(t) for t, *_ in want.values()}) > 4  # the heads differ: a real comparison


# ----------------------------------------------------------------------------- entropy, roles

@pytest.mark.parametrize("concepts, low, high, H, role", [
    (["texture"] * 4, 0.5, 1.5, 0.0, ("attribute", "texture")),
    (["animal"] * 3 + ["color"], 1.0, 1.5, 0.8113, ("specialist", None)),  # dominant: no attribute
    (["color", "shape"] * 2, 1.0, 1.5, 1.0, ("attribute", "color")),  # H = low; a tie: listed first
    (["animal", "location"], 1.0, 1.5, 1.0, ("attribute", "location")),  # attributes come first
    (["color", "shape", "texture"], 1.0, 2.0, 1.585, ("mixed", None)),
    (["color", "shape", "texture", "animal"], 1.0, 2.0, 2.0, ("generalization", None)),  # H = high
    (["color", "shape", "texture", "animal"], 1.0, 2.5, 2.0, ("mixed", None))])
def test_entropy_in_bits_and_roles_by_thresholds(concepts, low, high, H, role):
    P = entropy.concept_distribution(concepts)
    assert list(P) == list(CONCEPTS) and sum(P.values()) == pytest.approx(1)
    assert entropy.concept_entropy(P) == pytest.approx(H, abs=1e-4)
    got = entropy.assign_role(entropy.concept_entropy(P), P, low, high)
    assert (got["role"], got["attribute"]) == role
    assert role[0] != "specialist" or got["concept"] == "animal"


def test_default_thresholds_are_the_linear_tertiles():
    """Sorted positions 7/3 and 14/3 of 8 unsorted entropies: 1 + (3 - 1) / 3 and 4 + 0.5 * 2/3.
    numpy's other rules (lower, higher, nearest, midpoint) give other values here."""
    entropies = [4.5, 0.0, 7.0, 1.0, 8.0, 3.0, 0.5, 4.0]
    assert entropy.default_thresholds(entropies) == pytest.approx((5 / 3, 13 / 3), abs=1e-12)


def test_user_texts_take_the_concept_of_the_nearest_normalised_centroid():
    """30 colour texts (one next to the query) against 3 spread scene texts. Nearest normalised
    centroid: scene. The unnormalised sum or mean, or the nearest single text, would say colour."""
    g, e = torch.Generator().manual_seed(0), torch.eye(16)
    color = [e[0] + 0.05 * torch.randn(16, generator=g) for _ in range(29)]
    color += [0.6 * e[0] + 0.8 * e[1] + 0.05 * e[2]]
    ref = normalize(torch.stack(color + [e[1] + e[2], e[1] - e[2], e[1] + e[3]]), dim=-1)
    queries = torch.stack([0.6 * e[0] + 0.8 * e[1], e[0] + 0.1 * e[1]])
    got = entropy.label_by_centroid(queries, ref, ["color"] * 30 + ["scene"] * 3)
    assert got == ["scene", "color"]


def test_a_users_pool_keeps_its_concepts_and_labels_the_rest_by_the_builtin(monkeypatch, tmp_path):
    """The rest take the nearest built-in centroid in the model's text space (here a lookup)."""
    space = {"red": [1.0, 0, 0], "round": [0, 1.0, 0], "crimson": [0.9, 0.1, 0],
             "ball": [0.1, 0.9, 0.1], "mine": [0, 0, 1.0]}
    monkeypatch.setattr(entropy, "encode_texts", lambda model, texts: torch.tensor(
        [space[t] for t in texts]) * (model == "the model"))  # another model: all texts at 0
    builtin = [("red", "color"), ("round", "shape")]
    user = [("crimson", None), ("mine", "scene"), ("ball", None)]
    assert entropy.label_pool("the model", builtin, user) == (["crimson", "mine", "ball"],
                                                              ["color", "scene", "shape"])
    assert entropy.label_pool("the model", builtin) == (["red", "round"], ["color", "shape"])
    # read from files: the built-in pool, a user's (concepts optional), one of unknown concepts
    texts, concepts = zip(*entropy.read_pool(entropy.POOL))
    assert set(concepts) == set(CONCEPTS) and len(set(texts)) == len(texts) > 1000
    (tmp_path / "mine.txt").write_text("# mine\nshape\ta round thing\n\na striped cat\n")
    assert entropy.read_pool(tmp_path / "mine.txt") == [("a round thing", "shape"),
                                                        ("a striped cat", None)]
    (tmp_path / "bad.txt").write_text("colour\ta red thing\n")
    with pytest.raises(data.UserError, match="unknown concepts \\['colour'\\]"):
        entropy.read_pool(tmp_path / "bad.txt")


def test_texts_are_encoded_in_batches_as_clip_encodes_each_alone():
    """Texts of several lengths, one longer than the 16-position text tower (cut, keeping EOT), in
    batches of 2 that do not divide the 5 texts; each normalised on its own."""
    model = tiny_clip(context_length=16)
    long = "a very long text about a small red bird on a thin branch of an old tree"
    texts = ["red", "a striped tail", "round", long, "blue and shiny"]
    got = entropy.encode_texts(model, texts, batch_size=2)  # [5, E]
    with torch.no_grad():
        want = [model.encode_text(clip.tokenize(t, 16, truncate=True)) for t in texts]
    torch.testing.assert_close(got, normalize(torch.cat(want), dim=-1), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------- controls

def test_random_roles_shuffle_each_block_on_its_own():
    """Each block keeps its own roles (not one shuffle of all blocks pooled), the blocks get other
    permutations (not one reused), and the seed decides."""
    mix = {3: "AAAMMGSM", 4: "GGGGMAMM"}
    names = {"A": "attribute", "G": "generalization", "M": "mixed", "S": "specialist"}
    roles = {b: [{"role": names[r], "attribute": "color" if r == "A" else None,
                  "entropy": 10 * b + h} for h, r in enumerate(rs)] for b, rs in mix.items()}
    out = entropy.control_roles(roles, "random", 7)
    perms = {b: [int(e["entropy"]) - 10 * b for e in out[b]] for b in out}
    for b in roles:
        assert sorted(e["role"] for e in out[b]) == sorted(names[r] for r in mix[b])
        assert sorted(perms[b]) == list(range(8))
    assert perms[3] != perms[4] and list(range(8)) not in perms.values()
    again = [entropy.control_roles(roles, "random", seed) for seed in (7, 8)]
    assert again[0] == out != again[1]


def test_probe_skill_is_chance_normalised_so_more_values_are_not_penalised():
    """One-hot features of 4 cells; in each, 7 of 12 images share a colour (4 balanced values,
    chance 1/4) and 8 of 12 a shape (2 values, chance 1/2). Held-out accuracy ranks shape first
    (8/12 > 7/12); skill = (accuracy - chance) / (1 - chance) ranks colour first (4/9 > 1/3), and
    the report's best factor is the colour."""
    cells, colors, shapes = [], [], []
    for k in range(4):
        cells += [k] * 12
        colors += [k] * 7 + [(k + 1) % 4] * 2 + [(k + 2) % 4] * 2 + [(k + 3) % 4]
        shapes += [k % 2] * 8 + [1 - k % 2] * 4
    X = torch.eye(4)[cells * 10].view(480, 1, 1, 4)  # [N, 1 block, 1 head, E]
    out = entropy.probe_factors(X, {"color": colors * 10, "shape": shapes * 10})
    assert out["accuracy"] == {"color": [[0.5833]], "shape": [[0.6667]]}
    assert out["chance"] == {"color": 0.25, "shape": 0.5}
    assert out["skill"] == {"color": [[0.4444]], "shape": [[0.3333]]}
    best = entropy.best_factor({f: s[0][0] for f, s in out["skill"].items()})
    assert best == ("color", pytest.approx(1 / 9, abs=1e-3))


def test_the_probe_is_ridge_least_squares_on_centred_folds_by_hand():
    """probe_factors restated with numpy a head at a time (its defaults: 2 folds, ridge 1), on
    features off the origin where centring, the ridge, the folds and each head's count matter."""
    g, N, E = np.random.default_rng(0), 40, 3
    labels, X = g.integers(0, 3, N), g.normal(size=(N, 1, 2, E)) + 3.0
    X[:, 0, 0] += np.eye(3)[labels] * 0.8  # head 0 reads the label a little, head 1 not at all
    out, Y = entropy.probe_factors(torch.tensor(X), {"f": labels.tolist()}), np.eye(3)[labels]
    fold = (torch.randperm(N, generator=torch.Generator().manual_seed(0)) % 2).numpy()
    for h in range(2):
        right = 0
        for k in range(2):
            tr, te, mu = fold != k, fold == k, X[fold != k, 0, h].mean(0)
            A, B = X[tr, 0, h] - mu, X[te, 0, h] - mu
            lam = np.trace(A.T @ A) / E  # the ridge (1) times the mean eigenvalue
            W = np.linalg.solve(A.T @ A + lam * np.eye(E), A.T @ (Y[tr] - Y[tr].mean(0)))
            right += ((B @ W + Y[tr].mean(0)).argmax(1) == labels[te]).sum()
        assert out["accuracy"]["f"][0][h] == round(right / N, 4)


# -------------------------------------------------------------------------- roles file, report

def make_doc(layers=(3, 4), H=4):
    heads, kinds = [], [("attribute", "color"), ("generalization", None), ("mixed", None),
                        ("specialist", None)]
    for i, block in enumerate(layers):
        for h in range(H):
            role, attribute = kinds[(h + i) % 4]
            P = dict.fromkeys(CONCEPTS, 0.0) | {"animal" if role == "specialist" else "color": 1.0}
            heads.append({"layer": block, "head": h, "entropy": 0.25 * (h + i), "P": P,
                          "texts": [f"text {block}.{h}"], "ablation": 0.5 * h - i, "role": role,
                          "attribute": attribute} | ({"concept": "animal"} if P["animal"] else {}))
    costs = {r: [e["ablation"] for e in heads if e["role"] == r] for r, _ in kinds}
    by_role = {r: {"mean": sum(c) / len(c), "heads": len(c)} for r, c in costs.items()}
    return {"format": entropy.FORMAT, "model": "tiny", "checkpoint_sha256": "ab" * 32,
            "num_layers": 4, "num_heads": H, "layers": list(layers),
            "probe": {"dataset": "toy", "split": "test", "images": 8}, "texts_per_head": 1,
            "rank": 80, "concepts": list(CONCEPTS), "thresholds": {"low": 0.3, "high": 0.6},
            "heads": heads, "ablation": {"zero_shot": 62.5, "images": 8, "by_role": by_role}}


def test_roles_round_trip(tmp_path):
    (tmp_path / "roles.json").write_text(json.dumps(make_doc()))
    roles = entropy.load_roles(tmp_path / "roles.json", num_layers=4, num_heads=4, layers=[4],
                               sha256="ab" * 32)
    assert sorted(roles) == [3, 4] and [e["head"] for e in roles[4]] == [0, 1, 2, 3]
    want = [("attribute", "color"), ("generalization", None), ("mixed", None), ("specialist", None)]
    assert [(e["role"], e["attribute"]) for e in roles[3]] == want


@pytest.mark.parametrize("corrupt, kwargs, message", [
    (lambda d: d.update(format="something/1"), {}, f"not a {entropy.FORMAT} file"),
    (lambda d: d.pop("heads"), {}, "the document lacks 'heads'"),
    (None, {"sha256": "cd" * 32}, "computed for checkpoint abab.*, not for this one \\(cdcd"),
    (None, {"num_heads": 12}, "for a model of 4 blocks x 4 heads, not None x 12"),
    (None, {"layers": [2, 3, 4]}, "has blocks \\[3, 4\\], not all of \\[2, 3, 4\\]"),
    (lambda d: d["heads"][5].update(head=4), {}, "block 4 head 4 is not one of its heads"),
    (lambda d: d["heads"].__setitem__(5, dict(d["heads"][4])), {}, "block 4 head 0 .* twice"),
    (lambda d: d["heads"].pop(5), {}, "lacks some heads"),
    (lambda d: d["heads"][1].update(role="boss"), {}, "block 3 head 1: role 'boss'"),
    (lambda d: d["heads"][2].update(attribute="shape"), {},
     "block 3 head 2: role 'mixed' with attribute 'shape'"),
    (lambda d: d["heads"][0].update(attribute=None), {},
     "block 3 head 0: role 'attribute' with attribute None"),
    (lambda d: d["heads"][0].update(attribute="animal"), {},
     "block 3 head 0: role 'attribute' with attribute 'animal'")])
def test_load_roles_refuses_files_it_cannot_use(tmp_path, corrupt, kwargs, message):
    doc = make_doc()
    if corrupt:
        corrupt(doc)
    (tmp_path / "roles.json").write_text(json.dumps(doc))
    with pytest.raises(data.UserError, match="^.*roles.json: " + message):
        entropy.load_roles(tmp_path / "roles.json", **kwargs)


def test_the_report_is_as_reviewed_and_its_map_shows_every_head(tmp_path):
    """tests/texts/roles.md (see tests/test_texts.py); roles.png: role colours, texts in black."""
    doc = make_doc()
    for e in doc["heads"]:  # the toy world's ground truth
        e["decoding"], e["skill"] = {"color": 0.9, "shape": 0.5}, {"color": 0.8, "shape": 0.3}
    doc["decoding"] = {"probe": "ridge", "chance": {"color": 0.17, "shape": 0.25}}
    for i, name in ((0, "low"), (1, "low"), (6, "high"), (7, "high")):  # ties at both
        doc["heads"][i]["entropy"] = doc["thresholds"][name]
    entropy.write_report(doc, tmp_path / "out")
    reviewed("roles.md", (tmp_path / "out" / "roles.md").read_text())
    png, cell = Image.open(tmp_path / "out" / "roles.png").convert("RGB"), entropy.CELL
    pixels = np.asarray(png, dtype=int)
    for e in doc["heads"]:
        x, y = 44 + e["head"] * cell, entropy.TOP + doc["layers"].index(e["layer"]) * cell
        assert png.getpixel((x + cell - 6, y + cell - 6)) == entropy.ROLE_COLORS[e["role"]]
        # in black: its letter (an attribute's, or a specialist's concept), its entropy, its
        # ablation's cost, the head's and the block's labels
        texts = [(x + 5, y + 20), (x + 5, y + 37), (x, entropy.TOP - 16), (4, y + 22)]
        for x0, y0 in texts + [(x + 5, y + 3)] * (e["role"] in ("attribute", "specialist")):
            assert pixels[y0 : y0 + 10, x0 : x0 + 12].sum(-1).min() < 180, (x0, y0)


@pytest.mark.parametrize("variant", ["role", "generalization-only"])
def test_the_mask_picture_colours_what_each_head_allows(tmp_path, variant):
    """mask.png of DeAR's masks, read back cell by cell: in a head's panel the cell (query,
    key) over CLS, the five tokens and the patches has the head's role colour exactly where the
    paper's rules (test_dear.hand_allowed, on one position per group) allow, white elsewhere;
    under generalization-only an attribute head is drawn as the mixed head it acts as."""
    from test_dear import LAYOUTS, hand_allowed, roles_of
    roles = roles_of(LAYOUTS)
    masks = torch.stack([dear.role_mask(roles[b], 16, variant) for b in (3, 4)])
    entropy.draw_mask(masks, [roles[3], roles[4]], 3, variant, tmp_path / "mask.png")
    png = Image.open(tmp_path / "mask.png").convert("RGB")
    cell, side = entropy.MASK_CELL, 7 * entropy.MASK_CELL
    for i, b in enumerate((3, 4)):
        for h, (role, attribute) in enumerate(LAYOUTS[b]):
            acting = "mixed" if variant != "role" and role == "attribute" else role
            allowed = hand_allowed(acting, attribute, 7)
            x, y = 60 + h * (side + 70), 16 * 3 + 12 + i * (side + 44) + 16
            for r, c in np.ndindex(7, 7):
                want = entropy.ROLE_COLORS[acting] if allowed[r, c] else (255, 255, 255)
                got = png.getpixel((x + c * cell + cell // 2, y + r * cell + cell // 2))
                assert got == want, (b, h, r, c)


# ------------------------------------------------------------------------- run, cache, CLI

@pytest.fixture
def world(tmp_path, monkeypatch):
    """run() on tiny CLIPs (runs.load_backbone: tiny, other) and 14 images listed as a dataset
    (data.build_dataset replaced), with the CLIP cache in tmp_path; and a labelled user pool."""
    models = {"tiny": perturbed(blocks=6), "other": perturbed(blocks=6)}
    models["other"].sha256 = "cd" * 32
    monkeypatch.setattr(runs, "load_backbone", lambda name, device: models[name])
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "cache"))
    g, items = np.random.default_rng(0), [(str(tmp_path / f"{i}.png"), 0, "x") for i in range(14)]
    for path, *_ in items:
        Image.fromarray(g.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
    split = types.SimpleNamespace(test=items, train=items[:10], classnames=["x"], template="{}.")
    monkeypatch.setattr(data, "build_dataset", lambda name, root: split)
    pool = "".join(f"{CONCEPTS[j % 12]}\ttext {j}\n" for j in range(24))
    (tmp_path / "pool.txt").write_text(pool)
    return tmp_path


def test_the_cache_is_reused_only_for_equal_inputs(world):
    base = dict(texts=str(world / "pool.txt"), n=2, rank=8, log=lambda line: None)
    tiny = runs.load_backbone("tiny", "cpu")
    path = entropy.run(tiny, "imagenet", str(world), [3, 4], **base)
    cache, folder = os.path.split(os.path.dirname(path))
    assert cache == str(world / "cache" / "roles") and folder[:-12] == "tiny_L3-4_imagenet-test_"
    assert sorted(os.listdir(os.path.dirname(path))) == ["roles.json", "roles.md", "roles.png"]
    stamp = os.stat(path).st_mtime_ns
    assert entropy.run(tiny, "imagenet", "elsewhere", [3, 4], **base) == path  # named: any root
    assert os.stat(path).st_mtime_ns == stamp  # reused, not computed again
    doc = json.loads(open(path).read())
    assert doc["probe"] == {"dataset": "imagenet", "split": "test", "images": 14}
    assert doc["inputs"]["checkpoint_sha256"] == "ab" * 32 and doc["inputs"]["n"] == 2
    changes = [{"backbone": "other"}, {"layers": [4]}, {"dataset": "eurosat"}, {"split": "train"},
               {"n": 3}, {"rank": 6}, {"low": 0.5}, {"high": 2.0}, {"max_images": 12},
               {"seed": 1, "max_images": 12},  # the seed draws the sample
               {"dataset": f"folder:{world}/a"}, {"dataset": f"folder:{world}/b/a"}]
    paths = {path}
    for change in changes:
        args = {"backbone": "tiny", "dataset": "imagenet", "root": str(world), "layers": [3, 4],
                **base, **change}
        paths.add(entropy.run(runs.load_backbone(args.pop("backbone"), "cpu"), **args))
    (world / "pool.txt").write_text((world / "pool.txt").read_text().replace("text 0", "text zero"))
    paths.add(entropy.run(tiny, "imagenet", str(world), [3, 4], **base))  # same file, other texts
    assert len(paths) == len(changes) + 2


def test_the_toy_world_gets_its_pool_and_ground_truth(world, monkeypatch):
    """The toy CLIP: the toy pool, toyworld.TEXTS_PER_HEAD texts per head; the toy world's images
    (12 of 14 sampled by the seed, in their order): each head's held-out decoding of its factors."""
    toy, seen = perturbed(), []
    toy.name = "toy"
    pool = [(f"{c} {j}", c) for j in range(4) for c in ("color", "shape", "texture", "location")]
    monkeypatch.setattr(toyworld, "text_pool", lambda: pool)
    monkeypatch.setattr(toyworld, "ensure_dataset", lambda root: None)
    monkeypatch.setattr(toyworld, "factor_labels",
                        lambda paths: seen.append(paths) or {"color": [0, 0, 1] * 4})
    path = entropy.run(toy, "toyworld", str(world), [4], max_images=12, seed=3, log=lambda _: None)
    assert seen == [[f"{world}/{i}.png" for i in sorted(random.Random(3).sample(range(14), 12))]]
    doc = json.loads(open(path).read())
    assert doc["texts_per_head"] == toyworld.TEXTS_PER_HEAD
    assert doc["decoding"]["chance"] == {"color": 0.6667}
    assert all(set(e["texts"]) <= {t for t, _ in pool} for e in doc["heads"])
    assert all(set(e["skill"]) == {"color"} for e in doc["heads"])


def test_cli_writes_roles_and_refuses_in_one_line(world, capsys):
    args = "--backbone tiny --dataset imagenet --n 2 --rank 8 --device cpu".split()
    args += ["--root", str(world), "--texts", str(world / "pool.txt"), "--out", str(world / "out")]
    path = world / "out" / "roles.json"
    for verb in ("wrote", "found"):  # computed, then found
        assert entropy.main(args) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith(f"{verb} {path}: ")
    doc = json.loads(path.read_text())
    assert doc["layers"] == [3, 4, 5, 6] and len(doc["heads"]) == 16  # the last four by default
    # thresholds of 0 bits are 0, not "none" (the quantiles): every head above 0 bits generalizes
    assert entropy.main(args + ["--low", "0", "--high", "0", "--out", str(world / "zero")]) == 0
    zero = json.loads((world / "zero" / "roles.json").read_text())
    assert zero["thresholds"] == {"low": 0, "high": 0}
    assert (zero["inputs"]["low"], zero["inputs"]["high"]) == (0, 0)
    assert all((e["role"] == "generalization") == (e["entropy"] > 0) for e in zero["heads"])
    capsys.readouterr()
    for extra, says in (
        (["--layers", "5-8"], "blocks [5, 6, 7, 8] are not among the backbone's 1..6"),
        (["--layers", "5-3"], "blocks [] are not among the backbone's 1..6"),  # none, not default
        (["--n", "14", "--rank", "80"], "TextSpan cannot pick 14 texts per head"),  # 13 directions
        (["--n", "0"], "argument --n: '0' is not a whole number >= 1"),
        (["--low", "0.5", "--high", "0"], "--low must not exceed --high")):
        with pytest.raises(SystemExit) as e:
            entropy.main(args + extra)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: " + says) and err.count("\n") == 1, err

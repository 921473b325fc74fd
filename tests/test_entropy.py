"""Tests of entropy.py: the head decomposition, TextSpan, concept entropy, roles,
the roles file and the CLI."""

import json
import math
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import clip
import entropy
import roles_report
from conftest import tiny_clip
from entropy import CONCEPTS, EntropyError, RolesError


# ------------------------------------------------------------------------------------ decomposition


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
    assert sorted(parts) == ["heads", "mlp", "rest"] and parts["rest"].shape == (6, 32)
    with torch.no_grad():
        embedding = model.encode_image(images)
    torch.testing.assert_close(entropy.sum_parts(parts), embedding, atol=1e-5, rtol=1e-5)
    # no single part explains the embedding: the heads matter
    assert parts["heads"].abs().sum() > 0.01 * embedding.abs().sum()


def test_the_parts_add_up_with_ln_posts_eps_inside_the_root(tiny_model):
    """ln_post divides by sqrt(var + eps); with a large eps (0.5), var - eps or no eps is far
    off."""
    model = perturb_ln_post(tiny_model)
    model.visual.ln_post.eps = 0.5
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        embedding = model.encode_image(images)
    parts = entropy.decompose(model, images, [2, 4])
    torch.testing.assert_close(entropy.sum_parts(parts), embedding, atol=1e-5, rtol=1e-5)


def test_texts_are_encoded_in_batches_as_clip_encodes_each_alone():
    """encode_texts against CLIP on one text at a time: texts of several lengths, one longer than
    the 16-position text tower (cut, keeping EOT), in batches of 2 that do not divide the 5 texts.
    Rules out a skipped batch start, refusing or not cutting the long text, a cut before EOT, and a
    normalisation over the batch instead of per text."""
    model = tiny_clip(context_length=16)
    texts = [
        "red",
        "a striped tail",
        "round",
        "a very long text about a small red bird that sits on a thin branch of an old tree",
        "blue and shiny",
    ]
    got = entropy.encode_texts(model, texts, batch_size=2)  # [5, E]
    with torch.no_grad():
        want = [
            F.normalize(
                model.encode_text(clip.tokenize([t], context_length=16, truncate=True)), dim=-1
            )
            for t in texts
        ]
    torch.testing.assert_close(got, torch.cat(want), atol=1e-6, rtol=1e-5)


def test_collect_statistics_reads_total_images_and_stops_there(tiny_model, capsys):
    """total 5 out of batches of 2: the third batch is cut to 1 image and no fourth batch is
    read."""
    images = torch.randn(8, 3, 32, 32)
    pulled = []

    def loader():
        for i in range(0, 8, 2):
            pulled.append(i)
            yield images[i : i + 2], torch.zeros(2)

    stats, kept = entropy.collect_statistics(tiny_model, loader(), [2, 3], 5, keep=True)
    assert pulled == [0, 2, 4] and stats.count == 5
    torch.testing.assert_close(kept, entropy.head_contributions(tiny_model, images[:5], [2, 3]))
    assert "probe images 5/5" in capsys.readouterr().err


def test_head_contributions_do_not_depend_on_which_other_blocks_are_analysed(tiny_model):
    images = torch.randn(4, 3, 32, 32)
    alone = entropy.head_contributions(tiny_model, images, [3])
    together = entropy.head_contributions(tiny_model, images, [1, 2, 3, 4])
    torch.testing.assert_close(alone[:, 0], together[:, 2], atol=1e-6, rtol=1e-5)


def test_head_contributions_are_in_units_of_the_normalised_embedding(tiny_model):
    images = torch.randn(4, 3, 32, 32)
    parts = entropy.decompose(tiny_model, images, [1, 2, 3, 4])
    scaled = entropy.head_contributions(tiny_model, images, [1, 2, 3, 4])
    with torch.no_grad():
        norm = tiny_model.encode_image(images).norm(dim=-1)  # [B]
    torch.testing.assert_close(
        scaled * norm.view(-1, 1, 1, 1), parts["heads"], atol=1e-6, rtol=1e-5
    )


def test_one_heads_contribution_by_hand_as_textspans_prs_logger(tiny_model):
    """Block 3 (1-based), head 1 of a tiny CLIP, computed by hand from the description of TextSpan's
    PRS logger: the head's attention at CLS through its out_proj columns, plus out_proj.bias / H;
    minus mean(r) / ((2L+1) H) with L = 4, all blocks of the model (only blocks 2-3 are analysed);
    times ln_post.weight / std(r); plus ln_post.bias / ((2L+1) H); @ proj; divided by the norm of
    the image embedding. And that block's MLP: the same with a share 1 / (2L+1)."""
    model = perturb_ln_post(tiny_model)
    g = torch.Generator().manual_seed(1)
    visual = model.visual
    blocks = visual.transformer.resblocks
    with torch.no_grad():
        for block in blocks:  # biases the random init leaves at zero
            block.attn.out_proj.bias.copy_(0.5 * torch.randn(64, generator=g))
            block.attn.in_proj_bias.copy_(0.2 * torch.randn(192, generator=g))
    images = torch.randn(3, 3, 32, 32, generator=g)
    L, H, D, hs, b, h = 4, 4, 64, 16, 2, 1  # b: 0-based index of block 3
    with torch.no_grad():
        x = visual.embed(images)
        for block in blocks[:b]:
            x = block(x)
        block = blocks[b]
        y = block.ln_1(x)
        W, c = block.attn.in_proj_weight, block.attn.in_proj_bias
        cols = slice(h * hs, (h + 1) * hs)  # head h's rows of W_q, W_k, W_v and columns of W_O
        q, k, v = (
            y @ W[i * D : (i + 1) * D][cols].T + c[i * D : (i + 1) * D][cols] for i in range(3)
        )  # [B, T, hs]
        # CLS row [B, T]
        a = torch.softmax((q[:, :1] @ k.transpose(1, 2))[:, 0] / math.sqrt(hs), dim=-1)
        head = (a[:, :, None] * v).sum(1) @ block.attn.out_proj.weight[
            :, cols
        ].T + block.attn.out_proj.bias / H
        mlp = block.mlp(block.ln_2(x + block.attn(y)))[:, 0]  # [B, D]
        r = x
        for blk in blocks[b:]:
            r = blk(r)
        r = r[:, 0]  # [B, D]
        mean = r.mean(-1, keepdim=True)
        std = (((r - mean) ** 2).mean(-1, keepdim=True) + visual.ln_post.eps).sqrt()
        n = 2 * L + 1
        w, beta, proj = visual.ln_post.weight, visual.ln_post.bias, visual.proj
        norm = model.encode_image(images).norm(dim=-1, keepdim=True)
        want_head = ((head - mean / (n * H)) * w / std + beta / (n * H)) @ proj / norm
        want_mlp = ((mlp - mean / n) * w / std + beta / n) @ proj
    got = entropy.head_contributions(model, images, [2, 3])  # block 3 is the second analysed block
    torch.testing.assert_close(got[:, 1, h], want_head, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        entropy.decompose(model, images, [2, 3])["mlp"][:, 1], want_mlp, atol=1e-5, rtol=1e-4
    )


def plant_heads(model, layers=(3, 4), seed=0):
    """Make every head of `layers` (1-based) write along two known directions of the embedding space
    and nothing else write anything: the MLPs and the other blocks' attention outputs are zeroed,
    biases are zero, ln_post is the identity and proj's columns have mean 0 (so the heads' writes
    have mean 0 and r's mean stays 0). Returns the 2 * H * len(layers) orthonormal directions
    [K, E]: head (layers[i], h) writes along rows 2 (i H + h) and 2 (i H + h) + 1."""
    g = torch.Generator().manual_seed(seed)
    visual = model.visual
    D, H, E = visual.width, visual.heads, visual.output_dim
    hs = D // H
    with torch.no_grad():
        visual.ln_post.weight.fill_(1.0)
        visual.ln_post.bias.zero_()
        visual.proj.copy_(torch.randn(D, E, generator=g))
        visual.proj.sub_(visual.proj.mean(0))
        # [K, E]
        directions = torch.linalg.qr(torch.randn(E, E, generator=g))[0].T[: 2 * H * len(layers)]
        writes = directions @ torch.linalg.pinv(visual.proj)  # [K, D]: writes @ proj = directions
        for b, block in enumerate(visual.transformer.resblocks):
            block.mlp.c_proj.weight.zero_()
            block.mlp.c_proj.bias.zero_()
            block.attn.out_proj.bias.zero_()
            block.attn.out_proj.weight.zero_()
            if b + 1 not in layers:
                continue
            i = list(layers).index(b + 1)
            for h in range(H):
                k = 2 * (i * H + h)
                # what the head reads out of its 16 value dimensions
                mix = torch.randn(2, hs, generator=g)
                block.attn.out_proj.weight[:, h * hs : (h + 1) * hs] = writes[k : k + 2].T @ mix
    return directions


def test_planted_heads_are_credited_to_their_block_and_head(tiny_model):
    directions = plant_heads(tiny_model, layers=(3, 4))
    got = entropy.head_contributions(tiny_model, torch.randn(24, 3, 32, 32), [3, 4])  # [N, 2, 4, E]
    for i in range(2):
        for h in range(4):
            c = got[:, i, h] - got[:, i, h].mean(0)  # the head's variation across images
            own = directions[2 * (4 * i + h) : 2 * (4 * i + h) + 2]  # [2, E]
            assert (c @ own.T).pow(2).sum() > 0.999 * c.pow(2).sum(), (
                i,
                h,
            )  # all of it along its own directions
            assert c.pow(2).sum() > 1e-6


def test_roles_json_labels_planted_heads_at_their_block_and_head(tiny_model, tmp_path, monkeypatch):
    """Each of the 8 heads of blocks 3-4 writes along two texts of its own concept (8 concepts, in
    order); the roles file must name that concept at that block and head."""
    directions = plant_heads(tiny_model, layers=(3, 4))
    concepts = CONCEPTS[:8]
    texts = [f"{c} text {j}" for c in concepts for j in range(2)]  # texts[k] is directions[k]
    labels = [c for c in concepts for _ in range(2)]
    monkeypatch.setattr(
        entropy, "encode_texts", lambda model, batch: directions[[texts.index(t) for t in batch]]
    )
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(12):
        path = tmp_path / f"{i}.png"
        Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()).save(path)
        items.append((str(path), 0, "x"))
    path = entropy.compute_roles(
        tiny_model,
        items,
        texts,
        labels,
        [3, 4],
        str(tmp_path / "out"),
        batch_size=5,
        n=2,
        rank=2,
        low=0.5,
        high=1.0,
    )
    heads = {(e["layer"], e["head"]): e for e in json.loads(open(path).read())["heads"]}
    roles = entropy.load_roles(path)
    for i, layer in enumerate((3, 4)):
        for h in range(4):
            concept = concepts[4 * i + h]
            assert sorted(heads[(layer, h)]["texts"]) == [
                f"{concept} text 0",
                f"{concept} text 1",
            ], (layer, h)
            want = ("attribute", concept) if concept in entropy.ATTRIBUTES else ("specialist", None)
            assert (roles[layer][h]["role"], roles[layer][h]["attribute"]) == want, (layer, h)
            assert roles[layer][h].get("concept", concept) == concept


# ----------------------------------------------------------------------------------------- TextSpan


def planted(
    N=400, E=64, T=300, picks=(17, 123, 250, 5), scales=(4.0, 3.0, 2.0, 1.0), noise=0.02, seed=0
):
    """Contributions made of known text directions (largest variance first) plus small noise."""
    g = torch.Generator().manual_seed(seed)
    texts = torch.nn.functional.normalize(torch.randn(T, E, generator=g), dim=-1)
    coeffs = torch.randn(N, len(picks), generator=g) * torch.tensor(scales)  # [N, k]
    # offset: centring
    contributions = coeffs @ texts[list(picks)] + noise * torch.randn(N, E, generator=g) + 5.0
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


def textspan_by_hand(data, texts, n, rank, centre_first=False, deflate=True):
    """TextSpan's `replace_with_iterative_removal`, restated in numpy from its description: SVD of
    the raw contributions, texts projected onto the top-`rank` right singular vectors, then the
    contributions centred; n times: pick the text whose projection has the largest std across
    images, remove its direction from the contributions and from every text. centre_first /
    deflate=False: two plausible departures from it."""
    data, texts = np.asarray(data, dtype=np.float64), np.asarray(texts, dtype=np.float64)
    if centre_first:
        data = data - data.mean(0)
    _, _, vh = np.linalg.svd(data, full_matrices=False)
    vh = vh[:rank]  # [r, E], orthonormal rows
    texts = texts @ vh.T @ vh
    data = data - data.mean(0)
    picks = []
    for _ in range(n):
        scores = (data @ texts.T).std(0)
        if not deflate:
            scores[picks] = -1  # without deflation only the picked texts themselves are left out
        j = int(np.argmax(scores))
        picks.append(j)
        if deflate:
            t = texts[j]
            data = data - np.outer(data @ t / (t @ t), t)
            texts = texts - np.outer(texts @ t / (t @ t), t)
    return picks


def skewed(seed, N=60, E=12, T=40):
    """Contributions with a sizeable mean (as real CLIP heads have) and unequal variances; random
    unit texts in few dimensions, so they are far from orthogonal (|cos| ~ 0.25)."""
    g = np.random.default_rng(seed)
    contributions = (
        g.normal(size=(N, E))
        @ np.diag(np.linspace(3, 0.2, E))
        @ np.linalg.qr(g.normal(size=(E, E)))[0]
    )
    contributions += 4 * g.normal(size=E)  # the head's mean
    texts = g.normal(size=(T, E))
    return contributions, texts / np.linalg.norm(texts, axis=1, keepdims=True)


def test_textspan_matches_a_restatement_of_textspans_iterative_removal():
    differs = {"centre_first": 0, "no_deflation": 0}
    for seed in range(6):
        contributions, texts = skewed(seed)
        want = textspan_by_hand(contributions, texts, n=5, rank=6)
        assert (
            entropy.textspan(torch.tensor(contributions), torch.tensor(texts), n=5, rank=6) == want
        ), seed
        differs["centre_first"] += (
            textspan_by_hand(contributions, texts, 5, 6, centre_first=True) != want
        )
        differs["no_deflation"] += (
            textspan_by_hand(contributions, texts, 5, 6, deflate=False) != want
        )
    assert min(differs.values()) >= 3, differs  # the data tell both departures apart from TextSpan


def test_textspan_takes_the_span_of_the_uncentred_contributions():
    """By hand: the head has a large constant mean along e0 and variances 9, 4, 0.25 along e1, e2,
    e3. The top-2 span of the raw contributions is {e0, e1}, where text A = e2 has no component:
    TextSpan picks B = (0.5 e1 + e3) / |.| (variance 9 * 0.25 / 1.25 = 1.8). Centring first would
    give the span {e1, e2} and A (variance 4)."""
    hadamard = torch.tensor(
        [
            [1.0, 1, 1, 1, 1, 1, 1, 1],
            [1, -1, 1, -1, 1, -1, 1, -1],
            [1, 1, -1, -1, 1, 1, -1, -1],
            [1, -1, -1, 1, 1, -1, -1, 1],
        ]
    ).T  # [8, 4], orthogonal columns; 1..3 have mean 0
    # [8 images, E = 4]: e0 constant 10
    contributions = hadamard * torch.tensor([10.0, 3.0, 2.0, 0.5])
    A, B = (
        torch.tensor([0.0, 0, 1, 0]),
        torch.nn.functional.normalize(torch.tensor([0.0, 0.5, 0, 1]), dim=0),
    )
    assert entropy.textspan(contributions, torch.stack([A, B]), n=1, rank=2) == [1]
    assert textspan_by_hand(contributions, torch.stack([A, B]), n=1, rank=2, centre_first=True) == [
        0
    ]


def test_textspan_removes_each_pick_from_the_other_texts():
    """By hand: variances 9 along e1 and 4 along e2; texts A = e1, B = (e1 + 0.2 e2) / |.|, C = e2.
    First pick A (9 against 8.81 and 4). Removing e1 leaves B = 0.196 e2 (variance 0.15) against C
    (4): C is second. Without the removal B (8.81) would come second."""
    hadamard = torch.tensor([[1.0, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1]]).T  # [4, 3]
    contributions = hadamard * torch.tensor([1.0, 3.0, 2.0])  # E = 3: e0 constant, e1 and e2 vary
    texts = torch.nn.functional.normalize(
        torch.tensor([[0.0, 1, 0], [0, 1, 0.2], [0, 0, 1]]), dim=-1
    )
    assert entropy.textspan(contributions, texts, n=2, rank=3) == [0, 2]
    assert textspan_by_hand(contributions, texts, n=2, rank=3, deflate=False) == [0, 1]


def stream(contributions, sizes):
    """GramStatistics of contributions [N, ...] fed in batches of the given sizes (cycled),
    as the probe loader."""
    stats = entropy.GramStatistics(contributions.shape[1:-1], contributions.shape[-1])
    i, k = 0, 0
    while i < len(contributions):
        stats.add(contributions[i : i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return stats


def test_streamed_statistics_are_the_count_mean_and_scatter_of_all_images():
    """Uneven batches (7, 1, 13, 2) of contributions with a mean 1000x their spread: count, mean,
    the centred scatter and the uncentred Gram C^T C equal numpy's fp64 on the whole matrix. Rules
    out a merge without the between-batch term, one weighted by the wrong batch sizes, and sums kept
    in fp32 (relative error ~1e-4 on the scatter here, against ~1e-12)."""
    g = np.random.default_rng(3)
    C = g.normal(size=(61, 2, 3, 5)) * g.uniform(0.5, 2, size=5) + 1000 * g.normal(size=(2, 3, 5))
    stats = stream(torch.tensor(C, dtype=torch.float64), [7, 1, 13, 2])
    assert stats.count == 61 and stats.scatter.dtype == torch.float64
    for li in range(2):
        for h in range(3):
            c = C[:, li, h]  # [N, E]
            count, mean, scatter = stats.head((li, h))
            np.testing.assert_allclose(mean.numpy(), c.mean(0), rtol=1e-12)
            centred = c - c.mean(0)
            np.testing.assert_allclose(scatter.numpy(), centred.T @ centred, rtol=1e-9, atol=1e-9)
            gram = scatter + count * torch.outer(mean, mean)
            np.testing.assert_allclose(gram.numpy(), c.T @ c, rtol=1e-12)


def test_streamed_textspan_picks_what_the_official_algorithm_picks_on_the_stored_matrix():
    """The streamed path (statistics over uneven batches, then greedy picks on them) against
    TextSpan's iterative removal run on the full, stored contribution matrix (textspan_by_hand: SVD
    of the raw matrix, deflation of the data themselves). Heads with large means and unequal
    variances, where centring before the SVD or skipping the deflation would pick otherwise (see the
    test above)."""
    for seed in range(6):
        contributions, texts = skewed(seed)
        stats = stream(torch.tensor(contributions), [9, 4, 17])
        got = entropy.textspan_from_statistics(*stats.head(()), torch.tensor(texts), n=5, rank=6)
        assert got == textspan_by_hand(contributions, texts, n=5, rank=6), seed


def test_compute_roles_streamed_matches_the_stored_path_by_hand(
    tiny_model, tmp_path, monkeypatch, capsys
):
    """compute_roles on 23 images in batches of 5 (the last one short) against a stored path written
    here: every image's head contributions in one array, TextSpan's iterative removal on each head's
    full matrix, concept entropy by hand, thresholds the 1/3 and 2/3 linear quantiles; same texts,
    entropies and roles per head."""
    model = perturb_ln_post(tiny_model)
    g = np.random.default_rng(0)
    T, E = 40, model.visual.output_dim
    vectors = g.normal(size=(T, E))
    vectors = torch.tensor(
        vectors / np.linalg.norm(vectors, axis=1, keepdims=True), dtype=torch.float32
    )
    texts = [f"text {j}" for j in range(T)]
    labels = [CONCEPTS[j % 7] if j < 28 else "color" for j in range(T)]  # unequal concepts
    monkeypatch.setattr(
        entropy, "encode_texts", lambda model, batch: vectors[[texts.index(t) for t in batch]]
    )
    items = []
    for i in range(23):
        path = tmp_path / f"{i}.png"
        Image.fromarray(g.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
        items.append((str(path), 0, "x"))
    path = entropy.compute_roles(
        model, items, texts, labels, [3, 4], str(tmp_path / "out"), batch_size=5, n=4, rank=6
    )
    doc = json.loads(open(path).read())
    assert (
        doc["probe"]["images"] == doc["probe"]["available"] == 23
        and doc["probe"]["max_images"] is None
    )
    # the stored path: all 23 images at once
    images = torch.stack(
        [entropy.data.test_transform(32)(Image.open(p).convert("RGB")) for p, _, _ in items]
    )
    stored = entropy.head_contributions(model, images, [3, 4]).double().numpy()  # [23, 2, 4, E]
    want = {}
    for li, layer in enumerate((3, 4)):
        for h in range(4):
            picks = textspan_by_hand(stored[:, li, h], vectors.double().numpy(), n=4, rank=6)
            shares = [sum(labels[j] == c for j in picks) / 4 for c in CONCEPTS]
            want[(layer, h)] = (
                [texts[j] for j in picks],
                -sum(p * math.log2(p) for p in shares if p > 0),
            )
    # numpy's default: linear
    low, high = np.quantile([round(H, 4) for _, H in want.values()], [1 / 3, 2 / 3])
    heads = {(e["layer"], e["head"]): e for e in doc["heads"]}
    assert doc["thresholds"] == {
        "low": round(float(low), 4),
        "high": round(float(high), 4),
    }  # as stored
    assert "heads 8/8" in capsys.readouterr().err
    for key, (picked, H) in want.items():
        assert heads[key]["texts"] == picked, key
        assert heads[key]["entropy"] == round(H, 4)  # stored to 4 decimals, as P
        assert heads[key]["P"] == {
            c: round(sum(labels[texts.index(t)] == c for t in picked) / 4, 4) for c in CONCEPTS
        }
        role = "attribute" if H <= low + 1e-4 else "generalization" if H >= high - 1e-4 else "mixed"
        if role == "attribute":  # the dominant concept decides attribute / other specialist
            P = heads[key]["P"]
            top = max(CONCEPTS, key=lambda c: (P[c], -CONCEPTS.index(c)))
            role = "attribute" if top in entropy.ATTRIBUTES else "specialist"
        assert heads[key]["role"] == role, key
    # the heads differ: the comparison means something
    assert len({tuple(t) for t, _ in want.values()}) > 4


def test_compute_roles_checks_its_inputs_before_any_work(tiny_model, tmp_path):
    """Bad thresholds, labels or texts stop compute_roles before an image is read (the items here do
    not even exist): each with its own message."""
    items = [(str(tmp_path / "missing.png"), 0, "x")] * 30
    texts, labels = ["a", "b", "c"], ["color", "shape", "animal"]
    run = lambda **k: entropy.compute_roles(
        tiny_model,
        k.pop("items", items),
        k.pop("texts", texts),
        k.pop("labels", labels),
        [3, 4],
        str(tmp_path / "out"),
        n=2,
        rank=4,
        **k,
    )
    with pytest.raises(EntropyError, match="--low 2.0 is above --high 1.0"):
        run(low=2.0, high=1.0)
    need = "^every text of the pool needs one concept label out of " + ", ".join(CONCEPTS) + "$"
    with pytest.raises(EntropyError, match=need):
        run(labels=["color", "shape"])  # one label short
    with pytest.raises(EntropyError, match=need):
        run(labels=["color", "shape", "colour"])  # as many labels, one unknown
    with pytest.raises(
        EntropyError,
        match="^the text pool has duplicate descriptions; TextSpan needs unique texts$",
    ):
        run(texts=["a", "b", "a"])
    with pytest.raises(
        EntropyError, match="^no probe images found; check --dataset/--root/--split$"
    ):
        run(items=[])
    assert not (tmp_path / "out").exists()


def test_compute_roles_samples_by_seed_and_keeps_the_given_thresholds(
    tiny_model, tmp_path, monkeypatch
):
    """max_images 12 of 30: the seeded sample random.Random(seed).sample, in the items' order (seen
    through the factors hook, which gets the probe images' paths); given thresholds are recorded and
    used; a given low above the automatic high stops; an error inside TextSpan advises the caller
    named."""
    vectors = torch.nn.functional.normalize(
        torch.randn(6, 32, generator=torch.Generator().manual_seed(1)), dim=-1
    )
    texts = [f"text {j}" for j in range(6)]
    monkeypatch.setattr(
        entropy, "encode_texts", lambda model, batch: vectors[[texts.index(t) for t in batch]]
    )
    items = []
    for i in range(30):
        path = tmp_path / f"{i:02d}.png"
        Image.fromarray(np.full((32, 32, 3), 8 * i, dtype=np.uint8)).save(path)
        items.append((str(path), 0, "x"))
    labels = ["color", "shape", "animal", "color", "scene", "texture"]
    seen = []

    def factors(paths):
        seen.append(list(paths))
        return {"brightness": [i % 2 for i in range(len(paths))]}

    run = lambda out, **k: json.loads(
        open(
            entropy.compute_roles(
                tiny_model,
                items,
                texts,
                labels,
                [4],
                str(tmp_path / out),
                batch_size=5,
                n=2,
                rank=4,
                max_images=12,
                factors=factors,
                **k,
            )
        ).read()
    )
    doc = run("a", seed=3, low=0.25, high=0.75)
    run("b", seed=4)
    want = [items[i][0] for i in sorted(__import__("random").Random(3).sample(range(30), 12))]
    assert seen[0] == want and seen[1] != want and len(seen[1]) == 12
    assert doc["thresholds"] == {"low": 0.25, "high": 0.75} and doc["probe"]["images"] == 12
    # what roles.json records besides
    assert not hasattr(tiny_model, "name") and doc["model"] == "unknown"
    assert doc["pool"] == {"name": None, "texts": 6} and doc["concepts"] == list(CONCEPTS)
    assert doc["decoding"] == {
        "probe": "ridge least-squares classifier, 2-fold cross-validation",
        "chance": {"brightness": 0.5},
    }
    assert all(
        h["role"] == entropy.assign_role(h["entropy"], h["P"], 0.25, 0.75)["role"]
        for h in doc["heads"]
    )
    with pytest.raises(EntropyError, match="--low 5.0 is above --high"):
        run("c", seed=3, low=5.0)
    # one direction
    monkeypatch.setattr(entropy, "encode_texts", lambda model, batch: vectors[[0] * len(batch)])
    with pytest.raises(
        EntropyError,
        match="^the text pool spans only 1 directions inside this head's top-4 "
        "space, fewer than n = 2; use a larger pool or a smaller --n$",
    ):
        run("d", seed=3, caller="entropy.py")


def test_streaming_keeps_no_per_image_contributions(tiny_model, tmp_path, monkeypatch):
    """compute_roles without ground-truth factors: while TextSpan runs, no tensor holding more
    images than one batch (5) of head contributions [*, 2 blocks, 4 heads, E] is alive; memory is
    the statistics (blocks x heads x E x E doubles) and one batch, however many images. With factors
    (the toy world's probes) every image's contributions are kept, and only then."""
    import gc

    seen, calls, original = [], [], entropy.textspan_from_statistics

    def textspan_checking_memory(*args, **kwargs):
        if calls.append(1) or len(calls) > 1:  # once per compute_roles: gc.get_objects is slow
            return original(*args, **kwargs)
        gc.collect()
        seen.append(
            max(
                [
                    o.shape[0]
                    for o in gc.get_objects()
                    if type(o) is torch.Tensor and o.dim() == 4 and tuple(o.shape[1:]) == (2, 4, 32)
                ],
                default=0,
            )
        )
        return original(*args, **kwargs)

    monkeypatch.setattr(entropy, "textspan_from_statistics", textspan_checking_memory)
    vectors = torch.nn.functional.normalize(
        torch.randn(12, 32, generator=torch.Generator().manual_seed(0)), dim=-1
    )
    texts = [f"text {j}" for j in range(12)]
    monkeypatch.setattr(
        entropy, "encode_texts", lambda model, batch: vectors[[texts.index(t) for t in batch]]
    )
    items = []
    for i in range(23):
        path = tmp_path / f"{i}.png"
        Image.fromarray(np.full((32, 32, 3), 10 * i, dtype=np.uint8)).save(path)
        items.append((str(path), 0, "x"))
    labels = [CONCEPTS[j % 3] for j in range(12)]
    entropy.compute_roles(
        tiny_model, items, texts, labels, [3, 4], str(tmp_path / "a"), batch_size=5, n=2, rank=4
    )
    assert len(calls) == 8 and seen and max(seen) <= 5, seen
    seen.clear(), calls.clear()
    factors = lambda paths: {"brightness": [i % 2 for i in range(len(paths))]}
    entropy.compute_roles(
        tiny_model,
        items,
        texts,
        labels,
        [3, 4],
        str(tmp_path / "b"),
        batch_size=5,
        n=2,
        rank=4,
        factors=factors,
    )
    # the probes' copy: the control that the check sees stored contributions
    assert min(seen) == 23, seen


def test_textspan_defaults_are_textspans_20_texts_in_a_rank_80_span():
    """TextSpan's defaults (w_ov_rank 80, 20 texts per head as its README runs): a text along the
    81st right singular vector has no component in the default span, so with it alone the pool spans
    no direction there; rank 81 reaches it. With no n given, 20 texts are picked."""
    g = np.random.default_rng(0)
    # [E, E] orthonormal columns: the right singular vectors
    basis = np.linalg.qr(g.normal(size=(96, 96)))[0]
    left = np.linalg.qr(g.normal(size=(200, 96)))[0]  # [N, E] orthonormal columns
    data = (
        left * np.linspace(10, 1, 96)
    ) @ basis.T  # singular values 10..1 along basis 0..95, exactly
    data, texts = torch.tensor(data), torch.tensor(basis.T[[80, 81]])
    with pytest.raises(
        EntropyError, match="spans only 0 directions inside this head's top-80 space"
    ):
        entropy.textspan(data, texts, n=1)
    assert entropy.textspan(data, texts, n=1, rank=81) == [0]
    assert len(entropy.textspan(data, torch.tensor(g.normal(size=(30, 96))))) == 20
    import inspect

    defaults = {
        k: v.default for k, v in inspect.signature(entropy.compute_roles).parameters.items()
    }
    assert {k: defaults[k] for k in ("n", "rank", "max_images", "low", "high", "seed")} == {
        "n": 20,
        "rank": 80,
        "max_images": None,
        "low": None,
        "high": None,
        "seed": 0,
    }
    defaults = {
        k: v.default
        for k, v in inspect.signature(entropy.textspan_from_statistics).parameters.items()
    }
    assert (defaults["n"], defaults["rank"]) == (20, 80)
    # called directly with too few images, the check inside advises the caller named
    stats = stream(data[:3], [3])
    with pytest.raises(EntropyError, match="at least n \\+ 1 = 21 probe images") as e:
        entropy.textspan_from_statistics(
            *stats.head(()), torch.tensor(g.normal(size=(30, 96))), caller="entropy.py"
        )
    assert "dear.py" not in str(e.value) and "--max-images" in str(e.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (5, 80, 4, 100, 64),
            "TextSpan picks n = 5 texts per head but the pool has only 4; "
            "use a larger pool (--texts) or a smaller --n",
        ),
        (
            (5, 4, 10, 100, 64),
            "n = 5 texts per head needs rank >= n and embedding width >= n, got rank 4 and width "
            "64; raise --rank or lower --n",
        ),
        (
            (5, 80, 10, 100, 4),
            "n = 5 texts per head needs rank >= n and embedding width >= n, got rank 80 and width "
            "4; raise --rank or lower --n",
        ),
        (
            (5, 80, 10, 5, 64),
            "TextSpan needs at least n + 1 = 6 probe images for n = 5 texts per head (the centred "
            "contributions of N images span at most N - 1 directions), got 5; "
            + entropy.IMAGES_FIX,
        ),
    ],
)
def test_check_textspan_messages_and_their_bounds(args, message):
    """Each limit, one past it: the whole message for entropy.py's user; for dear.py's, dear.py's
    own fix. At the limit itself (n texts, rank n, width n, n + 1 images) nothing is raised."""
    with pytest.raises(EntropyError) as e:
        entropy.check_textspan(*args, caller="entropy.py")
    assert str(e.value) == message
    with pytest.raises(EntropyError) as e:
        entropy.check_textspan(*args, caller="dear.py")
    assert str(e.value) == message[: message.rindex("; ") + 2] + entropy.DEAR_FIX
    entropy.check_textspan(5, 5, 5, 6, 5)  # every bound met exactly


def test_textspan_with_fewer_images_than_the_rank_keeps_only_their_span():
    """N = 8 images in E = 12 dimensions with rank 10: the SVD has only 8 right singular vectors,
    and the texts are projected onto those 8 (the Gram matrix's other eigenvectors, of eigenvalue 0,
    are arbitrary)."""
    for seed in range(4):
        contributions, texts = skewed(seed, N=8, E=12, T=30)
        want = textspan_by_hand(contributions, texts, n=3, rank=10)
        assert (
            entropy.textspan(torch.tensor(contributions), torch.tensor(texts), n=3, rank=10) == want
        ), seed


def test_textspan_stops_clearly_with_too_few_images():
    contributions, texts = planted(N=10)
    with pytest.raises(EntropyError, match="at least n \\+ 1 = 21 probe images"):
        entropy.textspan(contributions, texts, n=20)
    with pytest.raises(EntropyError, match="needs rank >= n"):
        entropy.textspan(contributions, texts, n=5, rank=3)
    with pytest.raises(
        EntropyError, match="the pool has only 4;"
    ):  # T texts, not the E = 64 of their width
        entropy.textspan(contributions, texts[:4], n=5, rank=8)


# ----------------------------------------------------------------------------------- entropy, roles


def test_concept_entropy_of_known_distributions():
    assert entropy.concept_entropy([1.0] + [0.0] * 11) == 0.0
    assert entropy.concept_entropy([0.5, 0.5]) == pytest.approx(1.0)
    assert entropy.concept_entropy([1 / 12] * 12) == pytest.approx(math.log2(12))
    assert entropy.concept_entropy({"color": 0.25, "shape": 0.25, "animal": 0.5}) == pytest.approx(
        1.5
    )
    with pytest.raises(
        ValueError, match=r"not a probability distribution \(non-negative, sum 1\): \[0.5, 0.6\]"
    ):
        entropy.concept_entropy([0.5, 0.6])


def test_concept_distribution_counts_shares_of_a_heads_texts():
    P = entropy.concept_distribution(["color"] * 15 + ["shape"] * 5)
    assert list(P) == list(CONCEPTS)
    assert P == {**{c: 0.0 for c in CONCEPTS}, "color": 0.75, "shape": 0.25}
    assert entropy.concept_entropy(P) == pytest.approx(
        -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))
    )


def test_roles_by_thresholds_and_the_other_specialist_rule():
    low, high = 1.0, 2.0
    assert entropy.assign_role(0.5, {"texture": 0.9, "animal": 0.1}, low, high) == {
        "role": "attribute",
        "attribute": "texture",
    }
    assert entropy.assign_role(1.0, {"animal": 0.8, "color": 0.2}, low, high) == {
        "role": "specialist",
        "attribute": None,
        "concept": "animal",
    }  # low entropy, not one of the five
    assert entropy.assign_role(1.5, {"color": 1.0}, low, high)["role"] == "mixed"
    assert entropy.assign_role(2.0, {"color": 1.0}, low, high)["role"] == "generalization"
    # a tie for the dominant concept goes to the concept listed first (attributes before the others)
    assert (
        entropy.assign_role(1.0, {"animal": 0.5, "location": 0.5}, low, high)["attribute"]
        == "location"
    )


def test_default_thresholds_are_the_tertiles_of_the_heads_entropies():
    low, high = entropy.default_thresholds([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert (low, high) == pytest.approx((2.0, 4.0))


def test_default_thresholds_interpolate_linearly_between_the_heads_entropies():
    """8 heads (as 2 blocks x 4), unsorted, unevenly spaced: the 1/3 and 2/3 quantiles sit at sorted
    positions 7/3 and 14/3. Linear interpolation (numpy's default, the rule implemented):
    1 + (3 - 1) / 3 = 5/3 and 4 + 0.5 * 2/3 = 13/3. Rules out the "lower" rule (1, 4), "higher"
    (3, 4.5), "nearest" (1, 4.5), "midpoint" (2, 4.25) and quantiles of the entropies in the order
    given (not sorted)."""
    entropies = [4.5, 0.0, 7.0, 1.0, 8.0, 3.0, 0.5, 4.0]
    low, high = entropy.default_thresholds(entropies)
    assert (low, high) == pytest.approx((5 / 3, 13 / 3), abs=1e-12)
    for wrong in ("lower", "higher", "nearest", "midpoint"):  # the data tell them apart
        assert np.quantile(entropies, [1 / 3, 2 / 3], method=wrong) != pytest.approx((low, high))


# --------------------------------------------------------------------------------------- text pools


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


@pytest.mark.parametrize(
    "content, message",
    [
        ("a red car\n\na dog\n", "line 2: empty description"),
        ("a red car\na dog\nA red car\n", "line 3: 'A red car' repeats line 1"),
        ("colour\ta red car\n", "unknown concept 'colour'"),
    ],
)
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


def test_user_texts_take_the_nearest_normalised_centroid_with_unequal_concept_sizes():
    """30 colour texts (one of them close to the query) against 3 widely spread scene texts. The
    query q has cosine 0.6 with the colour direction e0 and 0.8 with the scene direction e1. Nearest
    normalised centroid (the rule): scene (0.76 against 0.61). Rules out: the unnormalised sum of
    the embeddings (colour: 30 texts outweigh 3), the unnormalised mean (the spread scene texts'
    mean has norm 0.75: 0.60 against 0.61, colour) and the single nearest text (the colour text next
    to q)."""
    g = torch.Generator().manual_seed(0)
    e = torch.eye(16)
    color = [e[0] + 0.05 * torch.randn(16, generator=g) for _ in range(29)] + [
        0.6 * e[0] + 0.8 * e[1] + 0.05 * e[2]
    ]
    scene = [e[1] + e[2], e[1] - e[2], e[1] + e[3]]
    ref = torch.nn.functional.normalize(torch.stack(color + scene), dim=-1)  # [33, 16]
    ref_labels = ["color"] * 30 + ["scene"] * 3
    queries = torch.stack([0.6 * e[0] + 0.8 * e[1], e[0] + 0.1 * e[1]])
    assert entropy.label_by_centroid(queries, ref, ref_labels) == ["scene", "color"]
    # the wrong rules on the same data, computed here, do pick colour for the first query
    q = torch.nn.functional.normalize(queries[0], dim=0)
    sums = [ref[:30].sum(0), ref[30:].sum(0)]
    assert (q @ sums[0] > q @ sums[1]) and (q @ (sums[0] / 30) > q @ (sums[1] / 3))
    assert ref_labels[int((ref @ q).argmax())] == "color"


def _head(role, attribute=None, skill=None, entropy_=1.0, concept=None):
    return {
        "role": role,
        "attribute": attribute,
        "entropy": entropy_,
        **({"skill": skill} if skill else {}),
        **({"concept": concept} if concept else {}),
    }


def test_random_roles_shuffle_each_block_on_its_own():
    """Two blocks of 8 heads with different role mixes; each head is marked by a distinct entropy.
    Every block keeps its own multiset of roles (rules out one shuffle over all blocks pooled), the
    two blocks get different permutations (rules out one permutation reused for every block), and
    another seed another shuffle."""
    mix = {
        3: [
            "attribute",
            "attribute",
            "attribute",
            "mixed",
            "mixed",
            "generalization",
            "specialist",
            "mixed",
        ],
        4: [
            "generalization",
            "generalization",
            "generalization",
            "generalization",
            "mixed",
            "attribute",
            "mixed",
            "mixed",
        ],
    }
    roles = {
        b: [
            _head(r, "color" if r == "attribute" else None, entropy_=10 * b + h)
            for h, r in enumerate(rs)
        ]
        for b, rs in mix.items()
    }
    out = entropy.control_roles(roles, "random", 7)
    perms = {}
    for b in roles:
        assert sorted(h["role"] for h in out[b]) == sorted(mix[b]), b  # the block's counts kept
        # which head of block b landed where
        perms[b] = [int(h["entropy"]) - 10 * b for h in out[b]]
        assert sorted(perms[b]) == list(range(8)), b  # heads of block b only
    assert perms[3] != perms[4] and perms[3] != list(range(8)) and perms[4] != list(range(8))
    other = entropy.control_roles(roles, "random", 8)
    assert [h["entropy"] for h in other[3]] != [h["entropy"] for h in out[3]]
    assert entropy.control_roles(roles, "random", 7) == out  # seeded


def test_oracle_roles_rank_across_blocks_and_count_specialists_as_masked_like_generalization():
    """Concept Entropy found 2 attribute, 2 generalization, 1 specialist and 3 mixed heads over
    blocks 3-4. The oracle ranks all 8 heads together by the lead of their best-decoded factor (by
    hand, below): the top 2 become attribute heads of that factor, the bottom 3 (2 generalization +
    1 specialist, masked alike) generalization, the rest mixed. Rules out: a specialist left out of
    the masked count (bottom 2 only), the specialist role kept, a ranking within each block (block 3
    would keep an attribute head), and an attribute head turned generalization (block 3 head 3) that
    keeps its attribute."""

    def skills(best, lead, base=0.2):
        s = {f: base for f in ("color", "shape", "texture", "location")}
        s[best] = base + lead
        return s

    roles = {
        3: [
            _head("attribute", "color", skills("color", 0.30)),
            _head("specialist", None, skills("shape", 0.05), concept="animal"),
            _head("mixed", None, skills("texture", 0.20)),
            _head("attribute", "location", skills("location", 0.10)),
        ],
        4: [
            _head("mixed", None, skills("texture", 0.70)),
            _head("generalization", None, skills("location", 0.60)),
            _head("generalization", None, skills("color", 0.0)),
            _head("mixed", None, skills("shape", 0.40)),
        ],
    }
    # leads: 4/0 0.7, 4/1 0.6, 4/3 0.4, 3/0 0.3, 3/2 0.2, 3/3 0.1, 3/1 0.05, 4/2 0.0
    out = entropy.control_roles(roles, "oracle", 1)
    got = {b: [(h["role"], h["attribute"]) for h in heads] for b, heads in out.items()}
    assert got == {
        3: [("mixed", None), ("generalization", None), ("mixed", None), ("generalization", None)],
        4: [
            ("attribute", "texture"),
            ("attribute", "location"),
            ("generalization", None),
            ("mixed", None),
        ],
    }
    assert out[3][1]["skill"] == roles[3][1]["skill"]  # the ground truth travels with the head


def test_control_roles_none_and_bad_controls():
    roles = {4: [_head("mixed", None, {"color": 0.5, "shape": 0.1})]}
    assert entropy.control_roles(roles, "none", 1) is roles
    with pytest.raises(
        ValueError, match="unknown roles control 'shuffle'; choose none, random or oracle"
    ):
        entropy.control_roles(roles, "shuffle", 1)
    with pytest.raises(
        ValueError,
        match="^--roles-control oracle needs roles with ground-truth decoding skills; "
        "entropy.py writes them only for the toy world \\(--dataset toyworld\\)$",
    ):
        entropy.control_roles({4: [_head("mixed")]}, "oracle", 1)


# --------------------------------------------------------------------------------------- roles file


def make_doc(layers=(3, 4), H=4, model="tiny"):
    roles = [
        ("attribute", "color"),
        ("generalization", None),
        ("mixed", None),
        ("specialist", None),
    ]
    heads = []
    for i, layer in enumerate(layers):
        for h in range(H):
            role, attribute = roles[(h + i) % len(roles)]
            P = {c: 0.0 for c in CONCEPTS}
            P["color" if role != "specialist" else "animal"] = 1.0
            entry = {
                "layer": layer,
                "head": h,
                "entropy": 0.25 * (h + i),
                "P": P,
                "texts": ["a red object"],
                "role": role,
                "attribute": attribute,
            }
            if role == "specialist":
                entry["concept"] = "animal"
            heads.append(entry)
    return {
        "format": entropy.FORMAT,
        "model": model,
        "checkpoint_sha256": "0" * 64,
        "num_layers": 4,
        "num_heads": H,
        "layers": list(layers),
        "probe": {"dataset": "toy", "split": "test", "images": 8},
        "texts_per_head": 1,
        "rank": 80,
        "concepts": list(CONCEPTS),
        "thresholds": {"low": 0.3, "high": 0.6},
        "heads": heads,
    }


def test_roles_round_trip(tmp_path):
    doc = make_doc()
    path = entropy.write_outputs(doc, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [
        "roles.json",
        "roles.md",
        "roles.png",
    ]  # no temp files left
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
    elif what == "heads-not-objects":
        doc["heads"][3] = "block 3 head 3: mixed"
    elif what == "heads-not-a-list":
        doc["heads"] = {"3": doc["heads"][:4], "4": doc["heads"][4:]}
    elif what == "layer-not-a-number":
        doc["heads"][2]["layer"] = [3]
    return doc


@pytest.mark.parametrize(
    "what, kwargs, message",
    [
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
        (
            "heads-not-objects",
            {},
            "'heads' must be a list of objects .* found \"block 3 head 3: mixed\"",
        ),
        ("heads-not-a-list", {}, "'heads' must be a list of objects"),
        ("layer-not-a-number", {}, "entry \\[3\\]/2: block/head outside the file's blocks"),
    ],
)
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


@pytest.mark.parametrize("what", ["json", "format", "role", "head-missing", "attribute"])
def test_a_damaged_roles_file_is_to_be_deleted_by_name(tmp_path, what):
    """A cached roles file that cannot be read says to delete that file (a rerun computes it again),
    not to recompute it with entropy.py (which writes elsewhere unless given the same --out)."""
    path = tmp_path / "cache" / "roles.json"
    path.parent.mkdir()
    path.write_text("{not json" if what == "json" else json.dumps(corrupt(make_doc(), what)))
    with pytest.raises(RolesError) as e:
        entropy.load_roles(str(path))
    assert f"delete {path} " in str(e.value) and "recompute" not in str(e.value)


def test_roles_for_another_model_are_to_be_replaced_not_deleted(tmp_path):
    path = tmp_path / "roles.json"
    path.write_text(json.dumps(make_doc()))
    with pytest.raises(RolesError, match="pass a roles file computed for this backbone") as e:
        entropy.load_roles(str(path), model_name="ViT-B/16")
    assert "delete" not in str(e.value)


def test_png_is_a_grid_of_blocks_by_heads_coloured_by_role(tmp_path):
    doc = make_doc(layers=(2, 3, 4), H=4)
    entropy.write_outputs(doc, str(tmp_path))
    img = Image.open(tmp_path / "roles.png").convert("RGB")
    assert img.size == (
        max(roles_report.LEFT + 4 * roles_report.CELL, 480) + 8,
        roles_report.TOP + 3 * roles_report.CELL + roles_report.LEGEND,
    )
    for entry in doc["heads"]:
        x0, y0 = roles_report.cell_origin(doc["layers"].index(entry["layer"]), entry["head"])
        corner = (
            x0 + roles_report.CELL - 6,
            y0 + roles_report.CELL - 6,
        )  # inside the cell, away from its text
        assert img.getpixel(corner) == roles_report.ROLE_COLORS[entry["role"]]


def test_layer_parsing(tmp_path):
    assert entropy.parse_layers(None, 12) == [9, 10, 11, 12]
    assert entropy.parse_layers(None, 2) == [1, 2]
    assert entropy.parse_layers("9-10,12", 12) == [9, 10, 12]
    assert entropy.layers_tag([12, 9, 10, 11]) == "9-12" and entropy.layers_tag([9, 11]) == "9_11"
    with pytest.raises(EntropyError, match="has 4 blocks"):
        entropy.parse_layers("3-6", 4)
    # blocks J..L with J beyond the depth: an empty list, one clear message (not an IndexError)
    with pytest.raises(
        EntropyError, match=r"no blocks in \[\]: the backbone has 12 blocks .* at most 12"
    ):
        entropy.parse_layers(list(range(13, 13)), 12)
    with pytest.raises(EntropyError, match="no blocks to analyse"):
        entropy.layers_tag([])
    with pytest.raises(EntropyError, match="has 12 blocks"):
        entropy.layers_tag([12, 13], num_layers=12)


def test_default_roles_path_is_keyed_by_everything_that_changes_the_roles(tiny_model, tmp_path):
    tiny_model.name, tiny_model.sha256 = "ViT-B/16", "ab" * 32
    (tmp_path / "mine.txt").write_text("a red thing\n")
    (tmp_path / "other" / "pets").mkdir(parents=True)
    base = dict(layers=[3, 4], cache_dir=str(tmp_path), dataset="imagenet")
    path = entropy.default_roles_path(tiny_model, **base)
    folder = os.path.basename(os.path.dirname(path))
    assert os.path.dirname(os.path.dirname(path)) == os.path.join(str(tmp_path), "roles")
    assert re.fullmatch(r"ViT-B-16_L3-4_imagenet-test_[0-9a-f]{12}", folder), folder
    # the same inputs, the same folder
    assert entropy.default_roles_path(tiny_model, **base) == path
    changes = [
        dict(layers=[4]),
        dict(dataset="eurosat"),
        dict(split="train"),
        dict(pool="toy"),
        dict(texts=str(tmp_path / "mine.txt")),
        dict(n=10),
        dict(rank=40),
        dict(low=0.5),
        dict(high=2.0),
        dict(max_images=500),
        dict(seed=1),
        dict(dataset=f"folder:{tmp_path / 'pets'}"),
        dict(dataset=f"folder:{tmp_path / 'other' / 'pets'}"),
    ]
    paths = {entropy.default_roles_path(tiny_model, **{**base, **change}) for change in changes}
    tiny_model.sha256 = "cd" * 32  # another checkpoint under the same name
    paths.add(entropy.default_roles_path(tiny_model, **base))
    tiny_model.sha256, tiny_model.name = "ab" * 32, "ViT-B-16"
    paths.add(entropy.default_roles_path(tiny_model, **base))
    assert len(paths | {path}) == len(changes) + 3
    (tmp_path / "mine.txt").write_text("a blue thing\n")  # the same file name, other texts
    assert (
        entropy.default_roles_path(tiny_model, **{**base, "texts": str(tmp_path / "mine.txt")})
        not in paths
    )
    with pytest.raises(EntropyError, match="unknown probe split 'val'"):
        entropy.default_roles_path(tiny_model, **{**base, "split": "val"})
    with pytest.raises(EntropyError, match="has 4 blocks"):
        entropy.default_roles_path(tiny_model, **{**base, "layers": [4, 5]})


# ------------------------------------------------------------------------------------- command line


@pytest.fixture
def fake_world(tmp_path, monkeypatch, tiny_model):
    """A two-class image folder (12 test images after data.py's split) and clip.load returning the
    tiny model."""
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
    rc = entropy.main(
        [
            "--backbone",
            "tiny",
            "--dataset",
            dataset,
            "--root",
            str(root),
            "--out",
            str(out),
            "--pool",
            "toy",
            "--n",
            "5",
            "--rank",
            "16",
            "--max-images",
            "10",
            "--batch-size",
            "4",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["roles.json", "roles.md", "roles.png"]
    doc = json.loads((out / "roles.json").read_text())
    assert doc["model"] == "tiny" and doc["checkpoint_sha256"] == "ab" * 32
    assert doc["layers"] == [1, 2, 3, 4] and doc["num_heads"] == 4 and len(doc["heads"]) == 16
    assert (
        doc["probe"]["images"] == 10
        and doc["probe"]["split"] == "test"
        and doc["probe"]["max_images"] == 10
    )
    low, high = doc["thresholds"]["low"], doc["thresholds"]["high"]
    toy_texts, toy_labels = entropy.toy_pool()
    concept_of = dict(zip(toy_texts, toy_labels))
    for head in doc["heads"]:
        assert len(head["texts"]) == len(set(head["texts"])) == 5
        # the stored P and entropy follow from the stored texts, and the role from the thresholds
        assert head["P"] == pytest.approx(
            entropy.concept_distribution([concept_of[t] for t in head["texts"]])
        )
        assert head["entropy"] == pytest.approx(entropy.concept_entropy(head["P"]), abs=1e-4)
        want = entropy.assign_role(head["entropy"], head["P"], low, high)
        assert (head["role"], head["attribute"]) == (want["role"], want["attribute"])
    roles = entropy.load_roles(
        str(out / "roles.json"), model_name="tiny", num_layers=4, num_heads=4
    )
    # the top tertile
    assert sum(h["role"] == "generalization" for r in roles.values() for h in r) >= 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--low", "2", "--high", "1"], "--low 2.0 is above --high 1.0"),
        (["--layers", "3-6"], "the backbone has 4 blocks"),
        (["--n", "30"], "at least n \\+ 1 = 31 probe images"),
        (["--texts", "DUP"], "repeats line 1"),
    ],
)
def test_cli_bad_input_exits_2_with_one_message(fake_world, capsys, extra, message):
    root, dataset = fake_world
    if "DUP" in extra:
        (root / "dup.txt").write_text("a red thing\na red thing\n")
        extra = ["--texts", str(root / "dup.txt")]
    rc = entropy.main(
        [
            "--dataset",
            dataset,
            "--root",
            str(root),
            "--out",
            str(root / "out"),
            "--pool",
            "toy",
            "--device",
            "cpu",
        ]
        + extra
    )
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert (
        lines[-1].startswith("entropy.py: error: ") and sum("error" in line for line in lines) == 1
    )
    assert re.search(message, lines[-1]), err
    assert not (root / "out").exists()


def test_too_few_probe_images_advise_what_the_caller_can_change(fake_world):
    """12 test images for n = 20: entropy.py's own command line suggests its flags; entropy.run as
    dear.py calls it (no caller named) also says what a dear.py user can do, who has no --max-images
    or --n; caller "dear.py" only that."""
    root, dataset = fake_world
    args = dict(out_dir=str(root / "out"), pool="default", device="cpu", n=20)
    with pytest.raises(EntropyError, match="at least n \\+ 1 = 21 probe images") as both:
        entropy.run("tiny", dataset, str(root), **args)
    with pytest.raises(EntropyError) as dear:
        entropy.run("tiny", dataset, str(root), caller="dear.py", **args)
    with pytest.raises(EntropyError) as cli:
        entropy.run("tiny", dataset, str(root), caller="entropy.py", **args)
    dear_fix = (
        "dear.py probes ImageNet val when ImageNet is under --root, else all training images of "
        "--dataset: put ImageNet under --root, or compute the roles with entropy.py and pass them "
        "with --roles"
    )
    assert dear_fix in str(both.value) and "--max-images" in str(both.value)
    assert dear_fix in str(dear.value) and "--max-images" not in str(dear.value)
    assert (
        "--max-images" in str(cli.value)
        and "--n" in str(cli.value)
        and "dear.py" not in str(cli.value)
    )


def test_cli_without_images_exits_2(fake_world, capsys):
    root, _ = fake_world
    (root / "empty").mkdir()
    rc = entropy.main(
        ["--dataset", f"folder:{root / 'empty'}", "--root", str(root), "--device", "cpu"]
    )
    err = capsys.readouterr().err
    assert (
        rc == 2
        and err.count("error") == 1
        and "entropy.py: error: " in err
        and "has no class sub-folders" in err
    )


def test_cli_probes_all_training_images_and_caches_by_its_inputs(fake_world, capsys):
    """--split train: every training image of the dataset (20 here; its test split has 12), recorded
    in roles.json; without --out the roles land in the CLIP cache at default_roles_path, which
    records all inputs."""
    root, dataset = fake_world
    args = [
        "--backbone",
        "tiny",
        "--dataset",
        dataset,
        "--root",
        str(root),
        "--pool",
        "toy",
        "--n",
        "3",
        "--rank",
        "8",
        "--max-images",
        "30",
        "--device",
        "cpu",
        "--download-root",
        str(root / "cache"),
    ]
    assert entropy.main(args + ["--split", "train"]) == 0, capsys.readouterr().err
    model = entropy.toyworld.load_clip("tiny")[0]
    path = entropy.default_roles_path(
        model,
        [1, 2, 3, 4],
        str(root / "cache"),
        dataset,
        split="train",
        pool="toy",
        n=3,
        rank=8,
        max_images=30,
    )
    doc = json.loads(open(path).read())
    assert doc["probe"] == {
        "dataset": "folder:" + os.path.realpath(dataset[7:]),
        "split": "train",
        "images": 20,
        "available": 20,
        "max_images": 30,
        "seed": 0,
    }
    assert doc["inputs"] == entropy.roles_inputs(
        model, [1, 2, 3, 4], dataset, split="train", pool="toy", n=3, rank=8, max_images=30
    )
    assert doc["inputs"]["checkpoint_sha256"] == "ab" * 32 and doc["inputs"]["low"] is None
    assert entropy.main(args) == 0  # the test split: another folder beside it
    assert len(list((root / "cache" / "roles").iterdir())) == 2
    test_doc = json.loads(
        open(
            entropy.default_roles_path(
                model,
                [1, 2, 3, 4],
                str(root / "cache"),
                dataset,
                pool="toy",
                n=3,
                rank=8,
                max_images=30,
            )
        ).read()
    )
    assert test_doc["probe"]["split"] == "test" and test_doc["probe"]["images"] == 12


def test_texts_per_head_default_follows_the_pool(fake_world, capsys, monkeypatch):
    """No --n: TextSpan's 20 with the default pool, toyworld.TEXTS_PER_HEAD with the toy pool (whose
    few words 20 texts would exhaust); the value used is the one recorded, and an explicit --n
    wins."""
    root, dataset = fake_world
    monkeypatch.setattr(entropy.toyworld, "TEXTS_PER_HEAD", 4)
    model = entropy.toyworld.load_clip("tiny")[0]
    inputs = lambda **k: entropy.roles_inputs(model, [3, 4], dataset, **k)["texts_per_head"]
    assert (inputs(pool="toy"), inputs(pool="default"), inputs(pool="toy", n=7)) == (4, 20, 7)
    args = [
        "--backbone",
        "tiny",
        "--dataset",
        dataset,
        "--root",
        str(root),
        "--pool",
        "toy",
        "--layers",
        "3-4",
        "--rank",
        "8",
        "--device",
        "cpu",
        "--out",
        str(root / "roles"),
    ]
    assert entropy.main(args) == 0, capsys.readouterr().err
    doc = json.loads((root / "roles" / "roles.json").read_text())
    assert doc["texts_per_head"] == doc["inputs"]["texts_per_head"] == 4
    assert all(len(h["texts"]) == 4 for h in doc["heads"])


# ------------------------------------------------------------------------------ mutation testing
# `./mutate.sh entropy.py` (mutmut, requirements-dev.txt). Surviving mutants judged equivalent, one
# line each:
# label_by_centroid 25, 26, 31, 33, 34, 35, 36: normalize's / argmax's dim -1 -> +1 or default: the
#   same on 2-D.
# head_contributions 21: norm(dim=+1) on the embedding [B, E]: the same axis as -1.
# encode_texts 32, 35: normalize's dim -1 -> +1 or default on [b, E]; 25: argmax(+1) on [b, T].
# encode_texts 27: the tokens cut one position after the last EOT: under the causal mask positions
#   after EOT never reach it.
# decompose 72, 90: einsum subscripts in capitals: the same contraction.
# decompose 108, 111, 119, 123: mean / var without keepdim: [B] instead of [B, 1], and through_ln
#   views both as [B, 1, ...] anyway; 109, 120: mean / var over dim +1 of [B, D]: the same axis.
# encode_texts 2, 34; collect_statistics 2, 7, 10, 14: device None: the CPU, where the tests run.
# textspan 6, 9: GramStatistics device None instead of the contributions' device: the same on the
#   CPU.
# textspan 10, textspan_from_statistics 7, 8: shape[+1] / shape[-2] of [N, E] or [E, E]: the same
#   size.
# textspan_from_statistics 37: min(rank, count) without E: a slice past E keeps all E columns
#   anyway.
# textspan_from_statistics 40: K = scatter * count instead of / count: a positive scale, the same
#   argmax.
# textspan_from_statistics 46: scores .sum(+1) on [T, E]: the same axis.
# textspan_from_statistics 51: norm <= 1e-12 instead of <: only a norm of exactly 1e-12 differs.
# textspan_from_statistics 66, 67, 68: signs in the update of K: every later text is orthogonal to
#   u, so t K t is the same whatever multiple of u u^T, K u u^T or u u^T K is added (the deflated
#   texts decide).
# textspan_from_statistics 36: min(rank, E) without count (N < rank): the extra eigenvectors carry
#   no variance; on the cases tried the picks agree (not proven equivalent;
#   test_textspan_with_fewer_images...).
# concept_entropy 13: > 1e-6 -> >= 1e-6: only a sum off by exactly 1e-6 differs.
# default_thresholds 7, 9: asarray without dtype float64: entropies are Python floats (float64
# anyway). control_roles 10, 12: 1000 * seed - block / 1001 * seed + block: another seeding, still
# per seed and block. compute_roles 1, 5, 66, 72: batch size 65, workers 1, shuffle None, default
# workers: the same images, order. compute_roles 40: available >= max_images: sampling all of them
# keeps every image in order. compute_roles 87, 90: device None: the CPU, where the tests run.
# compute_roles 130: P rounded to 5 decimals: the shares in the tests are multiples of 1/4 and 1/2.
# Not killed, not equivalent: compute_roles 191 (probe_factors' seed dropped: the tests use seed 0).
# mutmut's trampoline keeps the original signature, so default-value mutants
# (textspan_from_statistics 2; compute_roles 2, 3, 4) survive under mutmut although
# test_textspan_defaults_are... fails on each of them planted by hand. encode_texts 1 (batch_size
# 257) and collect_statistics 1 (keep True): default values, equivalent besides: the same texts in
# other batches; the same statistics, a copy kept.

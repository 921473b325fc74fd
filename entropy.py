"""Concept Entropy: which attention heads of CLIP's last blocks are attribute,
generalization or mixed heads.

DeAR's first step, offline and once per backbone. Read top to bottom:

  1. Text pools: short image descriptions, each labelled with one of 12 concepts (concepts.tsv)
  2. Head decomposition: each head's direct contribution to the image embedding, as TextSpan's PRS
     logger computes it (the CLS output = embedding + heads + MLPs; ln_post's mean and bias shared
     out evenly)
  3. TextSpan: per head, the N texts that explain most of the head's variance across images (SVD of
     the uncentred contributions, then greedy picks with removal, as
     `replace_with_iterative_removal`), computed exactly from per-head statistics (count, mean,
     centred scatter in fp64) accumulated while the probe images stream through the model: all
     50,000 ImageNet val images in bounded memory
  4. Concept entropy of those texts, and roles by entropy thresholds
  5. Outputs (roles.json, roles.md, roles.png), loading and validating a roles file
  6. The pipeline (compute_roles, run) and the command line

    # all of ImageNet val, as TextSpan:
    python entropy.py --backbone ViT-B/16 --dataset imagenet --root DATA
    # no ImageNet: the training images of a dataset, as dear.py's probe:
    python entropy.py --backbone ViT-B/16 --dataset eurosat --split train --root DATA

Blocks are counted from 1 in every file this script writes and reads (as the paper does: blocks 9-12
of ViT-B/16); code indexes the model's blocks from 0, converted in `decompose` only. Heads count
from 0.
"""

import argparse
import hashlib
import json
import math
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads; see BENCH.md
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import clip
import data
import toyworld
from roles_report import best_factor, render_markdown, render_png
from util import fingerprint, progress, write_atomic

FORMAT = "dear-roles/1"
# the 12 concepts of the text pool; the first five are DeAR's attributes, in the order of its tokens
CONCEPTS = (
    "color",
    "shape",
    "texture",
    "object",
    "location",
    "animal",
    "person",
    "scene",
    "text",
    "style",
    "count",
    "lighting",
)
ATTRIBUTES = CONCEPTS[:5]
ROLES = ("attribute", "generalization", "mixed", "specialist")
SPLITS = (
    "test",
    "train",
)  # probe splits: "test" for ImageNet val (as TextSpan), "train" for a training dataset
POOL_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "concepts.tsv")


class EntropyError(ValueError):
    """Bad input (images, texts, thresholds, layers);
    the message says what is wrong and how to fix it."""


class RolesError(EntropyError):
    """A roles file that cannot be used: wrong format, other model, missing layers or heads,
    unknown roles."""


# ----------------------------------------------------------------------------------------------
# 1. Text pools


def read_pool(path):
    """A pool file -> (texts, labels). One description per line; `concept<TAB>description` gives a
    label, a plain line has label None (labelled later by `label_by_centroid`); lines starting with
    '#' are comments."""
    if not os.path.isfile(path):
        raise EntropyError(
            f"text pool {path} does not exist; give a file with one description per line"
        )
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    texts, labels, seen = [], [], {}
    for i, line in enumerate(lines, 1):
        if line.startswith("#"):
            continue
        label, _, text = line.rpartition("\t")
        text = text.strip()
        if not text:
            raise EntropyError(f"{path}, line {i}: empty description; remove the line or write one")
        if label and label not in CONCEPTS:
            raise EntropyError(
                f"{path}, line {i}: unknown concept {label!r}; use one of {', '.join(CONCEPTS)}"
            )
        if text.lower() in seen:
            raise EntropyError(
                f"{path}, line {i}: {text!r} repeats line {seen[text.lower()]}; "
                "every description must be unique (TextSpan would pick it twice)"
            )
        seen[text.lower()] = i
        texts.append(text)
        labels.append(label or None)
    if not texts:
        raise EntropyError(f"text pool {path} has no descriptions")
    return texts, labels


def default_pool():
    """The built-in pool (concepts.tsv): ~1,700 descriptions over the 12 concepts."""
    return read_pool(POOL_FILE)


def toy_pool():
    """Descriptions in the words of the toy world (color, shape, texture, location),
    for the toy CLIP.

    The vocabularies are toyworld's own."""
    vocab = {
        "color": toyworld.COLORS,
        "shape": toyworld.SHAPES,
        "texture": toyworld.TEXTURES,
        "location": toyworld.LOCATIONS,
    }
    templates = {
        "color": ("{}", "a {} object", "something {}", "the color {}", "a {} thing", "painted {}"),
        "shape": (
            "{}",
            "a {}",
            "a photo of a {}",
            "a {} shape",
            "the outline of a {}",
            "a small {}",
        ),
        "texture": (
            "{}",
            "a {} object",
            "something {}",
            "a {} pattern",
            "a {} thing",
            "a {} surface",
        ),
        "location": (
            "in the {}",
            "an object in the {}",
            "something in the {}",
            "the {}",
            "a thing in the {}",
            "placed in the {}",
        ),
    }
    pairs = [(t.format(w), c) for c, words in vocab.items() for t in templates[c] for w in words]
    return [text for text, _ in pairs], [concept for _, concept in pairs]


# no_grad as a `with` block, not a decorator, in this file: mutmut (mutate.sh) skips decorated
# functions.
def encode_texts(model, texts, batch_size=256):
    """Raw descriptions (no template, as TextSpan) -> L2-normalised text embeddings [T, E], fp32."""
    with torch.no_grad():
        device = next(model.parameters()).device
        out = []
        for i in range(0, len(texts), batch_size):
            tokens = clip.tokenize(
                texts[i : i + batch_size], context_length=model.context_length, truncate=True
            )
            # [b, T]: up to the last EOT; causal, the tokens after an EOT never reach it
            tokens = tokens[:, : int(tokens.argmax(-1).max()) + 1]
            out.append(F.normalize(model.encode_text(tokens.to(device)).float(), dim=-1).cpu())
        return torch.cat(out)


def label_by_centroid(embeddings, ref_embeddings, ref_labels):
    """Label each text by its nearest concept centroid (cosine) among the labelled reference
    texts."""
    names = [c for c in CONCEPTS if c in set(ref_labels)]
    index = {c: i for i, c in enumerate(names)}
    which = torch.tensor([index[c] for c in ref_labels])
    centroids = torch.zeros(len(names), ref_embeddings.shape[1]).index_add_(
        0, which, ref_embeddings.float()
    )
    centroids = F.normalize(centroids, dim=-1)  # [concepts, E]
    nearest = (F.normalize(embeddings.float(), dim=-1) @ centroids.T).argmax(-1)  # [T]
    return [names[i] for i in nearest.tolist()]


# ----------------------------------------------------------------------------------------------
# 2. Head decomposition (TextSpan): the CLS output of the image tower as a sum of parts


def decompose(model, images, layers):
    """Split the image embedding (unnormalised, as encode_image) into additive parts,
    as TextSpan's PRS logger.

    r, the CLS entry of the residual stream after the last block, is a sum of 2L + 1 "intermediates"
    (L: all blocks of the model): the embedding, and per block its attention output and its MLP
    output. With r's per-image mean and std fixed, ln_post is linear, and TextSpan gives every
    intermediate p the share
        (p - mean(r) / (2L+1)) * ln_post.weight / std(r) + ln_post.bias / (2L+1),   then @ proj.
    An analysed block's attention output is split into its H heads: head h's part of the CLS output
    (attention row x values x its out_proj columns) plus out_proj.bias / H, with 1/H of the block's
    share of mean(r) and of ln_post.bias. layers: 1-based block numbers. Returns fp32 tensors that
    sum to encode_image(images):
      heads [B, nL, H, E]; mlp [B, nL, E] (the analysed blocks' MLPs);
      rest [B, E] (the embedding and the unanalysed blocks: 1 + 2 (L - nL) intermediates).
    """
    with torch.no_grad():
        visual = model.visual
        blocks = visual.transformer.resblocks
        analysed = sorted(set(int(l) - 1 for l in layers))  # 1-based blocks -> 0-based indices
        x = visual.embed(images)  # [B, 1+P, D]
        B, _, D = x.shape
        H = visual.heads
        hs = D // H
        heads, mlp = [], []
        # the CLS input of block 0; unanalysed blocks add their change below
        rest, rest_count = x[:, 0].float(), 1
        for b, block in enumerate(blocks):
            if b not in analysed:
                new = block(x)
                rest = rest + (new[:, 0] - x[:, 0]).float()
                rest_count += 2  # its attention output and its MLP
                x = new
                continue
            attn = block.attn
            y = block.ln_1(x)
            out, weights = attn(y, need_weights=True)  # out [B, T, D], weights [B, H, T, T]
            v = F.linear(y, attn.in_proj_weight[2 * D :], attn.in_proj_bias[2 * D :]).float()
            v = v.view(B, -1, H, hs)  # values [B, T, H, hs]
            # the CLS row of each head [B, H, hs]
            mixed = torch.einsum("bhm,bmhd->bhd", weights[:, :, 0].float(), v)
            # out_proj.weight is [D, D] with input columns grouped by head: head h owns columns
            # h*hs..(h+1)*hs-1
            w_o = attn.out_proj.weight.float().view(D, H, hs)  # [D_out, H, hs]
            # [B, H, D]
            heads.append(torch.einsum("bhd,ehd->bhe", mixed, w_o) + attn.out_proj.bias.float() / H)
            x = x + out
            m = block.mlp(block.ln_2(x))
            mlp.append(m[:, 0].float())
            x = x + m
        ln = visual.ln_post
        r = x[:, 0].float()  # the residual stream at CLS, what ln_post normalises [B, D]
        mean = r.mean(-1, keepdim=True)  # [B, 1]
        std = (r.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()  # [B, 1], eps inside
        proj = visual.proj.float()  # [D, E]
        total = 2 * len(blocks) + 1  # intermediates in r

        def through_ln(p, share):
            """A part p [B, ..., D] worth `share` of the intermediates -> [B, ..., E]."""
            # r's mean and std per image, broadcast over the rest
            view = (B,) + (1,) * (p.dim() - 1)
            return (
                (p - mean.view(view) * share) * ln.weight.float() / std.view(view)
                + ln.bias.float() * share
            ) @ proj

        return {
            "heads": through_ln(torch.stack(heads, 1), 1 / (total * H)),  # [B, nL, H, E]
            "mlp": through_ln(torch.stack(mlp, 1), 1 / total),  # [B, nL, E]
            "rest": through_ln(rest, rest_count / total),  # [B, E]
        }


def head_contributions(model, images, layers):
    """Each head's direct contribution [N, nL, H, E] in units of the normalised embedding
    (TextSpan): divided by the norm of the image embedding, so the parts of `decompose` sum to a
    unit vector."""
    parts = decompose(model, images, layers)
    return parts["heads"] / sum_parts(parts).norm(dim=-1).view(-1, 1, 1, 1)


def sum_parts(parts):
    """The image embedding [B, E] that the parts of `decompose` add up to."""
    return sum(p.reshape(p.shape[0], -1, p.shape[-1]).sum(1) for p in parts.values())


# ----------------------------------------------------------------------------------------------
# 3. TextSpan


def check_textspan(n, rank, num_texts, num_images, dim, caller=None):
    """Stop early, with what to change, when TextSpan cannot pick n distinct directions.
    caller: who can act on the advice ("entropy.py": its flags; "dear.py": its own; None: both)."""
    if n > num_texts:
        raise EntropyError(
            f"TextSpan picks n = {n} texts per head but the pool has only {num_texts}; "
            + advice(caller, "use a larger pool (--texts) or a smaller --n")
        )
    if n > min(rank, dim):
        raise EntropyError(
            f"n = {n} texts per head needs rank >= n and embedding width >= n, got rank {rank} "
            f"and width {dim}; " + advice(caller, "raise --rank or lower --n")
        )
    if num_images < n + 1:
        raise EntropyError(
            f"TextSpan needs at least n + 1 = {n + 1} probe images for n = {n} texts per head "
            f"(the centred contributions of N images span at most N - 1 directions), got "
            f"{num_images}; " + advice(caller, IMAGES_FIX)
        )


IMAGES_FIX = (
    "use more images (a larger --max-images, or leave it out: the whole split) or fewer texts (--n)"
)
DEAR_FIX = (
    "dear.py probes ImageNet val when ImageNet is under --root, else all training images of "
    "--dataset: put ImageNet under --root, or compute the roles with entropy.py and pass them with "
    "--roles"
)


def advice(caller, flags):
    """How to fix a TextSpan input: entropy.py's `flags`, or, for dear.py (which computes the roles
    with the defaults on its own probe), what its user can do; caller None: both."""
    if caller == "entropy.py":
        return flags
    if caller == "dear.py":
        return DEAR_FIX
    return f"with entropy.py: {flags}; {DEAR_FIX}"


class GramStatistics:
    """What TextSpan needs of each head's contributions, accumulated in fp64 over images streamed in
    batches.

    Per head (leading dims `shape`, e.g. (blocks, heads)): the count N, the mean m [E] and the
    centred scatter S = sum_i (c_i - m)(c_i - m)^T [E, E]. They give both matrices of
    `replace_with_iterative_removal`: the uncentred Gram C^T C = S + N m m^T (its eigenvectors are
    the right singular vectors of C) and the centred covariance S / N (the variance of C t across
    images is t S t / N). Batches are merged by the pairwise update of Chan, Golub and LeVeque, so
    no large mean is ever subtracted from a large sum."""

    def __init__(self, shape, dim, device=None):
        self.count = 0
        f64 = dict(dtype=torch.float64, device=device)
        self.mean = torch.zeros(*shape, dim, **f64)  # [*shape, E]
        self.scatter = torch.zeros(*shape, dim, dim, **f64)  # [*shape, E, E]

    def add(self, batch):
        """batch [B, *shape, E]: one contribution per image and head."""
        E = self.mean.shape[-1]
        x = batch.to(self.mean).reshape(batch.shape[0], -1, E).transpose(0, 1)  # [heads, B, E]
        b = x.shape[1]
        if b == 0:
            return
        batch_mean = x.mean(1)  # [heads, E]
        x = x - batch_mean.unsqueeze(1)  # centred on the batch's own mean
        mean, scatter = (
            self.mean.view(-1, E),
            self.scatter.view(-1, E, E),
        )  # views, updated in place
        delta = batch_mean - mean  # [heads, E]
        total = self.count + b
        scatter.baddbmm_(x.transpose(1, 2), x)  # + the batch's own scatter
        between = self.count * b / total  # weight of the two means' difference
        scatter.baddbmm_(delta.unsqueeze(2), delta.unsqueeze(1), alpha=between)
        mean.add_(delta, alpha=b / total)
        self.count = total

    def head(self, index):
        """(count, mean [E], scatter [E, E]) of one head; index: into the leading dims,
        e.g. (li, h)."""
        return self.count, self.mean[index], self.scatter[index]


def textspan(contributions, text_embeddings, n=20, rank=80):
    """TextSpan for one head from its contributions [N, E] on N images
    (textspan_from_statistics)."""
    stats = GramStatistics((), contributions.shape[-1], device=contributions.device)
    stats.add(contributions)
    return textspan_from_statistics(*stats.head(()), text_embeddings, n=n, rank=rank)


def textspan_from_statistics(count, mean, scatter, text_embeddings, n=20, rank=80, caller=None):
    """Greedy TextSpan for one head (`replace_with_iterative_removal`): indices of the n texts that
    best span the head's variance across images, in pick order.

    count, mean [E], scatter [E, E]: the head's contributions C [count, E] as GramStatistics keeps
    them; text_embeddings [T, E].
    1. The texts are projected onto the top-`rank` right singular vectors of C as it is: uncentred,
       as TextSpan does (the SVD comes before the mean is removed; a head with a large mean keeps
       the mean's direction in its span). They are the top eigenvectors of C^T C = scatter + count
       mean mean^T.
    2. The contributions are centred: their covariance is K = scatter / count.
    3. n times: pick the text t whose projection C t has the largest std across images (the largest
       t K t; the std's N or N - 1 does not change which), and remove that direction u = t / |t|
       from the images and from every text: C -> C (I - u u^T) turns K into (I - u u^T) K
       (I - u u^T) exactly.
    """
    mean, scatter = mean.double(), scatter.double()
    texts = text_embeddings.to(scatter)
    E = scatter.shape[-1]
    check_textspan(n, rank, texts.shape[0], count, E, caller)
    # 1. the span: eigenvectors of C^T C (ascending eigenvalues); an SVD of C [N, E] has
    #    min(N, E) of them
    _, vectors = torch.linalg.eigh(scatter + count * torch.outer(mean, mean))
    basis = vectors[:, -min(rank, count, E) :]  # [E, r]
    texts = texts @ basis @ basis.T  # [T, E], projected onto the head's top-rank span
    # 2. centre after the SVD
    K = scatter / count  # [E, E]
    picks = []
    for _ in range(n):
        # variance of C @ t across images, for every text [T]
        scores = ((texts @ K) * texts).sum(-1)
        j = int(scores.argmax())
        norm = texts[j].norm()
        if norm < 1e-12:
            raise EntropyError(
                f"the text pool spans only {len(picks)} directions inside this head's top-{rank} "
                f"space, fewer than n = {n}; "
                + advice(caller, "use a larger pool or a smaller --n")
            )
        picks.append(j)
        u = texts[j] / norm  # [E]
        Ku = K @ u
        # (I-uu^T) K (I-uu^T)
        K = K - torch.outer(Ku, u) - torch.outer(u, Ku) + (u @ Ku) * torch.outer(u, u)
        texts = texts - torch.outer(texts @ u, u)  # remove u from every text (the pick becomes 0)
    return picks


# ----------------------------------------------------------------------------------------------
# 4. Concept entropy and roles


def concept_distribution(labels):
    """P over the 12 concepts: the share of a head's texts in each concept (dict in CONCEPTS
    order)."""
    return {c: sum(1 for l in labels if l == c) / len(labels) for c in CONCEPTS}


def concept_entropy(p):
    """H(P) = -sum_c P(c) log2 P(c), in bits; p a sequence,
    tensor or dict of probabilities that sum to 1."""
    values = [float(x) for x in (p.values() if isinstance(p, dict) else p)]
    if any(x < 0 for x in values) or abs(sum(values) - 1.0) > 1e-6:
        raise ValueError(f"not a probability distribution (non-negative, sum 1): {values}")
    return 0.0 + -sum(x * math.log2(x) for x in values if x > 0)  # 0.0 + turns -0.0 into 0.0


def default_thresholds(entropies):
    """(low, high): the 1/3 and 2/3 quantiles (linear interpolation) of the analysed heads'
    entropies."""
    low, high = np.quantile(np.asarray(entropies, dtype=np.float64), [1 / 3, 2 / 3])
    return float(low), float(high)


def assign_role(entropy, P, low, high):
    """Role of one head: {"role", "attribute"} (+ "concept" for a specialist).

    H <= low: a specialist; an attribute head if its dominant concept is one of the five attributes,
    else an "other specialist" (role "specialist", which DeAR masks like a generalization head).
    H >= high: generalization; otherwise mixed. A tie for the dominant concept goes to the concept
    listed first in CONCEPTS (attributes first)."""
    if entropy <= low:
        dominant = max(CONCEPTS, key=lambda c: (P.get(c, 0.0), -CONCEPTS.index(c)))
        if dominant in ATTRIBUTES:
            return {"role": "attribute", "attribute": dominant}
        return {"role": "specialist", "attribute": None, "concept": dominant}
    if entropy >= high:
        return {"role": "generalization", "attribute": None}
    return {"role": "mixed", "attribute": None}


# ----------------------------------------------------------------------------------------------
# 4b. Ground truth: how well labelled factors can be decoded from each head (where the labels are
# known)


def probe_factors(contributions, factors, folds=2, ridge=1.0, seed=0):
    """Held-out accuracy of a linear probe that reads each labelled factor from each head's
    contribution.

    contributions [N, nL, H, E] (as collect_contributions); factors {name: [N] class ids}, e.g. the
    colour, shape, texture and location of every toy image. The probe is a ridge least-squares
    classifier (one-hot targets, features centred on the training fold, ridge = `ridge` x the mean
    eigenvalue of the training covariance: strong enough that a head of pure noise scores at chance,
    not below it, with a few hundred images in 64 dimensions), fitted on all folds but one and
    scored on the one left out; every image is scored once.
    Returns {"accuracy": {name: [nL][H] floats}, "chance": {name: share of the commonest class},
    "skill": {name: [nL][H]}}, skill = (accuracy - chance) / (1 - chance): 0 = chance, 1 = perfect,
    so factors with different numbers of classes compare fairly."""
    X = contributions.double()
    N, nL, H, E = X.shape
    # [nL*H, N, E]: one probe per head, solved in one batch
    X = X.reshape(N, nL * H, E).transpose(0, 1)
    # [N] fold of each image
    fold = torch.randperm(N, generator=torch.Generator().manual_seed(seed)) % folds
    out = {"accuracy": {}, "chance": {}, "skill": {}}
    for name, labels in factors.items():
        y = torch.as_tensor(labels, dtype=torch.long)  # [N]
        if y.shape != (N,):
            raise EntropyError(f"factor {name!r} has {tuple(y.shape)} labels for {N} probe images")
        C = int(y.max()) + 1
        Y = F.one_hot(y, C).double()  # [N, C]
        correct = torch.zeros(nL * H)
        for k in range(folds):
            tr, te = fold != k, fold == k
            mu = X[:, tr].mean(1, keepdim=True)  # [nL*H, 1, E]
            Xtr, Xte = X[:, tr] - mu, X[:, te] - mu
            G = Xtr.transpose(1, 2) @ Xtr  # [nL*H, E, E]
            lam = ridge * G.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-12)  # [nL*H]
            y_mean = Y[tr].mean(0)  # [C]: the intercept, the class shares of the training fold
            W = torch.linalg.solve(
                G + lam.view(-1, 1, 1) * torch.eye(E, dtype=G.dtype),
                Xtr.transpose(1, 2) @ (Y[tr] - y_mean),
            )  # [nL*H, E, C]
            pred = (Xte @ W + y_mean).argmax(-1)  # [nL*H, n_te]
            correct += (pred == y[te]).sum(1).float()
        acc = (correct / N).view(nL, H)
        chance = float(torch.bincount(y, minlength=C).max()) / N
        out["accuracy"][name] = [[round(float(a), 4) for a in row] for row in acc]
        out["chance"][name] = round(chance, 4)
        out["skill"][name] = [
            [round((float(a) - chance) / (1 - chance), 4) for a in row] for row in acc
        ]
    return out


def control_roles(roles, control: str, seed: int):
    """Controls for Concept Entropy: the roles DeAR masks with under --roles-control. roles
    {block: [head dicts]}.

    "none": the roles as given. "random": in every block, the heads' roles shuffled by a permutation
    seeded with `seed` and the block number; each block keeps its number of heads of each role (and
    of each attribute), only which head holds which role is chance. "oracle": roles from the ground
    truth instead of the texts: the heads of all given blocks ranked by how much better their
    best-decoded factor is decoded than the runner-up (the "skill" that probe_factors stores, the
    toy world only); the top ones become attribute heads of that factor, the bottom ones
    generalization heads, the rest mixed, in the same numbers as the given roles."""
    if control == "none":
        return roles
    if control == "random":
        out = {}
        for block, heads in roles.items():
            g = torch.Generator().manual_seed(1000 * seed + block)
            out[block] = [dict(heads[i]) for i in torch.randperm(len(heads), generator=g).tolist()]
        return out
    if control != "oracle":
        raise ValueError(f"unknown roles control {control!r}; choose none, random or oracle")
    heads = [
        (block, h, entry) for block, entries in roles.items() for h, entry in enumerate(entries)
    ]
    if any(not entry.get("skill") for _, _, entry in heads):
        raise ValueError(
            "--roles-control oracle needs roles with ground-truth decoding skills; entropy.py "
            "writes them only for the toy world (--dataset toyworld)"
        )

    n_attr = sum(e["role"] == "attribute" for _, _, e in heads)
    # both masked alike
    n_gen = sum(e["role"] in ("generalization", "specialist") for _, _, e in heads)
    order = sorted(heads, key=lambda t: -best_factor(t[2]["skill"])[1])  # most specialised first
    out = {block: [None] * len(entries) for block, entries in roles.items()}
    for rank, (block, h, entry) in enumerate(order):
        if rank < n_attr:
            role = {"role": "attribute", "attribute": best_factor(entry["skill"])[0]}
        elif rank >= len(order) - n_gen:
            role = {"role": "generalization", "attribute": None}
        else:
            role = {"role": "mixed", "attribute": None}
        out[block][h] = {**entry, **role}
    return out


# ----------------------------------------------------------------------------------------------
# 5. Outputs: roles.json (roles.md and roles.png are drawn by roles_report.py); loading a roles file


def write_outputs(doc, out_dir):
    """roles.json, roles.md and roles.png in out_dir (each written atomically);
    returns the JSON path."""
    path = os.path.join(out_dir, "roles.json")
    write_atomic(os.path.join(out_dir, "roles.md"), render_markdown(doc))
    render_png(doc, os.path.join(out_dir, "roles.png"))
    # last: its presence means the set is complete
    write_atomic(path, json.dumps(doc, indent=1) + "\n")
    return path


def load_roles(path, model_name=None, num_layers=None, num_heads=None, layers=None):
    """Read and validate a roles file; returns {1-based block: [one dict per head, in head order]},
    each dict with "role", "attribute" (None unless an attribute head), "entropy", for specialists
    "concept", and where the file has them (toy world) the ground-truth decoding "skill" per factor.

    model_name, num_layers, num_heads: checked against the file when given; layers: 1-based blocks
    the caller needs, all of which must be in the file. Raises RolesError with what is wrong and
    what to do: a damaged file (unreadable, wrong format, bad or missing entries) is to be deleted,
    so that the next run computes it again (dear.py does for its cache); a sound file for another
    model or other blocks is to be replaced by the right one."""
    if not os.path.isfile(path):
        raise RolesError(
            f"roles file {path} does not exist; compute it with `python entropy.py ...` "
            "(dear.py does so itself without --roles) or pass the right file"
        )
    other = (
        "pass a roles file computed for this backbone and "
        "these blocks, or compute one with `python entropy.py`"
    )
    hint = (
        f"delete {path} (a cached roles file is then computed again on the next run) or pass a "
        "roles file written by entropy.py"
    )  # a damaged file
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise RolesError(f"roles file {path} is not readable JSON ({e}); {hint}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise RolesError(
            f"{path} is not a roles file of format {FORMAT!r} (found {found!r}); {hint}"
        )
    for key in ("model", "num_layers", "num_heads", "layers", "heads"):
        if key not in doc:
            raise RolesError(f"roles file {path} has no {key!r} entry; {hint}")
    if model_name is not None and doc["model"] != model_name:
        raise RolesError(
            f"roles file {path} was computed for {doc['model']!r}, not {model_name!r}; {other}"
        )
    for key, want in (("num_layers", num_layers), ("num_heads", num_heads)):
        if want is not None and doc[key] != want:
            raise RolesError(
                f"roles file {path} has {key} = {doc[key]}, the model has {want}; {other}"
            )
    if not isinstance(doc["num_heads"], int) or doc["num_heads"] < 1:
        raise RolesError(
            f"roles file {path}: 'num_heads' must be a "
            f"positive number, got {doc['num_heads']!r}; {hint}"
        )
    if not isinstance(doc["layers"], list) or not all(isinstance(l, int) for l in doc["layers"]):
        raise RolesError(
            f"roles file {path}: 'layers' must be a list of "
            f"block numbers, got {doc['layers']!r}; {hint}"
        )
    if not isinstance(doc["heads"], list) or not all(isinstance(e, dict) for e in doc["heads"]):
        bad = (
            doc["heads"]
            if not isinstance(doc["heads"], list)
            else next(e for e in doc["heads"] if not isinstance(e, dict))
        )
        raise RolesError(
            f"roles file {path}: 'heads' must be a list of objects (one per head, with layer, "
            f"head, role, attribute), found {json.dumps(bad)[:60]}; {hint}"
        )
    H, file_layers = doc["num_heads"], list(doc["layers"])
    missing = [l for l in (layers or []) if l not in file_layers]
    if missing:
        raise RolesError(
            f"roles file {path} covers blocks {file_layers} but blocks {missing} are needed "
            f"(1-based); {other}"
        )
    roles = {l: [None] * H for l in file_layers}
    for entry in doc["heads"]:
        where = f"roles file {path}, entry {entry.get('layer')}/{entry.get('head')}"
        layer, head, role = entry.get("layer"), entry.get("head"), entry.get("role")
        if (
            not isinstance(layer, int)
            or layer not in roles
            or not isinstance(head, int)
            or not 0 <= head < H
        ):
            raise RolesError(
                f"{where}: block/head outside the file's blocks {file_layers} x {H} heads; {hint}"
            )
        if role not in ROLES:
            raise RolesError(f"{where}: unknown role {role!r} (known: {', '.join(ROLES)}); {hint}")
        attribute = entry.get("attribute")
        if role == "attribute" and attribute not in ATTRIBUTES:
            raise RolesError(
                f"{where}: an attribute head needs an attribute in {ATTRIBUTES}, "
                f"got {attribute!r}; {hint}"
            )
        if role != "attribute" and attribute is not None:
            raise RolesError(
                f"{where}: a {role} head must have attribute null, got {attribute!r}; {hint}"
            )
        if roles[layer][head] is not None:
            raise RolesError(f"{where}: this head is listed twice; {hint}")
        roles[layer][head] = {"role": role, "attribute": attribute, "entropy": entry.get("entropy")}
        if role == "specialist":
            roles[layer][head]["concept"] = entry.get("concept")
        if entry.get(
            "skill"
        ):  # ground-truth decoding skills (toy world): what --roles-control oracle reads
            roles[layer][head]["skill"] = dict(entry["skill"])
    absent = [(l, h) for l in file_layers for h in range(H) if roles[l][h] is None]
    if absent:
        raise RolesError(
            f"roles file {path} lacks {len(absent)} heads, e.g. block {absent[0][0]} head "
            f"{absent[0][1]}; {hint}"
        )
    return roles


def layers_tag(layers, num_layers=None):
    """'9-12' for a contiguous run of blocks, else '9_11'. num_layers: the backbone's depth,
    checked when given."""
    layers = parse_layers(layers, num_layers) if num_layers is not None else sorted(layers)
    if not layers:
        raise EntropyError(
            "no blocks to analyse (an empty list); the first block (J) must not exceed the "
            "backbone's depth"
        )
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 1:
        return f"{layers[0]}-{layers[-1]}"
    return "_".join(map(str, layers))


def _safe(name):
    """A name as a folder-name part: letters, digits and ._@- only."""
    return "".join(c if c.isalnum() or c in "._@-" else "-" for c in str(name)).strip("-")


def pool_sha256(pool, texts_file=None):
    """SHA256 of the text pool's content: the built-in pool `pool` ("default" or "toy"), plus the
    --texts file when given (its unlabelled lines are labelled by that built-in pool)."""
    if pool not in ("default", "toy"):
        raise EntropyError(f"unknown pool {pool!r}; use default or toy (or --texts FILE)")
    h = hashlib.sha256()
    if pool == "default":
        with open(POOL_FILE, "rb") as f:
            h.update(f.read())
    else:
        h.update("".join(f"{c}\t{t}\n" for t, c in zip(*toy_pool())).encode("utf-8"))
    if texts_file is not None:
        if not os.path.isfile(texts_file):
            raise EntropyError(
                f"text pool {texts_file} does not exist; give a file with one description per line"
            )
        with open(texts_file, "rb") as f:
            h.update(b"\0" + f.read())
    return h.hexdigest()


def texts_per_head(pool):
    """TextSpan's N when none is given: 20, as TextSpan, or toyworld.TEXTS_PER_HEAD with the toy
    pool (whose few words span only about 13 directions of the toy CLIP's 64)."""
    return toyworld.TEXTS_PER_HEAD if pool == "toy" else 20


def roles_inputs(
    model,
    layers,
    dataset,
    split="test",
    pool=None,
    texts=None,
    n=None,
    rank=80,
    low=None,
    high=None,
    max_images=None,
    seed=0,
):
    """Everything that changes the roles `run` computes,
    as a dict (recorded in roles.json as "inputs").

    model: the loaded CLIP (its .name and .sha256); layers: 1-based blocks; dataset: a data.py name
    (a named dataset is the same set under any --root) or folder:PATH (resolved to an absolute
    path); pool None: the default for the model (see load_pool); n None: the pool's
    (texts_per_head); low/high None: the tertiles (recorded as null)."""
    name = getattr(model, "name", None) or "unknown"
    layers = parse_layers(layers, model.visual.layers)
    if split not in SPLITS:
        raise EntropyError(f"unknown probe split {split!r}; use one of {', '.join(SPLITS)}")
    if str(dataset).startswith("folder:"):
        dataset = "folder:" + os.path.realpath(os.path.expanduser(dataset[len("folder:") :]))
    pool = pool or ("toy" if name == "toy" else "default")
    return {
        "model": name,
        "checkpoint_sha256": getattr(model, "sha256", None),
        "layers": layers,
        "dataset": dataset,
        "split": split,
        "max_images": max_images,
        "seed": seed,
        "pool": pool,
        "texts_file": os.path.basename(texts) if texts else None,
        "pool_sha256": pool_sha256(pool, texts),
        "texts_per_head": n or texts_per_head(pool),
        "rank": rank,
        "low": low,
        "high": high,
    }


def default_roles_path(
    model,
    layers,
    cache_dir,
    dataset,
    split="test",
    pool=None,
    texts=None,
    n=None,
    rank=80,
    low=None,
    high=None,
    max_images=None,
    seed=0,
):
    """Where `run` caches roles:
    <cache_dir>/roles/<model>_L<blocks>_<probe>-<split>_<key>/roles.json, where <key> is a short
    hash of everything that changes the roles (roles_inputs: backbone name and checkpoint SHA256,
    blocks, probe dataset and split, pool content, n, rank, thresholds, max_images, seed)."""
    inputs = roles_inputs(
        model,
        layers,
        dataset,
        split=split,
        pool=pool,
        texts=texts,
        n=n,
        rank=rank,
        low=low,
        high=high,
        max_images=max_images,
        seed=seed,
    )
    probe = inputs["dataset"]
    probe = os.path.basename(probe[len("folder:") :]) if probe.startswith("folder:") else probe
    folder = (
        f"{_safe(inputs['model'])}_L{layers_tag(inputs['layers'])}_{_safe(probe)}-{split}_"
        f"{fingerprint(inputs)[:12]}"
    )
    return os.path.join(cache_dir, "roles", folder, "roles.json")


# ----------------------------------------------------------------------------------------------
# 6. The pipeline and the command line


def parse_layers(spec, num_layers):
    """'9-12', '9,10,11,12' or None (the last four blocks,
    or all if fewer) -> sorted 1-based blocks."""
    if spec is None:
        return list(range(max(1, num_layers - 3), num_layers + 1))
    if isinstance(spec, str):
        try:
            layers = set()
            for part in spec.split(","):
                lo, _, hi = part.partition("-")
                layers.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise EntropyError(
                f"cannot read layers {spec!r}; write e.g. 9-12 or 9,10,11,12 (blocks from 1)"
            ) from None
    else:
        layers = set(int(l) for l in spec)
    if not layers:  # e.g. dear.py's blocks J..L with J beyond the depth
        raise EntropyError(
            f"no blocks in {spec!r}: the backbone has {num_layers} blocks (1..{num_layers}); "
            f"choose blocks within that range, e.g. {max(1, num_layers - 3)}-{num_layers} (so a "
            f"first block J of at most {num_layers})"
        )
    if min(layers) < 1 or max(layers) > num_layers:
        raise EntropyError(
            f"the backbone has {num_layers} blocks (1..{num_layers}) but layers {spec!r} asks for "
            f"blocks {min(layers)}..{max(layers)}; choose blocks within 1..{num_layers}"
        )
    return sorted(layers)


def check_thresholds(low, high):
    if low is not None and high is not None and low > high:
        raise EntropyError(
            f"--low {low} is above --high {high}; heads with H <= low are specialists and heads "
            "with H >= high generalization heads, so low must not exceed high"
        )


def load_pool(model, pool=None, texts_file=None):
    """(texts, labels, name): a built-in pool, or a user file whose unlabelled lines get the label
    of the nearest concept centroid of the built-in pool `pool` in CLIP text space. pool None: "toy"
    for the toy CLIP (model.name == "toy"), else "default"."""
    pool = pool or ("toy" if getattr(model, "name", None) == "toy" else "default")
    if pool not in ("default", "toy"):
        raise EntropyError(f"unknown pool {pool!r}; use default or toy (or --texts FILE)")
    ref_texts, ref_labels = default_pool() if pool == "default" else toy_pool()
    if texts_file is None:
        return ref_texts, ref_labels, pool
    texts, labels = read_pool(texts_file)
    todo = [i for i, l in enumerate(labels) if l is None]
    if todo:
        nearest = label_by_centroid(
            encode_texts(model, [texts[i] for i in todo]),
            encode_texts(model, ref_texts),
            ref_labels,
        )
        for i, label in zip(todo, nearest):
            labels[i] = label
    return texts, labels, os.path.basename(texts_file)


def collect_statistics(model, loader, layers, total, keep=False):
    """Stream the probe images through the model: (GramStatistics of every head [nL, H], fp64 on
    the model's device; the contributions [N, nL, H, E] fp32 on the CPU if keep, else None). Memory
    is bounded by the statistics (nL H E^2 x 8 bytes: 100 MB for 4 blocks of ViT-B/16) and one
    batch, whatever the number of images; keep (the toy world's ground-truth probes) stores every
    image's contributions besides."""
    with torch.no_grad():
        device = next(model.parameters()).device
        stats = GramStatistics(
            (len(layers), model.visual.heads), model.visual.output_dim, device=device
        )
        kept, done, start = [], 0, time.time()
        for images, _ in loader:
            images = images[: total - done].to(device)
            contributions = head_contributions(model, images, layers)  # [B, nL, H, E] fp32
            stats.add(contributions)
            if keep:
                kept.append(contributions.cpu())
            done += len(images)
            progress("probe images", done, total, start)
            if done >= total:
                break
        return stats, (torch.cat(kept) if keep else None)


def compute_roles(
    model,
    items,
    texts,
    text_concepts,
    layers,
    out_dir,
    batch_size=64,
    max_images=None,
    n=20,
    rank=80,
    low=None,
    high=None,
    probe=None,
    pool_name=None,
    seed=0,
    num_workers=0,
    inputs=None,
    factors=None,
    caller=None,
):
    """Concept Entropy for the heads of `layers` (1-based) -> roles.json
    (+ .md, .png) in out_dir; its path.

    items: probe images as data.py lists them, (path, label, classname): all of them (max_images
    None, the default, as TextSpan reads all of ImageNet val), or, if there are more than
    max_images, a seeded random sample of max_images of them (in their original order). The images
    are streamed: per head only the statistics TextSpan needs are kept (GramStatistics), so memory
    does not grow with the number of images. texts / text_concepts: the
    text pool and one concept per text. low / high: entropy thresholds in bits (None: the 1/3 and
    2/3 quantiles over the analysed heads). probe: what roles.json records of the probe set
    (dataset, split); inputs: roles_inputs(...), recorded as is. factors: None, or a function of the
    probe images' paths giving their known factors (e.g. toyworld.factor_labels); each head then
    also gets the held-out accuracy with which each factor can be decoded from it (probe_factors),
    the ground truth beside its role. The model runs on the device of its parameters. caller: who
    gets the advice of an error (see check_textspan)."""
    visual = model.visual
    layers = parse_layers(layers, visual.layers)
    check_thresholds(low, high)
    if len(texts) != len(text_concepts) or any(c not in CONCEPTS for c in text_concepts):
        raise EntropyError(
            "every text of the pool needs one concept label out of " + ", ".join(CONCEPTS)
        )
    if len(set(texts)) != len(texts):
        raise EntropyError("the text pool has duplicate descriptions; TextSpan needs unique texts")
    if not items:
        raise EntropyError("no probe images found; check --dataset/--root/--split")
    items = list(items)
    available = len(items)
    if max_images is not None and available > max_images:
        keep = sorted(random.Random(seed).sample(range(available), max_images))
        items = [items[i] for i in keep]
    check_textspan(n, rank, len(texts), len(items), visual.output_dim, caller)
    loader = data.make_loader(
        items,
        data.test_transform(visual.input_resolution),
        batch_size,
        shuffle=False,
        num_workers=num_workers,
    )
    # per head: count, mean, scatter; every image's contributions [N, nL, H, E] only for the probes
    stats, contributions = collect_statistics(
        model, loader, layers, len(items), keep=factors is not None
    )
    device = next(model.parameters()).device
    text_embeddings = encode_texts(model, texts).to(device)  # [T, E]
    heads, start = [], time.time()
    for li, layer in enumerate(layers):
        for h in range(visual.heads):
            picks = textspan_from_statistics(
                *stats.head((li, h)), text_embeddings, n=n, rank=rank, caller=caller
            )
            P = concept_distribution([text_concepts[j] for j in picks])
            heads.append(
                {
                    "layer": layer,
                    "head": h,
                    "entropy": round(concept_entropy(P), 4),
                    "P": {c: round(p, 4) for c, p in P.items()},
                    "texts": [texts[j] for j in picks],
                }
            )
            progress("heads", len(heads), len(layers) * visual.heads, start)
    auto_low, auto_high = default_thresholds([h["entropy"] for h in heads])
    # rounded as stored, so the file reproduces the roles
    low = round(auto_low if low is None else low, 4)
    high = round(auto_high if high is None else high, 4)
    check_thresholds(low, high)
    for head in heads:
        head.update(assign_role(head["entropy"], head["P"], low, high))
    decoding = None
    if factors is not None:  # ground truth: decode the known factors from every head, held out
        decoding = probe_factors(
            contributions.float(), factors([path for path, _, _ in items]), seed=seed
        )
        for i, head in enumerate(heads):
            li, h = divmod(i, visual.heads)
            head["decoding"] = {f: decoding["accuracy"][f][li][h] for f in decoding["accuracy"]}
            head["skill"] = {f: decoding["skill"][f][li][h] for f in decoding["skill"]}
        decoding = {
            "probe": "ridge least-squares classifier, 2-fold cross-validation",
            "chance": decoding["chance"],
        }
    doc = {
        "format": FORMAT,
        "model": getattr(model, "name", None) or "unknown",
        "checkpoint_sha256": getattr(model, "sha256", None),
        "num_layers": visual.layers,
        "num_heads": visual.heads,
        "layers": layers,
        "probe": {
            **(probe or {}),
            "images": stats.count,
            "available": available,
            "max_images": max_images,
            "seed": seed,
        },
        "pool": {"name": pool_name, "texts": len(texts)},
        "texts_per_head": n,
        "rank": rank,
        "concepts": list(CONCEPTS),
        "thresholds": {"low": low, "high": high},
        "inputs": inputs,
        "heads": heads,
    }
    if decoding is not None:
        doc["decoding"] = decoding
    return write_outputs(doc, out_dir)


def run(
    backbone,
    dataset,
    root,
    layers=None,
    out_dir=None,
    max_images=None,
    pool=None,
    texts=None,
    device="auto",
    batch_size=64,
    n=None,
    rank=80,
    low=None,
    high=None,
    download_root=None,
    seed=0,
    num_workers=0,
    split="test",
    caller=None,
):
    """Load CLIP and the probe set, compute the roles, return roles.json's path.

    split: "test" (the default: ImageNet val, as TextSpan) or "train" (all training images of a
    training dataset, never its few-shot subset; what dear.py uses when no ImageNet is present, so
    that the roles never come from the test images the model is evaluated on). out_dir None: beside
    the checkpoint cache, at default_roles_path(...), a folder named by everything that changes the
    roles. max_images None: every image of the split. caller: "entropy.py", "dear.py" or None
    (both): whose options an error suggests."""
    check_thresholds(low, high)
    if split not in SPLITS:
        raise EntropyError(f"unknown probe split {split!r}; use one of {', '.join(SPLITS)}")
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = toyworld.load_clip(backbone, device=device, download_root=download_root)  # "toy" too
    layers = parse_layers(layers, model.visual.layers)
    if dataset == "toyworld":
        toyworld.ensure_dataset(root)
    items = getattr(data.build_dataset(dataset, root), split)  # shots=-1: every image of the split
    if not items:
        raise EntropyError(
            f"the {split} split of {dataset} has no images; choose another --split or dataset"
        )
    pool_texts, labels, pool_name = load_pool(model, pool, texts)
    key = dict(
        layers=layers,
        pool=pool,
        texts=texts,
        n=n,
        rank=rank,
        low=low,
        high=high,
        max_images=max_images,
        seed=seed,
    )
    inputs = roles_inputs(model, dataset=dataset, split=split, **key)
    if out_dir is None:
        out_dir = os.path.dirname(
            default_roles_path(
                model, cache_dir=clip.cache_dir(download_root), dataset=dataset, split=split, **key
            )
        )
    using = "all" if max_images is None or max_images >= len(items) else f"a sample of {max_images}"
    print(
        f"Concept Entropy of {backbone}, blocks {layers_tag(layers)}: probe {dataset} {split} "
        f"({len(items)} images, using {using}), pool {pool_name} ({len(pool_texts)} texts, "
        f"{inputs['texts_per_head']} per head)",
        file=sys.stderr,
    )
    return compute_roles(
        model,
        items,
        pool_texts,
        labels,
        layers,
        out_dir,
        batch_size=batch_size,
        max_images=max_images,
        n=inputs["texts_per_head"],
        rank=rank,
        low=low,
        high=high,
        probe={"dataset": inputs["dataset"], "split": split},
        pool_name=pool_name,
        seed=seed,
        num_workers=num_workers,
        inputs=inputs,
        caller=caller,
        factors=toyworld.factor_labels if dataset == "toyworld" else None,
    )


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Concept Entropy: describe every attention head of CLIP's last blocks with "
        "TextSpan (each head's direct contribution as TextSpan's PRS logger computes it; texts "
        "picked inside the top singular directions of the uncentred contributions), label the "
        "descriptions with concepts, and sort heads into attribute / generalization / mixed / "
        "other specialist roles by the entropy of their concepts. Writes roles.json, roles.md, "
        "roles.png."
    )
    p.add_argument(
        "--backbone",
        default="ViT-B/16",
        help="CLIP model name or checkpoint path (default ViT-B/16)",
    )
    p.add_argument("--dataset", required=True, help="probe dataset (a data.py name or folder:PATH)")
    p.add_argument(
        "--split",
        default="test",
        choices=SPLITS,
        help="probe split: test (default; ImageNet val, as TextSpan) or train (all training images "
        "of a training dataset)",
    )
    p.add_argument("--root", default="data", help="datasets root folder (default: data)")
    p.add_argument(
        "--max-images",
        type=int,
        default=None,
        help="probe at most this many images, a seeded sample (default: every image of the split, "
        "as TextSpan reads all of ImageNet val; the images are streamed, so memory does not "
        "grow with their number)",
    )
    p.add_argument(
        "--layers", default=None, help="1-based blocks, e.g. 9-12 (default: the last four)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default: <clip cache>/roles/<model>_L<blocks>_"
        "<probe>-<split>_<hash of all inputs>)",
    )
    p.add_argument(
        "--pool",
        default=None,
        choices=("default", "toy"),
        help="built-in text pool: default (concepts.tsv) or toy (the toy world's words); "
        "default: toy for the toy backbone, else default",
    )
    p.add_argument(
        "--texts",
        default=None,
        help="your own pool: one description per line (or concept<TAB>text); "
        "unlabelled lines get the nearest --pool concept",
    )
    p.add_argument(
        "--n",
        type=int,
        default=None,
        help="TextSpan texts per head (default 20; with the toy pool "
        f"{toyworld.TEXTS_PER_HEAD}, see toyworld.TEXTS_PER_HEAD)",
    )
    p.add_argument("--rank", type=int, default=80, help="TextSpan SVD rank (default 80)")
    p.add_argument(
        "--low",
        type=float,
        default=None,
        help="H <= low (bits): specialist (default: 1/3 quantile)",
    )
    p.add_argument(
        "--high",
        type=float,
        default=None,
        help="H >= high (bits): generalization (default: 2/3 quantile)",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=0, help="data loader workers (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the probe image sample (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument(
        "--download-root", default=None, help="CLIP checkpoint cache (default: clip.cache_dir())"
    )
    args = p.parse_args(argv)
    errors = (
        EntropyError,
        FileNotFoundError,
        NotImplementedError,
        ValueError,
        data.DataError,
        toyworld.ToyWorldError,
    )
    try:
        if (
            (args.max_images is not None and args.max_images < 1)
            or (args.n is not None and args.n < 1)
            or args.rank < 1
            or args.batch_size < 1
        ):
            raise EntropyError("--max-images, --n, --rank and --batch-size must be positive")
        path = run(
            args.backbone,
            args.dataset,
            args.root,
            layers=args.layers,
            out_dir=args.out,
            max_images=args.max_images,
            pool=args.pool,
            texts=args.texts,
            device=args.device,
            batch_size=args.batch_size,
            n=args.n,
            rank=args.rank,
            low=args.low,
            high=args.high,
            download_root=args.download_root,
            seed=args.seed,
            num_workers=args.workers,
            split=args.split,
            caller="entropy.py",
        )
    except errors as e:
        print(f"entropy.py: error: {e}", file=sys.stderr)
        return 2
    roles = load_roles(path)
    counts = {r: sum(h["role"] == r for heads in roles.values() for h in heads) for r in ROLES}
    print(
        f"wrote {path} (+ roles.md, roles.png): " + ", ".join(f"{v} {k}" for k, v in counts.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

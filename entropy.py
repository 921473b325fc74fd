"""Concept Entropy: which attention heads of CLIP's last blocks are attribute, generalization or
mixed heads (DeAR's first step, once per backbone).

Per head, TextSpan (yossigandelsman/clip_text_span) finds the N descriptions that span the head's
direct contributions to the image embedding; the entropy of their concepts gives the head's role.

    python entropy.py --backbone ViT-B/16 --dataset imagenet --root DATA   # ImageNet val

Blocks count from 1 in flags and files (blocks 9-12 of ViT-B/16, as the paper), heads from 0.
"""

import contextlib
import itertools
import math
import os
import random
import re
import sys

import data  # before torch: OpenMP's idle threads sleep, and Ctrl-C or SIGTERM is one line
import numpy as np
import torch
import torch.nn.functional as F

import clip
import runs
import toyworld

FORMAT = "dear-roles/2"
# the pool's 12 concepts: DeAR's five attributes (in the order of its tokens) and seven others
ATTRIBUTES = ("color", "shape", "texture", "object", "location")
CONCEPTS = ATTRIBUTES + ("animal", "person", "scene", "text", "style", "count", "lighting")
ROLES = ("attribute", "generalization", "mixed", "specialist")
POOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "concepts.tsv")


# ------------------------------------------------------------------------------------------------
# 1. Text pools


def read_pool(path):
    """A pool file -> [(description, concept or None)]: a description per line, as
    `concept<TAB>description` (assets/concepts.tsv) or bare; lines starting with '#' are
    comments."""
    lines = data.read_text(path, "write a description a line, as concept<TAB>description or bare")
    parts = [line.rpartition("\t") for line in lines if not line.startswith("#")]
    pool = [(text.strip(), concept.strip() or None) for concept, _, text in parts if text.strip()]
    if unknown := {c for _, c in pool} - {None, *CONCEPTS}:
        raise data.UserError(f"{path}: unknown concepts {sorted(unknown)}; use {CONCEPTS}")
    if not pool:
        raise data.UserError(f"{path}: no descriptions; write one a line")
    return pool


@torch.no_grad()
def encode_texts(model, texts, batch_size=256):
    """Raw descriptions (no template, as TextSpan) -> L2-normalised text embeddings [T, E] fp32."""
    device = model.visual.proj.device
    out = []
    for i in range(0, len(texts), batch_size):
        tokens = clip.tokenize(texts[i : i + batch_size], model.context_length, truncate=True)
        tokens = tokens[:, : int(tokens.argmax(-1).max()) + 1]  # to the last EOT: causal, enough
        out.append(F.normalize(model.encode_text(tokens.to(device)).float(), dim=-1).cpu())
    return torch.cat(out)


def label_by_centroid(embeddings, ref_embeddings, ref_concepts):
    """The concept of each text [T, E]: the nearest (cosine) concept centroid of the reference
    texts."""
    names = [c for c in CONCEPTS if c in ref_concepts]
    which = torch.tensor([names.index(c) for c in ref_concepts])
    centroids = torch.zeros(len(names), ref_embeddings.shape[1])
    centroids.index_add_(0, which, ref_embeddings.float())
    scores = embeddings.float() @ F.normalize(centroids, dim=-1).T  # [T, c]: cosines x |text|
    return [names[i] for i in scores.argmax(-1).tolist()]


def label_pool(model, builtin, user=None):
    """(descriptions, concepts): the built-in pool, or the user's, whose unlabelled descriptions
    get the concept of the nearest built-in concept centroid in the model's text space."""
    pool = builtin if user is None else user
    if todo := [t for t, c in pool if c is None]:
        ref = encode_texts(model, [t for t, _ in builtin])
        nearest = iter(label_by_centroid(encode_texts(model, todo), ref, [c for _, c in builtin]))
        pool = [(t, c or next(nearest)) for t, c in pool]
    return [t for t, _ in pool], [c for _, c in pool]


# ------------------------------------------------------------------------------------------------
# 2. Head decomposition, as TextSpan's PRS logger (prs_hook.py)


@torch.no_grad()
def decompose(model, images, layers):
    """The image embedding (unnormalised, as encode_image) as a sum of parts: heads [B, nL, H, E],
    every head of the blocks `layers` (from 1, sorted), and rest [B, E]: the embedding, the MLPs
    and the other blocks.

    r, the CLS entry of the residual stream that ln_post normalises, is a sum of 2L + 1
    intermediates (the embedding; each block's attention and MLP outputs). With r's mean and std
    fixed per image ln_post is linear, and TextSpan gives an intermediate p the share
        (p - mean(r) / (2L + 1)) * ln_post.weight / std(r) + ln_post.bias / (2L + 1),  then @ proj.
    An analysed block's attention output splits into its H heads, each with 1/H of that share:
    head h's CLS row (attention x values x its out_proj columns) + out_proj.bias / H."""
    visual = model.visual
    blocks, H = visual.transformer.resblocks, visual.heads
    x = visual.embed(images)  # [B, 1+P, D]
    B, _, D = x.shape
    # the parts: the sum of the other intermediates and their count; the heads' contributions
    rest, n_rest, heads = x[:, 0].float(), 1, []
    for b, block in enumerate(blocks):
        if b + 1 not in layers:
            new = block(x)
            rest, n_rest = rest + (new[:, 0] - x[:, 0]).float(), n_rest + 2  # attention and MLP
            x = new
            continue
        attn = block.attn
        y = block.ln_1(x)
        out, weights = attn(y, need_weights=True)  # [B, T, D], [B, H, T, T]
        v = F.linear(y, attn.in_proj_weight[2 * D :], attn.in_proj_bias[2 * D :])
        v = v.float().view(B, -1, H, D // H)  # [B, T, H, hs]
        cls = torch.einsum("bhm,bmhd->bhd", weights[:, :, 0].float(), v)  # [B, H, hs]: CLS rows
        w_o = attn.out_proj.weight.float().view(D, H, D // H)  # head h: columns h*hs..(h+1)*hs-1
        heads.append(torch.einsum("bhd,ehd->bhe", cls, w_o) + attn.out_proj.bias.float() / H)
        x = x + out
        m = block.mlp(block.ln_2(x))
        rest, n_rest = rest + m[:, 0].float(), n_rest + 1
        x = x + m
    ln = visual.ln_post
    n = 2 * len(blocks) + 1
    r = x[:, 0].float()  # [B, D]
    # [B, 1] each: ln_post's statistics of r
    mean, std = r.mean(-1, keepdim=True), (r.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()

    def through_ln(p, share):  # p [B, ..., D], worth `share` intermediates -> [B, ..., E]
        view = (B,) + (1,) * (p.dim() - 1)
        p = (p - mean.view(view) * share) * ln.weight.float() / std.view(view)
        return (p + ln.bias.float() * share) @ visual.proj.float()

    return through_ln(torch.stack(heads, 1), 1 / (n * H)), through_ln(rest, n_rest / n)


def head_contributions(model, images, layers):
    """Each head's direct contribution [B, nL, H, E] and the image embedding [B, E], both divided
    (as TextSpan) by the norm of the image embedding."""
    heads, rest = decompose(model, images, layers)
    embedding = heads.sum((1, 2)) + rest  # [B, E]
    norm = embedding.norm(dim=-1, keepdim=True)  # [B, 1]
    return heads / norm.view(-1, 1, 1, 1), embedding / norm


@torch.no_grad()
def ablation(model, loader, layers, means, classes, log=print):
    """TextSpan's mean-ablation, head by head: the zero-shot accuracy of the probe images (their
    labels, against frozen CLIP's class features `classes` [C, E]) with nothing ablated, and the
    points it loses when one head's direct contribution is replaced by its mean over the probe
    (means [nL, H, E], of head_contributions). Returns (accuracy %, costs [nL, H] in points).
    A second pass over the probe: the means are known only after the first, and keeping every
    image's class scores for every head would take N x heads x C numbers (9.6 GB for ImageNet
    val at ViT-B/16)."""
    device = model.visual.proj.device
    classes, means = classes.to(device).float(), means.to(device).float()
    right, n = torch.zeros((), device=device), 0
    kept = torch.zeros(means.shape[:2], device=device)  # [nL, H]: images right once ablated
    for i, (images, labels) in enumerate(loader):
        heads, whole = head_contributions(model, images.to(device), layers)  # [b, nL, H, E], [b, E]
        y = labels.to(device)
        # [b, C], and its change [b, nL, H, C] with one head at its mean
        scores, change = whole @ classes.t(), (means - heads) @ classes.t()
        right += (scores.argmax(-1) == y).sum()
        kept += ((scores[:, None, None] + change).argmax(-1) == y[:, None, None]).sum(0)
        n += len(y)
        if i % 100 == 0:
            log(f"mean-ablation, probe images: {n}/{len(loader.dataset)}")
    accuracy = 100 * float(right) / n
    return accuracy, accuracy - 100 * kept.cpu() / n


# ------------------------------------------------------------------------------------------------
# 3. TextSpan, from statistics streamed over the probe images


class GramStatistics:
    """Per head (leading dims `shape`): the count N, mean m [E] and centred scatter
    S = sum_i (c_i - m)(c_i - m)^T [E, E] of its contributions, in fp64, merged batch by batch
    (Chan, Golub and LeVeque's pairwise update: no large mean is subtracted from a large sum).

    They give both matrices of `replace_with_iterative_removal`: the uncentred Gram
    C^T C = S + N m m^T (its eigenvectors are C's right singular vectors) and the covariance
    S / N."""

    def __init__(self, shape, dim, device=None):
        self.count = 0
        self.mean = torch.zeros(*shape, dim, dtype=torch.float64, device=device)  # [*shape, E]
        self.scatter = self.mean.new_zeros(*shape, dim, dim)  # [*shape, E, E]

    def add(self, batch):
        """batch [b, *shape, E]: one contribution per image and head."""
        b, E = batch.shape[0], self.mean.shape[-1]
        x = batch.to(self.mean).reshape(b, -1, E).transpose(0, 1)  # [heads, b, E]
        batch_mean = x.mean(1)  # [heads, E]
        x = x - batch_mean.unsqueeze(1)
        # views, updated in place
        mean, scatter = self.mean.view(-1, E), self.scatter.view(-1, E, E)
        delta, total = batch_mean - mean, self.count + b  # the means' gap; the count once merged
        scatter.baddbmm_(x.transpose(1, 2), x)  # the batch's own scatter
        scatter.baddbmm_(delta.unsqueeze(2), delta.unsqueeze(1), alpha=self.count * b / total)
        mean.add_(delta, alpha=b / total)
        self.count = total

    def head(self, index):
        """(count, mean [E], scatter [E, E]) of one head, e.g. index (li, h)."""
        return self.count, self.mean[index], self.scatter[index]


def textspan_from_statistics(count, mean, scatter, text_embeddings, n, rank):
    """TextSpan's greedy picks for one head (`replace_with_iterative_removal`): the indices of the
    n texts [T, E] that best span its contributions C across images, in pick order.

    1. Project the texts onto the top-`rank` right singular vectors of C as it is, uncentred (the
       SVD comes before the mean is removed): the top eigenvectors of C^T C = scatter + N m m^T.
    2. Centre C: its covariance is K = scatter / N.
    3. n times: pick the text t with the largest variance of C t across images (t K t), and
       remove its direction u from C and from every text. K itself need not change: C (I - u u^T)
       has covariance (I - u u^T) K (I - u u^T), the same quadratic form as K on texts that no
       longer have a u component."""
    mean, scatter = mean.double(), scatter.double()
    texts, E = text_embeddings.to(scatter), scatter.shape[-1]
    _, vectors = torch.linalg.eigh(scatter + count * torch.outer(mean, mean))  # ascending
    basis = vectors[:, -min(rank, count, E) :]  # [E, r]: an SVD of C [N, E] has min(N, E) of them
    texts = texts @ basis @ basis.T  # [T, E]
    K = scatter / count  # [E, E]
    picks = []
    for _ in range(n):
        j = int(((texts @ K) * texts).sum(-1).argmax())
        if (norm := texts[j].norm()) < 1e-12:
            raise data.UserError(f"the texts span {len(picks)} directions of a head, not --n {n}")
        picks.append(j)
        u = texts[j] / norm  # [E]
        texts = texts - torch.outer(texts @ u, u)  # the pick itself becomes 0
    return picks


# ------------------------------------------------------------------------------------------------
# 4. Concept entropy and roles


def concept_distribution(concepts):
    """P over CONCEPTS: the share of a head's texts in each concept."""
    return {c: concepts.count(c) / len(concepts) for c in CONCEPTS}


def concept_entropy(P):
    """H(P) = -sum_c P(c) log2 P(c), in bits; P a dict."""
    return 0.0 - sum(p * math.log2(p) for p in P.values() if p > 0)


def default_thresholds(entropies):
    """(low, high): the 1/3 and 2/3 quantiles (linear interpolation) of the analysed heads'
    entropies."""
    return tuple(float(q) for q in np.quantile(np.asarray(entropies, dtype=float), [1 / 3, 2 / 3]))


def assign_role(entropy, P, low, high):
    """H <= low: a specialist, an attribute head if its dominant concept is an attribute (a tie
    goes to the concept listed first), else an other specialist; H >= high: generalization; else
    mixed."""
    if entropy <= low:
        dominant = max(CONCEPTS, key=lambda c: (P.get(c, 0.0), -CONCEPTS.index(c)))
        if dominant in ATTRIBUTES:
            return {"role": "attribute", "attribute": dominant}
        return {"role": "specialist", "attribute": None, "concept": dominant}
    return {"role": "generalization" if entropy >= high else "mixed", "attribute": None}


# ------------------------------------------------------------------------------------------------
# 5. Ground truth (the toy world): what each head's contribution encodes; the random control


def probe_factors(contributions, factors, folds=2, ridge=1.0, seed=0):
    """Held-out accuracy of a linear probe reading each known factor from each head.

    contributions [N, nL, H, E]; factors {name: [N] class ids}. The probe: ridge least squares on
    one-hot targets, features centred on the training fold, ridge = `ridge` x the mean eigenvalue
    of the training covariance (a head of pure noise scores at chance, not below), fitted on all
    folds but one and scored on that one. Returns {"accuracy", "skill": {name: [nL][H]},
    "chance": {name}}, skill = (accuracy - chance) / (1 - chance), chance = the commonest class's
    share."""
    N, nL, H, E = contributions.shape
    # [nL*H, N, E]: all heads' probes in one batch
    X = contributions.double().reshape(N, nL * H, E).transpose(0, 1)
    fold = torch.randperm(N, generator=torch.Generator().manual_seed(seed)) % folds  # [N]
    out = {"accuracy": {}, "chance": {}, "skill": {}}
    for name, labels in factors.items():
        y = torch.as_tensor(labels, dtype=torch.long)  # [N]
        Y = F.one_hot(y).double()  # [N, C]
        correct = torch.zeros(nL * H)
        for k in range(folds):
            tr, te = fold != k, fold == k
            mu = X[:, tr].mean(1, keepdim=True)  # [nL*H, 1, E]
            Xtr, Xte = X[:, tr] - mu, X[:, te] - mu
            G = Xtr.transpose(1, 2) @ Xtr  # [nL*H, E, E]
            lam = ridge * G.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-12)  # [nL*H]
            y_mean = Y[tr].mean(0)  # [C]: the intercept
            W = torch.linalg.solve(G + lam.view(-1, 1, 1) * torch.eye(E, dtype=G.dtype),
                                   Xtr.transpose(1, 2) @ (Y[tr] - y_mean))
            correct += ((Xte @ W + y_mean).argmax(-1) == y[te]).sum(1).float()  # W [nL*H, E, C]
        acc, chance = (correct / N).view(nL, H).tolist(), float(torch.bincount(y).max()) / N
        out["accuracy"][name] = [[round(a, 4) for a in row] for row in acc]
        out["chance"][name] = round(chance, 4)
        out["skill"][name] = [[round((a - chance) / (1 - chance), 4) for a in row] for row in acc]
    return out


def best_factor(skills):
    """(the factor with the highest skill, its lead over the runner-up); skills {name: s}."""
    ranked = sorted(skills.items(), key=lambda kv: -kv[1])
    return ranked[0][0], ranked[0][1] - (ranked[1][1] if len(ranked) > 1 else 0.0)


def control_roles(roles, control, seed):
    """The roles DeAR masks with under --roles-control; roles {block: [head dicts]}. "random":
    each block's roles shuffled (seeded by seed and block): its counts of each role and attribute
    are kept, only which head holds which is chance."""
    if control == "none":
        return roles
    order = {b: torch.randperm(len(heads), generator=torch.Generator().manual_seed(1000 * seed + b))
             for b, heads in roles.items()}
    return {b: [dict(heads[i]) for i in order[b].tolist()] for b, heads in roles.items()}


# ------------------------------------------------------------------------------------------------
# 6. The roles file and its report

HEAD = dict(layer=int, head=int, role=str, attribute=(str, None), entropy=float, P=dict,
            texts=[str], ablation=float)
ROLES_DOC = {"format": str, "model": str, "checkpoint_sha256": str, "num_layers": int,
             "num_heads": int, "layers": [int], "texts_per_head": int, "rank": int,
             "thresholds": {"low": float, "high": float},
             "probe": {"dataset": str, "split": str, "images": int}, "heads": [HEAD],
             "ablation": {"zero_shot": slice(0, 100), "images": int, "by_role": dict}}
FIX = "compute the roles anew with entropy.py (cached ones: delete them, dear.py computes them)"


def read_roles(path):
    """A roles.json document, checked: its format and fields, each head of its blocks listed once
    with a role (and an attribute for an attribute head only)."""
    doc = data.read_json(path, ROLES_DOC, FIX)
    if doc["format"] != FORMAT:
        raise data.UserError(f"{path}: not a {FORMAT} file; {FIX}")
    seen = set()
    for e in doc["heads"]:
        where = f"{path}: block {e['layer']} head {e['head']}"
        known = e["layer"] in doc["layers"] and e["head"] in range(doc["num_heads"])
        if not known or (e["layer"], e["head"]) in seen:
            raise data.UserError(f"{where} is not one of its heads, or is listed twice; {FIX}")
        role, attribute = e["role"], e["attribute"]
        named = attribute in ATTRIBUTES if role == "attribute" else attribute is None
        if role not in ROLES or not named:
            raise data.UserError(f"{where}: role {role!r} with attribute {attribute!r}; {FIX}")
        seen.add((e["layer"], e["head"]))
    if len(seen) != len(doc["layers"]) * doc["num_heads"]:
        raise data.UserError(f"{path}: lacks some heads; {FIX}")
    return doc


def load_roles(path, num_layers=None, num_heads=None, layers=None, sha256=None):
    """A roles.json -> {block (from 1): [one entry per head, in head order]}, each with "role",
    "attribute" (None but for attribute heads), "entropy", ...; checked against the model's depth
    and heads, the blocks needed and the checkpoint's SHA256, where given."""
    doc = read_roles(path)
    L, H, blocks = doc["num_layers"], doc["num_heads"], doc["layers"]
    if sha256 is not None and doc["checkpoint_sha256"] != sha256:
        raise data.UserError(f"{path}: computed for checkpoint {doc['checkpoint_sha256']}, not for "
                             f"this one ({sha256}); {FIX}")
    if num_layers not in (None, L) or num_heads not in (None, H):
        raise data.UserError(f"{path}: for a model of {L} blocks x {H} heads, not {num_layers} x "
                             f"{num_heads}; {FIX}")
    if not set(layers or []) <= set(blocks):
        raise data.UserError(f"{path}: has blocks {blocks}, not all of {layers}; {FIX}")
    at = {(e["layer"], e["head"]): e for e in doc["heads"]}  # read_roles: each head once
    return {b: [at[b, h] for h in range(H)] for b in blocks}


ROLE_COLORS = {"attribute": (230, 145, 56), "generalization": (61, 133, 198),
               "mixed": (170, 170, 170), "specialist": (142, 103, 184)}
CELL = 56  # pixels per head in roles.png
TOP = 100  # pixels above its first row: the title's five lines and the heads' numbers


def short_role(e):
    """A head's role in a table cell: 'A:color', 'S:animal', 'G', 'M'."""
    tag = e["attribute"] or e.get("concept")  # attribute heads and other specialists
    return e["role"][0].upper() + (f":{tag}" if tag else "")


def ties(doc):
    """A sentence on the heads whose entropy equals a threshold ("" if none): H <= low and
    H >= high include them."""
    t = doc["thresholds"]
    said = []
    for name, role in (("low", "specialists"), ("high", "generalization heads")):
        if (k := sum(e["entropy"] == t[name] for e in doc["heads"])) > 1:
            said.append(f"{k} heads tie at the {name} threshold ({t[name]:.3f} bits), all "
                        f"counted as {role}")
    if not said:
        return ""
    counts = ", ".join(f"{sum(e['role'] == r for e in doc['heads'])} {r}" for r in ROLES)
    return "; ".join(said) + f"; so of the {len(doc['heads'])} heads: {counts} (not thirds)."


def ablation_line(doc):
    """One sentence: the probe's zero-shot accuracy and the mean cost of a head of each role."""
    roles = ", ".join(f"{r} {v['mean']:.2f} ({v['heads']} heads)"
                      for r, v in doc["ablation"]["by_role"].items())
    return (f"Mean-ablation (TextSpan's): zero-shot accuracy {doc['ablation']['zero_shot']:.2f}% "
            f"on the probe; the points one head costs when its direct contribution is replaced by "
            f"its mean, on average by role: {roles}.")


def write_report(doc, out_dir):
    """roles.md (a blocks x heads table: each head's role, concept entropy and what it costs when
    mean-ablated; the ground truth where known; every head's concepts and texts) and roles.png (a
    map of the same) of a roles.json document."""
    H, layers, probe, t = doc["num_heads"], doc["layers"], doc["probe"], doc["thresholds"]
    at = {(e["layer"], e["head"]): e for e in doc["heads"]}
    where = f"probe {probe['dataset']} {probe['split']}, {probe['images']} images"
    md = [f"# Head roles of {doc['model']}", "",
          f"Blocks {layers[0]}-{layers[-1]}, {where}. TextSpan: {doc['texts_per_head']} texts "
          f"per head, rank {doc['rank']}. Thresholds: low {t['low']:.3f}, high {t['high']:.3f} "
          "bits. A cell: the role (A = attribute head, G = generalization, M = mixed, S = other "
          "specialist), the concept entropy in bits, the zero-shot points the head costs when "
          "mean-ablated. " + ties(doc), "", ablation_line(doc), "",
          "| block | " + " | ".join(f"head {h}" for h in range(H)) + " |", "|---" * (H + 1) + "|"]
    for b in layers:
        cells = [f"{short_role(e)} {e['entropy']:.2f}, {e['ablation']:+.2f}"
                 for e in (at[b, h] for h in range(H))]
        md.append(f"| {b} | " + " | ".join(cells) + " |")
    if "decoding" in doc:  # the toy world: held-out accuracy (%) of a probe per known factor
        chance = doc["decoding"]["chance"]
        md += ["", f"## Ground truth ({doc['decoding']['probe']}; accuracy %)", "",
               "| block | head | role | " + " | ".join(chance) + " | best (lead in skill) |",
               "|---" * (len(chance) + 4) + "|"]
        for e in doc["heads"]:
            best, lead = best_factor(e["skill"])
            accuracy = " | ".join(f"{100 * e['decoding'][f]:.0f}" for f in chance)
            head = f"| {e['layer']} | {e['head']} | {short_role(e)} |"
            md.append(f"{head} {accuracy} | {best} (+{lead:.2f}) |")
    md += ["", "## Heads", ""]
    for e in doc["heads"]:
        ranked = sorted(e["P"].items(), key=lambda kv: -kv[1])
        shares = ", ".join(f"{c} {p:.2f}" for c, p in ranked if p > 0)
        md += [f"**Block {e['layer']}, head {e['head']}**: {short_role(e)}, H = "
               f"{e['entropy']:.3f} ({shares})", "", "; ".join(e["texts"]), ""]
    os.makedirs(out_dir, exist_ok=True)
    data.write_text(os.path.join(out_dir, "roles.md"), "\n".join(md))
    img, draw = canvas((max(48 + H * CELL, 760), TOP + len(layers) * CELL + 28), [
        f"Head roles of {doc['model']}: blocks {layers[0]}-{layers[-1]}, {where}",
        f"first number: the head's concept entropy H in bits; H <= {t['low']:.3f}: specialist, "
        f"H >= {t['high']:.3f}: generalization, else mixed", ties(doc),
        "letter: the attribute (C color, S shape, T texture, O object, L location) or, for "
        "another specialist, its concept", "second number: the zero-shot points the head costs "
        f"when mean-ablated (probe accuracy {doc['ablation']['zero_shot']:.1f}%)"])
    for h in range(H):
        draw.text((44 + h * CELL, TOP - 16), f"head {h}", fill="black")
    for b, y in zip(layers, itertools.count(TOP, CELL)):  # y: the top of the block's row
        draw.text((4, y + CELL // 2 - 6), f"block {b}", fill="black")
        for h in range(H):
            e, x = at[b, h], 44 + h * CELL
            draw.rectangle([x, y, x + CELL - 2, y + CELL - 2], fill=ROLE_COLORS[e["role"]])
            letter = e["attribute"][0].upper() if e["attribute"] else e.get("concept", "")[:3]
            for dy, text in (3, letter), (20, f"{e['entropy']:.2f}"), (37, f"{e['ablation']:+.1f}"):
                draw.text((x + 5, y + dy), text, fill="black")
    key(draw, TOP + len(layers) * CELL + 8)
    data.atomic_write(os.path.join(out_dir, "roles.png"), lambda tmp: img.save(tmp, format="PNG"))


def canvas(size, lines):
    """A white picture with its title lines in black: (the image, its drawing)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    for i, line in enumerate(lines):
        draw.text((6, 4 + 16 * i), line, fill="black")
    return img, draw


def key(draw, y):
    """The role colours, a row at height y."""
    for i, (role, color) in enumerate(ROLE_COLORS.items()):
        draw.rectangle([8 + i * 150, y, 20 + i * 150, y + 12], fill=color)
        draw.text((24 + i * 150, y), role + " head", fill="black")


# The role-based mask, drawn: a panel per head, rows the attending positions (queries), columns
# the attended ones (keys), in the order CLS, the five tokens, the patches (one row and one column:
# every patch has the same rules)
POSITIONS = ("C", "c", "s", "t", "o", "l", "P")
MASK_CELL = 12


def draw_mask(masks, roles, J, variant, path):
    """mask.png of a run's additive masks [n, H, T, T] (blocks J..L) and the roles they were made
    from: where a head lets a position attend to another, the cell has the head's role colour (as
    the mask treats it: under generalization-only an attribute head acts as mixed); where the mask
    blocks it, white."""
    n, H, T, _ = masks.shape
    # CLS and each token alone, the patches together
    groups = [[p] for p in range(1 + len(ATTRIBUTES))] + [list(range(1 + len(ATTRIBUTES), T))]
    allowed = masks.isfinite().cpu()
    side = len(groups) * MASK_CELL
    width, height, top = side + 70, side + 44, 60  # a panel and its gap; the title's height
    img, draw = canvas((max(60 + H * width, 900), top + n * height + 30), [
        f"The role-based attention mask ({variant}) of blocks {J}-{J + n - 1}: a panel per head, "
        "its role above it", "in a panel, row = the position that attends (query), column = the "
        "one attended (key): C = CLS, c s t o l = the tokens color, shape, texture, object, "
        "location, P = the patches", "coloured: allowed (the colour of the head's role); white: "
        "blocked"])
    for i in range(n):
        y = top + i * height + 16
        draw.text((4, y + side // 2 - 6), f"block {J + i}", fill="black")
        for h, e in enumerate(roles[i]):
            x = 60 + h * width
            attribute = variant == "generalization-only" and e["role"] == "attribute"
            fill = ROLE_COLORS["mixed" if attribute else e["role"]]
            draw.text((x, y - 14), f"head {h} {short_role(e)}", fill="black")
            for r, c in itertools.product(range(len(groups)), repeat=2):
                ok = bool(allowed[i, h][groups[r]][:, groups[c]].all())
                box = [x + c * MASK_CELL, y + r * MASK_CELL, x + (c + 1) * MASK_CELL - 1,
                       y + (r + 1) * MASK_CELL - 1]
                draw.rectangle(box, fill=fill if ok else "white", outline=(200, 200, 200))
        for p, name in enumerate(POSITIONS):  # once a row: down the left and along the bottom
            draw.text((51, y + p * MASK_CELL + 1), name, fill="black")
            draw.text((63 + p * MASK_CELL, y + side + 2), name, fill="black")
    key(draw, top + n * height + 6)
    data.atomic_write(path, lambda tmp: img.save(tmp, format="PNG"))


# ------------------------------------------------------------------------------------------------
# 7. The pipeline and the command line


@torch.no_grad()
def collect_statistics(model, loader, layers, keep=False, log=print):
    """Stream the probe images through the model: GramStatistics of every head [nL, H] (memory:
    nL H E^2 doubles and one batch, whatever the number of images), and, if keep (the toy world's
    ground-truth probe), every image's contributions [N, nL, H, E]."""
    device = model.visual.proj.device
    stats = GramStatistics((len(layers), model.visual.heads), model.visual.proj.shape[1], device)
    kept = []
    for i, (images, _) in enumerate(loader):
        contributions = head_contributions(model, images.to(device), layers)[0]  # [b, nL, H, E]
        stats.add(contributions)
        kept += [contributions.cpu()] if keep else []
        if i % 100 == 0:
            log(f"probe images: {stats.count}/{len(loader.dataset)}")
    return stats, torch.cat(kept) if keep else None


def compute_roles(model, loader, pool, layers, o, classes, factors=None, log=print):
    """Concept Entropy of the heads of `layers` (from 1) on the probe images of `loader` -> the
    roles.json document, less "probe" and "inputs". pool: (texts, concepts); o: the options n,
    rank, low / high (thresholds in bits; None: the 1/3 and 2/3 quantiles) and seed; classes:
    frozen CLIP's features [C, E] of the probe's classes, for each head's mean-ablation cost;
    factors: None, or the images' known factors {name: [N] class ids} (ground truth:
    probe_factors, its folds drawn by seed)."""
    texts, concepts = pool
    n, rank = o["n"], o["rank"]
    visual = model.visual
    N, E = len(loader.dataset), visual.proj.shape[1]
    if n > min(len(texts), rank, E, N - 1):  # N centred images span N - 1 directions
        raise data.UserError(f"TextSpan cannot pick {n} texts per head from {len(texts)} texts, "
                             f"rank {rank}, {N} images; lower --n, or give more of them")
    stats, contributions = collect_statistics(model, loader, layers, factors is not None, log)
    text_embeddings = encode_texts(model, texts).to(stats.mean.device)  # [T, E]
    heads = []
    for i, block in enumerate(layers):
        for h in range(visual.heads):
            picks = textspan_from_statistics(*stats.head((i, h)), text_embeddings, n, rank)
            P = concept_distribution([concepts[j] for j in picks])
            heads.append({"layer": block, "head": h, "entropy": round(concept_entropy(P), 4),
                          "P": {c: round(p, 4) for c, p in P.items()},
                          "texts": [texts[j] for j in picks]})
    auto = default_thresholds([e["entropy"] for e in heads])
    low, high = (round(a if o[k] is None else o[k], 4) for a, k in zip(auto, ("low", "high")))
    for e in heads:
        e.update(assign_role(e["entropy"], e["P"], low, high))
    doc = {"format": FORMAT, "model": model.name, "checkpoint_sha256": model.sha256,
           "num_layers": visual.transformer.layers, "num_heads": visual.heads, "layers": layers,
           "texts_per_head": n, "rank": rank, "concepts": list(CONCEPTS),
           "thresholds": {"low": low, "high": high}}
    accuracy, costs = ablation(model, loader, layers, stats.mean, classes, log)
    for e, cost in zip(heads, costs.flatten().tolist()):
        e["ablation"] = round(cost, 4)
    costs = {r: [e["ablation"] for e in heads if e["role"] == r] for r in ROLES}
    doc["ablation"] = {"zero_shot": round(accuracy, 4), "images": N, "by_role": {
        r: {"mean": round(sum(c) / len(c), 4), "heads": len(c)} for r, c in costs.items() if c}}
    if factors is not None:
        truth = probe_factors(contributions, factors, seed=o["seed"])
        for i, e in enumerate(heads):
            li, h = divmod(i, visual.heads)
            e["decoding"] = {f: truth["accuracy"][f][li][h] for f in factors}
            e["skill"] = {f: truth["skill"][f][li][h] for f in factors}
        probe = "ridge least squares, 2-fold cross-validation"
        doc["decoding"] = {"probe": probe, "chance": truth["chance"]}
    return {**doc, "heads": heads}


# run's options and their defaults, also those of the command line's flags of the same names
OPTIONS = dict(n=None, rank=80, low=None, high=None, max_images=None, seed=0, pool=None,
               texts=None, batch_size=64, workers=0)


def run(model, dataset, root, layers=None, split="test", out_dir=None, log=print, **options):
    """Concept Entropy of a CLIP `model` (with .name and .sha256, as clip.load gives it) on the
    `split` images of `dataset` -> the path of roles.json (beside it roles.md and roles.png).

    layers: blocks from 1 (None: the last four). options (OPTIONS): n texts per head (None: 20, as
    TextSpan; toyworld.TEXTS_PER_HEAD with the toy pool), rank, thresholds low/high in bits (None:
    quantiles), max_images (None: every image; else a sample by seed), pool: the built-in text
    pool "default" or "toy" (None: toy for the toy CLIP), texts: the user's pool file, batch_size,
    workers. out_dir None: clip.cache_dir()/roles/<name>_<hash of every input>. A folder whose
    roles.json records equal inputs is reused."""
    if options.keys() - OPTIONS.keys():
        raise TypeError(f"unknown options {sorted(options.keys() - OPTIONS.keys())}")
    o = {**OPTIONS, **options}
    L = model.visual.transformer.layers
    layers = sorted(set(range(max(1, L - 3), L + 1) if layers is None else layers))
    if not layers or not 1 <= layers[0] <= layers[-1] <= L:
        raise data.UserError(f"blocks {layers} are not among the backbone's 1..{L}")
    pool = o["pool"] or ("toy" if model.name == toyworld.BACKBONE else "default")
    builtin = [tuple(p) for p in toyworld.text_pool()] if pool == "toy" else read_pool(POOL)
    user = read_pool(o["texts"]) if o["texts"] else None
    if dataset.startswith("folder:"):  # the same folder under any name
        dataset = "folder:" + data.dataset_folder(dataset, root)
    n = o["n"] or (toyworld.TEXTS_PER_HEAD if pool == "toy" else 20)
    if pool == "toy":  # its few texts a head give a few entropies: thresholds between them
        o |= {k: t for k, t in zip(("low", "high"), toyworld.THRESHOLDS) if o[k] is None}
    inputs = {"model": model.name, "checkpoint_sha256": model.sha256, "layers": layers,
              "dataset": dataset, "split": split, "pool_sha256": runs.sha256_json([builtin, user]),
              "n": n, **{k: o[k] for k in ("rank", "low", "high", "max_images", "seed")}}
    key = runs.sha256_json(dict(sorted(inputs.items())))[:12]  # sorted: as folders named before
    name = f"{model.name}_L{layers[0]}-{layers[-1]}_{os.path.basename(dataset)}-{split}"
    name = re.sub(r"[^\w.@-]+", "-", name).strip("-")
    out_dir = out_dir or os.path.join(clip.cache_dir(), "roles", f"{name}_{key}")
    path = os.path.join(out_dir, "roles.json")
    with contextlib.suppress(data.UserError):  # none there, or not for these inputs: computed
        if read_roles(path).get("inputs") == inputs:
            log(f"roles: {path} (computed before, reused)")
            return path
    data.writable_folder(out_dir)  # before the work, not after it
    if dataset == "toyworld":
        toyworld.ensure_dataset(root)
    ds = data.build_dataset(dataset, root)
    items = getattr(ds, split)
    if o["max_images"] is not None and len(items) > o["max_images"]:
        chosen = random.Random(o["seed"]).sample(range(len(items)), o["max_images"])
        items = [items[i] for i in sorted(chosen)]
    pool = label_pool(model, builtin, user)
    log(f"Concept Entropy of {model.name}, blocks {layers}: {len(items)} images, {len(pool[0])} "
        "texts")
    images = data.ImageList(items, clip.transform(model.visual.input_resolution))
    loader = torch.utils.data.DataLoader(images, o["batch_size"], num_workers=o["workers"])
    factors = toyworld.factor_labels([p for p, _, _ in items]) if dataset == "toyworld" else None
    # [C, E]: the zero-shot classifier of the probe
    classes = encode_texts(model, [ds.template.format(c) for c in ds.classnames])
    doc = compute_roles(model, loader, pool, layers, dict(o, n=n), classes, factors, log)
    doc |= {"probe": {"dataset": dataset, "split": split, "images": len(items)}, "inputs": inputs}
    write_report(doc, out_dir)
    data.write_json(path, doc)  # last: a roles.json is a complete set
    return path


def parse_blocks(text):
    """'9-12' or '9,10,12' -> sorted blocks, counted from 1."""
    out = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        out |= set(range(data.POSITIVE(first), data.POSITIVE(last or first) + 1))
    return sorted(out)


def roles_of(argv):
    p = data.Parser(description="Concept Entropy: the roles of CLIP's attention heads.")
    bits = data.number(float, lambda v: True, "a finite number")
    p.add_argument("--backbone", default="ViT-B/16", help="a CLIP name, a checkpoint file or toy")
    p.add_argument("--dataset", required=True, help="probe dataset: a data.py name or folder:PATH")
    p.add_argument("--root", default=data.DEFAULT_ROOT, help="the datasets ($DATA, else data)")
    p.add_argument("--split", default="test", choices=("test", "train"), help="probe split (test: "
                   "ImageNet val, as TextSpan)")
    p.add_argument("--layers", type=parse_blocks, help="blocks from 1, e.g. 9-12 (default: last 4)")
    p.add_argument("--max-images", type=data.POSITIVE, help="a sample of this many (default: all)")
    p.add_argument("--seed", type=data.COUNT, default=0, help="seed of that sample")
    p.add_argument("--n", type=data.POSITIVE, help="TextSpan's texts per head (default 20; toy: 5)")
    p.add_argument("--rank", type=data.POSITIVE, default=80, help="TextSpan's SVD rank")
    p.add_argument("--low", type=bits, help="H <= low bits: specialist (default: 1/3 quantile)")
    p.add_argument("--high", type=bits, help="H >= high bits: generalization (2/3 quantile)")
    p.add_argument("--texts", help="your pool: a description a line (concepts: the nearest)")
    p.add_argument("--out", help="output folder (default: in the CLIP cache, named by the inputs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda where available)")
    p.add_argument("--batch-size", type=data.POSITIVE, default=64, help="images a batch")
    p.add_argument("--workers", type=data.COUNT, default=0, help="data loader workers")
    args = p.parse_args(argv)
    if None not in (args.low, args.high) and args.low > args.high:
        raise data.UserError("--low must not exceed --high")
    options = {k: v for k, v in vars(args).items() if k in OPTIONS}
    model = runs.load_backbone(args.backbone, args.device)
    lines = []

    def log(line):  # printed, and kept: the last line says whether the roles were found or written
        print(line)
        lines.append(line)

    path = run(model, args.dataset, args.root, args.layers, args.split, args.out, log, **options)
    roles = [e["role"] for entries in load_roles(path).values() for e in entries]
    done = "found" if any("reused" in line for line in lines) else "wrote"
    print(f"{done} {path}: " + ", ".join(f"{roles.count(r)} {r}" for r in ROLES))
    return 0


def main(argv=None):
    return data.guarded(roles_of, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Every results.json under an output root -> the paper's tables, in Markdown and CSV, beside the
reference numbers of zero-shot CLIP, MMRL and DeAR, each marked with where it comes from.

    python tables.py --out runs          # writes runs/tables/tables.md and runs/tables/table*.csv

Run by run_all.sh's last stage (and by hand after runs launched some other way); it reads the
results.json files that dear.py writes and the roles.md files that entropy.py writes.

Each cell computed here is the mean over seeds, with the standard deviation over seeds (np.std,
ddof=0, as CoOp's parse_test_res.py) and the number of seeds. Base-to-novel HM follows CoOp:
HM = 2BN/(B+N) of the seed-averaged B and N, and the "Average" row is the HM of the averaged base
and novel accuracies (not the mean of the per-dataset HMs). A cell with no run behind it is "–":
nothing is ever filled in. Reference numbers sit in one list, PUBLISHED: each keeps the text its
source prints (so its precision) and a source from SOURCES (paper table, summary, reprinted,
recalled, derived), printed as a letter after it; they are shown only for the ViT-B/16 backbone,
the one they were measured on.
"""

import argparse
import csv
import io
import json
import math
import os
import re
import sys
from typing import NamedTuple

from data import B2N_DATASETS, DG_TARGETS
from util import write_atomic

# ----------------------------------------------------------------------------------------------
# Datasets in the paper's table order: data.py's lists (data.py loads no torch at import).
XD_TARGETS = B2N_DATASETS[1:]  # cross-dataset: the ImageNet model on the other 10 datasets
SHOTS = (1, 2, 4, 8, 16)
TABLE_SHOTS = 16  # shots of the base-to-novel, transfer and ablation tables
PAPER_BACKBONE = "ViT-B/16"  # published numbers are shown only next to runs of this backbone
AVG = "average"  # dataset key of the "Average" row/column in PUBLISHED

PRETTY = {
    "imagenet": "ImageNet",
    "caltech101": "Caltech101",
    "oxford_pets": "OxfordPets",
    "stanford_cars": "StanfordCars",
    "oxford_flowers": "Flowers102",
    "food101": "Food101",
    "fgvc_aircraft": "FGVCAircraft",
    "sun397": "SUN397",
    "dtd": "DTD",
    "eurosat": "EuroSAT",
    "ucf101": "UCF101",
    "imagenetv2": "ImageNet-V2",
    "imagenet_sketch": "ImageNet-Sketch",
    "imagenet_a": "ImageNet-A",
    "imagenet_r": "ImageNet-R",
    "toyworld": "ToyWorld",
    AVG: "Average",
}

OURS_CLIP = "CLIP (zero-shot, this code)"
OURS_DEAR = "DeAR (this code)"
PAPER_DEAR = "DeAR (paper)"

# ----------------------------------------------------------------------------------------------
# Reference numbers (ViT-B/16, 16 shots, mean of 3 seeds), each with where it comes from. The
# number is kept as the text its source prints, so its digits are its precision ("83.9" stays
# "83.9"). Where each comes from: DeAR's numbers from the paper's results table as the wizwand.com
# paper page extracts it (arXiv 2603.01111) and from public summaries of the paper; CLIP's and
# MMRL's base-to-novel rows from the CoCoOp, MaPLe and MMRL papers (the averages as printed in the
# MaPLe and PromptSRC READMEs, muzairkhattak/multimodal-prompt-learning at 69bce21 and
# muzairkhattak/PromptSRC at bb95c77; MMRL's EuroSAT row as quoted in yunncheng/MMRL issue #14).

# source key -> (letter printed after the number, short name for the header, what it means)
SOURCES = {
    "paper_table": (
        "p",
        "DeAR's paper table",
        "DeAR's own results table, as extracted on wizwand.com's page for the paper "
        "(the paper's tables themselves could not be read)",
    ),
    "summary": (
        "s",
        "a summary of the DeAR paper",
        "public summaries of the DeAR paper; not confirmed "
        "against its tables, which could not be read",
    ),
    "readme": (
        "m",
        "a published average, reprinted",
        "published average, reprinted in the MaPLe and PromptSRC READMEs",
    ),
    "issue": (
        "i",
        "a published row, reprinted",
        "MMRL's published EuroSAT row, as quoted in yunncheng/MMRL issue #14",
    ),
    "listing": (
        "l",
        "recalled, confirmed by a listing",
        "recalled from the CoCoOp/MaPLe papers and confirmed by a benchmark listing",
    ),
    "checked": (
        "c",
        "recalled, checked against summaries",
        "recalled from the MMRL paper and checked against "
        "public summaries (of the DeAR and VaMP papers)",
    ),
    "recalled": (
        "r",
        "recalled",
        "recalled from the CoCoOp, MaPLe and MMRL papers, not re-read; in base-to-novel, "
        "each row's 11 datasets average to its published base and novel averages",
    ),
    "derived": (
        "d",
        "derived here",
        "derived here from other reference numbers, printed nowhere (how: below)",
    ),
}


class Ref(NamedTuple):
    """One reference number: where it sits in the tables, its text as its source prints it,
    its source."""

    row: str  # row label (CLIP_PUB, MMRL_PUB, PAPER_DEAR)
    protocol: str  # "b2n" (metric base/novel/hm) or "dg"/"xd" (metric "acc")
    dataset: str  # a dataset name, or AVG for the published average
    metric: str
    text: str  # e.g. "83.9": the value, with the source's precision
    source: str  # a key of SOURCES
    # printed under the table (how a derived number was made, a known inconsistency)
    remark: str = ""

    @property
    def value(self):
        return float(self.text)

    @property
    def decimals(self):
        return len(self.text.partition(".")[2])


CLIP_PUB, MMRL_PUB = "CLIP (published)", "MMRL (published)"
PUBLISHED = [
    # DeAR, base-to-novel: average base and two per-dataset bases (the paper's table on
    # wizwand.com), average HM (summaries); average novel derived from the summaries' "+1.83 novel
    # over MMRL".
    Ref(PAPER_DEAR, "b2n", AVG, "base", "85.94", "paper_table"),
    Ref(
        PAPER_DEAR,
        "b2n",
        AVG,
        "novel",
        "78.99",
        "derived",
        "DeAR's average novel 78.99 = MMRL's 77.16 + the \"+1.83 novel over MMRL\" of the "
        "summaries. HM(85.94, 78.99) = 82.32, not the 82.72 the summaries give: one of them is "
        "off; both are printed as given.",
    ),
    Ref(PAPER_DEAR, "b2n", AVG, "hm", "82.72", "summary"),
    Ref(PAPER_DEAR, "b2n", "dtd", "base", "83.9", "paper_table"),
    Ref(PAPER_DEAR, "b2n", "imagenet", "base", "78.12", "paper_table"),
    # DeAR, domain generalisation and cross-dataset (summaries).
    Ref(PAPER_DEAR, "dg", "imagenet_a", "acc", "51.80", "summary"),
    Ref(PAPER_DEAR, "dg", "imagenet_r", "acc", "78.83", "summary"),
    Ref(PAPER_DEAR, "xd", AVG, "acc", "67.60", "summary"),
    # MMRL, cross-dataset average: "about 67.25", derived from a public summary of the VaMP paper.
    Ref(
        MMRL_PUB,
        "xd",
        AVG,
        "acc",
        "67.25",
        "derived",
        "MMRL's cross-dataset average 67.25 = VaMP's 67.74 less its \"+0.49 over MMRL\", both as a "
        "summary of the VaMP paper gives them.",
    ),
]
# CLIP zero-shot and MMRL, base-to-novel (CoCoOp and MMRL papers): dataset -> "base / novel / hm";
# each is recalled except the rows in _B2N_SOURCE (CLIP's average in two READMEs, MMRL's EuroSAT in
# an issue).
_B2N_REFERENCE = {
    CLIP_PUB: {
        "imagenet": "72.43 / 68.14 / 70.22",
        "caltech101": "96.84 / 94.00 / 95.40",
        "oxford_pets": "91.17 / 97.26 / 94.12",
        "stanford_cars": "63.37 / 74.89 / 68.65",
        "oxford_flowers": "72.08 / 77.80 / 74.83",
        "food101": "90.10 / 91.22 / 90.66",
        "fgvc_aircraft": "27.19 / 36.29 / 31.09",
        "sun397": "69.36 / 75.35 / 72.23",
        "dtd": "53.24 / 59.90 / 56.37",
        "eurosat": "56.48 / 64.05 / 60.03",
        "ucf101": "70.53 / 77.50 / 73.85",
        AVG: "69.34 / 74.22 / 71.70",
    },
    MMRL_PUB: {
        "imagenet": "77.90 / 71.30 / 74.45",
        "caltech101": "98.97 / 94.50 / 96.68",
        "oxford_pets": "95.90 / 97.60 / 96.74",
        "stanford_cars": "81.30 / 75.07 / 78.06",
        "oxford_flowers": "98.97 / 77.27 / 86.78",
        "food101": "90.57 / 91.50 / 91.03",
        "fgvc_aircraft": "46.30 / 37.03 / 41.15",
        "sun397": "83.20 / 79.30 / 81.20",
        "dtd": "85.67 / 65.00 / 73.8",
        "eurosat": "95.60 / 80.17 / 87.21",
        "ucf101": "88.10 / 80.07 / 83.89",
        AVG: "85.68 / 77.16 / 81.20",
    },
}
_B2N_SOURCE = {
    (CLIP_PUB, AVG): "readme",
    (MMRL_PUB, AVG): "checked",
    (MMRL_PUB, "eurosat"): "issue",
}
_REMARKS = {
    (
        MMRL_PUB,
        "dtd",
        "hm",
    ): "MMRL's DTD HM is recalled only as 73.8x; 2BN/(B+N) of its base 85.67 and "
    "novel 65.00 is 73.92, so one of the three is off."
}
for _row, _table in _B2N_REFERENCE.items():
    for _ds, _bnh in _table.items():
        for _metric, _text in zip(("base", "novel", "hm"), _bnh.split(" / ")):
            PUBLISHED.append(
                Ref(
                    _row,
                    "b2n",
                    _ds,
                    _metric,
                    _text,
                    _B2N_SOURCE.get((_row, _ds), "recalled"),
                    _REMARKS.get((_row, _ds, _metric), ""),
                )
            )
# Domain generalisation, all classes: CLIP (CoCoOp / MaPLe tables; ImageNet-A confirmed by a
# benchmark listing), MMRL (the MMRL paper).
for _ds, _clip, _mmrl in zip(
    ("imagenet",) + DG_TARGETS,
    ("66.73", "60.83", "46.15", "47.77", "73.96"),
    ("72.03", "64.47", "49.17", "51.20", "77.53"),
):
    PUBLISHED.append(
        Ref(CLIP_PUB, "dg", _ds, "acc", _clip, "listing" if _ds == "imagenet_a" else "recalled")
    )
    PUBLISHED.append(Ref(MMRL_PUB, "dg", _ds, "acc", _mmrl, "checked"))


def published(row, protocol, dataset, metric):
    """The Ref of a reference number, or None."""
    for ref in PUBLISHED:
        if (ref.row, ref.protocol, ref.dataset, ref.metric) == (row, protocol, dataset, metric):
            return ref
    return None


def published_rows(protocol):
    """Row labels that have published numbers for a protocol, DeAR last."""
    rows = []
    for ref in PUBLISHED:
        if ref.protocol == protocol and ref.row not in rows:
            rows.append(ref.row)
    return sorted(rows, key=lambda r: r == PAPER_DEAR)


def reference_notes(rows):
    """Notes for the reference cells in `rows`: what each source letter used means,
    then the remarks."""
    refs = [c.ref for row in rows for c in row if isinstance(c, Cell) and c.ref is not None]
    used = {r.source for r in refs}
    notes = [f"[{letter}] {long}" for key, (letter, _, long) in SOURCES.items() if key in used]
    for remark in dict.fromkeys(r.remark for r in refs if r.remark):  # once each, in table order
        notes.append(remark)
    return notes


# ----------------------------------------------------------------------------------------------
# Statistics


class Cell:
    """One table cell: mean over seeds, std over seeds (ddof=0), number of seeds; or a reference
    number (ref: its Ref), printed as its source prints it, with the source's letter."""

    def __init__(self, mean, std=None, n=None, ref=None):
        self.mean, self.std, self.n, self.ref = mean, std, n, ref

    def text(self):
        if self.ref is not None:  # e.g. "83.9 [p]"
            return f"{self.ref.text} [{SOURCES[self.ref.source][0]}]"
        return f"{self.mean:.2f} ± {self.std:.2f} (n={self.n})"


def hm(base, novel):
    """Harmonic mean 2BN/(B+N); 0 if both are 0."""
    return 0.0 if base + novel == 0 else 2 * base * novel / (base + novel)


def mean_std(values):
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def seed_cell(by_seed):
    """{seed: accuracy} -> Cell over the seeds, or None when there is none."""
    if not by_seed:
        return None
    m, s = mean_std(list(by_seed.values()))
    return Cell(m, s, len(by_seed))


def hm_cell(base, novel):
    """HM of the seed-averaged base and novel; its std is over the per-seed HMs."""
    if not base or not novel:
        return None
    seeds = sorted(set(base) & set(novel))
    _, s = mean_std([hm(base[k], novel[k]) for k in seeds]) if seeds else (0.0, 0.0)
    return Cell(
        hm(mean_std(list(base.values()))[0], mean_std(list(novel.values()))[0]), s, len(seeds)
    )


def average_by_seed(tables):
    """[{seed: acc} per dataset] -> {seed: mean over datasets} for the seeds every dataset has.
    Returns None when a dataset has no value at all (an average over fewer datasets is not
    shown)."""
    if not tables or any(not t for t in tables):
        return None
    seeds = set.intersection(*(set(t) for t in tables))
    return {k: sum(t[k] for t in tables) / len(tables) for k in sorted(seeds)}


def average_cell(tables):
    """Mean over datasets of the per-dataset seed means; std/n over the seeds all datasets share."""
    if not tables or any(not t for t in tables):
        return None
    mean = sum(mean_std(list(t.values()))[0] for t in tables) / len(tables)
    per_seed = average_by_seed(tables)
    s = mean_std(list(per_seed.values()))[1] if per_seed else 0.0
    return Cell(mean, s, len(per_seed))


# ----------------------------------------------------------------------------------------------
# Reading runs


# dear.py names a run folder after its non-default flags, "<field>-<value>" joined by "_" (fields
# may contain "_" themselves, so the split needs the field names). Schedule fields (epochs, batch
# size, lr, ...) do not change the method, but they change its numbers: runs of one schedule make
# one set of tables, and a run never fills a cell of another schedule (build). The backbone has its
# own tables, so a backbone part names no ablation either.
VARIANT_FIELDS = (
    "backbone",
    "J",
    "beta",
    "lambda_reg",
    "lambda_fusion",
    "alpha_cls",
    "rep_dim",
    "mask",
    "attr_tokens",
    "novel_logits",
    "target_beta",
    "epochs",
    "batch_size",
    "lr",
    "warmup_epochs",
    "warmup_lr",
    "weight_decay",
    "crop_scale",
    "precision",
    "eval_precision",
    "roles_control",
    "roles",
)
SCHEDULE_FIELDS = ("epochs", "batch_size", "lr", "warmup_epochs", "warmup_lr", "weight_decay")
_PART = re.compile(
    r"(%s)-(.*?)(?=_(?:%s)-|$)" % ("|".join(VARIANT_FIELDS), "|".join(VARIANT_FIELDS))
)


def variant_parts(variant):
    """'mask-none_epochs-1' -> ['mask-none', 'epochs-1']; 'default' -> []."""
    if not variant or variant == "default":
        return []
    parts = [f"{m.group(1)}-{m.group(2)}" for m in _PART.finditer(variant)]
    return parts if "_".join(parts) == variant else [variant]  # unknown format: keep it whole


def _field(part):
    return part.split("-", 1)[0]


def method_key(variant, baseline="default"):
    """The ablation a variant stands for: its parts minus schedule and backbone parts minus the
    baseline's parts. "" = the full method with its defaults."""
    base = set(variant_parts(baseline))
    return "_".join(
        p
        for p in variant_parts(variant)
        if _field(p) not in SCHEDULE_FIELDS + ("backbone",) and p not in base
    )


def schedule_of(variant):
    """The schedule parts of a variant as one name: "" (dear.py's default schedule), "epochs-1"."""
    return "_".join(p for p in variant_parts(variant) if _field(p) in SCHEDULE_FIELDS)


def run_problem(run):
    """Why a parsed results.json cannot fill a table cell, for a message ("" when it can)."""
    if not isinstance(run, dict):
        return f"holds {json.dumps(run)[:40]}, not a JSON object of results"
    for field in ("protocol", "method", "dataset", "backbone"):
        if not isinstance(run.get(field), str) or not run.get(field):
            return f"has no {field}, so it belongs to no table"
    if not (isinstance(run.get("variant", "default"), str) and isinstance(run.get("seed", 1), int)):
        return "has a variant or seed that is not a name or a number"
    evals = run.get("evals")
    if not isinstance(evals, list) or not evals:
        return "has no evals (no accuracy at all)"
    for i, e in enumerate(evals):
        if not (
            isinstance(e, dict)
            and isinstance(e.get("dataset"), str)
            and isinstance(e.get("split"), str)
        ):
            return f"evals[{i}] names no dataset and split"
        acc = e.get("accuracy")
        if isinstance(acc, bool) or not isinstance(acc, (int, float)) or not math.isfinite(acc):
            return (
                f"evals[{i}] ({e['dataset']} {e['split']}) has accuracy {json.dumps(acc)}, "
                f"not a number"
            )
    return ""


def read_run(path, baseline):
    """One results.json as a run dict with "_path", "_key" (method_key) and "_schedule"
    (schedule_of); or a (path, reason) problem when it cannot be used."""
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError) as e:
        return path, f"cannot be read ({e})"
    why = run_problem(run)
    if why:
        return path, why
    variant = run.get("variant", "default")
    run.update(_path=path, _key=method_key(variant, baseline), _schedule=schedule_of(variant))
    return run


def slots(run):
    """The table slots a run fills, one per eval: (cell identity..., eval dataset, split, seed).
    A zero-shot run is one cell whatever its shots and flags (neither changes zero-shot CLIP)."""
    dear = run["method"] != "zeroshot"
    ident = (
        run["backbone"],
        run["protocol"],
        run["method"],
        run["dataset"],
        run["_schedule"] if dear else "",
        run["_key"] if dear else "",
        run.get("shots") if dear else None,
    )
    return [ident + (e["dataset"], e["split"], run.get("seed", 1)) for e in run["evals"]]


def model_folder(run):
    """The run folder of the model a run evaluated: an --eval-only result sits in
    <model run>/eval/<name>/; any other result in its own run folder."""
    folder = os.path.dirname(run["_path"])
    eval_only = (run.get("config") or {}).get("eval_only")
    if eval_only and os.path.basename(os.path.dirname(folder)) == "eval":
        return os.path.dirname(os.path.dirname(folder))
    return folder


def drop_duplicates(runs, problems):
    """Two results for one table slot (a backup copy of a run, the same run under two roots): that
    cell uses neither, and each is named in `problems`. An --eval-only result that repeats a slot of
    the run whose model it loaded is no conflict: that run's own value is kept. Returns the runs
    that still fill a cell."""
    by_slot = {}
    for r in runs:
        for slot in slots(r):
            by_slot.setdefault(slot, []).append(r)
    clash = {}  # path -> the paths it clashes with
    dropped = {}  # id(run) -> {(eval dataset, split)} it does not fill
    for slot, rs in by_slot.items():
        if len(rs) < 2:
            continue
        own = {model_folder(r) for r in rs if model_folder(r) == os.path.dirname(r["_path"])}
        # re-evaluations of a model whose own run is here give way to it
        again = [r for r in rs if model_folder(r) in own and os.path.dirname(r["_path"]) not in own]
        rest = [r for r in rs if not any(r is x for x in again)]
        if len(rest) > 1:
            for r in rest:
                clash.setdefault(r["_path"], set()).update(x["_path"] for x in rest if x is not r)
        for r in again + (rest if len(rest) > 1 else []):
            dropped.setdefault(id(r), set()).add(slot[-3:-1])
    for path, others in sorted(clash.items()):
        problems.append(
            (
                path,
                "fills the same table cell(s) as "
                + ", ".join(sorted(others))
                + "; those cells use neither: move or delete the copy you do not want, "
                "then rerun tables.py",
            )
        )
    keep = []
    for r in runs:
        skip = dropped.get(id(r), ())
        r["evals"] = [e for e in r["evals"] if (e["dataset"], e["split"]) not in skip]
        if r["evals"]:
            keep.append(r)
    return keep


def load_runs(out, baseline="default", problems=None):
    """Every usable results.json under `out` (the tables folder excluded), as dicts (read_run), with
    duplicates dropped (drop_duplicates). Each result that is not used is named on stderr and
    appended to `problems` as (path, reason)."""
    runs, found = [], []
    for folder, dirs, files in os.walk(out):
        dirs[:] = sorted(d for d in dirs if d != "tables")
        if "results.json" in files:
            got = read_run(os.path.join(folder, "results.json"), baseline)
            (runs if isinstance(got, dict) else found).append(got)
    runs = drop_duplicates(runs, found)
    for path, why in found:
        print(f"tables.py: not shown: {path} {why}", file=sys.stderr)
    if problems is not None:
        problems += found
    return runs


def accuracies(runs, protocol, method, key="", shots=None, backbone=None):
    """{(eval dataset, split): {seed: accuracy}} over the matching runs (key: see method_key), which
    must be of one schedule (build splits them). Zero-shot runs match any shots and variant (neither
    changes zero-shot CLIP). Each run used is marked "_used"."""
    table, source = {}, {}
    for r in runs:
        if (r.get("protocol"), r.get("method")) != (protocol, method):
            continue
        if backbone is not None and r.get("backbone") != backbone:
            continue
        if method != "zeroshot" and (
            r["_key"] != key or (shots is not None and r.get("shots") != shots)
        ):
            continue
        for e in r.get("evals", []):
            # xd runs evaluate on their own source too: key it by the source name either way
            slot = (e["dataset"], e["split"], r.get("seed", 1))
            cell = table.setdefault(slot[:2], {})
            if slot[2] in cell:  # load_runs drops duplicates, build splits schedules: never two
                raise ValueError(f"{r['_path']} and {source[slot]} fill one cell")
            cell[slot[2]], source[slot] = float(e["accuracy"]), r["_path"]
            r["_used"] = True
    return table


def datasets_listed(paper_list, found, always=False):
    """The paper's datasets (all of them, missing ones shown as "–") when any was run or `always`,
    then the other datasets found (e.g. the toy world)."""
    extras = sorted(d for d in found if d not in paper_list)
    return (list(paper_list) if always or any(d in paper_list for d in found) else []) + extras


# ----------------------------------------------------------------------------------------------
# Tables. Each returns (title, header, rows, notes); a row is [label cells...] of str/Cell/None.


def _published_cell(row, protocol, dataset, metric):
    ref = published(row, protocol, dataset, metric)
    return None if ref is None else Cell(ref.value, ref=ref)


def _delta(ours, paper):
    """ours − reference, to the reference's precision (83.9 is known to 0.1, not to 0.01)."""
    if ours is None or paper is None:
        return None
    return f"{ours.mean - paper.mean:+.{2 if paper.ref is None else paper.ref.decimals}f}"


def table_b2n(runs, backbone):
    zs = accuracies(runs, "b2n", "zeroshot", backbone=backbone)
    de = accuracies(runs, "b2n", "dear", shots=TABLE_SHOTS, backbone=backbone)
    found = {d for d, _ in list(zs) + list(de)}
    show_paper = backbone == PAPER_BACKBONE
    names = datasets_listed(B2N_DATASETS, found, always=show_paper)
    rows = []
    for ds in [AVG] + names:
        ours = {}
        for label, acc in ((OURS_CLIP, zs), (OURS_DEAR, de)):
            if ds == AVG:
                base = [acc.get((d, "base"), {}) for d in names]
                novel = [acc.get((d, "novel"), {}) for d in names]
                b, n = average_cell(base), average_cell(novel)
                h = None
                if b and n:  # HM of the averaged base and novel, as the paper does
                    pb, pn = average_by_seed(base), average_by_seed(novel)
                    _, s = mean_std([hm(pb[k], pn[k]) for k in pb]) if pb else (0, 0)
                    h = Cell(hm(b.mean, n.mean), s, len(pb))
            else:
                b, n = seed_cell(acc.get((ds, "base"))), seed_cell(acc.get((ds, "novel")))
                h = hm_cell(acc.get((ds, "base")), acc.get((ds, "novel")))
            ours[label] = (b, n, h)
        rows.append([PRETTY.get(ds, ds), OURS_CLIP, *ours[OURS_CLIP]])
        paper = {}
        if show_paper:
            for label in published_rows("b2n"):
                paper[label] = [
                    _published_cell(label, "b2n", ds, m) for m in ("base", "novel", "hm")
                ]
            clip_pub = paper.get(CLIP_PUB)
            if clip_pub and any(clip_pub):
                rows.append(["", CLIP_PUB, *clip_pub])
                rows.append(
                    [
                        "",
                        "Δ CLIP: this code − published",
                        *[_delta(o, p) for o, p in zip(ours[OURS_CLIP], clip_pub)],
                    ]
                )
            if any(paper.get(MMRL_PUB, [])):
                rows.append(["", MMRL_PUB, *paper[MMRL_PUB]])
        rows.append(["", OURS_DEAR, *ours[OURS_DEAR]])
        if show_paper and any(paper.get(PAPER_DEAR, [])):
            rows.append(["", PAPER_DEAR, *paper[PAPER_DEAR]])
            rows.append(
                [
                    "",
                    "Δ DeAR: this code − paper",
                    *[_delta(o, p) for o, p in zip(ours[OURS_DEAR], paper[PAPER_DEAR])],
                ]
            )
    notes = [
        f"Average = HM of the base and novel accuracies averaged over the {len(names)} datasets; "
        "shown only when every dataset has a result."
    ]
    notes += reference_notes(rows)
    return (
        "Table 1. Base-to-novel generalisation (16 shots): base / novel / HM",
        ["Dataset", "Method", "Base", "Novel", "HM"],
        rows,
        notes,
    )


def _transfer_table(runs, backbone, protocol, targets, title, source_col):
    """Shared by DG and XD: columns = (source,) + targets + average of the targets;
    all from xd runs."""
    zs = accuracies(runs, "xd", "zeroshot", backbone=backbone)
    de = accuracies(runs, "xd", "dear", shots=TABLE_SHOTS, backbone=backbone)
    sources = sorted(
        {
            r["dataset"]
            for r in runs
            if r.get("protocol") == "xd" and (backbone is None or r.get("backbone") == backbone)
        }
    ) or ["imagenet"]
    found = {d for d, _ in list(zs) + list(de) if d not in sources}
    if protocol == "dg":
        cols = list(targets)
    else:  # xd: the 10 datasets plus anything evaluated that is neither a source nor a DG target
        cols = datasets_listed(
            targets, {d for d in found if d not in DG_TARGETS}, always=backbone == PAPER_BACKBONE
        )
    if not cols:
        return None
    show_paper = backbone == PAPER_BACKBONE

    def ours(acc):  # source column(s), one column per target, then the average of the targets
        return (
            [seed_cell(acc.get((s, "all"))) for s in sources]
            + [seed_cell(acc.get((d, "all"))) for d in cols]
            + [average_cell([acc.get((d, "all"), {}) for d in cols])]
        )

    clip_ours, dear_ours = ours(zs), ours(de)
    rows = [[OURS_CLIP, *clip_ours]]
    if show_paper:
        clip_pub = _published_row(CLIP_PUB, protocol, sources, cols)
        if any(clip_pub):
            rows += [
                [CLIP_PUB, *clip_pub],
                [
                    "Δ CLIP: this code − published",
                    *[_delta(o, p) for o, p in zip(clip_ours, clip_pub)],
                ],
            ]
        rows.append([MMRL_PUB, *_published_row(MMRL_PUB, protocol, sources, cols)])
    rows.append([OURS_DEAR, *dear_ours])
    if show_paper:
        pub = _published_row(PAPER_DEAR, protocol, sources, cols)
        rows += [
            [PAPER_DEAR, *pub],
            ["Δ DeAR: this code − paper", *[_delta(o, p) for o, p in zip(dear_ours, pub)]],
        ]
    header = (
        ["Method"]
        + [f"{PRETTY.get(s, s)} {source_col}" for s in sources]
        + [
            PRETTY.get(
                d,
                "folder " + os.path.basename(os.path.normpath(d[7:]))
                if d.startswith("folder:")
                else d,
            )
            for d in cols
        ]
        + ["Average"]
    )  # folder:PATH datasets by their folder's name
    notes = [
        f"Average = mean over the {len(cols)} targets, shown only when every target has a result.",
        "The DeAR model is trained once per seed on the source (16 shots, all classes) and "
        "evaluated on every target without further training.",
    ]
    notes += reference_notes(rows)
    return title, header, rows, notes


def _published_row(label, protocol, sources, cols):
    """Published cells for a DG/XD row; the target average is computed when all targets are
    known."""
    cells = [_published_cell(label, protocol, s, "acc") for s in sources]
    tgt = [_published_cell(label, protocol, d, "acc") for d in cols]
    avg = _published_cell(label, protocol, AVG, "acc")
    if avg is None and tgt and all(tgt):  # the mean of the published targets, to their precision
        mean, decimals = sum(c.mean for c in tgt) / len(tgt), max(c.ref.decimals for c in tgt)
        ref = Ref(
            label,
            protocol,
            AVG,
            "acc",
            f"{mean:.{decimals}f}",
            "derived",
            "Average of a published row: the mean of its published targets, computed here.",
        )
        avg = Cell(mean, ref=ref)
    return cells + tgt + [avg]


def table_dg(runs, backbone):
    return _transfer_table(
        runs,
        backbone,
        "dg",
        DG_TARGETS,
        "Table 2. Domain generalisation: ImageNet source -> ImageNet variants",
        "(source)",
    )


def table_xd(runs, backbone):
    return _transfer_table(
        runs,
        backbone,
        "xd",
        XD_TARGETS,
        "Table 3. Cross-dataset transfer: ImageNet source -> 10 datasets",
        "(source)",
    )


def table_fewshot(runs, backbone):
    zs = accuracies(runs, "fewshot", "zeroshot", backbone=backbone)
    by_shot = {k: accuracies(runs, "fewshot", "dear", shots=k, backbone=backbone) for k in SHOTS}
    extra = sorted(
        {
            r.get("shots")
            for r in runs
            if r.get("protocol") == "fewshot"
            and r.get("method") == "dear"
            and r.get("shots") not in SHOTS
        }
        - {None}
    )
    by_shot.update(
        {k: accuracies(runs, "fewshot", "dear", shots=k, backbone=backbone) for k in extra}
    )
    found = {d for acc in [zs, *by_shot.values()] for d, _ in acc}
    if not found:
        return None
    names = datasets_listed(B2N_DATASETS, found)
    rows = [
        [
            OURS_CLIP,
            *[seed_cell(zs.get((d, "all"))) for d in names],
            average_cell([zs.get((d, "all"), {}) for d in names]),
        ]
    ]
    for k in sorted(by_shot):
        acc = by_shot[k]
        rows.append(
            [
                f"DeAR {k}-shot (this code)",
                *[seed_cell(acc.get((d, "all"))) for d in names],
                average_cell([acc.get((d, "all"), {}) for d in names]),
            ]
        )
    return (
        "Table 4. Few-shot classification (all classes): accuracy per number of shots",
        ["Method"] + [PRETTY.get(d, d) for d in names] + ["Average"],
        rows,
        [
            "The paper's few-shot numbers are not public; no paper row is shown.",
            "Zero-shot CLIP does not depend on the shots: one run per dataset.",
        ],
    )


ABLATION_NAMES = {
    "": "DeAR (full, defaults)",
    "mask-generalization-only": "mask: generalization heads only",
    "mask-none": "no role mask",
    "attr_tokens-False": "no attribute tokens",
    "lambda_fusion-0.0": "no fusion regulariser (λ_fusion = 0)",
    "novel_logits-cls": "novel classes: CLS logits only (MMRL's rule)",
    "roles_control-random": "random roles (shuffled within each block)",
    "roles_control-oracle": "oracle roles (from the ground-truth probes, toy)",
}


def variant_label(key):
    """A readable name for an ablation key (see method_key);
    the key itself when not in ABLATION_NAMES."""
    return ABLATION_NAMES.get(
        key, key.replace("_", ", ").replace("-", " = ", 1) if key.count("-") == 1 else key
    )


def table_ablations(runs, backbone):
    mine = [
        r
        for r in runs
        if r.get("protocol") == "b2n"
        and r.get("method") == "dear"
        and r.get("shots") == TABLE_SHOTS
        and (backbone is None or r.get("backbone") == backbone)
    ]
    keys = sorted({r["_key"] for r in mine} - {""})
    if not keys:
        return None
    # the datasets of the ablation study = those with at least one ablation run
    names = sorted(
        {r["dataset"] for r in mine if r["_key"]}, key=lambda d: (B2N_DATASETS + (d,)).index(d)
    )
    rows, full_hm = [], None
    for key in [""] + keys:
        acc = accuracies(runs, "b2n", "dear", key=key, shots=TABLE_SHOTS, backbone=backbone)
        base = [acc.get((d, "base"), {}) for d in names]
        novel = [acc.get((d, "novel"), {}) for d in names]
        b, n = average_cell(base), average_cell(novel)
        h = None
        if b and n:
            pb, pn = average_by_seed(base), average_by_seed(novel)
            _, s = mean_std([hm(pb[k], pn[k]) for k in pb]) if pb else (0, 0)
            h = Cell(hm(b.mean, n.mean), s, len(pb))
        if key == "":
            full_hm = h
        per_ds = [hm_cell(acc.get((d, "base")), acc.get((d, "novel"))) for d in names]
        rows.append(
            [variant_label(key), b, n, h, None if key == "" else _delta(h, full_hm), *per_ds]
        )
    return (
        "Table 5. Ablations (base-to-novel, averaged over "
        + ", ".join(PRETTY.get(d, d) for d in names)
        + ")",
        ["Variant", "Base", "Novel", "HM", "ΔHM vs full"]
        + [f"HM {PRETTY.get(d, d)}" for d in names],
        rows,
        [
            "Base/Novel/HM: averages over the ablation datasets (HM of the averages).",
            "A variant is named after the dear.py flags "
            "that differ from the defaults (its run folder).",
        ],
    )


# ----------------------------------------------------------------------------------------------
# Output


def cell_text(c):
    return "–" if c is None else c if isinstance(c, str) else c.text()


def markdown(title, header, rows, notes):
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell_text(c) for c in row) + " |" for row in rows]
    lines += [""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def csv_text(title, header, rows, backbone):
    """Long format: one line per cell, with mean, std and number of seeds in separate columns."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["backbone", "row", "group", "column", "mean", "std", "n_seeds", "note", "source"])
    group = ""
    for row in rows:
        label_cols = 2 if header[:2] == ["Dataset", "Method"] else 1
        if label_cols == 2:
            group = row[0] or group
        for col, c in zip(header[label_cols:], row[label_cols:]):
            if c is None:
                w.writerow([backbone, row[label_cols - 1], group, col, "", "", "", "missing", ""])
            elif isinstance(c, str):
                w.writerow([backbone, row[label_cols - 1], group, col, c, "", "", "difference", ""])
            elif c.ref is not None:  # a reference number: as its source prints it, and that source
                w.writerow(
                    [
                        backbone,
                        row[label_cols - 1],
                        group,
                        col,
                        c.ref.text,
                        "",
                        "",
                        "reference",
                        c.ref.source,
                    ]
                )
            else:
                w.writerow(
                    [
                        backbone,
                        row[label_cols - 1],
                        group,
                        col,
                        f"{c.mean:.4f}",
                        f"{c.std:.4f}",
                        c.n,
                        "",
                        "",
                    ]
                )
    return buf.getvalue()


def roles_section(out, tables_dir):
    """Table 6: the roles.md files that entropy.py wrote under <out>/roles,
    with a link to roles.png."""
    found = []
    for folder, dirs, files in os.walk(os.path.join(out, "roles")):
        dirs.sort()
        if "roles.md" in files:
            found.append(folder)
    lines = ["## Table 6. Head roles (Concept Entropy)", ""]
    if not found:
        return "\n".join(
            lines
            + ["– (no roles.md under " + os.path.join(out, "roles") + "; run the roles stage)", ""]
        )
    for folder in found:
        rel = os.path.relpath(folder, tables_dir)
        lines += [f"### {os.path.relpath(folder, out)}", ""]
        with open(os.path.join(folder, "roles.md")) as f:
            lines += [f.read().strip(), ""]
        if os.path.exists(os.path.join(folder, "roles.png")):
            lines += [f"![head roles]({rel}/roles.png)", ""]
    return "\n".join(lines)


REFERENCE_HEADER = (
    f"Beside ours, for {PAPER_BACKBONE} only: reference numbers of zero-shot CLIP, MMRL and DeAR. "
    "Not all of them could be read in a published table: each is printed with the precision of "
    "its source and a letter saying where it comes from ("
    + "; ".join(f"[{letter}] {short}" for letter, short, _ in SOURCES.values())
    + "); the notes under each table say more."
)


# (CSV name, the protocol of its DeAR runs), in table order
MAKERS = [
    ("table1_b2n", "b2n"),
    ("table2_dg", "xd"),
    ("table3_xd", "xd"),
    ("table4_fewshot", "fewshot"),
    ("table5_ablations", "b2n"),
]


def schedule_groups(runs):
    """{schedule: runs}: the DeAR runs of each schedule ("" = the default first), each group with
    every zero-shot run (zero-shot CLIP has no schedule). No DeAR run: one group, ""."""
    zero = [r for r in runs if r["method"] == "zeroshot"]
    names = sorted({r["_schedule"] for r in runs if r["method"] != "zeroshot"}) or [""]
    return {
        g: [r for r in runs if r["method"] != "zeroshot" and r["_schedule"] == g] + zero
        for g in names
    }


def shown_in(groups, protocol):
    """The schedules whose tables of `protocol` are drawn: those with a DeAR run of it; if none has
    one, the first (for its zero-shot rows)."""
    have = [
        g
        for g, rs in groups.items()
        if any(r["method"] != "zeroshot" and r["protocol"] == protocol for r in rs)
    ]
    return have or list(groups)[:1]


def unused_reason(r):
    return (
        f"is in no table: tables.py has no cell for protocol {r['protocol']}, method "
        f"{r['method']}, variant {r.get('variant', 'default')}, {r.get('shots')} shots"
    )


def not_shown_section(problems, unused):
    """The results.json files that fill no cell, each with the reason (also printed on stderr)."""
    lines = [f"{path} {why}" for path, why in problems]
    lines += [f"{r['_path']} {unused_reason(r)}" for r in unused]
    if not lines:
        return ""
    return "\n".join(["## Results not shown", ""] + [f"- {line}" for line in lines] + [""])


def build(out, baseline="default"):
    """Writes <out>/tables/tables.md and one CSV per table and schedule; returns the Markdown."""
    problems = []
    runs = load_runs(out, baseline, problems)
    tables_dir = os.path.join(out, "tables")
    os.makedirs(tables_dir, exist_ok=True)
    backbones = sorted({r["backbone"] for r in runs}) or [PAPER_BACKBONE]
    groups = schedule_groups(runs)
    others = f" ({len(problems)} other results.json not shown: see the end)" if problems else ""
    parts = [
        "# DeAR reproduction: results",
        "",
        f"{len(runs)} runs under `{out}`{others}. Cells: mean ± std over seeds "
        "(n = number of seeds); – = no result.",
        "",
        REFERENCE_HEADER,
        "",
    ]
    schedules = [g for g in groups if g]
    if baseline != "default" or schedules:
        parts += [
            f"Non-default settings in these runs: baseline flags `{baseline}`"
            + (f", schedule `{', '.join(schedules)}`" if schedules else "")
            + ".",
            "",
        ]
    if len(groups) > 1:
        parts += [
            "Runs of different schedules (epochs, batch size, lr, ...) never share a table: "
            "each schedule has its own tables (zero-shot CLIP, which has none, is in each).",
            "",
        ]
    makers = dict(
        table1_b2n=table_b2n,
        table2_dg=table_dg,
        table3_xd=table_xd,
        table4_fewshot=table_fewshot,
        table5_ablations=table_ablations,
    )
    csvs = {}
    for bb in backbones:
        if len(backbones) > 1:
            parts += [f"# Backbone {bb}", ""]
        for g, group in groups.items():
            if len(groups) > 1:
                parts += [f"## Schedule: {g or 'default'}", ""]
            for name, protocol in MAKERS:
                t = makers[name](group, bb) if g in shown_in(groups, protocol) else None
                if t is None:
                    continue
                title, header, rows, notes = t
                label = f"{title} [{bb}" + (f", schedule {g}]" if g else "]")
                parts.append(markdown(label, header, rows, notes))
                body, file = csv_text(title, header, rows, bb), name + (f"_{g}" if g else "")
                # one CSV per table and schedule; another backbone appends its lines, no header
                csvs[file] = csvs[file] + body.split("\n", 1)[1] if file in csvs else body
    parts.append(roles_section(out, tables_dir))
    unused = [r for r in runs if not r.get("_used")]
    for r in unused:
        print(f"tables.py: not shown: {r['_path']} {unused_reason(r)}", file=sys.stderr)
    parts.append(not_shown_section(problems, unused))
    text = "\n".join(parts)
    write_atomic(os.path.join(tables_dir, "tables.md"), text)
    for name, body in csvs.items():
        write_atomic(os.path.join(tables_dir, name + ".csv"), body)
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out", default="runs", help="output root that run_all.sh / dear.py wrote (default: runs)"
    )
    ap.add_argument(
        "--baseline",
        default="default",
        help="dear.py variant of the full-method runs (e.g. J-3 for the toy world, whose CLIP has "
        "4 blocks); runs that add flags to it are ablations (default: default)",
    )
    ap.add_argument("--print", action="store_true", help="also print the Markdown to stdout")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.out):
        print(
            f"tables.py: no folder {args.out!r}; pass the output root of your runs with --out",
            file=sys.stderr,
        )
        return 2
    text = build(args.out, args.baseline)
    if args.print:
        print(text)
    print(
        f"tables.py: wrote {os.path.join(args.out, 'tables', 'tables.md')} (+ CSV)", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every results.json under an output root -> the paper's tables in Markdown and CSV, beside zero-shot
CLIP measured by the same code and the published numbers of CLIP, MMRL and DeAR (assets/published.csv).

    python tables.py --out runs     # writes runs/tables/tables.md and runs/tables/table*.csv, prints the Markdown

A cell is the mean over seeds ± the standard deviation over seeds (ddof=0, as CoOp's parse_test_res.py),
with the number of seeds n. An HM is 2BN/(B+N) of the seed-averaged B and N; the Average row of Table 1 is
the HM of the averaged base and novel (as the paper), not the mean of the HMs. A cell without runs is "–".
"""

import argparse
import csv
import glob
import io
import json
import math
import os
import sys
from typing import NamedTuple

import data
from data import B2N_DATASETS, DG_TARGETS

PAPER_BACKBONE = "ViT-B/16"  # the published numbers were measured on it: shown beside its runs only
SCHEDULE = ("epochs", "batch_size", "lr", "warmup_epochs", "warmup_lr", "weight_decay")
PRETTY = dict(imagenet="ImageNet", caltech101="Caltech101", oxford_pets="OxfordPets", stanford_cars="StanfordCars",
              oxford_flowers="Flowers102", food101="Food101", fgvc_aircraft="FGVCAircraft", sun397="SUN397", dtd="DTD",
              eurosat="EuroSAT", ucf101="UCF101", imagenetv2="ImageNet-V2", imagenet_sketch="ImageNet-Sketch",
              imagenet_a="ImageNet-A", imagenet_r="ImageNet-R", toyworld="ToyWorld", average="Average")  # fmt: skip
OURS_CLIP, OURS_DEAR = "CLIP (zero-shot, this code)", "DeAR (this code)"
CLIP_PUB, MMRL_PUB, PAPER_DEAR = "CLIP (published)", "MMRL (published)", "DeAR (paper)"
DELTA = {CLIP_PUB: "Δ CLIP: this code − published", PAPER_DEAR: "Δ DeAR: this code − paper"}  # MMRL is not ours

# what each source letter of a published number means, printed under the tables that use it
SOURCES = {
    "p": "DeAR's own results table, as extracted on wizwand.com's page for the paper (the paper's tables "
         "themselves could not be read)",
    "s": "public summaries of the DeAR paper; not confirmed against its tables, which could not be read",
    "m": "published average, reprinted in the MaPLe and PromptSRC READMEs",
    "i": "MMRL's published EuroSAT row, as quoted in yunncheng/MMRL issue #14",
    "l": "recalled from the CoCoOp/MaPLe papers and confirmed by a benchmark listing",
    "c": "recalled from the MMRL paper and checked against public summaries (of the DeAR and VaMP papers)",
    "r": "recalled from the CoCoOp, MaPLe and MMRL papers, not re-read; in base-to-novel, each row's 11 datasets "
         "average to its published base and novel averages",
    "d": "derived here from other reference numbers, printed nowhere (how: below)",
}  # fmt: skip


class Ref(NamedTuple):
    """A published number, kept as its source prints it (so with its precision)."""

    text: str
    letter: str
    remark: str

    mean = property(lambda self: float(self.text))


with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "published.csv"), encoding="utf-8") as f:
    PUBLISHED = {(r["table"], r["row"], r["dataset"], r["metric"]): Ref(r["value"], r["source"], r["remark"])
                 for r in csv.DictReader(f)}  # fmt: skip


class Cell:
    """Ours: `mean` and the per-seed values `by_seed` its std and n come from; `runs` behind it."""

    def __init__(self, mean, by_seed, runs):
        self.mean, self.by_seed, self.runs = mean, by_seed, runs

    std = property(lambda self: mean_std(list(self.by_seed.values()))[1] if self.by_seed else 0.0)
    n = property(lambda self: len(self.by_seed))


def mean_std(values):
    """Mean and standard deviation with ddof=0 (CoOp's parse_test_res.py uses np.std)."""
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


hm = lambda b, n: 0.0 if b + n == 0 else 2 * b * n / (b + n)  # the harmonic mean 2BN/(B+N)


def cell(runs, dataset, split):
    """The accuracies of `dataset`/`split` over the seeds of `runs` (None without any)."""
    acc, src = {}, {}
    for r in runs:
        for e in r["evals"]:
            if (e["dataset"], e["split"]) == (dataset, split):
                if r["seed"] in acc:  # a copy of a run folder: which one is right is the user's call
                    raise ValueError(f"{src[r['seed']]} and {r['path']}: two results for one table cell")
                acc[r["seed"]], src[r["seed"]] = float(e["accuracy"]), r["path"]
    return Cell(mean_std(list(acc.values()))[0], acc, [r for r in runs if r["path"] in src.values()]) if acc else None


def average(cells):
    """Mean over datasets of their means (None unless every one has a result); std and n over the
    seeds that all of them have."""
    if not cells or any(c is None for c in cells):
        return None
    seeds = sorted(set.intersection(*(set(c.by_seed) for c in cells)))
    by_seed = {s: mean_std([c.by_seed[s] for c in cells])[0] for s in seeds}
    return Cell(mean_std([c.mean for c in cells])[0], by_seed, [r for c in cells for r in c.runs])


def hm_cell(b, n):
    """HM of the seed-averaged base and novel; std and n over the per-seed HMs."""
    if b is None or n is None:
        return None
    by_seed = {s: hm(b.by_seed[s], n.by_seed[s]) for s in b.by_seed if s in n.by_seed}
    return Cell(hm(b.mean, n.mean), by_seed, b.runs + n.runs)


def delta(ours, ref):
    """ours − a reference, to the reference's precision (83.9 is known to 0.1, not to 0.01)."""
    if ours is None or ref is None:
        return None
    return f"{ours.mean - ref.mean:+.{len(ref.text.partition('.')[2]) if isinstance(ref, Ref) else 2}f}"


def read_run(path):
    """One results.json -> the fields the tables need. Of the flags that differ from the defaults (`changed`, as
    dear.py records them), `schedule` names the schedule's and `key` the rest but the backbone: the ablation, "" for
    the full method."""
    try:
        with open(path) as f:
            res = json.load(f)
        c, changed = res["config"], res["changed"]
        schedule = "_".join(f"{k}-{v}" for k, v in changed.items() if k in SCHEDULE)
        key = "_".join(f"{k}-{v}" for k, v in changed.items() if k not in SCHEDULE and k != "backbone")
        run = {f: c[f] for f in ("backbone", "protocol", "method", "dataset", "shots", "seed")}
        return dict(run, path=path, evals=res["evals"], env=res.get("env") or {}, eval_only=c.get("eval_only"),
                    schedule=schedule, key=key)  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        e.add_note(f"in {path}")
        raise


def load_runs(out):
    """Every results.json under `out` but --eval-only re-evaluations (their model's own run is read)."""
    paths = sorted(glob.glob(os.path.join(glob.escape(out), "**", "results.json"), recursive=True))
    return [r for r in map(read_run, paths) if not r["eval_only"]]


def select(runs, protocol, method, key="", shots=16):
    """The runs of one row; a zero-shot row takes every zero-shot run (shots and flags change nothing)."""
    same = lambda r: key in (None, r["key"]) and shots in (None, r["shots"])
    return [r for r in runs if (r["protocol"], r["method"]) == (protocol, method) and (method == "zeroshot" or same(r))]


def listed(paper, found, always=False):
    """The paper's datasets (all of them when any was run, or `always`), then the others found (the toy's)."""
    return (list(paper) if always or set(paper) & found else []) + sorted(found - set(paper))


pretty = lambda d: PRETTY.get(d, "folder " + os.path.basename(os.path.normpath(d[7:])) if d[:7] == "folder:" else d)


# ----------------------------------------------------------------------------------------------
# Tables: (title, header, rows, notes); a row is its label(s), then cells: Cell | Ref | str (a Δ) | None.


def b2n_cells(runs, names):
    """Base and novel averaged over the datasets `names`, and the HM of the two (the paper's Average)."""
    b, n = (average([cell(runs, d, split) for d in names]) for split in ("base", "novel"))
    return [b, n, hm_cell(b, n)]


def with_average(runs, names):
    cells = [cell(runs, d, "all") for d in names]
    return cells + [average(cells)]


def compared(lead, clip_cells, dear_cells, table, columns, show):
    """Our zero-shot CLIP and DeAR rows, each followed by the published rows (`columns`: (dataset, metric)
    each; only if `show`) and our difference to them."""
    rows = []
    for ours, label, pubs in ((clip_cells, OURS_CLIP, [CLIP_PUB, MMRL_PUB]), (dear_cells, OURS_DEAR, [PAPER_DEAR])):
        rows.append(lead + [label, *ours])
        for pub in pubs if show else []:
            refs = [PUBLISHED.get((table, pub, d, m)) for d, m in columns]
            rows += [lead + [pub, *refs]] if any(refs) else []
            rows += [lead + [DELTA[pub], *map(delta, ours, refs)]] if any(refs) and pub in DELTA else []
    return rows


def table_b2n(runs, show):
    zs, de = select(runs, "b2n", "zeroshot"), select(runs, "b2n", "dear")
    names, rows = listed(B2N_DATASETS, {e["dataset"] for r in zs + de for e in r["evals"]}, show), []
    for ds in ["average"] + names if names else []:
        ours = [b2n_cells(rs, names if ds == "average" else [ds]) for rs in (zs, de)]
        rows += compared([pretty(ds)], *ours, "b2n", [(ds, m) for m in ("base", "novel", "hm")], show)
    notes = [f"Average = HM of the base and novel accuracies averaged over the {len(names)} datasets; "
             "shown only when every dataset has a result."]  # fmt: skip
    title = "Table 1. Base-to-novel generalisation (16 shots): base / novel / HM"
    return (title, ["Dataset", "Method", "Base", "Novel", "HM"], rows, notes) if names else None


def table_transfer(runs, show, kind):
    """Tables 2 (kind "dg") and 3 ("xd"), both from xd runs: the source, the targets, their average."""
    zs, de = select(runs, "xd", "zeroshot"), select(runs, "xd", "dear")
    sources = sorted({r["dataset"] for r in zs + de}) or ["imagenet"]
    found, dg = {e["dataset"] for r in zs + de for e in r["evals"]} - set(sources), set(DG_TARGETS)
    # xd: the 10 datasets but ImageNet, then whatever else was evaluated (the toy's transfer sets)
    cols = listed(DG_TARGETS, found & dg, show) if kind == "dg" else listed(B2N_DATASETS[1:], found - dg, show)
    ours = [[cell(rs, d, "all") for d in sources] + with_average(rs, cols) for rs in (zs, de)]
    rows = compared([""], *ours, kind, [(d, "acc") for d in sources + cols + ["average"]], show)
    header = ["", "Method"] + [f"{pretty(s)} (source)" for s in sources] + [pretty(d) for d in cols] + ["Average"]
    notes = [f"Average = mean over the {len(cols)} targets, shown only when every target has a result.",
             "The DeAR model is trained once per seed on the source (16 shots, all classes) and evaluated on "
             "every target without further training."]  # fmt: skip
    title = {"dg": "Table 2. Domain generalisation: ImageNet source -> ImageNet variants",
             "xd": "Table 3. Cross-dataset transfer: ImageNet source -> 10 datasets"}[kind]  # fmt: skip
    return (title, header, rows, notes) if cols else None


def table_fewshot(runs, show):
    zs, de = select(runs, "fewshot", "zeroshot"), select(runs, "fewshot", "dear", shots=None)
    names = listed(B2N_DATASETS, {e["dataset"] for r in zs + de for e in r["evals"]})
    rows = [["", OURS_CLIP, *with_average(zs, names)]]
    for k in sorted({1, 2, 4, 8, 16} | {r["shots"] for r in de}):
        rows.append(["", f"DeAR {k}-shot (this code)", *with_average([r for r in de if r["shots"] == k], names)])
    notes = ["The paper's few-shot numbers are not public; no paper row is shown.",
             "Zero-shot CLIP does not depend on the shots: one run per dataset."]  # fmt: skip
    title = "Table 4. Few-shot classification (all classes): accuracy per number of shots"
    return (title, ["", "Method"] + [pretty(d) for d in names] + ["Average"], rows, notes) if names else None


def table_ablations(runs, show):
    mine = select(runs, "b2n", "dear", key=None)
    keys = sorted({r["key"] for r in mine} - {""})
    found = {r["dataset"] for r in mine if r["key"]}  # the ablations' datasets, in the paper's order
    names = [d for d in listed(B2N_DATASETS, found) if d in found]
    rows, full = [], b2n_cells([r for r in mine if r["key"] == ""], names)[2]
    for key in [""] + keys:
        rs = [r for r in mine if r["key"] == key]
        b, n, h = b2n_cells(rs, names)
        label = key.replace("-", " = ", 1) or "DeAR (full, defaults)"
        rows.append(["", label, b, n, h, delta(h, full) if key else None, *[b2n_cells(rs, [d])[2] for d in names]])
    title = f"Table 5. Ablations (base-to-novel, averaged over {', '.join(map(pretty, names))})"
    header = ["", "Variant", "Base", "Novel", "HM", "ΔHM vs full"] + [f"HM {pretty(d)}" for d in names]
    notes = ["Base/Novel/HM: averages over the ablation datasets (HM of the averages).",
             "A variant is named after the dear.py flags that differ from the defaults (its run folder)."]  # fmt: skip
    return (title, header, rows, notes) if keys else None


# (CSV name, the protocol of the DeAR runs behind it, its maker), in table order
MAKERS = [("table1_b2n", "b2n", table_b2n), ("table2_dg", "xd", lambda r, s: table_transfer(r, s, "dg")),
          ("table3_xd", "xd", lambda r, s: table_transfer(r, s, "xd")), ("table4_fewshot", "fewshot", table_fewshot),
          ("table5_ablations", "b2n", table_ablations)]  # fmt: skip

# ----------------------------------------------------------------------------------------------
# Output


def text(c):
    if c is None or isinstance(c, str):
        return "–" if c is None else c
    return f"{c.text} [{c.letter}]" if isinstance(c, Ref) else f"{c.mean:.2f} ± {c.std:.2f} (n={c.n})"


def csv_cells(c):
    """mean, std, n_seeds, source of a cell ("" where it has none); a published number as printed."""
    if isinstance(c, Cell):
        return [f"{c.mean:.4f}", f"{c.std:.4f}", c.n, ""]
    return [getattr(c, "text", c or ""), "", "", getattr(c, "letter", "")]


def env_differences(c):
    """The env fields in which the runs behind a cell differ."""
    envs = [r["env"] for r in c.runs] if isinstance(c, Cell) else []
    return sorted(f for f in set().union(*envs) if len({repr(e.get(f)) for e in envs}) > 1)


def more_notes(title, header, rows):
    """What the source letters used mean, their remarks, and the cells whose runs differ in env
    (each also a warning on stderr)."""
    cells = [(row, col, c) for row in rows for col, c in zip(header[2:], row[2:])]
    refs = [c for _, _, c in cells if isinstance(c, Ref)]
    notes = [f"[{letter}] {meaning}" for letter, meaning in SOURCES.items() if letter in {r.letter for r in refs}]
    notes += list(dict.fromkeys(r.remark for r in refs if r.remark))
    differ = [f"{' / '.join(filter(None, row[:2]))} / {col} ({', '.join(fields)})"
              for row, col, c in cells if (fields := env_differences(c))]  # fmt: skip
    for cell_name in differ:
        print(f"tables.py: warning: {title}: the runs of {cell_name} differ in env", file=sys.stderr)
    return notes + ["The runs of these cells differ in env: " + "; ".join(differ) + "."] * bool(differ)


def markdown(title, header, rows, notes):
    k = 0 if header[0] else 1  # Table 1's Dataset column: each dataset named on its first row only
    lines = [f"## {title}", "", "| " + " | ".join(header[k:]) + " |", "|" + "---|" * len(header[k:])]
    for prev, row in zip([[None]] + rows, rows):
        lines.append("| " + " | ".join(map(text, [row[0] if row[0] != prev[0] else "", *row[1:]][k:])) + " |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes] + [""])


def roles_section(out):
    """Table 6: the roles.md files entropy.py wrote under OUT/roles, each with its roles.png."""
    lines = ["## Table 6. Head roles (Concept Entropy)", ""]
    for md in sorted(glob.glob(os.path.join(glob.escape(out), "roles", "**", "roles.md"), recursive=True)):
        folder, png = os.path.dirname(md), os.path.join(os.path.dirname(md), "roles.png")
        with open(md) as f:
            lines += [f"### {os.path.relpath(folder, out)}", "", f.read().strip(), ""]
        lines += [f"![head roles]({os.path.relpath(png, os.path.join(out, 'tables'))})", ""] * os.path.exists(png)
    return "\n".join(lines + [f"– (no roles.md under {out}/roles; run the roles stage)", ""] * (len(lines) == 2))


CSV_HEADER = ["backbone", "row", "group", "column", "mean", "std", "n_seeds", "source"]  # one line per cell


def write(path, body):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(body)
    os.replace(path + ".tmp", path)


def build(out):
    """Writes OUT/tables/tables.md and one CSV per table (and schedule); returns the Markdown."""
    runs, csvs = load_runs(out), {}
    parts = ["# DeAR reproduction: results", "",
             f"{len(runs)} runs under `{out}`. Cells: mean ± std over seeds (n = number of seeds); – = no result. "
             "A title names its backbone and any non-default schedule (zero-shot CLIP has none: it is in each).",
             "", f"Beside ours, for {PAPER_BACKBONE} only: the published numbers of zero-shot CLIP, MMRL and DeAR, "
             "each as its source prints it, with a letter saying where it comes from (see the notes).", ""]  # fmt: skip
    for bb in sorted({r["backbone"] for r in runs}) or [PAPER_BACKBONE]:
        mine = [r for r in runs if r["backbone"] == bb]
        dear = [r for r in mine if r["method"] != "zeroshot"]
        for name, protocol, make in MAKERS:
            schedules = sorted({r["schedule"] for r in dear if r["protocol"] == protocol})
            for s in schedules or [min([r["schedule"] for r in dear], default="")]:  # none: the zero-shot rows
                t = make([r for r in mine if r["method"] == "zeroshot" or r["schedule"] == s], bb == PAPER_BACKBONE)
                if t is None:
                    continue
                title, header, rows, notes = f"{t[0]} [{bb}" + (f", schedule {s}]" if s else "]"), *t[1:]
                parts.append(markdown(title, header, rows, notes + more_notes(title, header, rows)))
                lines = csvs.setdefault(name + (f"_{s}" if s else ""), [CSV_HEADER])
                lines += [[bb, r[1], r[0], col, *csv_cells(c)] for r in rows for col, c in zip(header[2:], r[2:])]
    parts.append(roles_section(out))
    os.makedirs(os.path.join(out, "tables"), exist_ok=True)
    for name, lines in csvs.items():
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(lines)
        write(os.path.join(out, "tables", name + ".csv"), buf.getvalue())
    write(os.path.join(out, "tables", "tables.md"), "\n".join(parts))
    return "\n".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs", help="the output root of the runs (default: runs)")
    out = ap.parse_args(argv).out
    try:
        if not os.path.isdir(out):
            raise data.UserError(f"no folder {out}; pass the output root of your runs with --out")
        print(build(out))
    except (data.UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

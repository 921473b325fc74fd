"""Every results.json under an output root -> the paper's tables in Markdown and CSV, beside
zero-shot CLIP measured by the same code and the published numbers of CLIP, MMRL, DeAR and the
strongest peers (assets/published.csv).

    python tables.py --out runs   # runs/tables/tables.md and table*.csv; prints the Markdown

A cell is the mean over seeds ± the standard deviation over seeds (ddof=0, as CoOp's
parse_test_res.py), with the number of seeds n. An HM is 2BN/(B+N) of the seed-averaged B and N;
the Average row of Table 1 is the HM of the averaged base and novel (as the paper), not the mean of
the HMs. A cell without runs is "–". A results.json that cannot be used is skipped, with its reason
under the tables and on stderr.
"""

import argparse
import csv
import io
import math
import os
import re
import sys
from typing import NamedTuple

import data  # first: Ctrl-C and SIGTERM are one line
import runs
from data import B2N_DATASETS, DG_TARGETS

PAPER_BACKBONE = "ViT-B/16"  # the published numbers were measured on it: shown beside its runs only
SCHEDULE = ("epochs", "batch_size", "lr", "warmup_epochs", "warmup_lr", "weight_decay")
PRETTY = {name: spec.coop for name, spec in data.DATASETS.items()}  # CoOp's names, but these:
PRETTY |= dict(oxford_flowers="Flowers102", dtd="DTD", imagenetv2="ImageNet-V2", average="Average",
               imagenet_sketch="ImageNet-Sketch", imagenet_a="ImageNet-A", imagenet_r="ImageNet-R")
OURS_CLIP = "CLIP (zero-shot, this code)"
OURS_DEAR = "DeAR (this code)"
CLIP_PUB = "CLIP (published)"
MMRL_PUB = "MMRL (published)"
PAPER_DEAR = "DeAR (paper)"
PEERS = ["VaMP (published)", "Promise (published)"]  # the strongest published peers at ViT-B/16
READOUTS = tuple(runs.READOUTS)  # what each evaluation records (dear.evaluate), in its order
# what a roles.json holds: each role's mean-ablation cost
ROLE_NAMES = ("attribute", "generalization", "mixed", "specialist")
ROLES = {"ablation": {"by_role": {r + "?": {"mean": float, "heads": int} for r in ROLE_NAMES}}}
DELTA = {CLIP_PUB: "Δ CLIP: this code − published", PAPER_DEAR: "Δ DeAR: this code − paper"}

class Ref(NamedTuple):
    """A published number, kept as its source prints it (so with its precision)."""

    text: str
    letter: str
    remark: str

    mean = property(lambda self: float(self.text))


ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
with open(os.path.join(ASSETS, "published.csv"), encoding="utf-8") as f:
    PUBLISHED = {(r["table"], r["row"], r["dataset"], r["metric"]):
                 Ref(r["value"], r["source"], r["remark"]) for r in csv.DictReader(f)}
with open(os.path.join(ASSETS, "sources.csv"), encoding="utf-8") as f:  # what a source letter means
    SOURCES = {r["letter"]: r["meaning"] for r in csv.DictReader(f)}


class Cell(NamedTuple):
    """Ours: `mean` and the per-seed values `by_seed` its std and n come from; `runs` behind it."""

    mean: float
    by_seed: dict
    runs: list

    std = property(lambda self: mean_std(list(self.by_seed.values()))[1] if self.by_seed else 0.0)
    n = property(lambda self: len(self.by_seed))


def mean_std(values):
    """Mean and standard deviation with ddof=0 (CoOp's parse_test_res.py uses np.std)."""
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


hm = runs.harmonic_mean  # 2BN/(B+N)


def cell(runs, dataset, split, readout=None):
    """The accuracies of `dataset`/`split` (or one of their readouts) over the seeds of `runs`
    (None without any)."""
    acc, src = {}, {}
    for r in runs:
        for e in r["evals"]:
            if (e["dataset"], e["split"]) == (dataset, split):
                assert r["seed"] not in acc, f"{src[r['seed']]}, {r['path']}: one cell, two runs"
                acc[r["seed"]] = float(e["readouts"][readout] if readout else e["accuracy"])
                src[r["seed"]] = r["path"]
    if not acc:
        return None
    return Cell(mean_std(acc.values())[0], acc, [r for r in runs if r["path"] in src.values()])


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
    digits = len(ref.text.partition(".")[2]) if isinstance(ref, Ref) else 2
    return f"{ours.mean - ref.mean:+.{digits}f}"


def read_run(path):
    """One results.json (runs.read_results: checked, accuracies in 0..100) -> the fields the tables
    need. Of the flags that differ from the defaults (`changed`, as dear.py records them),
    `schedule` names the schedule's and `key` the rest but the backbone: the ablation, "" for the
    full method."""
    res = runs.read_results(path)
    c, changed = res["config"], res["changed"]
    schedule = "_".join(f"{k}-{v}" for k, v in changed.items() if k in SCHEDULE)
    key = ", ".join(f"{k} = {v}" for k, v in changed.items() if k not in (*SCHEDULE, "backbone"))
    run = {f: c[f] for f in ("backbone", "protocol", "method", "dataset", "shots", "seed")}
    return dict(run, path=path, evals=res["evals"], env=res["env"], schedule=schedule, key=key,
                eval_only=c["eval_only"])


def load_runs(out):
    """(the runs of every usable results.json under `out` but --eval-only re-evaluations (their
    model's own run is read), [why each other file was skipped]): a file that is not a whole
    results.json of this version, or a second copy of a run."""
    runs, skipped, seen = [], [], {}
    for path in files(out, "results.json"):
        try:
            run = read_run(path)
        except data.UserError as e:
            skipped.append(str(e))
            continue
        if run["eval_only"]:
            continue
        same = tuple(v for k, v in run.items() if k not in ("path", "evals", "env"))
        if seen.setdefault(same, path) != path:  # the first copy of a run is the one read
            skipped.append(f"{path}: the same run as {seen[same]} (a copy?); move one of them away")
            continue
        runs.append(run)
    return runs, skipped


def files(top, name):
    """Every file called name under top, sorted; a link to a folder is followed once, never round
    a cycle."""
    seen, found = set(), []
    for folder, subs, names in os.walk(top, followlinks=True):
        seen.add(os.path.realpath(folder))
        subs[:] = sorted(s for s in subs if os.path.realpath(os.path.join(folder, s)) not in seen)
        found += [os.path.join(folder, name)] if name in names else []
    return sorted(found)


def select(runs, protocol, method, key="", shots=16):
    """The runs of one row: DeAR's of this ablation key (None: any) and shots (None: any); a
    zero-shot row takes the default zero-shot runs (shots change nothing there)."""
    if method == "zeroshot":
        return [r for r in runs if (r["protocol"], r["method"], r["key"]) == (protocol, method, "")]
    mine = [r for r in runs if (r["protocol"], r["method"]) == (protocol, method)]
    return [r for r in mine if shots in (None, r["shots"]) and key in (None, r["key"])]


def listed(paper, found, always=False):
    """The paper's datasets (all of them when any was run, or `always`), then the others found
    (the toy's)."""
    return (list(paper) if always or set(paper) & found else []) + sorted(found - set(paper))


def pretty(d):
    folder = "folder " + os.path.basename(os.path.normpath(d[7:]))  # of a folder:PATH dataset
    return folder if d.startswith("folder:") else PRETTY.get(d, d)


# ------------------------------------------------------------------------------------------------
# Tables: (title, header, rows, notes); a row is its label(s), then cells: Cell | Ref | str (a Δ)
# | None.


def b2n_cells(runs, names):
    """Base and novel averaged over the datasets `names`, and the HM of the two (the paper's
    Average)."""
    b, n = (average([cell(runs, d, split) for d in names]) for split in ("base", "novel"))
    return [b, n, hm_cell(b, n)]


def with_average(runs, names):
    cells = [cell(runs, d, "all") for d in names]
    return cells + [average(cells)]


def compared(lead, clip_cells, dear_cells, table, columns, show):
    """Our zero-shot CLIP and DeAR rows, each followed by the published rows (`columns`: (dataset,
    metric) each; only if `show`) and our difference to them where the published row is ours."""
    rows = []
    for ours, label, pubs in ((clip_cells, OURS_CLIP, [CLIP_PUB, MMRL_PUB]),
                              (dear_cells, OURS_DEAR, [PAPER_DEAR, *PEERS])):
        rows.append(lead + [label, *ours])
        for pub in pubs if show else []:
            refs = [PUBLISHED.get((table, pub, d, m)) for d, m in columns]
            if any(refs):
                rows.append(lead + [pub, *refs])
            if any(refs) and pub in DELTA:
                rows.append(lead + [DELTA[pub], *map(delta, ours, refs)])
    return rows


def table_b2n(runs, show):
    zs, de = select(runs, "b2n", "zeroshot"), select(runs, "b2n", "dear")
    names = listed(B2N_DATASETS, {e["dataset"] for r in zs + de for e in r["evals"]}, show)
    rows = []
    for ds in ["average"] + names if names else []:
        ours = [b2n_cells(rs, names if ds == "average" else [ds]) for rs in (zs, de)]
        columns = [(ds, m) for m in ("base", "novel", "hm")]
        rows += compared([pretty(ds)], *ours, "b2n", columns, show)
    notes = [f"Average = HM of the base and novel accuracies averaged over the datasets ("
             f"{len(names)}); shown only when every dataset has a result."]
    title = "Table 1. Base-to-novel generalisation (16 shots): base / novel / HM"
    return (title, ["Dataset", "Method", "Base", "Novel", "HM"], rows, notes) if names else None


def table_transfer(runs, show, kind):
    """Tables 2 (kind "dg") and 3 ("xd"), both from xd runs: the source, the targets (never the
    source), their average."""
    zs, de = select(runs, "xd", "zeroshot"), select(runs, "xd", "dear")
    sources = sorted({r["dataset"] for r in zs + de}) or ["imagenet"]
    found = {e["dataset"] for r in zs + de for e in r["evals"]} - set(sources)
    # dg: ImageNet's variants; xd: the 10 datasets but ImageNet, then whatever else was evaluated
    # (the toy's transfer sets)
    cols = (listed(DG_TARGETS, found & set(DG_TARGETS), show) if kind == "dg"
            else listed(B2N_DATASETS[1:], found - set(DG_TARGETS), show))
    # a row's cells: the accuracy on each source, then on each target, and the targets' average
    accs = lambda rs: [cell(rs, d, "all") for d in sources] + with_average(rs, cols)
    columns = [(d, "acc") for d in sources + cols + ["average"]]
    rows = compared([""], accs(zs), accs(de), kind, columns, show)
    for key in sorted({r["key"] for r in select(runs, "xd", "dear", key=None)} - {""}):
        # e.g. --novel-logits cls (the ablations stage)
        rows.append(["", f"DeAR, {key} (this code)", *accs(select(runs, "xd", "dear", key=key))])
    header = ["", "Method"] + [f"{pretty(s)} (source)" for s in sources]
    header += [*map(pretty, cols), "Average"]
    notes = [f"Average = mean over the targets ({len(cols)}), shown only when every target has a "
             "result.", "The DeAR model is trained once per seed on the source (16 shots, all "
             "classes) and evaluated on every target without further training."]
    to = "ImageNet variants" if kind == "dg" else f"{len(cols)} dataset" + "s" * (len(cols) > 1)
    title = {"dg": "Table 2. Domain generalisation", "xd": "Table 3. Cross-dataset transfer"}[kind]
    title += f": {', '.join(map(pretty, sources))} source -> {to}"
    return (title, header, rows, notes) if cols else None


def table_fewshot(runs, show):
    zs, de = select(runs, "fewshot", "zeroshot"), select(runs, "fewshot", "dear", shots=None)
    names = listed(B2N_DATASETS, {e["dataset"] for r in zs + de for e in r["evals"]})
    rows = [["", OURS_CLIP, *with_average(zs, names)]]
    for k in sorted({1, 2, 4, 8, 16} | {r["shots"] for r in de}):
        rs = [r for r in de if r["shots"] == k]
        rows.append(["", f"DeAR {k}-shot (this code)", *with_average(rs, names)])
    notes = ["The paper's few-shot numbers are not public; no paper row is shown.",
             "Zero-shot CLIP does not depend on the shots: one run per dataset."]
    title = "Table 4. Few-shot classification (all classes): accuracy per number of shots"
    header = ["", "Method", *map(pretty, names), "Average"]
    return (title, header, rows, notes) if names else None


def table_ablations(runs, show):
    mine = select(runs, "b2n", "dear", key=None)
    keys = sorted({r["key"] for r in mine} - {""})
    found = {r["dataset"] for r in mine if r["key"]}  # the ablations' datasets, the paper's order
    names = [d for d in listed(B2N_DATASETS, found) if d in found]
    full = b2n_cells([r for r in mine if r["key"] == ""], names)[2]
    rows = []
    zero = select(runs, "b2n", "zeroshot")
    for key in [None, "", *keys]:  # None: zero-shot CLIP, beside the variants
        rs = zero if key is None else [r for r in mine if r["key"] == key]
        if key == "" and not rs:
            continue  # a schedule of variants alone
        b, n, h = b2n_cells(rs, names)
        label = OURS_CLIP if key is None else key or "DeAR (full, defaults)"
        seen = [average([cell(rs, d, "novel", k) for d in names]) for k in READOUTS[1:]]
        per_dataset = [b2n_cells(rs, [d])[2] for d in names]
        rows.append(["", label, b, n, h, delta(h, full) if key else None, *seen, *per_dataset])
    title = f"Table 5. Ablations (base-to-novel, averaged over {', '.join(map(pretty, names))})"
    header = ["", "Variant", "Base", "Novel", "HM", "ΔHM vs full"]
    header += [f"novel: {k}" for k in READOUTS[1:]] + [f"HM {pretty(d)}" for d in names]
    notes = ["Base/Novel/HM: averages over the ablation datasets (HM of the averages).",
             "A variant is named after the dear.py flags that differ from the defaults (its run "
             "folder).", "The novel readouts say which side moved: class = the class logits "
             "alone; image = the trained image feature against frozen CLIP's class features (the "
             "image side alone); text = frozen CLIP's image feature against the trained class "
             "features (the text side alone). Zero-shot CLIP scores the same in all three."]
    return (title, header, rows, notes) if keys else None


# (CSV name, the protocol of the DeAR runs behind it, its maker), in table order
MAKERS = [("table1_b2n", "b2n", table_b2n),
          ("table2_dg", "xd", lambda runs, show: table_transfer(runs, show, "dg")),
          ("table3_xd", "xd", lambda runs, show: table_transfer(runs, show, "xd")),
          ("table4_fewshot", "fewshot", table_fewshot),
          ("table5_ablations", "b2n", table_ablations)]

# ------------------------------------------------------------------------------------------------
# Output


def text(c):
    if c is None or isinstance(c, str):
        return "–" if c is None else c
    if isinstance(c, Ref):
        return f"{c.text} [{c.letter}]"
    return f"{c.mean:.2f} ± {c.std:.2f} (n={c.n})"


def csv_cells(c):
    """mean, std, n_seeds, source of a cell ("" where it has none); a published number as
    printed."""
    if isinstance(c, Cell):
        return [f"{c.mean:.4f}", f"{c.std:.4f}", c.n, ""]
    return [getattr(c, "text", c or ""), "", "", getattr(c, "letter", "")]


def env_differences(c):
    """The env fields in which the runs behind one cell differ."""
    envs = [r["env"] for r in c.runs] if isinstance(c, Cell) else []
    return sorted(f for f in set().union(*envs) if len({repr(e.get(f)) for e in envs}) > 1)


def more_notes(title, header, rows):
    """What the source letters used mean, their remarks, and the cells whose runs differ in env
    (each also a warning on stderr)."""
    cells = [(row, col, c) for row in rows for col, c in zip(header[2:], row[2:])]
    refs = [c for _, _, c in cells if isinstance(c, Ref)]
    notes = [f"[{k}] {meaning}" for k, meaning in SOURCES.items() if k in {r.letter for r in refs}]
    notes += list(dict.fromkeys(r.remark for r in refs if r.remark))
    differ = [f"{' / '.join(filter(None, row[:2]))} / {col} ({', '.join(fields)})"
              for row, col, c in cells if (fields := env_differences(c))]
    for name in differ:
        print(f"tables.py: warning: {title}: the runs of {name} differ in env", file=sys.stderr)
    if differ:
        notes.append("The runs of these cells differ in env: " + "; ".join(differ) + ".")
    return notes


def markdown(title, header, rows, notes):
    k = 0 if header[0] else 1  # Table 1's Dataset column: each dataset named on its first row only
    lines = [f"## {title}", "", f"| {' | '.join(header[k:])} |", "|---" * len(header[k:]) + "|"]
    for prev, row in zip([[None]] + rows, rows):
        shown = [row[0] if row[0] != prev[0] else "", *row[1:]][k:]
        lines.append(f"| {' | '.join(map(text, shown))} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes] + [""])


def roles_section(out):
    """Table 6: links to the roles.md, roles.png and mask.png files of OUT/roles (dear.py
    --roles-only), each with the zero-shot points a head of each role costs when mean-ablated."""
    lines = []
    for md in files(os.path.join(out, "roles"), "roles.md"):
        rel = os.path.relpath(md, out)
        lines.append(f"- [{rel}](../{rel}), beside it roles.png and mask.png")
        try:
            doc = data.read_json(os.path.join(os.path.dirname(md), "roles.json"), ROLES, "")
        except data.UserError:
            continue  # a roles.md without a whole roles.json: the link alone
        by_role = doc["ablation"]["by_role"].items()
        costs = [f"{r} {v['mean']:.2f} ({v['heads']})" for r, v in by_role]
        lines[-1] += ". Mean-ablation, points a head costs, by role: " + ", ".join(costs)
    lines = lines or [f"– (no roles.md under {out}/roles; run the roles stage)"]
    return "\n".join(["## Table 6. Head roles (Concept Entropy)", "", *lines, ""])


CSV_HEADER = ["backbone", "row", "group", "column", "mean", "std", "n_seeds", "source"]  # per cell


def build(out):
    """Writes OUT/tables/tables.md and one CSV per table (and schedule); returns the Markdown."""
    runs, skipped = load_runs(out)
    csvs = {}
    parts = ["# DeAR reproduction: results", "", f"{len(runs)} runs under `{out}`. Cells: mean ± "
             "std over seeds (n = number of seeds); – = no result. A title names its backbone and "
             "any non-default schedule (zero-shot CLIP has none: it is in each).", "",
             f"Beside ours, for {PAPER_BACKBONE} only: the published numbers of zero-shot CLIP, "
             "MMRL, DeAR and its strongest peers, each as its source prints it, with a letter "
             "saying where it comes from (see the notes).", ""]
    for bb in sorted({r["backbone"] for r in runs}) or [PAPER_BACKBONE]:
        mine = [r for r in runs if r["backbone"] == bb]
        for name, protocol, make in MAKERS:
            # a table per schedule of its own protocol's DeAR runs (none: the zero-shot rows alone)
            schedules = sorted({r["schedule"] for r in select(mine, protocol, "dear", None, None)})
            for s in schedules or [""]:
                t = make([r for r in mine if r["method"] == "zeroshot" or r["schedule"] == s],
                         bb == PAPER_BACKBONE)
                if t is None:
                    continue
                title = f"{t[0]} [{bb}" + (f", schedule {s}]" if s else "]")
                header, rows, notes = t[1:]
                parts.append(markdown(title, header, rows, notes + more_notes(title, header, rows)))
                lines = csvs.setdefault(name + (f"_{s}" if s else ""), [CSV_HEADER])
                lines += [[bb, r[1], r[0], col, *csv_cells(c)]
                          for r in rows for col, c in zip(header[2:], r[2:])]
    parts.append(roles_section(out))
    if skipped:
        print("\n".join(f"tables.py: skipped {why}" for why in skipped), file=sys.stderr)
        parts += ["## Files skipped", ""] + [f"- {why}" for why in skipped] + [""]
    folder = data.makedirs_below(out, os.path.join(out, "tables"))
    for old in set(os.listdir(folder)) - {n + ".csv" for n in csvs}:  # tables no longer made
        if re.fullmatch(r"table\d_\w+\.csv", old):
            data.remove(os.path.join(folder, old))
    for name, lines in csvs.items():
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(lines)
        data.write_text(os.path.join(out, "tables", name + ".csv"), buf.getvalue())
    data.write_text(os.path.join(out, "tables", "tables.md"), "\n".join(parts))
    return "\n".join(parts)


def tables(argv):
    parser = data.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs", help="the output root of the runs (default: runs)")
    out = parser.parse_args(argv).out
    if not os.path.isdir(out):
        raise data.UserError(f"no folder {out}; pass the output root of your runs with --out")
    print(build(out))
    return 0


def main(argv=None):
    return data.guarded(tables, argv)


if __name__ == "__main__":
    sys.exit(main())

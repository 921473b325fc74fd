"""tables.py on hand-made results.json files (the CONTRACT schema, in folders whose names mean
nothing): cells, averages and HMs by hand, uneven result folders, published numbers, env
differences, the toy tables."""

import ast
import csv
import itertools
import json
import os
import subprocess
import sys

import pytest

import dear
import tables
from conftest import ROOT

ENV = dict(python="3.11.9", torch="2.4.1", torchvision="0.19.1", cuda="12.1", cudnn=90100,
           device="NVIDIA H100", git_commit="f4cba4f", git_dirty=False)
FOLDER = itertools.count()


def put(out, protocol, dataset, evals, method="dear", seed=1, shots=16, changed=None,
        backbone="ViT-B/16", env=None, readouts=None, **config):
    """One results.json as dear.py writes it (its config resolved, then `config` set); `evals`:
    (dataset, split, accuracy) each, with the readouts given (else the accuracy in each). Its folder
    is named by a counter only."""
    targets = [d for d, _, _ in evals if d != dataset]
    c = dear.resolve(dear.Config(dataset=dataset, protocol=protocol, method=method, shots=shots,
                                 seed=seed, backbone=backbone, device="cpu", targets=targets))
    changed = changed or {}  # the flags that differ from the defaults, as dear.py records them
    variant = "_".join(f"{k}-{v}" for k, v in changed.items()).replace("/", "-") or "default"
    res = {"config": {n: getattr(c, n) for n in dear.RECORDED} | {"targets": targets} | config,
           "variant": variant,
           "changed": changed, "env": dict(ENV, **(env or {})), "train": None, "warnings": [],
           "inputs": {"dataset_folder": dataset, "data_sha256": "cd" * 32,
                      "backbone_sha256": "ab" * 32, "roles_sha256": None}, "model_sha256": None,
           "evals": [{"dataset": d, "split": s, "beta": 0.9, "accuracy": a, "n": 100,
                      "logits": "fused", "precision": "fp32", "per_class": [],
                      "readouts": (readouts or {}).get(s) or dict.fromkeys(tables.READOUTS, a)}
                     for d, s, a in evals]}
    if protocol == "b2n":
        res["hm"] = tables.hm(evals[0][2], evals[1][2])
    folder = os.path.join(out, "a", f"run{next(FOLDER)}")  # below OUT, at any depth
    os.makedirs(folder)
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(res, f)
    return f.name


def b2n(out, dataset, base, novel, **kw):
    return put(out, "b2n", dataset, [(dataset, "base", base), (dataset, "novel", novel)], **kw)


def section(md, title, where="ViT-B/16"):
    """The table whose title starts with `title` and ends with `[where]`."""
    sections = md.split("\n## ")
    return next(s for s in sections
                if s.startswith(title) and s.split("\n")[0].endswith(f"[{where}]"))


def row(md, title, *labels, where="ViT-B/16"):
    """The cells of the Markdown row labelled `labels` (Table 1: the dataset names its first row
    only)."""
    group = None
    for line in section(md, title, where).splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and len(labels) == 2:
            group = cells[0] or group
            if (group, cells[1]) == labels:
                return cells[2:]
        elif line.startswith("|") and cells[0] == labels[0]:
            return cells[1:]
    raise KeyError(labels)


def test_cell_is_mean_and_population_std_over_seeds_with_n(tmp_path):
    for seed, base in ((1, 80.0), (2, 82.0), (3, 87.0)):  # EuroSAT: 3 seeds
        b2n(tmp_path, "eurosat", base, 60.0, seed=seed)
    # the others: 2 seeds, 70 and 74
    for ds, seed in itertools.product(tables.B2N_DATASETS, (1, 2)):
        b2n(tmp_path, ds, 70.0 + 4 * (seed - 1), 50.0, seed=seed) if ds != "eurosat" else None
    md = tables.build(str(tmp_path))
    # std with ddof=0 as CoOp's parse_test_res.py: sqrt((9 + 1 + 16) / 3) = 2.94 (ddof=1: 3.61)
    assert row(md, "Table 1", "EuroSAT", tables.OURS_DEAR)[0] == "83.00 ± 2.94 (n=3)"
    # HM(83, 60) = 69.65 (the mean of the per-seed HMs: 69.63); its std over the per-seed HMs
    assert row(md, "Table 1", "EuroSAT", tables.OURS_DEAR)[2] == "69.65 ± 1.03 (n=3)"
    assert row(md, "Table 1", "DTD", tables.OURS_DEAR)[0] == "72.00 ± 2.00 (n=2)"
    # the mean of the dataset means, (83 + 10 * 72) / 11 = 73.00 (over seeds 1 and 2 only: 72.73);
    # its std and n over the seeds all datasets have: seed 1 (80 + 700) / 11 = 70.91, seed 2
    # (82 + 740) / 11 = 74.73
    assert row(md, "Table 1", "Average", tables.OURS_DEAR)[0] == "73.00 ± 1.91 (n=2)"


def test_average_row_is_hm_of_averaged_base_and_novel(tmp_path):
    accs = {ds: (60.0, 60.0) for ds in tables.B2N_DATASETS} | {"dtd": (90.0, 30.0),
            "eurosat": (30.0, 90.0)}
    for ds, (base, novel) in accs.items():
        b2n(tmp_path, ds, base, novel)
    md = tables.build(str(tmp_path))
    base, novel, hm = row(md, "Table 1", "Average", tables.OURS_DEAR)
    assert (base, novel) == ("60.00 ± 0.00 (n=1)", "60.00 ± 0.00 (n=1)")
    # HM(60, 60); the mean of the HMs: (9 * 60 + 45 + 45) / 11 = 57.27
    assert hm == "60.00 ± 0.00 (n=1)"
    assert row(md, "Table 1", "DTD", tables.OURS_DEAR)[2] == "45.00 ± 0.00 (n=1)"
    # ours − the paper, to the paper's precision: DTD's base printed as 83.9, the average's as 85.94
    assert row(md, "Table 1", "DTD", "Δ DeAR: this code − paper") == ["+6.1", "–", "–"]
    assert row(md, "Table 1", "Average", "Δ DeAR: this code − paper") == ["-25.94", "-19.73",
            "-22.72"]


def test_backbones_have_their_own_cells_and_only_vit_b16_its_published_numbers(tmp_path):
    b2n(tmp_path, "eurosat", 80.0, 60.0, seed=1)
    b2n(tmp_path, "eurosat", 90.0, 70.0, seed=1, backbone="ViT-B/32",
        changed={"backbone": "ViT-B/32"})
    b2n(tmp_path, "eurosat", 50.0, 40.0, seed=2, backbone="ViT-B/32",
        changed={"backbone": "ViT-B/32"})
    b2n(tmp_path, "eurosat", 55.0, 45.0, backbone="ViT-L/14", method="zeroshot",
        changed={"backbone": "ViT-L/14"})
    md = tables.build(str(tmp_path))
    assert row(md, "Table 1", "EuroSAT", tables.OURS_DEAR)[0] == "80.00 ± 0.00 (n=1)"
    assert row(md, "Table 1", "EuroSAT", tables.OURS_DEAR,
               where="ViT-B/32")[0] == "70.00 ± 20.00 (n=2)"
    assert row(md, "Table 1", "EuroSAT", tables.OURS_CLIP,
               where="ViT-L/14")[0] == "55.00 ± 0.00 (n=1)"
    assert row(md, "Table 1", "EuroSAT", tables.CLIP_PUB)[0] == "56.48 [r]"
    for other in ("ViT-B/32", "ViT-L/14"):  # no published rows, no Δ rows
        assert not [w for w in ("(published)", "(paper)", "Δ") if w in section(md, "Table 1",
                other)]


def test_transfer_tables_split_the_targets_and_show_the_published_rows(tmp_path):
    """Tables 2 and 3 from xd runs: the ImageNet variants in Table 2, the other datasets in Table 3,
    the source never in an average; zero-shot CLIP and DeAR each with their published rows
    (assets/published.csv: DeAR's ImageNet-A 51.80 [s], CLIP's 47.77 [l]); a variant of the run
    (--novel-logits cls) a row of its own; an unknown target under its own name."""
    evals = [("imagenet", "all", 70.0), ("imagenet_a", "all", 50.0), ("dtd", "all", 40.0),
             ("mydata", "all", 30.0)]
    put(tmp_path, "xd", "imagenet", evals)
    put(tmp_path, "xd", "imagenet", [(d, s, a - 10) for d, s, a in evals], method="zeroshot")
    put(tmp_path, "xd", "imagenet", [(d, s, a + 1) for d, s, a in evals],
        changed={"novel_logits": "cls", "J": 7}, novel_logits="cls", J=7)
    md = tables.build(str(tmp_path))
    one = "± 0.00 (n=1)"
    assert row(md, "Table 2", tables.OURS_CLIP) == [f"60.00 {one}", "–", "–", f"40.00 {one}", "–",
                                                    "–"]
    assert row(md, "Table 2", tables.CLIP_PUB)[3] == "47.77 [l]"
    assert row(md, "Table 2", tables.PAPER_DEAR)[3] == "51.80 [s]"
    assert row(md, "Table 2", tables.DELTA[tables.PAPER_DEAR])[3] == "-1.80"
    header = section(md, "Table 3").splitlines()[2]
    assert header.startswith("| Method | ImageNet (source) | Caltech101 |")
    assert "ImageNet-A" not in header
    assert header.endswith("| DTD | EuroSAT | UCF101 | mydata | Average |")
    cls = row(md, "Table 3", "DeAR, novel_logits = cls, J = 7 (this code)")
    assert cls[-2:] == [f"31.00 {one}", "–"]
    assert tables.hm(0.0, 0.0) == 0.0 and tables.hm_cell(None, tables.Cell(1.0, {}, [])) is None
    assert tables.build(str(tmp_path)) == md  # into the same folder again


def test_ablations_average_their_own_datasets_and_show_the_novel_readouts(tmp_path):
    """Over DTD and EuroSAT (not ImageNet), zero-shot CLIP's row first; the novel readouts class,
    image, text (means over the datasets, then over the seeds) beside each variant."""
    for ds, base, novel in (("imagenet", 70.0, 60.0), ("dtd", 80.0, 50.0), ("eurosat", 90.0, 70.0)):
        b2n(tmp_path, ds, base, novel)
        b2n(tmp_path, ds, base - 5, novel + 5, method="zeroshot")
    seen = {"novel": {"fused": 40.0, "class": 41.0, "image": 55.0, "text": 33.0}}
    for ds, base, novel in (("dtd", 84.0, 40.0), ("eurosat", 90.0, 60.0)):
        b2n(tmp_path, ds, base, novel, changed={"mask": "none"}, mask="none", readouts=seen)
    md = tables.build(str(tmp_path))
    assert "## Table 5. Ablations (base-to-novel, averaged over DTD, EuroSAT) [ViT-B/16]" in md
    assert ("| Variant | Base | Novel | HM | ΔHM vs full | novel: class | novel: image | "
            "novel: text | HM DTD | HM EuroSAT |") in md
    full, ablated = (tables.hm(85.0, 60.0), tables.hm(87.0, 50.0))
    one = lambda x: f"{x:.2f} ± 0.00 (n=1)"
    assert row(md, "Table 5", "DeAR (full, defaults)")[:7] == [one(85), one(60), one(full), "–",
                                                               one(60), one(60), one(60)]
    assert row(md, "Table 5", tables.OURS_CLIP)[:2] == [one(80), one(65)]
    hms = [one(h) for h in (ablated, tables.hm(84, 40), tables.hm(90, 60))]
    assert row(md, "Table 5", "mask = none")[2:] == [hms[0], f"{ablated - full:+.2f}", one(41),
                                                     one(55), one(33), *hms[1:]]


def test_env_differences_in_a_cell_are_warned_and_noted(tmp_path, capsys):
    b2n(tmp_path, "eurosat", 80.0, 60.0, seed=1)
    b2n(tmp_path, "eurosat", 82.0, 62.0, seed=2, env=dict(torch="2.5.0", git_dirty=True))
    b2n(tmp_path, "dtd", 80.0, 60.0, seed=1, method="zeroshot")
    # the same env
    b2n(tmp_path, "dtd", 80.0, 60.0, seed=2, method="zeroshot", env=dict(device="NVIDIA H100"))
    md = tables.build(str(tmp_path))
    err = capsys.readouterr().err
    assert "EuroSAT / DeAR (this code) / Base (git_dirty, torch) differ in env" in err
    assert "EuroSAT / DeAR (this code) / HM (git_dirty, torch)" in err
    assert "DTD / CLIP" not in err and "Average / CLIP" not in err
    note = [line for line in md.splitlines() if line.startswith("- The runs of these cells differ")]
    assert len(note) == 1 and "EuroSAT / DeAR (this code) / Novel (git_dirty, torch)" in note[0]


# Restated from the old tables.py (its PUBLISHED, _B2N_REFERENCE, _B2N_SOURCE and DG rows, SOURCES'
# letters), but DeAR's average novel and HM: as the field's maintained list prints them [a]
# (zhengli97/Awesome-Prompt-Adapter-Learning-for-VLMs-CLIP at 704f0d6; HM(85.94, 79.73) = 82.72),
# where 78.99 [d] was derived from a summary's "+1.83 over MMRL":
# table | row | dataset | metric | the number as printed | source letter
OLD = """
b2n | DeAR (paper) | average | base | 85.94 | p
b2n | DeAR (paper) | average | novel | 79.73 | a
b2n | DeAR (paper) | average | hm | 82.72 | a
b2n | DeAR (paper) | dtd | base | 83.9 | p
dg | DeAR (paper) | imagenet_a | acc | 51.80 | s
xd | DeAR (paper) | average | acc | 67.60 | s
xd | MMRL (published) | average | acc | 67.25 | d
b2n | CLIP (published) | dtd | novel | 59.90 | r
b2n | CLIP (published) | average | hm | 71.70 | m
b2n | MMRL (published) | dtd | hm | 73.8 | r
b2n | MMRL (published) | eurosat | novel | 80.17 | i
b2n | MMRL (published) | average | base | 85.68 | c
dg | CLIP (published) | imagenet_a | acc | 47.77 | l
dg | MMRL (published) | imagenet_r | acc | 77.53 | c
"""


@pytest.mark.parametrize("line", OLD.strip().splitlines())
def test_published_csv_keeps_each_old_number_and_source(line):
    table, label, dataset, metric, text, letter = line.split(" | ")
    ref = tables.PUBLISHED[(table, label, dataset, metric)]
    assert (ref.text, ref.letter) == (text, letter)


def test_every_published_row_parses():
    with open(os.path.join(os.path.dirname(tables.__file__), "assets", "published.csv"),
              encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    # 91 of the old tables.py, its 2 derived DG averages, 5 of the strongest peers (VaMP, Promise)
    assert len(rows) == len(tables.PUBLISHED) == 98
    for r in rows:
        assert r["source"] in tables.SOURCES and r["table"] in ("b2n", "dg", "xd"), r
        # a number, as printed
        assert r["value"] == f"{float(r['value']):.{len(r['value'].partition('.')[2])}f}", r
        assert r["source"] != "d" or r["remark"], r  # a derived number says how
    # (60.83+46.15+47.77+73.96)/4
    assert tables.PUBLISHED[("dg", "CLIP (published)", "average", "acc")].text == "57.18"


BAD = {"truncated": lambda text: text[: len(text) // 2],
       "not UTF-8": lambda text: "\udcff".encode(errors="surrogateescape"),
       "older version": lambda text: json.dumps({k: v for k,
        v in json.loads(text).items() if k != "changed"}),
       "accuracy 150": lambda text: text.replace('"accuracy": 81.0', '"accuracy": 150.0'),
       "accuracy -7": lambda text: text.replace('"accuracy": 81.0', '"accuracy": -7'),
       "shots as a string": lambda text: text.replace('"shots": 16', '"shots": "16"'),
       "a boolean for a count": lambda text: text.replace('"shots": 16', '"shots": true'),
       "another dataset's evaluations": lambda text: text.replace('"dataset": "dtd", "split"',
                                                                  '"dataset": "ucf101", "split"'),
       "no evaluations": lambda text: json.dumps(dict(json.loads(text), evals=[])),
       "an HM of other numbers": lambda text: json.dumps(dict(json.loads(text), hm=99.0)),
       "an HM off by 0.01": lambda text: json.dumps(dict(d := json.loads(text), hm=d["hm"] + 0.01)),
       "a copy": lambda text: text}
WHY = {"truncated": ": not a JSON file", "not UTF-8": ": not a JSON file",
       "older version": "lacks 'changed'", "accuracy 150": "= 150.0 is not a number in [0, 100]",
       "accuracy -7": "= -7 is not a number in [0, 100]",
       "shots as a string": "['shots'] = \"16\" is not a whole number",
       "a boolean for a count": "['shots'] = true is not a whole number",
       "another dataset's evaluations": "evaluates [('ucf101', 'base'), ('ucf101', 'novel')], but "
       "its config asks for [('dtd', 'base'), ('dtd', 'novel')]",
       "no evaluations": "evaluates nothing, but", "an HM of other numbers": "its hm is not the HM",
       "an HM off by 0.01": "its hm is not the HM", "a copy": "the same run as"}


@pytest.mark.parametrize("kind", BAD)
def test_an_unusable_results_json_is_skipped_with_its_reason(tmp_path, capsys, kind):
    b2n(tmp_path, "dtd", 80.0, 60.0)
    bad = b2n(tmp_path, "dtd", 81.0, 60.0, seed=2)
    text = open(bad).read().replace('"seed": 2',
                                    '"seed": 1') if kind == "a copy" else open(bad).read()
    open(bad, "wb" if kind == "not UTF-8" else "w").write(BAD[kind](text))
    md = tables.build(str(tmp_path))
    err = capsys.readouterr().err
    # the usable run is shown
    assert row(md, "Table 1", "DTD", tables.OURS_DEAR)[0] == "80.00 ± 0.00 (n=1)"
    assert f"tables.py: skipped {bad}: " in err and WHY[kind] in err and err.count("\n") == 1, err
    assert md.split("## Files skipped")[1].strip().startswith(f"- {bad}: ")


def test_links_are_followed_round_no_cycle_and_stale_tables_go(tmp_path):
    """Two links that make cycles under OUT (tables.py walked them for ever), a run counted once;
    a CSV of a table no longer made is removed, a file that is not a table kept."""
    b2n(tmp_path, "dtd", 80.0, 60.0)
    os.symlink(tmp_path / "a", tmp_path / "a" / "loop")
    os.symlink(tmp_path, tmp_path / "a" / "up")
    os.makedirs(tmp_path / "tables")
    for name in ("table5_ablations.csv", "notes.csv"):
        (tmp_path / "tables" / name).write_text("old")
    md = tables.build(str(tmp_path))
    assert row(md, "Table 1", "DTD", tables.OURS_DEAR)[0] == "80.00 ± 0.00 (n=1)"
    assert "## Files skipped" not in md
    kept = os.listdir(tmp_path / "tables")
    assert "notes.csv" in kept and "table1_b2n.csv" in kept and "table5_ablations.csv" not in kept


def test_tables_reads_results_without_torch_and_no_module_imports_a_caller():
    """tables.py loads neither torch nor dear.py (0.15 s, not 4.6); and the project's imports go
    one way: no module imports one that (directly or not) imports it."""
    code = "import sys, tables; print(sorted({'torch', 'dear'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stderr
    modules = {os.path.splitext(f)[0] for f in os.listdir(ROOT) if f.endswith(".py")} | {"clip"}
    graph = {m: set() for m in modules}
    for m in modules:
        path = os.path.join(ROOT, "clip", "__init__.py") if m == "clip" else f"{ROOT}/{m}.py"
        for node in ast.walk(ast.parse(open(path).read())):  # at any depth, inside functions too
            if isinstance(node, ast.ImportFrom):  # from M import x
                graph[m] |= {(node.module or "").split(".")[0]} & modules - {m}
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name.split(".")[0] for a in node.names} & modules - {m}
    reach = {m: set(graph[m]) for m in modules}
    for _ in modules:
        reach = {m: r | {x for n in r for x in reach[n]} for m, r in reach.items()}
    assert not [m for m in modules if m in reach[m]], reach

"""tables.py over hostile output folders: backup copies (two results for one cell), results.json
files that are no results, runs no table has a cell for, and runs of several schedules (epochs,
batch size, lr) under one root. Each result that fills no cell is named, on stderr and at the end of
tables.md; a cell never mixes schedules. The tables themselves (cells, averages, reference numbers)
are tested in test_run_all.py."""

import json
import os
import shutil

import pytest

import tables

B2N = tables.B2N_DATASETS


def write_results(folder, res):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(res, f)
    return os.path.join(folder, "results.json")


def run(
    out,
    protocol,
    dataset,
    evals,
    method="dear",
    seed=1,
    shots=16,
    variant="default",
    backbone="ViT-B/16",
    **extra,
):
    """One results.json in dear.py's format and folder layout; returns its path."""
    d = os.path.join(out, protocol, dataset, f"{method}-{variant}-shots{shots}-seed{seed}")
    res = {
        "method": method,
        "protocol": protocol,
        "dataset": dataset,
        "backbone": backbone,
        "shots": shots,
        "seed": seed,
        "variant": variant,
        "config": {},
        "evals": [
            {"dataset": ds, "split": split, "accuracy": acc, "n": 100} for ds, split, acc in evals
        ],
        **extra,
    }
    return write_results(d, res)


def b2n(out, dataset, base, novel, **kw):
    return run(out, "b2n", dataset, [(dataset, "base", base), (dataset, "novel", novel)], **kw)


def rows_by_label(table):
    """{(dataset group, method label): cells} of a B2N table; {label: cells} for the others."""
    _, header, rows, _ = table
    out, group = {}, None
    for row in rows:
        if header[:2] == ["Dataset", "Method"]:
            group = row[0] or group
            out[(group, row[1])] = row[2:]
        else:
            out[row[0]] = row[1:]
    return out


def md_row(md, label, dataset):
    """The cells of the Markdown row `| <dataset> | <label> | ...` (B2N tables: the dataset opens
    its group)."""
    lines, group = md.splitlines(), None
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 2:
            group = cells[0] or group
            if group == dataset and cells[1] == label:
                return cells[2:]
    return None


# ------------------------------------------------------------------------------------ duplicates


def test_a_backup_copy_is_named_and_fills_no_cell(tmp_path, capsys):
    """A copy of some runs under the same root (runs/old/...): the copy used to win the cell
    silently. Now the cell it shares is left empty and both files are named; the other cells are
    unaffected."""
    out = str(tmp_path)
    first = b2n(out, "eurosat", 90.0, 70.0)
    copy = b2n(os.path.join(out, "old"), "eurosat", 80.0, 60.0)  # an older copy, other numbers
    b2n(out, "dtd", 70.0, 50.0)
    problems = []
    runs = tables.load_runs(out, problems=problems)
    err = capsys.readouterr().err
    assert sorted(p for p, _ in problems) == sorted([first, copy])
    assert (
        f"tables.py: not shown: {first} fills the same table cell(s) as {copy}; those cells "
        f"use neither"
    ) in err
    assert f"tables.py: not shown: {copy} fills the same table cell(s) as {first}" in err
    rows = rows_by_label(tables.table_b2n(runs, "ViT-B/16"))
    assert rows[("EuroSAT", tables.OURS_DEAR)] == [None, None, None]
    assert rows[("DTD", tables.OURS_DEAR)][0].mean == 70.0
    assert tables.main(["--out", out]) == 0
    md = open(tmp_path / "tables" / "tables.md").read()
    assert md_row(md, tables.OURS_DEAR, "EuroSAT")[:3] == ["–", "–", "–"]
    assert "## Results not shown" in md
    assert f"- {first} fills the same table cell(s) as {copy}" in md
    assert "2 runs under" not in md and "1 runs under" in md
    assert "(2 other results.json not shown" in md


def test_a_copy_under_another_seed_or_shots_is_no_duplicate(tmp_path, capsys):
    """Only two results for one slot clash: other seeds and other shots are other slots; zero-shot
    runs are one cell whatever their shots (so two of them clash)."""
    out = str(tmp_path)
    for k, seed in ((1, 1), (1, 2), (4, 1)):
        run(out, "fewshot", "dtd", [("dtd", "all", 40.0 + k + seed)], shots=k, seed=seed)
    z1 = run(out, "fewshot", "dtd", [("dtd", "all", 44.0)], method="zeroshot", shots=16)
    z2 = run(out, "fewshot", "dtd", [("dtd", "all", 45.0)], method="zeroshot", shots=1)
    problems = []
    runs = tables.load_runs(out, problems=problems)
    assert sorted(p for p, _ in problems) == sorted([z1, z2]) and len(runs) == 3
    fs = rows_by_label(tables.table_fewshot(runs, "ViT-B/16"))
    assert fs["DeAR 1-shot (this code)"][B2N.index("dtd")].n == 2
    assert fs[tables.OURS_CLIP][B2N.index("dtd")] is None
    capsys.readouterr()


def test_an_eval_only_rerun_of_the_same_model_is_no_conflict(tmp_path, capsys):
    """`--eval-only --load RUN` writes RUN/eval/<protocol>-<dataset>/results.json; it evaluates the
    same model, so where it repeats a cell of RUN (the source), RUN's own value is used, and its new
    targets are added."""
    out = str(tmp_path)
    source = run(out, "xd", "imagenet", [("imagenet", "all", 70.0), ("dtd", "all", 45.0)])
    rdir = os.path.dirname(source)
    again = write_results(
        os.path.join(rdir, "eval", "xd-imagenet"),
        {
            "method": "dear",
            "protocol": "xd",
            "dataset": "imagenet",
            "backbone": "ViT-B/16",
            "shots": 16,
            "seed": 1,
            "variant": "default",
            "config": {"eval_only": True, "load": rdir},
            "evals": [
                {"dataset": "imagenet", "split": "all", "accuracy": 70.5},
                {"dataset": "caltech101", "split": "all", "accuracy": 90.0},
            ],
        },
    )
    problems = []
    runs = tables.load_runs(out, problems=problems)
    assert problems == [] and "not shown" not in capsys.readouterr().err
    xd = rows_by_label(tables.table_xd(runs, "ViT-B/16"))[tables.OURS_DEAR]
    assert xd[0].mean == 70.0  # the training run's source
    assert xd[1 + tables.XD_TARGETS.index("caltech101")].mean == 90.0  # the eval-only run's target
    assert xd[1 + tables.XD_TARGETS.index("dtd")].mean == 45.0
    # a copy of the eval-only result elsewhere is a duplicate like any other: of the training run
    # on the source, of the eval-only run on its new target
    copy = os.path.join(out, "copy", "results.json")
    shutil.copytree(os.path.dirname(again), os.path.dirname(copy))
    problems = []
    tables.load_runs(out, problems=problems)
    fix = "; those cells use neither: move or delete the copy you do not want, then rerun tables.py"
    same = "fills the same table cell(s) as"
    assert sorted(problems) == sorted(
        [
            (source, f"{same} {copy}{fix}"),
            (again, f"{same} {copy}{fix}"),
            (copy, f"{same} {again}, {source}{fix}"),
        ]
    )
    capsys.readouterr()


# ---------------------------------------------------------------------------------- broken files


BROKEN = {
    "list": ([], "holds [], not a JSON object of results"),
    "null": (None, "holds null, not a JSON object of results"),
    "accuracy null": ("acc-null", "evals[0] (eurosat base) has accuracy null, not a number"),
    "accuracy missing": ("acc-missing", "evals[1] (eurosat novel) has accuracy null, not a number"),
    "accuracy text": ("acc-text", "evals[0] (eurosat base) has accuracy \"90\", not a number"),
    "no backbone": ("no-backbone", "has no backbone, so it belongs to no table"),
    "no evals": ("no-evals", "has no evals (no accuracy at all)"),
}


def broken_results(kind):
    res = {
        "method": "dear",
        "protocol": "b2n",
        "dataset": "eurosat",
        "backbone": "ViT-B/16",
        "shots": 16,
        "seed": 1,
        "variant": "default",
        "evals": [
            {"dataset": "eurosat", "split": "base", "accuracy": 90.0},
            {"dataset": "eurosat", "split": "novel", "accuracy": 70.0},
        ],
    }
    value = BROKEN[kind][0]
    if not isinstance(value, str):
        return value
    if value == "acc-null":
        res["evals"][0]["accuracy"] = None
    elif value == "acc-missing":
        del res["evals"][1]["accuracy"]
    elif value == "acc-text":
        res["evals"][0]["accuracy"] = "90"
    elif value == "no-backbone":
        del res["backbone"]
    else:
        res["evals"] = []
    return res


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_results_json_that_is_no_result_is_named_not_a_traceback(tmp_path, capsys, kind):
    """[], null, an accuracy null, missing or text, no backbone (counted, but shown in no table), no
    evals: skipped with one line naming the file and why, like a duplicate; the other runs' tables
    are written."""
    out = str(tmp_path)
    b2n(out, "dtd", 70.0, 50.0)
    folder = os.path.join(out, "b2n", "eurosat", "dear-default-shots16-seed1")
    bad = write_results(folder, broken_results(kind))
    assert tables.main(["--out", out]) == 0
    err = capsys.readouterr().err
    assert f"tables.py: not shown: {bad} {BROKEN[kind][1]}\n" in err and "Traceback" not in err
    md = open(tmp_path / "tables" / "tables.md").read()
    assert f"- {bad} {BROKEN[kind][1]}" in md and "1 runs under" in md
    assert md_row(md, tables.OURS_DEAR, "DTD")[0].startswith("70.00")


def test_an_unreadable_results_json_is_named(tmp_path, capsys):
    out = str(tmp_path)
    bad = os.path.join(out, "b2n", "eurosat", "dear-default-shots16-seed1", "results.json")
    os.makedirs(os.path.dirname(bad))
    with open(bad, "w") as f:
        f.write('{"method": "dear", "evals": [')  # cut off
    assert tables.main(["--out", out]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"tables.py: not shown: {bad} cannot be read (")
    assert "Traceback" not in err
    assert f"- {bad} cannot be read (" in open(tmp_path / "tables" / "tables.md").read()


def test_runs_that_no_table_has_a_cell_for_are_named(tmp_path, capsys):
    """An xd ablation, base-to-novel at 4 shots (the tables are of 16), an unknown protocol:
    named."""
    out = str(tmp_path)
    b2n(out, "dtd", 70.0, 50.0)
    odd = [
        run(out, "xd", "imagenet", [("imagenet", "all", 70.0)], variant="mask-none"),
        b2n(out, "dtd", 60.0, 40.0, shots=4),
        run(out, "other", "dtd", [("dtd", "all", 50.0)]),
    ]
    tables.build(out)
    err, md = capsys.readouterr().err, open(tmp_path / "tables" / "tables.md").read()
    for path in odd:
        assert f"not shown: {path} is in no table: tables.py has no cell for protocol" in err
        assert f"- {path} is in no table: tables.py has no cell for protocol" in md
    assert md.count("is in no table") == 3


# ------------------------------------------------------------------------------------- schedules


def test_a_run_of_another_schedule_never_fills_a_default_cell(tmp_path, capsys):
    """Runs of several schedules under one root: each schedule gets its own tables, and a cell of
    one never holds a run of another (the default schedule used to win a cell, and a lone epochs-1
    run filled it)."""
    out = str(tmp_path)
    b2n(out, "eurosat", 90.0, 70.0)  # the default schedule
    b2n(out, "eurosat", 50.0, 40.0, variant="epochs-1")
    b2n(out, "dtd", 60.0, 30.0, variant="epochs-1")  # only at epochs-1
    run(out, "b2n", "dtd", [("dtd", "base", 55.0), ("dtd", "novel", 45.0)], method="zeroshot")
    md = tables.build(out)
    default, rest = md.split("## Schedule: default", 1)[1].split("## Schedule: epochs-1", 1)
    assert md_row(default, tables.OURS_DEAR, "EuroSAT")[0].startswith("90.00")
    assert md_row(default, tables.OURS_DEAR, "DTD") == ["–", "–", "–"]
    assert md_row(rest, tables.OURS_DEAR, "EuroSAT")[0].startswith("50.00")
    assert md_row(rest, tables.OURS_DEAR, "DTD")[0].startswith("60.00")
    assert md_row(default, tables.OURS_CLIP, "DTD")[0].startswith("55.00")  # zero-shot: in each
    assert md_row(rest, tables.OURS_CLIP, "DTD")[0].startswith("55.00")
    assert "[ViT-B/16, schedule epochs-1]" in rest
    assert "schedule" not in default.split("## Table 1.")[1][:80]
    assert os.path.exists(tmp_path / "tables" / "table1_b2n.csv")
    csv = open(tmp_path / "tables" / "table1_b2n_epochs-1.csv").read()
    assert "ViT-B/16,DeAR (this code),EuroSAT,Base,50.0000,0.0000,1,," in csv
    assert "90.0000" not in csv
    assert "not shown" not in capsys.readouterr().err


def test_ablations_compare_against_the_full_model_of_their_own_schedule(tmp_path, capsys):
    """The smoke test's 1-epoch ablations beside the quick start's 20-epoch toy model (one --out):
    ΔHM is taken against the 1-epoch full model, not the 20-epoch one (which gave "no role mask" ΔHM
    -16)."""
    out = str(tmp_path)
    b2n(out, "toyworld", 87.0, 84.0, backbone="toy")  # quick start, 20 epochs
    b2n(out, "toyworld", 60.0, 55.0, backbone="toy", variant="epochs-1")  # smoke: full model
    b2n(out, "toyworld", 62.0, 58.0, backbone="toy", variant="mask-none_epochs-1")
    md = tables.build(out)
    smoke = md.split("## Schedule: epochs-1", 1)[1]
    line = next(ln for ln in smoke.splitlines() if ln.startswith("| no role mask |"))
    assert f"| {tables.hm(62, 58) - tables.hm(60, 55):+.2f} |" in line
    assert "Table 5." not in md.split("## Schedule: epochs-1", 1)[0]  # no default-schedule ablation
    capsys.readouterr()


def test_variant_parts_of_every_flag_dear_names():
    """dear.py's variant names hold backbone, precision, crop_scale, target_beta, ...: each parses,
    a schedule part (also lr, weight decay, warm-up) is the schedule, and a backbone part names no
    ablation (the backbone has its own tables)."""
    assert tables.variant_parts("precision-bf16_epochs-1") == ["precision-bf16", "epochs-1"]
    assert tables.method_key("precision-bf16_epochs-1") == "precision-bf16"
    assert tables.schedule_of("precision-bf16_epochs-1") == "epochs-1"
    variant = "crop_scale-0.8_weight_decay-0.01_lr-0.002"
    assert tables.schedule_of(variant) == "weight_decay-0.01_lr-0.002"
    assert tables.method_key(variant) == "crop_scale-0.8"
    assert tables.method_key("backbone-ViT-B-32") == "" and tables.schedule_of("default") == ""
    assert tables.method_key("backbone-ViT-B-32_mask-none") == "mask-none"


def test_the_full_method_of_another_backbone_is_its_table_row(tmp_path, capsys):
    out = str(tmp_path)
    b2n(out, "eurosat", 88.0, 66.0, backbone="ViT-B/32", variant="backbone-ViT-B-32")
    rows = rows_by_label(tables.table_b2n(tables.load_runs(out), "ViT-B/32"))
    assert rows[("EuroSAT", tables.OURS_DEAR)][0].mean == 88.0
    assert tables.table_ablations(tables.load_runs(out), "ViT-B/32") is None  # not an ablation
    capsys.readouterr()


def test_tables_parse_every_field_runs_puts_in_a_folder_name():
    """A field runs.py names a variant by but tables.py cannot parse would make the run a variant of
    its own name (planted: eval_precision missing from tables.VARIANT_FIELDS fails here)."""
    import runs

    assert set(runs.VARIANT_FIELDS) <= set(tables.VARIANT_FIELDS)
    assert set(tables.SCHEDULE_FIELDS) <= set(runs.VARIANT_FIELDS)

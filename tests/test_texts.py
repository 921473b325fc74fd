"""What users read, stated once in tests/texts/ and reviewed as a diff: every script's options
(flag, default, type, choices, help, description), tables.md on hand-made runs and (in
tests/test_entropy.py) roles.md. A change fails until `DEAR_REVIEW=1 python -m pytest` rewrites
the files, and `git diff tests/texts` shows it to the reviewer."""

import argparse
import json
import os
import sys

import pytest
import torch

import bench
import data
import dear
import entropy
import predict
import tables
from conftest import reviewed
from test_tables import b2n, put

PROBES = ["0", "1", "-1", "0.5", "nan", "9-12", "x"]  # what each type makes of them


def kind(t):
    if t in (None, str, int, float, data.text):
        return getattr(t, "what", getattr(t, "__name__", "str"))
    made = []
    for text in PROBES:
        try:
            made.append(f"{text}:{t(text)!r}")
        except (ValueError, argparse.ArgumentTypeError, data.UserError) as e:
            made.append(f"{text}:no" + (f" ({e})" if text == "x" else ""))
    return " ".join(made)


def options(parser, name):
    """Every option of `parser` and its sub-commands, a line each, under its group's title."""
    lines = [f"# {name}: {parser.description}", *(parser.epilog or "").splitlines()]
    for a in (a for g in parser._action_groups for a in [g.title, *g._group_actions]):
        if isinstance(a, str):
            lines.append(f"[{a}]")
        elif isinstance(a, argparse._SubParsersAction):
            lines += [f"{a.dest} (required={a.required}): " + ", ".join(
                f"{c.dest}: {c.help}" for c in a._choices_actions)]
            lines += [line for sub, p in a.choices.items() for line in options(p, f"{name} {sub}")]
        else:
            default = "$DATA, else data" if a.default == data.DEFAULT_ROOT else a.default
            said = dict(choices=a.choices, nargs=a.nargs, metavar=a.metavar, required=a.required)
            lines.append(f"{'/'.join(a.option_strings) or a.dest}: default={default!r} type="
                         f"{kind(a.type)} " + "".join(f"{k}={v} " for k, v in said.items() if v)
                         + f"help={a.help!r}")
    return lines


def test_every_scripts_options_are_as_reviewed(monkeypatch):
    # each script's parser, stopped before parsing: SystemExit(parser)
    monkeypatch.setattr(data.Parser, "parse_args", lambda parser, argv=None: sys.exit(parser))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the defaults of a CPU machine
    lines = []
    for name, main in [("dear.py", dear.parse_args), ("predict.py", predict.predict),
                       ("data.py", data.check_or_download), ("entropy.py", entropy.roles_of),
                       ("tables.py", tables.tables), ("bench.py", bench.bench)]:
        with pytest.raises(SystemExit) as stopped:
            main([])
        lines += options(stopped.value.code, name) + [""]
    reviewed("options.txt", "\n".join(lines))


def test_tables_md_is_as_reviewed(tmp_path, capsys):
    """Every table, on the paper's backbone and on the toy (each of its schedules under its own
    title; a folder target under its folder's name), with notes, published rows, an ablation, a
    re-evaluation (not a run), a skipped file and the roles section; a backbone with few-shot runs
    only (its Table 4 alone); printed as written."""
    for seed in (1, 2):
        for ds, base, novel in (("imagenet", 76.0, 70.0), ("dtd", 83.0, 60.0)):
            b2n(tmp_path, ds, base + seed, novel, seed=seed)
            b2n(tmp_path, ds, base - 5, novel - 2, seed=seed, method="zeroshot")
            b2n(tmp_path, ds, base, novel - 9, seed=seed, changed={"mask": "none"}, mask="none")
        # no ImageNet variant among the targets: Table 2 has the published rows alone
        put(tmp_path, "xd", "imagenet", [("imagenet", "all", 72.0), ("dtd", "all", 45.0 + seed)],
            seed=seed)
        put(tmp_path, "xd", "imagenet", [("imagenet", "all", 71.0), ("dtd", "all", 47.0)],
            seed=seed, changed={"novel_logits": "cls"}, novel_logits="cls")
        put(tmp_path, "fewshot", "dtd", [("dtd", "all", 60.0 + seed)], shots=4, seed=seed)
        put(tmp_path, "fewshot", "dtd", [("dtd", "all", 50.0)], method="zeroshot", seed=seed)
        put(tmp_path, "fewshot", "toyworld", [("toyworld", "all", 65.0)], shots=2, seed=seed,
            backbone="toy")
        b2n(tmp_path, "toyworld", 80.0, 60.0, seed=seed, changed={"epochs": 10}, epochs=10,
            backbone="toy")
        put(tmp_path, "xd", "toyworld", [("toyworld", "all", 85.0),
            ("folder:/data/toyworld-transfer/noisy", "all", 60.0)], seed=seed, backbone="toy")
        for changed in ({}, {"mask": "none"}):  # a second schedule, with an ablation
            b2n(tmp_path, "toyworld", 81.0, 61.0 - len(changed), seed=seed, backbone="toy",
                changed=changed | {"epochs": 12, "batch_size": 8}, epochs=12, batch_size=8,
                **changed)
    put(tmp_path, "xd", "toyworld", [("toyworld", "all", 5.0)], eval_only=True, backbone="toy")
    put(tmp_path, "fewshot", "dtd", [("dtd", "all", 70.0)], shots=2, backbone="ViT-L/14")
    b2n(tmp_path, "toyworld", 78.0, 55.0, method="zeroshot", backbone="toy")
    (tmp_path / "a" / "broken").mkdir()
    (tmp_path / "a" / "broken" / "results.json").write_text("{")
    for J in (9, 7):  # with a whole roles.json, its costs by role; else the link alone
        (tmp_path / "roles" / f"J{J}").mkdir(parents=True)
        (tmp_path / "roles" / f"J{J}" / "roles.md").write_text("| 9 | G |")
    costs = {"attribute": {"mean": 1.25, "heads": 3}, "generalization": {"mean": 2.5, "heads": 4}}
    by_role = json.dumps({"ablation": {"by_role": costs}})
    (tmp_path / "roles" / "J9" / "roles.json").write_text(by_role)
    assert tables.main(["--out", str(tmp_path)]) == 0
    md = (tmp_path / "tables" / "tables.md").read_text()
    assert capsys.readouterr().out.strip() == md.strip()
    assert not [f for f in os.listdir(tmp_path / "tables") if f.endswith(".tmp")]
    reviewed("tables.md", md.replace(str(tmp_path), "OUT"))
    csv = (tmp_path / "tables" / "table2_dg.csv").read_text().splitlines()  # the Markdown's cells
    assert csv[:2] == ["backbone,row,group,column,mean,std,n_seeds,source",
                       'ViT-B/16,"CLIP (zero-shot, this code)",,ImageNet (source),,,,']
    assert "ViT-B/16,CLIP (published),,ImageNet-A,47.77,,,l" in csv

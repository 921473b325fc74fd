"""bench.py runs end to end on the tiny model and writes a table with every row (no timing asserts)."""
import os
import re
import subprocess
import sys

import pytest

import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table_rows(text):
    """id -> cells of every row of the results table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and re.match(r"^[a-f]\.", cells[0]):
            rows[cells[0]] = cells
    return rows


def test_tiny_bench_writes_every_row(tmp_path):
    out = tmp_path / "bench.md"
    # one intra-op thread: the test suite shares a small machine, where spinning threads only slow it down
    proc = subprocess.run([sys.executable, "bench.py", "--tiny", "--repeats", "1", "--threads", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    rows = table_rows(text)
    settings = list(zip(bench.DEFAULTS["tiny"]["classes"], bench.DEFAULTS["tiny"]["batches"]))
    expected = bench.row_ids(settings)
    assert sorted(rows) == sorted(expected)
    for rid in expected:  # every row carries numbers in both columns
        assert re.search(r"\d", rows[rid][2]) and re.search(r"\d", rows[rid][3]), rows[rid]
    for rid in expected:
        if rid[0] in "abcd" and "agree" not in rid:
            assert float(rows[rid][4]) > 0  # a ratio was computed
    # the vendored CLIP and the nn.MultiheadAttention reference compute the same features
    assert all(float(v) < 1e-5 for v in rows["a.agree"][2:4])
    # the naive step and ours compute the same loss and the same gradient of R
    for C, B in settings:
        loss_ours, loss_naive = (float(v) for v in rows[f"c.agree.C{C}xB{B}"][2].split("/"))
        assert loss_ours == pytest.approx(loss_naive, rel=1e-5)
        assert float(rows[f"c.agree.C{C}xB{B}"][3]) < 1e-4
    for header in ("| device |", "| torch |", "| date |", "| settings (classes x batch) |", "intra-op threads"):
        assert header in text
    assert "GPU numbers were not measured" in text  # CPU run: says so
    assert "## Where a DeAR training step spends its time" in text


def test_bad_settings_stop_with_one_clear_message(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--tiny", "--classes", "10,100", "--batches", "4"])
    assert e.value.code == 2
    assert "one batch size per class count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--classes", "ten"])
    assert "comma-separated whole numbers" in capsys.readouterr().err


def test_reference_has_openai_layout_and_loads_the_same_weights():
    from conftest import tiny_clip
    import torch
    model = tiny_clip()
    ref = bench.build_reference(model, bench.TINY)
    assert isinstance(ref.transformer.resblocks[0].attn, torch.nn.MultiheadAttention)
    assert not ref.transformer.resblocks[0].attn.batch_first  # sequence-first, as OpenAI's original
    assert ref.visual.proj.data_ptr() == model.visual.proj.data_ptr()  # shared, not copied

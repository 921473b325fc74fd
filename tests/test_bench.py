"""bench.py runs end to end on the tiny model and writes a table with every row (no timing
asserts)."""

import os
import re
import subprocess
import sys

import pytest
import torch

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
    # one intra-op thread: the test suite shares a small machine, where spinning threads only slow
    # it down. In this process (command line, main() and all): a subprocess adds only torch's
    # start-up.
    threads = torch.get_num_threads()
    try:
        bench.main(
            [
                "--tiny",
                "--repeats",
                "1",
                "--short-repeats",
                "1",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads)  # bench sets it for the whole process
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
    for C, B in settings[:1]:  # on a CPU the naive step runs in the first setting only
        loss_ours, loss_naive = (float(v) for v in rows[f"c.agree.C{C}xB{B}"][2].split("/"))
        assert loss_ours == pytest.approx(loss_naive, rel=1e-5)
        assert float(rows[f"c.agree.C{C}xB{B}"][3]) < 1e-4
    for rid in expected:  # every timing row has its FLOP limit and measured / limit
        if rid[0] in "abcd" and "agree" not in rid:
            assert float(rows[rid][5]) > 0 and float(rows[rid][6]) > 0, rows[rid]
    # the naive step does far more work
    assert float(rows[f"c.C{settings[0][0]}xB{settings[0][1]}"][5]) > 3
    # the frozen forward with every position in its last blocks: the same predictions,
    # more FLOPs than the pruned one
    tag = "C{}xB{}".format(*settings[0])
    assert float(rows[f"b.rows.agree.{tag}"][2]) < 1e-3
    assert float(rows[f"b.rows.{tag}"][5]) < float(rows[f"b.{tag}"][5])
    for header in (
        "| device |",
        "| torch |",
        "| date |",
        "| settings (classes x batch) |",
        "intra-op threads",
    ):
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


def block_flops(n, r, D):
    """FLOPs (2 per multiply-add) of one pre-LN block on one sequence, written out by hand: keys and
    values of all n positions, queries, attention, output projection and MLP (4x wide) of the r rows
    computed."""
    return 2 * (n * D * 2 * D + r * D * D + 2 * r * n * D + r * D * D + r * D * 8 * D)


def test_flop_count_equals_a_hand_count_of_the_cut_last_block():
    """bench.count_flops reads every matmul the code runs; on encode_image and on DeAR's image side
    it equals the FLOPs counted by hand with the last block computing only the rows read
    (CLS; CLS + K tokens)."""
    import torch
    from conftest import tiny_clip
    from dear import K, DeAR

    m = tiny_clip()
    B, D, E, N, P, patch = 3, 64, 32, 17, 16, 8
    images = torch.randn(B, 3, 32, 32)
    embed = 2 * P * (3 * patch * patch) * D  # the patch convolution, per image
    with torch.no_grad():
        counted = bench.count_flops(lambda: m.encode_image(images))
    assert counted == B * (embed + 3 * block_flops(N, N, D) + block_flops(N, 1, D) + 2 * D * E)
    net = DeAR(m, None, J=3, mask="none", rep_dim=16)  # tokens in blocks 3 and 4 (1-based)
    with torch.no_grad():
        counted = bench.count_flops(lambda: net.encode_images(images))
    aligners = 2 * 2 * K * 16 * D  # F_v of blocks 3 and 4: [K, 16] -> [K, D]
    by_hand = B * (
        embed
        + 2 * block_flops(N, N, D)
        + block_flops(N + K, N + K, D)
        + block_flops(N + K, 1 + K, D)
        + 2 * (1 + K) * D * E
    )  # proj for CLS, P_attr for the K tokens
    assert counted == aligners + by_hand


def test_every_row_baseline_computes_every_position_of_the_last_blocks():
    """b.rows' frozen forward: the same logits as the pruned one, and exactly the FLOPs of the last
    image block on all N rows instead of CLS, plus the last text block on all T positions instead of
    EOT, counted by hand."""
    import torch
    from conftest import tiny_clip
    import clip

    m = tiny_clip()
    B, D, N = 3, 64, 17
    images = torch.randn(B, 3, 32, 32)
    tokens = clip.tokenize(["a photo of a red circle."])  # one text: one group, EOT at T - 1
    T = int(tokens.argmax(-1)) + 1
    with torch.no_grad():
        pruned, full = (bench.frozen_logits(m, images, tokens, every_row=e) for e in (False, True))
        extra = bench.count_flops(
            lambda: bench.frozen_logits(m, images, tokens, every_row=True)
        ) - bench.count_flops(lambda: bench.frozen_logits(m, images, tokens))
    assert torch.allclose(pruned, full, atol=1e-4)
    assert extra == B * (block_flops(N, N, D) - block_flops(N, 1, D)) + block_flops(
        T, T, D
    ) - block_flops(T, 1, D)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_code_path_under_autocast_as_far_as_a_cpu_allows(precision, monkeypatch, capsys):
    """--device cuda without CUDA stops with one line; the autocast path that a GPU takes (autocast
    around every contender, the frozen weights stored in the autocast dtype while they run, the
    pruned last block and the shared text start in that dtype; fp16: CUDA's default, with a
    GradScaler) runs here through CPU autocast, and the step it times is train.train_step itself;
    the agreement rows meet their half-precision targets."""
    import torch
    import train

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--device", "cuda"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "CUDA is not available" in err, err
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    steps, dtypes, real_step = (
        [],
        set(),
        train.train_step,
    )  # the precision of every timed step, its weights' dtype

    def spy(model, images, labels, loss_fn, opt, scaler, amp):
        steps.append(amp)
        dtypes.add(model.clip.visual.transformer.resblocks[0].mlp.c_fc.weight.dtype)
        assert scaler.is_enabled() == (amp == torch.float16)
        return real_step(model, images, labels, loss_fn, opt, scaler, amp)

    monkeypatch.setattr(train, "train_step", spy)
    args = bench.parse_args(
        [
            "--tiny",
            "--device",
            "cpu",
            "--precision",
            precision,
            "--repeats",
            "1",
            "--short-repeats",
            "1",
            "--classes",
            "10",
            "--batches",
            "4",
            "--no-breakdown",
        ]
    )
    res = bench.run(args)
    assert steps and set(steps) == {low} and dtypes == {low}  # frozen weights in the autocast dtype
    rows = {r[0]: r for r in res["rows"]}
    assert sorted(rows) == sorted(bench.row_ids([(10, 4)]))
    tol = bench.AGREEMENT[low]
    loss_ours, loss_naive = (float(v) for v in rows["c.agree.C10xB4"][2].split("/"))
    # the same loss and gradient of R (finite: no skipped step) to this precision's noise
    assert loss_ours == pytest.approx(loss_naive, rel=tol["loss"])
    assert float(rows["c.agree.C10xB4"][3]) < tol["grad"]
    assert float(rows["b.rows.agree.C10xB4"][4]) < tol["logits"]
    assert f"autocast {precision}" in bench.markdown(res, args)


def test_tiny_bench_never_writes_bench_md(capsys):
    """--tiny writes BENCH_TINY.md by default and refuses to write BENCH.md (the committed ViT-B/16
    numbers)."""
    assert bench.parse_args(["--tiny", "--device", "cpu"]).out == bench.TINY_OUT != "BENCH.md"
    assert bench.parse_args(["--device", "cpu"]).out == "BENCH.md"
    for out in ("BENCH.md", os.path.join(ROOT, "BENCH.md")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--tiny", "--device", "cpu", "--out", out])
        assert e.value.code == 2 and "BENCH.md keeps the ViT-B/16" in capsys.readouterr().err


def test_bench_gpu_sh_names_every_missing_wheel(tmp_path):
    """bench_gpu.sh with an interpreter that lacks packages (here: one that blocks ftfy and regex,
    and one without site-packages at all) stops with exit 2 before any check, naming every missing
    wheel and the pip download command that fills .whl/."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name in ('ftfy', 'regex'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    blocked, bare = tmp_path / "blocked-python", tmp_path / "bare-python"
    blocked.write_text(f"#!/bin/sh\nPYTHONPATH={block} exec {sys.executable} \"$@\"\n")
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    everything = ["torch", "torchvision", "numpy", "pillow", "regex", "ftfy", "pytest"]
    for wrapper, names in ((blocked, ["regex", "ftfy"]), (bare, everything)):
        wrapper.chmod(0o755)
        proc = subprocess.run(
            ["bash", "bench_gpu.sh"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHON": str(wrapper)},
        )
        assert proc.returncode == 2, proc.stderr
        said = proc.stderr.split("missing:")[1].split("(")[0].split()
        assert said == names, proc.stderr
        assert "python -m pip download " + " ".join(names) + " -d .whl" in proc.stderr

"""bench.py: the tiny bench writes every row; its FLOP counts agree with counts by hand."""

import pytest
import torch

import bench
import clip
import dear
from clip.model import CLIP


def test_tiny_bench_writes_every_row_and_the_shortcuts_only_save(tmp_path, monkeypatch):
    res = bench.main(["--tiny", "--out", str(tmp_path / "bench.md")])
    text = (tmp_path / "bench.md").read_text()
    assert "torch " + torch.__version__ in text and "`python bench.py --tiny --out" in text
    assert [len(res[k]) / len(bench.SETTINGS) for k in ("costs", "shortcuts")] == [5, 4]
    for what, where, *_ in res["costs"] + res["shortcuts"]:
        assert f"| {what} | {where} |" in text
    for what, _, r, base, trainable in res["costs"]:
        assert r["s"] > 0 and r["flops"] > 0 and (trainable > 0) == what.startswith("b.")
    # the readouts' f^0: blocks J..L again without the tokens (block 3 whole, block 4 CLS alone)
    for (_, where, c, _, _), (_, _, d, base, _) in zip(res["costs"][3::5], res["costs"][4::5]):
        B = int(where.split()[-1])
        assert base is c and d["flops"] - c["flops"] == B * (block(17, 17, 64) + block(17, 1, 64)
                                                             + 2 * 64 * 32)
    # exact: the same loss, never more FLOPs
    for shortcut, where, with_it, without_it, loss in res["shortcuts"]:
        saves = with_it < without_it if where.startswith("1000") else with_it <= without_it
        assert saves and abs(loss) < 1e-5, (shortcut, where)
    monkeypatch.setattr(bench, "run", None)  # a folder that takes no files: refused before the work
    with pytest.raises(SystemExit, match="2"):
        bench.main(["--tiny", "--out", "/proc/self/bench.md"])


def block(T, R, D):
    """FLOPs of a block on T positions computing R rows: k, v of T; q, attention, out, MLP of R."""
    return (2 * T * D * 2 * D + 2 * R * D * D + 2 * 2 * R * T * D + 2 * R * D * D
            + 2 * 2 * R * D * 4 * D)


def test_all_three_takes_every_shortcut_away():
    """Under bench.without(..., "all three") the class features cost what the plain computation
    costs by hand: every prompt whole, padded to the longest, every row of every block J..L (and
    each block's tokens from R), then the projection."""
    torch.manual_seed(0)
    model = dear.DeAR(CLIP(**bench.TINY).eval(), bench.made_up_roles(4, 4), J=3)
    names = bench.classnames(10)
    model.set_classes(names, bench.TEMPLATE)
    N = int(clip.tokenize([bench.TEMPLATE.format(c) for c in names]).argmax(-1).max()) + 1
    W, E, rep, K = 64, 32, 512, dear.K
    tokens = 2 * W * 4 * rep + 2 * K * rep * W  # W + A_i B_i, then R (W + A_i B_i)^T
    with bench.without(model, names, "all three"), torch.no_grad():
        flops, _ = bench.flops(model.encode_classes)
    assert flops == 2 * (tokens + 10 * block(N + K, N + K, W)) + 2 * 10 * W * E


def test_flop_count_of_a_clip_forward_equals_the_count_by_hand():
    torch.manual_seed(0)  # 4 vision blocks of width 64, 32 px in patches of 8; 2 text blocks of 64
    m = CLIP(**bench.TINY).eval()
    images, text = torch.randn(2, 3, 32, 32), clip.tokenize(["a photo of a dog."])
    D, P, E, n = 64, 16, 32, int(text.argmax()) + 1  # n: positions up to EOT; the last block: CLS
    image = 2 * P * (3 * 8 * 8) * D + 3 * block(1 + P, 1 + P, D) + block(1 + P, 1, D) + 2 * D * E
    prompt = block(n, n, D) + block(n, 1, D) + 2 * D * E  # the last block: EOT only
    with torch.no_grad():
        flops, _ = bench.flops(lambda: m(images, text))
    assert flops == 2 * image + prompt + 2 * 2 * E * 1  # + the logits [2, E] x [E, 1]

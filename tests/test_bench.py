"""bench.py: the tiny bench writes every row; its FLOP counts and memory estimate agree with
counts by hand."""

import torch
from torch.autograd.graph import saved_tensors_hooks

import bench
import clip
from clip.model import CLIP, ResidualAttentionBlock


def test_tiny_bench_writes_every_row_and_the_shortcuts_only_save(tmp_path):
    out = tmp_path / "bench.md"
    res = bench.main(["--tiny", "--out", str(out)])
    text = out.read_text()
    assert "torch " + torch.__version__ in text and "`python bench.py --tiny --out" in text
    assert len(res["costs"]) == 5 * len(bench.SETTINGS)
    assert len(res["shortcuts"]) == 4 * len(bench.SETTINGS)
    for what, where, *_ in res["costs"] + res["shortcuts"]:
        assert f"| {what} | {where} |" in text
    for what, _, r, base, trainable in res["costs"]:
        assert r["s"] > 0 and r["flops"] > 0 and (trainable > 0) == what.startswith("b.")
    # exact: the same loss, never more FLOPs
    for shortcut, where, with_it, without_it, loss in res["shortcuts"]:
        saves = with_it < without_it if where.startswith("1000") else with_it <= without_it
        assert saves, (shortcut, where)
        assert abs(loss) < 1e-5, (shortcut, where)
    for name, *_ in res["memory"]:
        assert f"| {name} |" in text


def block(T, R, D):
    """FLOPs of one block on T positions computing R rows: k, v of T rows and q of R, attention,
    out_proj, MLP."""
    return (2 * T * D * 2 * D + 2 * R * D * D + 2 * 2 * R * T * D + 2 * R * D * D
            + 2 * 2 * R * D * 4 * D)


def test_flop_count_of_a_clip_forward_equals_the_count_by_hand():
    torch.manual_seed(0)
    # 4 vision blocks of width 64, 32 px in patches of 8; 2 text blocks of 64; E = 32
    m = CLIP(**bench.TINY).eval()
    images, text = torch.randn(2, 3, 32, 32), clip.tokenize(["a photo of a dog."])
    D, P, E, n = 64, 16, 32, int(text.argmax()) + 1  # n: positions up to EOT
    # the last: CLS
    image = 2 * P * (3 * 8 * 8) * D + 3 * block(1 + P, 1 + P, D) + block(1 + P, 1, D) + 2 * D * E
    prompt = block(n, n, D) + block(n, 1, D) + 2 * D * E  # the last block: EOT only
    with torch.no_grad():
        flops, _ = bench.flops(lambda: m(images, text))
    assert flops == 2 * image + prompt + 2 * 2 * E * 1  # + the logits [2, E] x [E, 1]


def test_memory_estimate_counts_the_released_backbones():
    # parameter counts of OpenAI's released checkpoints (sum of numel of their state dicts)
    released = {"ViT-B/32": 151_277_313, "ViT-B/16": 149_620_737, "ViT-L/14": 427_616_513,
                "ViT-L/14@336px": 427_944_193}
    rows = {row[0]: row for row in (bench.memory_estimate(*b,
            10.0) for b in bench.BACKBONES.items())}
    for name, count in released.items():
        assert rows[name][4] * 2**30 == 4 * count  # frozen weights, fp32
        assert rows[name][8] == sum(rows[name][4:8])
    assert [r[1] for r in rows.values()] == ["9 of 12", "9 of 12", "17 of 24", "17 of 24"]
    assert all(r[2] < r[3] for r in rows.values())  # mmrlpp trains fewer values than mmrl


def test_saved_bytes_per_token_are_what_autograd_keeps():
    D, H, T = 64, 4, 10
    blk = ResidualAttentionBlock(D, H).requires_grad_(False)  # frozen, as the CLIP in DeAR
    x, storages = torch.randn(2, T, D, requires_grad=True), {}

    # each storage once; not the frozen weights nor the [T, T] mask (they do not grow with the
    # batch)
    def keep(t):
        if T in t.shape and t.shape[-2:] != (T, T):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    # 2 bytes a value, as fp16
    with saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        blk(x, torch.zeros(H, T, T))
    assert bench.SAVED_BYTES <= sum(storages.values()) / (2 * T * D) < bench.SAVED_BYTES + 1

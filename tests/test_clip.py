"""Tests of the vendored CLIP: model math, seams, tokenizer, checkpoint loading and downloading."""

import errno
import hashlib
import http.server
import os
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import clip
import clip.model
from clip.model import MultiheadAttention, build_model, infer_config
from clip.tokenizer import get_tokenizer
from conftest import tiny_clip, tiny_state_dict


# ---------------------------------------------------------------- a plain reference CLIP
# Built the most direct way: OpenAI's [L, N, D] layout and torch.nn.MultiheadAttention, fed the same
# state dict. It shares no code with clip/model.py.


def _ref_transformer(x, sd, prefix, layers, heads, mask=None):
    """x [L, N, D] through `layers` pre-LN blocks read from sd under `prefix`."""
    D = x.shape[-1]

    def ln(t, name):
        return F.layer_norm(t, (D,), sd[name + ".weight"], sd[name + ".bias"])

    for i in range(layers):
        p = f"{prefix}.resblocks.{i}."
        mha = nn.MultiheadAttention(D, heads)
        mha.load_state_dict(
            {
                k: sd[p + "attn." + k]
                for k in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
            }
        )
        h = ln(x, p + "ln_1")
        x = x + mha(h, h, h, need_weights=False, attn_mask=mask)[0]
        h = F.linear(ln(x, p + "ln_2"), sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])
        h = h * torch.sigmoid(1.702 * h)
        x = x + F.linear(h, sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
    return x


def ref_encode_image(sd, images, layers, heads):
    w = sd["visual.conv1.weight"]
    x = F.conv2d(images, w, stride=w.shape[-1])  # [N, D, g, g]
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # [N, P, D]
    cls = sd["visual.class_embedding"] + torch.zeros(x.shape[0], 1, x.shape[-1])
    x = torch.cat([cls, x], dim=1) + sd["visual.positional_embedding"]
    x = F.layer_norm(x, (x.shape[-1],), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    x = _ref_transformer(x.permute(1, 0, 2), sd, "visual.transformer", layers, heads).permute(
        1, 0, 2
    )
    x = F.layer_norm(
        x[:, 0], (x.shape[-1],), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"]
    )
    return x @ sd["visual.proj"]


def ref_encode_text(sd, tokens, layers, heads):
    n = tokens.shape[1]
    x = sd["token_embedding.weight"][tokens.long()] + sd["positional_embedding"]
    mask = torch.full((n, n), float("-inf")).triu(1)
    x = _ref_transformer(x.permute(1, 0, 2), sd, "transformer", layers, heads, mask).permute(
        1, 0, 2
    )
    x = F.layer_norm(x, (x.shape[-1],), sd["ln_final.weight"], sd["ln_final.bias"])
    return x[torch.arange(x.shape[0]), tokens.argmax(-1)] @ sd["text_projection"]


def _images(n=2, size=32, seed=1):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- model


def test_features_equal_plain_reference_and_state_dict_round_trips():
    sd = tiny_state_dict(seed=3)
    g = torch.Generator().manual_seed(3)
    for k in (
        sd
    ):  # random LayerNorm gains and biases (the init has ones and zeros) so every tensor matters
        if sd[k].dim() == 1:
            sd[k] = sd[k] + 0.1 * torch.randn(sd[k].shape, generator=g)
    model = build_model(sd)
    images = _images()
    tokens = clip.tokenize(["a photo of a cat.", "a red striped circle in the top left", "", ""])
    # id 0 ("!") inside a text: EOT is the argmax
    tokens[3, :6] = torch.tensor([49406, 0, 0, 320, 0, 49407])
    with torch.no_grad():
        ours_i = F.normalize(model.encode_image(images), dim=-1)
        ours_t = F.normalize(model.encode_text(tokens), dim=-1)
        ref_i = F.normalize(ref_encode_image(sd, images, 4, 4), dim=-1)
        ref_t = F.normalize(ref_encode_text(sd, tokens, 2, 4), dim=-1)
    assert (ours_i - ref_i).abs().max() < 1e-5
    assert (ours_t - ref_t).abs().max() < 1e-5
    # strict round trip: every key present, same names, same values
    out = model.state_dict()
    weights = {k: v for k, v in sd.items() if k not in ("vision_heads", "text_heads")}
    assert set(out) == set(weights)
    assert all(torch.equal(out[k], weights[k]) for k in weights)
    # strict again
    build_model({**out, "vision_heads": torch.tensor(4), "text_heads": torch.tensor(4)})
    # logits are exp(logit_scale) * cosine
    logits, logits_t = model(images, tokens)
    assert torch.allclose(logits, model.logit_scale.exp() * ours_i @ ours_t.t(), atol=1e-4)
    assert torch.equal(logits_t, logits.t())


def _explicit_attention(attn, x, mask):
    """Per head h: softmax(Q_h K_h^T / sqrt(d) + mask_h) V_h, heads concatenated, then out_proj."""
    B, L, D = x.shape
    H, d = attn.n_head, D // attn.n_head
    Wq, Wk, Wv = attn.in_proj_weight.split(D)
    bq, bk, bv = attn.in_proj_bias.split(D)
    outs, weights = [], []
    for h in range(H):
        rows = slice(h * d, (h + 1) * d)
        q = x @ Wq[rows].t() + bq[rows]
        k = x @ Wk[rows].t() + bk[rows]
        v = x @ Wv[rows].t() + bv[rows]
        w = torch.softmax(q @ k.transpose(1, 2) / d**0.5 + mask[:, h], dim=-1)  # [B, L, L]
        outs.append(w @ v)
        weights.append(w)
    return attn.out_proj(torch.cat(outs, dim=-1)), torch.stack(weights, dim=1)


@pytest.mark.parametrize("per_image", [False, True])
def test_masked_attention_equals_explicit_per_head_softmax(per_image):
    torch.manual_seed(0)
    B, L, D, H = 3, 7, 32, 4
    attn = MultiheadAttention(D, H)
    x = torch.randn(B, L, D)
    shape = (B, H, L, L) if per_image else (H, L, L)
    mask = torch.randn(shape)  # a different additive mask for every head
    mask = mask.masked_fill(torch.rand(shape) < 0.3, float("-inf"))
    # every query keeps at least itself
    mask = mask.masked_fill(torch.eye(L, dtype=torch.bool), 0.0)
    full = mask.expand(B, H, L, L)
    expected, expected_w = _explicit_attention(attn, x, full)
    out_fast = attn(x, attn_mask=mask)
    out_plain, w = attn(x, attn_mask=mask, need_weights=True)
    assert torch.allclose(out_fast, expected, atol=1e-5)
    assert torch.allclose(out_plain, expected, atol=1e-5)
    assert w.shape == (B, H, L, L) and torch.allclose(w, expected_w, atol=1e-6)
    assert torch.all(w[torch.isinf(full)] == 0)


def test_blocked_key_column_gets_zero_weight_isolates_and_passes_gradients():
    torch.manual_seed(0)
    B, L, D, H, j = 2, 6, 32, 4, 2
    attn = MultiheadAttention(D, H)
    mask = torch.zeros(H, L, L)
    mask[:, :, j] = float("-inf")  # nobody may look at token j ...
    mask[:, j, j] = 0.0  # ... except token j itself, so its row stays valid
    x = torch.randn(B, L, D, requires_grad=True)
    out, w = attn(x, attn_mask=mask, need_weights=True)
    others = [i for i in range(L) if i != j]
    assert torch.all(w[:, :, others, j] == 0)
    # the other tokens' outputs do not depend on token j at all
    out[:, others].sum().backward()
    assert x.grad[:, j].abs().max() == 0
    assert x.grad[:, others].abs().min() > 0
    # and gradients reach the weights on the fast path too
    attn.zero_grad()
    attn(x.detach(), attn_mask=mask).square().sum().backward()
    for p in attn.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    with pytest.raises(TypeError, match="additive float mask"):
        attn(x, attn_mask=mask == 0)


def test_seams_compose_to_the_encoders(tiny_model):
    m = tiny_model
    images = _images()
    tokens = clip.tokenize(["a photo of a cat.", "two dogs"])
    with torch.no_grad():
        x = m.visual.embed(images)
        assert x.shape == (2, 1 + m.visual.num_patches, m.visual.width)
        full = m.visual.run_blocks(x, 0, m.visual.layers)
        for k in range(m.visual.layers + 1):
            split = m.visual.run_blocks(m.visual.run_blocks(x, 0, k), k, m.visual.layers)
            assert torch.allclose(split, full, atol=1e-6)
        # encode_image computes only CLS in the last block: equal up to float round-off
        assert torch.allclose(m.encode_image(images), m.visual.head(full[:, 0]), atol=1e-6)
        # a per-block list of masks; all-zero masks (one per head) change nothing
        zeros = [torch.zeros(m.visual.heads, x.shape[1], x.shape[1]), None, None, torch.zeros(1, 1)]
        assert torch.allclose(m.visual.run_blocks(x, 0, 4, attn_mask=zeros), full, atol=1e-6)
        with pytest.raises(ValueError, match="one per block"):
            m.visual.run_blocks(x, 0, 4, attn_mask=[None])
        # head works on several tokens at once
        assert m.visual.head(full).shape == (2, x.shape[1], m.visual.output_dim)

        t = m.embed_text(tokens)
        L = m.transformer.layers
        text = m.text_head(m.run_text_blocks(t, 0, L), tokens.argmax(-1))
        # encode_text drops the padding after the longest prompt first: equal up to float round-off
        assert torch.allclose(m.encode_text(tokens), text, atol=1e-5)
        split = m.run_text_blocks(m.run_text_blocks(t, 0, 1), 1, L)
        assert torch.allclose(m.text_head(split, tokens.argmax(-1)), text, atol=1e-6)
        # causal: cutting the padding after EOT leaves the features unchanged
        short = tokens[:, :10]
        assert torch.allclose(m.encode_text(short), text, atol=1e-5)


def test_build_model_infers_released_sizes_and_rejects_resnets():
    meta = lambda *s: torch.empty(*s, device="meta")  # shapes only, no memory
    sd = {
        "visual.proj": meta(1024, 768),
        "visual.conv1.weight": meta(1024, 3, 14, 14),
        "visual.positional_embedding": meta(577, 1024),
        "text_projection": meta(768, 768),
        "positional_embedding": meta(77, 768),
        "token_embedding.weight": meta(49408, 768),
        "ln_final.weight": meta(768),
    }
    sd.update(
        {
            f"visual.transformer.resblocks.{i}.attn.in_proj_weight": meta(3072, 1024)
            for i in range(24)
        }
    )
    sd.update(
        {f"transformer.resblocks.{i}.attn.in_proj_weight": meta(2304, 768) for i in range(12)}
    )
    cfg = infer_config(sd)  # ViT-L/14@336px
    assert cfg == dict(
        embed_dim=768,
        image_resolution=336,
        vision_layers=24,
        vision_width=1024,
        vision_patch_size=14,
        context_length=77,
        vocab_size=49408,
        transformer_width=768,
        transformer_heads=12,
        transformer_layers=12,
        vision_heads=16,
    )
    with pytest.raises(NotImplementedError, match="ResNet"):
        build_model(
            {
                "visual.layer1.0.conv1.weight": torch.zeros(1),
                "visual.attnpool.c_proj.weight": torch.zeros(1),
            }
        )


def test_head_counts_are_stored_or_openais_and_never_guessed():
    """A width that is none of OpenAI's needs its head count stored; a stored count must fit."""
    sd = tiny_state_dict(seed=4, vision_width=128, text_width=128)  # the toy CLIP's: 4 heads each
    assert build_model(sd).visual.heads == 4 and build_model(sd).transformer.heads == 4
    for key in ("vision_heads", "text_heads"):  # width/64 would silently give 2 heads of 64
        without = {k: v for k, v in sd.items() if k != key}
        with pytest.raises(ValueError, match=rf"no '{key}' entry.*width 128.*add '{key}': torch"):
            build_model(without)
    bad_counts = (
        torch.tensor(3),
        torch.tensor(0),
        torch.tensor([4]),
        torch.tensor(2.5),
        torch.tensor(True),
    )  # 3 does not divide 128; the others are no count of heads
    for bad in bad_counts:
        with pytest.raises(ValueError, match="'vision_heads'"):
            build_model({**sd, "vision_heads": bad})
    assert build_model({**sd, "vision_heads": torch.tensor(8)}).visual.heads == 8  # stored, fits
    # OpenAI's published widths keep OpenAI's rule, heads of 64, with nothing stored (and ViT-B/16,
    # L/14@336px in the tests below)
    meta = lambda *s: torch.empty(*s, device="meta")
    cfg = infer_config(
        {
            "visual.proj": meta(768, 512),
            "visual.conv1.weight": meta(768, 3, 32, 32),
            "visual.positional_embedding": meta(50, 768),
            "text_projection": meta(512, 512),
            "positional_embedding": meta(77, 512),
            "token_embedding.weight": meta(49408, 512),
            "ln_final.weight": meta(512),
        }
    )  # ViT-B/32
    assert (cfg["vision_heads"], cfg["transformer_heads"]) == (12, 8)


def _vit_b16_state_dict():
    """Random tensors under exactly the keys and shapes of OpenAI's ViT-B/16 checkpoint."""
    pool = torch.randn(26_000_000, generator=torch.Generator().manual_seed(0)) * 0.02
    offsets = iter(range(0, 10**9, 104_729))

    def r(
        *shape,
    ):  # random values as views into one pool (150M fresh normals would be slow to draw)
        n = torch.Size(shape).numel()
        start = next(offsets) % (pool.numel() - n + 1)
        return pool[start : start + n].view(shape)

    sd = {
        "positional_embedding": r(77, 512),
        "text_projection": r(512, 512),
        "logit_scale": torch.tensor(4.6052),
        "token_embedding.weight": r(49408, 512),
        "ln_final.weight": torch.ones(512),
        "ln_final.bias": r(512),
        "visual.class_embedding": r(768),
        "visual.positional_embedding": r(197, 768),
        "visual.proj": r(768, 512),
        "visual.conv1.weight": r(768, 3, 16, 16),
        "visual.ln_pre.weight": torch.ones(768),
        "visual.ln_pre.bias": r(768),
        "visual.ln_post.weight": torch.ones(768),
        "visual.ln_post.bias": r(768),
    }
    for prefix, D in (("transformer", 512), ("visual.transformer", 768)):
        for i in range(12):
            p = f"{prefix}.resblocks.{i}."
            sd.update(
                {
                    p + "attn.in_proj_weight": r(3 * D, D),
                    p + "attn.in_proj_bias": r(3 * D),
                    p + "attn.out_proj.weight": r(D, D),
                    p + "attn.out_proj.bias": r(D),
                    p + "ln_1.weight": torch.ones(D),
                    p + "ln_1.bias": r(D),
                    p + "mlp.c_fc.weight": r(4 * D, D),
                    p + "mlp.c_fc.bias": r(4 * D),
                    p + "mlp.c_proj.weight": r(D, 4 * D),
                    p + "mlp.c_proj.bias": r(D),
                    p + "ln_2.weight": torch.ones(D),
                    p + "ln_2.bias": r(D),
                }
            )
    return sd


def test_vit_b16_sized_state_dict_loads_strictly_and_runs():
    sd = _vit_b16_state_dict()
    assert len(sd) == 302
    model = build_model(sd)
    assert sum(p.numel() for p in model.parameters()) == 149_620_737
    v = model.visual
    assert (v.input_resolution, v.patch_size, v.width, v.layers, v.heads) == (224, 16, 768, 12, 12)
    assert (model.transformer.heads, model.transformer.layers, model.context_length) == (8, 12, 77)
    with torch.no_grad():
        img = model.encode_image(_images(1, 224))
        txt = model.encode_text(clip.tokenize([f"a photo of a number {i}." for i in range(10)]))
    assert img.shape == (1, 512) and txt.shape == (10, 512)
    assert torch.isfinite(img).all() and torch.isfinite(txt).all()


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_known_ids_padding_and_dtype():
    # ids read off the merges file by hand: id = 512 + (line number of the merge - 1), e.g. "c
    # at</w>" -> 2368; byte symbols: "a</w>" = 256 + (ord("a") - 33) = 320, ".</w>" = 269
    t = clip.tokenize(["a photo of a cat.", "Hello   World!"])
    assert t.shape == (2, 77) and t.dtype == torch.int32
    assert t[0, :8].tolist() == [49406, 320, 1125, 539, 320, 2368, 269, 49407]
    assert t[1, :5].tolist() == [49406, 3306, 1002, 256, 49407]  # lower-cased, whitespace collapsed
    assert t[0, 8:].eq(0).all() and t[1, 5:].eq(0).all()
    tok = get_tokenizer()
    assert len(tok.encoder) == 49408
    # a word with no whole-word merge: only "b n" applies (rank 9984), z x q v stay single bytes
    assert tok.encode("zxqvbnm") == [89, 87, 80, 85, 10496, 332]
    assert tok.encode("don't") == [847, 713]  # contraction split off
    assert tok.decode(tok.encode("A photo of a CAT.")) == "a photo of a cat . "


def test_tokenizer_unicode_and_html():
    tok = get_tokenizer()
    assert tok.encode("fish &amp; chips") == tok.encode("fish & chips") == [2759, 261, 8855]
    # ftfy unescapes ...
    assert tok.encode("fish &amp;amp;amp; chips") == tok.encode("fish & chips")
    # ... but not beside "<": unescape twice
    assert tok.encode("x < y &amp;amp; z") == tok.encode("x < y & z")
    assert tok.encode("café") == [15304]  # UTF-8 bytes of é are symbols "Ã©"
    assert tok.encode("cafÃ©") == tok.encode("café")  # ftfy repairs mojibake
    assert tok.decode(tok.encode("naïve 東京 ❤")) == "naïve 東京 ❤ "  # any text round-trips
    assert tok.encode("a\n\tphoto") == tok.encode("a photo")


def test_tokenize_too_long_raises_or_truncates():
    fits = " ".join(["a"] * 75)  # 75 words + SOT + EOT = 77
    assert clip.tokenize(fits)[0, -1] == 49407
    too_long = " ".join(["a"] * 76)
    with pytest.raises(ValueError, match="context length 77.*truncate=True"):
        clip.tokenize(too_long)
    t = clip.tokenize(too_long, truncate=True)
    assert (
        t.shape == (1, 77) and t[0, 0] == 49406 and t[0, -1] == 49407 and (t[0, 1:-1] == 320).all()
    )
    assert clip.tokenize("a cat", context_length=5)[0].tolist() == [49406, 320, 2368, 49407, 0]


# ---------------------------------------------------------------- loading and downloading


class _Archive(nn.Module):
    """Holds a CLIP's weights under the same names plus the JIT extras,
    the way OpenAI's archives do."""

    def __init__(self, model):
        super().__init__()
        for name, child in model.named_children():
            setattr(self, name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for key, value in (("input_resolution", 32), ("context_length", 77), ("vocab_size", 49408)):
            self.register_buffer(key, torch.tensor(value))
        # width 64 is none of OpenAI's: the archive stores its head counts, as tiny checkpoints do
        self.register_buffer("vision_heads", torch.tensor(model.visual.heads))
        self.register_buffer("text_heads", torch.tensor(model.transformer.heads))

    def forward(self, x):
        return x * self.logit_scale.exp()


def test_load_torchscript_archive_and_plain_state_dicts(tmp_path):
    ref = tiny_clip(seed=5)
    archive = torch.jit.trace(_Archive(tiny_clip(seed=5)).half(), torch.ones(2, dtype=torch.half))
    archive.save(str(tmp_path / "archive.pt"))  # fp16 weights, as published
    sd = tiny_state_dict(seed=5)
    torch.save(sd, tmp_path / "plain.pt")
    torch.save({"state_dict": sd, "epoch": 3}, tmp_path / "wrapped.pt")
    images, tokens = _images(), clip.tokenize(["a cat"])

    m, preprocess = clip.load(str(tmp_path / "archive.pt"), device="cpu")
    assert m.visual.conv1.weight.dtype == torch.float32 and not m.training
    for k, v in ref.state_dict().items():  # the fp16-rounded weights of the reference
        assert torch.equal(m.state_dict()[k], v.half().float()), k
    assert m.sha256 == hashlib.sha256((tmp_path / "archive.pt").read_bytes()).hexdigest()
    heads = (ref.visual.heads, ref.transformer.heads)
    assert (m.visual.heads, m.transformer.heads) == heads == (4, 4)

    for name in ("plain.pt", "wrapped.pt"):
        m, _ = clip.load(str(tmp_path / name), device="cpu")
        assert m.name == str(tmp_path / name)
        with torch.no_grad():
            assert torch.equal(m.encode_image(images), ref.encode_image(images))
            assert torch.equal(m.encode_text(tokens), ref.encode_text(tokens))

    from PIL import Image

    x = preprocess(Image.new("L", (64, 48), color=128))  # grey, non-square, one channel
    assert x.shape == (3, 32, 32)
    assert torch.allclose(
        x[:, 0, 0], (128 / 255 - torch.tensor(clip.MEAN)) / torch.tensor(clip.STD), atol=1e-3
    )


def test_load_rejects_corrupt_files_and_unknown_names(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ValueError, match="neither a TorchScript archive nor a state dict"):
        clip.load(str(bad), device="cpu")
    torch.save({"visual.proj": torch.zeros(2, 2)}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match="not a complete CLIP checkpoint"):
        clip.load(str(tmp_path / "partial.pt"), device="cpu")
    with pytest.raises(ValueError, match="not found.*ViT-B/16"):
        clip.load("ViT-H/99", device="cpu")


@pytest.fixture
def server(tmp_path):
    """An http.server on 127.0.0.1 serving tmp_path/www; `server.hits` counts the GET requests."""
    www = tmp_path / "www"
    www.mkdir()
    hits = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(www), **kw)

        def do_GET(self):
            hits.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # a short poll: shutdown() waits for the loop to look (0.5 s by default, per test)
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
    )
    thread.start()
    yield types.SimpleNamespace(
        www=www, hits=hits, url=f"http://127.0.0.1:{httpd.server_address[1]}"
    )
    httpd.shutdown()
    httpd.server_close()


def _publish(server, data, sha=None):
    sha = sha or hashlib.sha256(data).hexdigest()
    (server.www / sha).mkdir()
    (server.www / sha / "ViT-T-8.pt").write_bytes(data)
    return f"{server.url}/{sha}/ViT-T-8.pt", hashlib.sha256(data).hexdigest()


def test_download_checks_sha_caches_and_refetches(tmp_path, server, monkeypatch):
    torch.save(tiny_state_dict(seed=2), tmp_path / "ckpt.pt")
    data = (tmp_path / "ckpt.pt").read_bytes()
    url, sha = _publish(server, data)
    monkeypatch.setattr(clip, "MODELS", {"ViT-T/8": url})
    cache = tmp_path / "cache"

    m, _ = clip.load("ViT-T/8", device="cpu", download_root=str(cache))
    assert (m.name, m.sha256, len(server.hits)) == ("ViT-T/8", sha, 1)
    assert os.listdir(cache) == ["ViT-T-8.pt"]  # no temporary files left
    clip.load("ViT-T/8", device="cpu", download_root=str(cache))
    assert len(server.hits) == 1  # served from the cache

    (cache / "ViT-T-8.pt").write_bytes(b"damaged")  # a cached file with the wrong checksum ...
    clip.load("ViT-T/8", device="cpu", download_root=str(cache))
    assert len(server.hits) == 2  # ... is fetched again
    assert (cache / "ViT-T-8.pt").read_bytes() == data

    # a local copy of a published file is recognised by its checksum
    assert clip.load(str(tmp_path / "ckpt.pt"), device="cpu")[0].name == "ViT-T/8"


def test_download_mismatch_and_failure_raise_and_keep_nothing(tmp_path, server, monkeypatch):
    wrong = "0" * 64
    url, actual = _publish(server, b"some other bytes", sha=wrong)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError) as e:
        clip.download(url, str(cache))
    assert url in str(e.value) and wrong in str(e.value) and actual in str(e.value)
    assert os.listdir(cache) == []
    missing = f"{server.url}/{'1' * 64}/nothing.pt"
    with pytest.raises(RuntimeError, match="download of .*nothing.pt failed"):
        clip.download(missing, str(cache))
    assert os.listdir(cache) == []


def test_download_to_a_full_or_unusable_cache_names_the_file_and_the_fix(
    tmp_path, server, monkeypatch
):
    url, _ = _publish(server, b"x" * 3 * 2**20)
    cache = tmp_path / "cache"

    def full(response, out, hasher, name):  # the disk fills after the first MiB
        out.write(response.read(2**20))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(clip, "stream", full)
    with pytest.raises(RuntimeError) as e:
        clip.download(url, str(cache))
    msg = str(e.value)
    assert f"cannot write {cache / 'ViT-T-8.pt'}: No space left on device (it needs 3.0 MiB" in msg
    assert "CLIP_CACHE" in msg and "network" not in msg and os.listdir(cache) == []
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RuntimeError, match=r"cache .*a_file/x cannot be created .*set CLIP_CACHE"):
        clip.download(url, str(tmp_path / "a_file" / "x"))


def test_cache_dir_and_available_models(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "env"))
    assert clip.cache_dir() == str(tmp_path / "env")
    assert clip.cache_dir(str(tmp_path / "root")) == str(tmp_path / "root")
    monkeypatch.delenv("CLIP_CACHE")
    assert clip.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "clip")
    assert clip.available_models() == [
        "ViT-B/32",
        "ViT-B/16",
        "ViT-L/14",
        "ViT-L/14@336px",
    ]  # OpenAI's, no "toy"


# -------------------------------------------------------------- exact savings: rows and shared past


def _block_and_input(seed=0, B=2, L=9, D=64, H=4):
    torch.manual_seed(seed)
    block = tiny_clip().visual.transformer.resblocks[0]
    x = torch.randn(B, L, D, requires_grad=True)
    return block, x


def test_rows_equal_the_full_block_read_at_those_rows():
    """rows: the block computes only some output positions; outputs and input gradients equal the
    full block read at those rows, with a per-head mask whose rows differ (each row must get its own
    mask row)."""
    block, x = _block_and_input()
    H, L = 4, x.shape[1]
    torch.manual_seed(1)
    blocked = torch.rand(H, L, L) < 0.5
    blocked[:, torch.arange(L), torch.arange(L)] = False  # every position sees itself
    mask = torch.zeros(H, L, L).masked_fill(blocked, float("-inf"))
    for rows in (slice(0, 3), slice(L - 1, None), torch.tensor([4, 1, 7])):
        full = block(x, attn_mask=mask)[:, rows]  # [B, R, D]
        part = block(x, attn_mask=mask, rows=rows)
        assert part.shape == full.shape
        assert torch.allclose(part, full, atol=1e-6)
        w = torch.randn_like(full)
        (g_full,) = torch.autograd.grad((full * w).sum(), x)
        (g_part,) = torch.autograd.grad((part * w).sum(), x)
        assert torch.allclose(g_part, g_full, atol=1e-6)
    # through the Transformer and the towers: only the last block is cut
    m = tiny_clip()
    tokens = m.visual.embed(_images())
    with torch.no_grad():
        full = m.visual.run_blocks(tokens, 0, 4)
    assert torch.allclose(
        m.visual.run_blocks(tokens, 0, 4, rows=slice(0, 1)), full[:, :1], atol=1e-6
    )
    # no block: a cut
    assert torch.allclose(m.visual.run_blocks(tokens, 1, 1, rows=slice(0, 2)), tokens[:, :2])


def test_past_equals_running_the_whole_sequence():
    """A text block on a suffix that attends to shared past positions equals the block on
    [past, suffix] under the causal mask, read after the past; gradients reach the past through its
    keys and values."""
    m = tiny_clip(text_layers=2)
    torch.manual_seed(2)
    past = torch.randn(1, 4, 64, requires_grad=True)  # shared by every text
    suffix = torch.randn(3, 5, 64, requires_grad=True)  # [C, n, W]
    whole = torch.cat([past.expand(3, -1, -1), suffix], dim=1)  # [C, 4 + 5, W]
    ref = m.transformer.resblocks[1](whole, attn_mask=torch.full((9, 9), float("-inf")).triu(1))[
        :, 4:
    ]
    out = m.run_text_blocks(suffix, 1, 2, past=past)
    assert torch.allclose(out, ref, atol=1e-6)
    # only the last position
    last = m.run_text_blocks(suffix, 1, 2, past=past, rows=slice(-1, None))
    assert torch.allclose(last, ref[:, -1:], atol=1e-6)
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), (past, suffix))
    g_out = torch.autograd.grad((out * w).sum(), (past, suffix))
    for a, b in zip(g_out, g_ref):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="one block"):
        m.run_text_blocks(suffix, 0, 2, past=past)


@pytest.mark.parametrize("group_cost", [0, 10**6])
def test_encode_text_groups_by_length_and_keeps_the_order(group_cost, monkeypatch):
    """Prompts of several lengths come back in their own order and equal the plain reference
    computed on the padded tokens: one group per length (group cost 0), and one group padded to the
    longest whose EOTs sit at three positions (a large group cost; each text must be read at its own
    EOT)."""
    monkeypatch.setitem(clip.model.GROUP_COST, "cpu", group_cost)
    m = tiny_clip()
    sd = m.state_dict()
    texts = [
        "a photo of a big red fox standing.",
        "cat",
        "a photo of a dog.",
        "two",
        "a photo of a cow.",
    ]
    tokens = clip.tokenize(texts)
    assert len(set(tokens.argmax(-1).tolist())) == 3  # three lengths
    assert len(clip.model.length_buckets(tokens.argmax(-1))) == (3 if group_cost == 0 else 1)
    with torch.no_grad():
        ours = m.encode_text(tokens)
        ref = ref_encode_text(sd, tokens, 2, 4)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_length_buckets_pick_the_cheapest_split():
    """Ten texts with EOT at 3, one at 4, ten at 20. Cost = texts x (longest EOT + 1) + group cost,
    by hand: group cost 32: {3},{4},{20} = 40 + 5 + 210 + 96 = 351; {3,4},{20} = 55 + 210 + 64 = 329
    (cheapest); {3},{4,20} = 40 + 231 + 64 = 335; {3,4,20} = 441 + 32 = 473. Group cost 0: one group
    per length; a huge one: a single group."""
    eot = torch.tensor([3] * 10 + [4] + [20] * 10)[
        torch.randperm(21, generator=torch.Generator().manual_seed(0))
    ]
    split = lambda cost: [
        (n, sorted(eot[idx].tolist())) for n, idx, _, _ in clip.model.length_buckets(eot, cost)
    ]
    assert split(0) == [(3, [3] * 10), (4, [4]), (20, [20] * 10)]
    assert split(32) == [(4, [3] * 10 + [4]), (20, [20] * 10)]
    assert split(10**6) == [(20, [3] * 10 + [4] + [20] * 10)]
    groups = clip.model.length_buckets(eot, 32)
    n, idx, rows, pick = groups[0]
    assert rows.tolist() == [3, 4] and torch.equal(rows[pick], eot[idx])  # each text's own EOT row
    # every text once
    assert sorted(torch.cat([idx for _, idx, _, _ in groups]).tolist()) == list(range(21))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_build_model_copies_never_aliases_the_state_dict(dtype):
    """build_model's parameters are copies: no storage shared with the caller's tensors (fp32 ones
    included, where a plain .to(float32) would return the very tensor), so changing either side
    leaves the other as is."""
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tiny_state_dict().items()}
    kept = {k: v.clone() for k, v in sd.items()}
    model = build_model(sd)
    ptrs = {v.data_ptr() for v in sd.values()}
    assert all(t.data_ptr() not in ptrs for t in list(model.parameters()) + list(model.buffers()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(sd[k], kept[k]) for k in sd)  # the caller's dict is untouched
    sd["visual.proj"].zero_()
    assert model.visual.proj.abs().sum() > 0  # nor does the model see the caller's later changes


def test_preprocess_equals_openais_torchvision_pipeline():
    """clip.load's preprocess is OpenAI's _transform (torchvision's Resize(n, bicubic),
    CenterCrop(n), RGB, ToTensor, Normalize) written with PIL and torch: bit for bit on noise images
    whose resized side truncates (44x40 -> 35.2 -> 35, not 36) and whose crop margin is odd
    (round(1.5) = 2), in RGB, L and RGBA (converted to RGB after the crop, as OpenAI's order)."""
    from PIL import Image
    from torchvision import transforms as TV

    openai = TV.Compose(
        [
            TV.Resize(32, interpolation=TV.InterpolationMode.BICUBIC),
            TV.CenterCrop(32),
            lambda image: image.convert("RGB"),
            TV.ToTensor(),
            TV.Normalize(clip.MEAN, clip.STD),
        ]
    )
    for w, h in ((44, 40), (40, 61), (32, 32)):
        pixels = np.random.default_rng(w + h).integers(0, 256, (h, w, 4), dtype=np.uint8)
        for mode in ("RGB", "L", "RGBA"):
            image = Image.fromarray(pixels, "RGBA").convert(mode)
            assert torch.equal(clip.transform(32)(image), openai(image)), (w, h, mode)


def test_loading_and_preprocessing_import_neither_torchvision_nor_dynamo(tmp_path):
    """Start-up cost: in a fresh process, clip.load of a checkpoint, its preprocess and data.py's
    pipelines import neither torchvision (its import loads torch._dynamo, as much CPU as torch's)
    nor torch._dynamo (random draws on the meta device load it: build_model builds shapes only).
    Planted: CLIP(**config) without init=False in build_model; a torchvision import in clip."""
    path = tmp_path / "tiny.pt"
    torch.save(tiny_state_dict(), path)
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from PIL import Image\n"
        "import clip, data\n"
        f"model, preprocess = clip.load({str(path)!r}, device='cpu')\n"
        "image = Image.fromarray(np.zeros((40, 50, 3), np.uint8))\n"
        "x = preprocess(image)[None]\n"
        "data.train_transform(32)(image), data.test_transform(32)(image)\n"
        "model.encode_image(x)\n"
        "print(sorted(m for m in ('torchvision', 'torch._dynamo') if m in sys.modules))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", p.stdout

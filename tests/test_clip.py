"""Tests of the vendored CLIP: model math, seams, tokenizer, checkpoint loading and downloading."""

import hashlib
import os

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

import clip
import clip.model
import clip.tokenizer
import runs
from clip.model import MultiheadAttention, build_model, length_buckets
from conftest import tiny_clip, tiny_state_dict

# ---------------------------------------------------------------- a plain reference CLIP
# OpenAI's layout ([L, N, D]) with torch.nn.MultiheadAttention, fed the same state dict; it shares
# no code with clip/model.py.

def ref_transformer(x, sd, prefix, layers, heads, mask=None):
    ln = lambda t, name: F.layer_norm(t, t.shape[-1:], sd[name + ".weight"], sd[name + ".bias"])
    for i in range(layers):
        p = f"{prefix}.resblocks.{i}."
        mha = nn.MultiheadAttention(x.shape[-1], heads)
        mha.load_state_dict({k: sd[p + "attn." + k] for k in mha.state_dict()})
        h = ln(x, p + "ln_1")
        x = x + mha(h, h, h, need_weights=False, attn_mask=mask)[0]
        h = F.linear(ln(x, p + "ln_2"), sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])
        x = x + F.linear(h * torch.sigmoid(1.702 * h), sd[p + "mlp.c_proj.weight"],
                         sd[p + "mlp.c_proj.bias"])
    return x


def ref_encode_image(sd, images, layers=4, heads=4):
    w = sd["visual.conv1.weight"]
    x = F.conv2d(images, w, stride=w.shape[-1]).flatten(2).permute(0, 2, 1)  # [N, P, D]
    x = torch.cat([sd["visual.class_embedding"].expand(x.shape[0], 1, -1), x], dim=1)
    x = x + sd["visual.positional_embedding"]
    x = F.layer_norm(x, x.shape[-1:], sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    x = ref_transformer(x.permute(1, 0, 2), sd, "visual.transformer", layers, heads)  # via LND
    x = F.layer_norm(x[0], x.shape[-1:], sd["visual.ln_post.weight"], sd["visual.ln_post.bias"])
    return x @ sd["visual.proj"]


def ref_encode_text(sd, tokens, layers=2, heads=4):
    n = tokens.shape[1]
    x = sd["token_embedding.weight"][tokens.long()] + sd["positional_embedding"][:n]
    mask = torch.full((n, n), float("-inf")).triu(1)
    x = ref_transformer(x.permute(1, 0, 2), sd, "transformer", layers, heads, mask).permute(1, 0, 2)
    x = F.layer_norm(x, x.shape[-1:], sd["ln_final.weight"], sd["ln_final.bias"])
    return x[torch.arange(x.shape[0]), tokens.argmax(-1)] @ sd["text_projection"]


IMAGES = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
TEXTS = ["a photo of a big red fox standing.", "cat", "a photo of a dog.", "", "a photo of a cow."]


# ---------------------------------------------------------------- model

# one group per prompt length; one group padded to the longest
@pytest.mark.parametrize("group_cost", [0, 10**6])
def test_features_equal_the_plain_reference(group_cost, monkeypatch):
    monkeypatch.setitem(clip.model.GROUP_COST, "cpu", group_cost)
    g = torch.Generator().manual_seed(3)  # LN gains
    sd = {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.dim() == 1 else v
          for k, v in tiny_state_dict(seed=3).items()}
    model, tokens = build_model(sd), clip.tokenize(TEXTS)
    tokens[3, :6] = torch.tensor([49406, 0, 0, 320, 0, 49407])  # "!" (id 0) inside: EOT = argmax
    norm = lambda *fs: [F.normalize(f, dim=-1) for f in fs]
    with torch.no_grad():
        ours_i, ours_t = norm(model.encode_image(IMAGES), model.encode_text(tokens))
        ref_i, ref_t = norm(ref_encode_image(sd, IMAGES), ref_encode_text(sd, tokens))
        logits, logits_t = model(IMAGES, tokens)
    assert (ours_i - ref_i).abs().max() < 1e-5 and (ours_t - ref_t).abs().max() < 1e-5
    assert torch.allclose(logits, model.logit_scale.exp() * ref_i @ ref_t.t(), atol=1e-4)
    assert torch.equal(logits_t, logits.t())


@pytest.mark.parametrize("shape", ["LL", "HLL", "BHLL"])
def test_masked_attention_equals_explicit_per_head_softmax(shape):
    """Per head h: softmax(Q_h K_h^T / sqrt(d) + mask[:, h]) V_h, heads concatenated, then
    out_proj; the mask broadcast from any of its shapes."""
    torch.manual_seed(0)
    B, H, L, D, d = 3, 4, 7, 32, 8  # d: a head's width
    attn, x = MultiheadAttention(D, H), torch.randn(B, L, D)
    mask = torch.randn([{"L": L, "H": H, "B": B}[c] for c in shape])
    mask = mask.masked_fill(torch.rand(mask.shape) < 0.3,
                            float("-inf")).masked_fill(torch.eye(L, dtype=bool), 0.0)
    full = mask.expand(B, H, L, L)
    (Wq, Wk, Wv), (bq, bk, bv) = attn.in_proj_weight.split(D), attn.in_proj_bias.split(D)
    outs, weights = [], []  # [B, L, d], [B, L, L] per head
    for h in range(H):
        r = slice(h * d, (h + 1) * d)
        q, k, v = x @ Wq[r].t() + bq[r], x @ Wk[r].t() + bk[r], x @ Wv[r].t() + bv[r]
        weights.append(torch.softmax(q @ k.transpose(1, 2) / d**0.5 + full[:, h], dim=-1))
        outs.append(weights[-1] @ v)
    expected, expected_w = attn.out_proj(torch.cat(outs, dim=-1)), torch.stack(weights, dim=1)
    out, w = attn(x, attn_mask=mask, need_weights=True)
    assert torch.allclose(attn(x, attn_mask=mask), expected, atol=1e-5)  # the fused path
    assert torch.allclose(out, expected, atol=1e-5) and torch.allclose(w, expected_w, atol=1e-6)
    assert torch.isinf(full).any() and torch.all(w[torch.isinf(full)] == 0)


def test_seams_rows_and_past_compose_to_the_full_computation():
    m, _ = tiny_clip(), torch.manual_seed(0)
    block, L, H = m.visual.transformer.resblocks[0], 9, 4
    x = torch.randn(2, L, 64, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(H, L, L).masked_fill(torch.rand(H, L, L) < 0.5, float("-inf"))
    mask[:, range(L), range(L)] = 0.0  # a mask per head and row; each position sees itself
    with torch.no_grad():
        for rows in (slice(0, 3), slice(L - 1, None), torch.tensor([4, 1, 7])):
            assert torch.allclose(block(x, attn_mask=mask, rows=rows),
                                  block(x, attn_mask=mask)[:, rows], atol=1e-6)
        v, tokens = m.visual, m.visual.embed(IMAGES)
        assert tokens.shape == (2, 1 + v.num_patches, 64)
        full = v.run_blocks(tokens, 0, 4)
        for k in range(5):
            assert torch.allclose(v.run_blocks(v.run_blocks(tokens, 0, k), k, 4), full, atol=1e-6)
        assert torch.allclose(m.encode_image(IMAGES), v.head(full[:, 0]), atol=1e-6)
        assert torch.allclose(v.run_blocks(tokens, 0, 4, rows=slice(0, 1)), full[:, :1], atol=1e-6)
        assert torch.equal(v.run_blocks(tokens, 1, 1, rows=slice(0, 2)), tokens[:, :2])  # no block
        # past: a text block on a suffix after 4 positions all texts share = it on [past, suffix]
        past, suffix = x[:1, :4], x[:, 4:]
        whole = torch.cat([past.expand(2, -1, -1), suffix], dim=1)
        whole = m.transformer.resblocks[1](whole, attn_mask=m.causal_mask(L))[:, 4:]
        assert torch.allclose(m.run_text_blocks(suffix, 1, 2, past=past), whole, atol=1e-6)
        last = m.run_text_blocks(suffix, 1, 2, rows=slice(-1, None), past=past)
        assert torch.allclose(last, whole[:, -1:], atol=1e-6)
        text = clip.tokenize(["a photo of a cat.", "two dogs"])
        t = m.run_text_blocks(m.run_text_blocks(m.embed_text(text), 0, 1), 1, 2)
        assert torch.allclose(m.encode_text(text), m.text_head(t, text.argmax(-1)), atol=1e-5)


def test_length_buckets_cover_every_prompt_once_with_its_eot():
    """Ten texts with EOT at 3, one at 4, ten at 20; cost = texts x (longest EOT + 1) + group
    cost, by hand for group cost 32: {3},{4},{20} = 351; {3,4},{20} = 55 + 210 + 64 = 329
    (cheapest); {3},{4,20} = 335."""
    perm = torch.randperm(21, generator=torch.Generator().manual_seed(0))
    eot = torch.tensor([3] * 10 + [4] + [20] * 10)[perm]
    for cost, split in ((0, [[3], [4], [20]]), (32, [[3, 4], [20]]), (10**6, [[3, 4, 20]])):
        groups = length_buckets(eot, cost)
        assert [rows.tolist() for _, _, rows, _ in groups] == split
        assert sorted(torch.cat([idx for _, idx, _, _ in groups]).tolist()) == list(range(21))
        for n, idx, rows, pick in groups:
            assert torch.equal(rows[pick], eot[idx]) and n == eot[idx].max()  # each at its EOT


def test_state_dicts_load_strictly_as_copies_and_resnets_are_refused():
    model = build_model(sd := tiny_state_dict())
    weights = {k: v.clone() for k, v in sd.items() if k not in ("vision_heads", "text_heads")}
    assert model.state_dict().keys() == weights.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    with torch.no_grad():
        model.visual.proj.add_(1.0)
    assert torch.equal(sd["visual.proj"], weights["visual.proj"])  # a copy: caller's unchanged
    with pytest.raises(RuntimeError, match="Unexpected key"):
        build_model({**sd, "visual.extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="Missing key"):
        build_model({k: v for k, v in sd.items() if k != "visual.ln_pre.bias"})
    msg = "DeAR needs attention heads: ResNet CLIPs are not supported"
    with pytest.raises(ValueError, match=msg):
        build_model({"visual.layer1.0.conv1.weight": torch.zeros(1),
                     "visual.attnpool.c_proj.weight": torch.zeros(1)})


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_known_ids_and_a_tampered_vocabulary_is_refused(tmp_path):
    # ids read off the merges file: id = 512 + (line number - 1) for a merge, e.g. "c at</w>" ->
    # 2368; byte symbols: "a</w>" = 256 + (ord("a") - 33) = 320, ".</w>" = 269
    t = clip.tokenize(["a photo of a cat.", "Hello   World!"])
    assert t.shape == (2, 77) and t.dtype == torch.int32
    assert t[0, :9].tolist() == [49406, 320, 1125, 539, 320, 2368, 269, 49407, 0]
    assert t[1, :6].tolist() == [49406, 3306, 1002, 256, 49407, 0]  # lower-cased, spaces collapsed
    tok = clip.tokenizer.get_tokenizer()
    assert tok.encode("zxqvbnm") == [89, 87, 80, 85, 10496, 332]  # only "b n" merges (rank 9984)
    assert tok.encode("don't") == [847, 713] and tok.encode("café") == [15304]
    assert tok.encode("fish &amp;amp; chips") == tok.encode("fish & chips") == [2759, 261, 8855]
    assert tok.decode(tok.encode("A photo of a CAT.")) == "a photo of a cat . "
    data = bytearray(open(clip.tokenizer.VOCAB_PATH, "rb").read())
    want = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"
    assert hashlib.sha256(data).hexdigest() == want
    data[-1] ^= 1
    (tmp_path / "vocab.txt.gz").write_bytes(data)
    with pytest.raises(ValueError, match="not CLIP's vocabulary"):
        clip.tokenizer.SimpleTokenizer(str(tmp_path / "vocab.txt.gz"))


# ---------------------------------------------------------------- loading and downloading

class Archive(nn.Module):
    """A CLIP's weights under the same names plus the extras of OpenAI's TorchScript archives."""

    def __init__(self, model):
        super().__init__()
        for name, value in [*model.named_children(), *model.named_parameters(recurse=False)]:
            setattr(self, name, value)  # a submodule or a parameter
        for key, value in (("input_resolution", 32), ("context_length", 77), ("vocab_size", 49408),
                           ("vision_heads", 4), ("text_heads", 4)):
            self.register_buffer(key, torch.tensor(value))

    def forward(self, x):
        return x * self.logit_scale.exp()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")  # deprecated; how OpenAI made its archives
def test_torchscript_archives_and_plain_state_dicts_load_the_same_weights(tmp_path):
    archive = torch.jit.trace(Archive(tiny_clip(seed=5)).half(), torch.ones(2, dtype=torch.half))
    archive.save(str(tmp_path / "archive.pt"))  # fp16 weights, as published
    sd = {k: v.half() if v.is_floating_point() else v for k, v in tiny_state_dict(seed=5).items()}
    torch.save(sd, tmp_path / "plain.pt")  # the same fp16 weights
    a, preprocess = clip.load(str(tmp_path / "archive.pt"))
    p, _ = clip.load(str(tmp_path / "plain.pt"))
    assert a.state_dict().keys() == p.state_dict().keys() and not a.training
    assert all(v.dtype == torch.float32 and torch.equal(v, p.state_dict()[k]) for k,
               v in a.state_dict().items())
    assert a.sha256 == hashlib.sha256((tmp_path / "archive.pt").read_bytes()).hexdigest()
    assert (a.name, a.visual.heads, a.transformer.heads) == (str(tmp_path / "archive.pt"), 4, 4)
    # preprocess: a uniform non-square image -> [3, 32, 32], each channel (v / 255 - MEAN) / STD
    x = preprocess(Image.new("RGB", (64, 48), color=(10, 128, 240)))
    want = (torch.tensor([10, 128, 240]) / 255 - torch.tensor(clip.MEAN)) / torch.tensor(clip.STD)
    assert x.shape == (3, 32, 32) and torch.allclose(x, want[:, None, None].expand_as(x), atol=1e-5)
    assert clip.available_models() == ["ViT-B/32", "ViT-B/16", "ViT-L/14", "ViT-L/14@336px"]
    with pytest.raises(FileNotFoundError, match="ViT-B/16"):
        clip.load("ViT-H/99")


def test_download_checks_the_sha256_of_its_url_and_the_cache_dir(tmp_path, server, monkeypatch):
    routes, url = server  # conftest's local HTTP server: routes[path] = the body served
    torch.save(tiny_state_dict(seed=2), tmp_path / "ckpt.pt")
    data = (tmp_path / "ckpt.pt").read_bytes()
    sha, cache = hashlib.sha256(data).hexdigest(), tmp_path / "cache"
    # ViT-W/8: a URL whose SHA256 is not the file's
    urls = {"ViT-T/8": f"/{sha}/ViT-T-8.pt", "ViT-W/8": f"/{'0' * 64}/ViT-T-8.pt"}
    routes.update(dict.fromkeys(urls.values(), data))
    monkeypatch.setattr(clip, "MODELS", {name: url + path for name, path in urls.items()})
    m, _ = clip.load("ViT-T/8", download_root=str(cache))
    assert (m.name, m.sha256, os.listdir(cache)) == ("ViT-T/8", sha, ["ViT-T-8.pt"])
    del routes[urls["ViT-T/8"]]
    assert clip.load("ViT-T/8", download_root=str(cache))[0].sha256 == sha  # from the cache
    (cache / "ViT-T-8.pt").write_bytes(data[:-1] + b"x")  # corrupt: refused, not reused
    with pytest.raises(OSError, match="not the SHA256"):
        clip.load("ViT-T/8", download_root=str(cache))
    os.remove(cache / "ViT-T-8.pt")
    with pytest.raises(RuntimeError, match="invalid hash value"):  # not its URL's SHA256 ...
        clip.load("ViT-W/8", download_root=str(cache))
    assert os.listdir(cache) == []  # ... is not kept
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "env"))
    with pytest.raises(runs.UserError, match=f"^{url}{urls['ViT-T/8']}: Not Found; save it in "
                       f"{tmp_path / 'env'}$"):  # offline or refused: one line, the URL
        runs.load_backbone("ViT-T/8", "cpu")
    assert clip.cache_dir(str(tmp_path / "r")) == str(tmp_path / "r")
    monkeypatch.delenv("CLIP_CACHE")
    assert clip.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "clip")

"""DeAR model, masks, loss, schedule and the run loop, on a tiny random CLIP."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_clip
import config
import data
import dear
import runs
import train
from dear import ATTRIBUTES, K, DeAR, role_mask

H, P = 4, 16  # the tiny CLIP: 4 heads per block, 32x32 images with patch 8 -> 16 patches
ORIG = [0] + list(range(1 + K, 1 + K + P))  # CLS and patches
ATTR = list(range(1, 1 + K))


def roles_all(role, attribute=None, layers=range(1, 5)):
    return {l: [{"role": role, "attribute": attribute}] * H for l in layers}


def mixed_roles():
    """Block roles with one head of each kind: generalization, color attribute, mixed,
    other specialist."""
    block = [
        {"role": "generalization", "attribute": None},
        {"role": "attribute", "attribute": "color"},
        {"role": "mixed", "attribute": None},
        {"role": "specialist", "attribute": None},
    ]
    return {l: block for l in range(1, 5)}


def attention_weights(mask, seed=0):
    """Weights [H, L, L] of a block of the tiny CLIP on random tokens, with the given mask."""
    torch.manual_seed(seed)
    block = tiny_clip(text_layers=3).visual.transformer.resblocks[0]
    x = torch.randn(1, 1 + K + P, 64)
    with torch.no_grad():
        _, w = block.attn(block.ln_1(x), attn_mask=mask, need_weights=True)
    return w[0]


def test_role_mask_semantics_on_attention_weights():
    w = attention_weights(role_mask(mixed_roles()[1], P))
    assert torch.allclose(w.sum(-1), torch.ones(H, 1 + K + P), atol=1e-6)
    g, a, m, s = w  # generalization, color attribute, mixed, other specialist
    for head in (
        g,
        s,
    ):  # originals and attribute tokens never exchange weight; attr tokens see only themselves
        assert head[ORIG][:, ATTR].abs().max() == 0
        assert head[ATTR][:, ORIG].abs().max() == 0
        assert torch.allclose(head[ATTR][:, ATTR], torch.eye(K))
    color = 1 + ATTRIBUTES.index("color")
    others = [i for i in ATTR if i != color]
    assert (a[ORIG][:, color] > 0).all() and (
        a[color][ORIG] > 0
    ).all()  # orig <-> color token, both ways
    for i in others:  # every other attribute token sees only itself and is seen by nobody else
        assert a[i, i] == pytest.approx(1.0)
        assert a[[j for j in range(1 + K + P) if j != i]][:, i].abs().max() == 0
    assert (m > 0).all()  # mixed: unrestricted


def test_mask_variants():
    roles = mixed_roles()[1]
    full = role_mask(roles, P, "role")
    gen_only = role_mask(roles, P, "generalization-only")
    # gen + specialist kept
    assert torch.equal(gen_only[0], full[0]) and torch.equal(gen_only[3], full[3])
    assert (gen_only[1] == 0).all()  # attribute head acts as mixed
    assert (role_mask(roles, P, "none") == 0).all()
    assert full.shape == (H, 1 + K + P, 1 + K + P)


def test_block_masks_one_per_block_with_the_variant():
    """block_masks: one mask per block first..L-1, each block its own roles under the given variant;
    --mask none: exactly one None per block."""
    shape = roles_all("attribute", "shape")
    roles = {l: mixed_roles()[1] if l % 2 else shape[l] for l in range(1, 5)}
    masks = dear.block_masks(roles, 1, 4, P, "generalization-only")
    assert len(masks) == 3
    for b, m in zip(range(1, 4), masks):
        assert torch.equal(m, role_mask(roles[b + 1], P, "generalization-only"))
    assert not torch.equal(masks[1], role_mask(roles[3], P, "role"))
    assert dear.block_masks(roles, 1, 4, P, "none") == [None] * 3


def test_mask_none_equals_plain_insertion():
    """--mask none and an all-mixed role table give the same features as inserting tokens with no
    mask."""
    clip_model = tiny_clip(text_layers=3)
    torch.manual_seed(0)
    a = DeAR(clip_model, roles_all("mixed"), J=2, mask="role")
    b = DeAR(clip_model, None, J=2, mask="none")
    b.load_state_dict(a.state_dict())
    images = torch.randn(2, 3, 32, 32)
    fa, fb = a.encode_images(images), b.encode_images(images)
    assert torch.allclose(fa[0], fb[0], atol=1e-6) and torch.allclose(fa[1], fb[1], atol=1e-6)
    assert all(getattr(b, f"mask_{i}") is None for i in range(3))


def test_generalization_heads_isolate_cls_from_tokens():
    """Every head a generalization head: the CLS output equals frozen CLIP's and gets no gradient
    from R."""
    clip_model = tiny_clip(text_layers=3)
    model = DeAR(clip_model, roles_all("generalization"), J=2)
    images = torch.randn(3, 3, 32, 32)
    f_cls, f_attr, f0 = model.encode_images(images, with_frozen=True)
    frozen = F.normalize(clip_model.encode_image(images), dim=-1)
    assert torch.allclose(f_cls, frozen, atol=1e-5) and torch.allclose(f0, frozen, atol=1e-5)
    assert f_cls.requires_grad
    grad = torch.autograd.grad(f_cls.sum(), model.tokens.R, allow_unused=True, retain_graph=True)[0]
    assert grad is None or grad.abs().max() == 0
    # ... while the attribute features do depend on the tokens
    assert torch.autograd.grad(f_attr.sum(), model.tokens.R)[0].abs().max() > 0


def test_attribute_head_lets_its_token_reach_cls():
    model = DeAR(tiny_clip(text_layers=3), roles_all("attribute", "color"), J=2)
    f_cls, _, _ = model.encode_images(torch.randn(2, 3, 32, 32))
    grad = torch.autograd.grad(f_cls.sum(), model.tokens.R)[0]  # [K, rep_dim]
    color = ATTRIBUTES.index("color")
    assert grad[color].abs().max() > 0
    # other tokens cannot reach CLS
    assert grad[[i for i in range(K) if i != color]].abs().max() == 0


def test_without_tokens_equals_frozen_clip():
    clip_model = tiny_clip(text_layers=3)
    model = DeAR(clip_model, None, J=3, attr_tokens=False)
    assert [p for p in model.trainable() if p.requires_grad] == []
    model.set_classes(["cat", "dog_house"], "a photo of a {}.")
    tokens = dear.clip.tokenize(["a photo of a cat.", "a photo of a dog house."])
    assert torch.allclose(
        model.encode_classes(), F.normalize(clip_model.encode_text(tokens), dim=-1), atol=1e-5
    )
    images = torch.randn(2, 3, 32, 32)
    out = model(images)
    ref = 100 * F.normalize(clip_model.encode_image(images), dim=-1) @ model.t0.t()
    assert torch.allclose(out["fused"], ref * clip_model.logit_scale.exp() / 100, atol=1e-4)


def test_text_tokens_after_sot_and_eot_shift():
    """encode_classes equals a by-hand run: K tokens inserted after SOT at block J, beta mixing
    after it, a causal mask of length T + K, features read at EOT + K."""
    clip_model = tiny_clip(text_layers=4)  # both towers 4 blocks; J = 3: tokens in blocks 3 and 4
    model = DeAR(clip_model, roles_all("mixed"), J=3, beta=0.25)
    model.set_classes(["cat"], "a photo of a {}.")
    tokens = dear.clip.tokenize(["a photo of a cat."])
    blocks = clip_model.transformer.resblocks
    x = clip_model.embed_text(tokens)
    for b in (0, 1):
        x = blocks[b](x, attn_mask=clip_model.causal_mask(77))
    x = torch.cat([x[:, :1], model.tokens.text(0)[None], x[:, 1:]], 1)  # [1, 77 + K, W]
    x = blocks[2](x, attn_mask=clip_model.causal_mask(77 + K))
    x = torch.cat(
        [x[:, :1], 0.25 * model.tokens.text(1)[None] + 0.75 * x[:, 1 : 1 + K], x[:, 1 + K :]], 1
    )
    x = blocks[3](x, attn_mask=clip_model.causal_mask(77 + K))
    eot = tokens.argmax(-1) + K
    ref = F.normalize(
        clip_model.ln_final(x[torch.arange(1), eot]) @ clip_model.text_projection, dim=-1
    )
    assert torch.allclose(model.encode_classes(), ref, atol=1e-5)
    assert not torch.allclose(model.encode_classes(), model.t0, atol=1e-3)  # the tokens do change t


# -------------------------------------------------------------------------- the vision side by hand

# A different role layout in each of blocks J..L (J = 2 of the tiny CLIP's 4): giving a block
# another block's roles changes the output. Every head kind appears, and every attribute in some
# block.
LAYOUTS = {
    2: [("generalization", None), ("attribute", "color"), ("mixed", None), ("specialist", None)],
    3: [
        ("attribute", "shape"),
        ("mixed", None),
        ("generalization", None),
        ("attribute", "texture"),
    ],
    4: [
        ("attribute", "location"),
        ("generalization", None),
        ("attribute", "object"),
        ("mixed", None),
    ],
}


def layout_roles():
    return {l: [{"role": r, "attribute": a} for r, a in heads] for l, heads in LAYOUTS.items()}


def hand_allowed(role, attribute, n):
    """[n, n] bool, row = query, column = key: the paper's rules stated pair by pair over
    [CLS, attr_1..attr_K, patches]."""
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            q_token, k_token = 1 <= q <= K, 1 <= k <= K
            if role == "mixed" or q == k or not (q_token or k_token):
                # mixed: anything; everyone sees itself; originals see originals
                allowed[q, k] = True
            elif role == "attribute" and q_token != k_token:
                allowed[q, k] = 1 + ATTRIBUTES.index(attribute) in (
                    q,
                    k,
                )  # originals <-> attr_a only
    return allowed


def hand_block(block, x, allowed=None):
    """One pre-LN block written out head by head: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
    allowed: [H, n, n] bool or None (no mask)."""
    attn, D = block.attn, x.shape[-1]
    hs = D // H
    # [B, n, D] each
    q, k, v = (block.ln_1(x) @ attn.in_proj_weight.t() + attn.in_proj_bias).split(D, dim=-1)
    heads = []
    for h in range(H):
        c = slice(h * hs, (h + 1) * hs)
        scores = q[..., c] @ k[..., c].transpose(1, 2) / math.sqrt(hs)  # [B, n, n]
        if allowed is not None:
            scores = scores.masked_fill(~allowed[h], float("-inf"))
        heads.append(scores.softmax(-1) @ v[..., c])
    x = x + attn.out_proj(torch.cat(heads, dim=-1))
    return x + block.mlp(block.ln_2(x))


def hand_vision(clip_model, model, images, J, beta, layouts):
    """f_cls, f_attr by hand: blocks 1..J-1 untouched; F^J(R) inserted after CLS at the input of
    block J; before every later block l the token slots become beta * F^l(R) + (1 - beta) * (their
    output of block l-1); block l masked by its own layout (None: no mask); f_cls through the frozen
    proj, f_attr through P_attr."""
    v = clip_model.visual
    blocks, L, B = v.transformer.resblocks, v.transformer.layers, images.shape[0]
    x = v.conv1(images).flatten(2).transpose(1, 2)  # [B, P, D]
    x = torch.cat([v.class_embedding.expand(B, 1, -1), x], dim=1) + v.positional_embedding
    x = v.ln_pre(x)  # [B, 1+P, D]
    for l in range(1, J):
        x = hand_block(blocks[l - 1], x)
    for i, l in enumerate(range(J, L + 1)):
        aligner = model.tokens.F_v[i]
        # F^l(R): [B, K, D]
        fresh = (model.tokens.R @ aligner.weight.t() + aligner.bias).expand(B, K, -1)
        if l == J:
            x = torch.cat([x[:, :1], fresh, x[:, 1:]], dim=1)  # [B, 1+K+P, D]
        else:
            x = torch.cat(
                [x[:, :1], beta * fresh + (1 - beta) * x[:, 1 : 1 + K], x[:, 1 + K :]], dim=1
            )
        allowed = (
            None
            if layouts is None
            else torch.stack([hand_allowed(r, a, x.shape[1]) for r, a in layouts[l]])
        )
        x = hand_block(blocks[l - 1], x, allowed)
    f_cls = v.ln_post(x[:, 0]) @ v.proj
    f_attr = v.ln_post(x[:, 1 : 1 + K]) @ model.P_attr
    return F.normalize(f_cls, dim=-1), F.normalize(f_attr, dim=-1)


def vision_model(roles, mask):
    """The tiny CLIP (vision 4 blocks, text 3) with J = 2, beta 0.3, and tokens and P_attr moved off
    their initial values so that every path matters: tokens as large as the residual stream, P_attr
    != proj."""
    clip_model = tiny_clip(text_layers=3)
    torch.manual_seed(1)
    model = DeAR(clip_model, roles, J=2, beta=0.3, mask=mask)
    with torch.no_grad():
        model.tokens.R.normal_()
        model.P_attr.add_(0.05 * torch.randn_like(model.P_attr))
    return clip_model, model, torch.randn(2, 3, 32, 32)


def test_vision_forward_by_hand_with_a_role_layout_per_block():
    """encode_images equals the by-hand forward: tokens at block J, beta mixing from J+1,
    each block its own roles."""
    clip_model, model, images = vision_model(layout_roles(), "role")
    f_cls, f_attr, f0 = model.encode_images(images, with_frozen=True)
    with torch.no_grad():
        ref_cls, ref_attr = hand_vision(clip_model, model, images, J=2, beta=0.3, layouts=LAYOUTS)
    assert torch.allclose(f_cls, ref_cls, atol=1e-5) and torch.allclose(f_attr, ref_attr, atol=1e-5)
    assert (
        f_cls - f0
    ).abs().max() > 1e-3  # the attribute and mixed heads do carry the tokens into CLS


def test_mask_none_by_hand():
    """--mask none: the tokens enter and mix exactly as with roles, and no head is masked."""
    clip_model, model, images = vision_model(None, "none")
    f_cls, f_attr, _ = model.encode_images(images)
    with torch.no_grad():
        ref_cls, ref_attr = hand_vision(clip_model, model, images, J=2, beta=0.3, layouts=None)
    assert torch.allclose(f_cls, ref_cls, atol=1e-5) and torch.allclose(f_attr, ref_attr, atol=1e-5)


def test_every_trainable_part_gets_a_gradient():
    """The classification loss alone (lambda_reg = lambda_fusion = 0) reaches P_attr, R, every
    aligner F_v^l and F_t^l, and the fusion weights w; the frozen CLIP gets no gradient."""
    _, model, images = vision_model(layout_roles(), "role")
    model.set_classes(["a", "b", "c"], "a photo of a {}.")
    out = model(images, with_frozen=True)
    total, _ = dear.dear_loss(
        out, torch.tensor([0, 2]), model.t0, model.alpha(), lambda_reg=0.0, lambda_fusion=0.0
    )
    total.backward()
    params = dict(model.named_parameters())
    names = ["P_attr", "w", "tokens.R"] + [
        f"tokens.{side}.{i}.{part}"
        for side in ("F_v", "F_t")
        for i in range(3)
        for part in ("weight", "bias")
    ]
    for name in names:
        assert params[name].grad is not None and params[name].grad.abs().max() > 0, name
    assert all(p.grad is None for n, p in params.items() if n.startswith("clip."))


def test_text_tower_shallower_than_vision():
    """Text 3 blocks, vision 4, J = 3: the tokens live in the last two blocks of each tower (text
    blocks 2 and 3)."""
    clip_model = tiny_clip(text_layers=3)
    model = DeAR(clip_model, roles_all("mixed", layers=(3, 4)), J=3, beta=0.25)
    with torch.no_grad():
        model.tokens.R.normal_()
    model.set_classes(["cat", "dog"], "a photo of a {}.")
    tokens = dear.clip.tokenize(["a photo of a cat.", "a photo of a dog."])
    blocks, R = clip_model.transformer.resblocks, model.tokens.R
    fresh = [R @ f.weight.t() + f.bias for f in model.tokens.F_t]  # F_t^l(R): [K, W], l = J, J+1
    with torch.no_grad():
        x = blocks[0](clip_model.embed_text(tokens), attn_mask=clip_model.causal_mask(77))
        x = torch.cat([x[:, :1], fresh[0].expand(2, K, -1), x[:, 1:]], 1)  # [2, 77 + K, W]
        x = blocks[1](x, attn_mask=clip_model.causal_mask(77 + K))
        x = torch.cat([x[:, :1], 0.25 * fresh[1] + 0.75 * x[:, 1 : 1 + K], x[:, 1 + K :]], 1)
        x = blocks[2](x, attn_mask=clip_model.causal_mask(77 + K))
        eot = tokens.argmax(-1) + K
        ref = F.normalize(
            clip_model.ln_final(x[torch.arange(2), eot]) @ clip_model.text_projection, dim=-1
        )
        assert torch.allclose(model.encode_classes(), ref, atol=1e-5)


def test_loss_terms_on_hand_set_features():
    """Features at known angles: 1 - cos is known, so every term and the total are numbers computed
    here."""
    e = torch.eye(4)
    c60, s60 = math.cos(math.pi / 3), math.sin(math.pi / 3)
    out = {
        "f0": torch.stack([e[0], e[1]]),
        # 60 and 90 degrees from f0: 1 - cos = 0.5, 1
        "f_cls": torch.stack([c60 * e[0] + s60 * e[2], e[3]]),
        # cos 0.8 and 1 with t0: 1 - cos = 0.2, 0
        "t": torch.stack([0.8 * e[0] + 0.6 * e[3], e[1]]),
        "fused": torch.tensor([[2.0, 0.0], [0.0, 1.0]]),
    }
    t0 = torch.stack([e[0], e[1]])
    alpha = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    total, parts = dear.dear_loss(
        out, torch.tensor([0, 1]), t0, alpha, lambda_reg=3.0, lambda_fusion=0.5
    )
    ce = (
        math.log(1 + math.exp(-2)) + math.log(1 + math.exp(-1))
    ) / 2  # two-class CE of margins 2 and 1
    assert parts["ce"] == pytest.approx(ce, rel=1e-6)
    assert parts["reg_img"] == pytest.approx(0.75, rel=1e-6)
    assert parts["reg_txt"] == pytest.approx(0.1, rel=1e-6)
    assert parts["fusion"] == pytest.approx(math.log(2), rel=1e-6)
    assert total.item() == pytest.approx(ce + 3.0 * (0.75 + 0.1) + 0.5 * math.log(2), rel=1e-6)


def test_loss_regularisers_are_cosines_per_row():
    """Three images, two classes, features of unequal norms: each regulariser is the mean over rows
    of 1 - cos(row, its frozen row), not a cosine down the batch (over dim 0) or of unnormalised
    dot products."""
    out = {
        "f_cls": torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 3.0], [1.0, 1.0, 0.0]]),
        "f0": torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.5], [0.0, 1.0, 0.0]]),
        "t": torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]),
        "fused": torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.5, 0.0]]),
    }
    t0 = torch.tensor([[3.0, 4.0, 0.0], [0.0, 1.0, 1.0]])
    s2 = math.sqrt(0.5)
    reg_img = ((1 - s2) + (1 - s2) + (1 - s2)) / 3  # 45 degrees in every row
    reg_txt = ((1 - 0.6) + (1 - s2)) / 2  # cos 3/5, then 45 degrees
    alpha = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.1, 0.1])
    total, parts = dear.dear_loss(
        out, torch.tensor([0, 1, 1]), t0, alpha, lambda_reg=0.3, lambda_fusion=2.0
    )
    assert parts["reg_img"] == pytest.approx(reg_img, rel=1e-6)
    assert parts["reg_txt"] == pytest.approx(reg_txt, rel=1e-6)
    ce = F.cross_entropy(out["fused"], torch.tensor([0, 1, 1])).item()
    expected = ce + 0.3 * (reg_img + reg_txt) - 2.0 * math.log(0.4)
    assert total.item() == pytest.approx(expected, rel=1e-6)


def test_harmonic_mean_by_hand():
    # 2 * 80 * 60 / 140
    assert runs.harmonic_mean(80.0, 60.0) == pytest.approx(68.5714286, abs=1e-6)
    assert runs.harmonic_mean(90.0, 10.0) == pytest.approx(18.0)
    assert runs.harmonic_mean(100.0, 0.0) == 0.0 and runs.harmonic_mean(0.0, 0.0) == 0.0


def test_fusion_weights_and_loss_terms():
    model = DeAR(tiny_clip(text_layers=3), roles_all("generalization"), J=3)
    alpha = model.alpha()
    assert alpha[0].item() == pytest.approx(0.7) and torch.allclose(
        alpha[1:], torch.full((K,), 0.06)
    )
    model.set_classes(["a", "b", "c"], "a photo of a {}.")
    images = torch.randn(4, 3, 32, 32)
    out = model(images, with_frozen=True)
    f_cls, f_attr, _ = model.encode_images(images)
    t, scale = model.encode_classes(), model.clip.logit_scale.exp()
    # six logit sets s * cos(f, t): the class features first, then the tokens in ATTRIBUTES order
    refs = [f_cls] + [f_attr[:, k] for k in range(K)]
    assert out["logits"].shape == (4, 1 + K, 3)
    assert all(
        torch.allclose(out["logits"][:, k], scale * f @ t.t(), atol=1e-4)
        for k, f in enumerate(refs)
    )
    assert torch.allclose(
        out["fused"], sum(alpha[k] * out["logits"][:, k] for k in range(1 + K)), atol=1e-4
    )
    labels = torch.tensor([0, 1, 2, 0])
    total, parts = dear.dear_loss(out, labels, model.t0, alpha, lambda_reg=2.0, lambda_fusion=0.5)
    # unit vectors: cos is the dot product
    reg_img = (1 - (out["f_cls"] * out["f0"]).sum(-1)).mean().item()
    reg_txt = (1 - (out["t"] * model.t0).sum(-1)).mean().item()
    # generalization heads: f_cls == f^0
    assert reg_img == pytest.approx(0.0, abs=1e-6) and reg_txt > 1e-4
    assert parts["reg_txt"] == pytest.approx(reg_txt, rel=1e-4)  # ... while the text tokens move t
    ce = F.cross_entropy(out["fused"], labels).item()
    assert total.item() == pytest.approx(
        ce + 2.0 * (reg_img + reg_txt) - 0.5 * math.log(0.7), rel=1e-5
    )


def test_head_is_fp32_under_bf16_autocast(monkeypatch):
    """DeAR.forward under CPU bf16 autocast, fed bf16 features (as the towers give them): the logits
    and the fused logits equal an fp64 computation by hand from the same features, and every top-1
    matches it, on 100 close classes where logits computed in bf16 (steps of 0.125-0.25 at 16-64)
    tie or swap about 13% of them."""
    g = torch.Generator().manual_seed(0)
    B, C, E = 128, 100, 64
    # close classes
    t = F.normalize(torch.randn(1, E, generator=g) + 0.1 * torch.randn(C, E, generator=g), dim=-1)
    center = t.mean(0, keepdim=True)
    f_cls = F.normalize(center + 0.5 * torch.randn(B, E, generator=g), dim=-1).bfloat16()
    f_attr = F.normalize(center + 0.5 * torch.randn(B, K, E, generator=g), dim=-1).bfloat16()
    model = DeAR(tiny_clip(text_layers=3), roles_all("mixed"), J=3)
    with torch.no_grad():
        model.clip.logit_scale.fill_(math.log(100.0))  # CLIP's trained scale
        model.w.copy_(torch.randn(1 + K, generator=g))
    monkeypatch.setattr(model, "image_features", lambda x: (f_cls, f_attr))  # what the towers give
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.zeros(B, 3, 32, 32), t=t.bfloat16())
    # by hand, in fp64: 100 * cos of each feature set with each class, fused with alpha = softmax(w)
    feats = torch.cat([f_cls.double()[:, None], f_attr.double()], 1)  # [B, 1+K, E]
    feats, tt = feats / feats.norm(dim=-1, keepdim=True), t.bfloat16().double()
    tt = tt / tt.norm(dim=-1, keepdim=True)
    logits = 100.0 * torch.einsum("bke,ce->bkc", feats, tt)
    w = model.w.detach().double()
    fused = (w.exp() / w.exp().sum())[None, :, None].mul(logits).sum(1)
    assert out["logits"].dtype == out["fused"].dtype == torch.float32
    assert (out["logits"].double() - logits).abs().max() < 1e-4
    assert (out["fused"].double() - fused).abs().max() < 1e-4
    top2 = fused.topk(2, -1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # the reference top-1 is unambiguous in fp32
    assert torch.equal(out["fused"].argmax(-1), fused.argmax(-1))
    with torch.autocast(
        "cpu", dtype=torch.bfloat16
    ):  # the case is sensitive: a bf16 head gets many wrong
        half = torch.einsum(
            "k,bkc->bc", model.alpha().detach(), 100.0 * feats.float() @ tt.float().t()
        )
    assert (half.argmax(-1) != fused.argmax(-1)).sum() >= 5


def test_aligners_start_identical_and_R_init_unchanged():
    """As MMRL: one aligner of each kind initialised and copied to every block; R is still
    N(0, 0.02), drawn first."""
    torch.manual_seed(7)
    tokens = dear.AttributeTokens(4, 16, 24, 20)
    torch.manual_seed(7)
    assert torch.equal(tokens.R, torch.randn(K, 16) * 0.02)
    for aligners in (tokens.F_v, tokens.F_t):
        for a in aligners[1:]:
            assert torch.equal(a.weight, aligners[0].weight) and torch.equal(
                a.bias, aligners[0].bias
            )
            assert a.weight.data_ptr() != aligners[0].weight.data_ptr()  # copies, trained apart
    # vision and text: separate draws
    assert not torch.equal(tokens.F_v[0].weight[:20], tokens.F_t[0].weight)
    bound = 1 / math.sqrt(16)  # nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in))
    assert tokens.F_v[0].weight.abs().max() <= bound and tokens.F_v[0].weight.std() > bound / 3


def test_set_beta_equals_a_model_built_with_that_beta():
    clip_model = tiny_clip(text_layers=3)
    torch.manual_seed(0)
    a = DeAR(clip_model, roles_all("mixed"), J=2, beta=0.9)
    b = DeAR(clip_model, roles_all("mixed"), J=2, beta=0.3)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m.set_classes(["cat", "dog"], "a photo of a {}.")
    images = torch.randn(2, 3, 32, 32)
    before = a(images)["fused"]
    a.set_beta(0.3)
    assert torch.allclose(a(images)["fused"], b(images)["fused"], atol=1e-5)
    assert not torch.allclose(before, b(images)["fused"], atol=1e-3)  # beta matters here
    with pytest.raises(ValueError, match="beta"):
        a.set_beta(1.5)


def test_xd_targets_get_mmrl_pp_test_time_beta():
    """SPEC §3 (MMRL++ config.py, task CD), restated by hand with the paper's dataset names."""
    published = {
        "ImageNet-V2": 0.9,
        "ImageNet-R": 0.9,
        "ImageNet-A": 0.8,
        "ImageNet-Sketch": 0.7,
        "FGVCAircraft": 0.9,
        "UCF101": 0.9,
        "SUN397": 0.7,
        "OxfordPets": 0.6,
        "Caltech101": 0.6,
        "DTD": 0.5,
        "OxfordFlowers": 0.4,
        "StanfordCars": 0.3,
        "EuroSAT": 0.3,
        "Food101": 0.3,
    }
    ours = {
        "ImageNet-V2": "imagenetv2",
        "ImageNet-R": "imagenet_r",
        "ImageNet-A": "imagenet_a",
        "ImageNet-Sketch": "imagenet_sketch",
        "FGVCAircraft": "fgvc_aircraft",
        "UCF101": "ucf101",
        "SUN397": "sun397",
        "OxfordPets": "oxford_pets",
        "Caltech101": "caltech101",
        "DTD": "dtd",
        "OxfordFlowers": "oxford_flowers",
        "StanfordCars": "stanford_cars",
        "EuroSAT": "eurosat",
        "Food101": "food101",
    }
    xd = dear.resolve(dear.Config(dataset="imagenet", protocol="xd"))
    assert set(ours.values()) == set(data.DG_TARGETS + data.B2N_DATASETS) - {"imagenet"}
    for name, beta in published.items():
        assert config.eval_beta(xd, ours[name]) == beta, name
    assert config.eval_beta(xd, "imagenet") == 0.9 == xd.beta  # the source keeps its own
    assert config.eval_beta(xd, "folder:/x") == xd.beta  # not in the table
    source = dear.resolve(
        dear.Config(dataset="imagenet", protocol="xd", beta=0.6, target_beta="source")
    )
    assert all(config.eval_beta(source, n) == 0.6 for n in ours.values())
    b2n = dear.resolve(dear.Config(dataset="dtd"))
    assert config.eval_beta(b2n, "dtd") == 0.9  # other protocols: the run's beta
    assert (
        runs.variant_name(dear.Config(dataset="imagenet", protocol="xd", target_beta="source"))
        == "target_beta-source"
    )


def test_schedule_values():
    cfg = dear.resolve(dear.Config(dataset="dtd", protocol="b2n"))
    assert (cfg.epochs, cfg.batch_size, cfg.beta, cfg.lambda_reg) == (10, 4, 0.9, 7.0)
    lrs = [train.lr_at(e, cfg) for e in range(cfg.epochs)]
    assert lrs[0] == 1e-5 and lrs[1] == pytest.approx(1e-3)
    assert lrs[2] == pytest.approx(1e-3 * (1 + math.cos(math.pi / 10)) / 2)
    assert lrs[-1] == pytest.approx(1e-3 * (1 + math.cos(math.pi * 8 / 10)) / 2) and lrs[-1] > 0
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:]))
    xd = dear.resolve(dear.Config(dataset="imagenet", protocol="xd"))
    assert (xd.epochs, xd.batch_size, xd.warmup_epochs, xd.beta, xd.lambda_reg) == (
        1,
        32,
        0,
        0.9,
        0.1,
    )
    assert train.lr_at(0, xd) == pytest.approx(1e-3)
    assert dear.resolve(dear.Config(dataset="imagenet")).epochs == 5
    # few-shot: MMRL++'s vit_b16_few_shot (100 epochs, batch 32, lr 2e-3, warm-up 1) with its beta /
    # lambda table; ImageNet keeps vit_b16_imagenet (5 epochs, batch 32, lr 1e-3)
    imagenet_fs = dear.resolve(dear.Config(dataset="imagenet", protocol="fewshot"))
    assert (
        imagenet_fs.epochs,
        imagenet_fs.batch_size,
        imagenet_fs.warmup_epochs,
        imagenet_fs.lr,
    ) == (5, 32, 1, 1e-3)
    for name, beta, lam in (("dtd", 0.9, 7.0), ("eurosat", 0.2, 0.01), ("food101", 0.1, 1.0)):
        fs = dear.resolve(dear.Config(dataset=name, protocol="fewshot"))
        assert (fs.epochs, fs.batch_size, fs.warmup_epochs, fs.lr, fs.beta, fs.lambda_reg) == (
            100,
            32,
            1,
            2e-3,
            beta,
            lam,
        )
        assert train.lr_at(1, fs) == 2e-3 and train.lr_at(0, fs) == 1e-5
    # --lr wins
    assert dear.resolve(dear.Config(dataset="dtd", protocol="fewshot", lr=5e-4)).lr == 5e-4
    assert dear.parse_args(["--protocol", "fewshot", "--lr", "5e-4"]).lr == 5e-4
    assert dear.parse_args(["--protocol", "fewshot"]).lr is None  # None: the protocol's default
    # base-to-novel (ImageNet too) and cross-dataset: lr 1e-3;
    # the toy world keeps its tables' recipe
    for c in (
        dict(dataset="dtd"),
        dict(dataset="imagenet"),
        dict(dataset="imagenet", protocol="xd"),
    ):
        assert dear.resolve(dear.Config(**c)).lr == 1e-3, c
    toy = dear.resolve(dear.Config(dataset="toyworld", protocol="fewshot"))
    assert (toy.epochs, toy.batch_size, toy.lr) == (50, 32, 1e-3)
    assert runs.variant_name(dear.Config(dataset="dtd", protocol="fewshot", lr=2e-3)) == "default"


def test_resolve_fills_only_what_is_missing(monkeypatch):
    """resolve's defaults where nothing is given (ViT-B/16 outside the toy world; a dataset not in
    the table: beta 0.9, lambda_reg 1.0; crop scale 0.5, the toy world's 1.0), and given values kept
    where the table says otherwise (dtd's lambda_reg is 7.0, the toy world's crop scale 1.0); data
    loader workers min(4, CPUs) unless given."""
    assert dear.resolve(dear.Config(dataset="dtd")).backbone == "ViT-B/16"
    assert dear.resolve(dear.Config(dataset="toyworld")).backbone == "toy"
    other = dear.resolve(dear.Config(dataset="folder:/x"))
    assert (other.beta, other.lambda_reg, other.crop_scale) == (0.9, 1.0, 0.5)
    given = dear.resolve(dear.Config(dataset="dtd", lambda_reg=0.25, beta=0.35))
    assert (given.beta, given.lambda_reg) == (0.35, 0.25)
    kept = dear.resolve(dear.Config(dataset="dtd", batch_size=7, warmup_epochs=3))  # table: 4, 1
    assert (kept.batch_size, kept.warmup_epochs) == (7, 3)
    assert dear.resolve(dear.Config(dataset="toyworld", crop_scale=0.3)).crop_scale == 0.3
    assert dear.resolve(dear.Config(dataset="toyworld")).crop_scale == 1.0
    for cpus, workers in ((8, 4), (2, 2)):  # data loaders: at most 4, at most the CPUs
        monkeypatch.setattr(config, "available_cpus", lambda: cpus)
        assert dear.resolve(dear.Config()).workers == workers
    assert dear.resolve(dear.Config(workers=0)).workers == 0


def test_refusals_name_the_flag_and_its_choices():
    """A bad name of a field with an underscore: the message names its flag (dashes) and the
    choices, exactly."""
    with pytest.raises(ValueError) as err:
        dear.resolve(dear.Config(novel_logits="attr"))
    assert str(err.value) == "unknown --novel-logits 'attr'; choose fused, cls"


def test_default_J_and_eval_beta_off_the_common_cases():
    """default_J on a depth not divisible by 4 (6 blocks: 5, an int, not 4.5); eval_beta of a b2n
    run on a dataset that has an xd target beta keeps the run's beta (0.35, not the table's 0.5)."""
    assert config.default_J(6) == 5 and isinstance(config.default_J(6), int)
    b2n = dear.resolve(dear.Config(dataset="imagenet", beta=0.35))
    assert config.eval_beta(b2n, "dtd") == 0.35


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="text tower has only 2"):
        DeAR(tiny_clip(text_layers=2), roles_all("mixed"), J=2)
    with pytest.raises(ValueError, match="J must lie in 1..4"):
        DeAR(tiny_clip(), roles_all("mixed"), J=5)
    with pytest.raises(ValueError, match="--mask"):
        dear.resolve(dear.Config(mask="half"))
    with pytest.raises(ValueError, match="--shots"):
        dear.resolve(dear.Config(shots=0))


def test_variant_names_separate_ablations():
    base = dear.Config(dataset="dtd")
    assert runs.variant_name(base) == "default"
    assert runs.variant_name(dear.Config(dataset="dtd", beta=0.9)) == "default"  # the table value
    assert runs.variant_name(dear.Config(dataset="dtd", mask="none", J=7)) == "J-7_mask-none"
    assert runs.run_dir(base).endswith("b2n/dtd/dear-default-shots16-seed1")
    assert runs.variant_name(dear.Config(dataset="dtd", backbone="ViT-L/14")) == "backbone-ViT-L-14"
    assert runs.variant_name(dear.Config(dataset="toyworld", backbone="toy")) == "default"
    assert [config.default_J(n) for n in (12, 4, 24)] == [9, 3, 18]


def test_epoch_batches_are_seeded_and_drop_last():
    a, b = train.epoch_batches(10, 4, 3), train.epoch_batches(10, 4, 3)
    assert a == b and len(a) == 2 and all(len(x) == 4 for x in a)
    # fewer items than a batch: one partial batch, nothing dropped
    small = train.epoch_batches(3, 4, 0)
    assert len(small) == 1 and sorted(small[0]) == [0, 1, 2]
    assert train.epoch_batches(10, 4, 4) != a


# ------------------------------------------------------------------------------------- the real CLI

COLORS = [
    (220, 40, 40),
    (40, 200, 60),
    (40, 80, 220),
    (230, 210, 40),
    (200, 60, 200),
    (40, 200, 210),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny CLIP checkpoint file and a 6-class folder dataset of noisy coloured squares."""
    import numpy as np
    from PIL import Image
    from conftest import tiny_state_dict

    root = tmp_path_factory.mktemp("world")
    ckpt = root / "tiny.pt"
    torch.save(tiny_state_dict(text_layers=4), ckpt)
    rng = np.random.default_rng(0)
    for c, color in enumerate(COLORS):
        folder = root / "colors" / f"class_{c}"
        folder.mkdir(parents=True)
        for i in range(20):
            pixels = np.clip(np.array(color) + rng.normal(0, 25, (32, 32, 3)), 0, 255).astype(
                np.uint8
            )
            Image.fromarray(pixels).save(folder / f"{i}.png")
    return root, str(ckpt), f"folder:{root / 'colors'}"


def cli(world, out, *extra):
    root, ckpt, dataset = world
    return [
        "--dataset",
        dataset,
        "--root",
        str(root),
        "--backbone",
        ckpt,
        "--shots",
        "4",
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--J",
        "3",
        "--workers",
        "0",
        "--out",
        str(out),
        *extra,
    ]


def test_cli_b2n_end_to_end(world, tmp_path, monkeypatch, capsys):
    """The real CLI on a tiny CLIP: roles computed once through entropy.py, 2 epochs,
    base/novel/HM written."""
    import json

    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "cache"))
    dear.main(cli(world, tmp_path / "runs"))
    (rdir,) = (tmp_path / "runs" / "b2n").glob("*/dear-*")
    results = json.loads((rdir / "results.json").read_text())
    assert [(e["split"], e["n"]) for e in results["evals"]] == [
        ("base", 18),
        ("novel", 18),
    ]  # 6 test images x 3 classes
    base, novel = (e["accuracy"] for e in results["evals"])
    assert results["hm"] == pytest.approx(runs.harmonic_mean(base, novel))
    # the trained fusion weights: alpha = softmax(w), by hand here
    w = torch.load(rdir / "model.pt")["w"]
    assert list(results["fusion_weights"]) == ["cls", *ATTRIBUTES]
    assert list(results["fusion_weights"].values()) == pytest.approx(
        (w.exp() / w.exp().sum()).tolist(), abs=1e-6
    )
    # trained away from the start
    assert results["fusion_weights"]["cls"] != pytest.approx(0.7, abs=1e-4)
    sha = runs.file_sha256(world[1])[:8]  # a checkpoint file is named with its content hash
    assert results["config"]["J"] == 3 and results["variant"] == f"backbone-tiny-{sha}_J-3_epochs-2"
    assert (rdir / "model.pt").exists() and not (rdir / "checkpoint.pt").exists()
    assert "epoch 2/2" in (rdir / "log.txt").read_text()
    roles = list((tmp_path / "cache").rglob("roles.json"))
    assert len(roles) == 1  # computed once, cached beside the checkpoint cache
    dear.main(cli(world, tmp_path / "runs"))  # a finished run is not redone
    assert "done already" in capsys.readouterr().out
    # the trained model evaluated again, on all classes, without training
    dear.main(
        cli(world, tmp_path / "runs", "--eval-only", "--load", str(rdir), "--protocol", "fewshot")
    )
    (again,) = (rdir / "eval").rglob("results.json")
    again = json.loads(again.read_text())
    assert [(e["split"], e["n"]) for e in again["evals"]] == [("all", 36)] and again["config"][
        "J"
    ] == 3
    assert again["fusion_weights"] == results["fusion_weights"]  # the trained weights, loaded
    # zero-shot CLIP through the same code: no training, no roles
    dear.main(cli(world, tmp_path / "runs", "--method", "zeroshot"))
    (zs,) = (tmp_path / "runs" / "b2n").glob("*/zeroshot-*")
    assert "fusion_weights" not in json.loads((zs / "results.json").read_text())


def test_resume_replays_the_interrupted_run_exactly(world, tmp_path, monkeypatch):
    roles = tmp_path / "roles.json"
    roles.write_text(__import__("json").dumps(fake_roles_doc(model_name=world[1])))
    args = cli(world, tmp_path / "a", "--roles", str(roles), "--protocol", "fewshot")
    dear.main(args)
    (full,) = (tmp_path / "a").rglob("model.pt")
    real_lr_at = train.lr_at

    def interrupt(epoch, cfg):  # Ctrl-C at the start of the second epoch
        if epoch == 1:
            raise KeyboardInterrupt
        return real_lr_at(epoch, cfg)

    monkeypatch.setattr(train, "lr_at", interrupt)
    args_b = cli(world, tmp_path / "b", "--roles", str(roles), "--protocol", "fewshot")
    with pytest.raises(SystemExit) as stop:
        dear.main(args_b)
    assert stop.value.code == 130
    (ckpt,) = (tmp_path / "b").rglob("checkpoint.pt")
    with pytest.raises(
        SystemExit
    ) as refused:  # a partial run is neither silently redone nor resumed
        dear.main(args_b)
    assert refused.value.code == 2
    monkeypatch.setattr(train, "lr_at", real_lr_at)
    dear.main(args_b + ["--resume"])
    (resumed,) = (tmp_path / "b").rglob("model.pt")
    a, b = torch.load(full), torch.load(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fake_roles_doc(model_name=None):
    """A roles file in entropy.py's format for the tiny CLIP's blocks 3-4: one head of each role."""
    kinds = [
        ("generalization", None),
        ("attribute", "color"),
        ("mixed", None),
        ("specialist", None),
    ]
    heads = [
        {
            "layer": l,
            "head": h,
            "entropy": 1.0,
            "P": {},
            "texts": [],
            "role": r,
            "attribute": a,
            **({"concept": "animal"} if r == "specialist" else {}),
        }
        for l in (3, 4)
        for h, (r, a) in enumerate(kinds)
    ]
    return {
        "format": "dear-roles/1",
        "model": model_name,
        "checkpoint_sha256": "",
        "num_layers": 4,
        "num_heads": 4,
        "layers": [3, 4],
        "probe": {},
        "texts_per_head": 20,
        "rank": 80,
        "concepts": [],
        "thresholds": {"low": 0.5, "high": 2.0},
        "heads": heads,
    }


def test_training_lowers_the_loss(world, tmp_path):
    root, ckpt, dataset = world
    model = DeAR(dear.clip.load(ckpt)[0], roles_all("mixed"), J=3)
    ds = data.build_dataset(dataset, root, shots=4, seed=1)
    cfg = dear.resolve(dear.Config(epochs=2, batch_size=4, workers=0, lr=5e-3, lambda_reg=0.1))

    def train_loss():
        images = torch.stack(
            [
                data.test_transform(32)(__import__("PIL").Image.open(p).convert("RGB"))
                for p, _, _ in ds.train
            ]
        )
        labels = torch.tensor([y for _, y, _ in ds.train])
        with torch.no_grad():
            out = model(images, with_frozen=True)
            return dear.dear_loss(
                out, labels, model.t0, model.alpha(), cfg.lambda_reg, cfg.lambda_fusion
            )[0].item()

    model.set_classes(ds.classnames, ds.template)
    before = train_loss()

    def loss_fn(model, out, labels):
        return dear.dear_loss(
            out, labels, model.t0, model.alpha(), cfg.lambda_reg, cfg.lambda_fusion
        )

    train.train(model, ds, cfg, torch.device("cpu"), str(tmp_path), lambda m: None, loss_fn)
    assert train_loss() < before - 0.05


def test_bad_roles_file_and_device_stop_with_a_message(world, tmp_path, capsys):
    bad = tmp_path / "roles.json"
    doc = fake_roles_doc(model_name=world[1])
    doc["num_heads"] = 12
    bad.write_text(__import__("json").dumps(doc))
    with pytest.raises(SystemExit) as stop:
        dear.main(cli(world, tmp_path / "r", "--roles", str(bad)))
    assert stop.value.code == 2 and "num_heads" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            dear.main(cli(world, tmp_path / "r", "--device", "cuda", "--force"))
        assert "CUDA is not available" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dear.main(cli(world, tmp_path / "r", "--dataset", "eurosatt", "--force"))
    assert "eurosat" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit):
        dear.main(cli(world, tmp_path / "r", "--backbone", str(corrupt), "--force"))
    assert "cannot load the CLIP backbone" in capsys.readouterr().err


def test_cli_xd_records_the_beta_of_every_evaluation(world, tmp_path, monkeypatch, capsys):
    """xd: the source is evaluated with its own beta and a target with MMRL++'s test-time beta (here
    a folder target given a table entry); results.json says which; --target-beta source evaluates it
    with the source's. config.json records the precision used (fp32 on a CPU by default, bf16 when
    asked; fp16 is refused)."""
    import json
    import shutil

    root = world[0]
    target = tmp_path / "target"
    shutil.copytree(root / "colors", target)
    monkeypatch.setitem(config.XD_TARGET_BETA, f"folder:{target}", 0.3)
    roles = tmp_path / "roles.json"
    roles.write_text(json.dumps(fake_roles_doc(model_name=world[1])))
    seen = []
    real_evaluate = runs.evaluate

    def evaluate(model, *args, **kw):  # the beta the model really has during each evaluation
        seen.append(model.beta)
        return real_evaluate(model, *args, **kw)

    monkeypatch.setattr(runs, "evaluate", evaluate)
    args = cli(
        world,
        tmp_path / "runs",
        "--protocol",
        "xd",
        "--targets",
        f"folder:{target}",
        "--roles",
        str(roles),
        "--device",
        "cpu",
    )
    dear.main(args)
    (rdir,) = (tmp_path / "runs" / "xd").glob("*/dear-*")
    results = json.loads((rdir / "results.json").read_text())
    assert [(e["dataset"], e["beta"]) for e in results["evals"]] == [
        (world[2], 0.9),
        (f"folder:{target}", 0.3),
    ]
    assert seen == [0.9, 0.3]
    # amp on a CPU
    assert json.loads((rdir / "config.json").read_text())["resolved"]["precision"] == "fp32"
    dear.main(
        args
        + ["--eval-only", "--load", str(rdir), "--target-beta", "source", "--precision", "bf16"]
    )
    (again,) = (rdir / "eval").rglob("results.json")
    assert [e["beta"] for e in json.loads(again.read_text())["evals"]] == [0.9, 0.9] and seen[
        2:
    ] == [0.9, 0.9]
    assert json.loads((again.parent / "config.json").read_text())["precision"] == "bf16"
    dear.main(args + ["--precision", "fp16"])  # CUDA's default path, GradScaler included, on a CPU
    # its own folder
    (half,) = [d for d in (tmp_path / "runs" / "xd").glob("*/dear-*") if d != rdir]
    assert json.loads((half / "config.json").read_text())["resolved"]["precision"] == "fp16"
    done = json.loads((half / "results.json").read_text())
    assert (
        done["precisions"] == {"train": "fp16", "eval": "fp32"} and "skipped_steps" in done["train"]
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_token_stream_is_fp32_from_block_J_under_autocast(dtype):
    """As MMRL, whose fp32 tokens promote the vision residual stream: under autocast (CPU autocast
    standing in for CUDA's) with the frozen weights in half precision, the stream entering blocks
    J..L with the tokens is fp32, and so is ln_post's input for f_cls and f_attr; the frozen prefix
    and the f^0 path keep the half-precision stream they had."""
    torch.manual_seed(0)
    model = DeAR(tiny_clip(text_layers=3), mixed_roles(), J=3)  # tokens in blocks 3 and 4 of 4
    seen = []
    for b, block in enumerate(model.clip.visual.transformer.resblocks):  # (block, positions, dtype)
        block.register_forward_pre_hook(
            lambda m, a, b=b: seen.append((b, a[0].shape[1], a[0].dtype))
        )
    model.clip.visual.ln_post.register_forward_pre_hook(
        lambda m, a: seen.append(("ln_post", a[0].shape[1:-1], a[0].dtype))
    )  # [B, K, D]: f_attr
    model.set_classes(["cat", "dog"], "a photo of a {}.")
    with (
        torch.no_grad(),
        train.frozen_weights_in(dtype, model.clip),
        torch.autocast("cpu", dtype=dtype),
    ):
        model(torch.randn(2, 3, 32, 32), with_frozen=True)
    half, f32, n = dtype, torch.float32, 1 + P  # n: CLS and patches
    assert seen == [
        (0, n, half),
        (1, n, half),  # the frozen prefix, blocks 1..J-1
        (2, n, half),
        (3, n, half),
        ("ln_post", (), half),  # f^0 as before
        (2, n + K, f32),
        (3, n + K, f32),  # blocks J..L with the tokens
        ("ln_post", (), f32),
        ("ln_post", (K,), f32),
    ]  # f_cls, f_attr


# Equivalent mutants (mutate.sh): survivors that no input can tell apart from the real code.
# - dear.py, every F.normalize(..., dim=-1) on a 2-D tensor ([B, E] or [C, E]) turned into dim=+1
#   or the default (dim=1): reference_images 8, 18, 67, 70; reference_classes 8, 23, 65, 74;
#   image_features 13, 14 (f_cls); encode_classes 76, 77; cosine_logits 17, 18 (t);
#   DeAR.frozen_feature 21, 23 (f^0 [B, E]); DeAR.set_classes 74, 76 (t^0 [C, E]).
# - dear.py dear_loss 21, 26, 36, 39: F.cosine_similarity's dim=-1 turned into +1 or the default
#   (1) on the 2-D features [B, E] and [C, E].
# - dear.py reference_classes 21, 72, DeAR.set_classes 19: tokens.argmax(-1) -> argmax(+1) on the
#   2-D ids [C, T].
# - dear.py reference_images 12, reference_classes 15, DeAR.frozen_feature 5, DeAR.set_classes 51:
#   run_blocks(x, ..., None): end None runs to the last block, which is model.L (model.Lt).
# - dear.py dear_loss 4, 5: autocast(enabled=False) -> enabled (True): no op of the loss autocasts
#   to half precision (cross_entropy and cosine_similarity are fp32 ops of autocast on CUDA; on a
#   CPU none of them is listed), so the values are the same bit for bit.
# - dear.py fuse 13: einsum "K,BKC->BC" is the same contraction as "k,bkc->bc".
# - dear.py image_features 8: x[:, 1:2 + K] on x [B, 1 + K, D] (token_blocks returns CLS and the
#   K tokens only) is x[:, 1:1 + K].
# - dear.py image_features 9: P_attr.to(None): x is fp32 (token_blocks casts it) and P_attr, a
#   trainable parameter, stays fp32 under every precision, so .to(x.dtype) changes nothing.
# - dear.py token_blocks 27, 29: slice(None, 1 + K) and slice(1 + K) are slice(0, 1 + K);
#   DeAR.frozen_feature 11, 13: slice(None, 1) and slice(1) are slice(0, 1).
# - dear.py DeAR.set_classes 9, 12: the prompt tokens' device None instead of P_attr's: the CPU,
#   where the tests run.
# - dear.py role_mask 1, 2: the default variant "role" -> "XXroleXX" / "ROLE": role_mask treats
#   every variant other than "none" and "generalization-only" as "role" (resolve refuses other
#   names).
# - dear.py role_mask 85: torch.zeros(L, L) broadcasts to [H, L, L] in masked_fill; 95: "-INF" is
#   float("-inf").

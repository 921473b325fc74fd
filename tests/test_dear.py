"""The method of dear.py against computations written out by hand, on tiny random CLIPs."""

import math

import pytest
import torch
import torch.nn.functional as F

import clip
import dear
import predict
from clip.model import build_model
from conftest import tiny_clip
from dear import ATTRIBUTES, K, DeAR, role_mask

H, P = 4, 16  # the tiny CLIP: 4 heads, 32x32 images, patch 8 -> 16 patches
# a different role layout in each block 2..4 (J = 2 of 4): every head kind, each attribute somewhere
G, M, S = ("generalization", None), ("mixed", None), ("specialist", None)
LAYOUTS = {2: [G, ("attribute", "color"), M, S],
           3: [("attribute", "shape"), M, G, ("attribute", "texture")],
           4: [("attribute", "location"), G, ("attribute", "object"), M]}


def roles_of(layouts):
    return {l: [{"role": r, "attribute": a} for r, a in heads] for l, heads in layouts.items()}


def all_roles(role, attribute=None, layers=range(1, 5)):
    return {l: [{"role": role, "attribute": attribute}] * H for l in layers}


def hand_allowed(role, attribute, n):
    """[n, n] bool, row = query, column = key: the paper's rules stated pair by pair."""
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            q_tok, k_tok = 1 <= q <= K, 1 <= k <= K
            if role == "mixed" or q == k or not (q_tok or k_tok):
                allowed[q, k] = True  # mixed: all; each sees itself; originals see originals
            elif role == "attribute" and q_tok != k_tok:
                allowed[q, k] = 1 + ATTRIBUTES.index(attribute) in (q, k)  # originals<->attr_a only
    return allowed


@pytest.mark.parametrize("variant", ["role", "generalization-only", "none"])
def test_role_mask_cells_equal_the_rules_stated_pair_by_pair_and_gate_the_attention(variant):
    """On real attention weights too: a blocked cell weighs exactly 0, an allowed one > 0."""
    block = tiny_clip().visual.transformer.resblocks[0]
    for layer, heads in LAYOUTS.items():
        mask = role_mask(roles_of(LAYOUTS)[layer], P, variant)
        with torch.no_grad():
            _, w = block.attn(block.ln_1(torch.randn(1, 1 + K + P, 64)), attn_mask=mask,
                              need_weights=True)
        assert torch.equal(w[0] > 0, mask == 0), layer
        for h, (role, attribute) in enumerate(heads):
            if variant == "none" or (variant == "generalization-only" and role == "attribute"):
                role = "mixed"
            assert torch.equal(mask[h] == 0, hand_allowed(role, attribute, 1 + K + P)), (layer, h)
            assert set(mask[h].unique().tolist()) <= {0.0, -math.inf}


def test_masks_and_attention_maps_take_the_roles_of_their_block_counted_from_1():
    """Roles files count blocks from 1, DeAR.blocks from 0: with J = 3 of 4, masks[0] is block 3's
    layout and masks[-1] block 4's, and attention_maps' heads are block 4's experts (location:
    head 0, object: head 2, the others: the mixed head 3); block 2's or 3's would differ."""
    model = DeAR(tiny_clip(), roles_of(LAYOUTS), J=3)
    assert torch.equal(model.masks[0], role_mask(roles_of(LAYOUTS)[3], P))
    assert torch.equal(model.masks[-1], role_mask(roles_of(LAYOUTS)[4], P))
    _, heads = predict.attention_maps(model, torch.randn(1, 3, 32, 32))
    assert heads == [[0, 1, 2, 3], [3], [3], [3], [2], [0]]  # CLS, then ATTRIBUTES' order


def hand_block(block, x, allowed=None):
    """One pre-LN block written out head by head; allowed: [H, n, n] bool or None."""
    attn, D, hs = block.attn, x.shape[-1], x.shape[-1] // H
    q, k, v = (block.ln_1(x) @ attn.in_proj_weight.t() + attn.in_proj_bias).split(D, dim=-1)
    heads = []
    for h in range(H):
        c = slice(h * hs, (h + 1) * hs)
        scores = q[..., c] @ k[..., c].transpose(1, 2) / math.sqrt(hs)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[h], float("-inf"))
        heads.append(scores.softmax(-1) @ v[..., c])
    x = x + attn.out_proj(torch.cat(heads, dim=-1))
    return x + block.mlp(block.ln_2(x))


def fresh_tokens(aligner, R, i):
    """F^l(R) from the parameters: MMRL++ R (W + A_i B_i)^T + b_i; MMRL R W_i^T + b_i."""
    mmrl = aligner.weight.dim() == 3  # a W_i per block
    W = aligner.weight[i] if mmrl else aligner.weight + aligner.A[i] @ aligner.B[i]
    return R @ W.t() + aligner.bias[i]


def hand_vision(model, images, J, beta, layouts):
    """f_cls, f_attr, f0 by hand: blocks 1..J-1 untouched; F^J(R) after CLS at block J; later
    blocks get beta F^l(R) + (1 - beta) (their output of block l-1); each block masked by its own
    roles."""
    v, blocks, B = model.clip.visual, model.clip.visual.transformer.resblocks, images.shape[0]
    x = v.conv1(images).flatten(2).transpose(1, 2)
    x = v.ln_pre(torch.cat([v.class_embedding.expand(B, 1, -1), x], dim=1) + v.positional_embedding)
    f0 = x
    for l in range(1, 5):
        f0 = hand_block(blocks[l - 1], f0)
        x = hand_block(blocks[l - 1], x) if l < J else x
    for i, l in enumerate(range(J, 5)):
        fresh = fresh_tokens(model.F_v, model.R, i).expand(B, K, -1)
        kept = x[:, 1:] if l == J else x[:, 1 + K :]  # insert at J, replace (mix) after it
        x = torch.cat([x[:, :1], fresh if l == J else beta * fresh + (1 - beta) * x[:, 1 : 1 + K],
                       kept], 1)
        allowed = layouts and torch.stack([hand_allowed(r, a, x.shape[1]) for r, a in layouts[l]])
        x = hand_block(blocks[l - 1], x, allowed)
    P_attr = v.proj + model.P_A @ model.P_B if model.kind == "mmrlpp" else model.P_full
    norm = lambda f: F.normalize(f, dim=-1)
    return (norm(v.ln_post(x[:, 0]) @ v.proj), norm(v.ln_post(x[:, 1 : 1 + K]) @ P_attr),
            norm(v.ln_post(f0[:, 0]) @ v.proj))


def hand_text(model, names, template, beta):
    """t by hand: every prompt whole, padded to the context length, the K tokens after SOT from
    block J, beta mixing after it, a causal mask of length T + K, read at EOT + K."""
    m, tokens = model.clip, clip.tokenize([template.format(n) for n in names])
    x = m.embed_text(tokens)
    for b in range(m.transformer.layers):
        i = b - model.text_blocks.start
        if i >= 0:
            fresh = fresh_tokens(model.F_t, model.R, i).expand(len(names), K, -1)
            kept = x[:, 1:] if i == 0 else x[:, 1 + K :]
            x = torch.cat([x[:, :1], fresh if i == 0 else beta * fresh + (1 - beta) * x[:,
                    1 : 1 + K], kept], 1)
        x = m.transformer.resblocks[b](x, attn_mask=m.causal_mask(x.shape[1]))
    eot = tokens.argmax(-1) + K
    return F.normalize(m.ln_final(x[torch.arange(len(names)), eot]) @ m.text_projection, dim=-1)


def trained_looking(model, seed=1):
    """Every trainable value moved off its initialisation, so that every path matters."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("clip.") and name != "w":
                p.add_(torch.randn_like(p) * (1.0 if name == "R" else 0.05))
    return model


# names of unequal lengths (length groups), a shared template start, one with spaces
NAMES = ["cat", "dog house", "a very long class name with many words", "ox", "sea lion pup"]


@pytest.mark.parametrize("tokens", ["mmrlpp", "mmrl"])
@pytest.mark.parametrize("mask", ["role", "none"])
def test_forward_equals_the_computation_written_out_by_hand(tokens, mask):
    """The fast forward (frozen prefix once, last block on the rows read, shared prompt start,
    length groups) equals all blocks on all positions by hand, as do the 6 logit sets and fusion."""
    roles = roles_of(LAYOUTS) if mask == "role" else None
    model = trained_looking(DeAR(tiny_clip(text_layers=4), roles, J=2, beta=0.3, mask=mask,
                                 tokens=tokens))
    images = torch.randn(3, 3, 32, 32)
    model.set_classes(NAMES, "a photo of a {}.")
    out = model(images, with_frozen=True)
    with torch.no_grad():
        f_cls, f_attr, f0 = hand_vision(model, images, 2, 0.3, LAYOUTS if mask == "role" else None)
        t = hand_text(model, NAMES, "a photo of a {}.", 0.3)
    plain = model.text_features_plain(NAMES, "a photo of a {}.")  # dear.py's plain statement
    for got, want in ((out["f_cls"], f_cls), (out["f_attr"], f_attr), (out["f0"], f0),
                      (out["t"], t), (plain, t)):
        assert torch.allclose(got, want, atol=2e-5)
    assert (f_cls - f0).abs().max() > 1e-3  # attribute and mixed heads carry the tokens into CLS
    feats = torch.cat([f_cls.unsqueeze(1), f_attr], 1)
    logits = model.clip.logit_scale.exp() * feats @ t.t()  # [B, 1+K, C]
    alpha = model.w.softmax(0)
    assert torch.allclose(out["logits"], logits, atol=1e-3)
    assert torch.allclose(out["fused"], (alpha[:, None] * logits).sum(1), atol=1e-3)


def test_text_tower_shallower_than_vision_gets_its_tokens_in_its_last_blocks():
    model = trained_looking(DeAR(tiny_clip(text_layers=3), all_roles("mixed", layers=(3, 4)), J=3,
                                 beta=0.25))
    model.set_classes(NAMES[:3], "itap of a {}.")
    assert model.text_blocks == range(1, 3)
    with pytest.raises(dear.UserError, match="--J 1: the backbone has 4 vision, 3 text blocks"):
        DeAR(tiny_clip(text_layers=3), all_roles("mixed"), J=1)  # 4 token blocks, 3 text blocks
    assert torch.allclose(model.encode_classes(), hand_text(model, NAMES[:3], "itap of a {}.",
            0.25), atol=2e-5)


def test_no_tokens_or_generalization_heads_give_frozen_clip_attribute_heads_their_token_only():
    images, m = torch.randn(2, 3, 32, 32), tiny_clip(text_layers=4)
    model = DeAR(m, None, J=3, attr_tokens=False)
    assert not any(p.requires_grad for p in model.parameters())
    model.set_classes(["cat", "dog house"], "a photo of a {}.")
    text = F.normalize(m.encode_text(clip.tokenize(["a photo of a cat.",
                                                    "a photo of a dog house."])), dim=-1)
    want = m.logit_scale.exp() * F.normalize(m.encode_image(images), dim=-1) @ text.t()
    assert torch.allclose(model(images)["fused"], want, atol=1e-4)
    model = trained_looking(DeAR(tiny_clip(text_layers=4), all_roles("generalization"), J=2))
    out = model(images, t=torch.randn(3, 32), with_frozen=True)
    assert torch.allclose(out["f_cls"], out["f0"], atol=1e-5)  # exactly frozen CLIP
    model = trained_looking(DeAR(tiny_clip(text_layers=4), all_roles("attribute", "texture"), J=2))
    f_cls = model.image_features(model.token_blocks(model.frozen_prefix(images)))[0]
    grad = torch.autograd.grad(f_cls.sum(), model.R)[0]  # [K, rep]
    size, texture = grad.abs().amax(1), [a == "texture" for a in ATTRIBUTES]  # NaN fails both
    assert (size > 0).tolist() == texture and (size == 0).tolist() == [not t for t in texture]


def test_loss_terms_on_features_at_known_angles_and_their_gradients():
    """1 - cos at 60/90 degrees is known; distinct lambdas so that swapped wiring fails; the -log
    alpha_cls term moves w (its gradient is lambda_fusion (softmax(w) - e_cls)) and the CE term
    moves the fused logits. The regularisers: three rows of unequal norms give the mean over rows
    of 1 - cos(row, its frozen row), not over the batch."""
    e, c60, s60 = torch.eye(4), math.cos(math.pi / 3), math.sin(math.pi / 3)
    out = {"f0": torch.stack([e[0], e[1]]), "f_cls": torch.stack([c60 * e[0] + s60 * e[2], e[3]]),
           "t": torch.stack([0.8 * e[0] + 0.6 * e[3], e[1]]),
           "fused": torch.tensor([[2.0, 0.0], [0.0, 1.0]])}
    w = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1]).log().requires_grad_()
    total, parts = dear.dear_loss(out, torch.tensor([0, 1]), torch.stack([e[0], e[1]]),
                                  w.softmax(0), 3.0, 0.5)
    ce = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(-1))) / 2  # 2-class CE, margins 2, 1
    assert [parts[k].item() for k in ("ce", "reg_img", "reg_txt", "fusion")] == pytest.approx(
        [ce, 0.75, 0.1, math.log(2)], rel=1e-6)
    assert total.item() == pytest.approx(ce + 3.0 * (0.75 + 0.1) + 0.5 * math.log(2), rel=1e-6)
    total.backward()
    want = 0.5 * (torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1]) - torch.eye(6)[0])
    assert torch.allclose(w.grad, want, atol=1e-6)
    out = {"f_cls": torch.tensor([[2.0, 0, 0], [0, 3, 3], [1, 1, 0]]),
           "t": torch.tensor([[1.0, 0, 0], [0, 2, 0]]),
           "f0": torch.tensor([[1.0, 1, 0], [0, 0, 0.5], [0, 1, 0]]), "fused": torch.ones(3, 2)}
    t0, s2 = torch.tensor([[3.0, 4, 0], [0, 1, 1]]), math.sqrt(0.5)
    _, parts = dear.dear_loss(out, torch.tensor([0, 1, 1]), t0, torch.full((6,), 1 / 6), 0.3, 2.0)
    assert (parts["reg_img"].item(), parts["reg_txt"].item()) == pytest.approx((1 - s2,
            (0.4 + 1 - s2) / 2), rel=1e-6)


# each loss term: the output it reads (the others' are detached to isolate it) and the trainable
# parameters (name prefixes) it must move; it must leave every other one alone
FEEDS = {"ce": "fused", "reg_img": "f_cls", "reg_txt": "t", "fusion": "alpha"}
MOVES = {"ce": ("",), "reg_img": ("R", "F_v."), "reg_txt": ("R", "F_t."), "fusion": ("w",)}


def test_each_loss_terms_gradient_is_its_finite_difference_and_reaches_only_its_parameters():
    """Each term alone (the other terms' inputs detached, lambdas 1): its gradient is nonzero
    exactly on MOVES' parameters and equals a 4-point central difference (h = 0.1) of dear_loss's
    value of the term at two coordinates (the largest CE gradient, a random one) of every trainable
    tensor, within 1e-2 of the term's largest gradient on that tensor. fp32, not fp64: the token
    stream and dear_loss cast to fp32 (model.double() fails); the fp32 noise is ~3e-3 of it. The
    total with lambda_reg 0.3, lambda_fusion 2.5, nothing detached: CE + 0.3 (reg_img + reg_txt) +
    2.5 fusion of those gradients, and none for the frozen CLIP."""
    torch.manual_seed(0)
    model = trained_looking(DeAR(tiny_clip(text_layers=4), roles_of(LAYOUTS), J=2))
    model.set_classes(["a", "b", "c"], "a photo of a {}.")
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def loss(term=None, lambdas=(1.0, 1.0)):  # term: only its input keeps its graph
        keep = FEEDS.get(term)
        out = dict(model(images, with_frozen=True), alpha=model.alpha())
        out = {k: v if keep in (None, k) else v.detach() for k, v in out.items()}
        return dear.dear_loss(out, labels, model.t0, out["alpha"], *lambdas)

    grads = {}
    for term in FEEDS:
        total = loss(term)[0]  # a term cut from its parameters has no graph at all
        got = [None] * len(params)
        if total.requires_grad:
            got = torch.autograd.grad(total, list(params.values()), allow_unused=True)
        grads[term] = {n: torch.zeros_like(p) if g is None else g
                       for (n, p), g in zip(params.items(), got)}
        for n in params:
            assert (grads[term][n].abs().max() > 0) == n.startswith(MOVES[term]), (term, n)
    rng = torch.Generator().manual_seed(0)
    for n, p in params.items():
        flat = p.data.view(-1)
        top = int(grads["ce"][n].abs().argmax())
        for i in (top, int(torch.randint(p.numel(), (1,), generator=rng))):
            old, at = flat[i].item(), {}
            for s in (-2, -1, 1, 2):
                flat[i] = old + s * 0.1
                with torch.no_grad():
                    parts = loss()[1]
                at[s] = torch.stack([parts[t] for t in FEEDS])
            flat[i] = old
            fd = (8 * (at[1] - at[-1]) - (at[2] - at[-2])) / 1.2
            for j, term in enumerate(FEEDS):
                g = grads[term][n]
                assert abs(fd[j] - g.view(-1)[i]) <= 1e-2 * g.abs().max() + 1e-7, (term, n, i)
    loss(lambdas=(0.3, 2.5))[0].backward()
    for n, p in model.named_parameters():
        if n.startswith("clip."):
            assert p.grad is None, n
        else:
            want = sum(w * grads[t][n] for t, w in zip(FEEDS, (1.0, 0.3, 0.3, 2.5)))
            torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["mmrlpp", "mmrl"])
@pytest.mark.parametrize("J, shape", [
    (1, dict(vision_width=768, vision_heads=12, text_width=512, text_heads=8, embed_dim=512,
             vision_layers=4, text_layers=4)),  # ViT-B/16 at J = 9
    (2, dict(vision_width=64, vision_heads=4, text_width=96, text_heads=4, embed_dim=48,
             vision_layers=4, text_layers=3))])
def test_trainable_values_counted_by_hand(kind, J, shape):
    """Trainable values: R, the two towers' aligners, P_attr, the six fusion weights."""
    model = DeAR(tiny_clip(**shape), None, J=J, mask="none", tokens=kind)
    n, D, W, E, rep = 5 - J, shape["vision_width"], shape["text_width"], shape["embed_dim"], 512
    if kind == "mmrlpp":  # shared W + per block (A [width, 4], B [4, rep], bias)
        towers = sum(width * rep + n * (width * 4 + 4 * rep + width) for width in (D, W))
        want = K * rep + towers + D * 64 + 64 * E + 6
    else:
        want = K * rep + sum(n * (width * rep + width) for width in (D, W)) + D * E + 6
    got = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert got == want
    if shape["vision_width"] == 768:  # the README's numbers for ViT-B/16, J = 9
        assert got == {"mmrlpp": 781_830, "mmrl": 3_022_342}[kind]


@pytest.mark.parametrize("kind", ["mmrlpp", "mmrl"])
def test_tokens_start_equal_in_every_block_and_p_attr_starts_as_proj(kind):
    """Every block's tokens are the one shared map of R: bit for bit between blocks (the same op
    on equal weights), and within torch.testing's fp32 tolerance of R W^T + b by hand (another
    kernel: another rounding). MMRL++'s A (rank 4) and P_A (rank 64) as
    nn.init.kaiming_uniform_(a=sqrt(5)): uniform within 1/sqrt(fan_in)."""
    model = DeAR(tiny_clip(text_layers=4), None, J=2, mask="none", tokens=kind)
    base = model.F_v.weight if kind == "mmrlpp" else model.F_v.weight[0]
    first = model.F_v(model.R, 0)
    assert all(torch.equal(model.F_v(model.R, i), first) for i in range(3))
    torch.testing.assert_close(first, model.R @ base.t() + model.F_v.bias[0])
    assert torch.equal(model.attr_proj(), model.clip.visual.proj)
    if kind == "mmrlpp":
        for A, bound in ((model.F_v.A, 1 / 2), (model.F_t.A, 1 / 2), (model.P_A, 1 / 8)):
            assert 0.95 * bound < A.abs().max() <= bound


def test_one_step_moves_each_block_residual_at_rank_at_most_4_and_the_blocks_part():
    """MMRL++: after one AdamW step on a fixed batch each block's residual A_i B_i has moved, has
    rank <= 4, and the blocks' tokens differ; the shared map moved too (it is trainable);
    P_attr's residual has rank <= 64."""
    model = DeAR(tiny_clip(vision_width=96, text_width=96, vision_heads=4, text_layers=4),
                 roles_of(LAYOUTS), J=2)
    model.set_classes(["a", "b", "c"], "a photo of a {}.")
    before = model.F_v.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = model(torch.randn(4, 3, 32, 32), with_frozen=True)
    dear.dear_loss(out, torch.tensor([0, 1, 2, 0]), model.t0, model.alpha(), 1.0, 1.0)[0].backward()
    opt.step()
    for aligner in (model.F_v, model.F_t):
        residuals = aligner.A.detach() @ aligner.B.detach()  # [n, width, rep]
        assert all(r.abs().max() > 0 and torch.linalg.matrix_rank(r) <= 4 for r in residuals)
    tokens = [model.F_v(model.R, i) for i in range(3)]
    assert not torch.allclose(tokens[0], tokens[1]) and not torch.allclose(tokens[1], tokens[2])
    assert not torch.equal(model.F_v.weight, before)
    assert 0 < torch.linalg.matrix_rank((model.P_A @ model.P_B).detach()) <= 64


def test_default_J_keeps_the_last_third_of_the_blocks():
    assert [dear.default_J(L) for L in (12, 24, 4, 6)] == [9, 17, 3, 5]


def openai_state_dict(width, patch, resolution, embed, text_width, vision_layers=2, text_layers=1):
    """Random tensors under the keys and shapes of OpenAI's ViT checkpoints (openai/CLIP
    `clip/model.py`)."""
    r = lambda *shape: torch.empty(shape).normal_(std=0.02)
    sd = {"positional_embedding": r(77, text_width), "token_embedding.weight": r(49408, text_width),
          "text_projection": r(text_width, embed), "logit_scale": r(),
          "visual.proj": r(width, embed), "ln_final.weight": r(text_width),
          "ln_final.bias": r(text_width), "visual.class_embedding": r(width),
          "visual.conv1.weight": r(width, 3, patch, patch),
          "visual.positional_embedding": r((resolution // patch) ** 2 + 1, width)}
    sd |= {f"visual.{ln}.{p}": r(width) for ln in ("ln_pre", "ln_post") for p in ("weight", "bias")}
    for prefix, D, layers in (("transformer", text_width, text_layers),
                              ("visual.transformer", width, vision_layers)):
        for i in range(layers):
            p = f"{prefix}.resblocks.{i}."
            sd |= {p + "attn.in_proj_weight": r(3 * D, D), p + "attn.in_proj_bias": r(3 * D),
                   p + "attn.out_proj.weight": r(D, D), p + "attn.out_proj.bias": r(D),
                   p + "mlp.c_fc.weight": r(4 * D, D), p + "mlp.c_fc.bias": r(4 * D),
                   p + "mlp.c_proj.weight": r(D, 4 * D), p + "mlp.c_proj.bias": r(D)}
            sd |= {p + f"{ln}.{q}": r(D) for ln in ("ln_1", "ln_2") for q in ("weight", "bias")}
    return sd


# name: vision width, heads, patch, resolution, embed dim, text width, text heads
BACKBONES = {"ViT-B/32": (768, 12, 32, 224, 512, 512, 8),
             "ViT-B/16": (768, 12, 16, 224, 512, 512, 8),
             "ViT-L/14": (1024, 16, 14, 224, 768, 768, 12),
             "ViT-L/14@336px": (1024, 16, 14, 336, 768, 768, 12)}


@pytest.mark.parametrize("name", BACKBONES)
def test_each_vit_backbone_builds_from_openai_shapes_and_dear_takes_a_training_step(name):
    """True shapes of each published ViT, but only 2 vision blocks and 1 text block (of 12 or 24)
    to save time: CLIP's build_model reads them off OpenAI's keys, and DeAR trains on it."""
    width, heads, patch, res, embed, text_width, text_heads = BACKBONES[name]
    m = build_model(openai_state_dict(width, patch, res, embed, text_width))
    v, t = m.visual, m.transformer
    got = (v.width, v.heads, v.transformer.heads, v.patch_size, v.input_resolution, v.output_dim)
    assert got == (width, heads, heads, patch, res, embed) and v.layers == 2
    assert v.num_patches == (res // patch) ** 2
    assert (t.width, t.heads, t.layers, m.context_length) == (text_width, text_heads, 1, 77)
    with torch.no_grad():
        f = m(torch.randn(1, 3, res, res), clip.tokenize(["a photo of a cat."]))[0]
    assert f.shape == (1, 1) and torch.isfinite(f).all()
    roles = {2: [{"role": ["attribute", "mixed", "generalization"][h % 3],
                  "attribute": ATTRIBUTES[h % K]} for h in range(heads)]}
    model = DeAR(m, roles, J=2)
    model.set_classes(["a", "b"], "a photo of a {}.")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    out = model(torch.randn(1, 3, res, res), with_frozen=True)
    loss = dear.dear_loss(out, torch.tensor([1]), model.t0, model.alpha(), 1.0, 1.0)[0]
    loss.backward()
    opt.step()
    assert out["fused"].shape == (1, 2) and math.isfinite(loss.item())


@pytest.mark.parametrize("device, dtype", [("cpu", torch.bfloat16), ("cpu", torch.float16)] + [
    pytest.param("cuda", d, marks=pytest.mark.cuda) for d in (torch.float16, torch.bfloat16)])
def test_half_precision_agrees_with_fp32_and_the_head_and_token_stream_stay_fp32(device, dtype):
    """Under autocast the features stay within half precision's round-off of fp32 (cos > 0.999
    for fp16, 0.99 for bf16, over 8 images and 5 classes), the masked attention of the fused
    kernel equals the plain softmax, and (with autograd on) the token stream, the six logit sets
    and the fusion stay fp32."""
    model = trained_looking(DeAR(tiny_clip(text_layers=4), roles_of(LAYOUTS), J=2)).to(device)
    model.set_classes(NAMES, "a photo of a {}.")
    images = torch.randn(8, 3, 32, 32, device=device)
    with torch.no_grad():
        ref = model(images, with_frozen=True)
        with torch.autocast(device, dtype=dtype):
            half = model(images, with_frozen=True)
        block, mask = model.clip.visual.transformer.resblocks[2], model.mask(1).to(device)
        x = block.ln_1(torch.randn(2, 1 + K + P, 64, device=device))
        with torch.autocast(device, dtype=dtype):
            fused, (plain, _) = (block.attn(x, attn_mask=mask),
                                 block.attn(x, attn_mask=mask, need_weights=True))
    with torch.autocast(device, dtype=dtype):
        stream = model.token_blocks(model.frozen_prefix(images[:2]))
        out = model(images[2:4], with_frozen=True)
    assert stream.dtype == out["fused"].dtype == out["logits"].dtype == torch.float32
    floor = 0.999 if dtype is torch.float16 else 0.99
    for k in ("f_cls", "f_attr", "f0", "t"):
        assert F.cosine_similarity(half[k].float(), ref[k], dim=-1).min() > floor, k
    assert torch.allclose(fused.float(), plain.float(),
                          atol=0.02 if dtype is torch.float16 else 0.1)

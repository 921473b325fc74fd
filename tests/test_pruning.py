"""DeAR's exact savings give DeAR's plain computation: the last block computes only the rows read (CLS and the
K tokens; CLS for f^0), the text start shared by every prompt runs once, and prompts run in groups of equal
length without padding. The reference below is the plain computation written out by hand: every position,
every block, prompts padded to 77 tokens, features read afterwards."""
import pytest
import torch
import torch.nn.functional as F

import clip
import clip.model
from conftest import tiny_clip
from dear import K, DeAR

H = 4  # heads per block of the tiny CLIP


def varied_roles(layers=range(1, 5)):
    """Per-head roles that differ from block to block, so every block has a different per-head mask."""
    kinds = [{"role": "generalization", "attribute": None}, {"role": "attribute", "attribute": "color"},
             {"role": "mixed", "attribute": None}, {"role": "specialist", "attribute": None},
             {"role": "attribute", "attribute": "shape"}]
    return {l: [kinds[(l + h) % len(kinds)] for h in range(H)] for l in layers}


def plain_images(model, images):
    """f_cls, f_attr, f^0 computed on every position of every block (no rows cut)."""
    visual = model.clip.visual
    x = visual.embed(images)
    f0_x = visual.run_blocks(x, 0, model.L)
    f0 = F.normalize(visual.head(f0_x[:, 0]), dim=-1)
    for b in range(model.L):
        i = b - model.first
        if i == 0:
            x = torch.cat([x[:, :1], model.tokens.vision(0).expand(len(x), -1, -1), x[:, 1:]], dim=1)
        elif i > 0:
            x = torch.cat([x[:, :1], model.beta * model.tokens.vision(i) + (1 - model.beta) * x[:, 1:1 + K],
                           x[:, 1 + K:]], dim=1)
        block = visual.transformer.resblocks[b]
        x = block(x, attn_mask=getattr(model, f"mask_{i}") if i >= 0 else None)
    f_cls = F.normalize(visual.head(x[:, 0]), dim=-1)
    f_attr = F.normalize(visual.ln_post(x[:, 1:1 + K]) @ model.P_attr, dim=-1)
    return f_cls, f_attr, f0


def plain_classes(model, prompts):
    """t and t^0 with every prompt padded to 77 tokens, all of them run through every block."""
    m = model.clip
    tokens = clip.tokenize(prompts)  # [C, 77]
    eot = tokens.argmax(-1)
    x = m.embed_text(tokens)
    t0_x = x
    for b in range(m.transformer.layers):
        t0_x = m.transformer.resblocks[b](t0_x, attn_mask=torch.full((77, 77), float("-inf")).triu(1))
    t0 = F.normalize(m.ln_final(t0_x[torch.arange(len(x)), eot]) @ m.text_projection, dim=-1)
    for b in range(m.transformer.layers):
        i = b - model.first_text
        if i == 0:
            x = torch.cat([x[:, :1], model.tokens.text(0).expand(len(x), -1, -1), x[:, 1:]], dim=1)
        elif i > 0:
            x = torch.cat([x[:, :1], model.beta * model.tokens.text(i) + (1 - model.beta) * x[:, 1:1 + K],
                           x[:, 1 + K:]], dim=1)
        n = x.shape[1]
        x = m.transformer.resblocks[b](x, attn_mask=torch.full((n, n), float("-inf")).triu(1))
    t = F.normalize(m.ln_final(x[torch.arange(len(x)), eot + K]) @ m.text_projection, dim=-1)
    return t, t0


def grads(model, value):
    params = [model.tokens.R, model.P_attr] + list(model.tokens.F_v.parameters()) + list(model.tokens.F_t.parameters())
    return [g if g is not None else torch.zeros_like(p)
            for g, p in zip(torch.autograd.grad(value, params, allow_unused=True, retain_graph=True), params)]


def test_image_side_equals_the_plain_computation_with_per_head_masks():
    torch.manual_seed(0)
    model = DeAR(tiny_clip(text_layers=4), varied_roles(), J=2, beta=0.7)  # tokens in blocks 2, 3, 4
    with torch.no_grad():  # trained-looking tokens and P_attr, so every path carries signal
        for p in model.trainable():
            p.add_(0.3 * torch.randn_like(p))
    images = torch.randn(3, 3, 32, 32)
    ours = model.encode_images(images, with_frozen=True)
    ref = plain_images(model, images)
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, atol=1e-6)
    w = torch.randn(3, 1 + K, ours[0].shape[-1])
    value = lambda out: (w[:, 0] * out[0]).sum() + (w[:, 1:] * out[1]).sum()
    g_ours, g_ref = grads(model, value(ours)), grads(model, value(ref))
    assert g_ours[0].abs().max() > 0  # the tokens do reach the features
    for a, b in zip(g_ours, g_ref):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("group_cost", [0, None])
def test_text_side_equals_the_plain_computation(group_cost, monkeypatch):
    """Class names of several lengths that also share a first word (the shared start then reaches into the
    class names), in an order that is not sorted by length; one group per length (group cost 0) and all
    prompts padded into one group whose EOTs sit at three positions (the CPU's group cost)."""
    if group_cost is not None:
        monkeypatch.setitem(clip.model.GROUP_COST, "cpu", group_cost)
    torch.manual_seed(1)
    model = DeAR(tiny_clip(text_layers=4), varied_roles(), J=3, beta=0.6)  # tokens in text blocks 3, 4
    with torch.no_grad():
        for p in model.trainable():
            p.add_(0.3 * torch.randn_like(p))
    for names in (["red fox of the hills", "red cat", "red sea lion", "red ox"], ["dog"]):
        prompts = [f"a photo of a {n}." for n in names]
        model.set_classes(names, "a photo of a {}.")
        if len(names) > 1:  # SOT + "a photo of a red" is shared; three prompt lengths
            assert model.text_shared.shape[1] == 6
            assert len(model.text_groups) == (3 if group_cost == 0 else 1)
            assert sum(len(g[2]) for g in model.text_groups) == 3  # the last block: three EOT rows in all
        t, t0 = plain_classes(model, prompts)
        assert torch.allclose(model.t0, t0, atol=1e-6)
        ours = model.encode_classes()
        assert torch.allclose(ours, t, atol=1e-6)
        w = torch.randn_like(t)
        for a, b in zip(grads(model, (w * ours).sum()), grads(model, (w * t).sum())):
            assert torch.allclose(a, b, atol=1e-6)
    assert model.text_shared.shape[1] == len(clip.tokenize(["a photo of a dog."])[0].nonzero()) - 1  # all but EOT

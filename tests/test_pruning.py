"""DeAR's shortcuts give DeAR's plain computation: the last block computes only the rows read
(CLS and the K tokens; CLS for f^0), the text start shared by every prompt runs once, prompts run in
groups of similar length, and blocks 1..J-1 run once. The reference is dear.reference_forward: every
position, every block, prompts padded to 77 tokens, features read afterwards."""

import pytest
import torch
import torch.nn.functional as F

import clip
import clip.model
from conftest import tiny_clip
from dear import K, DeAR, reference_classes, reference_forward, reference_images

H = 4  # heads per block of the tiny CLIP


def varied_roles(layers=range(1, 5)):
    """Per-head roles that differ from block to block,
    so every block has a different per-head mask."""
    kinds = [
        {"role": "generalization", "attribute": None},
        {"role": "attribute", "attribute": "color"},
        {"role": "mixed", "attribute": None},
        {"role": "specialist", "attribute": None},
        {"role": "attribute", "attribute": "shape"},
    ]
    return {l: [kinds[(l + h) % len(kinds)] for h in range(H)] for l in layers}


def grads(model, value):
    params = (
        [model.tokens.R, model.P_attr]
        + list(model.tokens.F_v.parameters())
        + list(model.tokens.F_t.parameters())
    )
    return [
        g if g is not None else torch.zeros_like(p)
        for g, p in zip(
            torch.autograd.grad(value, params, allow_unused=True, retain_graph=True), params
        )
    ]


def test_image_side_equals_the_plain_computation_with_per_head_masks():
    torch.manual_seed(0)
    # tokens in blocks 2, 3, 4
    model = DeAR(tiny_clip(text_layers=4), varied_roles(), J=2, beta=0.7)
    with torch.no_grad():  # trained-looking tokens and P_attr, so every path carries signal
        for p in model.trainable():
            p.add_(0.3 * torch.randn_like(p))
    images = torch.randn(3, 3, 32, 32)
    ours = model.encode_images(images, with_frozen=True)
    ref = reference_images(model, images)
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
    """Class names of several lengths that also share a first word (the shared start then reaches
    into the class names), in an order that is not sorted by length; one group per length (group
    cost 0) and all prompts padded into one group whose EOTs sit at three positions (the CPU's group
    cost)."""
    if group_cost is not None:
        monkeypatch.setitem(clip.model.GROUP_COST, "cpu", group_cost)
    torch.manual_seed(1)
    # tokens in text blocks 3, 4
    model = DeAR(tiny_clip(text_layers=4), varied_roles(), J=3, beta=0.6)
    with torch.no_grad():
        for p in model.trainable():
            p.add_(0.3 * torch.randn_like(p))
    for names in (["red fox of the hills", "red cat", "red sea lion", "red ox"], ["dog"]):
        model.set_classes(names, "a photo of a {}.")
        if len(names) > 1:  # SOT + "a photo of a red" is shared; three prompt lengths
            assert model.text_shared.shape[1] == 6
            assert len(model.text_groups) == (3 if group_cost == 0 else 1)
            assert (
                sum(len(g[2]) for g in model.text_groups) == 3
            )  # the last block: three EOT rows in all
            # each group is padded to its longest prompt, no further (not one position past EOT)
            eot = model.prompt_tokens.argmax(-1)  # [C]
            S = model.text_shared.shape[1]
            for idx, x, _, _ in model.text_groups:
                assert x.shape[1] == int(eot[idx].max()) + 1 - S
        t, t0 = reference_classes(model)
        assert torch.allclose(model.t0, t0, atol=1e-6)
        ours = model.encode_classes()
        assert torch.allclose(ours, t, atol=1e-6)
        w = torch.randn_like(t)
        for a, b in zip(grads(model, (w * ours).sum()), grads(model, (w * t).sum())):
            assert torch.allclose(a, b, atol=1e-6)
    # all but EOT
    assert model.text_shared.shape[1] == len(clip.tokenize(["a photo of a dog."])[0].nonzero()) - 1


def test_the_frozen_feature_runs_its_last_block_on_cls_alone():
    """Shortcut 1 for f^0: the last block computes the CLS row only, [B, 1, D]. Every row (rows
    None or slice(0, 2)) gives the same f^0 at up to 1+P times the cost, so no value test can see
    it. f^0 is frozen: no autograd even when its input has a graph."""
    model = DeAR(tiny_clip(text_layers=4), varied_roles(), J=2, beta=0.7)
    shapes = []
    last = model.clip.visual.transformer.resblocks[-1]
    hook = last.register_forward_hook(lambda m, args, out: shapes.append(tuple(out.shape)))
    x = model.frozen_prefix(torch.randn(3, 3, 32, 32))  # [3, 1 + 16, 64]
    f0 = model.frozen_feature(x.requires_grad_())
    hook.remove()
    assert shapes == [(3, 1, 64)]
    assert f0.shape == (3, 32) and not f0.requires_grad


def test_prompts_are_tokenized_to_the_models_context_length():
    """A text tower of 16 positions (the toy CLIP's): prompt_tokens [C, 16], and a prompt longer
    than 16 tokens is refused by the tokenizer (tokenizing to CLIP's usual 77 lets it through)."""
    model = DeAR(tiny_clip(text_layers=4, context_length=16), varied_roles(), J=2, beta=0.7)
    model.set_classes(["cat", "sea lion"], "a photo of a {}.")
    assert tuple(model.prompt_tokens.shape) == (2, 16)
    with pytest.raises(ValueError, match="context length 16"):
        model.set_classes(
            ["a very long name of a rather rare breed of red sea lion"], "a photo of {}."
        )


def perturbed(model, seed):
    """Trained-looking tokens, aligners, P_attr and fusion weights, so every path carries signal."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable():
            p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("attr_tokens", [True, False])
def test_forward_equals_reference_forward(attr_tokens):
    """The whole forward (Figure 2 with its four shortcuts) against the plain computation: class
    names of several lengths whose prompts share a start, non-uniform images, beta 0.7, roles that
    differ per block and per head, trained-looking weights; every output, t^0, and the gradients of
    the fused logits."""
    model = perturbed(
        DeAR(tiny_clip(text_layers=4), varied_roles(), J=2, beta=0.7, attr_tokens=attr_tokens),
        seed=4,
    )
    model.set_classes(
        ["red fox of the hills", "cat", "red sea lion", "ox", "dog_house"], "a photo of a {}."
    )
    images = torch.randn(3, 3, 32, 32) * torch.linspace(0.2, 2.0, 32)  # no two pixels alike
    ours, ref = model(images, with_frozen=True), reference_forward(model, images)
    keys = ("logits", "fused", "f_cls", "f0", "t") + (("f_attr",) if attr_tokens else ())
    assert set(ours) == set(keys) and ours["logits"].shape == (3, 1 + K if attr_tokens else 1, 5)
    for k in keys:
        assert torch.allclose(ours[k], ref[k], atol=1e-5), k
    assert torch.allclose(model.t0, ref["t0"], atol=1e-6)
    if attr_tokens:  # f^0 only when asked (zero-shot: f^0 is the image feature)
        assert model(images)["f0"] is None and reference_forward(model, images, False)["f0"] is None
        w = torch.randn_like(ours["fused"])
        g_ours, g_ref = (
            grads(model, (w * ours["fused"]).sum()),
            grads(model, (w * ref["fused"]).sum()),
        )
        assert g_ours[0].abs().max() > 0
        for a, b in zip(g_ours, g_ref):
            assert torch.allclose(a, b, atol=1e-5)


def test_text_side_in_half_precision_keeps_the_towers_dtype():
    """A half-precision text tower (the fp16/bf16 evaluation's frozen weights): the fp32 text tokens
    are cast to the tower's dtype before they enter, in the plain computation as in encode_classes,
    and both agree."""
    model = perturbed(DeAR(tiny_clip(text_layers=4), varied_roles(), J=3, beta=0.6), seed=2)
    model.clip.half()
    model.set_classes(["red fox", "cat", "sea lion"], "a photo of a {}.")
    t, t0 = reference_classes(model)
    ours = model.encode_classes()
    assert t.dtype == ours.dtype == torch.float16
    assert torch.allclose(ours.float(), t.float(), atol=3e-3)
    assert torch.allclose(model.t0.float(), t0.float(), atol=3e-3)
    assert (t.float() - t0.float()).abs().max() > 0.05  # the tokens do change t


def test_text_side_without_tokens_is_the_frozen_text_feature():
    """--no-attr-tokens: the plain computation's t is read at EOT itself (no K-place shift) and
    equals t^0 and encode_classes (the frozen features), for prompts of several lengths."""
    model = DeAR(tiny_clip(text_layers=4), None, J=2, attr_tokens=False)
    model.set_classes(["red fox of the hills", "cat", "sea lion"], "a photo of a {}.")
    t, t0 = reference_classes(model)
    assert torch.allclose(t, t0, atol=1e-6)
    assert torch.allclose(t, model.encode_classes(), atol=1e-5)


def test_last_block_computes_only_the_rows_read():
    """Shortcut 1 on the image side: token_blocks returns CLS and the K tokens only, [B, 1+K, D],
    with the values of the plain computation's first 1+K rows."""
    model = perturbed(DeAR(tiny_clip(text_layers=4), varied_roles(), J=2, beta=0.7), seed=3)
    images = torch.randn(2, 3, 32, 32)
    x = model.token_blocks(model.frozen_prefix(images))
    assert x.shape == (2, 1 + K, model.clip.visual.transformer.width)
    f_cls, f_attr, _ = reference_images(model, images)
    assert torch.allclose(F.normalize(model.clip.visual.head(x[:, 0]), dim=-1), f_cls, atol=1e-5)

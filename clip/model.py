"""CLIP's ViT image tower and text transformer (openai/CLIP d05afc4 `clip/model.py`), batch-first.

Module and parameter names equal the keys of OpenAI's checkpoints, so released weights load
strictly. What differs from OpenAI's code, all numerically neutral: attention is written by hand and
takes an additive mask per head; the towers expose seams (embed / run_blocks / head, embed_text /
run_text_blocks / text_head); the last block computes only the rows that are read (`rows`); texts
run in groups of similar length (`length_buckets`); a text block can attend to `past` positions
shared by every text. Blocks count from 0 and ranges exclude their end: `run_blocks(x, 0, 3)` runs
blocks 0, 1, 2.
"""

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.LayerNorm):
    """LayerNorm in fp32 whatever the input's dtype (as CLIP), cast back."""

    def forward(self, x):
        w, b = self.weight.float(), self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class MultiheadAttention(nn.Module):
    """Batch-first self-attention with nn.MultiheadAttention's parameter names.

    attn_mask is additive (0 = allowed, -inf = blocked): [L, L] for all, [H, L, L] per head, or
    [B, H, L, L] per image and head (nn.MultiheadAttention would read a 3-D mask as [B*H, L, L]).
    """

    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))  # rows: q, k, v
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d_model))
        self.out_proj = nn.Linear(d_model, d_model)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, x, attn_mask=None, need_weights=False, rows=None, past=None):
        """x [B, L, D] -> [B, R, D] (and the weights [B, H, R, S] with need_weights).
        rows: the positions whose output is wanted (a slice or index; None: all); queries come only
        from them, keys and values from all of x. past [1 or B, P, D]: layer-normed positions before
        x that give keys and values only; the mask's columns count them first ([.., R, P + L])."""
        B, L, D = x.shape
        H, W, b = self.n_head, self.in_proj_weight, self.in_proj_bias
        if rows is None and past is None:
            q, k, v = F.linear(x, W, b).split(D, dim=-1)  # [B, L, D] each
        else:
            k, v = F.linear(x, W[D:], b[D:]).split(D, dim=-1)  # [B, L, D] each
            q = F.linear(x if rows is None else x[:, rows], W[:D], b[:D])  # [B, R, D]: rows read
        if past is not None:
            kp, vp = F.linear(past, W[D:], b[D:]).expand(B, -1, -1).split(D, dim=-1)  # [B, P, D]
            k, v = torch.cat([kp, k], dim=1), torch.cat([vp, v], dim=1)  # [B, S = P + L, D]
        R, S = q.shape[1], k.shape[1]
        q = q.view(B, R, H, D // H).transpose(1, 2)  # [B, H, R, hs]
        k = k.view(B, S, H, D // H).transpose(1, 2)  # [B, H, S, hs]
        v = v.view(B, S, H, D // H).transpose(1, 2)  # [B, H, S, hs]
        if attn_mask is not None:
            assert attn_mask.is_floating_point(), "attn_mask is additive (0 or -inf), not bool"
            attn_mask = attn_mask.to(q)  # q's dtype and device
            attn_mask = attn_mask if rows is None else attn_mask[..., rows, :]
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.dim() == 3 else attn_mask  # SDPA: 4-D
        if need_weights:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // H))  # [B, H, R, S]
            att = (att if attn_mask is None else att + attn_mask).softmax(dim=-1)
            y = att @ v  # [B, H, R, hs]
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # the same, fused
        y = self.out_proj(y.transpose(1, 2).reshape(B, R, D))  # heads side by side: [B, R, D]
        return (y, att) if need_weights else y


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.attn = MultiheadAttention(d_model, n_head)
        self.ln_1 = LayerNorm(d_model)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(d_model, d_model * 4)),
                                              ("gelu", QuickGELU()),
                                              ("c_proj", nn.Linear(d_model * 4, d_model))]))
        self.ln_2 = LayerNorm(d_model)

    def forward(self, x, attn_mask=None, rows=None, past=None):
        """x [B, L, D] -> [B, R, D]: only the rows asked for (attention still reads every
        position)."""
        past = None if past is None else self.ln_1(past)
        y = self.attn(self.ln_1(x), attn_mask, rows=rows, past=past)
        x = (x if rows is None else x[:, rows]) + y
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width, layers, heads):
        super().__init__()
        self.width, self.layers, self.heads = width, layers, heads
        self.resblocks = nn.ModuleList(ResidualAttentionBlock(width, heads) for _ in range(layers))

    def forward(self, x, attn_mask=None, start=0, end=None, rows=None):
        """Blocks start..end-1 on x [B, L, D]; the last computes only `rows` -> [B, R, D]."""
        blocks = self.resblocks[start:end]
        if not blocks:
            return x if rows is None else x[:, rows]
        for block in blocks[:-1]:
            x = block(x, attn_mask)
        return blocks[-1](x, attn_mask, rows=rows)


class VisionTransformer(nn.Module):
    def __init__(self, input_resolution, patch_size, width, layers, heads, output_dim):
        super().__init__()
        self.input_resolution = input_resolution
        self.patch_size = patch_size
        self.output_dim = output_dim
        self.width, self.layers, self.heads = width, layers, heads
        self.num_patches = (input_resolution // patch_size) ** 2
        scale = width**-0.5
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn(self.num_patches + 1, width))
        self.ln_pre = LayerNorm(width)
        self.transformer = Transformer(width, layers, heads)
        self.ln_post = LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, output_dim))

    def embed(self, images):
        """[B, 3, R, R] -> tokens [B, 1+P, D]: class token, patches, positions, ln_pre."""
        x = self.conv1(images.to(self.conv1.weight.dtype))  # [B, D, grid, grid]
        x = x.flatten(2).transpose(1, 2)  # [B, P, D]
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)  # [B, 1, D]
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)  # [B, 1+P, D]
        return self.ln_pre(x)

    def run_blocks(self, x, start, end, attn_mask=None, rows=None):
        """Blocks start..end-1 on tokens [B, L, D] (L may exceed 1+P); rows=slice(0, 1): CLS."""
        return self.transformer(x, attn_mask, start, end, rows)

    def head(self, tokens):
        """ln_post, then the projection: [..., D] -> [..., E]."""
        return self.ln_post(tokens) @ self.proj

    def forward(self, images):
        x = self.run_blocks(self.embed(images), 0, self.layers, rows=slice(0, 1))  # [B, 1, D]: CLS
        return self.head(x[:, 0])  # [B, E]


class CLIP(nn.Module):
    def __init__(self, embed_dim, image_resolution, vision_layers, vision_width, vision_patch_size,
                 context_length, vocab_size, transformer_width, transformer_heads,
                 transformer_layers, vision_heads=None):
        super().__init__()
        self.context_length = context_length
        vision_heads = vision_heads or vision_width // 64
        self.visual = VisionTransformer(image_resolution, vision_patch_size, vision_width,
                                        vision_layers, vision_heads, embed_dim)
        self.transformer = Transformer(transformer_width, transformer_layers, transformer_heads)
        self.vocab_size = vocab_size
        self.token_embedding = nn.Embedding(vocab_size, transformer_width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, transformer_width))
        self.ln_final = LayerNorm(transformer_width)
        self.text_projection = nn.Parameter(torch.empty(transformer_width, embed_dim))
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))
        self.initialize_parameters()

    def initialize_parameters(self):
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        for tower in (self.transformer, self.visual.transformer):
            attn_std = tower.width**-0.5
            proj_std = attn_std * (2 * tower.layers) ** -0.5
            fc_std = (2 * tower.width) ** -0.5
            for block in tower.resblocks:
                nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
                nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
                nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
                nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        nn.init.normal_(self.text_projection, std=self.transformer.width**-0.5)

    def causal_mask(self, n, past=0):
        """[n, past + n]: -inf above the diagonal (a token sees only its past); the first `past`
        keys, shared positions before the text, are all visible."""
        device = self.positional_embedding.device
        return torch.full((n, past + n), float("-inf"), device=device).triu(past + 1)

    def embed_text(self, tokens):
        """Token ids [C, T] (T <= context_length) -> [C, T, W]."""
        x = self.token_embedding(tokens.long())  # [C, T, W]
        return x + self.positional_embedding[: tokens.shape[-1]].to(x.dtype)

    def run_text_blocks(self, x, start, end, rows=None, past=None):
        """Text blocks start..end-1 on x [C, T, W] under the causal mask; the last computes only
        `rows`. past [1, P, W]: block `start`'s input at P positions before x shared by every text
        (one block only, since past changes with the block)."""
        if past is None:
            return self.transformer(x, self.causal_mask(x.shape[1]), start, end, rows)
        assert end == start + 1, "past holds one block's input"
        mask = self.causal_mask(x.shape[1], past.shape[1])
        return self.transformer.resblocks[start](x, mask, rows, past)

    def text_head(self, x, eot_index):
        """ln_final, each text's feature at its EOT, projection: [C, T, W] -> [C, E]."""
        x = self.ln_final(x)
        eot = x[torch.arange(x.shape[0], device=x.device), eot_index.to(x.device)]  # [C, W]
        return eot @ self.text_projection

    def encode_image(self, image):
        return self.visual(image)

    def encode_text(self, text):
        # EOT (49407) is the largest id, so argmax finds it. Texts run padded only to their
        # group's longest (padding follows EOT, so the causal mask never lets it in); the last
        # block computes the EOTs.
        eot = text.argmax(dim=-1)
        feats, order = [], []
        for n, idx, rows, pick in length_buckets(eot):  # text idx[i] reads row pick[i] of rows
            x = self.embed_text(text[idx, : n + 1])
            x = self.run_text_blocks(x, 0, self.transformer.layers, rows=rows)
            feats.append(self.text_head(x, pick))  # [c, E]
            order.append(idx)
        return torch.cat(feats)[torch.cat(order).argsort()]  # [C, E], in the order of `text`

    def similarity(self, image_features, text_features):
        """[B, E], [C, E] -> logits per image [B, C]: scaled cosine similarity."""
        image_features = F.normalize(image_features, dim=-1)
        text_features = F.normalize(text_features, dim=-1)
        return self.logit_scale.exp() * image_features @ text_features.t()

    def forward(self, image, text):
        logits_per_image = self.similarity(self.encode_image(image), self.encode_text(text))
        return logits_per_image, logits_per_image.t()


# What one more group of texts costs, in padded token positions. CPU: measured at ViT-B/16's text
# width, one thread, about 35 positions (each matmul reads its weights once per group). CUDA: about
# 20 kernel launches per block, worth thousands of positions, so texts mostly run as one batch (an
# estimate).
GROUP_COST = {"cpu": 40, "cuda": 4096}


def length_buckets(eot, group_cost=None):
    """Group texts by EOT position: [(n, idx [c], rows [r], pick [c])], n the group's largest EOT,
    rows its distinct EOTs, rows[pick[i]] the EOT of text idx[i]; groups of ever longer texts. The
    split is the cheapest for sum over groups of (texts x (n + 1) + group_cost) (GROUP_COST of eot's
    device by default), found by dynamic programming over the sorted lengths (at most 77)."""
    if group_cost is None:
        group_cost = GROUP_COST.get(eot.device.type, GROUP_COST["cuda"])
    lengths, counts = eot.unique(return_counts=True)
    lengths = lengths.tolist()
    upto = [0] + counts.cumsum(0).tolist()  # upto[j]: texts of lengths[:j]
    best = [0]  # best[j]: cost of lengths[:j]
    first = []  # first[j]: the first length of the group ending at j
    for j, n in enumerate(lengths):
        cost = [best[i] + (upto[j + 1] - upto[i]) * (n + 1) + group_cost for i in range(j + 1)]
        first.append(min(range(j + 1), key=cost.__getitem__))
        best.append(cost[first[-1]])
    groups, j = [], len(lengths) - 1
    while j >= 0:  # read the groups back from the longest
        i = first[j]
        idx = ((eot >= lengths[i]) & (eot <= lengths[j])).nonzero().squeeze(1)
        rows, pick = eot[idx].unique(return_inverse=True)
        groups.insert(0, (lengths[j], idx, rows, pick))
        j = i - 1
    return groups


# what OpenAI's archives (the first three) and tiny checkpoints (head counts) hold besides weights
EXTRA_KEYS = ("input_resolution", "context_length", "vocab_size", "vision_heads", "text_heads")


def build_model(state_dict):
    """A ViT CLIP sized from the state dict (openai/CLIP `build_model`), loaded strictly, fp32, in
    eval mode. Heads: a stored 0-dim `vision_heads`/`text_heads` entry, else width // 64 (OpenAI's
    rule), refused where the width is not a multiple of 64."""
    sd = state_dict
    if any(k.startswith("visual.layer1.") for k in sd):
        raise ValueError("DeAR needs attention heads: ResNet CLIPs are not supported")
    vision_width, _, _, patch = sd["visual.conv1.weight"].shape
    grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    text_width = sd["ln_final.weight"].shape[0]
    for key, width in (("vision_heads", vision_width), ("text_heads", text_width)):
        if key not in sd and width % 64:  # OpenAI's rule would give a wrong count
            raise ValueError(f"width {width} is not a multiple of 64, and no {key} is given")
    vision_layers = len([k for k in sd if k.startswith("visual.") and k.endswith("in_proj_weight")])
    text_layers = len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.")})
    with torch.device("meta"):  # shapes only: every value comes from the state dict
        model = CLIP(embed_dim=sd["text_projection"].shape[1], image_resolution=patch * grid,
                     vision_layers=vision_layers, vision_width=vision_width,
                     vision_patch_size=patch, context_length=sd["positional_embedding"].shape[0],
                     vocab_size=sd["token_embedding.weight"].shape[0], transformer_width=text_width,
                     transformer_heads=int(sd.get("text_heads", text_width // 64)),
                     transformer_layers=text_layers,
                     vision_heads=int(sd.get("vision_heads", vision_width // 64)))
    # fp32 copies, so the model never shares memory with the caller's tensors
    weights = {k: v.to(torch.float32, copy=True) for k, v in sd.items() if k not in EXTRA_KEYS}
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval()

"""CLIP ViT image tower and text transformer, written in plain PyTorch.

Module and parameter names equal the keys of OpenAI's released checkpoints
(`visual.conv1.weight`, `visual.transformer.resblocks.0.attn.in_proj_weight`,
`token_embedding.weight`, ...), so a released state dict loads with `strict=True`.

Differences from OpenAI's reference code, all numerically neutral:
- tensors are batch-first ([batch, tokens, width]) everywhere;
- attention is written by hand (`MultiheadAttention`) and takes an additive mask
  broadcastable to [batch, heads, L, L], so every head can get its own mask;
- the towers expose seams (embed / run_blocks / head and embed_text / run_text_blocks /
  text_head); `encode_image` and `encode_text` are these seams composed;
- exact savings: the last block computes only the rows that are read (`rows`: CLS, or EOT), and
  texts run in groups of similar length padded only to the group's longest (`length_buckets`); a
  block can also attend to `past` positions shared by a whole batch of texts (DeAR's common template
  start).

Blocks are counted from 0 here; `run_blocks(x, start, end)` runs blocks start..end-1.
"""

import math
from collections import OrderedDict
from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

Mask = Optional[Union[torch.Tensor, List[Optional[torch.Tensor]]]]
Rows = Optional[Union[slice, torch.Tensor]]  # positions whose output a block computes (None: all)


class LayerNorm(nn.LayerNorm):
    """LayerNorm that always computes in fp32 and casts the result back (as CLIP does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        out = F.layer_norm(
            x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps
        )
        return out.to(dtype)


class QuickGELU(nn.Module):
    """The sigmoid approximation of GELU that CLIP was trained with (not nn.GELU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class MultiheadAttention(nn.Module):
    """Self-attention with the parameter names of nn.MultiheadAttention, batch-first.

    attn_mask is additive (0 = allowed, -inf = blocked) and broadcastable to [B, H, L, L]:
    [L, L] is shared by everything, [H, L, L] gives each head its own mask, [B, H, L, L]
    gives each image and head its own mask. (Note: nn.MultiheadAttention reads a 3-D mask as
    [B*H, L, L]; here a 3-D mask is per head.)
    """

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError(f"width {d_model} is not divisible by the number of heads {n_head}")
        self.d_model = d_model
        self.n_head = n_head
        # rows [0:D) project to queries, [D:2D) to keys, [2D:3D) to values;
        # head h owns rows h*hs..(h+1)*hs-1
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d_model))
        self.out_proj = nn.Linear(d_model, d_model)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        need_weights: bool = False,
        rows: Rows = None,
        past: Optional[torch.Tensor] = None,
    ):
        """x [B, L, D] -> [B, R, D]. rows: None (every position, R = L) or the positions whose
        output is wanted (a slice or 1-D index): keys and values still come from all of x, queries
        only from those rows. past [1 or B, P, D]: positions that precede x (already layer-normed);
        they give keys and values only, and mask columns count them first (the mask is
        [.., R, P + L])."""
        B, L, D = x.shape
        H = self.n_head
        hs = D // H
        W, b = self.in_proj_weight, self.in_proj_bias
        if rows is None and past is None:
            q, k, v = F.linear(x, W, b).split(D, dim=-1)  # 3 x [B, L, D]
        else:
            k, v = F.linear(x, W[D:], b[D:]).split(D, dim=-1)  # 2 x [B, L, D]
            # [B, R, D]: only the rows read later
            q = F.linear(x if rows is None else x[:, rows], W[:D], b[:D])
            if past is not None:  # the shared positions before x: their keys and values go first
                kp, vp = F.linear(past, W[D:], b[D:]).split(D, dim=-1)  # 2 x [1 or B, P, D]
                k = torch.cat([kp.expand(B, -1, -1), k], dim=1)  # [B, P + L, D]
                v = torch.cat([vp.expand(B, -1, -1), v], dim=1)
        R, S = q.shape[1], k.shape[1]
        q = q.view(B, R, H, hs).transpose(1, 2)  # [B, H, R, hs]
        k = k.view(B, S, H, hs).transpose(1, 2)  # [B, H, S, hs]
        v = v.view(B, S, H, hs).transpose(1, 2)  # [B, H, S, hs]
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                raise TypeError(
                    "attn_mask must be an additive float mask (0 = allowed, -inf = blocked), "
                    "not a bool mask"
                )
            attn_mask = attn_mask.to(dtype=q.dtype, device=q.device)
            if rows is not None:
                attn_mask = attn_mask[..., rows, :]  # only the query rows that are computed
            if (
                attn_mask.dim() == 3
            ):  # per-head [H, R, S] -> [1, H, R, S]: the fused kernels take 2-D or 4-D masks
                attn_mask = attn_mask.unsqueeze(0)
        if need_weights:
            # the plain path: softmax(Q K^T / sqrt(hs) + mask) V, keeping the weights
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # [B, H, R, S]
            if attn_mask is not None:
                att = att + attn_mask
            att = att.softmax(dim=-1)
            y = att @ v  # [B, H, R, hs]
        else:
            # the same math through PyTorch's fused kernel
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [B, H, R, hs]
        y = y.transpose(1, 2).reshape(B, R, D)  # heads side by side again: [B, R, D]
        out = self.out_proj(y)
        return (out, att) if need_weights else out


class ResidualAttentionBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.attn = MultiheadAttention(d_model, n_head)
        self.ln_1 = LayerNorm(d_model)
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(d_model, d_model * 4)),
                    ("gelu", QuickGELU()),
                    ("c_proj", nn.Linear(d_model * 4, d_model)),
                ]
            )
        )
        self.ln_2 = LayerNorm(d_model)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        rows: Rows = None,
        past: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x [B, L, D] -> [B, R, D]. rows: compute only these output positions (the attention still
        reads every position; the MLP runs on the rows alone). past [1 or B, P, D]: this block's
        input at P positions that precede x, shared by the batch; x attends to them (see
        MultiheadAttention)."""
        h = self.ln_1(x)
        hp = None if past is None else self.ln_1(past)
        x = (x if rows is None else x[:, rows]) + self.attn(
            h, attn_mask=attn_mask, rows=rows, past=hp
        )
        x = x + self.mlp(self.ln_2(x))
        return x


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int):
        super().__init__()
        self.width = width
        self.layers = layers
        self.heads = heads
        self.resblocks = nn.ModuleList(
            [ResidualAttentionBlock(width, heads) for _ in range(layers)]
        )

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Mask = None,
        start: int = 0,
        end: Optional[int] = None,
        rows: Rows = None,
    ):
        """Run blocks start..end-1 (0-based) on x [B, L, D].

        attn_mask: None, one tensor used by every block, or a list with one entry (tensor or None)
        per block that runs. rows: the positions of the output that will be read (None: all); the
        last block computes only those (its keys and values still need every position), giving
        [B, R, D].
        """
        end = self.layers if end is None else end
        if not 0 <= start <= end <= self.layers:
            raise ValueError(f"blocks {start}..{end} (end exclusive) are outside 0..{self.layers}")
        blocks = self.resblocks[start:end]
        if isinstance(attn_mask, (list, tuple)):
            if len(attn_mask) != len(blocks):
                raise ValueError(
                    f"got {len(attn_mask)} masks for {len(blocks)} blocks ({start}..{end - 1}); "
                    "give one per block, or a single tensor for all"
                )
            masks = list(attn_mask)
        else:
            masks = [attn_mask] * len(blocks)
        if rows is not None and not blocks:
            x = x[:, rows]
        for i, (block, mask) in enumerate(zip(blocks, masks)):
            x = block(x, attn_mask=mask, rows=rows if i == len(blocks) - 1 else None)
        return x


def normal(init: bool, std: float, *shape: int) -> nn.Parameter:
    """A parameter drawn std * N(0, 1) (OpenAI's init); with init False only its shape
    (torch.empty): build_model overwrites every value, and a draw on the meta device would load
    torch._dynamo."""
    return nn.Parameter(std * torch.randn(*shape) if init else torch.empty(*shape))


class VisionTransformer(nn.Module):
    def __init__(
        self,
        input_resolution: int,
        patch_size: int,
        width: int,
        layers: int,
        heads: int,
        output_dim: int,
        init: bool = True,
    ):
        super().__init__()
        if input_resolution % patch_size != 0:
            raise ValueError(
                f"image size {input_resolution} is not a multiple of the patch size {patch_size}"
            )
        self.input_resolution = input_resolution
        self.patch_size = patch_size
        self.width = width
        self.heads = heads
        self.layers = layers
        self.output_dim = output_dim
        self.num_patches = (input_resolution // patch_size) ** 2
        scale = width**-0.5
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.class_embedding = normal(init, scale, width)
        self.positional_embedding = normal(init, scale, self.num_patches + 1, width)
        self.ln_pre = LayerNorm(width)
        self.transformer = Transformer(width, layers, heads)
        self.ln_post = LayerNorm(width)
        self.proj = normal(init, scale, width, output_dim)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, R, R] -> tokens [B, 1+P, D]: patches, class token, positions, ln_pre."""
        if images.dim() != 4 or images.shape[-2:] != (self.input_resolution, self.input_resolution):
            raise ValueError(
                f"expected images of shape [B, 3, {self.input_resolution}, "
                f"{self.input_resolution}], got {list(images.shape)}; use the model's preprocess "
                "transform"
            )
        x = self.conv1(images.to(self.conv1.weight.dtype))  # [B, D, grid, grid]
        x = x.flatten(2).transpose(1, 2)  # [B, P, D]
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)  # [B, 1, D]
        x = torch.cat([cls, x], dim=1)  # [B, 1+P, D]
        x = x + self.positional_embedding.to(x.dtype)
        return self.ln_pre(x)

    def run_blocks(
        self, x: torch.Tensor, start: int, end: int, attn_mask: Mask = None, rows: Rows = None
    ) -> torch.Tensor:
        """Run blocks start..end-1 (0-based) on tokens [B, L, D]; L may exceed 1+P (extra tokens).
        rows: the output positions that will be read, e.g. slice(0, 1) for CLS: the last block
        computes only those, [B, R, D] (Transformer.forward)."""
        return self.transformer(x, attn_mask=attn_mask, start=start, end=end, rows=rows)

    def head(self, tokens: torch.Tensor) -> torch.Tensor:
        """ln_post then the projection; tokens [..., D] -> [..., E] (e.g. the CLS token [B, D])."""
        return self.ln_post(tokens) @ self.proj

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # [B, 1, D]: only CLS is read
        x = self.run_blocks(self.embed(images), 0, self.layers, rows=slice(0, 1))
        return self.head(x[:, 0])  # the CLS token -> [B, E]


class CLIP(nn.Module):
    def __init__(
        self,
        embed_dim: int,
        image_resolution: int,
        vision_layers: int,
        vision_width: int,
        vision_patch_size: int,
        context_length: int,
        vocab_size: int,
        transformer_width: int,
        transformer_heads: int,
        transformer_layers: int,
        vision_heads: Optional[int] = None,
        init: bool = True,
    ):
        """init False: shapes only, no random draws (build_model, which loads every value)."""
        super().__init__()
        self.context_length = context_length
        self.vocab_size = vocab_size
        vision_heads = vision_heads or vision_width // 64
        self.visual = VisionTransformer(
            input_resolution=image_resolution,
            patch_size=vision_patch_size,
            width=vision_width,
            layers=vision_layers,
            heads=vision_heads,
            output_dim=embed_dim,
            init=init,
        )
        self.transformer = Transformer(
            width=transformer_width, layers=transformer_layers, heads=transformer_heads
        )
        shape = (vocab_size, transformer_width)
        # (_weight: an Embedding that skips its own normal_ init)
        self.token_embedding = nn.Embedding(*shape, _weight=None if init else torch.empty(shape))
        self.positional_embedding = nn.Parameter(torch.empty(context_length, transformer_width))
        self.ln_final = LayerNorm(transformer_width)
        self.text_projection = nn.Parameter(torch.empty(transformer_width, embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        if init:
            self.initialize_parameters()

    def initialize_parameters(self):
        """CLIP's initialisation of the text side and of all transformer blocks."""
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

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.conv1.weight.dtype

    def causal_mask(self, n: int, past: int = 0) -> torch.Tensor:
        """[n, past + n] additive mask: 0 where a key is not later than the query, -inf after it (a
        token sees only its past). past: that many earlier positions come first among the keys (all
        of them visible)."""
        device = self.positional_embedding.device
        return torch.full((n, past + n), float("-inf"), device=device).triu(past + 1)

    def embed_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [C, T] (T <= context_length) -> [C, T, W]: token embedding + positions."""
        T = tokens.shape[-1]
        if T > self.context_length:
            raise ValueError(
                f"got {T} tokens per text, the model takes at most {self.context_length}"
            )
        x = self.token_embedding(tokens.long())  # [C, T, W]
        return x + self.positional_embedding[:T].to(x.dtype)

    def run_text_blocks(
        self,
        x: torch.Tensor,
        start: int,
        end: int,
        attn_mask: Mask = None,
        rows: Rows = None,
        past: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run text blocks start..end-1 on x [C, T', W]; attn_mask None means causal over T'.
        rows: output positions the last block computes (None: all), e.g. slice(T'-1, T') for an EOT
        at the end. past [1, P, W]: block `start`'s input at P positions that come before x and are
        the same for every text (a shared template start); x attends to them causally. One block
        only, as past changes with the block."""
        if past is not None:
            if end != start + 1:
                raise ValueError(f"past states belong to one block; got blocks {start}..{end - 1}")
            # [T', P + T']
            mask = self.causal_mask(x.shape[1], past.shape[1]) if attn_mask is None else attn_mask
            return self.transformer.resblocks[start](x, attn_mask=mask, rows=rows, past=past)
        if attn_mask is None:
            attn_mask = self.causal_mask(x.shape[1])
        return self.transformer(x, attn_mask=attn_mask, start=start, end=end, rows=rows)

    def text_head(self, x: torch.Tensor, eot_index: torch.Tensor) -> torch.Tensor:
        """ln_final, take each text's feature at its EOT position, project: [C, T', W] -> [C, E]."""
        x = self.ln_final(x)
        x = x[torch.arange(x.shape[0], device=x.device), eot_index.to(x.device)]  # [C, W]
        return x @ self.text_projection

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.visual(images)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [C, T] -> text features [C, E], read at each text's EOT.
        Texts run in groups of similar length, padded only to their group's longest (the causal mask
        never lets padding reach EOT; length_buckets), and the last block computes only the EOT
        positions: same features, far fewer FLOPs."""
        # EOT (49407) is the largest id, so argmax finds it; padding is 0
        eot = tokens.argmax(dim=-1)
        feats, order = [], []
        for n, idx, rows, pick in length_buckets(
            eot
        ):  # EOTs at rows (<= n); text i reads row pick[i]
            x = self.embed_text(tokens[idx, : n + 1])  # [c, n + 1, W]
            # [c, r, W]: EOT rows only
            x = self.run_text_blocks(x, 0, self.transformer.layers, rows=rows)
            feats.append(self.text_head(x, pick))  # [c, E]
            order.append(idx)
        return torch.cat(feats)[torch.cat(order).argsort()]  # back in the order of `tokens`

    def similarity(self, image_out: torch.Tensor, text_out: torch.Tensor) -> torch.Tensor:
        """Tower outputs [B, E] and [C, E] -> logits per image [B, C]: scaled cosine similarity."""
        image_features = F.normalize(image_out, dim=-1)
        text_features = F.normalize(text_out, dim=-1)
        return self.logit_scale.exp() * image_features @ text_features.t()

    def forward(self, images: torch.Tensor, tokens: torch.Tensor):
        logits_per_image = self.similarity(self.encode_image(images), self.encode_text(tokens))
        return logits_per_image, logits_per_image.t()


# What running one more group of texts costs, in padded token positions (see length_buckets). CPU:
# measured at ViT-B/16's text width on one thread, one more group costs about as much as 35 more
# positions (every matmul reads its weights once per group, worth 20-25 rows, plus the other ops),
# so a few short texts are cheaper padded into their neighbours' group. CUDA: every group adds about
# 20 kernel launches per block, worth thousands of positions on a GPU, so texts mostly run as one
# padded batch (an estimate, not measured).
GROUP_COST = {"cpu": 40, "cuda": 4096}


def length_buckets(eot: torch.Tensor, group_cost: Optional[int] = None):
    """Group texts to run padded only to their group's longest: [(n, indices [c], rows [r], pick
    [c])] with n = the group's largest EOT position, rows = its distinct EOT positions (the rows the
    last block computes) and pick = the row of each text in rows; groups of ever longer texts.

    Padding comes after a text's EOT, so under the causal mask it never reaches the EOT: exact.
    Which lengths share a group is the cheapest split for cost = sum over groups of (texts x (n + 1)
    + group_cost): one group per length when group_cost is 0, all texts padded to the longest when
    it is large. group_cost None: GROUP_COST of the device. Dynamic programming over the sorted
    lengths (at most 77 of them)."""
    if group_cost is None:
        group_cost = GROUP_COST.get(eot.device.type, GROUP_COST["cuda"])
    lengths, counts = eot.unique(return_counts=True)  # sorted EOT positions, texts at each
    lengths, upto = (
        lengths.tolist(),
        [0] + counts.cumsum(0).tolist(),
    )  # upto[j]: texts of lengths[:j]
    best, start = (
        [0],
        [],
    )  # best[j]: cheapest cost of the texts of lengths[:j]; start[j]: first length of
    for j in range(len(lengths)):  # the group that ends with lengths[j]; it holds lengths[i..j]
        cost = [
            best[i] + (upto[j + 1] - upto[i]) * (lengths[j] + 1) + group_cost for i in range(j + 1)
        ]
        start.append(min(range(j + 1), key=cost.__getitem__))
        best.append(cost[start[-1]])
    groups, j = [], len(lengths) - 1
    while j >= 0:  # read the groups back from the longest
        i = start[j]
        idx = ((eot >= lengths[i]) & (eot <= lengths[j])).nonzero().squeeze(1)
        rows, pick = eot[idx].unique(return_inverse=True)  # [r], [c]
        groups.append((lengths[j], idx, rows, pick))
        j = i - 1
    return groups[::-1]


# entries a checkpoint may carry besides the weights: OpenAI's TorchScript archives add the first
# three; tiny checkpoints add the head counts, which cannot be read from the shapes
EXTRA_KEYS = ("input_resolution", "context_length", "vocab_size", "vision_heads", "text_heads")
# The widths of OpenAI's published ViT checkpoints (ViT-B/32 and B/16: vision 768, text 512;
# ViT-L/14 and L/14@336px: vision 1024, text 768). Their heads are 64 wide (width / 64), the rule
# OpenAI's build_model applies; any other width needs its head count stored in the state dict.
OPENAI_WIDTHS = {"vision_heads": (768, 1024), "text_heads": (512, 768)}


def head_count(sd: dict, key: str, width: int) -> int:
    """The number of heads of a tower of `width`: the 0-dim whole number sd[key] when stored (it
    must divide the width), else width / 64 for OpenAI's published widths. ValueError otherwise."""
    tower = "vision" if key == "vision_heads" else "text"
    if key not in sd:
        if width in OPENAI_WIDTHS[key]:
            return width // 64
        raise ValueError(
            f"the state dict has no {key!r} entry and its {tower} width {width} is "
            f"none of OpenAI's {OPENAI_WIDTHS[key]} (whose heads are width/64), so "
            f"its number of heads cannot be known; add {key!r}: "
            "torch.tensor(HEADS) (a 0-dim integer) to it"
        )
    v = sd[key]
    n = v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else None
    if not isinstance(n, (int, float)) or isinstance(n, bool) or n != int(n) or n < 1:
        raise ValueError(
            f"{key!r} must be a 0-dim tensor holding a positive whole number, not {v!r}"
        )
    if width % int(n):
        raise ValueError(
            f"{key!r} is {int(n)}, which does not divide the {tower} width {width}; "
            "the checkpoint's head count and its weights disagree"
        )
    return int(n)


def infer_config(state_dict: dict) -> dict:
    """Read every size of a ViT CLIP from the tensors of its state dict (CLIP constructor
    arguments)."""
    sd = state_dict
    if "visual.proj" not in sd:
        if any(k.startswith("visual.layer1.") or k.startswith("visual.attnpool.") for k in sd):
            raise NotImplementedError(
                "ResNet CLIP checkpoints (RN50, RN101, RN50x4, ...) are not supported; "
                "use a ViT model such as ViT-B/16"
            )
        raise ValueError("this state dict is not a CLIP ViT checkpoint (no 'visual.proj' entry)")
    missing = [
        k
        for k in (
            "visual.conv1.weight",
            "visual.positional_embedding",
            "text_projection",
            "positional_embedding",
            "token_embedding.weight",
            "ln_final.weight",
        )
        if k not in sd
    ]
    if missing:
        raise ValueError(f"this state dict is not a complete CLIP checkpoint; missing {missing}")
    vision_width = sd["visual.conv1.weight"].shape[0]
    patch = sd["visual.conv1.weight"].shape[-1]
    grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    vision_layers = sum(
        1 for k in sd if k.startswith("visual.") and k.endswith(".attn.in_proj_weight")
    )
    text_width = sd["ln_final.weight"].shape[0]
    text_layers = len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.")})

    return dict(
        embed_dim=sd["text_projection"].shape[1],
        image_resolution=patch * grid,
        vision_layers=vision_layers,
        vision_width=vision_width,
        vision_patch_size=patch,
        context_length=sd["positional_embedding"].shape[0],
        vocab_size=sd["token_embedding.weight"].shape[0],
        transformer_width=text_width,
        transformer_heads=head_count(sd, "text_heads", text_width),
        transformer_layers=text_layers,
        vision_heads=head_count(sd, "vision_heads", vision_width),
    )


def build_model(state_dict: dict) -> CLIP:
    """A CLIP with every size inferred from `state_dict`, loaded strictly, in fp32 and eval mode."""
    config = infer_config(state_dict)
    # fp32 copies, so the model never shares memory with (or mutates) the caller's tensors
    sd = {k: v.to(torch.float32, copy=True) for k, v in state_dict.items() if k not in EXTRA_KEYS}
    with torch.device("meta"):  # shapes only: the random init would be overwritten anyway
        model = CLIP(**config, init=False)
    model.load_state_dict(sd, strict=True, assign=True)  # the copies become the parameters
    return model.eval()

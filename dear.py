"""DeAR: Fine-Grained VLM Adaptation by Decomposing Attention Head Roles (CVPR 2026).

A reference reproduction in plain PyTorch. This file is the method; read it top to bottom:

  1. Attribute tokens: one shared matrix R, per-block aligners F_v / F_t, beta mixing
  2. role_mask: the role-based per-head attention mask of one vision block
  3. The DeAR module: DeAR.forward is the paper's Figure 2, one named step a line, and
     reference_forward the same computation written plainly (no shortcut), side by side
  4. The loss: CE(fused) + lambda_reg * self-regularisation + lambda_fusion * -log alpha_cls
  5. The command line: `main` reads a Config (config.py) and hands it to runs.run with the method

Layers, from the top: dear.py (the method, `main`) -> runs.py (one run: its folder, what it reads,
results.json; the method is handed to it as `make_model` / `make_loss`) -> config.py (Config, the
per-dataset tables, resolve, the flags) -> train.py (MMRL's training loop and evaluation, nothing
DeAR-specific) and entropy.py (the head roles, Concept Entropy).

The paper counts blocks from 1 (J = 9: tokens enter block 9 of 12), and so do the flags and the
roles file. Code indexes blocks from 0: `DeAR.__init__` converts J once (`self.first = J - 1`), and
`block_masks` reads the 1-based roles with `roles[b + 1]`. Every design choice the paper leaves open
is a flag; see README.md, "Where this reproduction had to choose".
"""

import copy
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads; see BENCH.md
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import clip
import runs
from clip.model import length_buckets
from config import Config, parse_args, resolve  # noqa: F401  (resolve: run_all.sh's dear.resolve)
from runs import run_dir  # noqa: F401  run_all.sh asks dear.py where a run writes (dear.run_dir)

ATTRIBUTES = ("color", "shape", "texture", "object", "location")
K = len(ATTRIBUTES)  # number of attribute tokens, one per attribute, in this order

# ----------------------------------------------------------------------------------------------
# 1. Attribute tokens


class AttributeTokens(nn.Module):
    """The learnable attribute tokens: one shared matrix R [K, rep_dim] and, for every block l in
    J..L, a vision aligner F_v^l: rep_dim -> D and a text aligner F_t^l: rep_dim -> W. Vision and
    text tokens are projections of the same R, which couples the two modalities. As in MMRL, one
    aligner of each kind is initialised and copied to every block: all F_v^l start identical, and so
    do all F_t^l (they are trained apart)."""

    def __init__(self, n_blocks: int, rep_dim: int, vision_width: int, text_width: int):
        super().__init__()
        self.R = nn.Parameter(torch.randn(K, rep_dim) * 0.02)
        # nn.Linear's default initialisation
        F_v, F_t = nn.Linear(rep_dim, vision_width), nn.Linear(rep_dim, text_width)
        self.F_v = nn.ModuleList([copy.deepcopy(F_v) for _ in range(n_blocks)])
        self.F_t = nn.ModuleList([copy.deepcopy(F_t) for _ in range(n_blocks)])

    def vision(self, i: int) -> torch.Tensor:
        return self.F_v[i](self.R)  # [K, D]: the tokens fed to the i-th block after insertion

    def text(self, i: int) -> torch.Tensor:
        return self.F_t[i](self.R)  # [K, W]


def insert(x: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Put the K tokens right after the first token (CLS, or SOT): [B, 1 + K + rest, D]."""
    return torch.cat([x[:, :1], fresh.unsqueeze(0).expand(x.shape[0], -1, -1), x[:, 1:]], dim=1)


def mix(x: torch.Tensor, fresh: torch.Tensor, beta: float) -> torch.Tensor:
    """beta mixing of the token slots x[:, 1:1+K]: beta * F^l(R) + (1 - beta) * (their output of
    block l-1). x: [B, L, D]; fresh: [K, D]. A new tensor (no in-place write, simple autograd)."""
    tokens = beta * fresh.unsqueeze(0) + (1.0 - beta) * x[:, 1 : 1 + K]  # [B, K, D]
    return torch.cat([x[:, :1], tokens, x[:, 1 + K :]], dim=1)


# ----------------------------------------------------------------------------------------------
# 2. The role-based attention mask


def role_mask(head_roles, num_patches: int, variant: str = "role") -> torch.Tensor:
    """The additive mask [H, L, L] of one vision block, L = 1 + K + num_patches, token order
    [CLS, attr_1..attr_K, patches]; row = query, column = key; 0 = allowed, -inf = blocked.

    - generalization head (and an "other specialist": a low-entropy head whose concept is not one of
      the five): the originals (CLS, patches) and the attribute tokens never see each other; each
      attribute token sees only itself. These heads compute exactly what the frozen CLIP computes.
    - attribute head for attribute a: originals <-> attr_a both ways; every other attribute token
      sees only itself and nobody sees it.
    - mixed head: no restriction.
    variant "generalization-only": attribute heads act as mixed; "none": no mask at all (all zeros).
    """
    H, L = len(head_roles), 1 + K + num_patches
    allowed = torch.ones(H, L, L, dtype=torch.bool)
    attr = torch.arange(1, 1 + K)  # positions of the attribute tokens
    orig = torch.tensor([0] + list(range(1 + K, L)))  # CLS and patches
    eye = torch.eye(K, dtype=torch.bool)
    for h, entry in enumerate(head_roles):
        role = entry["role"]
        as_mixed = variant == "generalization-only" and role == "attribute"
        if variant == "none" or role == "mixed" or as_mixed:
            continue
        a = allowed[h]
        a[attr[:, None], :] = False  # attribute rows: nothing ...
        a[:, attr] = False  # ... and attribute columns: nobody,
        a[attr[:, None], attr[None, :]] = eye  # except each token itself.
        if role == "attribute":
            i = 1 + ATTRIBUTES.index(entry["attribute"])
            a[i, orig] = True  # attr_a reads the originals
            a[orig, i] = True  # the originals read attr_a
    mask = torch.zeros(H, L, L)
    return mask.masked_fill(~allowed, float("-inf"))


def block_masks(roles, first: int, num_layers: int, num_patches: int, variant: str):
    """One [H, L, L] mask per block first..num_layers-1 (0-based); None where nothing is masked."""
    if variant == "none":
        return [None] * (num_layers - first)
    # roles count blocks from 1
    return [role_mask(roles[b + 1], num_patches, variant) for b in range(first, num_layers)]


# ----------------------------------------------------------------------------------------------
# 3. The DeAR module


class DeAR(nn.Module):
    """Frozen CLIP + attribute tokens from block J + role masks + trainable P_attr + fusion w.

    forward computes what reference_forward computes, with four shortcuts that change no result:
    1. the last block computes only the rows read afterwards (CLS and the K tokens; CLS for f^0;
       EOT for text); 2. the start shared by every prompt (SOT and the template's first words) runs
    once per block; 3. prompts run in groups of similar length, padded only to their group's
    longest; 4. blocks 1..J-1 run once for f^0 and f_cls, and once per class list for the text."""

    def __init__(
        self,
        clip_model,
        roles,
        J=9,
        beta=0.9,
        rep_dim=512,
        mask="role",
        attr_tokens=True,
        alpha_cls=0.7,
    ):
        super().__init__()
        self.clip = clip_model.eval()
        for p in self.clip.parameters():
            p.requires_grad_(False)
        visual, L = clip_model.visual, clip_model.visual.transformer.layers
        if not 1 <= J <= L:
            raise ValueError(f"J must lie in 1..{L} (the backbone has {L} blocks), got {J}")
        self.J, self.first, self.L = J, J - 1, L  # first: block J, counted from 0
        self.beta, self.use_tokens = beta, attr_tokens
        n = L - self.first  # blocks with tokens: J..L of the vision tower, the text tower's last n
        self.Lt = clip_model.transformer.layers
        self.first_text = self.Lt - n  # equals J - 1 when both towers are equally deep (ViT-B)
        if self.first_text < 0:
            raise ValueError(
                f"J = {J} puts tokens in {n} blocks, but the text tower has only {self.Lt}"
            )
        widths = visual.transformer.width, clip_model.transformer.width
        self.tokens = AttributeTokens(n, rep_dim, *widths)
        self.P_attr = nn.Parameter(visual.proj.detach().clone())  # [D, E], starts as a copy of proj
        # fusion weights w, alpha = softmax(w): alpha_cls for the class logits, the rest shared
        w = torch.tensor([alpha_cls] + [(1 - alpha_cls) / K] * K).log()
        self.w = nn.Parameter(w)
        masks = [None] * n
        if attr_tokens:
            masks = block_masks(roles, self.first, L, visual.num_patches, mask)
        for i, m in enumerate(masks):  # buffers: .to(device) moves them; not saved in checkpoints
            self.register_buffer(f"mask_{i}", m, persistent=False)
        if not attr_tokens:  # nothing but the fusion weights would remain: the model is frozen CLIP
            for p in self.trainable():
                p.requires_grad_(False)

    def trainable(self):
        return [p for name, p in self.named_parameters() if not name.startswith("clip.")]

    def trainable_state(self):
        return {k: v for k, v in self.state_dict().items() if not k.startswith("clip.")}

    def alpha(self) -> torch.Tensor:
        return self.w.softmax(0)  # [1 + K]: alpha_cls, alpha_color, ...

    def fusion_weights(self) -> dict:
        """alpha by name, as results.json records it: {"cls": .., "color": .., ...}."""
        return dict(zip(("cls",) + ATTRIBUTES, self.alpha().tolist()))

    def set_beta(self, beta: float):
        """The token mixing beta of the next forward passes (an evaluation may use another beta than
        training: the xd targets); nothing is rebuilt, the token blocks read self.beta."""
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must lie in [0, 1], got {beta}")
        self.beta = float(beta)

    # --- the forward pass: Figure 2 ---------------------------------------------------------------
    def forward(self, images, t=None, with_frozen=False):
        """Figure 2, one step a line. images [B, 3, R, R]; t [C, E]: the class features, if already
        computed (an evaluation computes them once), else encode_classes(). with_frozen: also f^0
        (for the loss). Returns the six logit sets [B, 1+K, C] (class first, then the K tokens), the
        fused logits [B, C] and the features the loss reads. The towers may run under autocast; the
        head is fp32."""
        scale = self.clip.logit_scale
        t = self.encode_classes() if t is None else t  # [C, E]     t: text tokens in J..L
        x = self.frozen_prefix(images)  # [B, 1+P, D]  blocks 1..J-1, frozen
        f0 = self.frozen_feature(x) if with_frozen or not self.use_tokens else None  # [B, E]  f^0
        if not self.use_tokens:  # zero-shot CLIP: f^0 alone
            logits, feats, t = cosine_logits(f0.unsqueeze(1), t, scale)  # [B, 1, C]
            return {
                "logits": logits,
                "fused": logits[:, 0],
                "f_cls": feats[:, 0],
                "f0": f0.float(),
                "t": t,
            }
        x = self.token_blocks(x)  # [B, 1+K, D]  tokens from J, role masks
        f_cls, f_attr = self.image_features(x)  # [B, E], [B, K, E]
        feats = torch.cat([f_cls.unsqueeze(1), f_attr], 1)  # [B, 1+K, E]
        logits, feats, t = cosine_logits(feats, t, scale)  # [B, 1+K, C]  the six logit sets
        fused = fuse(logits, self.alpha())  # [B, C]       sum_k alpha_k logits_k
        return {
            "logits": logits,
            "fused": fused,
            "f_cls": feats[:, 0],
            "f_attr": feats[:, 1:],
            "f0": None if f0 is None else f0.float(),
            "t": t,
        }

    # --- the image side --------------------------------------------------------------------------
    # The frozen parts run under `with torch.no_grad()`, not the decorator: mutmut (mutate.sh) skips
    # decorated functions.
    def frozen_prefix(self, images):
        """Embedding and blocks 1..J-1 of the frozen vision tower: [B, 3, R, R] -> [B, 1+P, D]."""
        visual = self.clip.visual
        with torch.no_grad():  # blocks 1..J-1 never change: no autograd
            return visual.run_blocks(visual.embed(images), 0, self.first)

    def frozen_feature(self, x):
        """f^0 [B, E]: the frozen CLIP image feature, blocks J..L without tokens on the prefix x
        (shortcut 1: the last block computes CLS alone), normalised. The stream keeps the prefix's
        dtype."""
        visual = self.clip.visual
        with torch.no_grad():
            cls = visual.run_blocks(x, self.first, self.L, rows=slice(0, 1))[:, 0]  # [B, D]
            return F.normalize(visual.head(cls), dim=-1)

    def token_blocks(self, x):
        """Blocks J..L with the attribute tokens: inserted after CLS at block J, mixed with beta
        from J+1, each block under its role mask. [B, 1+P, D] -> [B, 1+K, D] (CLS and the K tokens:
        shortcut 1, the last block computes only these rows). As in MMRL the tokens are fp32 and so
        is the stream from block J on (under autocast the matmuls still run in half precision;
        residual adds and LayerNorm inputs are fp32), whatever the prefix's dtype."""
        x = x.float()
        for i, b in enumerate(range(self.first, self.L)):
            fresh = self.tokens.vision(i).float()  # [K, D]
            x = insert(x, fresh) if i == 0 else mix(x, fresh, self.beta)  # [B, 1+K+P, D]
            rows = slice(0, 1 + K) if b == self.L - 1 else None  # last block: [B, 1+K, D]
            mask = getattr(self, f"mask_{i}")  # [H, 1+K+P, 1+K+P] or None
            x = self.clip.visual.run_blocks(x, b, b + 1, attn_mask=mask, rows=rows)
        return x

    def image_features(self, x):
        """f_cls [B, E] (CLS through the frozen ln_post and proj) and f_attr [B, K, E] (the K tokens
        through ln_post and the trainable P_attr), normalised. x [B, 1+K, D]."""
        f_cls = self.clip.visual.head(x[:, 0])  # [B, E]
        f_attr = self.clip.visual.ln_post(x[:, 1 : 1 + K]) @ self.P_attr.to(x.dtype)  # [B, K, E]
        return F.normalize(f_cls, dim=-1), F.normalize(f_attr, dim=-1)

    def encode_images(self, images, with_frozen=False):
        """The image tower of forward alone: f_cls, f_attr and f^0 (None unless with_frozen)."""
        x = self.frozen_prefix(images)
        f0 = self.frozen_feature(x) if with_frozen or not self.use_tokens else None
        if not self.use_tokens:
            return f0, None, f0
        return (*self.image_features(self.token_blocks(x)), f0)

    # --- the text side ---------------------------------------------------------------------------
    def set_classes(self, classnames, template):
        """Everything class-dependent that never changes, computed once per class list: the prompts'
        token ids (prompt_tokens [C, T]), blocks 1..J-1 of every prompt and the frozen text features
        t^0.

        Blocks 1..J-1 are kept in the form encode_classes runs fastest, with the same result:
        - text_shared [1, S, W]: the first S positions, whose token ids are the same in every prompt
          (SOT and the template's first words). Under the causal mask their states are the same for
          every class, so blocks J..L run them once, and every class attends to them (shortcut 2).
        - text_groups: the rest of each prompt in groups padded to their longest (shortcut 3;
          length_buckets): [(indices, [c, n, W], rows [r]: the group's EOT positions, pick [c]: each
          prompt's row in rows)]; the last block computes only the EOT rows (shortcut 1).
        """
        with torch.no_grad():
            prompts = [template.format(c.replace("_", " ")) for c in classnames]
            device = self.P_attr.device
            m = self.clip
            tokens = clip.tokenize(prompts, context_length=m.context_length).to(device)  # [C, T]
            eot = tokens.argmax(-1)  # [C] EOT has the largest id
            same = (tokens == tokens[:1]).all(0).long().cumprod(0)  # [T] 1 while all prompts agree
            S = min(int(same.sum()), int(eot.min()))  # keep at least EOT per class
            groups, t0, order = [], [], []
            for n, idx, rows, pick in length_buckets(eot):  # EOTs at rows [r] (<= n)
                x = m.run_text_blocks(m.embed_text(tokens[idx, : n + 1]), 0, self.first_text)
                frozen = m.run_text_blocks(x, self.first_text, self.Lt, rows=rows)  # [c, r, W]
                t0.append(m.text_head(frozen, pick))  # [c, E]
                groups.append((idx, x[:, S:], rows - S, pick))  # [c, n + 1 - S, W]
                order.append(idx)
                self.text_shared = x[:1, :S]  # [1, S, W], equal in every group
            self.text_groups = groups
            self.text_order = torch.cat(order).argsort()  # group order -> class order
            self.t0 = F.normalize(torch.cat(t0)[self.text_order], dim=-1)  # [C, E]
            self.prompt_tokens, self.classnames = tokens, list(classnames)

    def encode_classes(self) -> torch.Tensor:
        """t [C, E]: the class text features with the K text tokens after SOT in blocks J..L,
        normalised. The shared start runs once per block and every class group attends to it
        (causal: the start never sees the class name); the last block computes only EOT."""
        if not self.use_tokens:
            return self.t0
        m, groups = self.clip, self.text_groups
        shared = self.text_shared  # [1, S, W]: [SOT, common words]
        parts = [x for _, x, _, _ in groups]  # [c, n, W]: the rest of a prompt
        for i, b in enumerate(range(self.first_text, self.Lt)):
            fresh = self.tokens.text(i).to(shared.dtype)  # [K, W]
            # [1, S + K, W]: [SOT, t_1..t_K, common words]; the tokens see SOT and earlier tokens,
            # the words after them see them
            shared = insert(shared, fresh) if i == 0 else mix(shared, fresh, self.beta)
            last = b == self.Lt - 1
            parts = [
                m.run_text_blocks(x, b, b + 1, rows=g[2] if last else None, past=shared)
                for x, g in zip(parts, groups)
            ]  # causal over [shared, x]
            if not last:
                shared = m.run_text_blocks(shared, b, b + 1)
        t = torch.cat([m.text_head(x, g[3]) for x, g in zip(parts, groups)])  # [C, E]
        return F.normalize(t[self.text_order], dim=-1)


def cosine_logits(feats, t, logit_scale):
    """logits = s * cos(f, t) [B, S, C], s = exp(logit_scale), in fp32 outside autocast, in training
    and evaluation alike. feats [B, S, E] (f_cls then f_attr, or f_cls alone), t [C, E]: features
    that may come out of autocast in half precision, cast to fp32 and normalised again: CLIP's
    logits are about 100 cos, 20-35, where bf16 steps are 0.125-0.25 (fp16 0.016-0.03), so in half
    precision close classes would tie or swap. Returns the logits and the fp32 features."""
    with torch.autocast(feats.device.type, enabled=False):
        feats = F.normalize(feats.float(), dim=-1)  # [B, S, E]
        t = F.normalize(t.float(), dim=-1)  # [C, E]
        return logit_scale.float().exp() * feats @ t.t(), feats, t  # [B, S, C]


def fuse(logits, alpha):
    """The fused logits sum_k alpha_k logits_k [B, C] of the six logit sets [B, 1+K, C], in fp32."""
    with torch.autocast(logits.device.type, enabled=False):
        return torch.einsum("k,bkc->bc", alpha.float(), logits.float())


# ----------------------------------------------------------------------------------------------
# The plain computation: forward without its shortcuts (tests/test_pruning.py: they change nothing)


def reference_forward(model, images, with_frozen=True):
    """What forward computes, written plainly: every block computes every position, every prompt
    runs whole, padded to the context length, through every block; f^0 and t^0 are computed from
    scratch. Returns forward's dict, plus "t0"."""
    t, t0 = reference_classes(model)
    f_cls, f_attr, f0 = reference_images(model, images)
    if not model.use_tokens:
        logits, feats, t = cosine_logits(f0.unsqueeze(1), t0, model.clip.logit_scale)
        return {
            "logits": logits,
            "fused": logits[:, 0],
            "f_cls": feats[:, 0],
            "f0": f0,
            "t": t,
            "t0": t0,
        }
    feats = torch.cat([f_cls.unsqueeze(1), f_attr], 1)  # [B, 1+K, E]
    logits, feats, t = cosine_logits(feats, t, model.clip.logit_scale)
    return {
        "logits": logits,
        "fused": fuse(logits, model.alpha()),
        "f_cls": feats[:, 0],
        "f_attr": feats[:, 1:],
        "f0": f0 if with_frozen else None,
        "t": t,
        "t0": t0,
    }


def reference_images(model, images):
    """f_cls [B, E], f_attr [B, K, E] and f^0 [B, E], normalised: every block on every position."""
    visual = model.clip.visual
    x = visual.embed(images)  # [B, 1+P, D]
    f0 = F.normalize(visual.head(visual.run_blocks(x, 0, model.L)[:, 0]), dim=-1)
    for b in range(model.L):
        i = b - model.first  # < 0: before block J
        if i >= 0:
            fresh = model.tokens.vision(i).float()  # [K, D]
            x = insert(x.float(), fresh) if i == 0 else mix(x, fresh, model.beta)  # [B, 1+K+P, D]
        mask = getattr(model, f"mask_{i}") if i >= 0 else None
        x = visual.run_blocks(x, b, b + 1, attn_mask=mask)  # every position
    if not model.use_tokens:
        return f0, None, f0
    f_cls = F.normalize(visual.head(x[:, 0]), dim=-1)
    f_attr = F.normalize(visual.ln_post(x[:, 1 : 1 + K]) @ model.P_attr, dim=-1)
    return f_cls, f_attr, f0


def reference_classes(model):
    """t [C, E] and t^0 [C, E], normalised: each prompt of set_classes, padded to the context
    length, through every text block on every position (causal), the K tokens after SOT from block J
    on."""
    m, tokens = model.clip, model.prompt_tokens  # [C, T]
    x = m.embed_text(tokens)  # [C, T, W]
    t0 = F.normalize(m.text_head(m.run_text_blocks(x, 0, model.Lt), tokens.argmax(-1)), dim=-1)
    for b in range(model.Lt):
        i = b - model.first_text
        if i >= 0 and model.use_tokens:
            fresh = model.tokens.text(i).to(x.dtype)  # [K, W]
            x = insert(x, fresh) if i == 0 else mix(x, fresh, model.beta)  # [C, T + K, W]
        x = m.run_text_blocks(x, b, b + 1)
    shift = K if model.use_tokens else 0  # tokens move EOT K places
    return F.normalize(m.text_head(x, tokens.argmax(-1) + shift), dim=-1), t0


# ----------------------------------------------------------------------------------------------
# 4. The loss


def dear_loss(out, labels, t0, alpha, lambda_reg, lambda_fusion):
    """CE(fused, y) + lambda_reg * [(1 - cos(f_cls, f^0)) + (1 - cos(t, t^0))] + lambda_fusion *
    -log alpha_cls, in fp32 outside autocast. Returns the total and its parts (0-dim tensors on the
    device: reading them waits for it, which the training loop does only at log lines)."""
    with torch.autocast(labels.device.type, enabled=False):
        ce = F.cross_entropy(out["fused"].float(), labels)
        reg_img = 1 - F.cosine_similarity(out["f_cls"].float(), out["f0"].float(), dim=-1).mean()
        reg_txt = 1 - F.cosine_similarity(out["t"].float(), t0.float(), dim=-1).mean()
        fusion = -alpha[0].float().log()
        total = ce + lambda_reg * (reg_img + reg_txt) + lambda_fusion * fusion
    parts = {"ce": ce, "reg_img": reg_img, "reg_txt": reg_txt, "fusion": fusion}
    return total, {k: v.detach() for k, v in parts.items()}


def make_model(clip_model, roles, cfg: Config) -> DeAR:
    """The model of a run (runs.run calls it with the backbone and the head roles it loaded)."""
    return DeAR(
        clip_model,
        roles,
        J=cfg.J,
        beta=cfg.beta,
        rep_dim=cfg.rep_dim,
        mask=cfg.mask,
        attr_tokens=cfg.method == "dear" and cfg.attr_tokens,
        alpha_cls=cfg.alpha_cls,
    )


def make_loss(cfg: Config):
    """The DeAR loss with a run's weights, as train.train calls it: loss_fn(model, out, labels)."""

    def loss_fn(model, out, labels):
        return dear_loss(out, labels, model.t0, model.alpha(), cfg.lambda_reg, cfg.lambda_fusion)

    return loss_fn


# ----------------------------------------------------------------------------------------------
# 5. The command line


def main(argv=None):
    cfg = parse_args(argv)
    try:
        if cfg.roles_only:
            return runs.export_roles(cfg)
        results = runs.run(cfg, make_model, make_loss)
    except runs.USER_ERRORS as e:  # a problem the user can fix: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except runs.Interrupted as e:
        print(f"\n{e}", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:  # outside a run folder (the roles stage, a toy pretraining)
        print(
            "\ninterrupted: nothing was kept; rerun the same command to start again",
            file=sys.stderr,
        )
        sys.exit(130)
    line = {e["dataset"] + "/" + e["split"]: round(e["accuracy"], 2) for e in results["evals"]}
    if "hm" in results:  # base-to-novel
        line["hm"] = round(results["hm"], 2)
    print(json.dumps(line))


if __name__ == "__main__":
    main()

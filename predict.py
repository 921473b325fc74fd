"""Classify your own images with a finished run, and see what its heads look at.

    python predict.py --load RUN a.jpg b.png                   # the top 5 classes and the evidence
    python predict.py --load RUN --explain maps.png --json a.jpg   # JSON on stdout, a sheet of maps
    python predict.py --load RUN --classes names.txt --template "a toy {}." photo.jpg

The classes are the run's (base and novel for a base-to-novel run, in its config.json), or
--classes with the run's template: a trained model names new classes too, as CLIP does. The run is
rebuilt with its own roles and weights, once they are what it recorded (dear.load_run).
"""

import contextlib
import json
import os
import sys

import data  # before torch: OpenMP's idle threads sleep, and Ctrl-C or SIGTERM is one line
import numpy as np
import torch
from PIL import Image, ImageDraw, PngImagePlugin

import clip
import dear
import runs


def predict(argv):
    parser = data.Parser(description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="+", help="image files")
    parser.add_argument("--load", required=True, help="a finished run folder")
    parser.add_argument("--classes", help="a file of class names, one a line (default: the run's)")
    parser.add_argument("--template", help="the prompt template (default: the run's)")
    parser.add_argument("--explain", help="a new .png (or a sheet written before): "
                        "what CLS and the tokens attend to in block L, on the crop the model saw")
    parser.add_argument("--json", action="store_true", help="JSON alone on stdout, not text")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    a = parser.parse_args(argv)
    saved = runs.read_config(a.load, dear.CONFIG)
    c = dear.resolve(dear.Config(**saved["config"], device=a.device))
    if a.explain and not (c.method == "dear" and c.attr_tokens):
        raise data.UserError(f"--explain: {a.load} has no attribute tokens to explain")
    names = data.read_text(a.classes, "one class name a line") if a.classes else saved["classes"]
    template = a.template or saved["template"]
    data.check_prompts(names, template)
    images = [data.open_image(f, "pass image files (PNG, JPEG, ...)") for f in a.images]
    if a.explain:
        check_sheet_path(a.explain)
    model = dear.load_run(a.load, c, lambda line: print(line, file=sys.stderr))[0]  # then the work
    model.eval().set_classes(names, template)
    preprocess = clip.transform(model.clip.visual.input_resolution)
    x = torch.stack([preprocess(im) for im in images]).to(c.device)
    with torch.no_grad():
        out = model(x)
    keys = ("cls",) + dear.ATTRIBUTES if model.use_tokens else ("cls",)
    alpha = dict(zip(keys, model.alpha().tolist() if model.use_tokens else [1.0]))
    top = out["fused"].softmax(-1).topk(min(5, len(names)))  # [B, 5]
    report = []
    for i, f in enumerate(a.images):
        top5 = [[names[j], p] for p, j in zip(top.values[i].tolist(), top.indices[i].tolist())]
        picks = out["logits"][i].argmax(-1).tolist()  # [1+K]: each logit set's own first
        evidence = {k: {"alpha": alpha[k], "top": names[j]} for k, j in zip(keys, picks)}
        report.append({"image": f, "top5": top5, "evidence": evidence})
        if not a.json:
            print(f + ": " + ", ".join(f"{n} {p:.1%}" for n, p in top5))
            sets = [f"{k} (alpha {v['alpha']:.2f}) {v['top']}" for k, v in evidence.items()]
            print("  by logit set: " + ", ".join(sets))
    if a.explain:
        maps, heads = attention_maps(model, x)  # [B, 1+K, P]
        crops = [clip.crop(model.clip.visual.input_resolution)(im) for im in images]
        titles = [f"{f}: {r['top5'][0][0]} {r['top5'][0][1]:.0%}" for f, r in zip(a.images, report)]
        last = model.roles[-1] if model.roles else None
        draw_explain(titles, crops, maps.cpu(), heads, last, alpha, a.explain)
        print(f"wrote {a.explain}", file=sys.stderr)
    if a.json:
        print(json.dumps(report, indent=1))
    return report


def attention_maps(model, images):
    """What CLS (every head) and each attribute token (its expert heads; the mixed heads where
    it has none) attend to among the patches in the last block: [B, 1+K, P]; and those heads,
    a list per map (empty: no head of the block lets the token see the patches)."""
    last = len(model.blocks) - 1
    with torch.no_grad():
        x = model.token_blocks(model.frozen_prefix(images), stop=last)  # block L's input
        block = model.clip.visual.transformer.resblocks[model.blocks[last]]
        w = block.attn(block.ln_1(x), model.mask(last), need_weights=True)[1]  # [B, H, T, T]
    w = w[:, :, : 1 + dear.K, 1 + dear.K :]  # queries CLS and the tokens, keys the patches
    roles = model.roles[last] if model.roles else [{"role": "mixed"}] * w.shape[1]
    mixed = [h for h, r in enumerate(roles) if r["role"] == "mixed"]
    experts = [[h for h, r in enumerate(roles) if r.get("attribute") == a] for a in dear.ATTRIBUTES]
    heads = [list(range(w.shape[1]))] + [hs or mixed for hs in experts]  # CLS: every head
    none = torch.zeros_like(w[:, 0, 0])  # a token no head lets see the patches: an empty map
    maps = [w[:, hs, k].mean(1) if hs else none for k, hs in enumerate(heads)]
    return torch.stack(maps, 1), heads


# The explain sheet: a colour scale from black through purple and red to
# pale yellow (as matplotlib's "inferno"); on a grey image it cannot be taken for an object's colour
HEAT = np.array([[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], float)
SHEET = "predict.py --explain"  # the PNG text that marks a sheet as one this wrote
TILE = 160


def heat(values):
    """Values in [0, 1] [...] -> RGB colours [..., 3] (uint8) on the HEAT scale."""
    stops = np.linspace(0, 1, len(HEAT))
    return np.stack([np.interp(values, stops, HEAT[:, i]) for i in range(3)], -1).astype(np.uint8)


def check_sheet_path(path):
    """--explain's file: a new .png, or a sheet this wrote before (its PNG text says so); never an
    image given to classify, never any other file of the user's."""
    ours = False
    with (contextlib.suppress(OSError, ValueError, data.UserError),  # none, or unreadable: not ours
          Image.open(data.regular(path, "")) as old):
        ours = old.text.get("Software") == SHEET
    if not path.lower().endswith(".png") or (os.path.lexists(path) and not ours):
        raise data.UserError(f"--explain {path}: give a new .png name, or a sheet this wrote (the "
                             "images to classify come after the flags)")
    data.writable_folder(os.path.dirname(path) or ".")  # made, and proven, before the work


def draw_explain(titles, crops, maps, heads, roles, alpha, path):
    """The --explain sheet, a row per image: its title (file, prediction); the crop the model saw;
    what CLS (all heads) and each token with a head (its expert heads, else the mixed heads)
    attend to among the patches of the last block, a tile each, on the patch grid, the image in
    grey under the heat of each patch's share of the tile's own largest (printed under it); the
    tokens that no head lets see the patches, named once. maps [B, 1+K, P]; heads: the heads of
    each map; roles: the last block's (None: no roles); alpha: {logit set: weight}."""
    shown = [m for m, hs in enumerate(heads) if hs]
    names = ["CLS"] + list(dear.ATTRIBUTES)
    labels = [f"CLS (alpha {alpha['cls']:.2f}): all heads"]
    for m in shown[1:]:
        kind = "head" if roles and roles[heads[m][0]]["role"] == "attribute" else "mixed heads"
        labels.append(f"{names[m]}: {kind} {','.join(map(str, heads[m]))}")
    blind = [names[m] for m, hs in enumerate(heads) if not hs]
    g, height = int(maps.shape[-1] ** 0.5), TILE + 64  # patches a side; a row's pixels
    edges = np.arange(1, g) * TILE // g  # the pixel rows and columns between patches
    scale = Image.fromarray(heat(np.linspace(1, 0, TILE)[:, None].repeat(20, 1)))  # 1 at the top
    page = Image.new("RGB", (TILE * (1 + len(shown)) + 110, height * len(titles)), "white")
    draw = ImageDraw.Draw(page)
    for y, title, crop, row in zip(range(0, page.height, height), titles, crops, maps):
        fit = Image.NEAREST if crop.width < TILE else Image.BICUBIC  # a toy's pixels stay pixels
        image = crop.convert("RGB").resize((TILE, TILE), fit)
        grey = np.asarray(image.convert("L"), dtype=float)[..., None]
        draw.text((4, y + 2), title, fill="black")
        page.paste(image, (0, y + 32))
        draw.text((2, y + 18), "what the model saw", fill="black")
        for i, m in enumerate(shown, 1):
            top = float(row[m].max().clamp_min(1e-12))
            share = Image.fromarray((row[m].view(g, g) / top).numpy().astype(np.float32))
            share = np.asarray(share.resize((TILE, TILE), Image.NEAREST))  # a patch: one block
            tile = (0.35 * grey + 0.65 * heat(share)).astype(np.uint8)
            tile[edges] = tile[:, edges] = 255  # the patch grid, in white
            page.paste(Image.fromarray(tile), (i * TILE, y + 32))
            draw.text((i * TILE + 2, y + 18), labels[i - 1], fill="black")
            draw.text((i * TILE + 2, y + 34 + TILE), f"top patch {100 * top:.1f}%", fill="black")
        if blind:
            note = "no head of the last block lets these see the patches: " + ", ".join(blind)
            draw.text((2, y + 48 + TILE), note, fill="black")
        x = TILE * (1 + len(shown)) + 8
        page.paste(scale, (x, y + 32))
        draw.text((x + 24, y + 32), "the tile's\ntop patch", fill="black")
        draw.text((x + 24, y + 20 + TILE), "0", fill="black")
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", SHEET)
    data.atomic_write(path, lambda tmp: page.save(tmp, format="PNG", pnginfo=info))


def main(argv=None):
    return data.guarded(predict, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()

"""The readable forms of a roles file: roles.md (a blocks x heads table, every head's concept shares
and texts, and the ground-truth table where the probe images have known factors) and roles.png (a
map: colour = role, letter = attribute, entropy in every cell).

Used by entropy.py, which writes roles.json and calls these; reads nothing but the roles document (a
dict in the roles.json format) and imports only util.py.
"""

import io

from util import write_atomic


def best_factor(skills):
    """The factor with the highest skill and its margin over the runner-up: (name, margin);
    skills {name: s}."""
    ranked = sorted(skills.items(), key=lambda kv: -kv[1])
    return ranked[0][0], ranked[0][1] - (ranked[1][1] if len(ranked) > 1 else 0.0)


def short_role(head):
    """Cell label of a head: 'A:color', 'S:animal', 'G', 'M'."""
    if head["role"] == "attribute":
        return "A:" + head["attribute"]
    if head["role"] == "specialist":
        return "S:" + head.get("concept", "?")
    return head["role"][0].upper()


def render_markdown(doc):
    """roles.md: a layers x heads table of roles and entropies, then every head's P and texts."""
    H = doc["num_heads"]
    by_pos = {(h["layer"], h["head"]): h for h in doc["heads"]}
    probe = doc["probe"]
    lines = [
        f"# Head roles of {doc['model']} (blocks {', '.join(map(str, doc['layers']))})",
        "",
        f"Probe: {probe.get('dataset')} {probe.get('split')}, {probe.get('images')} images. "
        f"TextSpan: {doc['texts_per_head']} texts per head, rank {doc['rank']}. Thresholds: low "
        f"{doc['thresholds']['low']:.3f} bits, high {doc['thresholds']['high']:.3f} bits.",
        "",
        "A = attribute head (its attribute), G = generalization, M = mixed, S = other specialist "
        "(its concept); the number is the concept entropy in bits.",
        "",
        "| block | " + " | ".join(f"head {h}" for h in range(H)) + " |",
        "|---" * (H + 1) + "|",
    ]
    for layer in doc["layers"]:
        cells = [
            f"{short_role(by_pos[(layer, h)])} {by_pos[(layer, h)]['entropy']:.2f}"
            for h in range(H)
        ]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    if "decoding" in doc:
        lines += decoding_markdown(doc)
    lines += ["", "## Heads", ""]
    for h in doc["heads"]:
        share = ", ".join(
            f"{c} {p:.2f}" for c, p in sorted(h["P"].items(), key=lambda kv: -kv[1]) if p > 0
        )
        truth = ""
        if "decoding" in h:
            truth = " Decoded (held-out accuracy): " + ", ".join(
                f"{f} {100 * a:.0f}%" for f, a in h["decoding"].items()
            )
        lines += [
            f"**Block {h['layer']}, head {h['head']}**: {short_role(h)}, H = {h['entropy']:.3f} "
            f"bits ({share}).{truth}",
            "",
            "; ".join(h["texts"]),
            "",
        ]
    return "\n".join(lines)


def decoding_markdown(doc):
    """The ground-truth table of roles.md: per head,
    the held-out probe accuracy of every known factor."""
    H, chance = doc["num_heads"], doc["decoding"]["chance"]
    by_pos = {(h["layer"], h["head"]): h for h in doc["heads"]}
    lines = [
        "",
        "## Ground truth: what each head's contribution encodes",
        "",
        f"Held-out accuracy (%) of a linear probe ({doc['decoding']['probe']}) that reads each "
        "known factor from the head's direct contribution; chance: "
        + ", ".join(f"{f} {100 * c:.0f}%" for f, c in chance.items())
        + ". Best = the factor with the highest skill, (accuracy - chance) / (1 - chance), and its "
        "lead in skill over the runner-up.",
        "",
        "| block | head | role | " + " | ".join(chance) + " | best (lead) |",
        "|---" * (len(chance) + 4) + "|",
    ]
    for layer in doc["layers"]:
        for h in range(H):
            head = by_pos[(layer, h)]
            best, lead = best_factor(head["skill"])
            lines.append(
                f"| {layer} | {h} | {short_role(head)} | "
                + " | ".join(f"{100 * head['decoding'][f]:.0f}" for f in chance)
                + f" | {best} (+{lead:.2f}) |"
            )
    return lines


ROLE_COLORS = {
    "attribute": (230, 145, 56),
    "generalization": (61, 133, 198),
    "mixed": (170, 170, 170),
    "specialist": (142, 103, 184),
}
CELL, LEFT, TOP, LEGEND = 56, 48, 24, 28  # PNG geometry in pixels


def cell_origin(row, col):
    """Top-left pixel of the cell of the row-th analysed block and head col in roles.png."""
    return LEFT + col * CELL, TOP + row * CELL


def render_png(doc, path):
    """roles.png: analysed blocks (rows) x heads (columns); colour = role, letter = attribute,
    the entropy in bits in every cell, a legend below (Pillow's default font). Where the file has
    ground truth (toy world), each cell also shows its two best-decoded factors with their held-out
    accuracy, e.g. "C97%"."""
    from PIL import Image, ImageDraw, ImageFont

    H, layers = doc["num_heads"], doc["layers"]
    by_pos = {(h["layer"], h["head"]): h for h in doc["heads"]}
    width = max(LEFT + H * CELL, 4 * 120) + 8
    height = TOP + len(layers) * CELL + LEGEND
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    for col in range(H):
        draw.text((LEFT + col * CELL + 4, 6), f"h{col}", fill="black", font=font)
    for row, layer in enumerate(layers):
        draw.text((6, TOP + row * CELL + CELL // 2 - 6), f"L{layer}", fill="black", font=font)
        for col in range(H):
            head = by_pos[(layer, col)]
            x0, y0 = cell_origin(row, col)
            draw.rectangle([x0, y0, x0 + CELL - 2, y0 + CELL - 2], fill=ROLE_COLORS[head["role"]])
            # attribute heads: C S T O L; other specialists: their concept's first letters
            letter = (
                head["attribute"][0].upper() if head["attribute"] else head.get("concept", "")[:3]
            )
            draw.text((x0 + 5, y0 + 4), letter, fill="black", font=font)
            if "skill" not in head:
                draw.text((x0 + 5, y0 + 28), f"{head['entropy']:.2f}", fill="black", font=font)
                continue
            # ground truth: the best-decoded factor's initial and its held-out accuracy,
            # and the runner-up's
            ranked = sorted(head["skill"], key=lambda f: -head["skill"][f])
            draw.text((x0 + 5, y0 + 16), f"{head['entropy']:.2f}", fill="black", font=font)
            for k, f in enumerate(ranked[:2]):
                draw.text(
                    (x0 + 5, y0 + 28 + 12 * k),
                    f"{f[0].upper()}{100 * head['decoding'][f]:.0f}%",
                    fill="black",
                    font=font,
                )
    y = TOP + len(layers) * CELL + 8
    for i, (role, color) in enumerate(ROLE_COLORS.items()):
        draw.rectangle([8 + i * 120, y, 20 + i * 120, y + 12], fill=color)
        draw.text((24 + i * 120, y), role, fill="black", font=font)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    write_atomic(path, buf.getvalue())

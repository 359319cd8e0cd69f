"""Synthetic "coloured shape on a plain background" data set and the pixel-statistics prompt check.

Everything is generated from a seed with numpy; nothing is downloaded. Shared by train.py and eval_prompts.py.
"""

from __future__ import annotations

import itertools

import numpy as np

IMAGE_SIZE = 64

# name -> RGB. Near the corners of the RGB cube so that every pair is far apart (min distance printed by
# `python shapes.py`); every name is a single word in both tokenizers' vocabularies or a short piece sequence.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 220, 50),
    "cyan": (40, 210, 220),
    "pink": (235, 100, 200),
    "white": (245, 245, 245),
    "black": (25, 25, 25),
}
SHAPES = ("circle", "square", "triangle")
# half-size (radius / half side) ranges in pixels, inclusive
SIZES = {"small": (6, 8), "medium": (9, 11), "large": (12, 13)}
# caption phrase -> (column, row) of the 3x3 grid the shape's centre lies in. "on the left" is the middle row's
# left cell: a vertical position left open would let a small model smear the shape over the column.
POSITIONS = {
    "left": ("on the left", 0, 1),
    "middle": ("in the middle", 1, 1),
    "right": ("on the right", 2, 1),
    "top left": ("in the top left corner", 0, 0),
    "top right": ("in the top right corner", 2, 0),
    "bottom left": ("in the bottom left corner", 0, 2),
    "bottom right": ("in the bottom right corner", 2, 2),
}
# range of the shape centre in pixels for column / row 0, 1, 2 (inside the thirds 0-21.3, 21.3-42.7, 42.7-64)
CENTRE_RANGES = ((13, 17), (29, 35), (47, 51))

# Prompt check parameters (also written to eval.json)
BORDER_PX = 2  # width of the frame whose median colour is the background
SHAPE_MIN_PIXELS = 16  # fewer "far from background" pixels than this: no shape found


def min_palette_distance() -> float:
    cols = np.array(list(PALETTE.values()), dtype=np.float64)
    return min(float(np.linalg.norm(a - b)) for a, b in itertools.combinations(cols, 2))


SHAPE_THRESHOLD = round(min_palette_distance() / 2)  # RGB distance from the background colour


def caption(shape: str, color: str, background: str, size: str | None, position: str | None) -> str:
    """'a [small|large ]<color> <shape>[ <position phrase>,] on a <background> background'."""
    words = ["a"]
    if size is not None and size != "medium":
        words.append(size)
    words += [color, shape]
    text = " ".join(words)
    if position is not None:
        text += " " + POSITIONS[position][0] + ","
    return f"{text} on a {background} background"


def _render_mask(shape: str, cx: float, cy: float, r: float, supersample: int = 4) -> np.ndarray:
    """Coverage in [0, 1] of a shape, anti-aliased by supersampling; (IMAGE_SIZE, IMAGE_SIZE) float32."""
    n = IMAGE_SIZE * supersample
    coords = (np.arange(n, dtype=np.float32) + 0.5) / supersample
    x = coords[None, :]
    y = coords[:, None]
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    elif shape == "square":
        inside = (np.abs(x - cx) <= r) & (np.abs(y - cy) <= r)
    elif shape == "triangle":
        # upward isosceles triangle in the box [cx-r, cx+r] x [cy-r, cy+r]: apex at top, base at the bottom
        rel_y = (y - (cy - r)) / (2 * r)  # 0 at apex, 1 at base
        inside = (rel_y >= 0) & (rel_y <= 1) & (np.abs(x - cx) <= r * rel_y)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    inside = inside.astype(np.float32)
    return inside.reshape(IMAGE_SIZE, supersample, IMAGE_SIZE, supersample).mean(axis=(1, 3))


def render(shape: str, color: str, background: str, cx: float, cy: float, r: float) -> np.ndarray:
    """(IMAGE_SIZE, IMAGE_SIZE, 3) uint8 image."""
    cover = _render_mask(shape, cx, cy, r)[..., None]
    fg = np.array(PALETTE[color], dtype=np.float32)
    bg = np.array(PALETTE[background], dtype=np.float32)
    img = cover * fg + (1.0 - cover) * bg
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def sample(rng: np.random.Generator, layout: str = "fixed") -> tuple[np.ndarray, str, dict]:
    """One random (image, caption, attributes). Size is named half of the time (else medium), position 80 % (else in
    the middle). layout "exact": the same captions, each always drawn at the middle of its size and position
    ranges (one image per caption). layout "open" is the data of training stage 4: any size when none is named, any row for "on the
    left" / "in the middle" / "on the right", anywhere when no position is named."""
    if layout == "open":
        return _sample_open(rng)
    shape, color, background = _draw_shape_and_colours(rng)
    # size / position not named: medium / in the middle, so that every caption names one narrow distribution
    size = list(SIZES)[rng.integers(len(SIZES))]
    say_size = size if rng.random() < 0.5 else None
    lo, hi = SIZES[size if say_size is not None else "medium"]
    r = float(rng.uniform(lo, hi + 1))
    position = list(POSITIONS)[rng.integers(len(POSITIONS))]
    say_position = position if rng.random() < 0.8 else None
    _, column, row = POSITIONS[position if say_position is not None else "middle"]
    cx = float(rng.uniform(*CENTRE_RANGES[column]))
    cy = float(rng.uniform(*CENTRE_RANGES[row]))
    if layout == "exact":
        # one image per caption: the middle of each range (the draws above still happen, so that the shape,
        # colour and wording of sample i are the same in every layout but "open")
        r = (lo + hi + 1) / 2
        cx = sum(CENTRE_RANGES[column]) / 2
        cy = sum(CENTRE_RANGES[row]) / 2
    elif layout != "fixed":
        raise ValueError(f"unknown layout {layout!r}")
    if shape == "triangle":
        cy -= r / 3  # the drawn point is the triangle's centroid, which lies r/3 below its box centre
    cx, cy = (float(np.clip(v, r + 2, IMAGE_SIZE - r - 2)) for v in (cx, cy))  # 2 px clear of the edge
    return _finish(shape, color, background, cx, cy, r, say_size, say_position)


def _draw_shape_and_colours(rng: np.random.Generator) -> tuple[str, str, str]:
    """Shape, its colour and a different background colour (the first draws of every sample)."""
    colors = list(PALETTE)
    shape = SHAPES[rng.integers(len(SHAPES))]
    color = colors[rng.integers(len(colors))]
    background = color
    while background == color:
        background = colors[rng.integers(len(colors))]
    return shape, color, background


def _sample_open(rng: np.random.Generator) -> tuple[np.ndarray, str, dict]:
    shape, color, background = _draw_shape_and_colours(rng)
    size = list(SIZES)[rng.integers(len(SIZES))]
    lo, hi = SIZES[size]
    r = float(rng.uniform(lo, hi + 1))
    position = list(POSITIONS)[rng.integers(len(POSITIONS))]
    _, column, row = POSITIONS[position]
    cx = float(rng.uniform(*CENTRE_RANGES[column]))
    if position in ("left", "middle", "right"):
        cy = float(rng.uniform(r + 2, IMAGE_SIZE - r - 2))
    else:
        cy = float(rng.uniform(*CENTRE_RANGES[row]))
    if shape == "triangle":
        cy -= r / 3
    cx, cy = (float(np.clip(v, r + 2, IMAGE_SIZE - r - 2)) for v in (cx, cy))
    say_size = size if rng.random() < 0.5 else None
    say_position = position if rng.random() < 0.8 else None
    if say_position is None:
        cx = float(rng.uniform(r + 2, IMAGE_SIZE - r - 2))
        cy = float(rng.uniform(r + 2, IMAGE_SIZE - r - 2))
    return _finish(shape, color, background, cx, cy, r, say_size, say_position)


def _finish(shape, color, background, cx, cy, r, say_size, say_position) -> tuple[np.ndarray, str, dict]:
    img = render(shape, color, background, cx, cy, r)
    # size / position: as named in the caption (None when not named)
    attrs = {"shape": shape, "color": color, "background": background, "size": say_size, "position": say_position}
    return img, caption(shape, color, background, say_size, say_position), attrs


def make_dataset(n: int, seed: int) -> tuple[np.ndarray, list[str]]:
    """n images (n, 64, 64, 3) uint8 and their captions, deterministic from the seed."""
    rng = np.random.default_rng(seed)
    images = np.empty((n, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    captions = []
    for i in range(n):
        images[i], text, _ = sample(rng)
        captions.append(text)
    return images, captions


# ---------------------------------------------------------------------------------------------------------
# Evaluation prompts and the pixel check


def eval_prompts() -> list[dict]:
    """24 fixed prompts: every shape at every named position (21), and each shape without one (3); colours cycle
    so that each palette colour is a shape and a background colour; sizes cycle none / small / none / large."""
    colors = list(PALETTE)
    sizes = [None, "small", None, "large"]
    specs = [("circle", "red", "blue", None, None)]  # the README's first example
    combos = [(pos, shape) for pos in POSITIONS for shape in SHAPES]
    for i, (pos, shape) in enumerate(combos):
        color = colors[i % len(colors)]
        bg = colors[(3 * i + 2) % len(colors)]
        if bg == color:
            bg = colors[(3 * i + 3) % len(colors)]
        specs.append((shape, color, bg, sizes[i % len(sizes)], pos))
    specs += [("square", "yellow", "pink", None, None), ("triangle", "white", "black", "large", None)]
    return [
        {
            "prompt": caption(shape, color, bg, size, pos),
            "shape": shape,
            "color": color,
            "background": bg,
            "size": size,
            "position": pos,
        }
        for shape, color, bg, size, pos in specs
    ]


EVAL_SEEDS = [0, 1, 2, 3]

# shape type from the largest foreground component: fill = pixels / bounding-box area (square 1, circle pi/4,
# triangle 1/2); its bounding box must be about as wide as high, and a triangle's top half must hold clearly
# fewer pixels than its bottom half (apex up: 1/4 vs 3/4 of the area)
SQUARE_MIN_FILL = 0.89
CIRCLE_MIN_FILL = 0.65
MAX_ASPECT = 1.3
APEX_MAX_RATIO = 0.6


def nearest_palette(rgb: np.ndarray) -> str:
    names = list(PALETTE)
    cols = np.array([PALETTE[n] for n in names], dtype=np.float64)
    return names[int(np.argmin(np.linalg.norm(cols - np.asarray(rgb, dtype=np.float64), axis=1)))]


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask (ties: the first found in row-major order)."""
    h, w = mask.shape
    label = np.zeros((h, w), dtype=np.int32)
    best, best_size, current = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if label[y0, x0]:
            continue
        current += 1
        label[y0, x0] = current
        stack, size = [(y0, x0)], 0
        while stack:
            y, x = stack.pop()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not label[ny, nx]:
                    label[ny, nx] = current
                    stack.append((ny, nx))
        if size > best_size:
            best, best_size = current, size
    return label == best if best else np.zeros_like(mask)


def classify_shape(component: np.ndarray) -> str | None:
    ys, xs = np.nonzero(component)
    height, width = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    if not (1 / MAX_ASPECT <= width / height <= MAX_ASPECT):
        return None
    fill = len(xs) / (width * height)
    if fill >= SQUARE_MIN_FILL:
        return "square"
    if fill >= CIRCLE_MIN_FILL:
        return "circle"
    top = int((ys < ys.min() + height / 2).sum())
    return "triangle" if top < APEX_MAX_RATIO * (len(ys) - top) else None


def third(v: float, size: int) -> int:
    return min(2, int(v // (size / 3.0)))


def analyse(img: np.ndarray) -> dict:
    """Pixel statistics of one (H, W, 3) uint8 image.

    background: per-channel median of the pixels in the BORDER_PX-wide frame, nearest palette colour.
    shape: the largest 4-connected component of the pixels whose RGB distance from that median > SHAPE_THRESHOLD
    (none if it has < SHAPE_MIN_PIXELS); its colour (per-channel median, nearest palette colour), its centroid's
    column and row in the 3x3 grid, and its type (classify_shape).
    """
    h, w, _ = img.shape
    px = img.astype(np.float64)
    frame = np.ones((h, w), dtype=bool)
    frame[BORDER_PX : h - BORDER_PX, BORDER_PX : w - BORDER_PX] = False
    bg_rgb = np.median(px[frame], axis=0)
    far = np.linalg.norm(px - bg_rgb, axis=2) > SHAPE_THRESHOLD
    shape = largest_component(far)
    out = {"background": nearest_palette(bg_rgb), "background_rgb": bg_rgb.tolist(), "shape_pixels": int(shape.sum())}
    if shape.sum() < SHAPE_MIN_PIXELS:
        out.update(color=None, color_rgb=None, centroid=None, column=None, row=None, shape=None)
        return out
    fg_rgb = np.median(px[shape], axis=0)
    ys, xs = np.nonzero(shape)
    cx, cy = float(xs.mean()) + 0.5, float(ys.mean()) + 0.5  # pixel centres
    out.update(color=nearest_palette(fg_rgb), color_rgb=fg_rgb.tolist(), centroid=[cx, cy], column=third(cx, w),
               row=third(cy, h), shape=classify_shape(shape))
    return out


def check(img: np.ndarray, spec: dict) -> dict:
    """Compare analyse(img) with a prompt spec: background, shape colour, shape type and (when named) position —
    the centroid's column and row — must all match."""
    got = analyse(img)
    bg_ok = got["background"] == spec["background"]
    color_ok = got["color"] == spec["color"]
    shape_ok = got["shape"] == spec["shape"]
    pos_ok = True
    if spec.get("position") is not None:
        _, column, row = POSITIONS[spec["position"]]
        pos_ok = got["column"] == column and got["row"] == row
    ok = bg_ok and color_ok and shape_ok and pos_ok
    return {**got, "background_ok": bg_ok, "color_ok": color_ok, "shape_ok": shape_ok, "position_ok": pos_ok,
            "ok": ok}


def eval_spec() -> dict:
    """Content of eval.json: everything a re-implementation needs to repeat the check."""
    return {
        "prompts": eval_prompts(),
        "seeds": EVAL_SEEDS,
        "palette": {k: list(v) for k, v in PALETTE.items()},
        "positions": {k: {"phrase": v[0], "column": v[1], "row": v[2]} for k, v in POSITIONS.items()},
        "check": {
            "border_px": BORDER_PX,
            "shape_threshold": SHAPE_THRESHOLD,
            "shape_min_pixels": SHAPE_MIN_PIXELS,
            "square_min_fill": SQUARE_MIN_FILL,
            "circle_min_fill": CIRCLE_MIN_FILL,
            "max_aspect": MAX_ASPECT,
            "apex_max_ratio": APEX_MAX_RATIO,
            "description": (
                "background = per-channel median of the pixels within border_px of the image edge, nearest "
                "palette colour (Euclidean RGB); foreground = pixels whose Euclidean RGB distance to that median "
                "is > shape_threshold; the shape = its largest 4-connected component (fail if fewer than "
                "shape_min_pixels); shape colour = per-channel median of its pixels, nearest palette colour; "
                "centroid = mean (x, y) of its pixels + 0.5; column / row = floor(centroid / (size / 3)), at "
                "most 2; type: bounding box width/height outside [1/max_aspect, max_aspect] -> none; fill = "
                "pixels / box area >= square_min_fill -> square, >= circle_min_fill -> circle, else triangle "
                "when the pixels with y < box top + box height / 2 are fewer than apex_max_ratio x the others, "
                "else none. An image passes when background, shape colour and type match and, when the prompt "
                "names a position, its column and row match. Medians of an even count "
                "are the mean of the two middle values (numpy.median)."
            ),
        },
    }


def evaluator_accuracy(n: int = 3000, seed: int = 12345) -> dict:
    """The check on the data set's own rendered images (ground truth = the sample's attributes)."""
    rng = np.random.default_rng(seed)
    fails: dict[str, int] = {"background": 0, "color": 0, "shape": 0, "position": 0}
    ok = 0
    for _ in range(n):
        img, _, attrs = sample(rng)
        r = check(img, attrs)
        ok += r["ok"]
        for k in fails:
            fails[k] += not r[f"{k}_ok"]
    return {"images": n, "accuracy": ok / n, "fails": fails}


if __name__ == "__main__":
    print("min palette distance", min_palette_distance(), "threshold", SHAPE_THRESHOLD)
    for p in eval_prompts():
        print(p["prompt"])
    print(evaluator_accuracy())

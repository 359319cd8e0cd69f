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
# caption phrase, horizontal range of the shape centre in pixels
POSITIONS = {"left": ("on the left", (13, 17)), "middle": ("in the middle", (29, 35)), "right": ("on the right", (47, 51))}

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


def sample(rng: np.random.Generator) -> tuple[np.ndarray, str, dict]:
    """One random (image, caption, attributes). Size and position are named in the caption half of the time."""
    colors = list(PALETTE)
    shape = SHAPES[rng.integers(len(SHAPES))]
    color = colors[rng.integers(len(colors))]
    background = color
    while background == color:
        background = colors[rng.integers(len(colors))]
    size = list(SIZES)[rng.integers(len(SIZES))]
    lo, hi = SIZES[size]
    r = float(rng.uniform(lo, hi + 1))
    position = list(POSITIONS)[rng.integers(len(POSITIONS))]
    plo, phi = POSITIONS[position][1]
    cx = float(rng.uniform(plo, phi))
    cy = float(rng.uniform(r + 2, IMAGE_SIZE - r - 2))
    say_size = size if rng.random() < 0.5 else None
    say_position = position if rng.random() < 0.5 else None
    if say_position is None:
        # position not named: anywhere across the image
        cx = float(rng.uniform(r + 2, IMAGE_SIZE - r - 2))
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
    """24 fixed prompts covering every shape, colour (as shape and as background), size and position."""
    specs = [
        ("circle", "red", "blue", None, None),
        ("square", "green", "white", None, None),
        ("triangle", "yellow", "black", None, None),
        ("circle", "cyan", "pink", None, None),
        ("square", "pink", "green", None, None),
        ("triangle", "white", "red", None, None),
        ("circle", "black", "yellow", None, None),
        ("square", "blue", "cyan", None, None),
        ("circle", "red", "blue", None, "left"),
        ("square", "yellow", "blue", None, "right"),
        ("triangle", "green", "black", None, "middle"),
        ("circle", "white", "green", None, "right"),
        ("square", "black", "white", None, "left"),
        ("triangle", "pink", "cyan", None, "left"),
        ("circle", "blue", "yellow", None, "middle"),
        ("triangle", "cyan", "red", None, "right"),
        ("circle", "green", "pink", "small", None),
        ("square", "red", "black", "large", None),
        ("triangle", "blue", "white", "large", "middle"),
        ("circle", "yellow", "green", "small", "right"),
        ("square", "cyan", "black", "small", "left"),
        ("triangle", "black", "pink", "large", None),
        ("square", "white", "blue", "large", "right"),
        ("circle", "pink", "black", "small", "middle"),
    ]
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


def nearest_palette(rgb: np.ndarray) -> str:
    names = list(PALETTE)
    cols = np.array([PALETTE[n] for n in names], dtype=np.float64)
    return names[int(np.argmin(np.linalg.norm(cols - np.asarray(rgb, dtype=np.float64), axis=1)))]


def analyse(img: np.ndarray) -> dict:
    """Pixel statistics of one (H, W, 3) uint8 image.

    background: per-channel median of the pixels in the BORDER_PX-wide frame, nearest palette colour.
    shape pixels: RGB distance from that median background colour > SHAPE_THRESHOLD.
    shape colour: per-channel median of the shape pixels, nearest palette colour (None if < SHAPE_MIN_PIXELS).
    position: centroid x of the shape pixels; left / middle / right third of the width.
    """
    h, w, _ = img.shape
    px = img.astype(np.float64)
    frame = np.ones((h, w), dtype=bool)
    frame[BORDER_PX : h - BORDER_PX, BORDER_PX : w - BORDER_PX] = False
    bg_rgb = np.median(px[frame], axis=0)
    far = np.linalg.norm(px - bg_rgb, axis=2) > SHAPE_THRESHOLD
    out = {"background": nearest_palette(bg_rgb), "background_rgb": bg_rgb.tolist(), "shape_pixels": int(far.sum())}
    if far.sum() < SHAPE_MIN_PIXELS:
        out.update(color=None, color_rgb=None, centroid_x=None, position=None)
        return out
    fg_rgb = np.median(px[far], axis=0)
    cx = float(np.nonzero(far)[1].mean()) + 0.5  # pixel centres
    third = w / 3.0
    position = "left" if cx < third else ("middle" if cx < 2 * third else "right")
    out.update(color=nearest_palette(fg_rgb), color_rgb=fg_rgb.tolist(), centroid_x=cx, position=position)
    return out


def check(img: np.ndarray, spec: dict) -> dict:
    """Compare analyse(img) with a prompt spec; 'ok' = background, shape colour and (if named) position match."""
    got = analyse(img)
    bg_ok = got["background"] == spec["background"]
    color_ok = got["color"] == spec["color"]
    pos_ok = spec.get("position") is None or got["position"] == spec["position"]
    return {**got, "background_ok": bg_ok, "color_ok": color_ok, "position_ok": pos_ok, "ok": bg_ok and color_ok and pos_ok}


def eval_spec() -> dict:
    """Content of eval.json: everything a re-implementation needs to repeat the check."""
    return {
        "prompts": eval_prompts(),
        "seeds": EVAL_SEEDS,
        "palette": {k: list(v) for k, v in PALETTE.items()},
        "check": {
            "border_px": BORDER_PX,
            "shape_threshold": SHAPE_THRESHOLD,
            "shape_min_pixels": SHAPE_MIN_PIXELS,
            "description": (
                "background = per-channel median of the pixels within border_px of the image edge, nearest "
                "palette colour (Euclidean RGB); shape pixels = pixels whose Euclidean RGB distance to that "
                "median background colour is > shape_threshold; if fewer than shape_min_pixels: no shape "
                "(fail); shape colour = per-channel median of the shape pixels, nearest palette colour; "
                "position = mean x of the shape pixels (+0.5, pixel centres) in the left / middle / right third "
                "of the width (< W/3, < 2W/3, else right); an image passes when background and shape colour "
                "match and, when the prompt names a position, the position matches. Medians of an even count "
                "are the mean of the two middle values (numpy.median)."
            ),
        },
    }


if __name__ == "__main__":
    print("min palette distance", min_palette_distance(), "threshold", SHAPE_THRESHOLD)
    imgs, caps = make_dataset(8, 0)
    for img, c in zip(imgs, caps):
        print(c, analyse(img)["background"], analyse(img)["color"], analyse(img)["position"])

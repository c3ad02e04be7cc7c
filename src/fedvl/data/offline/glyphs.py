"""Digit glyphs: the bundled TrueType fonts and the masks of printed digits drawn with them."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from fedvl.data.offline.imageops import SIZE, box_down

# Fonts are rendered at 2x and box-downsampled: PIL's antialiasing alone is poor at 28 px.
_SS = 2
_CANVAS = SIZE * _SS
# Only text fonts with ordinary digit glyphs; symbol/math/size-variant fonts are excluded.
_FONT_PREFIXES = (
    "DejaVuSans-",
    "DejaVuSans.",
    "DejaVuSerif-",
    "DejaVuSerif.",
    "DejaVuSansMono",
    "STIXGeneral",
    "cmr10",
    "cmss10",
    "cmtt10",
    "cmb10",
)


def _has_digit_glyphs(path: str) -> bool:
    """Whether the font at `path` draws ten distinct digits (not .notdef boxes)."""
    try:
        font = ImageFont.truetype(path, 32, layout_engine=ImageFont.Layout.BASIC)
    except OSError:
        return False

    def bitmap(ch: str) -> bytes:
        img = Image.new("L", (64, 64), 0)
        ImageDraw.Draw(img).text((8, 4), ch, fill=255, font=font)
        return img.tobytes()

    # A font missing digits renders them all as the same .notdef box (or nothing).
    notdef = bitmap("\ue000")
    maps = [bitmap(str(d)) for d in range(10)]
    return all(any(m) for m in maps) and len(set(maps)) == 10 and notdef not in maps


@functools.lru_cache(maxsize=1)
def digit_fonts() -> tuple[str, ...]:
    """Paths of the matplotlib-bundled TrueType fonts used to render printed digits."""
    import matplotlib

    font_dir = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    paths = sorted(
        str(p)
        for p in font_dir.glob("*.ttf")
        if p.name.startswith(_FONT_PREFIXES) and _has_digit_glyphs(str(p))
    )
    if not paths:
        raise RuntimeError(f"no usable digit fonts found in {font_dir}")
    return tuple(paths)


@functools.cache
def _font(path: str, size: int) -> ImageFont.FreeTypeFont:
    # BASIC layout: identical output whether or not libraqm is installed.
    return ImageFont.truetype(path, size, layout_engine=ImageFont.Layout.BASIC)


@functools.cache
def _digit_height_ratio(path: str) -> float:
    left, top, right, bottom = _font(path, 100).getbbox("0123456789")
    return (bottom - top) / 100.0


def _text_masks(
    font_path: str,
    height: float,
    text: str,
    centre_pos: int,
    angle: float,
    centre_xy: tuple[float, float],
    stroke: int,
    canvas: int = _CANVAS,
) -> tuple[np.ndarray, np.ndarray]:
    """(fill, fill+outline) masks on the 2x canvas, text[centre_pos] centred at centre_xy."""
    size = max(6, round(height / _digit_height_ratio(font_path)))
    font = _font(font_path, size)
    ch = text[centre_pos]
    left, top, right, bottom = font.getbbox(ch)
    prefix = font.getlength(text[:centre_pos]) if centre_pos else 0.0
    cx, cy = centre_xy
    origin = (cx - prefix - (left + right) / 2.0, cy - (top + bottom) / 2.0)

    def draw(width: int) -> np.ndarray:
        img = Image.new("L", (canvas, canvas), 0)
        ImageDraw.Draw(img).text(
            origin, text, fill=255, font=font, stroke_width=width, stroke_fill=255
        )
        img = img.rotate(angle, resample=Image.Resampling.BICUBIC, center=centre_xy)
        return np.asarray(img)

    fill = draw(0)
    return fill, (draw(stroke) if stroke else fill)


def render_masks(
    labels: np.ndarray,
    rng: np.random.Generator,
    height: tuple[float, float],
    angle: float,
    shift: float,
    neighbour_p: float,
    stroke_p: float,
    size: int = SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """Downsampled (n, size, size) fill and outline masks of printed digits.

    Each image shows the label's digit centred, with a random neighbour digit on either side
    with probability `neighbour_p` each (so numbers of 1 to 3 digits, cut off by the frame).
    """
    fonts = digit_fonts()
    n = len(labels)
    canvas = size * _SS
    fill = np.empty((n, canvas, canvas), dtype=np.uint8)
    outer = np.empty((n, canvas, canvas), dtype=np.uint8)
    for i, label in enumerate(labels):
        left = str(rng.integers(10)) if rng.random() < neighbour_p else ""
        right = str(rng.integers(10)) if rng.random() < neighbour_p else ""
        stroke = int(rng.integers(1, 3)) if rng.random() < stroke_p else 0
        centre = (
            canvas / 2 + rng.uniform(-shift, shift) * _SS,
            canvas / 2 + rng.uniform(-shift, shift) * _SS,
        )
        fill[i], outer[i] = _text_masks(
            fonts[int(rng.integers(len(fonts)))],
            rng.uniform(*height) * _SS,
            f"{left}{label}{right}",
            len(left),
            rng.uniform(-angle, angle),
            centre,
            stroke * _SS,
            canvas,
        )
    return box_down(fill / np.float32(255), _SS), box_down(outer / np.float32(255), _SS)

"""The printed styles: SVHN- and SynthDigits-like digits drawn from fonts."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedvl.data.offline.glyphs import render_masks
from fedvl.data.offline.imageops import (
    SIZE,
    blur,
    contrasting_colours,
    gradient,
    luma,
    noise,
    over,
    resize,
    to_uint8,
    uniform,
)


def balanced_labels(n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` labels 0..9 in random order, each class as often as possible."""
    return rng.permutation(np.arange(n, dtype=np.int64) % 10)


def render_printed_clutter(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """SVHN-like: house-number digits with cut-off neighbours on a busy photo-ish background."""
    n = len(labels)
    fill, outer = render_masks(
        labels, rng, height=(15.0, 21.0), angle=12.0, shift=1.5, neighbour_p=0.7, stroke_p=0.1
    )
    base, fg = contrasting_colours(rng, n, 0.35)
    c2 = np.clip(base + noise(rng, 0.25, (n, 3)), 0, 1)
    ramp = gradient(rng, n) * uniform(rng, 0.3, 1.0, (n, 1, 1))
    bg = over(np.broadcast_to(base[:, None, None], (n, SIZE, SIZE, 3)), c2, ramp)
    bg = bg + resize(noise(rng, 0.12, (n, 5, 5, 3)), SIZE)  # blotchy colour noise
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    for _ in range(3):  # semi-transparent rectangles: walls, frames, plates
        y0, x0 = uniform(rng, -8, 26, (2, n, 1, 1))
        hh, ww = uniform(rng, 3, 16, (2, n, 1, 1))
        inside = (yy >= y0) & (yy < y0 + hh) & (xx >= x0) & (xx < x0 + ww)
        alpha = uniform(rng, 0.2, 0.5, (n, 1, 1)) * (rng.random((n, 1, 1)) < 0.6) * inside
        bg = over(bg, uniform(rng, 0, 1, (n, 3)), alpha)
    for _ in range(2):  # thin lines: edges, cables, frame borders
        t = uniform(rng, 0, np.pi, (n, 1, 1))
        off = uniform(rng, -14, 14, (n, 1, 1))
        dist = np.abs(np.cos(t) * (xx - 13.5) + np.sin(t) * (yy - 13.5) - off)
        alpha = np.clip(uniform(rng, 0.8, 1.6, (n, 1, 1)) - dist, 0, 1) * np.float32(0.6)
        alpha *= rng.random((n, 1, 1)) < 0.5
        bg = over(bg, uniform(rng, 0, 1, (n, 3)), alpha)
    # Occasional dark/light rim around the digit, as on painted or embossed house numbers.
    rim = np.clip(fg * 0.3 + (1 - fg) * 0.2 + noise(rng, 0.1, (n, 3)), 0, 1)
    img = over(over(bg, rim, outer), fg, fill)
    img = blur(img, 0.6) + noise(rng, 0.025, img.shape)
    return to_uint8(img)


def render_printed_clean(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """SynthDigits-like: one font digit on a flat or gently graded background, slightly blurred."""
    n = len(labels)
    fill, outer = render_masks(
        labels, rng, height=(13.0, 19.0), angle=15.0, shift=3.0, neighbour_p=0.0, stroke_p=0.2
    )
    base, fg = contrasting_colours(rng, n, 0.4)
    _, stroke_col = contrasting_colours(rng, n, 0.0)
    # The gradient runs away from the text colour so it never erodes the contrast.
    away = np.sign(0.5 - luma(base)).astype(np.float32)[:, None, None]
    ramp = gradient(rng, n) * uniform(rng, 0.0, 0.25, (n, 1, 1)) * away
    bg = base[:, None, None] + ramp[..., None]
    img = over(over(bg, stroke_col, outer), fg, fill)
    img = blur(img, 0.5) + noise(rng, 0.01, img.shape)
    return to_uint8(img)


RENDERERS: dict[str, Callable[[np.ndarray, np.random.Generator], np.ndarray]] = {
    "printed-clutter": render_printed_clutter,
    "printed-clean": render_printed_clean,
}

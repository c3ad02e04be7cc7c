"""The handwritten styles: MNIST-, MNIST-M- and USPS-like renderings of scikit-learn digits."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedvl.data.offline.bases import sklearn_digits
from fedvl.data.offline.imageops import (
    SIZE,
    affine_warp,
    blur,
    grey_rgb,
    resize,
    to_uint8,
)


def _hires_handwritten(base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Smooth 32x32 strokes of the given sklearn digits plus their centres of mass."""
    images, _ = sklearn_digits()
    x = np.clip(resize(images[base], 32), 0.0, 1.0)
    # sklearn digits are 4x4-block averages: re-sharpen into solid strokes with soft edges.
    x = np.clip((x - 0.25) / 0.45, 0.0, 1.0)
    x = x * x * (3.0 - 2.0 * x)
    mass = x.sum(axis=(1, 2)) + 1e-6
    grid = np.arange(32, dtype=np.float64)
    com = np.stack(
        [(x.sum(axis=2) * grid).sum(axis=1) / mass, (x.sum(axis=1) * grid).sum(axis=1) / mass],
        axis=1,
    )
    return x, com


def _mnist_like(base: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(n, 28, 28) float strokes in [0, 1]: 20 px digit box, centred by mass, jittered."""
    n = len(base)
    hires, com = _hires_handwritten(base)
    scale = rng.uniform(17.5, 22.0, n)
    aspect = rng.uniform(0.9, 1.1, n)
    box = np.stack([scale * aspect, scale / aspect], axis=1)
    angle = rng.uniform(-14, 14, n)
    shift = rng.uniform(-1.5, 1.5, (n, 2))
    return np.clip(affine_warp(hires, box, angle, shift, com), 0.0, 1.0)


def render_handwritten(base: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """MNIST-like: white strokes on black, centred by mass, jittered."""
    return grey_rgb(_mnist_like(base, rng))


def _texture_bank(rng: np.random.Generator, n_tex: int = 48, size: int = 64) -> np.ndarray:
    """Colourful (n_tex, size, size, 3) textures in [0, 1], standing in for BSDS500 photos."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    bank = np.empty((n_tex, size, size, 3), dtype=np.float32)
    for i in range(n_tex):
        kind = i % 4
        if kind in (0, 3):  # smooth random colour field (coarse or medium grain)
            g = int(rng.integers(2, 5)) if kind == 0 else int(rng.integers(5, 9))
            tex = resize(rng.uniform(0, 1, (1, g, g, 3)).astype(np.float32), size)[0]
        elif kind == 1:  # two-colour gradient
            t = rng.uniform(0, 2 * np.pi)
            ramp = np.cos(t) * xx + np.sin(t) * yy
            ramp = (ramp - ramp.min()) / (np.ptp(ramp) + 1e-6)
            c0, c1 = rng.uniform(0, 1, (2, 3)).astype(np.float32)
            tex = c0 + (c1 - c0) * ramp[..., None]
        else:  # wavy stripes, like fabric or wood grain
            t = rng.uniform(0, np.pi)
            freq = rng.uniform(2, 5)
            warp = resize(rng.normal(0, 0.8, (1, 3, 3)).astype(np.float32), size)[0]
            s = 0.5 + 0.5 * np.sin(2 * np.pi * freq * (np.cos(t) * xx + np.sin(t) * yy) + warp)
            c0, c1 = rng.uniform(0, 1, (2, 3)).astype(np.float32)
            tex = c0 + (c1 - c0) * s[..., None]
        tex = tex + rng.normal(0, 0.03, tex.shape).astype(np.float32)  # photo grain
        lo = tex.min(axis=(0, 1), keepdims=True)
        hi = tex.max(axis=(0, 1), keepdims=True)
        tex = (tex - lo) / np.maximum(hi - lo, 0.2)
        # |bg - 1| inverts the texture under the digit; near mid-grey that inversion is
        # invisible, so each texture is kept mostly dark or mostly bright (random per texture).
        amp = rng.uniform(0.35, 0.65, 3).astype(np.float32)
        tex = tex * amp
        bank[i] = tex if rng.random() < 0.5 else 1.0 - tex
    return np.clip(bank, 0.0, 1.0)


def render_handwritten_color(base: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """MNIST-M-like: the strokes invert a colourful texture under them."""
    n = len(base)
    digit = _mnist_like(base, rng)
    bank = _texture_bank(rng)
    size = bank.shape[1]
    tex = rng.integers(0, len(bank), n)
    oy = rng.integers(0, size - SIZE + 1, n)
    ox = rng.integers(0, size - SIZE + 1, n)
    ar = np.arange(SIZE)
    bg = bank[
        tex[:, None, None],
        oy[:, None, None] + ar[None, :, None],
        ox[:, None, None] + ar[None, None, :],
    ]
    # The MNIST-M blend: the digit inverts the colours of the background it covers.
    return to_uint8(np.abs(bg - digit[..., None]))


def render_handwritten_thick(base: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """USPS-like: thick strokes filling a 16 px frame, upsampled soft."""
    n = len(base)
    hires, _ = _hires_handwritten(base)
    # USPS digits are scaled to touch their 16x16 frame: map each digit's ink bounding box
    # (not the 8x8 frame) onto nearly the whole image, at USPS resolution.
    ink = hires > 0.3
    rows, cols = ink.any(axis=2), ink.any(axis=1)
    grid = np.arange(32)
    top = np.where(rows, grid, 99).min(axis=1)
    bottom = np.where(rows, grid, -1).max(axis=1) + 1
    left = np.where(cols, grid, 99).min(axis=1)
    right = np.where(cols, grid, -1).max(axis=1) + 1
    ext_h = np.maximum(bottom - top, 4).astype(np.float64)
    ext_w = np.maximum(right - left, 4).astype(np.float64)
    zoom_h = rng.uniform(14.0, 15.5, n) / ext_h
    # Thin digits (a "1") widen only a little, as in USPS, instead of becoming a block.
    zoom_w = np.minimum(rng.uniform(11.5, 14.5, n) / ext_w, zoom_h * 1.35)
    box = np.stack([32.0 * zoom_h, 32.0 * zoom_w], axis=1)
    centre = np.stack([(top + bottom - 1) / 2.0, (left + right - 1) / 2.0], axis=1)
    angle = rng.uniform(-5, 5, n)
    shift = rng.uniform(-0.3, 0.3, (n, 2))
    x = affine_warp(hires, box, angle, shift, centre, out_size=16)
    # USPS pens are thick relative to the 16 px frame; upsampling then gives the soft look.
    from scipy import ndimage
    x = ndimage.grey_dilation(x, size=(1, 2, 2))
    x = blur(np.clip(resize(x, SIZE), 0.0, 1.0), 0.7)
    x = x / np.maximum(x.max(axis=(1, 2), keepdims=True), 1e-6)
    return grey_rgb(np.clip(x * 1.15, 0.0, 1.0))


RENDERERS: dict[str, Callable[[np.ndarray, np.random.Generator], np.ndarray]] = {
    "handwritten": render_handwritten,
    "handwritten-color": render_handwritten_color,
    "handwritten-thick": render_handwritten_thick,
}

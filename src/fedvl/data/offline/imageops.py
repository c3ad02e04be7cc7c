"""Batch image operations on float arrays: resizing, blurring, warping, colours, compositing."""

from __future__ import annotations

import functools

import numpy as np

# scipy.ndimage is imported by the operations that use it: a run that finds its cached images
# never needs it (0.15 s of start-up).

# Side of every generated image, in pixels.
SIZE = 28


@functools.cache
def _cubic_resize_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) Keys-bicubic resampling matrix (half-pixel centres, clamped edges)."""
    a = -0.5
    pos = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
    base = np.floor(pos).astype(int)
    mat = np.zeros((n_out, n_in), dtype=np.float64)
    for off in (-1, 0, 1, 2):
        idx = base + off
        d = np.abs(pos - idx)
        w = np.where(
            d <= 1,
            (a + 2) * d**3 - (a + 3) * d**2 + 1,
            np.where(d < 2, a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a, 0.0),
        )
        np.add.at(mat, (np.arange(n_out), np.clip(idx, 0, n_in - 1)), w)
    return mat.astype(np.float32)


def resize(imgs: np.ndarray, n_out: int) -> np.ndarray:
    """Bicubic resize of a (n, h, w[, c]) square batch to n_out x n_out."""
    m = _cubic_resize_matrix(imgs.shape[1], n_out)
    if imgs.ndim == 3:
        return np.einsum("ij,njk,lk->nil", m, imgs, m, optimize=True)
    return np.einsum("ij,njkc,lk->nilc", m, imgs, m, optimize=True)


def box_down(imgs: np.ndarray, factor: int) -> np.ndarray:
    """Mean of each factor x factor block of a (n, h, w[, c]) batch."""
    n, h, w = imgs.shape[:3]
    shaped = imgs.reshape(n, h // factor, factor, w // factor, factor, *imgs.shape[3:])
    return shaped.mean(axis=(2, 4))


def blur(imgs: np.ndarray, sigma: float) -> np.ndarray:
    """Spatial Gaussian blur of a (n, h, w[, c]) batch, never mixing samples or channels."""
    sig = (0.0, sigma, sigma) + (0.0,) * (imgs.ndim - 3)
    from scipy import ndimage
    return ndimage.gaussian_filter(imgs, sig, mode="nearest")


def affine_warp(
    src: np.ndarray,
    box_hw: np.ndarray,
    angle_deg: np.ndarray,
    shift_yx: np.ndarray,
    centre_yx: np.ndarray,
    out_size: int = SIZE,
) -> np.ndarray:
    """Warp each (H, W) source so its full frame becomes a box of box_hw px in the output.

    The source point centre_yx lands at the output centre (+ shift), rotated by angle_deg.
    """
    n, h, w = src.shape
    c = (out_size - 1) / 2.0
    yy, xx = np.mgrid[0:out_size, 0:out_size].astype(np.float64)
    y = yy[None] - c - shift_yx[:, 0, None, None]
    x = xx[None] - c - shift_yx[:, 1, None, None]
    t = np.deg2rad(angle_deg)[:, None, None]
    cos, sin = np.cos(t), np.sin(t)
    u = cos * x + sin * y
    v = -sin * x + cos * y
    src_y = centre_yx[:, 0, None, None] + v * (h / box_hw[:, 0, None, None])
    src_x = centre_yx[:, 1, None, None] + u * (w / box_hw[:, 1, None, None])
    # Integer sample coordinate + order=1 interpolation never blends different samples.
    idx = np.broadcast_to(np.arange(n, dtype=np.float64)[:, None, None], src_y.shape)
    coords = np.stack([idx, src_y, src_x])
    from scipy import ndimage
    return ndimage.map_coordinates(src, coords, order=1, mode="constant", cval=0.0)


def luma(rgb: np.ndarray) -> np.ndarray:
    """Luminance (ITU-R BT.601 weights) of RGB values on the last axis."""
    return rgb @ np.array([0.299, 0.587, 0.114], dtype=rgb.dtype)


def contrasting_colours(
    rng: np.random.Generator, n: int, min_diff: float
) -> tuple[np.ndarray, np.ndarray]:
    """Random (background, foreground) RGB pairs in [0, 1] whose luminance differs enough."""
    bg = uniform(rng, 0, 1, (n, 3))
    fg = uniform(rng, 0, 1, (n, 3))
    bad = np.abs(luma(bg) - luma(fg)) < min_diff
    while bad.any():
        k = int(bad.sum())
        bg[bad] = uniform(rng, 0, 1, (k, 3))
        fg[bad] = uniform(rng, 0, 1, (k, 3))
        bad = np.abs(luma(bg) - luma(fg)) < min_diff
    return bg, fg


def uniform(
    rng: np.random.Generator, lo: float, hi: float, shape: int | tuple[int, ...]
) -> np.ndarray:
    """Uniform draws in [lo, hi) as float32."""
    # float32 parameters keep the per-pixel arithmetic in float32 (half the memory traffic).
    return rng.uniform(lo, hi, shape).astype(np.float32)


def to_uint8(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] as rounded, clipped uint8 0..255."""
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


def grey_rgb(x: np.ndarray) -> np.ndarray:
    """Grey images in [0, 1] as uint8 RGB (the grey value repeated in three channels)."""
    return np.repeat(to_uint8(x)[..., None], 3, axis=-1)


def gradient(rng: np.random.Generator, n: int, size: int = SIZE) -> np.ndarray:
    """(n, size, size) linear ramps in [-0.5, 0.5] along random directions."""
    yy, xx = (np.mgrid[0:size, 0:size] / (size - 1) - 0.5).astype(np.float32)
    t = uniform(rng, 0, 2 * np.pi, (n, 1, 1))
    return (np.cos(t) * xx + np.sin(t) * yy) / np.float32(np.sqrt(0.5))


def noise(rng: np.random.Generator, sigma: float, shape: tuple[int, ...]) -> np.ndarray:
    """Gaussian noise of standard deviation `sigma`, in float32."""
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(sigma)


def over(img: np.ndarray, colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Alpha-composite colour (n, 3) or (n, h, w, 3) over img with (n, h, w) alpha."""
    if colour.ndim == 2:
        colour = colour[:, None, None]
    return img + (colour - img) * alpha[..., None]

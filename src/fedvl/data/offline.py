"""Embedded offline feature-shift benchmark "digits-offline".

Five clients share the label space 0..9 but differ strongly in image style, imitating the
classic Digit-Five federation (MNIST, MNIST-M, SVHN, SynthDigits, USPS). It is built only from
data shipped with installed packages, so it works without network access or a data directory:

* scikit-learn's 1797 real handwritten 8x8 digits (``sklearn.datasets.load_digits``), split
  disjointly across the three handwritten clients;
* digits rendered with PIL from the TrueType fonts bundled with matplotlib.

Every image is 28x28x3 ``uint8`` (HWC) and every label ``int64``. Generation is deterministic
from one integer seed and takes a few seconds; results are cached on disk.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import operator
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from fedvl.data.cache import cache_root, save_npz_atomic

# scipy.ndimage is imported by the renderers that use it: a run that finds its cached images
# never needs it (0.15 s of start-up).

__all__ = [
    "CLIENT_NAMES",
    "HANDWRITTEN_CLIENTS",
    "cache_path",
    "digit_fonts",
    "handwritten_base_index",
    "make_digits_offline",
    "save_preview",
]

CLIENT_NAMES: tuple[str, ...] = (
    "handwritten",
    "handwritten-color",
    "printed-clutter",
    "printed-clean",
    "handwritten-thick",
)
HANDWRITTEN_CLIENTS: tuple[str, ...] = ("handwritten", "handwritten-color", "handwritten-thick")

# Bump whenever the generated pixels change, so stale caches are never reused.
_CACHE_VERSION = "v1"
_SIZE = 28
# Fonts are rendered at 2x and box-downsampled: PIL's antialiasing alone is poor at 28 px.
_SS = 2
_CANVAS = _SIZE * _SS
_FIELDS = ("x_train", "y_train", "x_test", "y_test")
# Independent RNG streams per client, so asking for a subset of clients (or a different
# test size) never changes the images of the other clients / the train set.
_CLIENT_OFFSET = {name: 101 * (i + 1) for i, name in enumerate(CLIENT_NAMES)}
_STREAM_SPLIT, _STREAM_PICK_TRAIN, _STREAM_PICK_TEST = 0, 1, 2
_STREAM_RENDER_TRAIN, _STREAM_RENDER_TEST = 3, 4

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


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------


def _digits_csv() -> Path | None:
    """scikit-learn's bundled `digits.csv.gz`, located without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=1)
def _sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    # Importing scikit-learn costs about 1.5 s of a first run; its digits are one CSV file
    # (64 pixel columns, then the label), which is what `load_digits` reads too.
    path = _digits_csv()
    if path is not None:
        data = np.loadtxt(path, delimiter=",")
        pixels, labels = data[:, :-1].reshape(-1, 8, 8), data[:, -1]
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, labels = bunch.images, bunch.target
    images = (pixels / 16.0).astype(np.float32)
    target = labels.astype(np.int64)
    images.setflags(write=False)
    target.setflags(write=False)
    return images, target


def _has_digit_glyphs(path: str) -> bool:
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


# --------------------------------------------------------------------------------------------
# seeds and the handwritten base-image split
# --------------------------------------------------------------------------------------------


def _check_seed(seed: int) -> int:
    seed = operator.index(seed)
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    return seed


def _rng(seed: int, client: str, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, _CLIENT_OFFSET[client], stream])


def _base_split(seed: int, test_fraction: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    _, target = _sklearn_digits()
    # One RNG shared by all handwritten clients: the split must be decided jointly.
    rng = np.random.default_rng([seed, 0, _STREAM_SPLIT])
    n_clients = len(HANDWRITTEN_CLIENTS)
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {
        name: ([], []) for name in HANDWRITTEN_CLIENTS
    }
    for c in range(10):
        chunks = np.array_split(rng.permutation(np.flatnonzero(target == c)), n_clients)
        for k, name in enumerate(HANDWRITTEN_CLIENTS):
            # Rotate which client receives the larger leftover chunks so totals stay even.
            chunk = chunks[(k + c) % n_clients]
            n_test = 0
            if test_fraction > 0:
                n_test = min(max(1, round(len(chunk) * test_fraction)), len(chunk) - 1)
            parts[name][1].append(chunk[:n_test])
            parts[name][0].append(chunk[n_test:])
    return {
        name: (np.sort(np.concatenate(tr)), np.sort(np.concatenate(te)))
        for name, (tr, te) in parts.items()
    }


def _expand(bases: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Per-sample base indices: every base used ceil(n / len(bases)) times at most."""
    if n == 0 or len(bases) == 0:
        return np.zeros(0, dtype=np.int64)
    reps = math.ceil(n / len(bases))
    return np.concatenate([rng.permutation(bases) for _ in range(reps)])[:n].astype(np.int64)


def _check_sizes(train_per_client: int, test_per_client: int) -> tuple[int, int]:
    train_per_client = operator.index(train_per_client)
    test_per_client = operator.index(test_per_client)
    if train_per_client < 1 or test_per_client < 0:
        raise ValueError(
            "train_per_client must be >= 1 and test_per_client >= 0, got "
            f"{train_per_client} and {test_per_client}"
        )
    return train_per_client, test_per_client


def handwritten_base_index(
    seed: int = 0, train_per_client: int = 1000, test_per_client: int = 250
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-sample sklearn-digits indices behind each handwritten client's (train, test) images."""
    seed = _check_seed(seed)
    n_train, n_test = _check_sizes(train_per_client, test_per_client)
    split = _base_split(seed, n_test / (n_train + n_test))
    out = {}
    for name, (train_bases, test_bases) in split.items():
        out[name] = (
            _expand(train_bases, n_train, _rng(seed, name, _STREAM_PICK_TRAIN)),
            _expand(test_bases, n_test, _rng(seed, name, _STREAM_PICK_TEST)),
        )
    return out


# --------------------------------------------------------------------------------------------
# numeric helpers
# --------------------------------------------------------------------------------------------


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


def _resize(imgs: np.ndarray, n_out: int) -> np.ndarray:
    """Bicubic resize of a (n, h, w[, c]) square batch to n_out x n_out."""
    m = _cubic_resize_matrix(imgs.shape[1], n_out)
    if imgs.ndim == 3:
        return np.einsum("ij,njk,lk->nil", m, imgs, m, optimize=True)
    return np.einsum("ij,njkc,lk->nilc", m, imgs, m, optimize=True)


def _box_down(imgs: np.ndarray, factor: int) -> np.ndarray:
    n, h, w = imgs.shape[:3]
    shaped = imgs.reshape(n, h // factor, factor, w // factor, factor, *imgs.shape[3:])
    return shaped.mean(axis=(2, 4))


def _blur(imgs: np.ndarray, sigma: float) -> np.ndarray:
    """Spatial Gaussian blur of a (n, h, w[, c]) batch, never mixing samples or channels."""
    sig = (0.0, sigma, sigma) + (0.0,) * (imgs.ndim - 3)
    from scipy import ndimage
    return ndimage.gaussian_filter(imgs, sig, mode="nearest")


def _affine_warp(
    src: np.ndarray,
    box_hw: np.ndarray,
    angle_deg: np.ndarray,
    shift_yx: np.ndarray,
    centre_yx: np.ndarray,
    out_size: int = _SIZE,
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


def _luma(rgb: np.ndarray) -> np.ndarray:
    return rgb @ np.array([0.299, 0.587, 0.114], dtype=rgb.dtype)


def _contrasting_colours(
    rng: np.random.Generator, n: int, min_diff: float
) -> tuple[np.ndarray, np.ndarray]:
    """Random (background, foreground) RGB pairs in [0, 1] whose luminance differs enough."""
    bg = _uniform(rng, 0, 1, (n, 3))
    fg = _uniform(rng, 0, 1, (n, 3))
    bad = np.abs(_luma(bg) - _luma(fg)) < min_diff
    while bad.any():
        k = int(bad.sum())
        bg[bad] = _uniform(rng, 0, 1, (k, 3))
        fg[bad] = _uniform(rng, 0, 1, (k, 3))
        bad = np.abs(_luma(bg) - _luma(fg)) < min_diff
    return bg, fg


def _uniform(
    rng: np.random.Generator, lo: float, hi: float, shape: int | tuple[int, ...]
) -> np.ndarray:
    # float32 parameters keep the per-pixel arithmetic in float32 (half the memory traffic).
    return rng.uniform(lo, hi, shape).astype(np.float32)


def _to_uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


def _grey_rgb(x: np.ndarray) -> np.ndarray:
    return np.repeat(_to_uint8(x)[..., None], 3, axis=-1)


# --------------------------------------------------------------------------------------------
# handwritten styles
# --------------------------------------------------------------------------------------------


def _hires_handwritten(base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Smooth 32x32 strokes of the given sklearn digits plus their centres of mass."""
    images, _ = _sklearn_digits()
    x = np.clip(_resize(images[base], 32), 0.0, 1.0)
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
    return np.clip(_affine_warp(hires, box, angle, shift, com), 0.0, 1.0)


def _render_handwritten(base: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _grey_rgb(_mnist_like(base, rng))


def _texture_bank(rng: np.random.Generator, n_tex: int = 48, size: int = 64) -> np.ndarray:
    """Colourful (n_tex, size, size, 3) textures in [0, 1], standing in for BSDS500 photos."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    bank = np.empty((n_tex, size, size, 3), dtype=np.float32)
    for i in range(n_tex):
        kind = i % 4
        if kind in (0, 3):  # smooth random colour field (coarse or medium grain)
            g = int(rng.integers(2, 5)) if kind == 0 else int(rng.integers(5, 9))
            tex = _resize(rng.uniform(0, 1, (1, g, g, 3)).astype(np.float32), size)[0]
        elif kind == 1:  # two-colour gradient
            t = rng.uniform(0, 2 * np.pi)
            ramp = np.cos(t) * xx + np.sin(t) * yy
            ramp = (ramp - ramp.min()) / (np.ptp(ramp) + 1e-6)
            c0, c1 = rng.uniform(0, 1, (2, 3)).astype(np.float32)
            tex = c0 + (c1 - c0) * ramp[..., None]
        else:  # wavy stripes, like fabric or wood grain
            t = rng.uniform(0, np.pi)
            freq = rng.uniform(2, 5)
            warp = _resize(rng.normal(0, 0.8, (1, 3, 3)).astype(np.float32), size)[0]
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


def _render_handwritten_color(base: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    n = len(base)
    digit = _mnist_like(base, rng)
    bank = _texture_bank(rng)
    size = bank.shape[1]
    tex = rng.integers(0, len(bank), n)
    oy = rng.integers(0, size - _SIZE + 1, n)
    ox = rng.integers(0, size - _SIZE + 1, n)
    ar = np.arange(_SIZE)
    bg = bank[
        tex[:, None, None],
        oy[:, None, None] + ar[None, :, None],
        ox[:, None, None] + ar[None, None, :],
    ]
    # The MNIST-M blend: the digit inverts the colours of the background it covers.
    return _to_uint8(np.abs(bg - digit[..., None]))


def _render_handwritten_thick(base: np.ndarray, rng: np.random.Generator) -> np.ndarray:
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
    x = _affine_warp(hires, box, angle, shift, centre, out_size=16)
    # USPS pens are thick relative to the 16 px frame; upsampling then gives the soft look.
    from scipy import ndimage
    x = ndimage.grey_dilation(x, size=(1, 2, 2))
    x = _blur(np.clip(_resize(x, _SIZE), 0.0, 1.0), 0.7)
    x = x / np.maximum(x.max(axis=(1, 2), keepdims=True), 1e-6)
    return _grey_rgb(np.clip(x * 1.15, 0.0, 1.0))


# --------------------------------------------------------------------------------------------
# printed styles
# --------------------------------------------------------------------------------------------


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


def _render_masks(
    labels: np.ndarray,
    rng: np.random.Generator,
    height: tuple[float, float],
    angle: float,
    shift: float,
    neighbour_p: float,
    stroke_p: float,
    size: int = _SIZE,
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
    return _box_down(fill / np.float32(255), _SS), _box_down(outer / np.float32(255), _SS)


def _gradient(rng: np.random.Generator, n: int, size: int = _SIZE) -> np.ndarray:
    """(n, size, size) linear ramps in [-0.5, 0.5] along random directions."""
    yy, xx = (np.mgrid[0:size, 0:size] / (size - 1) - 0.5).astype(np.float32)
    t = _uniform(rng, 0, 2 * np.pi, (n, 1, 1))
    return (np.cos(t) * xx + np.sin(t) * yy) / np.float32(np.sqrt(0.5))


def _balanced_labels(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(np.arange(n, dtype=np.int64) % 10)


def _noise(rng: np.random.Generator, sigma: float, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(sigma)


def _over(img: np.ndarray, colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Alpha-composite colour (n, 3) or (n, h, w, 3) over img with (n, h, w) alpha."""
    if colour.ndim == 2:
        colour = colour[:, None, None]
    return img + (colour - img) * alpha[..., None]


def _render_printed_clutter(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """SVHN-like: house-number digits with cut-off neighbours on a busy photo-ish background."""
    n = len(labels)
    fill, outer = _render_masks(
        labels, rng, height=(15.0, 21.0), angle=12.0, shift=1.5, neighbour_p=0.7, stroke_p=0.1
    )
    base, fg = _contrasting_colours(rng, n, 0.35)
    c2 = np.clip(base + _noise(rng, 0.25, (n, 3)), 0, 1)
    ramp = _gradient(rng, n) * _uniform(rng, 0.3, 1.0, (n, 1, 1))
    bg = _over(np.broadcast_to(base[:, None, None], (n, _SIZE, _SIZE, 3)), c2, ramp)
    bg = bg + _resize(_noise(rng, 0.12, (n, 5, 5, 3)), _SIZE)  # blotchy colour noise
    yy, xx = np.mgrid[0:_SIZE, 0:_SIZE].astype(np.float32)
    for _ in range(3):  # semi-transparent rectangles: walls, frames, plates
        y0, x0 = _uniform(rng, -8, 26, (2, n, 1, 1))
        hh, ww = _uniform(rng, 3, 16, (2, n, 1, 1))
        inside = (yy >= y0) & (yy < y0 + hh) & (xx >= x0) & (xx < x0 + ww)
        alpha = _uniform(rng, 0.2, 0.5, (n, 1, 1)) * (rng.random((n, 1, 1)) < 0.6) * inside
        bg = _over(bg, _uniform(rng, 0, 1, (n, 3)), alpha)
    for _ in range(2):  # thin lines: edges, cables, frame borders
        t = _uniform(rng, 0, np.pi, (n, 1, 1))
        off = _uniform(rng, -14, 14, (n, 1, 1))
        dist = np.abs(np.cos(t) * (xx - 13.5) + np.sin(t) * (yy - 13.5) - off)
        alpha = np.clip(_uniform(rng, 0.8, 1.6, (n, 1, 1)) - dist, 0, 1) * np.float32(0.6)
        alpha *= rng.random((n, 1, 1)) < 0.5
        bg = _over(bg, _uniform(rng, 0, 1, (n, 3)), alpha)
    # Occasional dark/light rim around the digit, as on painted or embossed house numbers.
    rim = np.clip(fg * 0.3 + (1 - fg) * 0.2 + _noise(rng, 0.1, (n, 3)), 0, 1)
    img = _over(_over(bg, rim, outer), fg, fill)
    img = _blur(img, 0.6) + _noise(rng, 0.025, img.shape)
    return _to_uint8(img)


def _render_printed_clean(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """SynthDigits-like: one font digit on a flat or gently graded background, slightly blurred."""
    n = len(labels)
    fill, outer = _render_masks(
        labels, rng, height=(13.0, 19.0), angle=15.0, shift=3.0, neighbour_p=0.0, stroke_p=0.2
    )
    base, fg = _contrasting_colours(rng, n, 0.4)
    _, stroke_col = _contrasting_colours(rng, n, 0.0)
    # The gradient runs away from the text colour so it never erodes the contrast.
    away = np.sign(0.5 - _luma(base)).astype(np.float32)[:, None, None]
    ramp = _gradient(rng, n) * _uniform(rng, 0.0, 0.25, (n, 1, 1)) * away
    bg = base[:, None, None] + ramp[..., None]
    img = _over(_over(bg, stroke_col, outer), fg, fill)
    img = _blur(img, 0.5) + _noise(rng, 0.01, img.shape)
    return _to_uint8(img)


# --------------------------------------------------------------------------------------------
# generation, cache, public API
# --------------------------------------------------------------------------------------------

_HANDWRITTEN_RENDERERS = {
    "handwritten": _render_handwritten,
    "handwritten-color": _render_handwritten_color,
    "handwritten-thick": _render_handwritten_thick,
}
_PRINTED_RENDERERS = {
    "printed-clutter": _render_printed_clutter,
    "printed-clean": _render_printed_clean,
}

Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _generate_client(
    name: str, seed: int, n_train: int, n_test: int, base_index: Mapping | None
) -> Split:
    out: list[np.ndarray] = []
    for stream, n, part in ((_STREAM_RENDER_TRAIN, n_train, 0), (_STREAM_RENDER_TEST, n_test, 1)):
        rng = _rng(seed, name, stream)
        if name in _HANDWRITTEN_RENDERERS:
            assert base_index is not None
            base = base_index[name][part]
            y = _sklearn_digits()[1][base].astype(np.int64)
            x = (
                _HANDWRITTEN_RENDERERS[name](base, rng)
                if n
                else np.zeros((0, _SIZE, _SIZE, 3), np.uint8)
            )
        else:
            y = _balanced_labels(n, rng)
            x = _PRINTED_RENDERERS[name](y, rng) if n else np.zeros((0, _SIZE, _SIZE, 3), np.uint8)
        out += [np.ascontiguousarray(x, dtype=np.uint8), np.ascontiguousarray(y, dtype=np.int64)]
    return out[0], out[1], out[2], out[3]


def cache_path(seed: int = 0, train_per_client: int = 1000, test_per_client: int = 250) -> Path:
    """Cache file for one configuration; its directory is $FEDVL_CACHE_DIR or ~/.cache/fedvl."""
    name = f"digits-offline-{_CACHE_VERSION}-seed{seed}-{train_per_client}-{test_per_client}.npz"
    return cache_root() / name


def _valid_split(split: Split, n_train: int, n_test: int) -> bool:
    x_tr, y_tr, x_te, y_te = split
    for x, y, n in ((x_tr, y_tr, n_train), (x_te, y_te, n_test)):
        if x.shape != (n, _SIZE, _SIZE, 3) or x.dtype != np.uint8:
            return False
        if y.shape != (n,) or y.dtype != np.int64 or (n and (y.min() < 0 or y.max() > 9)):
            return False
    return True


def _load_cache(path: Path, n_train: int, n_test: int) -> dict[str, Split] | None:
    """Valid clients stored in the cache; None when the file exists but is unreadable."""
    if not path.exists():
        return {}
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = set(z.files)
            found = {}
            for name in CLIENT_NAMES:
                if all(f"{name}__{f}" in keys for f in _FIELDS):
                    # np.array copies, forcing the full read (and CRC check) right here.
                    split = tuple(np.array(z[f"{name}__{f}"]) for f in _FIELDS)
                    if not _valid_split(split, n_train, n_test):
                        return None
                    found[name] = split
            return found
    except Exception:  # noqa: BLE001 - any unreadable cache is simply regenerated
        return None


def _write_cache(path: Path, data: Mapping[str, Split]) -> None:
    arrays = {f"{name}__{f}": arr for name, split in data.items() for f, arr in zip(_FIELDS, split)}
    save_npz_atomic(path, arrays, "digits-offline")


def _resolve_clients(clients: Sequence[str] | str | None) -> list[str]:
    if clients is None:
        return list(CLIENT_NAMES)
    if isinstance(clients, str):
        clients = (clients,)
    for name in clients:
        if name not in CLIENT_NAMES:
            raise ValueError(
                f"unknown digits-offline client {name!r}; allowed names: {', '.join(CLIENT_NAMES)}"
            )
    wanted = set(clients)
    return [name for name in CLIENT_NAMES if name in wanted]


def make_digits_offline(
    seed: int = 0,
    train_per_client: int = 1000,
    test_per_client: int = 250,
    clients: Sequence[str] | None = None,
    cache: bool = True,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Build the five-style digits federation: {client: (x_train, y_train, x_test, y_test)}.

    Images are uint8 (N, 28, 28, 3), labels int64 (N,), keys in CLIENT_NAMES order. The three
    handwritten clients use disjoint sklearn base images, and within each client no base image
    is shared by train and test; train bases are re-rendered with fresh jitter to reach
    ``train_per_client`` (likewise for test), see :func:`handwritten_base_index`.
    """
    seed = _check_seed(seed)
    n_train, n_test = _check_sizes(train_per_client, test_per_client)
    names = _resolve_clients(clients)

    path = cache_path(seed, n_train, n_test)
    stored: dict[str, Split] = {}
    rewrite = False
    if cache:
        loaded = _load_cache(path, n_train, n_test)
        # An unreadable file is dropped entirely and rebuilt below.
        stored = loaded if loaded is not None else {}
        rewrite = loaded is None
    missing = [name for name in names if name not in stored]
    if missing:
        base_index = None
        if any(name in _HANDWRITTEN_RENDERERS for name in missing):
            base_index = handwritten_base_index(seed, n_train, n_test)
        for name in missing:
            stored[name] = _generate_client(name, seed, n_train, n_test, base_index)
        if cache:
            rewrite = True
    if cache and rewrite:
        _write_cache(path, {name: stored[name] for name in CLIENT_NAMES if name in stored})
    return {name: stored[name] for name in names}


def save_preview(
    data: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    path: str,
    per_client: int = 10,
) -> None:
    """Write a PNG grid: one row per client, its first `per_client` train images with labels."""
    scale, label_w, cap_h, pad = 3, 150, 12, 4
    tile = _SIZE * scale
    rows = list(data.items())
    width = label_w + per_client * (tile + pad)
    height = max(1, len(rows)) * (tile + cap_h + pad) + pad
    sheet = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for r, (name, split) in enumerate(rows):
        x_train, y_train = split[0], split[1]
        top = pad + r * (tile + cap_h + pad)
        draw.text((4, top + tile // 2 - 6), name, fill=(0, 0, 0), font=font)
        for c in range(min(per_client, len(x_train))):
            left = label_w + c * (tile + pad)
            img = Image.fromarray(np.asarray(x_train[c], dtype=np.uint8), "RGB")
            sheet.paste(img.resize((tile, tile), Image.Resampling.NEAREST), (left, top))
            draw.text(
                (left + tile // 2 - 3, top + tile),
                str(int(y_train[c])),
                fill=(200, 0, 0),
                font=font,
            )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path, format="PNG")

"""SynthDigits, regenerated: Ganin & Lempitsky (2015)'s "Synthetic Digits" recipe, offline.

Ganin & Lempitsky (ICML 2015, Sec. 5) made ~500,000 images (the released `synth_train_32x32.mat`
/ `synth_test_32x32.mat` hold 479,400 train and 9,553 test images) by rendering one-, two- and
three-digit numbers in Windows fonts, varying the position, orientation, background and stroke
colours and the amount of blur, with degrees of variation chosen to resemble SVHN. Like SVHN's
cropped-digit format, each 32x32 image is centred on one digit, which is its label; the other
digits of the number are neighbours cut off by the frame.

This module follows that recipe with the fonts bundled in installed packages (the ones
`digits-offline` uses: matplotlib's DejaVu, STIX and Computer Modern) and its text renderer
(`fedvl.data.offline`). It is a regeneration, not the original file: fonts, ranges and sizes
differ. Images are 32x32x3 uint8, labels int64 0..9 (balanced), deterministic from the seed and
cached on disk; the default size is 10,000 train + 2,000 test images.
"""

from __future__ import annotations

import operator
from pathlib import Path

import numpy as np

from fedvl.data.cache import cache_root, save_npz_atomic

# The offline renderer's building blocks; SynthDigits differs only in its ranges and colours.
from fedvl.data.offline.builder import Split, valid_split
from fedvl.data.offline.glyphs import render_masks
from fedvl.data.offline.imageops import (
    blur,
    contrasting_colours,
    gradient,
    luma,
    noise,
    over,
    to_uint8,
    uniform,
)
from fedvl.data.offline.printed import balanced_labels

__all__ = ["DEFAULT_TEST", "DEFAULT_TRAIN", "SIZE", "cache_path", "make_synthdigits",
           "render_synthdigits"]

SIZE = 32
DEFAULT_TRAIN = 10_000
DEFAULT_TEST = 2_000
# Bump whenever the generated pixels change, so stale caches are never reused.
_CACHE_VERSION = "v1"
# Train and test draw from separate streams: a different test size leaves the train set as is.
_STREAM_TRAIN, _STREAM_TEST = 1, 2
_OFFSET = 331
# Recipe ranges (pixels of the 32x32 output, degrees): digit height, rotation, centre shift.
_HEIGHT = (14.0, 24.0)
_ANGLE = 12.0
_SHIFT = 2.0
# Each side gets a neighbour digit with this probability: 1, 2 or 3 digits in 1:2:1 ratio.
_NEIGHBOUR_P = 0.5
_STROKE_P = 0.3
_BLUR = (0.2, 1.3)


def render_synthdigits(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(n, 32, 32, 3) uint8 SynthDigits images, each centred on the digit `labels[i]`."""
    n = len(labels)
    if n == 0:
        return np.zeros((0, SIZE, SIZE, 3), dtype=np.uint8)
    fill, outer = render_masks(labels, rng, height=_HEIGHT, angle=_ANGLE, shift=_SHIFT,
                               neighbour_p=_NEIGHBOUR_P, stroke_p=_STROKE_P, size=SIZE)
    base, fg = contrasting_colours(rng, n, 0.25)
    _, stroke_col = contrasting_colours(rng, n, 0.0)
    # A soft gradient, brighter or darker away from the text colour: SynthDigits backgrounds are
    # plain, without SVHN's structured clutter (the gap Ganin & Lempitsky point out).
    away = np.sign(0.5 - luma(base)).astype(np.float32)[:, None, None]
    ramp = gradient(rng, n, SIZE) * uniform(rng, 0.0, 0.35, (n, 1, 1)) * away
    img = over(over(base[:, None, None] + ramp[..., None], stroke_col, outer), fg, fill)
    # The amount of blur varies per image; sigmas are rounded to 0.1 so that each group of
    # equal sigmas is blurred in one call.
    sigma = np.round(rng.uniform(*_BLUR, n), 1)
    for s in np.unique(sigma):
        pick = sigma == s
        img[pick] = blur(img[pick], float(s))
    return to_uint8(img + noise(rng, 0.015, img.shape))


def cache_path(seed: int = 0, n_train: int = DEFAULT_TRAIN, n_test: int = DEFAULT_TEST) -> Path:
    """Cache file of one configuration; its directory is $FEDVL_CACHE_DIR or ~/.cache/fedvl."""
    return cache_root() / f"synthdigits-{_CACHE_VERSION}-seed{seed}-{n_train}-{n_test}.npz"


_FIELDS = ("x_train", "y_train", "x_test", "y_test")


def _load_cache(path: Path, n_train: int, n_test: int) -> Split | None:
    """The cached split, or None when absent or not a valid one (then it is regenerated)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            split = tuple(np.array(z[f]) for f in _FIELDS)
    except Exception:  # noqa: BLE001 - any unreadable cache is simply regenerated
        return None
    out = (split[0], split[1], split[2], split[3])
    return out if valid_split(out, n_train, n_test) else None


def make_synthdigits(seed: int = 0, n_train: int = DEFAULT_TRAIN, n_test: int = DEFAULT_TEST,
                     cache: bool = True) -> Split:
    """(x_train, y_train, x_test, y_test): uint8 (N, 32, 32, 3) images and int64 labels 0..9.

    Equal arguments give equal bytes; the result is cached under `cache_path(...)` (written
    whole through a temporary file, so a reader never sees half of it).
    """
    seed, n_train, n_test = (operator.index(v) for v in (seed, n_train, n_test))
    if seed < 0 or n_train < 1 or n_test < 0:
        raise ValueError(f"SynthDigits needs seed >= 0, n_train >= 1 and n_test >= 0; got seed "
                         f"{seed}, n_train {n_train}, n_test {n_test}")
    path = cache_path(seed, n_train, n_test)
    if cache:
        found = _load_cache(path, n_train, n_test)
        if found is not None:
            return found
    out: list[np.ndarray] = []
    for stream, n in ((_STREAM_TRAIN, n_train), (_STREAM_TEST, n_test)):
        rng = np.random.default_rng([seed, _OFFSET, stream])
        y = balanced_labels(n, rng)
        out += [np.ascontiguousarray(render_synthdigits(y, rng)), y.astype(np.int64)]
    split = (out[0], out[1], out[2], out[3])
    if cache:
        save_npz_atomic(path, dict(zip(_FIELDS, split, strict=True)), "SynthDigits")
    return split

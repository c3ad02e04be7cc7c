"""The embedded offline feature-shift benchmark "digits-offline": five digit styles, generated.

Five clients share the label space 0..9 but differ strongly in image style, imitating the
classic Digit-Five federation (MNIST, MNIST-M, SVHN, SynthDigits, USPS). It is built only from
data shipped with installed packages, so it works without network access or a data directory:

* scikit-learn's 1797 real handwritten 8x8 digits (``sklearn.datasets.load_digits``), split
  disjointly across the three handwritten clients;
* digits rendered with PIL from the TrueType fonts bundled with matplotlib.

Every image is 28x28x3 ``uint8`` (HWC) and every label ``int64``. Generation is deterministic
from one integer seed and takes a few seconds; results are cached on disk.

Modules: `clients` (the style names and their random streams), `bases` (scikit-learn's digits
and their split over the handwritten clients), `imageops` (batch image operations), `glyphs`
(fonts and printed-digit masks), `handwritten` and `printed` (the style renderers), `builder`
(generation and the disk cache) and `preview` (a PNG contact sheet).
"""

from __future__ import annotations

from fedvl.data.offline.bases import handwritten_base_index
from fedvl.data.offline.builder import cache_path, make_digits_offline
from fedvl.data.offline.clients import CLIENT_NAMES, HANDWRITTEN_CLIENTS
from fedvl.data.offline.glyphs import digit_fonts
from fedvl.data.offline.preview import save_preview

__all__ = [
    "CLIENT_NAMES",
    "HANDWRITTEN_CLIENTS",
    "cache_path",
    "digit_fonts",
    "handwritten_base_index",
    "make_digits_offline",
    "save_preview",
]

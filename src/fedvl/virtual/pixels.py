"""How a virtual-data generator's raw output becomes [0, 1] pixel values.

`affine` (the default) rescales the generator's natural range onto [0, 1]: (x + 1) / 2 for the
tanh-like generators, 0.5 + 0.25 x for up-sampled noise (whose values are read as already
normalised pixels). `clamp` keeps the raw values as pixel values and clips them to [0, 1], which
is what writing the raw output with `torchvision.utils.save_image` does (the VHL code's files):
negative values become black.
"""

from __future__ import annotations

import torch

PIXEL_MAPPINGS = ("affine", "clamp")


def check_pixel_mapping(mapping: str) -> None:
    """Raise if `mapping` is not one of `PIXEL_MAPPINGS`."""
    if mapping not in PIXEL_MAPPINGS:
        raise ValueError(f"pixel_mapping is '{mapping}'; allowed: {', '.join(PIXEL_MAPPINGS)}")


def to_unit_range(raw: torch.Tensor, mapping: str, offset: float, scale: float) -> torch.Tensor:
    """Raw generator output -> [0, 1]: offset + scale * raw (`affine`) or raw (`clamp`), clipped."""
    check_pixel_mapping(mapping)
    if mapping == "clamp":
        return raw.clamp(0, 1)
    return (offset + scale * raw).clamp(0, 1)

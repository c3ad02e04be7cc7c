"""Up-sampled Gaussian noise (VHL's `Gaussian_Noise`): one random low-resolution mean per class.

Class i: mu_i ~ N(0, I) in C x (H/4) x (W/4); samples mu_i + noise_std * eps, bilinearly
up-sampled to H x W. The values are read as already-normalised pixels: the returned [0, 1] image
is 0.5 + 0.25 * value (clamped), so that after the virtual normalisation (mean 0.5, std 0.25)
the model sees the noise itself (clamped to [-2, 2]). `pixel_mapping='clamp'` instead takes the
values as [0, 1] pixels and clips them, as the VHL code's saved images do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedvl.registry import register_virtual_generator
from fedvl.virtual.pixels import check_pixel_mapping, to_unit_range


@register_virtual_generator("upsampled_noise")
def upsampled_noise(num_classes: int, per_class: int, image_shape: tuple[int, int, int],
                    noise_std: float = 0.5, factor: int = 4,
                    pixel_mapping: str = "affine", device: torch.device | str = "cpu"
                    ) -> torch.Tensor:
    """Per-class low-resolution Gaussian means plus noise, bilinearly up-sampled (on the CPU)."""
    # `device` is the registry's convention; one up-sampling gains nothing from a GPU.
    del device
    check_pixel_mapping(pixel_mapping)
    c, h, w = image_shape
    lh, lw = max(1, h // factor), max(1, w // factor)
    means = torch.randn(num_classes, c, lh, lw, device="cpu")
    low = (means.repeat_interleave(per_class, dim=0)
           + noise_std * torch.randn(num_classes * per_class, c, lh, lw, device="cpu"))
    up = F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    return to_unit_range(up, pixel_mapping, 0.5, 0.25)

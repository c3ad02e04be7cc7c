"""Virtual (synthetic, data-free) datasets for VHL: generated once per run from the run seed.

Every generator is registered by name in `VIRTUAL_GENERATORS` and has the signature
`fn(num_classes, per_class, image_shape, device=..., **options) -> images` returning float
images in [0, 1] of shape (num_classes * per_class, C, H, W), class-major (class k occupies rows
k*per_class .. (k+1)*per_class - 1). It draws from the global (CPU) torch RNG, which
`make_virtual_dataset` seeds through `fedvl.seeding.seeded`, so the caller's RNG is untouched
and the same seed always gives the same draws on every device. `device` is where it may
compute (the run's device): `style_gan` runs its forward passes there, the cheaper generators
compute on the CPU whatever it says; images may come back on `device`, and
`make_virtual_dataset` brings them to the CPU. The registered generators take
`pixel_mapping` ('affine' or 'clamp', see `fedvl.virtual.pixels`) for how their raw output
becomes [0, 1] pixels.

Images travel as 8-bit (like the PNG/JPEG files the VHL code reads) and are normalised on the
client with mean 0.5 and std 0.25 per channel (the VHL loader's statistics), giving values in
[-2, 2], about the range of the normalised real images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedvl.data.transforms import save_grid, to_uint8
from fedvl.registry import VIRTUAL_GENERATORS, register_virtual_generator
from fedvl.seeding import seeded
from fedvl.timing import timed
from fedvl.virtual import decoder, noise, stylegan  # noqa: F401  (registers the generators)

VIRTUAL_MEAN = 0.5
VIRTUAL_STD = 0.25

__all__ = ["VIRTUAL_GENERATORS", "VirtualDataset", "make_virtual_dataset", "normalise",
           "register_virtual_generator", "save_grid", "to_uint8"]


def normalise(images: torch.Tensor, mean: float = VIRTUAL_MEAN, std: float = VIRTUAL_STD
              ) -> torch.Tensor:
    """uint8 or [0, 1] images -> float (x - mean) / std."""
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    return (x - mean) / std


@dataclass
class VirtualDataset:
    """A labelled virtual dataset: 8-bit images and virtual class ids 0..num_classes-1."""

    images: torch.Tensor  # uint8 (N, C, H, W)
    labels: torch.Tensor  # int64 (N,)
    num_classes: int
    generator: str

    def normalised(self, mean: float = VIRTUAL_MEAN, std: float = VIRTUAL_STD) -> torch.Tensor:
        """Float images ready for a model."""
        return normalise(self.images, mean, std)


def make_virtual_dataset(name: str, num_classes: int, per_class: int,
                         image_shape: tuple[int, int, int], seed: int, *,
                         device: torch.device | str = "cpu", **options: Any) -> VirtualDataset:
    """Generate `per_class` images for each of `num_classes` virtual classes with generator
    `name`, deterministically from `seed`, computing on `device`; the dataset is on the CPU."""
    if num_classes < 1 or per_class < 1:
        raise ValueError(f"virtual dataset needs >= 1 class and >= 1 image per class, got "
                         f"{num_classes} classes x {per_class}")
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"virtual dataset device {device!r} is not a torch device; allowed: "
                         "a torch.device or a name such as 'cpu', 'cuda' or 'cuda:0'") from e
    fn = VIRTUAL_GENERATORS.get(name)
    # Generating the images is the synthesis of a run that uses them (`fedvl.timing`); the copy
    # to the CPU is inside the block because it waits for a GPU's queued work, which then counts.
    with seeded(seed), torch.no_grad(), timed("synthesis"):
        images = fn(num_classes, per_class, tuple(image_shape), device=where,
                    **options).to("cpu")
    expected = (num_classes * per_class, *image_shape)
    if tuple(images.shape) != expected:
        raise RuntimeError(f"generator '{name}' returned shape {tuple(images.shape)}, "
                           f"expected {expected}")
    labels = torch.arange(num_classes, device="cpu").repeat_interleave(per_class)
    return VirtualDataset(to_uint8(images), labels, num_classes, name)

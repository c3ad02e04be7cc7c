"""The dataset-condensation ConvNet (conv-norm-relu-pool blocks, linear classifier)."""

from __future__ import annotations

import torch
from torch import nn

from fedvl.defaults import MAX_FIRST_PADDING
from fedvl.models.base import FedModel, infer_feature_dim, norm_layer
from fedvl.models.pooling import AvgPool2x2
from fedvl.registry import register_model


def first_conv_padding(first_padding: int | None, in_channels: int, image_size: int) -> int:
    """Padding of the first convolution: `first_padding`, or when None the DC ConvNet's rule
    (3 for 1-channel 28 px images, which become 32 px, else 1)."""
    if first_padding is None:
        return 3 if (in_channels == 1 and image_size == 28) else 1
    if (isinstance(first_padding, bool) or not isinstance(first_padding, int)
            or not 0 <= first_padding <= MAX_FIRST_PADDING):
        raise ValueError(f"convnet first_padding must be an integer in [0, {MAX_FIRST_PADDING}] "
                         f"(3: the FedVCK reference on 28 px images), got {first_padding!r}")
    return first_padding


@register_model("convnet")
class ConvNet(FedModel):
    """ConvNet of `depth` conv blocks; the DC default is width 128, depth 3, instance norm.

    `first_padding` sets the first convolution's padding (None: 3 for 1-channel 28 px images,
    else 1).
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        width: int = 128,
        depth: int = 3,
        norm: str = "instance",
        pooling: str = "avg",
        first_padding: int | None = None,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"convnet depth must be >= 1, got {depth}")
        if pooling not in ("avg", "max", "none"):
            raise ValueError(f"unknown pooling '{pooling}'; allowed: avg, max, none")
        first = first_conv_padding(first_padding, in_channels, image_size)
        layers: list[nn.Module] = []
        c, size = in_channels, image_size
        for i in range(depth):
            # The FedVCK reference pads 3-channel 28 px inputs by 3 too (28 -> 32 -> 4x4 after
            # three pools, 3x3 with padding 1): `first_padding=3` reproduces it.
            pad = first if i == 0 else 1
            layers.append(nn.Conv2d(c, width, kernel_size=3, padding=pad))
            size = size + 2 * pad - 2
            layers.append(norm_layer(norm, width, (size, size)))
            layers.append(nn.ReLU(inplace=True))
            if pooling != "none":
                layers.append(AvgPool2x2() if pooling == "avg" else nn.MaxPool2d(2, 2))
                size //= 2
            c = width
        self.features = nn.Sequential(*layers)
        self.feature_dim = infer_feature_dim(self.features, in_channels, image_size)
        self.num_classes = num_classes
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).flatten(1)

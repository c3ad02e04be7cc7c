"""The dataset-condensation ConvNet (conv-norm-relu-pool blocks, linear classifier)."""

from __future__ import annotations

import torch
from torch import nn

from fedvl.models.base import FedModel, infer_feature_dim, norm_layer
from fedvl.models.pooling import AvgPool2x2
from fedvl.registry import register_model


@register_model("convnet")
class ConvNet(FedModel):
    """ConvNet of `depth` conv blocks; the DC default is width 128, depth 3, instance norm."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        width: int = 128,
        depth: int = 3,
        norm: str = "instance",
        pooling: str = "avg",
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"convnet depth must be >= 1, got {depth}")
        if pooling not in ("avg", "max", "none"):
            raise ValueError(f"unknown pooling '{pooling}'; allowed: avg, max, none")
        layers: list[nn.Module] = []
        c, size = in_channels, image_size
        for i in range(depth):
            # Grayscale 28x28 gets padding 3 so that it becomes 32x32, as in the reference code.
            pad = 3 if (i == 0 and in_channels == 1 and image_size == 28) else 1
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

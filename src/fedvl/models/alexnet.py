"""AlexNet as used by DESA (no normalisation by default; first conv padding 4)."""

from __future__ import annotations

import torch
from torch import nn

from fedvl.models.base import FedModel, infer_feature_dim
from fedvl.registry import register_model


@register_model("alexnet")
class AlexNet(FedModel):
    """Five-conv AlexNet; `width` scales every layer (width 128 -> 128/192/256/192/192)."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        width: int = 128,
        batchnorm: bool = False,
    ) -> None:
        super().__init__()
        w = [width, width * 3 // 2, width * 2, width * 3 // 2, width * 3 // 2]

        def block(cin: int, cout: int, k: int, pad: int) -> list[nn.Module]:
            mods: list[nn.Module] = [nn.Conv2d(cin, cout, kernel_size=k, padding=pad)]
            if batchnorm:
                mods.append(nn.BatchNorm2d(cout))
            mods.append(nn.ReLU(inplace=True))
            return mods

        self.features = nn.Sequential(
            *block(in_channels, w[0], 5, 4), nn.MaxPool2d(2, 2),
            *block(w[0], w[1], 5, 2), nn.MaxPool2d(2, 2),
            *block(w[1], w[2], 3, 1),
            *block(w[2], w[3], 3, 1),
            *block(w[3], w[4], 3, 1), nn.MaxPool2d(2, 2),
        )
        self.feature_dim = infer_feature_dim(self.features, in_channels, image_size)
        self.num_classes = num_classes
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).flatten(1)

"""CIFAR-style ResNet18 (3x3 stem, no max-pool) with batch or group normalisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.devices import needs_deterministic_kernels
from fedvl.models.base import FedModel, norm_layer
from fedvl.registry import register_model


class BasicBlock(nn.Module):
    """Two 3x3 convs with a (projected) identity shortcut."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = norm_layer(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = norm_layer(norm, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), norm_layer(norm, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.n1(self.conv1(x)))
        out = self.n2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


@register_model("resnet18")
class ResNet18(FedModel):
    """ResNet18 with blocks [2,2,2,2], widths w,2w,4w,8w (w=64), global average pooling."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        width: int = 64,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        if norm not in ("batch", "group", "instance"):
            raise ValueError(
                f"resnet18 norm '{norm}' not supported; allowed: batch, group, instance")
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), norm_layer(norm, width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        cin = width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(cin, cout, stride, norm), BasicBlock(cout, cout, 1, norm)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.feature_dim = cin
        self.num_classes = num_classes
        self.classifier = nn.Linear(cin, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        # adaptive_avg_pool2d's backward has no deterministic CUDA kernel (torch raises under
        # --deterministic); the mean is the same pooling.
        if needs_deterministic_kernels(out):
            return out.mean((2, 3))
        return F.adaptive_avg_pool2d(out, 1).flatten(1)

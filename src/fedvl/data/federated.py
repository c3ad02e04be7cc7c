"""Per-client tensors of a federation, plus the statistics methods need from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedvl.data.transforms import PixelImages


@dataclass
class ClientData:
    """One client's private train/test tensors (images normalised, N x C x H x W)."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    # Raw private data when x_train/y_train hold a distilled set (`--local-data virtual`).
    x_real: torch.Tensor | None = None
    y_real: torch.Tensor | None = None

    @property
    def num_train(self) -> int:
        """Number of training samples."""
        return int(self.y_train.shape[0])

    def class_counts(self, num_classes: int) -> torch.Tensor:
        """Training samples per class."""
        return torch.bincount(self.y_train, minlength=num_classes)


@dataclass
class FederatedDataset:
    """A benchmark instance: clients, label space, and the normalisation in use."""

    name: str
    clients: list[ClientData]
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # Images are a tensor or `PixelImages` (uint8, normalised a slice at a time when read).
    global_test: tuple[torch.Tensor | PixelImages, torch.Tensor] | None = None
    info: dict[str, object] = field(default_factory=dict)
    # Clients kept out of training (`--holdout-clients`): evaluated only, as unseen clients.
    holdout: list[ClientData] = field(default_factory=list)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every image."""
        c, h, w = self.clients[0].x_train.shape[1:]
        return int(c), int(h), int(w)

    @property
    def client_names(self) -> list[str]:
        """Client names in index order."""
        return [c.name for c in self.clients]

    def client_index(self, key: str | int) -> int:
        """Resolve a client index or name to its index."""
        names = self.client_names
        if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
            i = int(key)
            if not 0 <= i < len(names):
                raise ValueError(f"client index {i} out of range 0..{len(names) - 1}")
            return i
        if key not in names:
            raise ValueError(f"unknown client '{key}'; allowed: {', '.join(names)}")
        return names.index(key)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Map normalised images back to [0, 1] pixel space (clipped)."""
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        return (x * std + mean).clamp(0, 1)


def class_channel_stats(
    x: torch.Tensor, y: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean and (population) std per class and channel, using each class's own pixel count.

    Returns (mean [K, C], std [K, C], counts [K]); classes without samples get mean 0, std 0.
    """
    n, c = x.shape[:2]
    flat = x.reshape(n, c, -1).double()
    pix = flat.shape[2]
    s1 = torch.zeros(num_classes, c, dtype=torch.float64, device=x.device).index_add_(
        0, y, flat.sum(2))
    s2 = torch.zeros(num_classes, c, dtype=torch.float64, device=x.device).index_add_(
        0, y, (flat**2).sum(2))
    counts = torch.bincount(y, minlength=num_classes)
    denom = (counts.double() * pix).clamp_min(1).unsqueeze(1)
    mean = s1 / denom
    var = (s2 / denom - mean**2).clamp_min(0)
    return mean.float(), var.sqrt().float(), counts

"""A learnable synthetic (distilled) image set with fixed, class-blocked labels."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fedvl.data.federated import class_channel_stats
from fedvl.safeload import load_torch


def _ipc_list(ipc: int | Sequence[int], num_classes: int) -> list[int]:
    if isinstance(ipc, int):
        if ipc < 1:
            raise ValueError(f"ipc must be >= 1, got {ipc}")
        return [ipc] * num_classes
    out = [int(v) for v in ipc]
    if len(out) != num_classes or any(v < 0 for v in out) or sum(out) == 0:
        raise ValueError(f"per-class ipc must be {num_classes} non-negative counts (not all 0), "
                         f"got {out}")
    return out


class SyntheticSet:
    """Images in normalised space (a leaf tensor with grad) and labels 0..0,1..1,... (fixed)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int,
                 meta: dict[str, Any] | None = None) -> None:
        if images.dim() != 4 or labels.dim() != 1 or len(images) != len(labels):
            raise ValueError(f"images must be N x C x H x W with N labels; got "
                             f"{tuple(images.shape)} and {tuple(labels.shape)}")
        self.images = images.detach().clone().float().requires_grad_(True)
        self.labels = labels.detach().clone().long()
        self.num_classes = int(num_classes)
        self.meta: dict[str, Any] = dict(meta or {})

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def blocked_labels(ipc: int | Sequence[int], num_classes: int) -> torch.Tensor:
        """ipc_0 copies of class 0, then ipc_1 of class 1, ..."""
        counts = torch.tensor(_ipc_list(ipc, num_classes), device="cpu")
        return torch.repeat_interleave(torch.arange(num_classes, device="cpu"), counts)

    @classmethod
    def noise(cls, ipc: int | Sequence[int], num_classes: int, shape: tuple[int, int, int],
              generator: torch.Generator) -> SyntheticSet:
        """N(0, 1) pixels in normalised space (DC 'noise', DESA anchors)."""
        y = cls.blocked_labels(ipc, num_classes)
        return cls(torch.randn(len(y), *shape, generator=generator, device=generator.device), y,
                   num_classes,
                   {"init": "noise"})

    @classmethod
    def from_stats(cls, ipc: int | Sequence[int], mean: torch.Tensor, std: torch.Tensor,
                   shape: tuple[int, int, int], generator: torch.Generator) -> SyntheticSet:
        """Pixels ~ N(mean[c, ch], std[c, ch]) for class c, channel ch (FedLGD init)."""
        k = mean.shape[0]
        # Drawn on the CPU generator (same pixels on every device); callers move the set.
        mean, std = mean.cpu(), std.cpu()
        y = cls.blocked_labels(ipc, k)
        eps = torch.randn(len(y), *shape, generator=generator, device=generator.device)
        x = eps * std[y].view(len(y), -1, 1, 1) + mean[y].view(len(y), -1, 1, 1)
        return cls(x, y, k, {"init": "stats"})

    @classmethod
    def from_client_stats(cls, ipc: int | Sequence[int], x: torch.Tensor, y: torch.Tensor,
                          num_classes: int, generator: torch.Generator,
                          fedlgd_scaled: bool = False) -> SyntheticSet:
        """Stats init from a client's data; `fedlgd_scaled` reproduces FedLGD's wrong-count stats.

        The public FedLGD code divides class sums by the total image count N instead of n_c, so
        its mean is n_c/N times the class mean and its 'variance' is E_c[x^2]*n_c/N - mean^2.
        """
        mean, std, counts = class_channel_stats(x, y, num_classes)
        if fedlgd_scaled:
            frac = (counts.float() / max(int(counts.sum()), 1)).unsqueeze(1)
            second = std**2 + mean**2
            mean_s = mean * frac
            std = (second * frac - mean_s**2).clamp_min(0).sqrt()
            mean = mean_s
        s = cls.from_stats(ipc, mean, std, tuple(x.shape[1:]), generator)
        s.meta["init"] = "stats-fedlgd-scaled" if fedlgd_scaled else "stats"
        return s

    @classmethod
    def from_real(cls, ipc: int | Sequence[int], x: torch.Tensor, y: torch.Tensor,
                  num_classes: int, generator: torch.Generator) -> SyntheticSet:
        """Random real images of each class (with replacement only when a class is too small)."""
        labels = cls.blocked_labels(ipc, num_classes)
        out = torch.empty(len(labels), *x.shape[1:], device=x.device)
        for c in range(num_classes):
            slots = (labels == c).nonzero().flatten()
            if len(slots) == 0:
                continue
            pool = (y == c).nonzero().flatten()
            if len(pool) == 0:
                raise ValueError(f"init 'real' needs images of class {c}, the client has none")
            if len(pool) >= len(slots):
                pick = pool[torch.randperm(len(pool), generator=generator,
                                           device=generator.device)[: len(slots)]]
            else:
                pick = pool[torch.randint(len(pool), (len(slots),), generator=generator,
                                          device=generator.device)]
            out[slots] = x[pick].float()
        return cls(out, labels, num_classes, {"init": "real"})

    @classmethod
    def from_real_means(cls, ipc: int | Sequence[int], x: torch.Tensor, y: torch.Tensor,
                        num_classes: int, generator: torch.Generator, group: int
                        ) -> SyntheticSet:
        """Each image the mean of `group` random real images of its class (all of them when
        the class has fewer), a fresh draw per image (FedAF's 'average of randomly sampled
        local data')."""
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        labels = cls.blocked_labels(ipc, num_classes)
        out = torch.empty(len(labels), *x.shape[1:], device=x.device)
        for i, c in enumerate(labels.tolist()):
            pool = (y == c).nonzero().flatten()
            if len(pool) == 0:
                raise ValueError(f"init 'mean' needs images of class {c}, the client has none")
            pick = pool[torch.randperm(len(pool), generator=generator,
                                       device=generator.device)[:group]]
            out[i] = x[pick].float().mean(0)
        return cls(out, labels, num_classes, {"init": "mean", "group": group})

    @classmethod
    def average(cls, sets: Sequence[SyntheticSet]) -> SyntheticSet:
        """Element-wise mean of sets with identical labels (DESA's 'interpolation')."""
        if not sets:
            raise ValueError("average needs at least one synthetic set")
        first = sets[0]
        for s in sets[1:]:
            if s.images.shape != first.images.shape or not torch.equal(s.labels, first.labels):
                raise ValueError("averaged synthetic sets must have the same shape and labels")
        x = torch.stack([s.images.detach() for s in sets]).mean(0)
        return cls(x, first.labels, first.num_classes, {"init": "average", "parts": len(sets)})

    # -- views ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.labels)

    @property
    def ipc(self) -> list[int]:
        """Images per class."""
        return torch.bincount(self.labels, minlength=self.num_classes).tolist()

    def to(self, device: torch.device | str) -> SyntheticSet:
        """A fresh learnable copy of this set on `device` (labels and metadata kept)."""
        return SyntheticSet(self.images.detach().to(device), self.labels.to(device),
                            self.num_classes, self.meta)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Detached copies of (images, labels) for training models on the set."""
        return self.images.detach().clone(), self.labels.clone()

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write a torch file with images, labels, num_classes and metadata."""
        torch.save({"format": "fedvl-synthetic-v1", "images": self.images.detach().cpu(),
                    "labels": self.labels.cpu(), "num_classes": self.num_classes,
                    "meta": self.meta}, Path(path))

    @classmethod
    def load(cls, path: str | Path) -> SyntheticSet:
        """Read a file written by `save`; anything else raises one ValueError naming the file."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"synthetic set file '{p}' does not exist")
        # Restricted unpickler: a crafted file is refused with one line and runs nothing.
        d = load_torch(p, "synthetic set file")
        ok = (isinstance(d, dict) and d.get("format") == "fedvl-synthetic-v1"
              and isinstance(d.get("images"), torch.Tensor)
              and isinstance(d.get("labels"), torch.Tensor)
              and isinstance(d.get("num_classes"), int))
        if not ok:
            raise ValueError(f"synthetic set file '{p}' is malformed: expected a dict with format "
                             "'fedvl-synthetic-v1', tensors 'images' and 'labels'")
        return cls(d["images"], d["labels"], int(d["num_classes"]), d.get("meta") or {})

    def save_png(self, path: str | Path, mean: Sequence[float], std: Sequence[float],
                 pad: int = 2) -> None:
        """De-normalise, clip to [0, 1] and write a grid with one row per class present."""
        from fedvl.data.transforms import save_grid

        x = self.images.detach().cpu()
        m = torch.tensor(mean, device="cpu").view(1, -1, 1, 1)
        s = torch.tensor(std, device="cpu").view(1, -1, 1, 1)
        x = (x * s + m).clamp(0, 1)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        # Classes without images (not owned under label skew) get no empty row.
        present = sorted(set(self.labels.tolist()))
        row = {c: i for i, c in enumerate(present)}
        seen = [0] * self.num_classes
        cells = []
        for c in self.labels.tolist():
            cells.append((row[c], seen[c]))
            seen[c] += 1
        save_grid(x, path, nrow=max(max(self.ipc), 1), padding=pad, cells=cells)

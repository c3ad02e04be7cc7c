"""Turning uint8 image arrays into normalised float tensors (at once or a slice at a time), and
class-stratified subsets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def to_tensor_images(
    x: np.ndarray,
    size: int,
    channels: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    chunk: int = 4096,
) -> torch.Tensor:
    """uint8 N x H x W (x C) array -> normalised float32 N x C x size x size tensor."""
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.dtype != np.uint8:
        raise ValueError(f"expected uint8 images N x H x W x C, got {x.dtype} {x.shape}")
    out = torch.empty(x.shape[0], channels, size, size, dtype=torch.float32, device="cpu")
    m = torch.tensor(mean, dtype=torch.float32, device="cpu").view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device="cpu").view(1, -1, 1, 1)
    for i in range(0, x.shape[0], chunk):
        t = torch.from_numpy(np.ascontiguousarray(x[i : i + chunk])).permute(0, 3, 1, 2).float()
        t = t / 255.0
        if t.shape[1] == 1 and channels == 3:
            t = t.expand(-1, 3, -1, -1)
        elif t.shape[1] == 3 and channels == 1:
            t = t.mean(1, keepdim=True)
        if t.shape[-1] != size or t.shape[-2] != size:
            t = F.interpolate(t, size=(size, size), mode="bilinear", antialias=True,
                              align_corners=False).clamp(0, 1)
        out[i : i + chunk] = (t - m) / s
    return out


class PixelImages:
    """uint8 images that turn into `to_tensor_images`' float tensors a slice at a time.

    A 10,000-image CIFAR-10 test set takes 117 MiB as float32 and 29 MiB as uint8; evaluation
    reads it in batches (`core.training.evaluate` slices it), so only a batch is ever float.
    Every image is converted on its own, so a slice equals the same rows of the whole
    conversion bit for bit.
    """

    def __init__(self, x: np.ndarray, size: int, channels: int, mean: tuple[float, ...],
                 std: tuple[float, ...], device: torch.device | str = "cpu") -> None:
        if x.ndim == 3:
            x = x[..., None]
        if x.ndim != 4 or x.dtype != np.uint8:
            raise ValueError(f"expected uint8 images N x H x W x C, got {x.dtype} {x.shape}")
        self.x, self.size, self.channels = x, size, channels
        self.mean, self.std = tuple(mean), tuple(std)
        self.device = torch.device(device)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def shape(self) -> torch.Size:
        """N x C x size x size, as the float tensor would have."""
        return torch.Size((len(self), self.channels, self.size, self.size))

    def __getitem__(self, index: slice | torch.Tensor | np.ndarray) -> torch.Tensor:
        """The selected images as a normalised float32 tensor on `device`."""
        if isinstance(index, torch.Tensor):
            index = index.cpu().numpy()
        rows = self.x[index]
        return to_tensor_images(rows, self.size, self.channels, self.mean,
                                self.std).to(self.device)

    def rows(self, start: int, stop: int) -> PixelImages:
        """Images `start` to `stop` (exclusive), still uint8 until read."""
        return PixelImages(self.x[start:stop], self.size, self.channels, self.mean, self.std,
                           self.device)

    def to(self, device: torch.device | str) -> PixelImages:
        """The same images, converted onto `device` when read."""
        return PixelImages(self.x, self.size, self.channels, self.mean, self.std, device)

    def tensor(self) -> torch.Tensor:
        """Every image as one float tensor (what `to_tensor_images` returns)."""
        return self[slice(None)]


def stratified_subset(y: np.ndarray, cap: int | None, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of a class-stratified random subset of at most `cap` samples."""
    n = len(y)
    if cap is None or cap >= n:
        return np.arange(n)
    classes, counts = np.unique(y, return_counts=True)
    quota = counts * cap / n
    base = np.floor(quota).astype(int)
    # Largest remainders get the leftover slots so the total is exactly `cap`.
    left = cap - base.sum()
    order = np.argsort(-(quota - base), kind="stable")
    base[order[:left]] += 1
    picked = [rng.choice(np.flatnonzero(y == c), size=q, replace=False)
              for c, q in zip(classes, base, strict=True)]
    return np.sort(np.concatenate(picked))


def to_uint8(images01: torch.Tensor) -> torch.Tensor:
    """[0, 1] floats -> uint8 (rounded, clamped)."""
    return (images01.clamp(0, 1) * 255).round().to(torch.uint8)


def save_grid(images: torch.Tensor, path: str | Path, nrow: int | None = None,
              padding: int = 1, scale: int = 1,
              cells: list[tuple[int, int]] | None = None) -> Path:
    """Write images (uint8, or floats in [0, 1]) of shape (N, C, H, W) as one PNG grid.

    Image i goes to grid cell `cells[i]` = (row, column), by default `divmod(i, nrow)`; with
    class-major data and `nrow` = images per class shown, each row is one class.
    """
    from PIL import Image

    x = images if images.dtype == torch.uint8 else to_uint8(images)
    n, c, h, w = x.shape
    if c not in (1, 3):
        raise ValueError(f"save_grid needs 1 or 3 channels, got {c}")
    nrow = nrow or max(1, int(n**0.5))
    cells = cells if cells is not None else [divmod(i, nrow) for i in range(n)]
    rows = max((r for r, _ in cells), default=0) + 1
    cols = max(nrow, max((k for _, k in cells), default=0) + 1)
    grid = torch.full((c, rows * (h + padding) + padding, cols * (w + padding) + padding), 255,
                      dtype=torch.uint8, device="cpu")
    for i, (r, col) in enumerate(cells):
        top, left = padding + r * (h + padding), padding + col * (w + padding)
        grid[:, top:top + h, left:left + w] = x[i]
    arr = grid.permute(1, 2, 0).numpy()
    img = Image.fromarray(arr[:, :, 0] if c == 1 else arr, mode="L" if c == 1 else "RGB")
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path

"""Differentiable siamese augmentation (DSA) with explicit, generator-drawn parameters.

The reference code makes real and synthetic batches share a transform by reseeding the global RNG
before each draw; here one `DSAParams` is sampled from a `torch.Generator` and applied to both, so
no global RNG is touched. Parameters have one row per "parameter group": a whole call (siamese, one
row), one row per class (siamese per class, rows picked by label), or one row per sample (ordinary
training augmentation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fedvl.devices import needs_deterministic_kernels, to_device

GROUPS = ("color", "crop", "cutout", "flip", "scale", "rotate")
DEFAULT_STRATEGY = "color_crop_cutout_flip_scale_rotate"


@dataclass(frozen=True)
class DSAConfig:
    """Reference parameter ranges (ParamDiffAug defaults) and the mode ('S' one group, 'M' all)."""

    strategy: str = DEFAULT_STRATEGY
    mode: str = "S"
    prob_flip: float = 0.5
    ratio_scale: float = 1.2
    ratio_rotate: float = 15.0
    ratio_crop_pad: float = 0.125
    ratio_cutout: float = 0.5
    brightness: float = 1.0
    saturation: float = 2.0
    contrast: float = 0.5

    def groups(self) -> list[str]:
        """Group names of the strategy, validated."""
        names = [g for g in self.strategy.split("_") if g]
        bad = [g for g in names if g not in GROUPS]
        if bad or not names:
            raise ValueError(f"unknown DSA group(s) {bad or [self.strategy]}; "
                             f"allowed: {', '.join(GROUPS)}")
        if self.mode not in ("S", "M"):
            raise ValueError(f"DSA mode '{self.mode}' is invalid; allowed: S, M")
        return names


@dataclass
class DSAParams:
    """One explicit draw: the groups to apply and per-row parameter tensors for each."""

    groups: list[str]
    rows: int
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def select(self, rows: torch.Tensor) -> DSAParams:
        """The same draw restricted to (or re-indexed by) `rows`."""
        return DSAParams(list(self.groups), int(rows.numel()),
                         {k: v[rows] for k, v in self.values.items()})


def sample_dsa_params(
    rows: int, generator: torch.Generator, cfg: DSAConfig | None = None, image_size: int = 32
) -> DSAParams:
    """Draw `rows` parameter sets (one group for the whole call in mode 'S', all in mode 'M')."""
    cfg = cfg or DSAConfig()
    names = cfg.groups()
    if cfg.mode == "S":
        names = [names[int(torch.randint(len(names), (1,), generator=generator,
                                         device=generator.device))]]
    vals: dict[str, torch.Tensor] = {}

    def u() -> torch.Tensor:
        return torch.rand(rows, generator=generator, device=generator.device)

    for g in names:
        if g == "color":
            vals["brightness"] = (u() - 0.5) * cfg.brightness
            vals["saturation"] = u() * cfg.saturation
            vals["contrast"] = u() + cfg.contrast
        elif g == "crop":
            r = int(image_size * cfg.ratio_crop_pad + 0.5)
            vals["shift_x"] = torch.randint(-r, r + 1, (rows,), generator=generator,
                                            device=generator.device)
            vals["shift_y"] = torch.randint(-r, r + 1, (rows,), generator=generator,
                                            device=generator.device)
        elif g == "cutout":
            side = int(image_size * cfg.ratio_cutout + 0.5)
            # Centre range matches the reference: one extra position when the side is even.
            hi = image_size + (1 - side % 2)
            vals["cut_x"] = torch.randint(0, hi, (rows,), generator=generator,
                                          device=generator.device)
            vals["cut_y"] = torch.randint(0, hi, (rows,), generator=generator,
                                          device=generator.device)
            vals["cut_side"] = torch.full((rows,), side, device=generator.device)
        elif g == "flip":
            vals["flip"] = u() < cfg.prob_flip
        elif g == "scale":
            lo = 1.0 / cfg.ratio_scale
            vals["scale_x"] = u() * (cfg.ratio_scale - lo) + lo
            vals["scale_y"] = u() * (cfg.ratio_scale - lo) + lo
        elif g == "rotate":
            vals["theta"] = (u() - 0.5) * 2 * cfg.ratio_rotate / 180 * math.pi
    return DSAParams(names, rows, vals)


def _per_sample(p: DSAParams, key: str, index: torch.Tensor | None, n: int) -> torch.Tensor:
    v = p.values[key]
    if index is not None:
        return to_device(v, index.device)[index]
    if p.rows == 1:
        return v.expand(n)
    if p.rows != n:
        raise ValueError(f"DSA params have {p.rows} rows but the batch has {n} images; "
                         "pass index= to map images to rows")
    return v


def apply_dsa(
    x: torch.Tensor, params: DSAParams, index: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply a drawn augmentation to x (N,C,H,W); image i uses row `index[i]` (default: i or 0)."""
    n, _, h, w = x.shape
    if index is not None:
        index = index.to(torch.long)

    def get(key: str) -> torch.Tensor:
        return to_device(_per_sample(params, key, index, n), x.device)

    for g in params.groups:
        if g == "color":
            x = x + get("brightness").to(x.dtype).view(n, 1, 1, 1)
            m = x.mean(dim=1, keepdim=True)
            x = (x - m) * get("saturation").to(x.dtype).view(n, 1, 1, 1) + m
            m = x.mean(dim=(1, 2, 3), keepdim=True)
            x = (x - m) * get("contrast").to(x.dtype).view(n, 1, 1, 1) + m
        elif g == "crop":
            # Gather from a 1-px zero-padded copy with clamped indices: vacated pixels become 0.
            xp = F.pad(x, [1, 1, 1, 1])
            gi = (torch.arange(h, device=x.device).view(1, h) + get("shift_x").view(n, 1) + 1)
            gj = (torch.arange(w, device=x.device).view(1, w) + get("shift_y").view(n, 1) + 1)
            gi = gi.clamp(0, h + 1)
            gj = gj.clamp(0, w + 1)
            b = torch.arange(n, device=x.device).view(n, 1, 1)
            x = xp.permute(0, 2, 3, 1)[b, gi.view(n, h, 1), gj.view(n, 1, w)].permute(0, 3, 1, 2)
        elif g == "cutout":
            side = get("cut_side").view(n, 1, 1)
            ii = torch.arange(h, device=x.device).view(1, h, 1)
            jj = torch.arange(w, device=x.device).view(1, 1, w)
            x0 = get("cut_x").view(n, 1, 1) - side // 2
            y0 = get("cut_y").view(n, 1, 1) - side // 2
            inside = (ii >= x0) & (ii < x0 + side) & (jj >= y0) & (jj < y0 + side)
            x = x * (~inside).unsqueeze(1).to(x.dtype)
        elif g == "flip":
            f = get("flip").view(n, 1, 1, 1)
            x = torch.where(f, x.flip(3), x)
        elif g in ("scale", "rotate"):
            theta = torch.zeros(n, 2, 3, dtype=x.dtype, device=x.device)
            if g == "scale":
                theta[:, 0, 0] = get("scale_x").to(x.dtype)
                theta[:, 1, 1] = get("scale_y").to(x.dtype)
            else:
                t = get("theta").to(x.dtype)
                theta[:, 0, 0] = t.cos()
                theta[:, 0, 1] = -t.sin()
                theta[:, 1, 0] = t.sin()
                theta[:, 1, 1] = t.cos()
            grid = F.affine_grid(theta, list(x.shape), align_corners=True)
            # grid_sample's backward has no deterministic CUDA kernel: under --deterministic
            # torch raises instead of running it, so the same sampling is done by index_select.
            x = (bilinear_sample(x, grid) if needs_deterministic_kernels(x)
                 else F.grid_sample(x, grid, align_corners=True))
    return x


def bilinear_sample(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """`F.grid_sample(x, grid, align_corners=True)` (bilinear, zero padding) from
    `index_select`, whose backward torch runs deterministically on a GPU."""
    n, c, h, w = x.shape
    ho, wo = grid.shape[1:3]
    # align_corners=True: -1 and 1 are the centres of the corner pixels.
    gx = (grid[..., 0] + 1) * ((w - 1) / 2)
    gy = (grid[..., 1] + 1) * ((h - 1) / 2)
    x0, y0 = gx.floor(), gy.floor()
    fx, fy = gx - x0, gy - y0
    rows = x.permute(0, 2, 3, 1).reshape(n * h * w, c)
    base = (torch.arange(n, device=x.device) * (h * w)).view(n, 1, 1)
    out = x.new_zeros((n, ho, wo, c))
    for yy, wy in ((y0, 1 - fy), (y0 + 1, fy)):
        for xx, wx in ((x0, 1 - fx), (x0 + 1, fx)):
            # A corner outside the image contributes 0 (zero padding); its index is clamped
            # only so that the lookup stays in range.
            inside = (xx >= 0) & (xx <= w - 1) & (yy >= 0) & (yy <= h - 1)
            idx = base + yy.clamp(0, h - 1).long() * w + xx.clamp(0, w - 1).long()
            corner = rows.index_select(0, idx.reshape(-1)).view(n, ho, wo, c)
            out = out + corner * (wx * wy * inside.to(x.dtype)).unsqueeze(-1)
    return out.permute(0, 3, 1, 2)


def siamese_dsa(
    real: torch.Tensor,
    syn: torch.Tensor,
    generator: torch.Generator,
    cfg: DSAConfig | None = None,
    y_real: torch.Tensor | None = None,
    y_syn: torch.Tensor | None = None,
    num_classes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augment both batches with the same draw (one per class when labels are given)."""
    per_class = y_real is not None and y_syn is not None and num_classes is not None
    rows = num_classes if per_class else 1
    p = sample_dsa_params(rows, generator, cfg, real.shape[-1])
    # Two calls with the same parameters transform every image as one call would; apart, the
    # real batch (usually several times the synthetic one) records no graph and gets no
    # input gradient computed only to be thrown away.
    with torch.set_grad_enabled(real.requires_grad and torch.is_grad_enabled()):
        out_real = apply_dsa(real, p, y_real if per_class else None)
    return out_real, apply_dsa(syn, p, y_syn if per_class else None)


def augment_batch(
    x: torch.Tensor, generator: torch.Generator, cfg: DSAConfig | None = None
) -> torch.Tensor:
    """Non-siamese training augmentation: independent parameters for every image."""
    return apply_dsa(x, sample_dsa_params(len(x), generator, cfg, x.shape[-1]))

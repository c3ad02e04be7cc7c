"""An untrained style-based generator (StyleGAN2-like), the VHL default virtual-data source.

Structure: mapping network PixelNorm -> `n_mlp` equalised linear layers (learning-rate
multiplier `lr_mul`, leaky ReLU 0.2 scaled by sqrt 2); a learned constant 4x4 input; per
resolution two modulated/demodulated 3x3 convolutions (the first after a x2 bilinear
up-sampling) and a modulated 1x1 "to image" layer whose outputs are summed over resolutions
(skip architecture). Everything stays at its random initialisation; the per-class structure
comes only from the style codes: class i has a mean mu_i ~ N(0, mean_std^2 I) and its samples
use z ~ N(mu_i, z_std^2 I).

Deliberate simplifications (see docs/vhl.md): bilinear up-sampling instead of transposed
convolution + blur; no noise injection (the original creates it with zero weights, so it has no
effect in an untrained generator); small channel counts so that generation is fast on a CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.registry import register_virtual_generator
from fedvl.virtual.pixels import check_pixel_mapping, to_unit_range

LRELU_GAIN = math.sqrt(2.0)


def _bias_lrelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return F.leaky_relu(x + bias.view(shape), 0.2) * LRELU_GAIN


class PixelNorm(nn.Module):
    """Normalise each latent vector to unit root-mean-square."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-8)


class EqualLinear(nn.Module):
    """Linear layer with run-time weight scaling (equalised learning rate)."""

    def __init__(self, in_dim: int, out_dim: int, bias_init: float = 0.0, lr_mul: float = 1.0,
                 activation: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim, device="cpu") / lr_mul)
        self.bias = nn.Parameter(torch.full((out_dim,), float(bias_init), device="cpu"))
        self.scale = lr_mul / math.sqrt(in_dim)
        self.lr_mul = lr_mul
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight * self.scale)
        bias = self.bias * self.lr_mul
        return _bias_lrelu(out, bias) if self.activation else out + bias


class ModulatedConv2d(nn.Module):
    """Convolution whose input channels are scaled per sample by a style (weight demodulation
    renormalises each output filter to unit norm)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, style_dim: int,
                 demodulate: bool = True, upsample: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, out_ch, in_ch, kernel, kernel, device="cpu"))
        self.scale = 1.0 / math.sqrt(in_ch * kernel * kernel)
        self.modulation = EqualLinear(style_dim, in_ch, bias_init=1.0)
        self.demodulate, self.upsample, self.pad = demodulate, upsample, kernel // 2
        self.out_ch = out_ch

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        # Scaling the input channels by the style, convolving with the shared weight and
        # rescaling each output channel equals convolving with the per-sample modulated and
        # demodulated weight, and is a plain (fast) convolution.
        s = self.modulation(style)  # (B, in)
        w = self.scale * self.weight[0]  # (out, in, k, k)
        if self.upsample:
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        out = F.conv2d(x * s[:, :, None, None], w, padding=self.pad)
        if self.demodulate:
            # ||w_o * s||^2 summed over (in, k, k) for every sample b and output channel o.
            d = torch.rsqrt(s.pow(2) @ w.pow(2).sum(dim=(2, 3)).T + 1e-8)  # (B, out)
            out = out * d[:, :, None, None]
        return out


class StyledConv(nn.Module):
    """Modulated 3x3 convolution + bias + scaled leaky ReLU."""

    def __init__(self, in_ch: int, out_ch: int, style_dim: int, upsample: bool = False) -> None:
        super().__init__()
        self.conv = ModulatedConv2d(in_ch, out_ch, 3, style_dim, upsample=upsample)
        self.bias = nn.Parameter(torch.zeros(out_ch, device="cpu"))

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        return _bias_lrelu(self.conv(x, style), self.bias)


class ToImage(nn.Module):
    """Modulated 1x1 convolution to image channels, added to the up-sampled previous output."""

    def __init__(self, in_ch: int, out_ch: int, style_dim: int) -> None:
        super().__init__()
        self.conv = ModulatedConv2d(in_ch, out_ch, 1, style_dim, demodulate=False)
        self.bias = nn.Parameter(torch.zeros(1, out_ch, 1, 1, device="cpu"))

    def forward(self, x: torch.Tensor, style: torch.Tensor,
                skip: torch.Tensor | None = None) -> torch.Tensor:
        out = self.conv(x, style) + self.bias
        if skip is not None:
            out = out + F.interpolate(skip, scale_factor=2, mode="bilinear", align_corners=False)
        return out


def default_channels(res: int, base: int) -> int:
    """Channel budget per resolution: `base` up to 8x8, then halving, at least 8."""
    return max(8, base if res <= 8 else base // (res // 8))


class StyleGenerator(nn.Module):
    """Untrained style-based generator producing `out_channels` x `size` x `size` in ~[-1, 1]."""

    def __init__(self, size: int, out_channels: int = 3, style_dim: int = 64, n_mlp: int = 1,
                 lr_mul: float = 0.01, channels: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = [PixelNorm()]
        layers += [EqualLinear(style_dim, style_dim, lr_mul=lr_mul, activation=True)
                   for _ in range(n_mlp)]
        self.mapping = nn.Sequential(*layers)
        self.style_dim = style_dim
        ch = default_channels(4, channels)
        self.const = nn.Parameter(torch.randn(1, ch, 4, 4, device="cpu"))
        self.conv1 = StyledConv(ch, ch, style_dim)
        self.to_img1 = ToImage(ch, out_channels, style_dim)
        self.ups, self.convs, self.to_imgs = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        res = 4
        while res < size:
            res *= 2
            out_ch = default_channels(res, channels)
            self.ups.append(StyledConv(ch, out_ch, style_dim, upsample=True))
            self.convs.append(StyledConv(out_ch, out_ch, style_dim))
            self.to_imgs.append(ToImage(out_ch, out_channels, style_dim))
            ch = out_ch
        self.size = size

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        w = self.mapping(z)
        x = self.conv1(self.const.expand(len(z), -1, -1, -1), w)
        img = self.to_img1(x, w)
        for up, conv, to_img in zip(self.ups, self.convs, self.to_imgs, strict=True):
            x = conv(up(x, w), w)
            img = to_img(x, w, img)
        return img


@register_virtual_generator("style_gan")
def style_gan(num_classes: int, per_class: int, image_shape: tuple[int, int, int],
              style_dim: int = 64, n_mlp: int = 1, lr_mul: float = 0.01, channels: int = 32,
              mean_std: float = 0.5, z_std: float = 0.3, batch: int = 250,
              pixel_mapping: str = "affine", device: torch.device | str = "cpu"
              ) -> torch.Tensor:
    """Images from one random StyleGenerator; class i's styles are N(mu_i, z_std^2),
    mu_i ~ N(0, mean_std^2). Output (x + 1) / 2 clamped to [0, 1] (x in about [-1, 1]), or x
    clamped with `pixel_mapping='clamp'`; computed on `device` and returned there."""
    check_pixel_mapping(pixel_mapping)
    c, h, w = image_shape
    side = 2 ** max(2, math.ceil(math.log2(max(h, w))))
    # Weights and styles are drawn on the CPU from the seeded generator, so one seed gives the
    # same ones on every device; only the forward passes run on `device`.
    gen = StyleGenerator(side, c, style_dim, n_mlp, lr_mul, channels).eval()
    means = torch.randn(num_classes, style_dim, device="cpu") * mean_std
    z = (means.repeat_interleave(per_class, dim=0)
         + z_std * torch.randn(num_classes * per_class, style_dim, device="cpu"))
    gen, z = gen.to(device), z.to(device)
    out = torch.cat([gen(zb) for zb in z.split(batch)])
    if (side, side) != (h, w):
        out = F.interpolate(out, size=(h, w), mode="area")
    return to_unit_range(out, pixel_mapping, 0.5, 0.5)

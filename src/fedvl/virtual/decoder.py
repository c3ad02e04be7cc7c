"""Random CNN decoders (VHL's `cifar_conv_decoder`): one small random decoder per class.

Decoder: Linear(z -> hidden * s * s) + BN + ReLU, reshaped to `hidden` maps of s x s (s = H/4);
four 3x3 transposed convolutions (BN + ReLU) with x2 nearest up-sampling after the first two;
four 5x5 convolutions (ReLU between) to the image channels; tanh. Kaiming init, then `steps`
SGD steps that reduce the mean squared off-diagonal correlation between the (8x8-pooled, per
channel) outputs of a batch of codes, to spread the outputs; then images from z ~ N(0, I).

The published decoder reshapes its hidden vector to 16 maps while its first transposed
convolution expects 8 input channels; here the reshape and the first layer agree (`hidden`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.registry import register_virtual_generator
from fedvl.virtual.pixels import check_pixel_mapping, to_unit_range


class ConvDecoder(nn.Module):
    """z (B, z_dim) -> image (B, C, 4s, 4s) in [-1, 1]."""

    def __init__(self, z_dim: int, out_channels: int, base: int, ngf: int = 8,
                 hidden: int = 16) -> None:
        super().__init__()
        self.hidden, self.base = hidden, base
        self.fc = nn.Sequential(nn.Linear(z_dim, hidden * base * base),
                                nn.BatchNorm1d(hidden * base * base), nn.ReLU())

        def tconv(i: int, o: int) -> list[nn.Module]:
            return [nn.ConvTranspose2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU()]

        up = nn.Upsample(scale_factor=2, mode="nearest")
        self.deconv = nn.Sequential(*tconv(hidden, ngf), up, *tconv(ngf, ngf), up,
                                    *tconv(ngf, ngf), *tconv(ngf, ngf))
        self.out = nn.Sequential(
            nn.Conv2d(ngf, ngf, 5, padding=2), nn.ReLU(),
            nn.Conv2d(ngf, ngf, 5, padding=2), nn.ReLU(),
            nn.Conv2d(ngf, ngf, 5, padding=2), nn.ReLU(),
            nn.Conv2d(ngf, out_channels, 5, padding=2), nn.Tanh())
        for m in self.modules():
            if isinstance(m, nn.Conv2d | nn.ConvTranspose2d | nn.Linear):
                nn.init.kaiming_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.fc(z).view(len(z), self.hidden, self.base, self.base)
        return self.out(self.deconv(h))


def offdiag_correlation(images: torch.Tensor, pooled: int = 8) -> torch.Tensor:
    """Mean squared off-diagonal correlation between the samples of a batch, per channel."""
    x = F.adaptive_avg_pool2d(images, pooled)
    b, c = x.shape[:2]
    x = x.permute(1, 0, 2, 3).reshape(c, b, -1)
    x = x - x.mean(dim=2, keepdim=True)
    x = x / (x.norm(dim=2, keepdim=True) + 1e-8)
    corr = x @ x.transpose(1, 2)
    off = ~torch.eye(b, dtype=torch.bool, device=images.device)
    return corr[:, off].pow(2).mean()


@register_virtual_generator("random_cnn")
def random_cnn(num_classes: int, per_class: int, image_shape: tuple[int, int, int],
               z_dim: int = 8, ngf: int = 8, hidden: int = 16, steps: int = 20,
               lr: float = 0.01, batch: int = 32, pixel_mapping: str = "affine",
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Per class one randomly initialised (briefly decorrelated) decoder; (tanh + 1) / 2, or
    tanh clipped to [0, 1] with `pixel_mapping='clamp'` (computed on the CPU)."""
    # `device` is the registry's convention. The decoders draw their latents between training
    # steps from the seeded CPU generator, and are tiny (8 channels): kept on the CPU.
    del device
    check_pixel_mapping(pixel_mapping)
    c, h, w = image_shape
    base = max(1, max(h, w) // 4)
    out = []
    for _ in range(num_classes):
        dec = ConvDecoder(z_dim, c, base, ngf, hidden)
        if steps > 0:
            opt = torch.optim.SGD(dec.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
            dec.train()
            with torch.enable_grad():
                for _ in range(steps):
                    loss = offdiag_correlation(dec(torch.randn(batch, z_dim, device="cpu")))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        # Batch-norm statistics from a cumulative average over a few batches, then eval mode.
        for m in dec.modules():
            if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                m.reset_running_stats()
                m.momentum = None
        dec.train()
        for _ in range(4):
            dec(torch.randn(batch, z_dim, device="cpu"))
        dec.eval()
        img = dec(torch.randn(per_class, z_dim, device="cpu"))
        if img.shape[2:] != (h, w):
            img = F.interpolate(img, size=(h, w), mode="bilinear", align_corners=False)
        out.append(img)
    return to_unit_range(torch.cat(out), pixel_mapping, 0.5, 0.5)

"""2x2 average pooling that computes exactly what `nn.AvgPool2d(2, 2)` does, faster on CPU.

PyTorch's CPU kernel for `avg_pool2d` on NCHW tensors is slow where it need not be: summing the
four strided views of each window is 1.3-4x faster on small activations (batch 32) on one
thread (`benchmarks/results/pool-speed-cpu.json`); a whole training step of the 32-wide ConvNet
at batch 32 gains 8-11 % (14.1 to 12.9 ms at 28 px, 17.2 to 15.4 ms at 32 px), as convolutions
dominate it. The sum runs in the kernel's order, so the output is bit-for-bit the kernel's, and
the backward spreads grad/4 over each window as the kernel's backward does (a training run's
weights come out identical). The backward is written in differentiable ops, so gradient matching
(which differentiates through parameter gradients) gets second derivatives too. Rows whose
length is a multiple of 32 floats alias in the cache, so past about two million elements those
(and any activation past 16 million) keep the kernel, as do odd sides (which would need
cropping); every measured shape follows this rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many elements the strided sum was faster at every measured shape (8 MiB float32).
STRIDED_ANY_NUMEL = 1 << 21
# Rows of a multiple of this many floats alias in the cache: slower than the kernel from 4 M
# elements (32 and 64 px); other widths gain up to 12.8 M (2x at 28 px) and lose at 42 M.
ALIASING_ROW = 32
STRIDED_MAX_NUMEL = 1 << 24


class _Pool2x2(torch.autograd.Function):
    """Strided-sum forward and expand backward of a 2x2, stride-2 average pool (even sides)."""

    # Lets torch.func (vmap, grad) run it, as stacked client training does.
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (x[:, :, 0::2, 0::2] + x[:, :, 0::2, 1::2] + x[:, :, 1::2, 0::2]
                + x[:, :, 1::2, 1::2]) * 0.25

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        """Nothing to keep: the backward needs only the gradient's shape."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n, c, h2, w2 = grad.shape
        # grad * 0.25 equals grad / 4 exactly (a power of two), the kernel's division.
        quarter = grad * 0.25
        if torch.is_grad_enabled():
            # A double backward (gradient matching) needs differentiable ops.
            spread = quarter[:, :, :, None, :, None].expand(n, c, h2, 2, w2, 2)
            return spread.reshape(n, c, 2 * h2, 2 * w2)
        # Four strided writes copy the same values 3x faster than reshaping the expanded view
        # (whose copy kernel walks the zero strides element by element).
        out = grad.new_empty(n, c, 2 * h2, 2 * w2)
        for i in (0, 1):
            for j in (0, 1):
                out[:, :, i::2, j::2] = quarter
        return out


def _strided_pays(x: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dim() != 4 or not x.is_contiguous():
        return False
    h, w = x.shape[2], x.shape[3]
    if h % 2 or w % 2:
        return False
    n = x.numel()
    return n <= STRIDED_ANY_NUMEL or (w % ALIASING_ROW != 0 and n <= STRIDED_MAX_NUMEL)


def avg_pool_2x2(x: torch.Tensor) -> torch.Tensor:
    """2x2 average pooling with stride 2 (floor mode) of an N x C x H x W tensor."""
    return _Pool2x2.apply(x) if _strided_pays(x) else F.avg_pool2d(x, 2, 2)


class AvgPool2x2(nn.Module):
    """`nn.AvgPool2d(2, 2)` with the same output, faster on CPU (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return avg_pool_2x2(x)

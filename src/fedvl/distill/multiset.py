"""Real batches drawn with replacement, computed once per distinct image.

FedVCK draws `batch_real` images per class with replacement; on a client with a few dozen
images per class most of a 64-image draw repeats images already in it, and the real forward
pass (94 % of a condensation step) embedded every copy. A multiset batch is the same batch as
distinct images with their multiplicities: per-sample layers give each copy the same output,
class means and kernel MMD weight each distinct image by its count, and BatchNorm in train mode
normalises with the multiset's statistics (`weighted_batch_stats`), so every quantity equals the
one of the repeated batch up to float rounding (the sums run in another order).

The same statistics serve FedVCK's latent constraint in the paper's form (Eq. 4): a real
batch's BatchNorm statistics are recorded as the layers compute them (`weighted_batch_stats`
with `record`) and the synthetic batch is normalised with them (`fixed_batch_stats`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


def collapse(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct entries of `idx` (sorted) and how often each occurs."""
    uniq, counts = torch.unique(idx, sorted=True, return_counts=True)
    return uniq, counts


def batch_stats(x: torch.Tensor, w: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance BatchNorm in train mode takes from `x` (as the
    batch with row i repeated `w[i]` times when `w` is given), and the element count.

    The sums accumulate in float64 (x itself is not copied): a multiset and its repeated batch
    then agree to float32 rounding (in float32 the sums' order showed, 2e-5 in a
    Gaussian-kernel image gradient through FedVCK's latent constraint).
    """
    shape = [1, -1] + [1] * (x.dim() - 2)
    rows, c = x.shape[0], x.shape[1]
    per_row = x[0, 0].numel() if x.dim() > 2 else 1
    wv = (torch.ones(rows, device=x.device, dtype=torch.float64) if w is None
          else w.to(torch.float64))
    # The repeated batch's element count per channel, kept on the device (no host sync).
    n = wv.sum() * per_row
    mean = (wv @ x.reshape(rows, c, -1).sum(2, dtype=torch.float64)) / n
    d = x - mean.to(x.dtype).view(shape)
    var = (wv @ (d * d).reshape(rows, c, -1).sum(2, dtype=torch.float64)) / n   # biased, as BN
    return mean.to(x.dtype), var.to(x.dtype), n.to(x.dtype)


BatchStats = dict[nn.Module, tuple[torch.Tensor, torch.Tensor]]


def _weighted_bn_forward(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor,
                         w: torch.Tensor | None, record: BatchStats | None) -> torch.Tensor:
    """`bn(x)` in train mode for the batch in which row i of `x` occurs `w[i]` times (once
    each without `w`); the statistics it normalises with go into `record` when given."""
    mean, var, n = batch_stats(x, w)
    if record is not None:
        record[bn] = (mean.detach(), var.detach())
    if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
        assert bn.num_batches_tracked is not None
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            m = (bn.momentum if bn.momentum is not None
                 else 1.0 / float(bn.num_batches_tracked))
            # Running variance is unbiased over the repeated batch's n elements, as torch's.
            bn.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            bn.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1).clamp_min(1)), alpha=m)
    return F.batch_norm(x, mean, var, bn.weight, bn.bias, training=False, eps=bn.eps)


@contextmanager
def weighted_batch_stats(model: nn.Module, counts: torch.Tensor | None,
                         record: BatchStats | None = None) -> Iterator[None]:
    """Inside the block, every BatchNorm layer of `model` in train mode normalises a batch of
    len(counts) rows as the batch with row i repeated counts[i] times (running statistics too;
    without `counts` each row once), and records the statistics it used into `record`.

    For a model's private copy: the layers' `forward` is replaced for the block's duration.
    """
    layers = [m for m in model.modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    for bn in layers:
        bn.forward = (lambda x, bn=bn: _weighted_bn_forward(  # type: ignore[method-assign]
            bn, x, counts, record))
    try:
        yield
    finally:
        for bn in layers:
            del bn.forward


@contextmanager
def fixed_batch_stats(model: nn.Module, stats: BatchStats) -> Iterator[None]:
    """Inside the block, each BatchNorm layer in `stats` normalises with the given mean and
    variance (its affine weights still apply), whatever its mode; running statistics untouched.
    """
    layers = [m for m in model.modules() if m in stats]
    for bn in layers:
        mean, var = stats[bn]
        bn.forward = (lambda x, bn=bn, mean=mean, var=var: F.batch_norm(  # type: ignore[method-assign]
            x, mean, var, bn.weight, bn.bias, training=False, eps=bn.eps))
    try:
        yield
    finally:
        for bn in layers:
            del bn.forward

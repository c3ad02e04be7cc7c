"""Trajectory matching (MTT, Cazenavette et al. 2022): unrolled, differentiable SGD on a
synthetic set, scored by how close it lands to a recorded later checkpoint.

theta_0 = theta_s;  theta_{j+1} = theta_j - lr * grad L(f_{theta_j}(A(X_B)), Y_B)  for j < N;
loss = ||theta_N - theta*||^2 / ||theta_s - theta*||^2   (sums over every parameter entry).

The unroll runs through `torch.func.functional_call`, so the model object is only a template:
its parameters stay untouched and each step's parameters are tensors in the autograd graph,
which carries the second-order path from the loss back to the images, labels and lr.
Layers that normalise with batch statistics (BatchNorm in train mode) use each inner batch's
own statistics, as a train-mode step does; their running statistics are updated in copies
that are thrown away, so the template keeps its buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

Params = dict[str, torch.Tensor]


def soft_cross_entropy(logits: torch.Tensor, label_logits: torch.Tensor) -> torch.Tensor:
    """mean over rows and classes of -softmax(label_logits) * log_softmax(logits).

    The DynaFed code's `kd_loss` (`torch.mean` over all N x C entries): plain soft-label
    cross-entropy divided by the class count C.
    """
    return -(F.softmax(label_logits, dim=1) * F.log_softmax(logits, dim=1)).mean()


def inner_batches(n: int, batch: int, steps: int, generator: torch.Generator
                  ) -> list[torch.Tensor]:
    """`steps` index batches of size `batch`: chunks of a fresh permutation of the n rows,
    a new permutation whenever the last is used up (the MTT code's order)."""
    out: list[torch.Tensor] = []
    chunks: list[torch.Tensor] = []
    for _ in range(steps):
        if not chunks:
            # The reference pops chunks from the end of the split.
            chunks = list(torch.split(torch.randperm(n, generator=generator,
                                                     device=generator.device), batch))
        out.append(chunks.pop())
    return out


def unroll_sgd(
    model: nn.Module,
    start: Mapping[str, torch.Tensor],
    images: torch.Tensor,
    label_logits: torch.Tensor,
    lr: torch.Tensor,
    batches: list[torch.Tensor],
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Params:
    """The parameters after one SGD step of soft-label CE per batch, from `start`.

    Differentiable w.r.t. `images`, `label_logits` and `lr` (the graph of every inner gradient
    is kept); `model` serves as a template for the forward pass and is not changed. Parameters
    of `model` absent from `start` are an error.
    """
    names = [n for n, _ in model.named_parameters()]
    missing = sorted(set(names) - set(start))
    if missing:
        raise ValueError(f"the start checkpoint lacks parameters {missing}")
    params = {n: start[n].detach().clone().requires_grad_(True) for n in names}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    for idx in batches:
        x = images[idx]
        if augment is not None:
            x = augment(x)
        logits = functional_call(model, (params, buffers), (x,))
        loss = soft_cross_entropy(logits, label_logits[idx])
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {n: p - lr * g for (n, p), g in zip(params.items(), grads, strict=True)}
    return params


def trajectory_matching_loss(end: Mapping[str, torch.Tensor],
                             start: Mapping[str, torch.Tensor],
                             target: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """||end - target||^2 / ||start - target||^2 over the parameters of `end` (all entries
    flattened into one vector); `start` and `target` are constants."""
    num = sum(((end[n] - target[n].detach()) ** 2).sum() for n in end)
    den = sum(((start[n].detach() - target[n].detach()) ** 2).sum() for n in end)
    return num / den  # type: ignore[operator]

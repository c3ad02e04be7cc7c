"""Local SGD on in-memory tensors with pluggable extra loss terms, and batched evaluation."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from fedvl.models.base import FedModel


@dataclass
class TrainConfig:
    """Client optimiser and schedule."""

    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    local_epochs: int = 1
    local_steps: int | None = None
    batch_size: int = 32


@dataclass
class TrainStats:
    """What a local training run did."""

    steps: int
    samples: int
    mean_loss: float


class LossTerm(Protocol):
    """An extra objective added to cross-entropy at every local step."""

    def __call__(
        self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
        logits: torch.Tensor,
    ) -> torch.Tensor: ...


def batch_indices(
    n: int, batch_size: int, epochs: int, steps: int | None, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Shuffled mini-batch indices: `steps` batches if given, else `epochs` full passes."""
    if n == 0:
        return
    total = steps if steps is not None else epochs * math.ceil(n / batch_size)
    done = 0
    while done < total:
        perm = torch.randperm(n, generator=generator)
        for i in range(0, n, batch_size):
            if done >= total:
                return
            yield perm[i : i + batch_size]
            done += 1


def local_train(
    model: FedModel,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    generator: torch.Generator,
    terms: Sequence[LossTerm] = (),
    after_step: Callable[[FedModel, float], None] | None = None,
    augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None,
    lr_decay_step: int | None = None,
) -> TrainStats:
    """Train `model` in place with SGD on (x, y): CE + sum of `terms`; returns step counts.

    `augment` transforms each batch (drawing from `generator`); `lr_decay_step` multiplies the
    learning rate by 0.1 from that step on (the dataset-condensation evaluation schedule).
    """
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    steps = samples = 0
    loss_sum = 0.0
    for idx in batch_indices(len(y), cfg.batch_size, cfg.local_epochs, cfg.local_steps,
                             generator):
        if steps == lr_decay_step:
            for group in opt.param_groups:
                group["lr"] = cfg.lr * 0.1
        idx = idx.to(x.device)
        xb, yb = x[idx], y[idx]
        if augment is not None:
            xb = augment(xb, generator)
        z, logits = model.features_and_logits(xb)
        loss = F.cross_entropy(logits, yb)
        for term in terms:
            loss = loss + term(model, xb, yb, z, logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(model, cfg.lr)
        steps += 1
        samples += len(yb)
        loss_sum += float(loss.detach())
    return TrainStats(steps, samples, loss_sum / max(steps, 1))


@torch.no_grad()
def evaluate(
    model: FedModel, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000
) -> tuple[float, float]:
    """Accuracy (fraction) and mean CE loss of `model` on (x, y)."""
    if len(y) == 0:
        return float("nan"), float("nan")
    was_training = model.training
    model.eval()
    correct = 0
    loss = 0.0
    for i in range(0, len(y), batch_size):
        logits = model(x[i : i + batch_size])
        yb = y[i : i + batch_size]
        correct += int((logits.argmax(1) == yb).sum())
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
    model.train(was_training)
    return correct / len(y), loss / len(y)

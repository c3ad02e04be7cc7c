"""Local SGD on in-memory tensors with pluggable extra loss terms, and batched evaluation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from fedvl.models.base import FedModel


@dataclass
class TrainConfig:
    """Client optimiser and schedule.

    `lr_decay` is per communication round: round t (0-based) trains at lr * lr_decay^t. A
    round's own config (`at_round`) folds that in, and only such a config (decay 1.0) trains.
    """

    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    local_epochs: int = 1
    local_steps: int | None = None
    batch_size: int = 32
    lr_decay: float = 1.0
    autocast: str = "none"   # "bf16": forward passes under bfloat16 autocast
    # "adam": torch's Adam (L2 weight decay; `momentum` unused), for a server that trains as its
    # paper's code does (FedD3's official Adam); every client trains with SGD.
    optimizer: str = "sgd"
    # > 0: each step's gradient (all parameters together) is clipped to this L2 norm before the
    # step, as FedDyn's public code does for every method; 0: no clipping (every method here).
    max_grad_norm: float = 0.0

    def lr_at(self, rnd: int) -> float:
        """The learning rate of round `rnd` (0-based): lr * lr_decay^rnd."""
        # No arithmetic without decay: lr stays bit-identical to runs before `lr_decay` existed.
        return self.lr if self.lr_decay == 1.0 else self.lr * self.lr_decay ** rnd

    def at_round(self, rnd: int) -> TrainConfig:
        """The config round `rnd` trains with: its decayed learning rate, no further decay."""
        if self.lr_decay == 1.0:
            return self
        return replace(self, lr=self.lr_at(rnd), lr_decay=1.0)


# `--autocast` values and their dtypes ("none" trains in float32).
AUTOCAST_DTYPES = {"bf16": torch.bfloat16}


def autocast_context(kind: str, device: torch.device
                     ) -> contextlib.AbstractContextManager[object]:
    """torch.autocast on `device` for `kind` (a key of AUTOCAST_DTYPES); "none": no change."""
    if kind == "none":
        return contextlib.nullcontext()
    if kind not in AUTOCAST_DTYPES:
        raise ValueError(f"unknown autocast '{kind}'; allowed: none, "
                         f"{', '.join(AUTOCAST_DTYPES)}")
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[kind])


def check_round_config(cfg: TrainConfig) -> None:
    """Raise unless `cfg` is one round's config: a per-round decay needs the round to apply."""
    if cfg.lr_decay != 1.0:
        raise ValueError(f"TrainConfig.lr_decay = {cfg.lr_decay} is per round, so training "
                         "needs the round's config: pass `cfg.at_round(round)` (methods: "
                         "`self.client_train(client)`), not the run's config")
    if not cfg.max_grad_norm >= 0:
        raise ValueError(f"TrainConfig.max_grad_norm must be >= 0 (0: no clipping); got "
                         f"{cfg.max_grad_norm}")


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


@dataclass
class ExtraBatch:
    """Inputs (with their labels) that a loss term adds to a step's forward pass."""

    x: torch.Tensor
    y: torch.Tensor


class SharedForwardTerm(LossTerm, Protocol):
    """A loss term that may forward its own inputs in the same pass as the real batch.

    Layers with batch statistics (BatchNorm) then normalise the concatenation [x; extra], as
    one forward on a mixed batch does. When `extra_batch` returns None the term is called as a
    plain `LossTerm` (and may run its own forward passes).
    """

    def extra_batch(self, model: FedModel, x: torch.Tensor, y: torch.Tensor
                    ) -> ExtraBatch | None:
        """This step's extra inputs to forward with (x, y), or None for a separate pass."""
        ...

    def loss_with_extra(
        self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
        logits: torch.Tensor, extra: ExtraBatch, z_extra: torch.Tensor,
        logits_extra: torch.Tensor,
    ) -> torch.Tensor:
        """The term from the shared pass: features and logits of the real and extra rows."""
        ...


SharedPart = tuple[ExtraBatch, torch.Tensor, torch.Tensor]  # (extra, z_extra, logits_extra)


def forward_with_extras(
    model: FedModel, x: torch.Tensor, y: torch.Tensor, terms: Sequence[LossTerm]
) -> tuple[torch.Tensor, torch.Tensor, list[SharedPart | None]]:
    """One forward of x plus every term's extra batch: real (z, logits) and, per term, its
    (extra batch, z_extra, logits_extra), or None for terms that contributed nothing."""
    extras: list[ExtraBatch | None] = []
    for term in terms:
        ask = getattr(term, "extra_batch", None)
        extras.append(ask(model, x, y) if ask is not None else None)
    given = [e for e in extras if e is not None]
    if not given:
        z, logits = model.features_and_logits(x)
        return z, logits, [None] * len(terms)
    sizes = [len(x)] + [len(e.x) for e in given]
    z_all, logits_all = model.features_and_logits(torch.cat([x, *(e.x for e in given)]))
    zs, ls = z_all.split(sizes), logits_all.split(sizes)
    out: list[SharedPart | None] = []
    k = 1
    for e in extras:
        if e is None:
            out.append(None)
        else:
            out.append((e, zs[k], ls[k]))
            k += 1
    return zs[0], ls[0], out


def num_batches(n: int, batch_size: int, epochs: int, steps: int | None) -> int:
    """How many local steps `n` samples take: `steps` if given, else `epochs` full passes."""
    return steps if steps is not None else epochs * math.ceil(n / batch_size)


def batch_indices(
    n: int, batch_size: int, epochs: int, steps: int | None, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Shuffled mini-batch indices: `steps` batches if given, else `epochs` full passes."""
    if n == 0:
        return
    total = num_batches(n, batch_size, epochs, steps)
    done = 0
    while done < total:
        perm = torch.randperm(n, generator=generator, device=generator.device)
        for i in range(0, n, batch_size):
            if done >= total:
                return
            yield perm[i : i + batch_size]
            done += 1


OPTIMIZERS = ("sgd", "adam")


def check_plain_sgd(cfg: TrainConfig, who: str) -> None:
    """Raise unless `cfg` is plain SGD without a batch clip, all that `who` (a training loop of
    its own: DP-SGD's, the stacked clients') implements."""
    if cfg.optimizer != "sgd":
        raise ValueError(f"{who} trains with SGD only; got optimizer '{cfg.optimizer}'")
    if cfg.max_grad_norm > 0:
        raise ValueError(f"{who} does not clip the batch gradient; got max_grad_norm "
                         f"{cfg.max_grad_norm}")


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimiser `cfg` names over `model`'s parameters (SGD with momentum, or Adam)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer '{cfg.optimizer}'; allowed: {', '.join(OPTIMIZERS)}")


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
    sample_weight: torch.Tensor | None = None,
) -> TrainStats:
    """Train `model` in place with SGD on (x, y): CE + sum of `terms`; returns step counts.

    `sample_weight` (one per row of x, mean 1 for the CE's scale) weights each row's CE in the
    batch mean, e.g. FedDM's server weighting each client's synthetic set by its data share.

    Terms with an `extra_batch` method (`SharedForwardTerm`) may add inputs to the same forward
    pass as the real batch. `augment` transforms each batch (drawing from `generator`);
    `lr_decay_step` multiplies the learning rate by 0.1 from that step on (the
    dataset-condensation evaluation schedule). `cfg` is one round's config (`at_round`).
    """
    check_round_config(cfg)
    model.train()
    opt = make_optimizer(model, cfg)
    steps = samples = 0
    # Summed on the device in float64 (as a Python float would sum them): a read per step
    # would make every step wait for the device.
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    for idx in batch_indices(len(y), cfg.batch_size, cfg.local_epochs, cfg.local_steps,
                             generator):
        if steps == lr_decay_step:
            for group in opt.param_groups:
                group["lr"] = cfg.lr * 0.1
        idx = idx.to(x.device)
        xb, yb = x[idx], y[idx]
        if augment is not None:
            xb = augment(xb, generator)
        with autocast_context(cfg.autocast, xb.device):
            z, logits, shared = forward_with_extras(model, xb, yb, terms)
            if sample_weight is None:
                loss = F.cross_entropy(logits, yb)
            else:
                loss = (F.cross_entropy(logits, yb, reduction="none")
                        * sample_weight[idx]).mean()
            for term, part in zip(terms, shared, strict=True):
                if part is None:
                    loss = loss + term(model, xb, yb, z, logits)
                else:
                    loss = loss + term.loss_with_extra(  # type: ignore[attr-defined]
                        model, xb, yb, z, logits, *part)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.max_grad_norm > 0:
            # The clip factor stays a device tensor: no read of the norm on the host.
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        if after_step is not None:
            after_step(model, cfg.lr)
        steps += 1
        samples += len(yb)
        loss_sum += loss.detach().double()
    return TrainStats(steps, samples, float(loss_sum) / max(steps, 1))


# On CPU an evaluation forward takes this many rows at a time: a width-32 ConvNet's first layer
# then holds 8 MiB (cache-sized) instead of the 32 MiB of 256 rows, which made the forward up to
# 3x slower and raised the peak memory of concurrent evaluations. Every model's per-row outputs
# are the same bit for bit at either size (benchmarks/results/eval-batch-cpu.json).
CPU_FORWARD_ROWS = 64


@torch.no_grad()
@torch.inference_mode()
def evaluate(
    model: FedModel, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256
) -> tuple[float, float]:
    """Accuracy (fraction) and mean CE loss of `model` on (x, y)."""
    if len(y) == 0:
        return float("nan"), float("nan")
    was_training = model.training
    model.eval()
    correct = 0
    loss = 0.0
    for i in range(0, len(y), batch_size):
        xb = x[i : i + batch_size]
        rows = CPU_FORWARD_ROWS if xb.device.type == "cpu" else len(xb)
        parts = [model(xb[j : j + rows]) for j in range(0, len(xb), rows)]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        yb = y[i : i + batch_size]
        correct += int((logits.argmax(1) == yb).sum())
        # The loss is summed per batch of `batch_size` rows whatever the forward's size, so
        # its rounding (and every recorded loss) does not depend on CPU_FORWARD_ROWS.
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
    model.train(was_training)
    return correct / len(y), loss / len(y)


def mean_accuracy(accuracies: Iterable[float]) -> float:
    """Mean over the clients that have test images (`evaluate` gives NaN for the others);
    NaN when none has."""
    tested = [a for a in accuracies if not math.isnan(a)]
    return float(np.mean(tested)) if tested else float("nan")

"""Where the feature extractor and the real batches of each synthesis step come from."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fedvl.devices import to_device
from fedvl.distill.multiset import collapse
from fedvl.models.base import FedModel


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` on the CPU, never sharing its storage (also when `t` is on the CPU)."""
    return t.detach().to("cpu", copy=True)


# ---------------------------------------------------------------------------------------------
# Feature-extractor samplers: called once per synthesis step with the run's generator.


class RandomModelSampler:
    """A freshly initialised network every step (DM, DESA anchors, DC/GM)."""

    def __init__(self, factory: Callable[[int], FedModel]) -> None:
        # factory(seed) -> model; seeds come from the synthesis generator, so runs are repeatable.
        self.factory = factory

    def __call__(self, generator: torch.Generator) -> FedModel:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        model = self.factory(seed)
        model.train()
        return model


class FixedModelSampler:
    """The same given model every step (FedLGD iterative DM, FedVCK); a private copy is used so
    BN running statistics touched by the latent constraint never leak into the caller's model."""

    def __init__(self, model: FedModel, train_mode: bool = True) -> None:
        self.model = copy.deepcopy(model)
        self.model.train(train_mode)

    def __call__(self, generator: torch.Generator) -> FedModel:
        return self.model


class BlendedModelSampler:
    """gamma x the given weights + (1 - gamma) x a freshly initialised network's (FedAF's
    re-sampled model): a new network every step, or one per sampler (`per_step=False`).

    The model returned is one working copy, overwritten on every call; buffers (BatchNorm
    statistics) are the given model's. `factory(seed)` builds the fresh network; its seed comes
    from the synthesis generator, so runs are repeatable.
    """

    def __init__(self, model: FedModel, factory: Callable[[int], FedModel], gamma: float,
                 per_step: bool = True, train_mode: bool = False) -> None:
        if not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        self.base = copy.deepcopy(model)
        self.work = copy.deepcopy(model)
        self.factory, self.gamma = factory, gamma
        self.per_step, self.train_mode = per_step, train_mode
        self.drawn = False

    def __call__(self, generator: torch.Generator) -> FedModel:
        if self.per_step or not self.drawn:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            fresh = self.factory(seed)
            g = self.gamma
            with torch.no_grad():
                for p, b, r in zip(self.work.parameters(), self.base.parameters(),
                                   fresh.parameters(), strict=True):
                    p.copy_(b * g + r.to(p) * (1 - g))
                for w, b in zip(self.work.buffers(), self.base.buffers(), strict=True):
                    w.copy_(b)
            self.drawn = True
        self.work.train(self.train_mode)
        return self.work


def perturbation(
    shapes: Sequence[torch.Size], rho: float, generator: torch.Generator, sphere: bool = False
) -> list[torch.Tensor]:
    """A random vector (split by `shapes`) uniform in the L2 ball of radius rho (or on its sphere).

    Uniform in the ball: Gaussian direction, radius rho * U^(1/P) for P total entries. FedDM's
    public re-implementation scales a Gaussian by min(1, rho/||eps||), which puts it on the sphere.
    """
    eps = [torch.randn(s, generator=generator, device=generator.device) for s in shapes]
    norm = torch.sqrt(sum((e.double() ** 2).sum() for e in eps))
    total = sum(math.prod(s) for s in shapes)
    if sphere:
        radius = rho
    else:
        u = float(torch.rand((), generator=generator, device=generator.device, dtype=torch.float64))
        radius = rho * u ** (1.0 / total)
    scale = float(radius / max(float(norm), 1e-30))
    return [e * scale for e in eps]


class RhoBallSampler:
    """Given weights plus a fresh perturbation in the rho-ball each step (FedDM).

    The model returned is one working copy, reset to the given weights (buffers too) and
    perturbed on every call: a step's model is valid until the next call. Copying the weights
    in place computes the same values as a fresh deep copy, without rebuilding the network.
    """

    def __init__(self, model: FedModel, rho: float, sphere: bool = False,
                 train_mode: bool = False) -> None:
        if rho < 0:
            raise ValueError(f"rho must be >= 0, got {rho}")
        self.base = copy.deepcopy(model)
        self.work = copy.deepcopy(model)
        self.rho, self.sphere, self.train_mode = rho, sphere, train_mode
        self.last_delta: list[torch.Tensor] = []

    def draw(self, generator: torch.Generator) -> list[torch.Tensor]:
        """This step's perturbation of every parameter, drawn on the host as a call draws it."""
        self.last_delta = perturbation([p.shape for p in self.base.parameters()], self.rho,
                                       generator, self.sphere)
        return self.last_delta

    def __call__(self, generator: torch.Generator) -> FedModel:
        model = self.work
        params = list(model.parameters())
        delta = self.draw(generator)
        with torch.no_grad():
            for p, b, d in zip(params, self.base.parameters(), delta):
                p.copy_(b).add_(to_device(d, p.device).to(p.dtype))   # drawn on the CPU
            # BN running statistics a train-mode step moved start from the given ones again.
            for w, b in zip(model.buffers(), self.base.buffers()):
                w.copy_(b)
        model.train(self.train_mode)
        return model


# ---------------------------------------------------------------------------------------------
# Real-batch samplers: return (x, y) holding up to `per_class` images of every class.


class UniformClassSampler:
    """`per_class` images of each class, uniformly without replacement (all if fewer)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int, per_class: int) -> None:
        self.x, self.y, self.k, self.n = x, y, num_classes, per_class
        # Index drawing stays on the CPU generator (same batches on every device), on a host
        # copy of the labels: a step then never reads the device.
        self.y_cpu = host_copy(y)
        # The most images a batch holds of one class (known on the host, so a batched step
        # pads each class to this many slots without reading the device).
        counts = torch.bincount(self.y_cpu, minlength=num_classes)
        self.max_per_class = min(per_class, int(counts.max())) if len(self.y_cpu) else 0

    def indices(self, generator: torch.Generator) -> torch.Tensor:
        """Indices of one batch, grouped by class (a CPU tensor)."""
        # Sorting label + U[0,1) gives a random order inside every class block; keep the first n.
        y = self.y_cpu
        keys = y.double() + torch.rand(len(y), generator=generator, device=generator.device,
                                       dtype=torch.float64)
        order = torch.argsort(keys)
        counts = torch.bincount(y, minlength=self.k)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(len(order), device="cpu") - starts[y[order]]
        return order[rank < self.n]

    def __call__(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = to_device(self.indices(generator), self.x.device)
        return self.x[idx], self.y[idx]


def _in_eval(model: torch.nn.Module, fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
             chunk: int) -> list[Any]:
    """`fn` of `x` chunk by chunk with `model` in eval mode, its mode restored."""
    was = model.training
    model.eval()
    try:
        return [fn(x[i : i + chunk]) for i in range(0, len(x), chunk)]
    finally:
        model.train(was)


@torch.no_grad()
def eval_logits(model: FedModel, x: torch.Tensor, chunk: int = 500
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings and logits of `x` under `model` in eval mode (its mode restored), in chunks."""
    parts = _in_eval(model, model.features_and_logits, x, chunk)
    return torch.cat([z for z, _ in parts]), torch.cat([lg for _, lg in parts])


def weights_from_logits(logits: Sequence[torch.Tensor], y: torch.Tensor,
                        mix: Sequence[float] | None = None, gamma: float = 1.0,
                        bias: float = 0.0) -> torch.Tensor:
    """FedVCK weights sigmoid(gamma * (CE(sum_m mix[m] * logits[m], y) - bias)) per sample."""
    mix = list(mix) if mix is not None else [1.0 / len(logits)] * len(logits)
    z = sum(w * lg for w, lg in zip(mix, logits))
    assert isinstance(z, torch.Tensor)
    return torch.sigmoid(gamma * (F.cross_entropy(z, y, reduction="none") - bias))


@torch.no_grad()
def importance_weights(
    models: Sequence[FedModel], x: torch.Tensor, y: torch.Tensor,
    mix: Sequence[float] | None = None, gamma: float = 1.0, bias: float = 0.0,
    chunk: int = 500,
) -> torch.Tensor:
    """FedVCK weights sigmoid(gamma * (CE(ensemble logits) - bias)) per real sample.

    The ensemble is sum_m mix[m] * logits_m (FedVCK: (1-lambda) current + lambda previous);
    a model given twice (FedVCK's first round) is run once.
    """
    seen: dict[int, torch.Tensor] = {}
    for m in models:
        if id(m) not in seen:
            seen[id(m)] = torch.cat(_in_eval(m, m, x, chunk))
    return weights_from_logits([seen[id(m)] for m in models], y, mix, gamma, bias)


# How ImportanceClassSampler turns a class's weights into draw probabilities: `linear`,
# p = w / sum(w) (FedVCK's paper, Eq. 8), `softmax`, p = softmax(w) (its public code), or
# `uniform`, the weights ignored (importance sampling off, for ablations).
WEIGHTINGS = ("linear", "softmax", "uniform")


def class_probabilities(weights: torch.Tensor, y: torch.Tensor, num_classes: int,
                        weighting: str = "softmax") -> torch.Tensor:
    """Per class (rows) the probability of drawing each sample (columns) from its weights."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting '{weighting}'; allowed: {', '.join(WEIGHTINGS)}")
    w = weights.detach().cpu().double()
    rows, cols = y, torch.arange(len(y), device="cpu")
    if weighting == "uniform":
        w = torch.zeros_like(w)   # equal logits: a softmax within each class is uniform
    if weighting in ("softmax", "uniform"):
        logits = torch.full((num_classes, len(y)), float("-inf"), dtype=torch.float64,
                            device="cpu")
        logits[rows, cols] = w
        return torch.softmax(logits, dim=1)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("linear weighting needs finite weights >= 0")
    table = torch.zeros(num_classes, len(y), dtype=torch.float64, device="cpu")
    table[rows, cols] = w
    total = table.sum(1, keepdim=True)
    # A class whose weights all underflowed to 0 (a sigmoid far below its offset) has nothing
    # to prefer: its images are drawn uniformly rather than not at all.
    uniform = torch.zeros_like(table)
    uniform[rows, cols] = 1.0
    table = torch.where(total > 0, table, uniform)
    return table / table.sum(1, keepdim=True).clamp_min(1e-300)


class ImportanceClassSampler:
    """`per_class` draws per class, p from the weights within the class (`weighting`).

    `weighting="softmax"` (FedVCK's public code) draws with p = softmax(w), `"linear"` (its
    paper, Eq. 8) with p = w / sum(w). Every call draws afresh, so consecutive batches never
    share a window of one pre-drawn list (FedVCK's reference slides a stride-1 window over such
    a list; a fresh weighted draw per step is what a window of stride `per_class` gives).
    `replacement=True` (the reference) may repeat an image within a batch; `replacement=False`
    draws distinct images, at most the class's size. With `multiset=True` a draw with
    replacement comes back as its distinct images and their counts (x, y, counts): the same
    batch, each image computed once.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int, per_class: int,
                 weights: torch.Tensor, replacement: bool = True, multiset: bool = False,
                 weighting: str = "softmax") -> None:
        self.x, self.y, self.k, self.n = x, y, num_classes, per_class
        self.replacement, self.multiset = replacement, multiset and replacement
        y = y.cpu()
        counts = torch.bincount(y, minlength=num_classes)
        self.present = counts > 0
        self.probs = class_probabilities(weights, y, num_classes, weighting)[self.present]
        self.classes = torch.arange(num_classes, device="cpu")[self.present]
        # Without replacement a class gives at most its images of non-zero probability (a
        # linear weight can underflow to 0).
        drawable = (self.probs > 0).sum(1).tolist()
        self.take = [min(per_class, int(n)) for n in drawable]

    def indices(self, generator: torch.Generator) -> torch.Tensor:
        """Indices of one batch, grouped by class."""
        if self.replacement:
            # One multinomial call for all classes.
            return torch.multinomial(self.probs, self.n, replacement=True,
                                     generator=generator).flatten()
        return torch.cat([torch.multinomial(row, k, replacement=False, generator=generator)
                          for row, k in zip(self.probs, self.take, strict=True)])

    def __call__(self, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        idx = self.indices(generator)
        if self.multiset:
            idx, counts = collapse(idx)
            idx = to_device(idx, self.x.device)
            return self.x[idx], self.y[idx], to_device(counts, self.x.device)
        idx = to_device(idx, self.x.device)
        return self.x[idx], self.y[idx]

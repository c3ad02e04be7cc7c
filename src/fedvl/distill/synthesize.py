"""The synthesis loop and its matching objectives (DM, kernel MMD, FedDM, DC-style and target GM).

An objective is called once per step with the synthetic images (a leaf tensor) and returns the
loss and, optionally, the gradient to use (DP objectives return a privatised gradient); otherwise
the loop differentiates the loss w.r.t. the images only, so model parameters never collect `.grad`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.distill.augment import DSAConfig, siamese_dsa
from fedvl.distill.losses import (
    GRAD_METRICS,
    KERNELS,
    gradient_distance,
    mean_embedding_loss,
    mmd_loss,
)
from fedvl.distill.multiset import BatchStats, fixed_batch_stats, weighted_batch_stats
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models.base import FedModel, has_batch_stats
from fedvl.progress import emit
from fedvl.timing import timed

# A real sampler returns (x, y), or (x, y, counts) for a multiset batch: distinct images, each
# standing for counts[i] copies (`fedvl.distill.multiset`).
RealSampler = Callable[[torch.Generator], tuple[torch.Tensor, ...]]
ExtractorSampler = Callable[[torch.Generator], FedModel]
MATCHINGS = ("dm", "kernel", "embed_logit")


class Objective(Protocol):
    """One synthesis step's loss (and optionally the gradient to apply instead of its autograd)."""

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


# The statistics BatchNorm normalises the synthetic batch with under FedVCK's latent
# constraint: `batch`, the current real batch's (the paper's Eq. 4), or `running`, the running
# statistics the real batch has just updated (the public code's train/eval switch).
LATENT_STATS = ("batch", "running")


def embed_real_and_syn(
    model: FedModel, x_real: torch.Tensor, x_syn: torch.Tensor, logits: bool = False,
    latent_constraint: bool = False, chunk: int | None = None,
    real_counts: torch.Tensor | None = None, latent_stats: str = "batch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Embeddings (and logits) of real (no grad) and synthetic (with grad) batches.

    Two forwards rather than one on the concatenation: the real pass needs no graph, and BN layers
    in train mode must not mix real and synthetic batch statistics. With `latent_constraint`
    (FedVCK) real data runs in train mode (updating BN running statistics) and synthetic data is
    normalised by the real batch's statistics (`latent_stats="batch"`, the paper) or, in eval
    mode, by the running statistics just pulled towards them (`"running"`, the public code).
    Layers without batch statistics (instance/group/layer norm, none) behave identically in
    both modes, so for them the constraint does nothing.
    With `real_counts` the real batch is a multiset: BN layers in train mode normalise it as
    the batch with each row repeated that often.
    """
    if latent_stats not in LATENT_STATS:
        raise ValueError(f"unknown latent_stats '{latent_stats}'; allowed: "
                         f"{', '.join(LATENT_STATS)}")
    was = model.training
    if latent_constraint:
        model.train()
    bn = has_batch_stats(model) and model.training
    # The real batch's statistics, recorded as its forward computes them (the paper's Eq. 4).
    stats: BatchStats | None = {} if (bn and latent_constraint and latent_stats == "batch") \
        else None
    if bn and (real_counts is not None or stats is not None):
        with weighted_batch_stats(model, real_counts, stats):
            zr, lr = _embed_chunks(model, x_real, logits, chunk, grad=False)
    else:
        zr, lr = _embed_chunks(model, x_real, logits, chunk, grad=False)
    if latent_constraint:
        model.eval()
    with fixed_batch_stats(model, stats or {}):
        zs, ls = _embed_chunks(model, x_syn, logits, chunk, grad=True)
    model.train(was)
    return zr, zs, lr, ls


# On CPU a batch of a few dozen images keeps a 32-wide ConvNet's activations in cache: the
# batched DM step went from 0.61x to 0.82x the per-class loop's speed with 32-image chunks of
# real images instead of 128 (benchmarks/distill_speed.py, distill-speed.json). Accelerators
# want the whole batch at once.
CPU_CHUNK = 32


def _embed_chunks(model: FedModel, x: torch.Tensor, logits: bool, chunk: int | None,
                  grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    # Chunking is exact unless BN normalises with the batch's own statistics.
    if chunk is None:
        chunk = CPU_CHUNK if x.device.type == "cpu" else len(x)
    step = len(x) if (has_batch_stats(model) and model.training) else max(chunk, 1)
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        parts = [model.features_and_logits(x[i : i + step]) if logits
                 else (model.embed(x[i : i + step]), None)
                 for i in range(0, len(x), step)] or [(model.embed(x), None)]
    z = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
    if not logits:
        return z, None
    lg = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])  # type: ignore[misc]
    return z, lg


@dataclass
class DistributionMatching:
    """DM / kernel-MMD / FedDM embedding+logit matching on sampled models and real batches."""

    real: RealSampler
    extractor: ExtractorSampler
    num_classes: int
    matching: str = "dm"
    kernel: str = "linear"
    logit_weight: float = 1.0
    dsa: DSAConfig | None = field(default_factory=DSAConfig)
    latent_constraint: bool = False
    latent_stats: str = "batch"

    def __post_init__(self) -> None:
        if self.latent_stats not in LATENT_STATS:
            raise ValueError(f"unknown latent_stats '{self.latent_stats}'; allowed: "
                             f"{', '.join(LATENT_STATS)}")
        if self.matching not in MATCHINGS:
            raise ValueError(f"unknown matching '{self.matching}'; allowed: {', '.join(MATCHINGS)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown kernel '{self.kernel}'; allowed: {', '.join(KERNELS)}")

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
                 ) -> tuple[torch.Tensor, None]:
        model = self.extractor(generator)
        xr, yr, *rest = self.real(generator)
        counts = rest[0] if rest else None
        xs = images
        if self.dsa is not None:
            # One siamese draw per class, applied to real and synthetic images of that class
            # (so copies in a multiset batch stay copies).
            xr, xs = siamese_dsa(xr, xs, generator, self.dsa, yr, labels, self.num_classes)
        want_logits = self.matching == "embed_logit"
        zr, zs, lr, ls = embed_real_and_syn(model, xr, xs, want_logits, self.latent_constraint,
                                            real_counts=counts, latent_stats=self.latent_stats)
        k = self.num_classes
        if self.matching == "dm":
            loss = mean_embedding_loss(zr, yr, zs, labels, k, real_counts=counts)
        elif self.matching == "kernel":
            loss = mmd_loss(zr, yr, zs, labels, k, kernel=self.kernel, real_counts=counts)
        else:
            assert lr is not None and ls is not None
            loss = (mean_embedding_loss(zr, yr, zs, labels, k, real_counts=counts)
                    + self.logit_weight * mean_embedding_loss(lr, yr, ls, labels, k,
                                                              real_counts=counts))
        return loss, None


@dataclass
class GradientMatching:
    """DC-style matching of per-class CE gradients (real vs synthetic) on a sampled network.

    One match per step on a fresh network; DC's inner loop that trains the network on the
    synthetic set between outer steps is not included. Each class gets its own forward passes,
    as in DC's reference: a class's gradient then back-propagates through its own images only,
    where a forward shared by all classes made each of the K backward passes run over the
    whole batch (K times the backward FLOPs). With per-sample normalisation the two agree up
    to float rounding; BatchNorm normalises each class's batch with its own statistics (DC).
    """

    real: RealSampler
    extractor: ExtractorSampler
    num_classes: int
    metric: str = "ours"
    dsa: DSAConfig | None = field(default_factory=DSAConfig)

    def __post_init__(self) -> None:
        if self.metric not in GRAD_METRICS:
            raise ValueError(f"unknown metric '{self.metric}'; allowed: {', '.join(GRAD_METRICS)}")

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
                 ) -> tuple[torch.Tensor, None]:
        model = self.extractor(generator)
        params = [p for p in model.parameters() if p.requires_grad]
        xr, yr, *rest = self.real(generator)
        if rest:
            raise ValueError("gradient matching takes plain real batches, not multisets "
                             "(a sampler with multiset=True)")
        xs = images
        if self.dsa is not None:
            xr, xs = siamese_dsa(xr, xs, generator, self.dsa, yr, labels, self.num_classes)
        loss = images.new_zeros(())
        for c in range(self.num_classes):
            mr, ms = yr == c, labels == c
            if not bool(mr.any()) or not bool(ms.any()):
                continue
            gr = torch.autograd.grad(F.cross_entropy(model(xr[mr]), yr[mr]), params)
            gs = class_gradient(model, xs[ms], labels[ms], params)
            loss = loss + gradient_distance(gs, [g.detach() for g in gr], self.metric)
        return loss, None


def class_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """d mean CE(model(x), y) / d params, differentiable w.r.t. x (a double backward follows)."""
    return torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)


@dataclass
class TargetGradientMatching:
    """FedLGD server step: match CE gradients of the whole synthetic set on `model` to targets.

    `targets` maps parameter names to target gradients (e.g. (w_old - w_new) / lr); parameters
    without a target are ignored. No augmentation, all classes in one batch, as in FedLGD.
    """

    model: FedModel
    targets: Mapping[str, torch.Tensor]
    metric: str = "ours"

    def __post_init__(self) -> None:
        names = dict(self.model.named_parameters())
        bad = sorted(set(self.targets) - set(names))
        if bad:
            raise ValueError(f"target gradients for unknown parameters {bad}")
        if self.metric not in GRAD_METRICS:
            raise ValueError(f"unknown metric '{self.metric}'; allowed: {', '.join(GRAD_METRICS)}")
        self.names = [n for n in names if n in self.targets]
        self.params = [names[n] for n in self.names]

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
                 ) -> tuple[torch.Tensor, None]:
        ce = F.cross_entropy(self.model(images), labels)
        gs = torch.autograd.grad(ce, self.params, create_graph=True)
        return gradient_distance(gs, [self.targets[n].detach() for n in self.names],
                                 self.metric), None


@dataclass
class SynthesisResult:
    """The optimised set and what the run did."""

    syn: SyntheticSet
    loss_curve: list[float]
    steps: int
    seconds: float
    epsilon: float | None = None
    delta: float | None = None
    info: dict[str, object] = field(default_factory=dict)


def synthesize(
    syn: SyntheticSet,
    objective: Objective,
    steps: int,
    generator: torch.Generator,
    lr_img: float = 1.0,
    momentum: float = 0.5,
    clip_norm: float | None = None,
    weight_decay: float = 0.0,
    callback: Callable[[int, float], None] | None = None,
) -> SynthesisResult:
    """Optimise `syn.images` in place with SGD(lr_img, momentum) for `steps` objective steps."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    opt = torch.optim.SGD([syn.images], lr=lr_img, momentum=momentum, weight_decay=weight_decay)
    curve: list[float] = []
    start = time.perf_counter()
    with timed("synthesis"):   # where a round's time goes (`fedvl.timing`)
        for step in range(steps):
            loss, grad = objective(syn.images, syn.labels, generator)
            if grad is None:
                (grad,) = torch.autograd.grad(loss, syn.images)
            if clip_norm is not None:
                # FedVCK clips the image gradient's global norm before every step.
                norm = grad.norm()
                grad = grad * min(1.0, clip_norm / (float(norm) + 1e-12))
            syn.images.grad = grad.detach()
            opt.step()
            syn.images.grad = None
            curve.append(float(loss.detach()))
            if callback is not None:
                callback(step, curve[-1])
            # Step counts for a progress display, if one listens (the phase is the caller's scope).
            emit(step=step + 1, total=steps)
    seconds = time.perf_counter() - start
    eps = delta = None
    privacy = getattr(objective, "privacy_spent", None)
    if callable(privacy):
        eps, delta = privacy(steps)
    return SynthesisResult(syn, curve, steps, seconds, eps, delta)

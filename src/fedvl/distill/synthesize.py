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
from fedvl.distill.class_gradients import per_class_gradients, vmap_exact
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
        return self.match(model, xr, yr, xs, labels, counts), None

    def match(self, model: FedModel, xr: torch.Tensor, yr: torch.Tensor, xs: torch.Tensor,
              labels: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """The matching loss of (augmented) real and synthetic batches under `model`."""
        want_logits = self.matching == "embed_logit"
        zr, zs, lr, ls = embed_real_and_syn(model, xr, xs, want_logits, self.latent_constraint,
                                            real_counts=counts, latent_stats=self.latent_stats)
        k = self.num_classes
        if self.matching == "dm":
            return mean_embedding_loss(zr, yr, zs, labels, k, real_counts=counts)
        if self.matching == "kernel":
            return mmd_loss(zr, yr, zs, labels, k, kernel=self.kernel, real_counts=counts)
        assert lr is not None and ls is not None
        return (mean_embedding_loss(zr, yr, zs, labels, k, real_counts=counts)
                + self.logit_weight * mean_embedding_loss(lr, yr, ls, labels, k,
                                                          real_counts=counts))


@dataclass
class GradientMatching:
    """DC-style matching of per-class CE gradients (real vs synthetic) on a sampled network.

    One match per step on a fresh network; DC's inner loop that trains the network on the
    synthetic set between outer steps is not included. Each class's gradient back-propagates
    through its own images only, as in DC's reference (one forward per class). All classes run
    at once: each class's images are laid into its own row of a [classes, slots] grid (padded,
    the padding weighted 0) and the per-class gradients of all rows come at once
    (`fedvl.distill.class_gradients`), so a step's op count does not grow with the number of
    classes and nothing waits on the host. A network with BatchNorm in
    train mode normalises each class's batch with its own statistics (DC), which padded rows
    would disturb, and `vmap` differentiates LayerNorm twice wrongly (`vmap_exact`): both keep
    the loop.
    """

    real: RealSampler
    extractor: ExtractorSampler
    num_classes: int
    metric: str = "ours"
    dsa: DSAConfig | None = field(default_factory=DSAConfig)
    # All classes in one vmap (True) or one class at a time (False); None: the vmap on an
    # accelerator, the loop on the CPU, where it measured faster (0.60 against 0.80 s a step,
    # 10 classes, width 32, one thread) and its host reads cost nothing.
    batched: bool | None = None

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
        batched = images.device.type != "cpu" if self.batched is None else self.batched
        if batched and not (has_batch_stats(model) and model.training) and vmap_exact(model):
            k = self.num_classes
            real_slots = getattr(self.real, "max_per_class", None)   # a sampler's bound
            # DC's layer-wise distance is 0 for 1-D parameters: "ours" needs no bias gradients.
            names = [n for n, p in model.named_parameters() if p.requires_grad
                     and (self.metric != "ours" or p.dim() > 1)]
            gr, cr = per_class_gradients(model, xr, yr, k, real_slots, names=names)
            gs, cs = per_class_gradients(model, xs, labels, k, self._syn_slots(labels),
                                         create_graph=True, names=names)
            dist = gradient_distance([gs[n] for n in names], [gr[n].detach() for n in names],
                                     self.metric, batched=True)
            return (dist * ((cr > 0) & (cs > 0)).to(dist.dtype)).sum(), None
        loss = images.new_zeros(())
        for c in range(self.num_classes):
            mr, ms = yr == c, labels == c
            if not bool(mr.any()) or not bool(ms.any()):
                continue
            gr = torch.autograd.grad(F.cross_entropy(model(xr[mr]), yr[mr]), params)
            gs = class_gradient(model, xs[ms], labels[ms], params)
            loss = loss + gradient_distance(gs, [g.detach() for g in gr], self.metric)
        return loss, None


    def _syn_slots(self, labels: torch.Tensor) -> int:
        # The synthetic labels never change during synthesis: their largest class is read
        # from the device once per set, not once per step.
        cached = self.__dict__.get("_syn")
        if cached is None or cached[0] is not labels:
            most = int(torch.bincount(labels, minlength=self.num_classes).max()) if len(labels) \
                else 0
            self.__dict__["_syn"] = cached = (labels, most)
        return cached[1]


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
    graph: bool = False,
) -> SynthesisResult:
    """Optimise `syn.images` in place with SGD(lr_img, momentum) for `steps` objective steps.

    With `graph` the step's device work is captured once and replayed (`fedvl.distill.graphed`:
    on a GPU; on the CPU the same split runs eagerly, with the same numbers); objectives it
    cannot capture are refused with the reason.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if graph:
        return _synthesize_captured(syn, objective, steps, generator, lr_img, momentum,
                                    clip_norm, weight_decay, callback)
    opt = torch.optim.SGD([syn.images], lr=lr_img, momentum=momentum, weight_decay=weight_decay)
    # The losses stay on the device until the loop ends: reading one back every step would make
    # the host wait for the device (a sync per step). A callback asks for the float, so it syncs.
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    with timed("synthesis"):   # where a round's time goes (`fedvl.timing`)
        for step in range(steps):
            loss, grad = objective(syn.images, syn.labels, generator)
            if grad is None:
                (grad,) = torch.autograd.grad(loss, syn.images)
            if clip_norm is not None:
                # FedVCK clips the image gradient's global norm before every step; the factor
                # min(1, c / (||g|| + 1e-12)) is computed in float64 on the device, as the host
                # computed it.
                scale = (clip_norm / (grad.norm().double() + 1e-12)).clamp(max=1.0)
                grad = grad * scale.to(grad.dtype)
            syn.images.grad = grad.detach()
            opt.step()
            syn.images.grad = None
            losses.append(loss.detach())
            if callback is not None:
                callback(step, float(losses[-1]))
            # Step counts for a progress display, if one listens (the phase is the caller's scope).
            emit(step=step + 1, total=steps)
    curve = torch.stack(losses).tolist() if losses else []
    seconds = time.perf_counter() - start
    eps = delta = None
    privacy = getattr(objective, "privacy_spent", None)
    if callable(privacy):
        eps, delta = privacy(steps)
    return SynthesisResult(syn, curve, steps, seconds, eps, delta)


def _synthesize_captured(syn: SyntheticSet, objective: Objective, steps: int,
                         generator: torch.Generator, lr_img: float, momentum: float,
                         clip_norm: float | None, weight_decay: float,
                         callback: Callable[[int, float], None] | None) -> SynthesisResult:
    """`synthesize` with captured steps; the graphs live on the objective for its next calls."""
    from fedvl.distill.graphed import CapturedStep, not_graphable

    why = not_graphable(objective, clip_norm)
    if why is not None:
        raise ValueError(f"cannot capture this synthesis step: {why}")
    cache = objective.__dict__.setdefault("_captured", {})
    key = (lr_img, momentum, weight_decay)
    stepper = cache.get(key)
    if stepper is None or stepper.syn is not syn:
        stepper = cache[key] = CapturedStep(objective, syn, lr_img, momentum,  # type: ignore[arg-type]
                                            weight_decay)
    stepper.restart()   # a fresh optimiser per call, as the eager loop makes one
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    with timed("synthesis"):
        for step in range(steps):
            losses.append(stepper.step(generator).clone())
            if callback is not None:
                callback(step, float(losses[-1]))
            emit(step=step + 1, total=steps)
    curve = torch.stack(losses).tolist() if losses else []
    return SynthesisResult(syn, curve, steps, time.perf_counter() - start)


"""A distribution-matching step whose device work is captured once and replayed (CUDA graphs).

The small networks of dataset distillation make a synthesis step a few hundred short kernels;
on a GPU each costs its launch more than its arithmetic (`fedvl perf --distill`). A step's
device work is the same every step but for its inputs: the real batch's indices, the drawn
augmentation, the network's weights. So the host draws those as the eager step does (the same
generator, the same order: network, real indices, augmentation), copies them into fixed input
tensors, and replays one captured graph of the rest: real gather, augmentation, both forwards,
the matching loss, its image gradient and the SGD update. One graph per augmentation transform
(DSA draws one of six per step in mode 'S').

`CapturedStep(capture=False)` runs the same split eagerly: on the CPU it gives the eager loop's
numbers bit for bit (`tests/test_distill_synthesis.py`), which is what the captured graph
replays on a GPU.

Which objectives: `DistributionMatching` with real batches of a fixed size (`UniformClassSampler`)
and without FedVCK's latent constraint (its BatchNorm statistics pass through Python hooks) and
without a gradient clip: DM, FedLGD's local refresh, DESA's anchors, FedDM's matching.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fedvl.devices import copy_into, to_device
from fedvl.distill.augment import DSAParams, apply_dsa, sample_dsa_params
from fedvl.distill.samplers import UniformClassSampler
from fedvl.distill.synthesize import DistributionMatching
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models.base import FedModel

# Eager runs on a side stream before a capture, so lazy initialisations (cuBLAS handles, the
# autograd engine's) happen outside it, as torch's CUDA-graph notes ask.
WARMUP_RUNS = 2


def not_graphable(objective: object, clip_norm: float | None = None) -> str | None:
    """Why `objective` cannot run as a captured step, or None when it can."""
    if not isinstance(objective, DistributionMatching):
        return "only distribution matching (DM, FedLGD's refresh, DESA, FedDM) is captured"
    if not isinstance(objective.real, UniformClassSampler):
        return "real batches must have a fixed size (a uniform class sampler)"
    if objective.latent_constraint:
        return "FedVCK's latent constraint normalises through Python hooks"
    if clip_norm is not None:
        return "a gradient clip is not captured"
    return None


class CapturedStep:
    """One synthesis step of SGD(lr, momentum, weight_decay) on `syn.images`, replayed.

    Call `restart()` where a fresh optimiser would start (its momentum buffer empty), then
    `step(generator)` once per step; it returns the step's loss (a tensor the next step
    overwrites: copy it to keep it).
    """

    def __init__(self, objective: DistributionMatching, syn: SyntheticSet, lr: float,
                 momentum: float, weight_decay: float = 0.0, capture: bool | None = None
                 ) -> None:
        why = not_graphable(objective)
        if why is not None:
            raise ValueError(f"cannot capture this synthesis step: {why}")
        self.obj, self.syn = objective, syn
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.device = syn.images.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.buf = torch.zeros_like(syn.images)
        # 0 before the first step of a run of steps: SGD's buffer then starts as the gradient.
        self.started = torch.zeros((), dtype=syn.images.dtype, device=self.device)
        self.model: FedModel | None = None
        self.idx: torch.Tensor | None = None
        self.values: dict[str, torch.Tensor] = {}
        self.graphs: dict[tuple[str, ...], torch.cuda.CUDAGraph] = {}
        self.losses: dict[tuple[str, ...], torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def restart(self) -> None:
        """Start a new run of steps: the momentum buffer empties, as a fresh optimiser's."""
        self.started.zero_()

    # -- the host's part: draws, copied into the graph's inputs --------------------------------
    def _load(self, generator: torch.Generator) -> tuple[str, ...]:
        obj = self.obj
        model = obj.extractor(generator)
        idx = obj.real.indices(generator)   # type: ignore[attr-defined]
        drawn = (sample_dsa_params(obj.num_classes, generator, obj.dsa,
                                   obj.real.x.shape[-1])   # type: ignore[attr-defined]
                 if obj.dsa is not None else None)
        if self.model is None:
            self.model = model
        elif model is not self.model:
            # A fresh network each step (DM): its weights into the network the graph reads.
            with torch.no_grad():
                for mine, new in zip(self._tensors(self.model), self._tensors(model),
                                     strict=True):
                    mine.copy_(new, non_blocking=True)
            self.model.train(model.training)
        self.idx = self._into(self.idx, idx)
        if drawn is None:
            return ()
        for name, v in drawn.values.items():
            self.values[name] = self._into(self.values.get(name), v)
        return tuple(drawn.groups)

    @staticmethod
    def _tensors(model: FedModel) -> Iterator[torch.Tensor]:
        yield from model.parameters()
        yield from model.buffers()

    def _into(self, static: torch.Tensor | None, host: torch.Tensor) -> torch.Tensor:
        """`host` copied into the fixed input `static` (made on first use, or on a new shape,
        which forgets the graphs that read the old one)."""
        if static is None or static.shape != host.shape or static.dtype != host.dtype:
            self.graphs.clear()
            self.losses.clear()
            return to_device(host, self.device).clone()
        copy_into(static, host)
        return static

    # -- the device's part: the captured computation -------------------------------------------
    def _compute(self, groups: tuple[str, ...]) -> torch.Tensor:
        obj, images, labels = self.obj, self.syn.images, self.syn.labels
        assert self.model is not None and self.idx is not None
        xr = obj.real.x[self.idx]          # type: ignore[attr-defined]
        yr = obj.real.y[self.idx]          # type: ignore[attr-defined]
        xs = images
        if groups:
            params = DSAParams(list(groups), obj.num_classes, self.values)
            with torch.no_grad():
                xr = apply_dsa(xr, params, yr)
            xs = apply_dsa(xs, params, labels)
        loss = obj.match(self.model, xr, yr, xs, labels)
        (grad,) = torch.autograd.grad(loss, images)
        # torch.optim.SGD's step (dampening 0, no Nesterov): the buffer is the gradient at the
        # first step (buf * 0 + g) and momentum * buf + g after it.
        with torch.no_grad():
            if self.weight_decay:
                grad = grad.add(images, alpha=self.weight_decay)
            self.buf.mul_(self.started * self.momentum).add_(grad)
            images.add_(self.buf, alpha=-self.lr)
            self.started.fill_(1.0)
        return loss.detach()

    def _mutable(self) -> list[torch.Tensor]:
        assert self.model is not None
        return [self.syn.images.data, self.buf, self.started, *self.model.buffers()]

    def _capture(self, groups: tuple[str, ...]) -> torch.cuda.CUDAGraph:
        # Warm-up runs change the images and buffers: they are put back before the capture.
        saved = [t.clone() for t in self._mutable()]
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._compute(groups)
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.no_grad():
            for t, v in zip(self._mutable(), saved, strict=True):
                t.copy_(v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.losses[groups] = self._compute(groups)
        self.graphs[groups] = graph
        return graph

    def step(self, generator: torch.Generator) -> torch.Tensor:
        """One step: the host's draws into the graph's inputs, then the graph (or, without
        capture, the same computation run eagerly); the step's loss."""
        groups = self._load(generator)
        if not self.capture:
            return self._compute(groups)
        graph = self.graphs.get(groups) or self._capture(groups)
        graph.replay()
        return self.losses[groups]

"""Several clients' distribution-matching synthesis in lockstep: one `vmap` over clients a step.

A round's clients each distil their own synthetic set (FedDM). Alone, a client's step is a few
hundred small kernels; here every step runs all clients' device work at once. Per step each
client first makes exactly the host draws `synthesize` would make for it, from its own generator
in the same order (its extractor's draw, then its real batch's indices); then one `vmap` of
`functional_call` over the clients' stacked extractor weights embeds the stacked real batches
and synthetic sets, the per-class means and the matching loss are batched matrix products, and
one autograd call gives every client's image gradient (the clients are independent, so the
gradient of the summed losses is each one's own). The update is `synthesize`'s SGD (momentum
buffer started from the first gradient, weight decay added to the gradient), per client.

Clients differ in size: real batches and synthetic sets are padded to the largest with a zero
image labelled -1, which no class's one-hot row selects, so padding adds exact zeros to the
class sums and never moves. The results equal `synthesize` per client to float rounding (the
sums are regrouped; `tests/test_stacked_synthesis.py` states the tolerance). Nothing in a step
reads the device back: the losses are read once, at the end. On the CPU the forwards take
`CPU_CHUNK` images per client at a time (activations that fit the cache), elsewhere all at once.

Which objectives: `DistributionMatching` with matching `dm` or `embed_logit`, no DSA, no latent
constraint, real batches of a fixed size (`UniformClassSampler`), on extractors without
BatchNorm (their statistics would need per-client in-place updates) of one architecture.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn
from torch.func import functional_call, vmap

from fedvl.core.stacked import stackable
from fedvl.devices import to_device
from fedvl.distill.samplers import RhoBallSampler, UniformClassSampler
from fedvl.distill.synthesize import (
    CPU_CHUNK,
    DistributionMatching,
    Objective,
    SynthesisResult,
)
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models.base import FedModel
from fedvl.progress import emit
from fedvl.timing import timed

STACKED_MATCHINGS = ("dm", "embed_logit")
ALLOWED = ("DistributionMatching with matching 'dm' or 'embed_logit', dsa=None, no latent "
           "constraint, a UniformClassSampler, an extractor without BatchNorm")


def not_stackable(objective: object) -> str | None:
    """Why `objective` cannot run in `stacked_synthesize`, or None when it can."""
    if type(objective) is not DistributionMatching:
        return f"{type(objective).__name__} is not plain distribution matching"
    if objective.matching not in STACKED_MATCHINGS:
        return f"matching '{objective.matching}'"
    if objective.dsa is not None:
        return "DSA augmentation (drawn per client and class)"
    if objective.latent_constraint:
        return "FedVCK's latent constraint"
    if not isinstance(objective.real, UniformClassSampler):
        return "real batches of varying size (not a UniformClassSampler)"
    return None


class _Features(nn.Module):
    """A model's embedding (and logits) as a forward, so `functional_call` can run it."""

    def __init__(self, model: FedModel, logits: bool) -> None:
        super().__init__()
        self.model, self.logits = model, logits

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.model.features_and_logits(x) if self.logits else (self.model.embed(x),)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _refused(why: str) -> ValueError:
    return ValueError(f"cannot stack this synthesis: {why}; allowed: {ALLOWED}")


def _stack(models: Sequence[FedModel]) -> dict[str, torch.Tensor]:
    """The models' weights stacked, {name: [K, ...]}: models without BatchNorm, all alike."""
    weights = [_weights(m) for m in models]
    shapes = [{n: t.shape for n, t in w.items()} for w in weights]
    if not all(stackable(m) for m in models):
        raise _refused("an extractor with BatchNorm")
    if any(s != shapes[0] for s in shapes):
        raise _refused("extractors of different architectures")
    return {n: torch.stack([w[n].detach() for w in weights]) for n in weights[0]}


def _onehot(y: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    # A comparison, not F.one_hot (which checks the range on the host); label -1 (padding)
    # selects no class.
    return (y.unsqueeze(-1) == torch.arange(num_classes, device=y.device)).to(dtype)


def _mean_embedding_loss(zr: torch.Tensor, wr: torch.Tensor, zs: torch.Tensor,
                         ws: torch.Tensor) -> torch.Tensor:
    """`losses.mean_embedding_loss` per client: z [K, N, D], one-hot class weights w [K, N, C]."""
    cr, cs = wr.sum(1), ws.sum(1)
    mr = wr.transpose(1, 2) @ zr / cr.clamp_min(1).unsqueeze(-1)
    ms = ws.transpose(1, 2) @ zs / cs.clamp_min(1).unsqueeze(-1)
    both = ((cr > 0) & (cs > 0)).to(zs.dtype)
    return (((mr - ms) ** 2).sum(-1) * both).sum(-1)


def _chunked(features: Callable[..., tuple[torch.Tensor, ...]],
             weights: dict[str, torch.Tensor], x: torch.Tensor, chunk: int
             ) -> tuple[torch.Tensor, ...]:
    """`features` of x [K, N, ...], `chunk` images per client at a time."""
    parts = [features(weights, x[:, i : i + chunk]) for i in range(0, x.shape[1], chunk)]
    return parts[0] if len(parts) == 1 else tuple(torch.cat(p, 1) for p in zip(*parts))


def _padded(tensors: Sequence[torch.Tensor], pad: torch.Tensor) -> torch.Tensor:
    """Every client's rows, concatenated, then one `pad` row (what padded slots point to)."""
    return torch.cat([*tensors, pad.unsqueeze(0)])


class _Extractors:
    """Each step's extractors of K clients as stacked weights {name: [K, ...]}.

    Rho-ball samplers (FedDM) draw their perturbations on the host; the stacked base weights are
    made once and one copy per step carries all clients' draws: base + delta, the sum the
    sampler computes in place. Any other sampler is called and its model's weights stacked.
    """

    def __init__(self, objectives: Sequence[DistributionMatching]) -> None:
        self.samplers = [o.extractor for o in objectives]
        self.rho = all(isinstance(s, RhoBallSampler) for s in self.samplers)
        self.template: FedModel | None = None
        if self.rho:
            balls: list[RhoBallSampler] = self.samplers   # type: ignore[assignment]
            self.base = _stack([s.base for s in balls])
            self.params = [n for n, _ in balls[0].base.named_parameters()]
            self.template = balls[0].work
            self.template.train(balls[0].train_mode)

    def draw(self, generators: Sequence[torch.Generator]) -> dict[str, torch.Tensor]:
        """The stacked weights of this step's extractors, each drawn from its generator."""
        pairs = zip(self.samplers, generators, strict=True)
        if not self.rho:
            models = [s(g) for s, g in pairs]
            self.template = models[0]
            return _stack(models)
        # All clients' perturbations in one host tensor, one copy to the device.
        flat = torch.stack([torch.cat([d.flatten() for d in s.draw(g)])   # type: ignore[attr-defined]
                            for s, g in pairs])
        base = self.base
        parts = to_device(flat, base[self.params[0]].device).split(
            [base[n][0].numel() for n in self.params], dim=1)
        out = dict(base)
        for n, d in zip(self.params, parts, strict=True):
            out[n] = base[n] + d.view(base[n].shape).to(base[n].dtype)
        return out


def stacked_synthesize(
    syns: Sequence[SyntheticSet],
    objectives: Sequence[Objective],
    steps: int,
    generators: Sequence[torch.Generator],
    lr_img: float = 1.0,
    momentum: float = 0.5,
    weight_decay: float = 0.0,
    chunk: int | None = None,
) -> list[SynthesisResult]:
    """`synthesize(syns[k], objectives[k], steps, generators[k], ...)` of every client k, run in
    lockstep as one vectorised computation; each set's images are updated in place. `chunk`:
    images per client in one forward (None: `CPU_CHUNK` on the CPU, all on other devices)."""
    k = len(syns)
    if not (k == len(objectives) == len(generators)):
        raise ValueError(f"stacked synthesis needs as many sets, objectives and generators "
                         f"(got {len(syns)}, {len(objectives)}, {len(generators)})")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    for o in objectives:
        why = not_stackable(o)
        if why is not None:
            raise _refused(why)
    dms = cast(list[DistributionMatching], list(objectives))
    if len({m.matching for m in dms}) > 1 or len({s.num_classes for s in syns}) > 1:
        raise ValueError("stacked synthesis needs one matching and one class count for all")
    # Shared generators would interleave the clients' draws differently from one at a time.
    if len({id(g) for g in generators}) < k:
        raise ValueError("stacked synthesis needs a generator of its own for every client")
    if k == 0:
        return []
    reals: list[UniformClassSampler] = [o.real for o in dms]   # type: ignore[misc]
    images = syns[0].images
    device, dtype, classes = images.device, images.dtype, syns[0].num_classes
    logits = dms[0].matching == "embed_logit"
    extractors = _Extractors(dms)

    # Every client's real images in one tensor (made once): a step gathers all batches at once.
    xr_all = _padded([r.x for r in reals], torch.zeros_like(reals[0].x[0]))
    yr_all = _padded([r.y for r in reals], torch.full((), -1, dtype=torch.long, device=device))
    offsets = torch.tensor([0, *[len(r.y_cpu) for r in reals]], device="cpu").cumsum(0)
    pad_row = int(offsets[-1])
    # A uniform class batch has a fixed size: per class the smaller of `per_class` and its count.
    width = max(int(torch.bincount(r.y_cpu, minlength=classes).clamp(max=r.n).sum())
                for r in reals)
    # The synthetic sets, padded to the largest (zero images labelled -1, which never move).
    size = max(len(s.labels) for s in syns)
    xs = torch.zeros(k, size, *images.shape[1:], dtype=dtype, device=device)
    ys = torch.full((k, size), -1, dtype=torch.long, device=device)
    with torch.no_grad():
        for c, s in enumerate(syns):
            xs[c, : len(s.labels)] = s.images
            ys[c, : len(s.labels)] = s.labels
    xs.requires_grad_(True)
    ws = _onehot(ys, classes, dtype)
    lw = torch.tensor([o.logit_weight for o in dms], dtype=dtype, device=device)
    # As `embed_real_and_syn`: on the CPU a few dozen images per client at a time keep the
    # activations in cache (5 clients of 100 images, width 32: 0.98 against 2.25 s for 3 steps).
    chunk = chunk or (CPU_CHUNK if device.type == "cpu" else max(width, size))
    features = None
    buf: torch.Tensor | None = None
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    with timed("synthesis"):
        for step in range(steps):
            # The host's part: each client's draws from its own generator in `__call__`'s order
            # (extractor, then real indices); the clients' generators are independent.
            weights = extractors.draw(generators)
            idx = torch.full((k, width), pad_row, dtype=torch.long, device="cpu")
            for c, (r, g) in enumerate(zip(reals, generators, strict=True)):
                drawn = r.indices(g)
                idx[c, : len(drawn)] = drawn + offsets[c]
            if features is None:
                assert extractors.template is not None
                net = _Features(extractors.template, logits)
                features = vmap(lambda w, x, net=net: functional_call(
                    net, {f"model.{n}": t for n, t in w.items()}, (x,)))
            # The device's part, all clients at once.
            idx_d = to_device(idx, device)
            xr, wr = xr_all[idx_d], _onehot(yr_all[idx_d], classes, dtype)
            with torch.no_grad():
                real = _chunked(features, weights, xr, chunk)
            syn = _chunked(features, weights, xs, chunk)
            loss = _mean_embedding_loss(real[0], wr, syn[0], ws)
            if logits:
                loss = loss + lw * _mean_embedding_loss(real[1], wr, syn[1], ws)
            (grad,) = torch.autograd.grad(loss.sum(), xs)
            # torch.optim.SGD's step (dampening 0, no Nesterov), per client.
            with torch.no_grad():
                if weight_decay:
                    grad = grad.add(xs, alpha=weight_decay)
                if momentum:
                    buf = grad.clone() if buf is None else buf.mul_(momentum).add_(grad)
                    grad = buf
                xs.add_(grad, alpha=-lr_img)
            losses.append(loss.detach())
            emit(step=step + 1, total=steps)
    curves = torch.stack(losses).T.tolist() if losses else [[] for _ in syns]
    seconds = time.perf_counter() - start
    with torch.no_grad():
        for c, s in enumerate(syns):
            s.images.copy_(xs[c, : len(s.labels)])
    return [SynthesisResult(s, curve, steps, seconds, info={"stacked_clients": k})
            for s, curve in zip(syns, curves, strict=True)]

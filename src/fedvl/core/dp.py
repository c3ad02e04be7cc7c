"""Differential privacy below the methods: the accountant, per-sample clipping, DP-SGD.

Accounting: Opacus' RDP (or PRV) accountant for `steps` compositions of the sampled Gaussian
mechanism at sample rate q (add/remove adjacency); `compute_epsilon` gives the epsilon spent and
`noise_multiplier_for` inverts it. The default delta is 1/(10 N), below 1/N: a mechanism that
publishes each record with probability 1/N is (0, 1/N)-DP and still expects to leak one record
in the clear. Per-sample clipping bounds one record's influence only when the network does not
normalise with batch statistics (BatchNorm in train mode mixes every sample of a batch into
every output), so `check_dp_model` refuses such networks.

DP-SGD (Abadi et al. 2016) of a model's local training (`dp_sgd_train`): every step includes
each of the n records independently with probability q = min(1, batch/n), takes every included
record's cross-entropy gradient (Opacus' `GradSampleModule`), clips it to joint L2 norm <= C
over all parameters, sums, adds N(0, (sigma C)^2) per coordinate and divides by the expected
batch size q n (`privatise`). Terms that read no data (a proximal pull, weight decay,
control-variate corrections) are added after privatisation: they are post-processing.

A client's privacy over a run: every DP release reads the same private records, so epsilon
composes all of a client's DP steps so far. The client keeps its running total under `dp_steps`
in its persistent state (`add_dp_steps`) and reports epsilon, delta and that total in its
reply's meta (`privacy_meta`); the server keeps the latest values per client name
(`merge_privacy`) and puts them under `privacy` in summary.json (`privacy_report`). The
distillation mechanism on synthetic images (DP distribution matching) is
`fedvl.distill.dp_matching`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fedvl.core.message import Message
from fedvl.core.training import (
    LossTerm,
    TrainConfig,
    TrainStats,
    check_plain_sgd,
    check_round_config,
    num_batches,
)
from fedvl.models.base import has_batch_stats

ACCOUNTANTS = ("rdp", "prv")
# The privacy a client reports in its reply meta and the server keeps per client name: the
# running total `dp_steps` is left out by methods whose release is not a running composition.
PRIVACY_KEYS = ("epsilon", "delta", "dp_steps")
EPSILON_DELTA = PRIVACY_KEYS[:2]
_PRIVACY_TYPES: dict[str, Callable[[Any], float | int]] = {
    "epsilon": float, "delta": float, "dp_steps": int}


def default_delta(n: int) -> float:
    """The default DP delta for a dataset of `n` records: 1 / (10 n)."""
    return 1.0 / (10 * max(n, 1))


def delta_for(delta: float, n: int) -> float:
    """The DP delta of a `dp_delta` option: `delta` when positive, else `default_delta(n)`."""
    return delta if delta > 0 else default_delta(n)


def check_dp_model(model: torch.nn.Module) -> None:
    """Refuse a network whose per-sample gradients do not bound one sample's influence."""
    if has_batch_stats(model):
        raise ValueError("differential privacy cannot use a network with BatchNorm: batch "
                         "statistics mix every sample into every output, so per-sample clipping "
                         "does not bound one sample's influence; use norm 'instance', 'group', "
                         "'layer' or 'none'")


def compute_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                    accountant: str = "rdp") -> float:
    """Epsilon spent by `steps` sampled-Gaussian steps, from an Opacus accountant."""
    if accountant == "rdp":
        from opacus.accountants import RDPAccountant

        acc = RDPAccountant()
    elif accountant == "prv":
        from opacus.accountants import PRVAccountant

        acc = PRVAccountant()
    else:
        raise ValueError(f"unknown accountant '{accountant}'; allowed: {', '.join(ACCOUNTANTS)}")
    if steps == 0:
        return 0.0
    acc.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    return float(acc.get_epsilon(delta=delta))


def noise_multiplier_for(epsilon: float, delta: float, sample_rate: float, steps: int,
                         accountant: str = "rdp", tolerance: float = 0.01) -> float:
    """The smallest noise multiplier (to `tolerance` in epsilon) whose `steps` sampled-Gaussian
    steps at `sample_rate` spend at most `epsilon` at `delta` (Opacus' bisection)."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant '{accountant}'; allowed: {', '.join(ACCOUNTANTS)}")
    if not epsilon > 0 or not 0 < delta < 1 or not 0 < sample_rate <= 1 or steps < 1:
        raise ValueError(f"a noise multiplier needs epsilon > 0, delta in (0, 1), sample rate "
                         f"in (0, 1] and steps >= 1; got epsilon {epsilon}, delta {delta}, "
                         f"sample rate {sample_rate}, steps {steps}")
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta,
                                      sample_rate=sample_rate, steps=steps,
                                      accountant=accountant, epsilon_tolerance=tolerance))


def clip_rows(g: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale every row (sample) of g [N, ...] to L2 norm <= clip; returns (clipped, norms)."""
    # An explicit row size: a batch of zero rows (an empty Poisson draw) has norms of shape [0].
    norms = g.reshape(len(g), math.prod(g.shape[1:])).norm(dim=1)
    scale = (clip / (norms + 1e-12)).clamp(max=1.0)
    return g * scale.view(-1, *([1] * (g.dim() - 1))), norms


# -- a client's privacy over a run -------------------------------------------------------------
def add_dp_steps(state: Message, steps: int) -> int:
    """Add `steps` to the client's running total of DP steps (`dp_steps` in its state meta);
    returns the new total."""
    total = int(state.meta.get("dp_steps", 0)) + steps
    state.meta["dp_steps"] = total
    return total


def privacy_meta(state: Message, spent: Callable[[int], tuple[float, float]]
                 ) -> dict[str, float | int]:
    """The reply meta entries of a client's privacy: `spent(total)`'s (epsilon, delta) over the
    running total of DP steps in its state, and that total."""
    steps = int(state.meta.get("dp_steps", 0))
    epsilon, delta = spent(steps)
    return {"epsilon": epsilon, "delta": delta, "dp_steps": steps}


def merge_privacy(state: Mapping[str, Any], replies: Mapping[int, Message],
                  name: Callable[[int], str], keys: Sequence[str] = PRIVACY_KEYS
                  ) -> dict[str, dict[str, float | int]]:
    """The server's per-client-name dicts of `keys` (from `state`), updated with the values of
    every reply that reports an epsilon; `name` maps a client id to its name."""
    out = {k: dict(state.get(k, {})) for k in keys}
    for cid, r in replies.items():
        if "epsilon" in r.meta:
            for k in keys:
                out[k][name(cid)] = _PRIVACY_TYPES[k](r.meta[k])
    return out


def privacy_report(mechanism: str, noise_multiplier: float, clip: float,
                   state: Mapping[str, Any], keys: Sequence[str] = PRIVACY_KEYS
                   ) -> dict[str, Any]:
    """summary.json's `privacy` entry: the mechanism, its noise multiplier and clip, and the
    latest per-client values of `keys` kept in the server `state`."""
    return {"mechanism": mechanism, "noise_multiplier": noise_multiplier, "clip": clip,
            **{k: dict(state.get(k, {})) for k in keys}}


# -- DP-SGD of local training ------------------------------------------------------------------
def poisson_batch(n: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of the records one Poisson-sampled step includes (each with probability rate)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device)
    return (u < rate).nonzero().flatten()


def privatise(per_sample: Sequence[torch.Tensor], clip: float, noise_multiplier: float,
              expected_batch: float, generator: torch.Generator
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The DP-SGD gradient from per-sample gradients (one [B, *shape] tensor per parameter).

    Each sample's gradient, all parameters together, is clipped to L2 norm <= clip; the clipped
    gradients are summed, one N(0, (noise_multiplier * clip)^2) vector over all coordinates (in
    parameter order, drawn from `generator` on its device) is added, and the sum is divided by
    `expected_batch`. Returns the gradient per parameter and the per-sample norms before
    clipping.
    """
    b = per_sample[0].shape[0]
    sizes = [math.prod(g.shape[1:]) for g in per_sample]
    flat = torch.cat([g.reshape(b, size) for g, size in zip(per_sample, sizes, strict=True)],
                     dim=1)
    clipped, norms = clip_rows(flat, clip)
    noise = torch.randn(flat.shape[1], generator=generator, dtype=flat.dtype,
                        device=generator.device) * (noise_multiplier * clip)
    total = (clipped.sum(0) + noise.to(flat.device)) / expected_batch
    return [t.view(g.shape[1:]) for t, g in zip(total.split(sizes), per_sample, strict=True)
            ], norms


class PerSampleGradients:
    """Per-sample cross-entropy gradients of a model's trainable parameters (Opacus hooks).

    Opacus' `GradSampleModule` computes them from each layer's activations and backprops in one
    ordinary backward pass (exact for linear, convolution and per-sample normalisation layers;
    Opacus falls back to `torch.func` for others). Its full backward hooks cannot see through
    in-place activations, so those modules compute out of place while wrapped: the same
    numbers. `close` restores the model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from opacus import GradSampleModule

        check_dp_model(model)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._inplace = [m for m in model.modules() if getattr(m, "inplace", False) is True]
        for m in self._inplace:
            m.inplace = False  # type: ignore[assignment]
        # The inputs need no gradient, so torch notes that the first layer's hook sees only
        # output gradients, which is all Opacus reads: the note says nothing about the result.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients "
                                "are computed with respect to module outputs")
        self.wrapped = GradSampleModule(model, batch_first=True, loss_reduction="sum")

    def __call__(self, x: torch.Tensor, y: torch.Tensor
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(per-parameter [B, *shape] gradients of each sample's own loss, per-sample losses)."""
        for p in self.params:
            p.grad_sample = None  # type: ignore[attr-defined]
            p.grad = None
        if len(y) == 0:
            return [p.new_zeros((0, *p.shape)) for p in self.params], x.new_zeros(0)
        losses = F.cross_entropy(self.wrapped(x), y, reduction="none")
        losses.sum().backward()
        grads = [p.grad_sample.detach() for p in self.params]  # type: ignore[attr-defined]
        for p in self.params:
            p.grad_sample = None  # type: ignore[attr-defined]
            p.grad = None
        return grads, losses.detach()

    def close(self) -> None:
        """Remove the hooks and restore in-place activations."""
        self.wrapped._close()
        for m in self._inplace:
            m.inplace = True  # type: ignore[assignment]


def dp_sgd_train(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    generator: torch.Generator,
    noise_multiplier: float,
    clip: float,
    terms: Sequence[LossTerm] = (),
    after_step: Callable[[torch.nn.Module, float], None] | None = None,
) -> TrainStats:
    """Train `model` in place with DP-SGD on (x, y); returns the step counts.

    As many steps as `local_train` takes (`num_batches`), each on a Poisson sample at rate
    q = min(1, batch_size / n) with the gradient from `privatise` (expected batch q n). `terms`
    are data-independent objectives (they are called with zero data rows) whose gradient is
    added after privatisation; SGD's momentum and weight decay and `after_step` act on the
    privatised gradient only. Every draw (samples, then noise, per step) comes from `generator`.
    """
    check_round_config(cfg)
    check_plain_sgd(cfg, "DP-SGD")
    if clip <= 0 or noise_multiplier < 0:
        raise ValueError(f"DP-SGD needs clip > 0 and noise multiplier >= 0; got clip {clip}, "
                         f"noise multiplier {noise_multiplier}")
    check_dp_model(model)
    n = len(y)
    if n == 0:
        return TrainStats(0, 0, 0.0)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    rate = min(1.0, cfg.batch_size / n)
    per_sample = PerSampleGradients(model)
    steps = samples = 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)   # no read per step
    try:
        for _ in range(num_batches(n, cfg.batch_size, cfg.local_epochs, cfg.local_steps)):
            idx = poisson_batch(n, rate, generator).to(x.device)
            grads, losses = per_sample(x[idx], y[idx])
            private, _ = privatise(grads, clip, noise_multiplier, rate * n, generator)
            extra = _term_gradients(model, per_sample.params, terms, x, y)
            for p, g, e in zip(per_sample.params, private, extra, strict=True):
                p.grad = g if e is None else g + e
            opt.step()
            if after_step is not None:
                after_step(model, cfg.lr)
            steps += 1
            samples += len(idx)
            if len(losses):
                loss_sum += losses.detach().mean().double()
    finally:
        per_sample.close()
    return TrainStats(steps, samples, float(loss_sum) / max(steps, 1))


def _term_gradients(model: torch.nn.Module, params: list[torch.Tensor],
                    terms: Sequence[LossTerm], x: torch.Tensor, y: torch.Tensor
                    ) -> list[torch.Tensor | None]:
    """Gradients of the data-independent terms; each term sees zero rows of data."""
    if not terms:
        return [None] * len(params)
    none = x.new_zeros(0)
    loss = sum(term(model, x[:0], y[:0], none, none) for term in terms)  # type: ignore[arg-type]
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return [None] * len(params)
    return list(torch.autograd.grad(loss, params, allow_unused=True))

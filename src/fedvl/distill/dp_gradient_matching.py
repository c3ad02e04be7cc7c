"""Gradient matching against real-data gradients, optionally differentially private.

FedLAP-DP's client objective: on one model w, the synthetic set's cross-entropy gradient is
pulled towards the gradient of a real batch, all classes together (not class by class, as in
DC-style matching, `fedvl.distill.synthesize.GradientMatching`).

Real side (`RealGradients`): every real record joins the batch independently with probability
q = min(1, batch / n) (Poisson sampling). Without DP the target is the gradient of the batch's
mean cross-entropy. With DP each sampled record's gradient (all parameters together) is clipped
to L2 norm <= C, the clipped gradients are summed, N(0, sigma^2 C^2) is added to every
coordinate and the sum is divided by the expected batch q n (`fedvl.core.dp.privatise`, the
DP-SGD gradient); Opacus' RDP accountant composes one sampled Gaussian mechanism per target
(`privacy_spent`). Everything the synthetic images learn from the real records passes through
these targets, so the images are post-processing of them.

Distance (`layer_cosine_distance`): FedLAP-DP's layer-wise cosine distance. A parameter's
gradient is laid out as rows (output channels; a 1-D parameter is one row); every row is
divided by its L2 norm + 1e-8, and the parameter contributes the mean over its rows of
1 - <real row, synthetic row>. Unlike DC's distance (`fedvl.distill.losses.distance_wb`: a sum
over rows, 1-D parameters left out) every parameter counts, biases and norm scales included,
and each counts as much as any other. `match_loss` adds `mse_weight` times the squared L2
distance of the two whole gradients (FedLAP's non-private regulariser).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.core.dp import (
    ACCOUNTANTS,
    PerSampleGradients,
    compute_epsilon,
    default_delta,
    poisson_batch,
    privatise,
)
from fedvl.distill.losses import gradient_distance

# Added to every row's norm before it divides the row (FedLAP-DP `utils/ops.py` distance_wb).
ROW_EPS = 1e-8


def layer_cosine_distance(g_syn: Sequence[torch.Tensor], g_real: Sequence[torch.Tensor]
                          ) -> torch.Tensor:
    """Sum over parameters of the mean over rows of 1 - cos(real row, synthetic row), each row
    normalised by (norm + 1e-8); a 1-D parameter is one row."""
    total = None
    for gs, gr in zip(g_syn, g_real, strict=True):
        rows = gs.shape[0] if gs.dim() > 1 else 1
        a = gr.reshape(rows, -1)
        b = gs.reshape(rows, -1)
        a = a / (a.norm(dim=-1, keepdim=True) + ROW_EPS)
        b = b / (b.norm(dim=-1, keepdim=True) + ROW_EPS)
        d = (1 - (a * b).sum(-1)).sum() / rows
        total = d if total is None else total + d
    if total is None:
        raise ValueError("gradient matching needs at least one parameter")
    return total


def match_loss(g_syn: Sequence[torch.Tensor], g_real: Sequence[torch.Tensor],
               mse_weight: float = 0.0) -> torch.Tensor:
    """`layer_cosine_distance` plus `mse_weight` times ||g_syn - g_real||^2 over all
    parameters."""
    loss = layer_cosine_distance(g_syn, g_real)
    if mse_weight > 0:
        loss = loss + mse_weight * gradient_distance(g_syn, g_real, "mse")
    return loss


@dataclass
class RealGradients:
    """Cross-entropy gradients of Poisson-sampled real batches: plain, or DP-SGD's privatised
    gradient when `noise_multiplier` is given (`clip` C, `delta`; default 1/(10 n))."""

    x: torch.Tensor
    y: torch.Tensor
    batch: int
    noise_multiplier: float | None = None
    clip: float = 1.0
    delta: float | None = None
    accountant: str = "rdp"
    _shadow: tuple[nn.Module, nn.Module, PerSampleGradients] | None = field(
        default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.batch < 1 or len(self.y) == 0:
            raise ValueError(f"real gradients need batch >= 1 and at least one record; got "
                             f"batch {self.batch}, {len(self.y)} records")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"unknown accountant '{self.accountant}'; "
                             f"allowed: {', '.join(ACCOUNTANTS)}")
        if self.dp and (self.clip <= 0 or self.noise_multiplier < 0):   # type: ignore[operator]
            raise ValueError(f"DP needs clip > 0 and noise multiplier >= 0; got clip "
                             f"{self.clip}, noise multiplier {self.noise_multiplier}")
        self.n = len(self.y)
        self.sample_rate = min(1.0, self.batch / self.n)
        if self.delta is None:
            self.delta = default_delta(self.n)
        self.last_norms: torch.Tensor | None = None

    @property
    def dp(self) -> bool:
        """Whether the targets are privatised."""
        return self.noise_multiplier is not None

    def privacy_spent(self, steps: int) -> tuple[float, float]:
        """(epsilon, delta) after `steps` privatised targets, from the accountant."""
        if not self.dp:
            raise ValueError("non-private real gradients spend no accounted privacy")
        assert self.delta is not None and self.noise_multiplier is not None
        return compute_epsilon(self.noise_multiplier, self.sample_rate, steps, self.delta,
                               self.accountant), self.delta

    def __call__(self, model: nn.Module, generator: torch.Generator,
                 augment: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> list[torch.Tensor]:
        """One target: the gradient w.r.t. `model`'s trainable parameters of a fresh Poisson
        batch (transformed by `augment`), detached. Draws: the batch, then (DP) the noise."""
        idx = poisson_batch(self.n, self.sample_rate, generator).to(self.x.device)
        xb, yb = self.x[idx], self.y[idx]
        if augment is not None:
            xb = augment(xb)
        params = [p for p in model.parameters() if p.requires_grad]
        if not self.dp:
            if len(yb) == 0:   # an empty draw: no signal (known on the host, no sync)
                return [torch.zeros_like(p) for p in params]
            with torch.enable_grad():
                grads = torch.autograd.grad(F.cross_entropy(model(xb), yb), params)
            return [g.detach() for g in grads]
        per_sample = self._per_sample(model)
        grads, _ = per_sample(xb.detach(), yb)
        assert self.noise_multiplier is not None
        private, self.last_norms = privatise(grads, self.clip, self.noise_multiplier,
                                             self.sample_rate * self.n, generator)
        return private

    def _per_sample(self, model: nn.Module) -> PerSampleGradients:
        """Opacus' per-sample gradients of a shadow copy of `model` (its hooks would disturb
        the double backward of the synthetic side), its parameters set to `model`'s."""
        if self._shadow is None or self._shadow[0] is not model:
            self.close()
            shadow = copy.deepcopy(model)
            self._shadow = (model, shadow, PerSampleGradients(shadow))
        _, shadow, per_sample = self._shadow
        with torch.no_grad():
            for s, p in zip(shadow.parameters(), model.parameters(), strict=True):
                s.copy_(p)
        shadow.train(model.training)
        return per_sample

    def close(self) -> None:
        """Remove the per-sample hooks of the shadow model, if any."""
        if self._shadow is not None:
            self._shadow[2].close()
            self._shadow = None

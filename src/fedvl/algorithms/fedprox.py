"""FedProx (Li et al. 2020): FedAvg plus a proximal term (mu/2)||w - w_global||^2 locally.

Under DP-SGD (`dp_noise` > 0) the proximal term reads no data, so its gradient is added to the
privatised cross-entropy gradient after clipping and noise (post-processing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedvl.algorithms.base import ClientContext
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.message import Message
from fedvl.core.training import LossTerm
from fedvl.models.base import FedModel
from fedvl.options import LogUniform, option
from fedvl.registry import register_algorithm


class ProximalTerm:
    """(mu/2) * sum over parameters of ||w - w_global||^2 (reads no data)."""

    def __init__(self, model: FedModel, mu: float) -> None:
        self.mu = mu
        self.anchor = [p.detach().clone() for p in model.parameters()]

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        sq = sum((p - a).pow(2).sum() for p, a in zip(model.parameters(), self.anchor,
                                                       strict=True))
        return 0.5 * self.mu * sq


@register_algorithm("fedprox")
class FedProx(FedAvg):
    """FedAvg with a proximal regulariser toward the round's global model."""

    # The proximal term depends on the weights only: DP-SGD adds it after privatisation.
    dp_sgd = True

    @dataclass
    class Params(FedAvg.Params):
        mu: float = option(0.01, "weight of the proximal term", ge=0,
                            tune=LogUniform(1e-3, 1.0))

    def loss_terms(self, model: FedModel, msg: Message,
                   client: ClientContext) -> Sequence[LossTerm]:
        return (ProximalTerm(model, self.p.mu),) if self.p.mu > 0 else ()

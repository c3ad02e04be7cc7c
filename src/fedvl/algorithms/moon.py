"""MOON (Li et al. 2021): model-contrastive loss on projection-head features.

z, z_glob, z_prev = projections of x by the local, global and previous local models;
l = [cos(z, z_glob), cos(z, z_prev)] / T;  loss = CE + mu * CE(l, 0).
The model gets a projection head Linear(d,d)-ReLU-Linear(d,out_dim) before the classifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.algorithms.base import ClientContext
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.training import LossTerm, TrainStats
from fedvl.models.base import FedModel
from fedvl.options import LogUniform, option
from fedvl.registry import register_algorithm
from fedvl.seeding import seeded


class ProjectedModel(FedModel):
    """A base model whose embedding passes through a projection head before the classifier."""

    def __init__(self, base: FedModel, out_dim: int) -> None:
        super().__init__()
        self.base = base
        d = base.feature_dim
        self.proj = nn.Sequential(nn.Linear(d, d), nn.ReLU(inplace=True), nn.Linear(d, out_dim))
        self.feature_dim = out_dim
        self.num_classes = base.num_classes
        self.classifier = nn.Linear(out_dim, base.num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.base.embed(x))


class ModelContrastiveTerm:
    """mu * CE([cos(z, z_g), cos(z, z_p)] / T, 0)."""

    def __init__(self, global_model: FedModel, prev_model: FedModel, mu: float,
                 temperature: float) -> None:
        self.g, self.prev, self.mu, self.t = global_model.eval(), prev_model.eval(), mu, temperature

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            zg, zp = self.g.embed(x), self.prev.embed(x)
        pos = F.cosine_similarity(z, zg, dim=1)
        neg = F.cosine_similarity(z, zp, dim=1)
        lg = torch.stack([pos, neg], dim=1) / self.t
        return self.mu * F.cross_entropy(lg, torch.zeros(len(x), dtype=torch.long,
                                                          device=x.device))


@register_algorithm("moon")
class Moon(FedAvg):
    """Model-contrastive federated learning."""

    name = "moon"

    @dataclass
    class Params:
        mu: float = option(1.0, "weight of the model-contrastive term", ge=0,
                            tune=LogUniform(0.1, 10.0))
        temperature: float = option(0.5, "temperature of the model-contrastive term", gt=0)
        out_dim: int = option(256, "width of the projection head", ge=1)

    def new_model(self) -> FedModel:
        return self._wrap(self.env.model_fn()).to(self.env.device)

    def _wrap(self, base: FedModel) -> FedModel:
        # The head's init must not depend on the global RNG: derive it from the run seed.
        with seeded(self.env.seed + 7919):
            return ProjectedModel(base, self.p.out_dim)

    def load_model(self, weights: dict, device: torch.device) -> FedModel:
        model = self._wrap(self.env.model_fn()).to(device)
        model.load_state_dict(weights)
        return model

    def loss_terms(self, model: FedModel, msg: Message,
                   client: ClientContext) -> Sequence[LossTerm]:
        glob = self.load_model(msg.get("weights"), client.device)
        prev_w = client.state.arrays.get("weights") or msg.get("weights")
        prev = self.load_model(prev_w, client.device)
        return (ModelContrastiveTerm(glob, prev, self.p.mu, self.p.temperature),)

    def reply(self, model: FedModel, stats: TrainStats, msg: Message,
              client: ClientContext) -> Message:
        client.state.arrays["weights"] = clone_state(model.state_dict())
        return super().reply(model, stats, msg, client)

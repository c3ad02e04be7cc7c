"""FedProto (Tan et al. 2022): heterogeneous models share class prototypes of their features.

Round r:
  client: trains its own model with CE + ld * MSE(rep(x), P[y]) on the samples whose class has
          a global prototype P[y] (no term before one exists), and uploads the per-class mean
          representation of its training batches, with counts.
  server: P[c] = the plain mean of the prototypes of the clients holding class c.
The representation is the input of the classifier. Prototypes need one size for every client:
when the architectures' embeddings differ (ConvNet and AlexNet), each client model gets a
linear layer to `proto_dim` features (default: the smallest embedding size) in front of its
classifier, as FedProto's heterogeneous networks share the size of their last hidden layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedvl.algorithms.base import Algorithm, ServerContext, ServerState
from fedvl.algorithms.class_means import ClassMeanExchange
from fedvl.core.message import Message
from fedvl.core.prototypes import pool_class_means
from fedvl.models.base import FedModel
from fedvl.options import LogUniform, option
from fedvl.registry import register_algorithm
from fedvl.seeding import derive_seed, seeded

# Seed stream of the projection layers (client id is mixed in).
PROJECTION_STREAM = 97


class ProjectedModel(FedModel):
    """A model whose representation is a linear map of its embedding; the classifier reads it."""

    def __init__(self, base: FedModel, dim: int) -> None:
        super().__init__()
        self.base = base
        self.base.classifier = nn.Identity()  # replaced by the classifier on the projection
        self.proj = nn.Linear(base.feature_dim, dim)
        self.feature_dim, self.num_classes = dim, base.num_classes
        self.classifier = nn.Linear(dim, base.num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.base.embed(x))


@register_algorithm("fedproto")
class FedProto(ClassMeanExchange):
    """Class prototypes through the server; each client keeps its own model."""

    kind = "prototypes"
    on_logits = False
    payload_kinds = {"down": frozenset({"prototypes"}), "up": frozenset({"prototypes"})}
    count_tensors = frozenset({"prototypes/counts"})

    @dataclass
    class Params:
        ld: float = option(1.0, "weight of the MSE toward the global prototypes (reference 1)",
                           ge=0, tune=LogUniform(0.1, 10.0))
        proto_dim: int = option(0, "representation size when the clients' embeddings differ "
                                "(0: the smallest of them); a linear layer maps to it", ge=0)

    def __init__(self, env: Any, params: Any | None = None) -> None:
        super().__init__(env, params)
        dims = sorted({int(Algorithm.client_new_model(self, k).feature_dim)
                       for k in range(max(env.num_clients, 1))})
        self.project = len(dims) > 1 or self.p.proto_dim > 0
        self.dim = self.p.proto_dim or dims[0]

    def client_new_model(self, cid: int) -> FedModel:
        base = super().client_new_model(cid)
        if not self.project:
            return base
        # Seeded per run and client, so every engine builds the same layer.
        with seeded(derive_seed(self.env.seed, PROJECTION_STREAM, cid)):
            return ProjectedModel(base, self.dim).to(self.env.device)

    def report(self, state: ServerState) -> dict[str, Any]:
        return {"prototypes": {"dim": self.dim, "projection": self.project}}

    def pull_weight(self) -> float:
        return self.p.ld

    def server_init(self) -> ServerState:
        return {"protos": None, "counts": None}

    def served(self, state: ServerState) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if state["protos"] is None else (state["protos"], state["counts"])

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        protos, counts = pool_class_means(self.uploads(replies), weighted=False)
        return {"protos": protos, "counts": counts}

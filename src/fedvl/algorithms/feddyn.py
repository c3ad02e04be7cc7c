"""FedDyn (Acar et al., ICLR 2021): dynamic regularisation of each client's local objective.

m clients, P_t the participants of round t, alpha > 0; g_k (client state) and h (server state)
start at 0.
Client k in P_t, from the served model theta:
  1. theta_k = argmin  L_k(w) - <g_k, w> + (alpha/2) ||w - theta||^2   (the round's local SGD)
  2. g_k <- g_k - alpha (theta_k - theta);  upload theta_k.
Server:
  3. h <- h - (alpha/m) sum_{k in P_t} (theta_k - theta)           (m: all clients)
  4. theta <- (1/|P_t|) sum_{k in P_t} theta_k - h/alpha           (plain mean of participants)
The reference code stores a_k = -g_k/alpha, adds alpha<w, a_k - theta> to the loss and puts
(alpha/2)||w||^2 into SGD's weight decay: the same gradient. It also clips each step's
gradient norm to 10 (`max_grad_norm`; off by default, as no other method here clips). Only
parameters carry g_k and h; buffers (BatchNorm statistics) take the participants' plain mean.
Under DP-SGD (`dp_noise` > 0) both terms read no data, so their gradient joins the privatised
step (post-processing), and g_k is computed from the privatised weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from fedvl.algorithms.base import ClientContext, Env, ServerContext, ServerState
from fedvl.algorithms.fedavg import FedAvg
from fedvl.algorithms.fedprox import ProximalTerm
from fedvl.core.message import Message
from fedvl.core.params import weighted_average
from fedvl.core.training import LossTerm, TrainConfig, TrainStats
from fedvl.models.base import FedModel
from fedvl.options import ConfigError, LogUniform, option
from fedvl.registry import register_algorithm

# The client-state kind of g_k, its running estimate of its own loss gradient.
STATE_KIND = "gradients"


class LinearTerm:
    """-<g, w> over the named parameters (reads no data)."""

    def __init__(self, g: Mapping[str, torch.Tensor]) -> None:
        self.g = g

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        return -sum((self.g[n] * p).sum() for n, p in model.named_parameters() if n in self.g)


def dyn_client_state(g: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor],
                     served: Mapping[str, torch.Tensor], alpha: float
                     ) -> dict[str, torch.Tensor]:
    """Step 2: g_k - alpha (theta_k - theta), for every name of g_k."""
    return {n: g[n] - alpha * (trained[n] - served[n]) for n in g}


def dyn_server_step(served: Mapping[str, torch.Tensor], h: Mapping[str, torch.Tensor],
                    uploads: Sequence[Mapping[str, torch.Tensor]], alpha: float,
                    num_clients: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Steps 3 and 4: (the next served model, the next h); keys outside h take the plain mean."""
    mean = weighted_average(uploads, [1.0] * len(uploads))
    new_h = {}
    for n, hn in h.items():
        drift = sum(u[n] - served[n] for u in uploads)
        new_h[n] = hn - (alpha / num_clients) * drift
    model = {n: mean[n] - new_h[n] / alpha if n in new_h else mean[n] for n in served}
    return model, new_h


@register_algorithm("feddyn")
class FedDyn(FedAvg):
    """Federated learning with dynamic regularisation."""

    # Step 4 is the plain mean of the participants corrected by h; a median or a trimmed mean
    # would break the correction's bookkeeping.
    robust_aggregation = False
    # Both terms depend on the weights and the client's own past models only.
    dp_sgd = True

    @dataclass
    class Params(FedAvg.Params):
        alpha_coef: float = option(0.01, "weight alpha of the dynamic regulariser (named as in "
                                   "the reference code; VHL has an alpha of its own)", gt=0,
                                   tune=LogUniform(1e-3, 1e-1))
        max_grad_norm: float = option(0.0, "L2 norm each local step's gradient is clipped to "
                                      "(the reference code: 10, for every method); 0: no "
                                      "clipping", ge=0)

    def __init__(self, env: Env, params: Any | None = None) -> None:
        super().__init__(env, params)
        if self.dp and self.p.max_grad_norm > 0:
            raise ConfigError("feddyn: max_grad_norm > 0 cannot run with dp_noise > 0 (DP-SGD "
                              "clips each sample's gradient to dp_clip instead); set one of "
                              "them to 0")

    def client_train(self, client: ClientContext) -> TrainConfig:
        """The run's round config, with the reference code's clip when `max_grad_norm` > 0."""
        cfg = super().client_train(client)
        if self.p.max_grad_norm > 0:
            return replace(cfg, max_grad_norm=self.p.max_grad_norm)
        return cfg

    def server_init(self) -> ServerState:
        state = super().server_init()
        state["h"] = {n: torch.zeros_like(p.detach())
                      for n, p in self.new_model().named_parameters()}
        return state

    def linear_state(self, model: FedModel, client: ClientContext) -> dict[str, torch.Tensor]:
        """g_k from the client's state, or zeros before its first round."""
        kept = client.state.arrays.get(STATE_KIND)
        if kept is not None:
            return kept
        return {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()}

    def loss_terms(self, model: FedModel, msg: Message,
                   client: ClientContext) -> Sequence[LossTerm]:
        # (alpha/2)||w - theta||^2 is FedProx's term with mu = alpha: `model` holds theta now.
        return (ProximalTerm(model, self.p.alpha_coef),
                LinearTerm(self.linear_state(model, client)))

    def reply(self, model: FedModel, stats: TrainStats, msg: Message,
              client: ClientContext) -> Message:
        trained = {n: p.detach() for n, p in model.named_parameters()}
        client.state.arrays[STATE_KIND] = dyn_client_state(
            self.linear_state(model, client), trained, msg.get("weights"), self.p.alpha_coef)
        return super().reply(model, stats, msg, client)

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        model, h = dyn_server_step(state["model"], state["h"],
                                   [r.get("weights") for r in replies.values()],
                                   self.p.alpha_coef, self.env.num_clients)
        return self.record_privacy({**state, "model": model, "h": h}, replies)

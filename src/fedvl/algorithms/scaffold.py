"""SCAFFOLD (Karimireddy et al. 2020): control variates correct client drift.

Server sends (w, c). Client k, after every optimiser step: w <- w - lr (c - c_k).
After K steps: c_k+ = c_k - c + (w_global - w_k) / (K lr); upload w_k and dc_k = c_k+ - c_k.
Server: w = average of w_k; c <- c + (1/N) sum_k dc_k (paper rule, keeps c = mean_k c_k);
`cv_scale="sampled"` uses the mean over sampled clients instead (NIID-Bench/VHL code).
The control variates cover the parameters the server sends them for (all of them, unless an
add-on keeps some layers local: `scaffold+fedbn`'s BatchNorm layers take plain SGD steps).
Under DP-SGD (`dp_noise` > 0) the correction follows each privatised step; it reads no data, and
c_k+ is computed from the privatised weights, so both are post-processing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedvl.algorithms.base import ClientContext, ServerContext, ServerState
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.training import TrainStats
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm


@register_algorithm("scaffold")
class Scaffold(FedAvg):
    """Stochastic controlled averaging."""

    payload_kinds = {"down": frozenset({"control_variates"}),
                     "up": frozenset({"control_variates"})}

    # The correction c - c_k is data-independent: DP-SGD applies it after the privatised step.
    dp_sgd = True

    @dataclass
    class Params(FedAvg.Params):
        cv_scale: str = option("all", "server control-variate update: mean over all clients "
                               "(paper) or over the sampled ones", choices=("all", "sampled"))

    def server_init(self) -> ServerState:
        state = super().server_init()
        model = self.new_model()
        state["c"] = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        return state

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        msg = Message({"weights": state["model"], "control_variates": state["c"]})
        return {c: msg for c in clients}

    def _local_c(self, msg: Message, client: ClientContext) -> dict[str, torch.Tensor]:
        c_local = client.state.arrays.get("control_variates")
        if c_local is None:
            c_local = {n: torch.zeros_like(t) for n, t in msg.get("control_variates").items()}
        return c_local

    def after_step(self, model: FedModel, msg: Message,
                   client: ClientContext) -> Callable[[FedModel, float], None]:
        c = msg.get("control_variates")
        c_local = self._local_c(msg, client)
        corr = {n: c[n] - c_local[n] for n in c}

        @torch.no_grad()
        def correct(m: FedModel, lr: float) -> None:
            for n, p in m.named_parameters():
                if n in corr:
                    p.sub_(corr[n], alpha=lr)

        return correct

    def reply(self, model: FedModel, stats: TrainStats, msg: Message,
              client: ClientContext) -> Message:
        c = msg.get("control_variates")
        c_local = self._local_c(msg, client)
        w0 = msg.get("weights")
        # The learning rate the K steps took (decayed with the round, `--lr-decay`).
        scale = 1.0 / (max(stats.steps, 1) * self.client_train(client).lr)
        new_local, delta = {}, {}
        for n, p in model.named_parameters():
            if n not in c:
                continue
            new_local[n] = c_local[n] - c[n] + (w0[n] - p.detach()) * scale
            delta[n] = new_local[n] - c_local[n]
        client.state.arrays["control_variates"] = new_local
        base = super().reply(model, stats, msg, client)
        base.arrays["control_variates"] = delta
        return base

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        new = super().aggregate(state, ctx, replies)
        denom = self.env.num_clients if self.p.cv_scale == "all" else len(replies)
        c = clone_state(state["c"])
        for r in replies.values():
            for n, d in r.get("control_variates").items():
                c[n].add_(d, alpha=1.0 / denom)
        new["c"] = c
        return new

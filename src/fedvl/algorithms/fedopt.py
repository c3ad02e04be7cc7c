"""Server optimisers on the pseudo-gradient g = w_t - avg_k(w_k) (Reddi et al. 2021; Hsu 2019).

FedAvgM: m <- beta m + g;  w <- w - server_lr m.
FedAdam: m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;  w <- w - server_lr m / (sqrt(v) + tau).
Both move the parameters only; buffers (BN running statistics) take the plain average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedvl.algorithms.base import ServerState
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.message import Message
from fedvl.options import option
from fedvl.registry import register_algorithm


@register_algorithm("fedavgm")
class FedAvgM(FedAvg):
    """FedAvg with server momentum."""

    name = "fedavgm"

    @dataclass
    class Params:
        server_lr: float = option(1.0, "server learning rate", gt=0)
        server_momentum: float = option(0.9, "server momentum", ge=0, lt=1)

    def server_update(self, state: ServerState, avg: dict, replies: dict[int, Message]
                      ) -> ServerState:
        w = state["model"]
        params = self.parameter_keys()
        mom = state.get("momentum") or {k: torch.zeros_like(v) for k, v in w.items()
                                        if k in params}
        new, new_mom = {}, {}
        for k, v in w.items():
            if k not in params:
                new[k] = avg[k]
                continue
            new_mom[k] = self.p.server_momentum * mom[k] + (v - avg[k])
            new[k] = v - self.p.server_lr * new_mom[k]
        return {**state, "model": new, "momentum": new_mom}


@register_algorithm("fedadam")
class FedAdam(FedAvg):
    """FedAvg with an Adam server optimiser (no bias correction, as in FedOpt)."""

    name = "fedadam"

    @dataclass
    class Params:
        server_lr: float = option(0.01, "server learning rate", gt=0)
        beta1: float = option(0.9, "first-moment decay", ge=0, lt=1)
        beta2: float = option(0.99, "second-moment decay", ge=0, lt=1)
        tau: float = option(1e-3, "adaptivity (added to the root of the second moment)", gt=0)

    def server_update(self, state: ServerState, avg: dict, replies: dict[int, Message]
                      ) -> ServerState:
        w = state["model"]
        params = self.parameter_keys()
        zeros = {k: torch.zeros_like(v) for k, v in w.items() if k in params}
        m0, v0 = state.get("m") or zeros, state.get("v") or zeros
        new, m, v = {}, {}, {}
        for k, wk in w.items():
            if k not in params:
                new[k] = avg[k]
                continue
            g = wk - avg[k]
            m[k] = self.p.beta1 * m0[k] + (1 - self.p.beta1) * g
            v[k] = self.p.beta2 * v0[k] + (1 - self.p.beta2) * g * g
            new[k] = wk - self.p.server_lr * m[k] / (v[k].sqrt() + self.p.tau)
        return {**state, "model": new, "m": m, "v": v}

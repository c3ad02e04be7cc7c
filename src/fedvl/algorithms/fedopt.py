"""Server optimisers on the pseudo-gradient g = w_t - avg_k(w_k) (Reddi et al. 2021; Hsu 2019).

FedAvgM: m <- beta m + g;  w <- w - server_lr m.
FedAdam: m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;  w <- w - lr_t m / (sqrt(v) + tau),
  lr_t = server_lr (FedOpt's Algorithm 2, no bias correction: `bias_correction=none`), or
  server_lr sqrt(1 - b2^s) / (1 - b1^s) with s = t + 1 after t server steps (`flower`: Flower's
  FedAdam, whose exponent is its 1-based round + 1) or s = t (`adam`: Kingma & Ba's step t).
Both move the parameters only; buffers (BN running statistics) take the plain average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedvl.algorithms.base import ServerState
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.message import Message
from fedvl.options import Choice, LogUniform, option
from fedvl.registry import register_algorithm


@register_algorithm("fedavgm")
class FedAvgM(FedAvg):
    """FedAvg with server momentum."""

    name = "fedavgm"

    @dataclass
    class Params:
        server_lr: float = option(1.0, "server learning rate", gt=0,
                                  tune=LogUniform(0.1, 1.0))
        server_momentum: float = option(0.9, "server momentum", ge=0, lt=1,
                                        tune=Choice(0.7, 0.9, 0.97))

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
    """FedAvg with an Adam server optimiser (bias correction: none as in FedOpt, or Flower's)."""

    name = "fedadam"

    @dataclass
    class Params:
        server_lr: float = option(0.01, "server learning rate", gt=0,
                                  tune=LogUniform(1e-3, 1.0))
        beta1: float = option(0.9, "first-moment decay", ge=0, lt=1)
        beta2: float = option(0.99, "second-moment decay", ge=0, lt=1)
        tau: float = option(1e-3, "adaptivity (added to the root of the second moment)", gt=0)
        bias_correction: str = option("none", "none: FedOpt's Algorithm 2 (the paper); flower: "
                                      "Flower's FedAdam learning rate; adam: Kingma & Ba's",
                                      choices=("none", "flower", "adam"))

    def server_update(self, state: ServerState, avg: dict, replies: dict[int, Message]
                      ) -> ServerState:
        w = state["model"]
        params = self.parameter_keys()
        zeros = {k: torch.zeros_like(v) for k, v in w.items() if k in params}
        m0, v0 = state.get("m") or zeros, state.get("v") or zeros
        t = int(state.get("adam_steps", 0)) + 1   # this server step's number, from 1
        lr = self.p.server_lr
        if self.p.bias_correction != "none":
            s = t + 1 if self.p.bias_correction == "flower" else t
            lr = lr * math.sqrt(1 - self.p.beta2 ** s) / (1 - self.p.beta1 ** s)
        new, m, v = {}, {}, {}
        for k, wk in w.items():
            if k not in params:
                new[k] = avg[k]
                continue
            g = wk - avg[k]
            m[k] = self.p.beta1 * m0[k] + (1 - self.p.beta1) * g
            v[k] = self.p.beta2 * v0[k] + (1 - self.p.beta2) * g * g
            new[k] = wk - lr * m[k] / (v[k].sqrt() + self.p.tau)
        return {**state, "model": new, "m": m, "v": v, "adam_steps": t}

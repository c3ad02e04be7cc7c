"""FedNova (Wang et al. 2020): normalise each client's update by its effective local steps.

a_k = [tau_k - rho (1 - rho^tau_k) / (1 - rho)] / (1 - rho)   (a_k = tau_k without momentum)
d_k = (w - w_k) / a_k;   d = sum_k p_k d_k;   tau_eff = sum_k p_k a_k;   w <- w - tau_eff d.
The rule moves the parameters; buffers (BN running statistics) are the weighted average of the
clients' buffers, as in FedAvg. Under DP-SGD (`dp_noise`), tau_k is the number of Poisson-sampled
steps, which depends on n_k only.
"""

from __future__ import annotations

from fedvl.algorithms.base import ServerContext, ServerState
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.message import Message
from fedvl.core.params import weighted_average
from fedvl.core.replies import ReplySpec
from fedvl.registry import register_algorithm


def effective_steps(tau: int, rho: float) -> float:
    """FedNova's a_k for `tau` SGD steps with momentum `rho`."""
    if rho == 0:
        return float(tau)
    return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)


@register_algorithm("fednova")
class FedNova(FedAvg):
    """Normalised averaging."""

    name = "fednova"
    # Its update is a step-normalised mean of deltas; a median of those is another method.
    robust_aggregation = False

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        spec.required_meta |= {"steps"}   # tau_k, the local step count it normalises by
        return spec

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        w = state["model"]
        weights = self.client_weights(replies)
        total = sum(weights)
        rho = self.env.train.momentum
        a = [effective_steps(int(r.meta["steps"]), rho) for r in replies.values()]
        tau_eff = sum(p * ak for p, ak in zip(weights, a, strict=True)) / total
        avg = weighted_average([r.get("weights") for r in replies.values()], weights)
        params = self.parameter_keys()
        new = {}
        for key, w0 in w.items():
            if key not in params:
                new[key] = avg[key]
                continue
            d = sum((p / total) * (w0 - r.get("weights")[key]) / max(ak, 1e-12)
                    for p, ak, r in zip(weights, a, replies.values(), strict=True))
            new[key] = w0 - tau_eff * d
        return self.record_privacy({**state, "model": new}, replies)

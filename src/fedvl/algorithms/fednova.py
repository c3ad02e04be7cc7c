"""FedNova (Wang et al. 2020): normalise each client's update by its effective local steps.

a_k = [tau_k - rho (1 - rho^tau_k) / (1 - rho)] / (1 - rho)   (a_k = tau_k without momentum)
d_k = (w - w_k) / a_k;   d = sum_k p_k d_k;   tau_eff = sum_k p_k a_k;   w <- w - tau_eff d.
The rule moves the parameters; buffers (BN running statistics) are the weighted average of the
clients' buffers, as in FedAvg. Under DP-SGD (`dp_noise`), tau_k is the number of Poisson-sampled
steps, which depends on n_k only. With `--aggregation median|trimmed-mean` (fedvl's reading) the
rule replaces both weighted means, coordinate-wise: d = rule_k(d_k), tau_eff = rule_k(a_k).
A reply's tau_k must lie in [1, the steps local training takes on the client's announced
training-set size].
"""

from __future__ import annotations

import torch

from fedvl.algorithms.base import ServerContext, ServerState
from fedvl.algorithms.fedavg import ROBUST_RULES, FedAvg
from fedvl.core.message import Message
from fedvl.core.params import robust_average, weighted_average
from fedvl.core.replies import ReplySpec
from fedvl.core.training import num_batches
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
    # `--aggregation median|trimmed-mean`: the rule combines the normalised updates d_k and
    # the a_k coordinate-wise instead of the weighted means (see `aggregate`).
    robust_aggregation = True

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        spec.required_meta |= {"steps"}   # tau_k, the local step count it normalises by
        return spec

    def meta_bounds(self, cid: int, announced: int) -> dict[str, tuple[int, int]]:
        """`steps` within [1, the steps local training takes on `announced` samples]: a_k
        divides the update, so 0 or a huge count would scale the server's step at will."""
        cfg = self.env.train
        most = num_batches(announced, cfg.batch_size, cfg.local_epochs, cfg.local_steps)
        return {**super().meta_bounds(cid, announced), "steps": (1, max(1, most))}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        if self.env.aggregation in ROBUST_RULES:
            return self.record_privacy(self.robust_step(state, replies), replies)
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

    def robust_step(self, state: ServerState, replies: dict[int, Message]) -> ServerState:
        """FedNova's step with a robust rule: d = rule_k(d_k), tau_eff = rule_k(a_k).

        d_k = (w - w_k) / a_k is each client's update per effective step; the median (or
        trimmed mean) of the d_k, coordinate-wise, replaces their weighted mean, and the same
        rule over the a_k replaces the weighted mean of the steps, so one client can move
        neither the direction nor the step length by more than the spread of the others.
        Buffers take the rule over the clients' buffers.
        """
        w, rule, trim = state["model"], self.env.aggregation, self.env.trim
        rho = self.env.train.momentum
        states = [r.get("weights") for r in replies.values()]
        a = [effective_steps(int(r.meta["steps"]), rho) for r in replies.values()]
        params = self.parameter_keys()
        d = robust_average([{k: (w[k] - s[k]) / max(ak, 1e-12) for k in w if k in params}
                            for s, ak in zip(states, a, strict=True)], rule, trim)
        tau_eff = float(robust_average([{"a": torch.tensor(ak, dtype=torch.float64, device="cpu")}
                                        for ak in a], rule, trim)["a"])
        buffers = robust_average(states, rule, trim)
        new = {k: w[k] - tau_eff * d[k] if k in params else buffers[k] for k in w}
        return {**state, "model": new}

"""FedHe (Chan & Ngai 2021): heterogeneous models share per-class mean logits.

Round r:
  client: trains its own model (any architecture) with CE + alpha * MSE(logits, g[y]) on the
          samples whose class has a served mean logit g[y] (no term before one exists), and
          uploads the per-class mean of the logits it produced during that training, with counts.
  server: keeps a running per-class sum and count of the uploaded logits (`memory=running`, the
          reference's asynchronous server, which never forgets) or only this round's
          (`memory=round`), and serves the per-class average.
Synchronous rounds here; the reference updates one client at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedvl.algorithms.base import ServerContext, ServerState
from fedvl.algorithms.class_means import ClassMeanExchange
from fedvl.core.message import Message
from fedvl.options import Uniform, option
from fedvl.registry import register_algorithm


@register_algorithm("fedhe")
class FedHe(ClassMeanExchange):
    """Per-class mean logits through the server; each client keeps its own model."""

    kind = "logits"
    on_logits = True
    payload_kinds = {"down": frozenset({"logits"}), "up": frozenset({"logits"})}
    count_tensors = frozenset({"logits/counts"})

    @dataclass
    class Params:
        alpha: float = option(0.5, "weight of the MSE toward the served class logits "
                              "(reference 0.5)", ge=0, tune=Uniform(0.1, 1.0))
        memory: str = option("running", "server keeps every round's logits (running: the "
                             "reference) or only the last round's (round)",
                             choices=("running", "round"))

    def pull_weight(self) -> float:
        return self.p.alpha

    def server_init(self) -> ServerState:
        return {"sums": None, "counts": None}

    def served(self, state: ServerState) -> tuple[torch.Tensor, torch.Tensor] | None:
        if state["sums"] is None:
            return None
        return state["sums"] / state["counts"].clamp_min(1)[:, None], state["counts"]

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        sums, counts = state["sums"], state["counts"]
        if self.p.memory == "round" or sums is None:
            sums = counts = None
        for m, n in self.uploads(replies):
            sums = m * n[:, None] if sums is None else sums + m * n[:, None]
            counts = n if counts is None else counts + n
        return {"sums": sums, "counts": counts}

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

from fedvl.algorithms.base import Algorithm, ClientContext, ServerContext, ServerState
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.prototypes import ClassMeanTerm
from fedvl.core.training import local_train
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm


@register_algorithm("fedhe")
class FedHe(Algorithm):
    """Per-class mean logits through the server; each client keeps its own model."""

    personalized = True
    mixed_models = True
    payload_kinds = {"down": frozenset({"logits"}), "up": frozenset({"logits"})}

    @dataclass
    class Params:
        alpha: float = option(0.5, "weight of the MSE toward the served class logits "
                              "(reference 0.5)", ge=0)
        memory: str = option("running", "server keeps every round's logits (running: the "
                             "reference) or only the last round's (round)",
                             choices=("running", "round"))

    def server_init(self) -> ServerState:
        return {"sums": None, "counts": None}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        if state["sums"] is None:
            return {c: Message() for c in clients}
        mean = state["sums"] / state["counts"].clamp_min(1)[:, None]
        msg = Message({"logits": {"class_mean": mean, "counts": state["counts"]}})
        return {c: msg for c in clients}

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        model = self.own_model(client)
        target = has = None
        if "logits" in msg.arrays:
            target = msg.arrays["logits"]["class_mean"].to(client.device)
            has = (msg.arrays["logits"]["counts"] > 0).to(client.device)
        term = ClassMeanTerm(target, has, self.p.alpha, client.num_classes, use_logits=True)
        stats = local_train(model, client.x, client.y, self.env.train, client.generator,
                            terms=[term])
        client.state.arrays["weights"] = clone_state(model.state_dict())
        mean, counts = term.means()
        return Message({"logits": {"class_mean": mean, "counts": counts}},
                       {"num_examples": client.num_train, "steps": stats.steps,
                        "train_loss": stats.mean_loss})

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        sums, counts = state["sums"], state["counts"]
        if self.p.memory == "round" or sums is None:
            sums = counts = None
        for r in replies.values():
            m = r.arrays["logits"]["class_mean"].float().cpu()
            n = r.arrays["logits"]["counts"].float().cpu()
            sums = m * n[:, None] if sums is None else sums + m * n[:, None]
            counts = n if counts is None else counts + n
        return {"sums": sums, "counts": counts}

    def client_model(self, client: ClientContext) -> FedModel:
        return self.own_model(client)

"""Methods that exchange per-class means of a model's outputs through the server (FedHe: logits,
FedProto: representations), each client keeping its own model of its own architecture."""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from fedvl.algorithms.base import Algorithm, ClientContext, ServerContext, ServerState
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.prototypes import ClassMeanTerm
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.core.training import local_train, num_batches


class ClassMeanExchange(Algorithm):
    """Client: CE + weight * MSE toward the served class means, then upload its own class means
    (of the outputs it produced while training) with counts. Subclasses say which output
    (`on_logits`), under which payload kind, the pull's weight, and how the server pools."""

    personalized = True
    mixed_models = True
    kind: ClassVar[str] = "logits"
    on_logits: ClassVar[bool] = True

    @abc.abstractmethod
    def pull_weight(self) -> float:
        """The weight of the MSE toward the served means."""

    @abc.abstractmethod
    def served(self, state: ServerState) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-class means and counts the server hands out (None: nothing yet)."""

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        served = self.served(state)
        if served is None:
            return {c: Message() for c in clients}
        msg = Message({self.kind: {"class_mean": served[0], "counts": served[1]}})
        return {c: msg for c in clients}

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        model = self.own_model(client)
        target = has = None
        if self.kind in msg.arrays:
            target = msg.arrays[self.kind]["class_mean"].to(client.device)
            has = (msg.arrays[self.kind]["counts"] > 0).to(client.device)
        term = ClassMeanTerm(target, has, self.pull_weight(), client.num_classes,
                             use_logits=self.on_logits)
        stats = local_train(model, client.x, client.y, self.client_train(client),
                            client.generator, terms=[term])
        client.state.arrays["weights"] = clone_state(model.state_dict())
        mean, counts = term.means()
        return Message({self.kind: {"class_mean": mean, "counts": counts}},
                       {"num_examples": client.num_train, "steps": stats.steps,
                        "train_loss": stats.mean_loss})

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        c = self.env.num_classes
        # Means of logits span the classes, means of features the model's embedding: every
        # client's must have the same width for the server to pool them.
        width = c if self.on_logits else self.feature_width(cid)
        spec.exact.setdefault(self.kind, {"class_mean": TensorSpec((c, width), torch.float32),
                                          "counts": TensorSpec((c,), torch.float32)})
        spec.required |= {self.kind}
        return spec

    def count_bounds(self, cid: int, announced: int) -> dict[str, int]:
        """The counts tally every sample of every local step: at most the steps local training
        takes on `announced` samples times the batch size."""
        cfg = self.env.train
        seen = num_batches(announced, cfg.batch_size, cfg.local_epochs, cfg.local_steps)
        return dict.fromkeys(self.count_tensors, max(1, seen) * cfg.batch_size)

    def uploads(self, replies: dict[int, Message]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every reply's (class means, counts), as float CPU tensors."""
        return [(r.arrays[self.kind]["class_mean"].float().cpu(),
                 r.arrays[self.kind]["counts"].float().cpu()) for r in replies.values()]


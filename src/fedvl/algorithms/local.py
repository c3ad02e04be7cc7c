"""Local-only training: every client trains its own model on its own data; nothing is shared."""

from __future__ import annotations

from fedvl.algorithms.base import Algorithm, ClientContext, ServerContext, ServerState
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.training import local_train
from fedvl.registry import register_algorithm


@register_algorithm("local")
class LocalOnly(Algorithm):
    """The no-collaboration baseline (personalised: each client is evaluated with its model)."""

    personalized = True
    mixed_models = True  # each client trains its own model, so each may have its own architecture

    def server_init(self) -> ServerState:
        return {}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        return {c: Message() for c in clients}

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        model = self.client_model(client)
        stats = local_train(model, client.x, client.y, self.client_train(client),
                            client.generator)
        client.state.arrays["weights"] = clone_state(model.state_dict())
        return Message(meta={"num_examples": client.num_train, "steps": stats.steps,
                             "train_loss": stats.mean_loss})

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        return state


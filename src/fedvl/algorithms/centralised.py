"""The centralised reference: every client's training data pooled on the server, one model.

NOT a federated method. It is the upper reference of a comparison (`fedvl bench`): what the
same model reaches with the same training budget when the data need not stay with the clients.
It keeps the engine's contract by making the pooling explicit instead of hiding it in the
engine: a client sampled for the first time uploads its training images and labels (payload
kinds `raw_images` / `raw_labels`, counted by the ledger like any other bytes), the server
keeps them in its state, and every round it trains the global model on the union of every
upload so far. The private-data test lists it as a by-design exception.

Budget: per round, the server takes as many SGD steps on the pooled data as FedAvg's clients
take in that round, i.e. the sum over the round's participants of `--local-steps`, or of
`--local-epochs` x ceil(n_k / batch size); same batch size, learning rate (with `--lr-decay`),
momentum and weight decay. The momentum buffer starts afresh every round, as each FedAvg
client's does. With `--client-ratio 1` every client uploads in round 0, so each round is E
epochs over the whole pool (up to the partial last batch of each client); with a smaller ratio
the pool grows as clients are first sampled, and the steps follow the round's participants.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fedvl.algorithms.base import Algorithm, ClientContext, ServerContext, ServerState
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.training import local_train
from fedvl.models.base import FedModel
from fedvl.registry import register_algorithm

# Stream id of the server's mini-batch draws (with the run seed and round).
POOLED_TRAIN_STREAM = 103
NOTE = ("centralised reference, not a federated method: every client's training data are "
        "uploaded once and pooled on the server, which trains one model on the union with the "
        "SGD steps of a FedAvg round (see docs/protocol.md)")


@register_algorithm("centralised")
class Centralised(Algorithm):
    """Pooled-data training on the server: the upper reference of a comparison."""

    payload_kinds = {"up": frozenset({"raw_images", "raw_labels"})}

    def upload_exemption(self) -> str | None:
        """Why its upload is the private data (it pools the raw data by design)."""
        return "the centralised reference uploads the raw training data by design"

    def server_init(self) -> ServerState:
        # Pool keyed by client id (as a str): the union is concatenated in id order, so it does
        # not depend on the order replies arrive in.
        return {"model": clone_state(self.new_model().state_dict()), "pool_x": {},
                "pool_y": {}}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        # Only a client whose data the server lacks is asked for them; the rest get nothing.
        return {c: Message(meta={"upload": str(c) not in state["pool_x"]}) for c in clients}

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        meta: dict[str, Any] = {"num_examples": client.num_train} if client.num_train else {}
        if not msg.meta.get("upload"):
            return Message(meta=meta)
        return Message({"raw_images": {"x": client.x}, "raw_labels": {"y": client.y}}, meta)

    def row_bounds(self, cid: int, announced: int) -> dict[str, int]:
        """The raw upload holds at most the client's own training images."""
        return {"raw_images": announced}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        pool_x, pool_y = dict(state["pool_x"]), dict(state["pool_y"])
        for cid, r in replies.items():
            if "raw_images" in r.arrays:
                pool_x[str(cid)] = r.arrays["raw_images"]["x"].to(ctx.device)
                pool_y[str(cid)] = r.arrays["raw_labels"]["y"].to(ctx.device)
        model = self.load_model(state["model"], ctx.device)
        keys = sorted(pool_x, key=int)
        if keys:
            cfg = self.env.train.at_round(ctx.round)
            steps = sum(self.fedavg_steps(len(pool_y[str(c)])) for c in replies
                        if str(c) in pool_y)
            x = torch.cat([pool_x[k] for k in keys])
            y = torch.cat([pool_y[k] for k in keys])
            local_train(model, x, y, replace(cfg, local_epochs=1, local_steps=steps),
                        ctx.stream(POOLED_TRAIN_STREAM))
        return {"model": clone_state(model.state_dict()), "pool_x": pool_x, "pool_y": pool_y}

    def fedavg_steps(self, n: int) -> int:
        """SGD steps a FedAvg client with `n` training samples takes in one round."""
        t = self.env.train
        if t.local_steps is not None:
            return t.local_steps if n else 0
        return t.local_epochs * -(-n // t.batch_size)

    def global_model(self, state: ServerState) -> FedModel:
        return self.load_model(state["model"], self.env.device)

    def report(self, state: ServerState) -> dict[str, Any]:
        return {"reference": NOTE, "federated": False,
                "pooled_train_samples": int(sum(len(y) for y in state["pool_y"].values()))}

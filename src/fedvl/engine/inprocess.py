"""The in-process transport: every client lives in this process, messages are copied."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedvl.algorithms.base import Algorithm, ClientContext, ServerState
from fedvl.core.message import Message
from fedvl.core.training import evaluate
from fedvl.data.federated import FederatedDataset
from fedvl.engine.driver import SHARE_STREAM, Exchange, Inboxes, client_generator


class InProcessTransport:
    """Runs each client's half in this process, in sampled order, on copies of the messages."""

    def __init__(self, algorithm: Algorithm, fed: FederatedDataset, seed: int,
                 device: torch.device) -> None:
        self.alg, self.fed, self.seed, self.device = algorithm, fed, seed, device
        self.num_clients = len(fed.clients)
        self.names = list(fed.client_names)
        self.client_states: dict[int, Message] = {i: Message() for i in range(self.num_clients)}
        self.data = [
            (c.x_train.to(device), c.y_train.to(device), c.x_test.to(device), c.y_test.to(device))
            for c in fed.clients
        ]
        self.real = [
            (c.x_real.to(device), c.y_real.to(device))
            if c.x_real is not None and c.y_real is not None else (None, None)
            for c in fed.clients
        ]

    def context(self, cid: int, rnd: int, inbox: dict[int, Message] | None = None,
                stream: int = 2) -> ClientContext:
        """The ClientContext of client `cid` in round `rnd` (with its peers' messages)."""
        x, y, _, _ = self.data[cid]
        return ClientContext(cid=cid, name=self.fed.clients[cid].name, x=x, y=y,
                             num_classes=self.fed.num_classes, state=self.client_states[cid],
                             generator=client_generator(self.seed, rnd, cid, stream), round=rnd,
                             device=self.device, x_real=self.real[cid][0],
                             y_real=self.real[cid][1], inbox=inbox or {})

    def ready(self, rnd: int, clients: list[int]) -> bool:
        """In-process clients are always there."""
        return True

    def share(self, rnd: int, peers: dict[int, list[int]]) -> dict[int, dict[int, Message]]:
        """Each sampled client's `share` step, on copies of what it sends."""
        return {c: {r: m.copy() for r, m in self.alg.share(
                    self.context(c, rnd, stream=SHARE_STREAM), p).items()}
                for c, p in peers.items()}

    def exchange(self, rnd: int, outgoing: dict[int, Message],
                 inboxes: Inboxes | None = None) -> Exchange:
        """Each client's `client_update`, one after another in sampled order."""
        replies: dict[int, Message] = {}
        for cid, msg in outgoing.items():
            # A copy stands in for the network hop: no half can alias the other's tensors.
            inbox = {s: m.copy() for s, m in (inboxes or {}).get(cid, {}).items()}
            reply = self.alg.client_update(msg.copy(), self.context(cid, rnd, inbox))
            replies[cid] = reply.copy()
        return Exchange(delivered=list(outgoing), replies=replies)

    def evaluate(self, rnd: int, state: ServerState) -> dict[str, Any]:
        """Per-client accuracy/loss of the global model, or of each client's own model."""
        names = self.fed.client_names
        out: dict[str, Any] = {}
        model = self.alg.global_model(state)
        if model is not None:
            acc, loss = {}, {}
            for name, (_, _, xt, yt) in zip(names, self.data, strict=True):
                acc[name], loss[name] = evaluate(model, xt, yt)
            out["per_client_accuracy"], out["per_client_loss"] = acc, loss
            if self.fed.global_test is not None:
                xg, yg = (t.to(self.device) for t in self.fed.global_test)
                out["global_test_accuracy"] = evaluate(model, xg, yg)[0]
        else:
            # Personalised: client k's model on its own test (local) and on everyone's (global).
            cross = np.zeros((len(names), len(names)))
            loss = {}
            for i in range(len(names)):
                m = self.alg.client_model(self.context(i, rnd))
                for j, (_, _, xt, yt) in enumerate(self.data):
                    cross[i, j], lj = evaluate(m, xt, yt)
                    if i == j:
                        loss[names[i]] = lj
            out["per_client_accuracy"] = {n: float(cross[i, i]) for i, n in enumerate(names)}
            out["per_client_loss"] = loss
            out["global_accuracy"] = {n: float(cross[i].mean()) for i, n in enumerate(names)}
            out["cross_accuracy"] = cross.tolist()
            out["mean_global_accuracy"] = float(cross.mean())
            if len(names) > 1:
                # Inter: on every *other* client's test set (DESA's "global" accuracy).
                others = ~np.eye(len(names), dtype=bool)
                inter = {n: float(cross[i][others[i]].mean()) for i, n in enumerate(names)}
                out["inter_accuracy"] = inter
                out["mean_inter_accuracy"] = float(np.mean(list(inter.values())))
            out["worst_accuracy"] = float(min(out["per_client_accuracy"].values()))
        out["mean_accuracy"] = float(np.mean(list(out["per_client_accuracy"].values())))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Client states go into the checkpoint: here the server process holds them."""
        return {"client_states": {i: (m.arrays, m.meta) for i, m in self.client_states.items()}}

    def load_state_dict(self, ck: dict[str, Any]) -> None:
        """Restore the client states of a checkpoint."""
        self.client_states = {int(i): Message(a, m) for i, (a, m) in ck["client_states"].items()}

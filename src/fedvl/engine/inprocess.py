"""The in-process transport: every client lives in this process, messages are copied.

Clients of a round run on a `ClientPool` (`--workers`), one torch thread each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedvl.algorithms.base import Algorithm, ClientContext, ServerState
from fedvl.core.audit import DEFAULT_GUARD, Audit, UploadGuard, screenable, with_audit
from fedvl.core.message import Message, copy_reply
from fedvl.core.training import evaluate, mean_accuracy
from fedvl.data.federated import FederatedDataset
from fedvl.data.transforms import PixelImages
from fedvl.engine.driver import SHARE_STREAM, Exchange, Inboxes, client_generator
from fedvl.engine.holdout import holdout_scores
from fedvl.engine.workers import ClientPool
from fedvl.models.base import FedModel
from fedvl.progress import Ticker, emit, scope
from fedvl.timing import accumulating, with_timing


class InProcessTransport:
    """Runs each client's half in this process, on copies of the messages, `workers` at once."""

    def __init__(self, algorithm: Algorithm, fed: FederatedDataset, seed: int,
                 device: torch.device, workers: int = 1, stack: bool = False,
                 upload_guard: float = DEFAULT_GUARD) -> None:
        self.alg, self.fed, self.seed, self.device = algorithm, fed, seed, device
        self.pool = ClientPool(workers)
        # `--stack-clients`: a method that can train its clients as one vectorised model does.
        self.stack = stack and algorithm.stack_ready()
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
        # Every message a client sends is audited against its private images before it leaves.
        self.guard = UploadGuard(fed.image_shape, upload_guard, algorithm.upload_exemption())
        # Each client's `share` step this round (what it sent, its seconds), told in its reply.
        self.shared_audit: dict[int, Audit | None] = {}
        self.shared_seconds: dict[int, dict[str, float]] = {}

    def private_images(self, cid: int) -> torch.Tensor:
        """The images client `cid` must not send: its real training images."""
        x_real = self.real[cid][0]
        return x_real if x_real is not None else self.data[cid][0]

    def screened(self, cid: int, msg: Message) -> tuple[Message, Audit | None]:
        """`msg` as client `cid`'s upload guard lets it go, and its audit."""
        return self.guard.screen(msg, self.private_images(cid), self.names[cid])

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

    def train_size(self, cid: int) -> int | None:
        """Client `cid`'s training-set size, from the federated dataset (the larger of its
        training set and, under `--local-data virtual`, the raw data kept beside it)."""
        c = self.fed.clients[cid]
        return max(c.num_train, 0 if c.y_real is None else int(c.y_real.shape[0]))

    def share(self, rnd: int, peers: dict[int, list[int]]) -> dict[int, dict[int, Message]]:
        """Each sampled client's `share` step, on copies of what it sends."""
        def share(c: int) -> dict[int, Message]:
            with accumulating() as acc:
                sent = self.alg.share(self.context(c, rnd, stream=SHARE_STREAM), peers[c])
                if not isinstance(sent, Mapping):   # the driver's check rejects it
                    return sent
                out, self.shared_audit[c] = self.guard.screen_peers(sent, self.private_images(c),
                                                                    self.names[c])
            self.shared_seconds[c] = acc.meta()
            return {r: copy_reply(m) for r, m in out.items()}
        self.shared_audit, self.shared_seconds = {}, {}
        return self.pool.map(share, peers)

    def exchange(self, rnd: int, outgoing: dict[int, Message],
                 inboxes: Inboxes | None = None) -> Exchange:
        """Each client's `client_update` on the pool (or all together, stacked); replies in
        sampled order."""
        if self.stack and not inboxes and len(outgoing) > 1:
            with accumulating() as acc:
                items = [(outgoing[c].copy(), self.context(c, rnd)) for c in outgoing]
                stacked = self.alg.client_update_stacked(items)
                replies = {c: self.upload(c, r) for c, r in zip(outgoing, stacked, strict=True)}
            # One computation for all: each client reports an equal part of its seconds.
            part = {k: v / len(replies) for k, v in acc.meta().items()}
            return Exchange(delivered=list(outgoing),
                            replies={c: with_timing(r, part) for c, r in replies.items()})

        done = Ticker("clients", len(outgoing))
        done.start()

        def update(cid: int) -> Message:
            # A copy stands in for the network hop: no half can alias the other's tensors.
            inbox = {s: m.copy() for s, m in (inboxes or {}).get(cid, {}).items()}
            # Progress events of this client's work (distillation steps) name it.
            with scope(client=self.names[cid], client_id=cid, num_clients=self.num_clients,
                       phase="train"), accumulating() as acc:
                emit()
                reply = self.upload(cid, self.alg.client_update(outgoing[cid].copy(),
                                                                self.context(cid, rnd, inbox)))
            done.tick()
            # The client's seconds (its `share` step's too) travel with its reply, as on Flower.
            return with_timing(reply, acc.meta(), self.shared_seconds.get(cid))
        return Exchange(delivered=list(outgoing), replies=self.pool.map(update, outgoing))

    def upload(self, cid: int, reply: Message) -> Message:
        """Client `cid`'s reply as it leaves the client: screened by its upload guard, with the
        round's audit (its peer messages' too) in the metadata, copied."""
        if not screenable(reply):
            # Not a message the guard can read: it travels as sent, the server's check rejects it.
            return copy_reply(reply)
        reply, audit = self.screened(cid, reply)
        shared = self.shared_audit.get(cid)
        audit = audit.merge(shared) if audit is not None else shared
        return with_audit(reply.copy(), audit)

    def evaluate(self, rnd: int, state: ServerState) -> dict[str, Any]:
        """Per-client accuracy/loss of the global model, or of each client's own model."""
        names = self.fed.client_names
        out: dict[str, Any] = {}
        model = self.alg.global_model(state)
        if model is not None and not self.alg.local_layers:
            model.eval()  # shared read-only by the pool's threads
            ticks = Ticker("evaluate", len(names))

            def score(i: int) -> tuple[float, float]:
                out = evaluate(model, *self.data[i][2:])
                ticks.tick()
                return out
            scores = self.pool.map(score, range(len(names)))
            out["per_client_accuracy"] = {names[i]: a for i, (a, _) in scores.items()}
            out["per_client_loss"] = {names[i]: lo for i, (_, lo) in scores.items()}
            if self.fed.global_test is not None:
                xg, yg = (t.to(self.device) for t in self.fed.global_test)
                out["global_test_accuracy"] = self._split_accuracy(model, xg, yg)
        else:
            # Personalised: client k's model on its own test (local) and on everyone's (global);
            # with local layers, client k's model is the global one with its own layers.
            ticks = Ticker("evaluate", len(names))

            def row(i: int) -> list[tuple[float, float]]:
                m = self._own_model(model, i, rnd)
                out = [evaluate(m, xt, yt) for _, _, xt, yt in self.data]
                ticks.tick()
                return out
            rows = self.pool.map(row, range(len(names)))
            cross = np.array([[a for a, _ in rows[i]] for i in range(len(names))])
            loss = {n: rows[i][i][1] for i, n in enumerate(names)}
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
        out["mean_accuracy"] = mean_accuracy(out["per_client_accuracy"].values())
        if self.fed.holdout:
            # With local layers (FedBN) a newcomer has none of its own: it is personalised.
            shared = model if model is not None and not self.alg.local_layers else None
            own = [] if shared is not None else [self._own_model(model, i, rnd)
                                                 for i in range(len(names))]
            out.update(holdout_scores(self.fed.holdout, shared, own, self.alg.env.train,
                                      self.seed, rnd, names, self.device))
        return out

    def _own_model(self, model: FedModel | None, i: int, rnd: int) -> FedModel | None:
        """Client i's own model: its personal one, or the global one with its local layers."""
        ctx = self.context(i, rnd)
        return self.alg.client_model(ctx) if model is None else self.alg.personalise(model, ctx)

    def _split_accuracy(self, model: FedModel, x: torch.Tensor | PixelImages, y: torch.Tensor
                        ) -> float:
        """`model`'s accuracy on (x, y), its rows split over the pool's workers."""
        # Pieces of whole 256-row batches: each worker runs evaluate's own batches.
        step = -(-len(y) // (self.pool.workers * 256)) * 256
        starts = range(0, len(y), step)

        def piece(i: int) -> float:
            # A PixelImages piece stays uint8: slicing one would convert all its rows at once.
            xi = x.rows(i, i + step) if isinstance(x, PixelImages) else x[i:i + step]
            return evaluate(model, xi, y[i:i + step])[0]  # type: ignore[arg-type]

        accs = self.pool.map(piece, starts)
        # Accuracy times rows is a whole count (to float rounding), so the sum is exact.
        correct = sum(round(a * len(y[i:i + step])) for i, a in accs.items())
        return correct / len(y)

    def state_dict(self) -> dict[str, Any]:
        """Client states go into the checkpoint: here the server process holds them."""
        return {"client_states": {i: (m.arrays, m.meta) for i, m in self.client_states.items()}}

    def load_state_dict(self, ck: dict[str, Any]) -> None:
        """Restore the client states of a checkpoint."""
        self.client_states = {int(i): Message(a, m) for i, (a, m) in ck["client_states"].items()}

"""Peer topology: clients address messages to their neighbours; the engine delivers them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fedvl.algorithms.base import (
    Algorithm,
    ClientContext,
    ServerContext,
    ServerState,
    neighbourhood,
)
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.training import local_train
from fedvl.models.base import FedModel
from fedvl.registry import ALGORITHMS
from fedvl.run.experiment import run_experiment


class Gossip(Algorithm):
    """Decentralised averaging: send my weights to my peers, average mine with theirs, train."""

    personalized = True
    topology = "peer"
    payload_kinds = {"peer": frozenset({"weights"})}

    @dataclass
    class Params:
        neighbourhood: str = "all"
        k: int = 1

    def server_init(self) -> ServerState:
        return {"inboxes": {}}

    def configure(self, state, ctx, clients):
        return {c: Message() for c in clients}

    def neighbours(self, cid: int, sampled: list[int], ctx: ServerContext) -> list[int]:
        return neighbourhood(self.p.neighbourhood, cid, sampled, self.p.k, ctx.seed, ctx.round)

    def share(self, client: ClientContext, peers: list[int]) -> dict[int, Message]:
        w = clone_state(self.client_model(client).state_dict())
        return {p: Message({"weights": w}) for p in peers}

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        model = self.client_model(client)
        if client.inbox:
            own = model.state_dict()
            parts = [own] + [m.get("weights") for m in client.inbox.values()]
            model.load_state_dict({k: sum(p[k] for p in parts) / len(parts) for k in own})
        stats = local_train(model, client.x, client.y, self.env.train, client.generator)
        client.state.arrays["weights"] = clone_state(model.state_dict())
        return Message(meta={"num_examples": client.num_train, "train_loss": stats.mean_loss,
                             "inbox": sorted(client.inbox)})

    def aggregate(self, state, ctx, replies):
        seen = dict(state["inboxes"])
        seen[ctx.round] = {c: list(r.meta["inbox"]) for c, r in replies.items()}
        return {"inboxes": seen}

    def client_model(self, client: ClientContext) -> FedModel:
        model = self.client_new_model(client.cid).to(client.device)
        w = client.state.arrays.get("weights")
        if w is not None:
            model.load_state_dict(w)
        return model


@pytest.fixture
def gossip():
    ALGORITHMS.register("test-gossip")(Gossip)
    yield "test-gossip"
    ALGORITHMS._items.pop("test-gossip", None)


def _cfg(**kw) -> RunConfig:
    base = {"method": "test-gossip", "benchmark": "digits-offline", "train_cap": 40,
            "test_cap": 20, "rounds": 3, "batch_size": 16, "momentum": 0.0, "client_ratio": 0.8,
            "model_args": {"width": 8, "depth": 2, "norm": "instance"}}
    return RunConfig(**{**base, **kw})


def test_neighbourhoods():
    s = [0, 2, 3, 7]
    assert neighbourhood("all", 2, s) == [0, 3, 7]
    assert neighbourhood("ring", 0, s) == [2, 7] and neighbourhood("ring", 3, s) == [2, 7]
    r = neighbourhood("random", 3, s, k=2, seed=1, rnd=4)
    assert len(r) == 2 and 3 not in r and set(r) <= set(s)
    assert r == neighbourhood("random", 3, s, k=2, seed=1, rnd=4)
    with pytest.raises(ValueError, match="allowed: all, full, ring, random"):
        neighbourhood("star", 0, s)


def test_peer_messages_reach_exactly_the_neighbours_and_are_counted_once(gossip, tmp_path):
    out = run_experiment(_cfg(method_args={"neighbourhood": "ring"}), out=tmp_path / "r")
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    from fedvl.engine.driver import sample_clients

    n_params = None
    for rnd, got in ck["server_state"]["inboxes"].items():
        sampled = sample_clients(5, 0.8, 0, rnd)
        for c, senders in got.items():
            assert senders == neighbourhood("ring", c, sampled), (rnd, c)
        n_params = n_params or sum(t.numel() * t.element_size() for t in
                                   ck["client_states"][c][0]["weights"].values())
    sends = sum(len(neighbourhood("ring", c, sample_clients(5, 0.8, 0, r)))
                for r in range(3) for c in sample_clients(5, 0.8, 0, r))
    assert out["bytes_peer"] == sends * n_params
    assert out["bytes_by_kind"]["weights"] == {"up": 0, "down": 0, "peer": sends * n_params}
    assert out["bytes_up"] == out["bytes_down"] == 0


def test_addressing_a_non_neighbour_is_refused(gossip, tmp_path, monkeypatch):
    """A peer message to a client outside the sender's neighbours is not delivered: it is a
    rejection recorded under `rejected_peer` (a hostile client cannot crash the server)."""
    monkeypatch.setattr(Gossip, "share", lambda self, client, peers: {
        (client.cid + 1) % 5: Message()} if client.cid == 0 else {})
    out = run_experiment(_cfg(method_args={"neighbourhood": "random", "k": 1}, seed=3),
                         out=tmp_path / "r")
    peer = [r for r in out["rejected_replies"] if r.get("peer")]
    assert peer and all("is not among" in r["reason"] for r in peer)


def test_star_runs_have_no_peer_entries(tmp_path):
    out = run_experiment(_cfg(method="fedavg", rounds=1), out=tmp_path / "r")
    assert "bytes_peer" not in out and all("peer" not in v for v in out["bytes_by_kind"].values())


def test_flower_relays_peer_messages_unchanged(gossip, tmp_path):
    pytest.importorskip("flwr")
    from tests.conftest import FakeGrid, run_on_grid

    cfg = _cfg(method_args={"neighbourhood": "random", "k": 2}, threads=1)
    embedded = run_experiment(cfg, out=tmp_path / "embedded")
    flower = run_on_grid(FakeGrid(5), cfg, tmp_path, name="flower")
    for key in ("per_client_accuracy", "per_client_loss", "bytes_peer", "bytes_by_kind"):
        assert flower[key] == embedded[key], key

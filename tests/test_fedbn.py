"""FedBN: BatchNorm layers never leave a client, the rest is averaged as FedAvg averages it,
and each client is evaluated with its own BatchNorm layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.config import ConfigError
from fedvl.core.message import Message
from fedvl.core.params import batch_norm_keys
from fedvl.core.training import evaluate
from fedvl.engine.inprocess import InProcessTransport
from fedvl.registry import ALGORITHMS
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation, small_cfg

# The tiny BatchNorm ConvNet's BatchNorm entries (two blocks: layers 1 and 5).
BN = {f"features.{i}.{k}" for i in (1, 5)
      for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=24, n_test=12)


def _spied_run(name, fed, tmp_path, monkeypatch, rounds=2):
    """Run `name` on every client each round; (messages down, replies up, summary)."""
    down, up = [], []
    original = InProcessTransport.exchange

    def spy(self, rnd, outgoing, inboxes=None):
        down.extend(outgoing.values())
        ex = original(self, rnd, outgoing, inboxes)
        up.extend(ex.replies.values())
        return ex

    monkeypatch.setattr(InProcessTransport, "exchange", spy)
    cfg = dataclasses.replace(small_cfg(name, rounds=rounds), client_ratio=1.0)
    return down, up, run_experiment(cfg, out=tmp_path / "r", fed=fed)


@pytest.mark.parametrize("name", ["fedbn", "scaffold+fedbn"])
def test_batch_norm_entries_never_leave_a_client(name, fed, tmp_path, monkeypatch):
    down, up, summary = _spied_run(name, fed, tmp_path, monkeypatch)
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    every = set(ck["server_state"]["model"])
    assert BN < every and len(down) == len(up) == 6
    for msg in down + up:
        names = {n for tensors in msg.arrays.values() for n in tensors}
        assert not names & BN, names & BN
        assert set(msg.arrays["weights"]) == every - BN   # every shared entry travels
    if name == "scaffold+fedbn":
        assert all("control_variates" in m.arrays for m in down + up)
    # Each client keeps exactly its BatchNorm entries, and they moved away from the start.
    init = make_algorithm(name, build_env(small_cfg(name), fed, torch.device("cpu")))
    start = init.new_model().state_dict()
    for cid, (arrays, _) in ck["client_states"].items():
        assert set(arrays["weights"]) == BN, cid
        assert not torch.equal(arrays["weights"]["features.1.running_mean"],
                               start["features.1.running_mean"]), cid
    # The server's copy of the BatchNorm entries is the initial model's, unchanged.
    for k in BN:
        assert torch.equal(ck["server_state"]["model"][k], start[k]), k
    assert summary["rejected_replies"] == []


def test_shared_entries_are_averaged_exactly_as_fedavg_averages_them(fed):
    env = build_env(small_cfg("fedbn"), fed, torch.device("cpu"))
    fedbn, fedavg = make_algorithm("fedbn", env), make_algorithm("fedavg", env)
    state = fedbn.server_init()
    g = torch.Generator().manual_seed(3)
    full = {c: {k: (torch.randn(v.shape, generator=g) if v.is_floating_point() else v + c)
                for k, v in state["model"].items()} for c in (0, 1)}
    sizes = {0: 10, 1: 30}
    shared = {c: Message({"weights": {k: v for k, v in w.items() if k not in BN}},
                         {"num_examples": sizes[c], "steps": 1}) for c, w in full.items()}
    got = fedbn.aggregate(state, ServerContext(0), shared)["model"]
    avg = fedavg.aggregate(fedavg.server_init(), ServerContext(0),
                           {c: Message({"weights": w}, {"num_examples": sizes[c], "steps": 1})
                            for c, w in full.items()})["model"]
    for k, v in got.items():
        if k in BN:
            assert torch.equal(v, state["model"][k]), k   # never moved by the clients
        else:
            assert torch.equal(v, avg[k]), k
            # By hand: (10 w_0 + 30 w_1) / 40.
            torch.testing.assert_close(v, 0.25 * full[0][k] + 0.75 * full[1][k])


def test_each_client_is_evaluated_with_its_own_batch_norm(fed, tmp_path):
    cfg = dataclasses.replace(small_cfg("fedbn", rounds=2), client_ratio=1.0)
    summary = run_experiment(cfg, out=tmp_path / "r", fed=fed)
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    alg = make_algorithm("fedbn", build_env(cfg, fed, torch.device("cpu")))
    states = {int(c): arrays["weights"] for c, (arrays, _) in ck["client_states"].items()}
    # Two clients trained on different data end with different statistics.
    assert not torch.allclose(states[0]["features.1.running_var"],
                              states[1]["features.1.running_var"])
    glob = alg.global_model(ck["server_state"])
    for cid, c in enumerate(fed.clients):
        ctx = ClientContext(cid, c.name, c.x_train, c.y_train, fed.num_classes,
                            Message({"weights": states[cid]}), torch.Generator(), 2)
        mine = alg.personalise(glob, ctx)
        for k, v in mine.state_dict().items():
            want = states[cid][k] if k in BN else ck["server_state"]["model"][k]
            assert torch.equal(v, want), (cid, k)
        acc, _ = evaluate(mine, c.x_test, c.y_test)
        assert summary["per_client_accuracy"][c.name] == acc
    # The personalised report: own test set, everyone's, the others'.
    assert {"cross_accuracy", "inter_accuracy", "worst_accuracy"} <= set(summary)


@pytest.mark.parametrize("model_args, method_args, message", [
    ({"norm": "instance"}, {}, r"no BatchNorm layer; run it with --norm batch"),
    ({"norm": "batch"}, {"dp_noise": 1.0}, r"DP-SGD cannot train a network with BatchNorm"),
])
def test_refusals_name_the_fix(model_args, method_args, message, fed, tmp_path):
    cfg = small_cfg("fedbn")
    cfg = dataclasses.replace(cfg, model_args={**cfg.model_args, **model_args},
                              method_args=method_args)
    with pytest.raises(ConfigError, match=message):
        run_experiment(cfg, out=tmp_path / "r", fed=fed)


def test_composes_only_with_bases_that_exchange_model_states():
    for name in ("fedbn", "fedprox+fedbn", "scaffold+fedbn", "fednova+fedbn", "feddyn+fedbn"):
        assert name in ALGORITHMS, name
    # MOON's projection-head model, FedGen's generator, VHL's add-on slot: not composable.
    for name in ("moon+fedbn", "fedgen+fedbn", "vhl+fedbn"):
        assert name not in ALGORITHMS, name


def test_batch_norm_keys_are_chosen_by_layer_type():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                    torch.nn.BatchNorm1d(4, affine=False)))
    assert batch_norm_keys(model) == {
        "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked",
        "2.1.running_mean", "2.1.running_var", "2.1.num_batches_tracked"}

"""Clients on concurrent workers give the numbers of clients one after another.

Every method (each add-on on FedAvg, and one other composition) runs two rounds on a tiny
federation with `--workers 1` and again with `--workers 3` (the server's work on two torch
threads in both): per-round accuracy, loss and bytes must be identical (tolerance 0). A client
trains on one torch thread whichever worker runs it, and every draw from torch's global RNG
(layer initialisers) holds one lock.
The pool itself: results in input order, the first error stops it, no thread survives.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch

from fedvl.engine.threads import default_workers
from fedvl.engine.workers import ClientPool
from fedvl.run.experiment import resume_experiment, run_experiment
from tests.conftest import COMPOSED, METHODS, make_toy_federation, small_cfg

pytestmark = pytest.mark.slow(seconds=18)

KEYS = ("sampled", "participants", "train_loss", "per_client_accuracy", "per_client_loss",
        "mean_accuracy", "round_bytes_up", "round_bytes_down", "round_bytes_peer",
        "cross_accuracy")


def _client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fedvl-client")]


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=4, n_train=24, n_test=12)


# Methods whose client half is another's, unchanged (a subclass that adds server work only):
# the other's row already runs that client on workers.
SAME_CLIENT = {"coboosting": "dense"}


# One BASE+ADDON composition besides: composed classes run on workers too.
@pytest.mark.parametrize("name", [*(m for m in METHODS if m not in SAME_CLIENT), *COMPOSED[:1]])
def test_workers_give_the_sequential_numbers(name, fed, tmp_path) -> None:
    # The server's work (aggregation, server-side training) runs on two threads in both runs.
    # Two rounds: the second starts from state the first left (client state, FedLGD's
    # refresh, FedGAN's synthetic samples all begin in round 1).
    cfg = dataclasses.replace(small_cfg(name, rounds=2), client_ratio=1.0, threads=2)
    one = run_experiment(dataclasses.replace(cfg, workers=1), out=tmp_path / "w1", fed=fed)
    three = run_experiment(dataclasses.replace(cfg, workers=3), out=tmp_path / "w3", fed=fed)
    assert one["workers"] == 1 and three["workers"] == 3
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").open()]
            for d in ("w1", "w3")]
    for a, b in zip(*rows, strict=True):
        for k in KEYS:
            assert a.get(k) == b.get(k), (name, a["round"], k)
    for k in ("per_client_accuracy", "per_client_loss", "accuracy_curve", "bytes_up",
              "bytes_down"):
        assert one.get(k) == three.get(k), (name, k)
    assert not _client_threads()


def test_methods_skipped_above_run_the_client_of_the_one_they_name() -> None:
    from fedvl.registry import ALGORITHMS

    for name, other in SAME_CLIENT.items():
        a, b = ALGORITHMS.get(name), ALGORITHMS.get(other)
        assert issubclass(a, b) and a.client_update is b.client_update, name


# FedProx and FedNova run FedAvg's DP-SGD loop with additions that draw nothing (a proximal
# gradient, a step count); SCAFFOLD's correction enters every step.
@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_workers_give_the_sequential_numbers_with_dp_sgd(name, fed, tmp_path) -> None:
    # DP-SGD draws its Poisson batches and noise from each client's own generator.
    cfg = dataclasses.replace(small_cfg(name, rounds=2), client_ratio=1.0, threads=2,
                              method_args={"dp_noise": 0.8, "dp_clip": 1.0})
    one = run_experiment(dataclasses.replace(cfg, workers=1), out=tmp_path / "w1", fed=fed)
    three = run_experiment(dataclasses.replace(cfg, workers=3), out=tmp_path / "w3", fed=fed)
    for k in ("per_client_accuracy", "per_client_loss", "accuracy_curve", "privacy"):
        assert one.get(k) == three.get(k), (name, k)
    assert one["privacy"]["epsilon"]
    assert not _client_threads()


def test_pool_keeps_input_order_and_pins_one_thread() -> None:
    pool = ClientPool(3)
    try:
        def work(k: int) -> tuple[int, int]:
            time.sleep(0.01 * (5 - k))   # later keys finish first
            return k, torch.get_num_threads()
        out = pool.map(work, range(5))
    finally:
        pool.close()
    assert list(out) == list(range(5))
    assert all(v == (k, 1) for k, v in out.items())
    assert not _client_threads()


def test_pool_stops_on_the_first_error_and_leaves_no_thread() -> None:
    pool = ClientPool(2)
    started: list[int] = []

    def work(k: int) -> int:
        started.append(k)
        if k == 0:
            raise KeyboardInterrupt   # what Ctrl-C raises inside a client
        time.sleep(0.05)
        return k
    with pytest.raises(KeyboardInterrupt):
        pool.map(work, range(20))
    pool.close()
    assert len(started) < 20     # the queued clients never started
    assert not _client_threads()


def test_a_failing_client_fails_the_run_and_stops_the_threads(tmp_path, monkeypatch) -> None:
    from fedvl.algorithms.fedavg import FedAvg

    fed = make_toy_federation(num_clients=4, n_train=24, n_test=12)

    def broken(self, msg, ctx):
        raise RuntimeError(f"client {ctx.cid} failed")
    monkeypatch.setattr(FedAvg, "client_update", broken)
    with pytest.raises(RuntimeError, match="client [0-3] failed") as info:
        run_experiment(dataclasses.replace(small_cfg("fedavg"), workers=2), out=tmp_path / "r",
                       fed=fed)
    # The error names the client whose task raised it.
    assert any("raised by the task of client" in n for n in info.value.__notes__)
    assert not _client_threads()


def test_default_workers() -> None:
    assert default_workers("cpu", cores=8) == 8
    assert default_workers("cuda:0", cores=8) == 1
    with pytest.raises(ValueError, match="workers must be >= 1"):
        ClientPool(0)


def test_a_client_failing_on_a_worker_leaves_a_resumable_checkpoint(tmp_path, monkeypatch):
    from fedvl.algorithms.scaffold import Scaffold
    from fedvl.run import assemble

    fed = make_toy_federation(num_clients=4, n_train=24, n_test=12)
    cfg = dataclasses.replace(small_cfg("scaffold"), workers=2, rounds=3)
    full = run_experiment(cfg, out=tmp_path / "full", fed=fed)
    original = Scaffold.client_update

    def dies_in_the_second_round(self, msg, ctx):
        if ctx.round == 1:
            raise RuntimeError("worker lost")
        return original(self, msg, ctx)
    monkeypatch.setattr(Scaffold, "client_update", dies_in_the_second_round)
    with pytest.raises(RuntimeError, match="worker lost") as info:
        run_experiment(cfg, out=tmp_path / "cut", fed=fed)
    assert any("raised by the task of client" in n for n in info.value.__notes__)
    assert not _client_threads()
    monkeypatch.setattr(Scaffold, "client_update", original)
    monkeypatch.setattr(assemble, "build_federation", lambda c: fed)
    # The stateful clients' control variates come back from the checkpoint: same numbers.
    resumed = resume_experiment(tmp_path / "cut")
    assert resumed["per_client_accuracy"] == full["per_client_accuracy"]
    assert resumed["per_client_loss"] == full["per_client_loss"]

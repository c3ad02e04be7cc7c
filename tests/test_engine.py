"""Engine guarantees: determinism, resume, run-directory outputs, sampling."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fedvl.algorithms.base import ServerContext
from fedvl.core.message import Message, MessageError
from fedvl.engine.simulation import sample_clients
from fedvl.run.experiment import resume_experiment, run_experiment
from tests.conftest import make_toy_federation, small_cfg


def test_same_config_and_seed_same_numbers(tiny_cfg, toy_fed, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, client_ratio=0.67)
    a = run_experiment(cfg, out=tmp_path / "a", fed=toy_fed)
    b = run_experiment(cfg, out=tmp_path / "b", fed=toy_fed)
    assert a["per_client_accuracy"] == b["per_client_accuracy"]
    assert a["per_client_loss"] == b["per_client_loss"]
    c = run_experiment(dataclasses.replace(cfg, seed=1), out=tmp_path / "c", fed=toy_fed)
    assert c["per_client_loss"] != a["per_client_loss"]


def test_run_directory_contents(tiny_cfg, toy_fed, tmp_path):
    s = run_experiment(tiny_cfg, out=tmp_path / "r", fed=toy_fed)
    files = {p.name for p in (tmp_path / "r").iterdir()}
    assert {"config.yaml", "metrics.jsonl", "summary.json", "checkpoint.pt"} <= files
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    for key in ("method", "benchmark", "seed", "rounds", "per_client_accuracy", "mean_accuracy",
                "bytes_up", "bytes_down", "bytes_by_kind", "wall_seconds"):
        assert key in summary
    accs = summary["per_client_accuracy"].values()
    assert all(0.0 <= a <= 1.0 for a in accs)
    assert summary["mean_accuracy"] == pytest.approx(sum(accs) / len(accs))
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [0, 1, 2]
    assert s["rounds"] == 3


@pytest.mark.parametrize("method", ["fedavg", "scaffold", "moon", "fedadam"])
def test_resume_matches_uninterrupted(method, tiny_cfg, toy_fed, tmp_path, monkeypatch):
    cfg = dataclasses.replace(tiny_cfg, method=method, rounds=4, client_ratio=0.67)
    full = run_experiment(cfg, out=tmp_path / "full", fed=toy_fed)

    # Interrupt after round 1 by failing inside round 2, then resume from the directory.
    from fedvl.engine import simulation

    original = simulation.Simulation.run_round

    def crashing(self, rnd):
        if rnd == 2:
            raise KeyboardInterrupt
        return original(self, rnd)

    monkeypatch.setattr(simulation.Simulation, "run_round", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out=tmp_path / "cut", fed=toy_fed)
    monkeypatch.setattr(simulation.Simulation, "run_round", original)
    ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert ck["round"] == 1
    from fedvl.run import assemble

    monkeypatch.setattr(assemble, "build_federation", lambda c: toy_fed)
    resumed = resume_experiment(tmp_path / "cut")
    assert resumed["per_client_accuracy"] == full["per_client_accuracy"]
    assert resumed["per_client_loss"] == full["per_client_loss"]
    assert resumed["bytes_up"] == full["bytes_up"]
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_sampling_deterministic_and_sized():
    a = sample_clients(10, 0.3, seed=0, rnd=5)
    assert a == sample_clients(10, 0.3, seed=0, rnd=5)
    assert len(a) == 3 and len(set(a)) == 3
    assert sample_clients(10, 1.0, 0, 0) == list(range(10))
    rounds = {tuple(sample_clients(10, 0.3, 0, r)) for r in range(20)}
    assert len(rounds) > 5


def test_message_validation_and_bytes():
    m = Message({"weights": {"w": torch.zeros(10)}}, meta={"n": 3})
    assert m.nbytes() == 40 and m.bytes_by_kind() == {"weights": 40}
    with pytest.raises(MessageError, match="unknown payload kind 'blob'"):
        Message({"blob": {"w": torch.zeros(1)}})
    with pytest.raises(MessageError, match="must map a str to a torch.Tensor"):
        Message({"weights": {"w": [1, 2]}})
    with pytest.raises(MessageError, match="meta 'x'"):
        Message(meta={"x": {"nested": 1}})
    c = m.copy()
    c.arrays["weights"]["w"][0] = 1.0
    assert float(m.arrays["weights"]["w"][0]) == 0.0


def test_messages_do_not_alias_client_tensors(tiny_cfg, toy_fed, tmp_path):
    # A client mutating what it received must not change the server's state.
    from fedvl.algorithms.fedavg import FedAvg

    seen = {}
    original = FedAvg.client_update

    def meddling(self, msg, client):
        w = msg.get("weights")
        key = next(iter(w))
        seen["server_before"] = self_state["model"][key].clone()
        w[key].add_(100.0)
        return original(self, msg, client)

    from fedvl.algorithms.base import make_algorithm
    from fedvl.engine.simulation import Simulation, SimulationConfig
    from fedvl.run.assemble import build_env

    alg = make_algorithm("fedavg", build_env(tiny_cfg, toy_fed, torch.device("cpu")))
    sim = Simulation(alg, toy_fed, SimulationConfig(rounds=1))
    sim.state = alg.server_init()
    self_state = sim.state
    FedAvg.client_update = meddling
    try:
        outgoing = alg.configure(sim.state, ServerContext(0), [0])
        alg.client_update(outgoing[0].copy(), sim.context(0, 0))
    finally:
        FedAvg.client_update = original
    key = next(iter(self_state["model"]))
    assert torch.equal(self_state["model"][key], seen["server_before"])


def test_run_directory_files_are_replaced_whole(tmp_path):
    from fedvl.engine.recorder import RunRecorder, atomic_write

    rec = RunRecorder(tmp_path / "r")
    rec.write_summary({"mean_accuracy": 0.5})

    def broken(path):
        path.write_text('{"mean_acc')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "r" / "summary.json", broken)
    assert json.loads((tmp_path / "r" / "summary.json").read_text()) == {"mean_accuracy": 0.5}
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["summary.json"]


def test_thread_count_resolved_recorded_and_restored(tiny_cfg, toy_fed, tmp_path):
    import yaml

    torch.set_num_threads(2)  # the conftest fixture restores its own count afterwards
    s = run_experiment(tiny_cfg, out=tmp_path / "a", fed=toy_fed)
    assert tiny_cfg.threads is None and s["threads"] == 2
    assert yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())["threads"] == 2
    one = run_experiment(dataclasses.replace(tiny_cfg, threads=1), out=tmp_path / "b",
                         fed=toy_fed)
    assert one["threads"] == 1 and torch.get_num_threads() == 2
    assert not [p for p in (tmp_path / "a").iterdir() if ".tmp" in p.name]


def test_truncated_checkpoint_is_one_clear_error_naming_the_file(tmp_path, capsys):
    from fedvl.cli import main

    run = tmp_path / "run"
    args = ["run", "--benchmark", "digits-offline", "--train-cap", "20", "--test-cap", "10",
            "--rounds", "1", "--width", "8", "--depth", "2", "--quiet", "--method", "fedavg"]
    assert main([*args, "--out", str(run)]) == 0
    ck = run / "checkpoint.pt"
    ck.write_bytes(ck.read_bytes()[: ck.stat().st_size // 2])
    assert main(["run", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(ck) in err and "corrupted or truncated" in err and "Traceback" not in err


@pytest.mark.parametrize("method", ["fedavg", "feddm", "fedlgd"])
def test_each_round_says_where_its_time_went(method, toy_fed, tmp_path):
    """Every phase recorded, none negative, all of them (with "other") the round's seconds;
    synthesis only where the method distils (FedLGD's server matching on the server's side)."""
    from fedvl.timing import PHASES

    s = run_experiment(dataclasses.replace(small_cfg(method, rounds=2), client_ratio=1.0,
                                           workers=2),
                       out=tmp_path / "r", fed=toy_fed)
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").open()]
    for row in rows:
        t = row["time_by_phase"]
        assert list(t) == list(PHASES) and min(t.values()) >= 0, t
        assert sum(t.values()) == pytest.approx(row["seconds"], abs=1e-4)
        assert t["client_synthesis"] + t["client_training"] == pytest.approx(
            row["client_seconds"], abs=1e-5)
        assert t["evaluation"] == pytest.approx(row["eval_seconds"], abs=1e-5)
    assert s["round_time_by_phase"] == [{"round": r["round"], **r["time_by_phase"]}
                                        for r in rows]
    total = s["time_by_phase"]
    assert total["client_training"] > 0 and total["server_training"] > 0
    assert (total["client_synthesis"] > 0) == (method != "fedavg")
    assert (total["server_synthesis"] > 0) == (method == "fedlgd")
    summed = s["client_seconds_summed"]
    assert summed["total"] >= summed["synthesis"] and (summed["synthesis"] > 0) == (
        method != "fedavg")


def test_the_first_optimisers_import_is_paid_before_round_0(tmp_path):
    """A fresh process imports torch's compiler front end with its first optimiser (about
    0.8 s); the driver pays it before round 0, so no client's update (and no phase of round 0)
    contains it."""
    import subprocess
    import sys

    code = (
        "import sys, dataclasses\n"
        "from fedvl.algorithms import fedavg\n"
        "from fedvl.run.experiment import run_experiment\n"
        "from tests.conftest import make_toy_federation, small_cfg\n"
        "seen = []\n"
        "update = fedavg.FedAvg.client_update\n"
        "def spy(self, msg, client):\n"
        "    seen.append('torch._dynamo' in sys.modules)\n"
        "    return update(self, msg, client)\n"
        "fedavg.FedAvg.client_update = spy\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "run_experiment(dataclasses.replace(small_cfg('fedavg', rounds=1), client_ratio=1.0),\n"
        f"               out={str(tmp_path / 'r')!r}, fed=make_toy_federation())\n"
        "assert seen and all(seen), seen\n")
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_timed_adds_to_the_task_that_started_it_on_any_worker_thread(monkeypatch):
    """Each pool task's accumulator gets its own `timed` seconds, not its neighbours'; a nested
    block of the same kind counts once; without an accumulator `timed` is a no-op."""
    import itertools
    import time

    from fedvl import timing
    from fedvl.engine.workers import ClientPool
    from fedvl.timing import accumulating, timed

    with timed("synthesis"):   # nothing installed: nothing to add to, no error
        pass

    def task(k: int) -> tuple[float, float]:
        with accumulating() as acc:
            with timed("synthesis"):
                time.sleep(0.05 * k)
            time.sleep(0.01)
        return acc.get("synthesis"), acc.total

    pool = ClientPool(3)
    try:
        got = pool.map(task, [1, 2, 3])
    finally:
        pool.close()
    for k, (syn, total) in got.items():
        # Another task's seconds would add at least 0.15 s.
        assert 0.05 * k <= syn < 0.05 * k + 0.15 and total >= syn + 0.01, (k, syn, total)

    clock = itertools.count()   # each reading one second later
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    with accumulating() as acc, timed("synthesis"), timed("synthesis"):
        pass
    assert acc.get("synthesis") == 1.0 and acc.total == 3.0


def test_client_ratio_changes_which_clients_train(tiny_cfg, tmp_path, monkeypatch):
    from fedvl.algorithms.fedavg import FedAvg

    fed = make_toy_federation(num_clients=10, n_train=16, n_test=8)
    trained: list[tuple[int, int]] = []
    real = FedAvg.client_update

    def spy(self, msg, client):
        trained.append((client.round, client.cid))
        return real(self, msg, client)

    monkeypatch.setattr(FedAvg, "client_update", spy)
    cfg = dataclasses.replace(tiny_cfg, client_ratio=0.2, rounds=6)
    run_experiment(cfg, out=tmp_path / "r", fed=fed)
    rounds = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    chosen = [sample_clients(10, 0.2, cfg.seed, r) for r in range(6)]
    for r, rec in enumerate(rounds):
        # Only the round's sample trains, and it is the one the metrics report.
        assert sorted(c for rr, c in trained if rr == r) == chosen[r] == rec["participants"]
    assert all(len(c) == 2 for c in chosen)
    assert len({tuple(c) for c in chosen}) > 1   # the sample changes from round to round

"""Progress events: what a run reports while it works, and that reporting changes no number."""

from __future__ import annotations

import io
import json
import threading

from fedvl import progress
from fedvl.config import RunConfig
from fedvl.engine.driver import TIMING_KEYS
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation

SMALL = {"ipc": 2, "server_ipc": 2, "warmup_steps": 3, "local_dm_steps": 2,
         "server_gm_steps": 3, "refresh_period": 2, "refresh_count": 1, "batch_real": 4,
         "dsa": False}


def _cfg() -> RunConfig:
    # Two workers: events arrive from two client threads.
    return RunConfig(method="fedlgd", rounds=3, batch_size=8, lr=0.05, momentum=0.0,
                     workers=2, threads=1, model_args={"width": 8, "depth": 2, "norm": "instance"},
                     method_args=dict(SMALL))


def _metrics(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in lines]


def test_fedlgd_reports_steps_and_evaluation_without_changing_numbers(tmp_path, monkeypatch):
    events: list[dict] = []
    inside = threading.Lock()   # the sink is never entered by two threads at once

    def sink(event: dict) -> None:
        assert inside.acquire(blocking=False)
        events.append(dict(event))
        inside.release()

    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache-a"))
    with_cb = run_experiment(_cfg(), out=tmp_path / "a", progress=sink,
                             fed=make_toy_federation())
    # A fresh cache: the second run distils its warm-up sets again instead of loading them.
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache-b"))
    without = run_experiment(_cfg(), out=tmp_path / "b", fed=make_toy_federation())

    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")
    assert with_cb["per_client_accuracy"] == without["per_client_accuracy"]

    def of(phase: str) -> list[dict]:
        return [e for e in events if e["phase"] == phase]

    # Round 0: each client's warm-up distillation, step by step, named by client and round.
    warm = of("distill")
    assert {e["client"] for e in warm} == {"c0", "c1", "c2"}
    assert all(e["round"] == 0 and e["rounds"] == 3 and e["total"] == 3 for e in warm)
    assert sorted(e["step"] for e in warm if e["client"] == "c1") == [1, 2, 3]
    # Round 2: the local refresh; rounds 0 and 2: the server's gradient matching.
    assert {e["round"] for e in of("refresh")} == {2}
    assert {e["round"] for e in of("server_matching")} == {0, 2}
    assert all("client" not in e for e in of("server_matching"))
    # Clients finishing and the evaluation, counted up to their totals, every round.
    for phase in ("clients", "evaluate"):
        for rnd in range(3):
            steps = sorted(e["step"] for e in of(phase) if e["round"] == rnd)
            assert steps == [0, 1, 2, 3], (phase, rnd, steps)
    done = of("round_done")
    assert [e["round"] for e in done] == [0, 1, 2]
    assert done[-1]["mean_accuracy"] == with_cb["mean_accuracy"]


def test_a_failing_callback_does_not_stop_the_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def broken(event: dict) -> None:
        calls.append(event)
        raise RuntimeError("display gone")

    cfg = RunConfig(method="fedavg", rounds=1, batch_size=8, threads=1, workers=1,
                    model_args={"width": 8, "depth": 2, "norm": "instance"})
    summary = run_experiment(cfg, out=tmp_path / "r", progress=broken,
                             fed=make_toy_federation())
    assert "mean_accuracy" in summary and len(calls) == 1
    assert "progress callback raised RuntimeError: display gone" in caplog.text


def test_no_sink_no_events_and_scopes_nest():
    progress.emit("distill", step=1, total=2)   # nobody listens: nothing happens
    got: list[dict] = []
    with progress.reporting(got.append):
        with progress.scope(round=1, rounds=4, phase="distill"):
            with progress.scope(client="mnist", client_id=1, num_clients=5):
                progress.emit(step=40, total=100)
            progress.emit("evaluate", step=2, total=5)
    progress.emit("distill", step=2, total=2)
    assert got == [
        {"round": 1, "rounds": 4, "phase": "distill", "client": "mnist", "client_id": 1,
         "num_clients": 5, "step": 40, "total": 100},
        {"round": 1, "rounds": 4, "phase": "evaluate", "step": 2, "total": 5},
    ]
    assert progress.describe(got[0]) == "round 1/4 · distilling mnist (2/5) · step 40/100"
    assert progress.describe(got[1]) == "round 1/4 · evaluating · 2/5"


def test_status_line_on_a_file_writes_whole_lines_sparsely():
    out = io.StringIO()
    line = progress.StatusLine("distill: ", stream=out, file_interval=3600)
    line({"phase": "synthesis", "step": 1, "total": 9})
    line({"phase": "synthesis", "step": 2, "total": 9})   # within the interval: not shown
    line({"phase": "evaluate", "step": 0, "total": 3})   # a new phase: shown at once
    assert out.getvalue() == "distill: synthesis · step 1/9\ndistill: evaluating · 0/3\n"


TINY_DISTILL = ["distill", "--benchmark", "digits-offline", "--ipc", "1", "--steps", "3",
                "--width", "8", "--depth", "2", "--batch-real", "4", "--eval-epochs", "2",
                "--train-cap", "100", "--test-cap", "40"]


def test_distill_prints_a_table_says_its_budget_and_writes_json(tmp_path, capsys):
    from fedvl.cli import main

    assert main([*TINY_DISTILL, "--out", str(tmp_path / "d")]) == 0
    out, err = capsys.readouterr()
    res = json.loads((tmp_path / "d" / "distill.json").read_text())
    # The default budget: one model per set, distilled and random real only.
    assert res["eval_models"] == 1 and res["accuracy"]["noise"] is None
    assert "1 fresh model(s) x 2 epochs on each of distilled, random_real" in err
    assert "--eval-models 20 --eval-epochs 1000" in err
    assert "distill: synthesis · step 1/3" in err   # progress, not on stdout
    assert "random_real" in out and "1 x 2" in out and "{" not in out
    assert "distill.json" in out


def test_distill_json_flag_prints_the_result_alone(tmp_path, capsys):
    from fedvl.cli import main

    assert main([*TINY_DISTILL, "--quiet", "--json", "--eval-models", "0",
                 "--out", str(tmp_path / "d")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["steps"] == 3
    assert "distill:" not in err   # --quiet: no progress line


def test_heterogeneity_announces_each_part_and_the_distillation_steps(tmp_path, monkeypatch):
    from fedvl.eval import shift
    from fedvl.eval.shift import PARTS, analyse

    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    # The t-SNE itself is the CLI test's (test_heterogeneity.py); here only its announcement.
    monkeypatch.setattr(shift, "_tsne", lambda *a: {})
    cfg = RunConfig(benchmark="digits-offline", train_cap=40, test_cap=10, ipc=2,
                    virtual_steps=3, model_args={"width": 8, "depth": 2, "norm": "instance"})
    events: list[dict] = []
    analyse(cfg, tmp_path / "het", samples=20, tsne_points=20, progress=events.append)
    labels = [e["label"] for e in events
              if e["phase"] == "analysis" and "step" not in e and "elapsed" not in e]
    assert labels == [f"[{i + 1}/{len(PARTS)}] {p}" for i, p in enumerate(PARTS)]
    steps = [e for e in events if e["phase"] == "distill"]
    assert {e["client_id"] for e in steps} == set(range(5))
    assert all(e["label"].endswith("distilling the local virtual sets") for e in steps)
    rows = [e for e in events if e.get("unit") == "client"]
    assert len(rows) == 4 * 5   # four MMD matrices, one event per client row


def test_flower_startup_is_the_time_before_the_first_round_of_this_session():
    from fedvl.flower.simulate import startup_seconds

    # A resumed run: round 0 ended before the simulation started; round 1 began at 130.
    records = [{"round": 0, "time": 50.0, "seconds": 4.0},
               {"round": 1, "time": 135.0, "seconds": 5.0},
               {"round": 2, "time": 140.0, "seconds": 5.0}]
    assert startup_seconds(records, since=100.0) == 30.0
    assert startup_seconds(records[:1], since=100.0) is None


def test_heartbeat_reports_a_silent_call_until_it_returns():
    import time

    got: list[dict] = []
    with progress.reporting(got.append), progress.scope(phase="analysis", label="t-SNE"):
        with progress.heartbeat(every=0.02):
            time.sleep(0.15)
        n = len(got)
        time.sleep(0.05)
    assert n >= 2 and len(got) == n   # nothing once the call is over
    assert all(e["label"] == "t-SNE" and isinstance(e["elapsed"], int) for e in got)
    assert progress.describe({**got[0], "elapsed": 12}) == "t-SNE · 12 s"

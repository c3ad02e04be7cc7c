"""A real Flower deployment on loopback: SuperLink + 3 SuperNodes as separate processes.

Each test starts its own processes on free 127.0.0.1 ports (FLWR_HOME in a tmp dir, no
telemetry, no update check, no runtime dependency installation), submits the fedvl app with
`flwr run`, waits for the run's real final status with `flwr list --run-id ... --format json`
(never trusting an exit code), reads the summary.json the ServerApp wrote, and always tears
every process group down (context manager with try/finally semantics), also on failure.
Every wait is bounded. Per-message cost is dominated by the ClientApp process start
(Flower spawns one `flwr-clientapp` per message; it imports torch), so rounds are few.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("flwr")
if shutil.which("flower-superlink") is None or shutil.which("flower-supernode") is None:
    pytest.skip("flower-superlink/flower-supernode not on PATH", allow_module_level=True)

from fedvl.config import RunConfig  # noqa: E402
from fedvl.flower.deploy import wait_for_run, write_app_dir  # noqa: E402
from fedvl.flower.local_deployment import LocalFederation  # noqa: E402
from fedvl.flower.server_app import ServerOptions  # noqa: E402
from fedvl.run.experiment import run_experiment  # noqa: E402

pytestmark = [pytest.mark.flower, pytest.mark.slow]

DOMAINS = ["handwritten", "printed-clean", "handwritten-thick"]
CFG = RunConfig(method="fedavg", benchmark="digits-offline", domains=DOMAINS, train_cap=60,
                test_cap=30, seed=2, model_args={"width": 8, "depth": 3, "norm": "instance"},
                local_steps=3, batch_size=16, threads=1)
RUN_TIMEOUT = 300.0
ROUND_TIMEOUT = 60.0  # well above a ClientApp's cold start on a loaded 2-core machine


def _submit(fed: LocalFederation, app: Path) -> int:
    from fedvl.flower.deploy import submit

    return submit(app, fed.connection, fed.flwr_home, timeout=120)


def _logs(fed: LocalFederation) -> str:
    return "\n".join(f"--- {n}\n{fed.log(n, 2000)}" for n in
                     ["superlink.log"] + [f"supernode-{i}.log" for i in range(fed.num_nodes)])


def test_deployment_tls_same_numbers(tmp_path: Path) -> None:
    cfg = replace(CFG, rounds=2, eval_every=2)
    run_dir = tmp_path / "run"
    app = write_app_dir(tmp_path / "app", cfg, ServerOptions(out=str(run_dir),
                                                             round_timeout=120,
                                                             join_timeout=120))
    with LocalFederation(tmp_path / "fed", num_nodes=3, tls=True) as fed:
        run_id = _submit(fed, app)
        try:
            row = wait_for_run(run_id, fed.connection, fed.flwr_home, timeout=RUN_TIMEOUT)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{_logs(fed)}") from e
        assert row["status"] == "finished:completed", _logs(fed)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["flower"]["status"] == "completed" and not summary["flower"]["failures"]
    assert summary["clients"] == DOMAINS
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    assert [r["participants"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    embedded = run_experiment(cfg, out=tmp_path / "embedded")
    assert summary["accuracy_curve"] == embedded["accuracy_curve"]
    assert summary["per_client_accuracy"] == embedded["per_client_accuracy"]
    assert summary["bytes_up"] == embedded["bytes_up"]


def test_node_killed_mid_run(tmp_path: Path) -> None:
    cfg = replace(CFG, rounds=3, eval_every=3)
    run_dir = tmp_path / "run"
    app = write_app_dir(tmp_path / "app", cfg, ServerOptions(out=str(run_dir),
                                                             round_timeout=ROUND_TIMEOUT,
                                                             join_timeout=120))
    with LocalFederation(tmp_path / "fed", num_nodes=3, tls=False) as fed:
        run_id = _submit(fed, app)
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + RUN_TIMEOUT
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert time.monotonic() < deadline, f"round 0 never finished\n{_logs(fed)}"
            time.sleep(0.5)
        fed.kill_node(2)  # crash (SIGKILL to the node and its ClientApps); it never returns
        try:
            row = wait_for_run(run_id, fed.connection, fed.flwr_home,
                               timeout=max(30.0, deadline - time.monotonic()))
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{_logs(fed)}") from e
        assert row["status"] == "finished:completed", _logs(fed)
    summary = json.loads((run_dir / "summary.json").read_text())
    fl = summary["flower"]
    assert fl["status"] == "completed" and fl["rounds_completed"] == 3
    assert fl["lost_rounds"] == {DOMAINS[2]: [1, 2]}
    rows = [json.loads(x) for x in metrics.open()]
    assert [r["participants"] for r in rows] == [[0, 1, 2], [0, 1], [0, 1]]
    assert DOMAINS[2] in rows[1]["lost"] and rows[2]["eval_missing"] == [DOMAINS[2]]
    assert set(summary["per_client_accuracy"]) == set(DOMAINS[:2])
    # The dead node never made a round wait longer than the round timeout (+ overhead).
    assert rows[1]["seconds"] < ROUND_TIMEOUT + 60 and rows[2]["seconds"] < ROUND_TIMEOUT

"""A real Flower deployment on loopback: SuperLink + 2 SuperNodes as separate processes.

The module starts ONE federation on free 127.0.0.1 ports (FLWR_HOME in a tmp dir, no
telemetry, no update check, no runtime dependency installation): a TLS SuperLink with SuperNode
authentication (Flower 1.41 `--enable-supernode-auth`) and two SuperNodes whose public keys
were registered through the Control API before they started. One test uses it:

1. One 2-round run over TLS: round 0, on every registered node, gives the embedded engine's
   numbers; then one node is killed (SIGKILL): recorded as lost in round 1, not awaited
   again at its evaluation, and the run completes with the other (the node never comes back).
2. While the run waits for the dead node, two intruders claim its partition and the other's
   (one without a key, which tries to register itself, and one with a key nobody registered):
   the SuperLink refuses both, they exit, and they are never listed as nodes nor take part.
   Without `--enable-supernode-auth` the keyless intruder would register itself and stay
   connected.

The run is submitted with `flwr run`; its real final status is read with `flwr list --run-id
... --format json` (never trusting an exit code), then the summary.json the ServerApp wrote.
Every process group is torn down (context manager with try/finally semantics), also on failure,
and every wait is bounded. Per-message cost is dominated by the ClientApp process start (Flower
spawns one `flwr-clientapp` per message; it imports torch), so rounds are few and the
federation is started once.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("cryptography")
if any(shutil.which(p) is None for p in ("flower-superlink", "flower-supernode", "flwr")):
    pytest.skip("flower-superlink/flower-supernode/flwr not on PATH", allow_module_level=True)

from fedvl.config import RunConfig  # noqa: E402
from fedvl.flower.deploy import (  # noqa: E402
    list_nodes,
    make_node_keys,
    submit,
    wait_for_run,
    write_app_dir,
)
from fedvl.flower.local_deployment import LocalFederation  # noqa: E402
from fedvl.flower.server_app import ServerOptions  # noqa: E402
from fedvl.run.experiment import run_experiment  # noqa: E402

pytestmark = [pytest.mark.flower, pytest.mark.slow(seconds=90)]

DOMAINS = ["handwritten", "printed-clean"]
CFG = RunConfig(method="fedavg", benchmark="digits-offline", domains=DOMAINS, train_cap=60,
                test_cap=30, seed=2, model_args={"width": 8, "depth": 3, "norm": "instance"},
                local_steps=3, batch_size=16, threads=1)
RUN_TIMEOUT = 300.0
# 3x the slowest honest phase measured on a loaded 2-core machine (13 s: three ClientApps
# starting at once; here two). Flower itself marks a killed node offline 36-60 s after the
# kill (two missed 24-30 s heartbeats), so a timeout above 60 s is never reached.
ROUND_TIMEOUT = 40.0
REFUSAL_TIMEOUT = 120.0  # an intruder is refused within seconds; generous for a loaded machine
INTRUDERS = ["intruder-nokey.log", "intruder-stranger.log"]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory):
    """The module's federation: TLS SuperLink with authentication, two registered nodes."""
    with LocalFederation(tmp_path_factory.mktemp("fed"), num_nodes=2, tls=True,
                         auth=True) as f:
        yield f


def _submit(fed: LocalFederation, app: Path) -> int:
    """Submit the app directory `app` to the federation; the run id."""
    return submit(app, fed.connection, fed.flwr_home, timeout=120)


def _logs(fed: LocalFederation) -> str:
    """The tails of every process log (for failure messages)."""
    return "\n".join(f"--- {n}\n{fed.log(n, 2000)}" for n in
                     ["superlink.log"] + [f"supernode-{i}.log" for i in range(fed.num_nodes)]
                     + [n for n in INTRUDERS if (fed.workdir / n).is_file()])


def _node_ids(fed: LocalFederation) -> set[int]:
    """The node ids the SuperLink lists."""
    return {int(r["node-id"]) for r in list_nodes(fed.connection, fed.flwr_home)}


def _finished(fed: LocalFederation, run_id: int, run_dir: Path, deadline: float) -> dict:
    """The run's final `flwr list` row, once the ServerApp wrote its summary."""
    # Polling the run directory costs nothing; every `flwr list` starts a Python process.
    while not (run_dir / "summary.json").is_file():
        assert time.monotonic() < deadline, f"run {run_id} wrote no summary\n{_logs(fed)}"
        time.sleep(0.5)
    try:
        return wait_for_run(run_id, fed.connection, fed.flwr_home,
                            timeout=max(30.0, deadline - time.monotonic()))
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{_logs(fed)}") from e


def _refuse_intruders(fed: LocalFederation, tmp_path: Path) -> None:
    """Two intruders claim partitions 0 and 1; both are refused and exit."""
    stranger_key = make_node_keys(tmp_path / "stranger", 1, prefix="stranger")[0]["private"]
    nokey = fed.start_extra_node("intruder-nokey", 0)
    stranger = fed.start_extra_node("intruder-stranger", 1, node_key=stranger_key)
    deadline = time.monotonic() + REFUSAL_TIMEOUT
    while running := [n for n, p in fed.extra_nodes.items() if p.poll() is None]:
        assert time.monotonic() < deadline, \
            f"not refused (still running): {running}\n{_logs(fed)}"
        time.sleep(0.5)
    assert nokey.returncode != 0 and stranger.returncode != 0, _logs(fed)
    # Flower's refusals: self-registration disabled (2001), unknown key (2004).
    assert "SuperNode authentication is enabled" in fed.log("intruder-nokey.log")
    assert "Failed to activate SuperNode" in fed.log("intruder-stranger.log")


def test_registered_nodes_give_the_same_numbers_over_tls_then_a_node_killed_and_intruders_refused(
        fed: LocalFederation, tmp_path: Path) -> None:
    assert len(set(fed.node_ids.values())) == 2
    cfg = replace(CFG, rounds=2, eval_every=1)
    run_dir = tmp_path / "run"
    app = write_app_dir(tmp_path / "app", cfg, ServerOptions(out=str(run_dir),
                                                             round_timeout=ROUND_TIMEOUT,
                                                             join_timeout=120))
    run_id = _submit(fed, app)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, f"round 0 never finished\n{_logs(fed)}"
        time.sleep(0.5)
    fed.kill_node(1)  # crash (SIGKILL to the node and its ClientApps); it never returns
    # The round now waits for the dead node: meanwhile intruders claim its partition.
    _refuse_intruders(fed, tmp_path)
    row = _finished(fed, run_id, run_dir, deadline)
    assert row["status"] == "finished:completed", _logs(fed)
    # Only the registered nodes ran it, and no intruder was ever listed.
    assert _node_ids(fed) == set(fed.node_ids.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    fl = summary["flower"]
    assert fl["status"] == "completed" and fl["rounds_completed"] == 2
    assert summary["clients"] == DOMAINS
    rows = [json.loads(x) for x in metrics.open()]
    assert [r["participants"] for r in rows] == [[0, 1], [0]]

    # Round 0, every node over TLS: the embedded engine's numbers. Its evaluation scores the
    # aggregate, so the server's averaging over this transport is part of what is compared.
    embedded = run_experiment(cfg, out=tmp_path / "embedded")
    emb = [json.loads(x) for x in (tmp_path / "embedded" / "metrics.jsonl").open()]
    for k in ("train_loss", "per_client_accuracy", "per_client_loss", "mean_accuracy",
              "round_bytes_up", "round_bytes_down"):
        assert rows[0][k] == emb[0][k], k
    assert summary["accuracy_curve"][0] == embedded["accuracy_curve"][0]

    # Round 1: the dead node is lost (train), then not awaited again (evaluate), and the run
    # completes with the other.
    assert fl["lost_rounds"] == {DOMAINS[1]: [1]}
    assert DOMAINS[1] in rows[1]["lost"] and rows[1]["eval_missing"] == [DOMAINS[1]]
    assert set(summary["per_client_accuracy"]) == {DOMAINS[0]}
    # The dead node never made the round wait longer than the round timeout (+ overhead).
    assert rows[1]["seconds"] < ROUND_TIMEOUT + 60

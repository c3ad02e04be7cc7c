"""`fedvl flower simulate`: a fedvl run on Flower's Simulation Engine (Ray backend).

One virtual SuperNode per partition (node config `partition-id`), the generic ServerApp and
ClientApp of this package, and the same run-directory outputs as `fedvl run`. The virtual
nodes share this machine's disk, so they keep their client state inside each run directory
(`node-state/`), which is what `resume` continues from.
`flwr.simulation.run_simulation` is used (deprecated in favour of `flwr run`, still working in
flwr 1.41/1.42): it runs the ServerApp in this process, which lets us hand it the config
directly (its `run_config` is empty) and collect the summary. Its deprecation notice is
filtered out of the log.
A ClientApp actor whose process dies is restarted by Ray (see `backend` below); the client it
was serving is lost for that round and recorded, and `min-nodes` decides whether the run goes
on (`fedvl flower simulate` requires every sampled client unless told otherwise).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from fedvl.config import RunConfig, validate
from fedvl.data.spec import spec_of
from fedvl.flower.server_app import ServerOptions, Tap, make_server_app
from fedvl.run.assemble import data_options


def num_partitions(cfg: RunConfig) -> int:
    """Number of partitions (= virtual SuperNodes) of the configured benchmark.

    What the benchmark's spec counts without loading data; `--num-clients` for one whose spec
    does not say.
    """
    n = spec_of(cfg.benchmark).num_clients(data_options(cfg))
    return cfg.num_clients if n is None else n


class _DropDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return "run_simulation` function is deprecated" not in text


def startup_seconds(records: list[dict[str, Any]], since: float) -> float | None:
    """Seconds from `since` (a wall-clock time) to the start of the first round run after it.

    A round record carries the wall clock at its end (`time`) and its length (`seconds`); rounds
    of an earlier session (a resumed run's) ended before `since` and are skipped.
    """
    for r in records:
        if isinstance(r.get("time"), int | float) and r["time"] >= since:
            return max(0.0, float(r["time"]) - float(r.get("seconds", 0.0)) - since)
    return None


def _record_startup(summary: dict[str, Any], out: str | None, since: float) -> None:
    """Add `flower.startup_seconds` (Ray, the virtual nodes, the first message) to the first
    experiment's summary and its summary.json."""
    from fedvl.engine.recorder import RunRecorder, read_metrics

    if out is None or not isinstance(summary.get("flower"), dict):
        return
    seconds = startup_seconds(read_metrics(out), since)
    if seconds is None:
        return
    summary["flower"]["startup_seconds"] = seconds
    RunRecorder(out).write_summary(summary)


def simulate(experiments: list[tuple[RunConfig, ServerOptions]], *,
             num_supernodes: int | None = None, client_cpus: float = 1.0,
             client_gpus: float = 0.0, ray_cpus: int | None = None, tap: Tap | None = None,
             verbose: bool = False, resume: bool = False, announce: bool = True
             ) -> list[dict[str, Any]]:
    """Run experiments (same benchmark partitioning) in one Flower simulation; their summaries.

    All experiments must have the same number of partitions; each runs to completion before
    the next starts, on the same virtual nodes (client state is kept per config). With
    `resume` each continues from the checkpoint in its run directory. Each run's `min_nodes`
    is taken as given (`fedvl flower simulate` passes every partition by default); a run
    below it raises `MinNodesError` after writing its summary.

    Start-up (Ray, the virtual nodes) is not part of any round: the first experiment's summary
    records it as `flower.startup_seconds`, and with `announce` a line on stderr says it begins
    and how long it took.
    """
    since = time.time()
    from flwr.simulation import run_simulation

    from fedvl.flower.client_app import app as client_app

    if not experiments:
        return []
    for cfg, _ in experiments:
        validate(cfg)
    counts = {num_partitions(cfg) for cfg, _ in experiments}
    if len(counts) != 1:
        raise ValueError(f"experiments in one simulation need the same partition count, "
                         f"got {sorted(counts)}")
    n = num_supernodes or counts.pop()
    results: list[dict[str, Any]] = []
    server_app = make_server_app(experiments, tap=tap, results=results, resume=resume,
                                 nodes_share_disk=True)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    init_args: dict[str, Any] = {"include_dashboard": False}
    if ray_cpus:
        init_args["num_cpus"] = ray_cpus
    # Ray options of every ClientApp actor (Flower passes `client_resources` to
    # `ClientAppActor.options`). Without restarts, an actor whose process dies (a client's
    # crash, the OOM killer) goes back into Flower's pool dead and fails every later message
    # it is given: one crash cost 4 of 5 clients. Restarted, the actor serves the next
    # message; a message caught by the death or the restart is retried once (a crash that
    # repeats loses that client's round; a Python exception is never retried).
    backend = {"client_resources": {"num_cpus": client_cpus, "num_gpus": client_gpus,
                                    "max_restarts": -1, "max_task_retries": 1},
               "init_args": init_args}
    flt = _DropDeprecation()
    flwr_log = logging.getLogger("flwr")
    flwr_log.addFilter(flt)
    for h in flwr_log.handlers:
        h.addFilter(flt)
    if announce:
        # Ray and the nodes start before round 0 can: without a word this looks like a hang.
        print(f"fedvl: starting Flower simulation (Ray, {n} virtual nodes)...", file=sys.stderr,
              flush=True)
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=n,
                       backend_config=backend, verbose_logging=verbose)
    finally:
        flwr_log.removeFilter(flt)
        for h in flwr_log.handlers:
            h.removeFilter(flt)
    if results:
        _record_startup(results[0], experiments[0][1].out, since)
        up = results[0].get("flower", {}).get("startup_seconds")
        if announce and up is not None:
            print(f"fedvl: Flower start-up took {up:.1f} s before the first round began (not "
                  f"in the run's wall time; recorded as flower.startup_seconds)",
                  file=sys.stderr, flush=True)
    if len(results) != len(experiments):
        raise RuntimeError(f"the Flower simulation finished {len(results)} of "
                           f"{len(experiments)} experiments; see the log above")
    return results

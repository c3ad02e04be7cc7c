"""The generic fedvl ServerApp: the server half of any registered algorithm, driven over a Grid.

`FlowerRun` builds the algorithm from what the nodes report, then hands it to the same
`RoundDriver` as the embedded engine, over a `FlowerTransport` (see `transport.py` for what
only a real federation has: discovery, lost nodes, `min-nodes`, `round-timeout`,
`node-wait`, evaluation by message). The run directory is written by the same recorder;
`checkpoint.pt` holds the server's state, ledger and history, and each node keeps its own
client state (`node_state.py`), so a run resumes from the same checkpoint code.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedvl.config import RunConfig, validate
from fedvl.engine.driver import RoundDriver
from fedvl.engine.logs import check_logs
from fedvl.engine.recorder import SUMMARY, RunRecorder
from fedvl.engine.threads import resolve_threads, torch_threads
from fedvl.flower.failures import MinNodesError, clean_reason
from fedvl.flower.node import NORM, config_key, partition_names
from fedvl.flower.records import config_from_run_config, config_to_text
from fedvl.flower.server_options import ServerOptions
from fedvl.flower.transport import FlowerTransport, NodeInfo, Tap
from fedvl.run.assemble import (
    FederationShape,
    build_method,
    default_run_dir,
    deterministic_mode,
    resolve_device,
    round_config,
    summary_head,
)

__all__ = ["FlowerRun", "NodeInfo", "ServerOptions", "Tap", "make_server_app"]

NODE_STATE = "node-state"  # client state folder inside the run directory (simulation only)


class FlowerRun:
    """One fedvl experiment over a Flower Grid."""

    def __init__(self, grid: Grid, cfg: RunConfig, opts: ServerOptions,
                 tap: Tap | None = None, resume: bool = False,
                 nodes_share_disk: bool = False) -> None:
        validate(cfg)
        if cfg.data.holdout_clients:
            raise ValueError("--holdout-clients runs on the in-process engine only: a Flower "
                             "federation's nodes are its training clients; allowed on Flower: 0")
        check_logs(cfg.engine.log)   # before the run directory exists
        # Resolved once, here, and sent to every node inside the config text.
        self.cfg = replace(cfg, threads=resolve_threads(cfg.engine.threads))
        self.opts, self.resume = opts, resume
        self.run_dir = Path(opts.out) if opts.out else default_run_dir(self.cfg)
        self.recorder = RunRecorder(self.run_dir)
        self.recorder.use_logs(self.cfg)
        self.text = config_to_text(self.cfg)
        self.key = config_key(self.text)
        self.device = resolve_device(self.cfg.engine.device)
        names = partition_names(self.cfg)
        hint = str(self.run_dir.resolve() / NODE_STATE) if nodes_share_disk else None
        self.transport = FlowerTransport(grid, opts, self.text, self.key, self.device,
                                         None if names is None else len(names), tap, hint)
        self.driver: RoundDriver | None = None
        self.status = "running"
        self.setup_seconds = 0.0   # meeting the nodes and building the method, before round 0
        self.images: list[str] = []
        self.resumed_after: str | None = None   # status of the attempt a resumed run continues

    def setup(self) -> None:
        """Wait for the partitions, then build the algorithm from their public shape."""
        t = self.transport
        t.join()
        assert t.num_partitions is not None
        first = next(iter(t.nodes.values()))
        for n in t.nodes.values():
            if (n.num_classes, n.image_shape) != (first.num_classes, first.image_shape):
                raise RuntimeError(f"partition {n.pid} disagrees on label space / image shape")
        names = partition_names(self.cfg) or [
            t.nodes[p].name if p in t.nodes else f"partition{p}"
            for p in range(t.num_partitions)]
        norm = first.dataset_info.get(NORM, {})
        self.shape = FederationShape(first.num_classes, first.image_shape, names,
                                     mean=tuple(norm.get("mean", ())),
                                     std=tuple(norm.get("std", ())))
        t.names = names
        t.alg = build_method(self.cfg, self.shape, self.device)
        self.driver = RoundDriver(t.alg, t, round_config(self.cfg), self.recorder,
                                  self.device)

    def summary(self) -> dict[str, Any]:
        """The same keys as `fedvl run`'s summary.json, plus `engine` and `flower`."""
        assert self.driver is not None
        t = self.transport
        lost_rounds: dict[str, list[int]] = {}
        lost_clients: list[dict[str, Any]] = []   # every client lost in training or evaluation
        for f in t.failures:
            if f.get("stage") == "train":
                lost_rounds.setdefault(f["client"], []).append(int(f["round"]))
            if f.get("stage") in ("train", "evaluate") and "client" in f:
                lost_clients.append({k: f[k] for k in ("round", "stage", "client", "reason")})
        last_eval = next((r for r in reversed(self.driver.history) if "mean_accuracy" in r), {})
        infos = t.infos
        info = next((i.dataset_info for i in infos.values()), {})
        head = summary_head(self.cfg, t.names,
                            {infos[p].name: infos[p].num_train for p in sorted(infos)},
                            {k: v for k, v in info.items() if k != NORM}, self.device,
                            self.run_dir, self.images)
        return {
            **head, **self.driver.result(), "setup_seconds": round(self.setup_seconds, 3),
            **self.driver.alg.report(self.driver.state),
            # The clients the final `mean_accuracy` is over (all that answered the evaluation).
            "evaluated_clients": last_eval.get("evaluated_clients", []),
            "engine": "flower",
            "flower": {
                "status": self.status, "rounds_completed": len(self.driver.history),
                "lost_rounds": lost_rounds, "lost_clients": lost_clients,
                "failures": t.failures,
                "eval_bytes_down": t.eval_ledger.totals()["bytes_down"],
                "round_timeout": self.opts.round_timeout, "min_nodes": self.opts.min_nodes,
                # A resumed run's checkpoint forgets the failed attempt's lost clients: say it.
                **({"resumed_after": self.resumed_after} if self.resumed_after else {}),
                "nodes": {t.names[p]: infos[p].node_id for p in sorted(infos)},
            },
        }

    def save_images(self) -> list[str]:
        """PNG grids of the virtual sets the server holds (client-held sets stay on nodes)."""
        assert self.driver is not None
        if not self.shape.mean:
            return []
        return self.recorder.save_images(self.driver.alg.virtual_sets(self.driver.state, {}),
                                         self.shape.num_classes, self.shape.mean,
                                         self.shape.std)

    def run(self) -> dict[str, Any]:
        """All rounds (or the rest, resuming); writes the run directory, returns the summary."""
        if not self.resume:
            self.recorder.write_config(self.cfg)
        else:
            self.resumed_after = previous_status(self.run_dir)
        finished = False
        engine = self.cfg.engine
        with deterministic_mode(engine.deterministic), torch_threads(engine.threads):
            try:
                start = time.perf_counter()
                self.setup()
                self.setup_seconds = time.perf_counter() - start
                assert self.driver is not None
                self.driver.run(resume=self.resume)
                self.status = self.driver.status
                self.images = self.save_images()
                finished = True
            except MinNodesError as e:
                # Too many clients lost: the round is not kept and the checkpoint of the round
                # before stays, so the run resumes there with every client again.
                self.status = e.status
                self.transport.failures.append({"round": e.round, "stage": "server",
                                                "reason": str(e)})
                self.recorder.write_summary(self.summary())
                raise
            except Exception as e:
                self.status = "failed"
                self.transport.failures.append(
                    {"stage": "server", "reason": clean_reason(f"{type(e).__name__}: {e}")})
                if self.driver is not None:
                    self.recorder.write_summary(self.summary())
                else:
                    self.recorder.write_error(f"{type(e).__name__}: {e}\n")
                raise
            finally:
                if not finished:
                    self.recorder.logs.close(failed=True)
        summary = self.summary()
        self.recorder.write_summary(summary)
        self.recorder.logs.close()
        return summary


def previous_status(run_dir: Path) -> str | None:
    """The Flower status in a run directory's `summary.json` (None: none readable)."""
    try:
        prev = json.loads((run_dir / SUMMARY).read_text())
        status = prev["flower"]["status"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return clean_reason(status) if isinstance(status, str) else None


def make_server_app(experiments: list[tuple[RunConfig, ServerOptions]] | None = None,
                    tap: Tap | None = None,
                    results: list[dict[str, Any]] | None = None, resume: bool = False,
                    nodes_share_disk: bool = False) -> ServerApp:
    """A ServerApp running the given experiments one after another on the same federation.

    Without `experiments` the run config comes from Flower's `run_config`
    (`fedvl-config` YAML text, field overrides, the ServerOptions keys, and `resume=true`
    to continue from the checkpoint in `out`). `nodes_share_disk` (simulation) lets nodes
    keep their client state inside each run directory.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        todo, again = experiments, resume
        if todo is None:
            rc = dict(context.run_config)
            todo = [(config_from_run_config(rc), ServerOptions.from_run_config(rc))]
            again = again or str(rc.get("resume", "")).lower() in ("1", "true", "yes")
        for cfg, opts in todo:
            summary = FlowerRun(grid, cfg, opts, tap, again, nodes_share_disk).run()
            if results is not None:
                results.append(summary)

    return app


app = make_server_app()

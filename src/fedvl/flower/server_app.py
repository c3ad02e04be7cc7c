"""The generic fedvl ServerApp: the server half of any registered algorithm, driven over a Grid.

The round loop mirrors `fedvl.engine.simulation.Simulation` step for step (client sampling,
message contents, aggregation order, ledger, evaluation schedule, metrics records), so the
same config and seed give the same numbers. Differences that only a real federation has:
  * nodes are discovered with a `query.info` message (partition id, name, sample counts);
  * a sampled partition whose node is offline, fails, or does not answer within
    `round-timeout` seconds is dropped from that round (recorded under `lost`);
  * a round starts only with at least `min-nodes` reachable sampled nodes; the server waits
    at most `node-wait` seconds for them and otherwise stops the run (status `aborted`);
  * evaluation is an `evaluate` message to every node (each tests on its own split).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlwrMessage
from flwr.serverapp import Grid, ServerApp

from fedvl import __version__
from fedvl.algorithms.base import ServerContext, make_algorithm
from fedvl.config import RunConfig, dump_yaml, validate
from fedvl.engine.ledger import Ledger
from fedvl.engine.message import Message
from fedvl.engine.simulation import (
    Simulation,
    evaluation_due,
    round_record,
    sample_clients,
)
from fedvl.experiment import build_env, default_run_dir, resolve_device
from fedvl.flower.node import NORM, FederationInfo, config_key, partition_names
from fedvl.flower.options import ServerOptions
from fedvl.flower.records import (
    METRICS,
    RUN,
    config_from_run_config,
    config_to_text,
    from_recorddict,
    to_recorddict,
)

Tap = Callable[[str, FlwrMessage], None]


@dataclass
class NodeInfo:
    """What the server knows about one connected node (public facts only)."""

    node_id: int
    pid: int
    name: str
    num_train: int
    num_test: int
    num_classes: int
    image_shape: tuple[int, int, int]
    num_partitions: int
    dataset_info: dict[str, Any] = field(default_factory=dict)
    has_global_test: bool = False


class FlowerRun:
    """One fedvl experiment over a Flower Grid."""

    def __init__(self, grid: Grid, cfg: RunConfig, opts: ServerOptions,
                 tap: Tap | None = None) -> None:
        validate(cfg)
        self.grid, self.cfg, self.opts, self.tap = grid, cfg, opts, tap
        self.text = config_to_text(cfg)
        self.key = config_key(self.text)
        self.device = resolve_device(cfg.device)
        self.ledger = Ledger()
        self.eval_ledger = Ledger()  # evaluation traffic (the embedded engine has none)
        self.nodes: dict[int, NodeInfo] = {}      # pid -> node
        self.infos: dict[int, NodeInfo] = {}      # pid -> last seen info (names survive loss)
        self.failures: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []
        self.elapsed = 0.0
        self.status = "running"
        self.num_partitions: int | None = None
        self.suspects: set[int] = set()   # node ids that missed a deadline
        self.images: list[str] = []
        self.poll = 0.2
        names = partition_names(cfg)
        if names is not None:
            self.num_partitions = len(names)

    # -- messaging ----
    def _run_record(self, **extra: Any) -> ConfigRecord:
        return ConfigRecord({"config": self.text, "config-key": self.key, **extra})

    def send(self, messages: list[FlwrMessage], timeout: float) -> list[FlwrMessage]:
        """Push `messages`, pull replies until all arrived or `timeout` s passed.

        Like `Grid.send_and_receive`, with a short poll interval, and without waiting for
        *suspect* nodes (nodes that missed an earlier deadline): once some reply arrived and
        only suspects are pending, the exchange ends. A suspect that answers is trusted again.
        """
        if not messages:
            return []
        if self.tap is not None:
            for m in messages:
                self.tap("send", m)
        ids = list(self.grid.push_messages(messages))
        pending = {mid: int(m.metadata.dst_node_id) for mid, m in zip(ids, messages, strict=True)}
        deadline = time.monotonic() + timeout
        replies: list[FlwrMessage] = []
        while pending:
            for r in self.grid.pull_messages(list(pending)):
                if pending.pop(r.metadata.reply_to_message_id, None) is None:
                    continue
                if self.tap is not None:
                    self.tap("recv", r)
                replies.append(r)
                self.suspects.discard(int(r.metadata.src_node_id))
            if not pending or time.monotonic() >= deadline:
                break
            if replies and all(n in self.suspects for n in pending.values()):
                break  # the trusted nodes are done; suspects get no extra wait
            time.sleep(self.poll)
        self.suspects.update(pending.values())
        return replies

    # -- node discovery ----
    def discover(self) -> None:
        """Refresh the pid -> node map: forget gone nodes, ask new ones who they are."""
        ids = {int(i) for i in self.grid.get_node_ids()}
        for pid in [p for p, n in self.nodes.items() if n.node_id not in ids]:
            del self.nodes[pid]
        known = {n.node_id for n in self.nodes.values()}
        new = sorted(ids - known)
        if not new:
            return
        msgs = [FlwrMessage(RecordDict({RUN: self._run_record()}), dst_node_id=nid,
                            message_type="query.info") for nid in new]
        for r in self.send(msgs, timeout=min(self.opts.round_timeout, 120.0)):
            if r.has_error():
                self.failures.append({"stage": "discover", "node_id": r.metadata.src_node_id,
                                      "error": f"{r.error.code}: {r.error.reason}"})
                continue
            i = r.content["info"]
            node = NodeInfo(
                node_id=int(r.metadata.src_node_id), pid=int(i["partition-id"]),
                name=str(i["name"]), num_train=int(i["num-train"]), num_test=int(i["num-test"]),
                num_classes=int(i["num-classes"]),
                image_shape=tuple(int(s) for s in i["image-shape"]),  # type: ignore[arg-type]
                num_partitions=int(i["num-partitions"]),
                dataset_info=json.loads(str(i["dataset-info"])),
                has_global_test=bool(i["has-global-test"]))
            if self.num_partitions is None:
                self.num_partitions = node.num_partitions
            if node.num_partitions != self.num_partitions:
                raise RuntimeError(f"node {node.node_id} reports {node.num_partitions} "
                                   f"partitions, expected {self.num_partitions}")
            old = self.nodes.get(node.pid)
            if old is not None and old.node_id != node.node_id:
                # A restarted SuperNode (new node id) takes over its partition; the old id is
                # usually a crashed node whose heartbeats have not expired yet.
                self.failures.append({"stage": "discover", "partition": node.pid,
                                      "reason": f"node {node.node_id} replaces node "
                                                f"{old.node_id} for partition {node.pid}"})
            self.nodes[node.pid] = node
            self.infos[node.pid] = node

    def wait_for(self, want: Callable[[], bool], timeout: float) -> bool:
        """Poll discovery until `want()` holds or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            self.discover()
            if want():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    # -- setup ----
    def setup(self) -> None:
        """Wait for the partitions, then build the algorithm from their public shape."""
        def all_joined() -> bool:
            return self.num_partitions is not None and len(self.nodes) >= self.num_partitions

        if not self.wait_for(all_joined, self.opts.join_timeout):
            if len(self.nodes) < max(self.opts.min_nodes, 1):
                raise TimeoutError(
                    f"only {len(self.nodes)} of {self.num_partitions or '?'} partitions joined "
                    f"within {self.opts.join_timeout:.0f} s (min-nodes {self.opts.min_nodes})")
        assert self.num_partitions is not None
        first = next(iter(self.nodes.values()))
        for n in self.nodes.values():
            if (n.num_classes, n.image_shape) != (first.num_classes, first.image_shape):
                raise RuntimeError(f"partition {n.pid} disagrees on label space / image shape")
        names = partition_names(self.cfg) or [
            self.nodes[p].name if p in self.nodes else f"partition{p}"
            for p in range(self.num_partitions)]
        self.names = names
        norm = first.dataset_info.get(NORM, {})
        fed = FederationInfo(self.cfg.benchmark, first.num_classes, first.image_shape, names,
                             mean=tuple(norm.get("mean", ())), std=tuple(norm.get("std", ())))
        self.fed_info = fed
        self.env = build_env(self.cfg, fed, self.device)  # type: ignore[arg-type]
        self.alg = make_algorithm(self.cfg.method, self.env, self.cfg.method_args)

    # -- round loop ----
    def _lose(self, rnd: int, stage: str, pid: int, reason: str, lost: dict[str, str]) -> None:
        lost[self.names[pid]] = reason
        self.failures.append({"round": rnd, "stage": stage, "partition": pid,
                              "client": self.names[pid], "reason": reason})

    def run_round(self, rnd: int) -> dict[str, Any] | None:
        """One round (None when too few nodes are reachable and the run must stop)."""
        t0 = time.perf_counter()
        k = self.num_partitions
        assert k is not None
        clients = sample_clients(k, self.cfg.client_ratio, self.cfg.seed, rnd)
        need = min(self.opts.min_nodes, len(clients))
        self.discover()
        if sum(c in self.nodes for c in clients) < need and not self.wait_for(
                lambda: sum(c in self.nodes for c in clients) >= need, self.opts.node_wait):
            return None
        ctx = ServerContext(rnd, self.cfg.seed, self.device)
        outgoing = self.alg.configure(self.state, ctx, clients)
        lost: dict[str, str] = {}
        sent: dict[int, int] = {}  # node_id -> pid
        msgs = []
        for cid in clients:
            node = self.nodes.get(cid)
            if node is None:
                self._lose(rnd, "train", cid, "offline", lost)
                continue
            msg = outgoing[cid]
            self.ledger.record(rnd, "down", msg)
            content = to_recorddict(msg)
            content[RUN] = self._run_record(**{"round": rnd, "client-names": self.names})
            msgs.append(FlwrMessage(content, dst_node_id=node.node_id, message_type="train",
                                    group_id=f"{self.key}-{rnd}"))
            sent[node.node_id] = cid
        got: dict[int, Message] = {}
        for r in self.send(msgs, timeout=self.opts.round_timeout):
            pid = sent.get(int(r.metadata.src_node_id))
            if pid is None:
                continue
            if r.has_error():
                self._lose(rnd, "train", pid, f"error {r.error.code}: {r.error.reason}", lost)
                continue
            got[pid] = from_recorddict(r.content).to(self.device)
        for pid in sent.values():
            if pid not in got and self.names[pid] not in lost:
                self._lose(rnd, "train", pid, f"no reply within {self.opts.round_timeout} s",
                           lost)
        # Same order as the embedded engine (sampled order), so sums are bit-identical.
        replies = {cid: got[cid] for cid in clients if cid in got}
        for reply in replies.values():
            self.ledger.record(rnd, "up", reply)
        if replies:
            self.state = self.alg.aggregate(self.state, ctx, replies)
        record = round_record(rnd, clients, replies, self.ledger)
        if evaluation_due(rnd, self.cfg.eval_every, self.cfg.rounds):
            record.update(self.evaluate(rnd, lost))
        if lost:
            record["lost"] = lost
        record["participants"] = sorted(replies)
        record["seconds"] = time.perf_counter() - t0
        return record

    def evaluate(self, rnd: int, lost: dict[str, str]) -> dict[str, Any]:
        """Every reachable node tests the global model (or its own) on its own test split."""
        model = self.alg.global_model(self.state)
        payload = Message() if model is None else Message(
            {"weights": {n: t.detach().cpu() for n, t in model.state_dict().items()}})
        self.discover()
        pids = sorted(self.nodes)
        gtest = next((p for p in pids if self.nodes[p].has_global_test), None)
        msgs, sent = [], {}
        for pid in pids:
            node = self.nodes[pid]
            self.eval_ledger.record(rnd, "down", payload)
            content = to_recorddict(payload)
            content[RUN] = self._run_record(**{"round": rnd, "client-names": self.names,
                                               "global-test": pid == gtest})
            msgs.append(FlwrMessage(content, dst_node_id=node.node_id, message_type="evaluate",
                                    group_id=f"{self.key}-{rnd}-eval"))
            sent[node.node_id] = pid
        res: dict[int, Any] = {}
        for r in self.send(msgs, timeout=self.opts.round_timeout):
            pid = sent.get(int(r.metadata.src_node_id))
            if pid is None:
                continue
            if r.has_error():
                self.failures.append({"round": rnd, "stage": "evaluate", "partition": pid,
                                      "client": self.names[pid],
                                      "reason": f"error {r.error.code}: {r.error.reason}"})
                continue
            res[pid] = r.content[METRICS]
        out: dict[str, Any] = {}
        acc = {self.names[p]: float(res[p]["accuracy"]) for p in range(len(self.names))
               if p in res}
        loss = {self.names[p]: float(res[p]["loss"]) for p in range(len(self.names)) if p in res}
        out["per_client_accuracy"], out["per_client_loss"] = acc, loss
        for p in res:
            if "global-test-accuracy" in res[p]:
                out["global_test_accuracy"] = float(res[p]["global-test-accuracy"])
        missing = [n for i, n in enumerate(self.names) if i not in res]
        if missing:
            out["eval_missing"] = missing
        out["mean_accuracy"] = float(np.mean(list(acc.values()))) if acc else float("nan")
        return out

    # -- outputs ----
    def _write_metrics(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        os.replace(tmp, path)

    def summary(self) -> dict[str, Any]:
        """The same keys as `fedvl run`'s summary.json, plus `engine` and `flower`."""
        result = Simulation.result(self)  # type: ignore[arg-type]  # same keys and maths
        lost_rounds: dict[str, list[int]] = {}
        for f in self.failures:
            if f.get("stage") == "train":
                lost_rounds.setdefault(f["client"], []).append(int(f["round"]))
        infos = self.infos
        cfg = self.cfg
        return {
            "method": cfg.method, "benchmark": cfg.benchmark, "seed": cfg.seed,
            "rounds": cfg.rounds, "model": cfg.model, "model_args": cfg.model_args,
            "method_args": cfg.method_args, "clients": self.names,
            "train_samples": {infos[p].name: infos[p].num_train for p in sorted(infos)},
            "dataset_info": {k: v for k, v in next(
                (i.dataset_info for i in infos.values()), {}).items() if k != NORM},
            "device": str(self.device), "fedvl_version": __version__,
            "run_dir": str(self.run_dir), "images": self.images, **result,
            "engine": "flower",
            "flower": {
                "status": self.status, "rounds_completed": len(self.history),
                "lost_rounds": lost_rounds, "failures": self.failures,
                "eval_bytes_down": self.eval_ledger.totals()["bytes_down"],
                "round_timeout": self.opts.round_timeout, "min_nodes": self.opts.min_nodes,
                "nodes": {self.names[p]: infos[p].node_id for p in sorted(infos)},
            },
        }

    def save_images(self) -> list[str]:
        """PNG grids of the virtual sets the server holds (client-held sets stay on nodes)."""
        sets = getattr(self.alg, "virtual_sets", None)
        if sets is None or not self.fed_info.mean:
            return []
        from fedvl.experiment import save_virtual_grids

        return save_virtual_grids(sets(self.state, {}), self.fed_info,  # type: ignore[arg-type]
                                  self.run_dir)

    def _write_summary(self) -> dict[str, Any]:
        summary = self.summary()
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, default=_json_default))
        os.replace(tmp, self.run_dir / "summary.json")
        return summary

    def run(self) -> dict[str, Any]:
        """All rounds; writes config.yaml, metrics.jsonl (per round) and summary.json."""
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.run_dir = Path(self.opts.out) if self.opts.out else default_run_dir(self.cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_yaml(self.cfg, self.run_dir / "config.yaml")
        try:
            self.setup()
            self.state = self.alg.server_init()
            for rnd in range(self.cfg.rounds):
                t0 = time.perf_counter()
                record = self.run_round(rnd)
                if record is None:
                    self.status = "aborted"
                    self.failures.append({"round": rnd, "stage": "sample",
                                          "reason": f"fewer than {self.opts.min_nodes} "
                                                    f"reachable nodes after "
                                                    f"{self.opts.node_wait:.0f} s"})
                    break
                self.history.append(record)
                self.elapsed += time.perf_counter() - t0
                self._write_metrics()
            else:
                self.status = "completed"
            self.images = self.save_images()
        except Exception as e:
            self.status = "failed"
            self.failures.append({"stage": "server", "reason": f"{type(e).__name__}: {e}"})
            if hasattr(self, "names"):
                self._write_summary()
            else:
                (self.run_dir / "error.txt").write_text(f"{type(e).__name__}: {e}\n")
            raise
        return self._write_summary()


def _json_default(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    return str(v)


def make_server_app(experiments: list[tuple[RunConfig, ServerOptions]] | None = None,
                    tap: Tap | None = None,
                    results: list[dict[str, Any]] | None = None) -> ServerApp:
    """A ServerApp running the given experiments one after another on the same federation.

    Without `experiments` the run config comes from Flower's `run_config`
    (`fedvl-config` YAML text, field overrides, and the ServerOptions keys).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        todo = experiments
        if todo is None:
            rc = dict(context.run_config)
            todo = [(config_from_run_config(rc), ServerOptions.from_run_config(rc))]
        for cfg, opts in todo:
            summary = FlowerRun(grid, cfg, opts, tap).run()
            if results is not None:
                results.append(summary)

    return app


app = make_server_app()

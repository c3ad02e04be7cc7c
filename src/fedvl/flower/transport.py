"""The Flower transport: the round driver's messages over a Grid.

What only a real federation has:
  * nodes are discovered with a `query.info` message (partition id, name, sample counts);
  * a sampled partition whose node is offline, fails, or does not answer within
    `round-timeout` seconds is dropped from that round (recorded under `lost`);
  * a round starts only with at least `min-nodes` reachable sampled nodes; the transport waits
    at most `node-wait` seconds for them and otherwise the run stops (status `aborted`);
  * a round (or its evaluation) that hears from fewer than `min-nodes` of the nodes it asked
    raises `MinNodesError`: the run fails, and resumes from the round before;
  * evaluation is an `evaluate` message to every node (each tests on its own split); the
    round record names the clients it covers (`evaluated_clients`);
  * every recorded failure reason is one line of plain text (`clean_reason`).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ConfigRecord, RecordDict
from flwr.app import Message as FlwrMessage
from flwr.serverapp import Grid

from fedvl.algorithms.base import Algorithm, ServerState
from fedvl.core.ledger import Ledger
from fedvl.core.message import Message
from fedvl.core.training import mean_accuracy
from fedvl.engine.driver import Exchange
from fedvl.flower.failures import check_min_nodes, clean_reason
from fedvl.flower.records import (
    INBOX,
    METRICS,
    PEER,
    RUN,
    from_recorddict,
    get_messages,
    put_messages,
    to_recorddict,
)
from fedvl.flower.server_options import ServerOptions

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


def _node_info(r: FlwrMessage) -> NodeInfo:
    """A node's `query.info` answer as a NodeInfo (KeyError/TypeError/ValueError if garbled)."""
    i = r.content["info"]
    node = NodeInfo(
        node_id=int(r.metadata.src_node_id), pid=int(i["partition-id"]),
        name=str(i["name"]), num_train=int(i["num-train"]), num_test=int(i["num-test"]),
        num_classes=int(i["num-classes"]),
        image_shape=tuple(int(s) for s in i["image-shape"]),  # type: ignore[arg-type]
        num_partitions=int(i["num-partitions"]),
        dataset_info=json.loads(str(i["dataset-info"])),
        has_global_test=bool(i["has-global-test"]))
    if node.num_train < 0 or node.num_test < 0 or len(node.image_shape) != 3:
        raise ValueError(f"sizes {node.num_train}/{node.num_test}, image shape "
                         f"{node.image_shape}")
    return node


class FlowerTransport:
    """Delivers a run's messages to the SuperNodes holding its partitions."""

    def __init__(self, grid: Grid, opts: ServerOptions, text: str, key: str,
                 device: torch.device, num_partitions: int | None = None,
                 tap: Tap | None = None, node_state_dir: str | None = None) -> None:
        self.grid, self.opts, self.text, self.key, self.tap = grid, opts, text, key, tap
        self.device = device
        self.num_partitions = num_partitions
        self.node_state_dir = node_state_dir  # a hint for nodes that have no state-dir setting
        self.alg: Algorithm | None = None
        self.names: list[str] = []
        self.eval_ledger = Ledger()  # evaluation traffic (the embedded engine has none)
        self.nodes: dict[int, NodeInfo] = {}      # pid -> node
        self.infos: dict[int, NodeInfo] = {}      # pid -> last seen info (names survive loss)
        self.failures: list[dict[str, Any]] = []
        self.suspects: set[int] = set()   # node ids that missed a deadline
        self.resume_round: int | None = None  # last round of the checkpoint a run resumed from
        # Separates this run's client state on the nodes from an identical config's run
        # earlier in the same Flower run (see client_app.run_key).
        self.session = secrets.token_hex(4)
        self.poll = 0.2  # the longest wait between two pulls of one exchange

    @property
    def num_clients(self) -> int:
        """Number of partitions of the federation."""
        assert self.num_partitions is not None
        return self.num_partitions

    # -- messaging ----
    def run_record(self, **extra: Any) -> ConfigRecord:
        """The `fedvl.run` record every message carries (config text, key, control fields)."""
        fields: dict[str, Any] = {"config": self.text, "config-key": self.key,
                                  "session": self.session}
        if self.resume_round is not None:
            fields["resume-round"] = self.resume_round
        if self.node_state_dir:
            fields["state-dir"] = self.node_state_dir
        return ConfigRecord({**fields, **extra})

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
        # A simulated node answers in milliseconds, a deployed one in seconds: the wait between
        # pulls grows from 5 ms to `poll`, so neither pays a fixed 0.2 s per exchange or
        # floods the SuperLink with pulls.
        wait = 0.005
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
            time.sleep(wait)
            wait = min(self.poll, wait * 1.5)
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
        msgs = [FlwrMessage(RecordDict({RUN: self.run_record()}), dst_node_id=nid,
                            message_type="query.info") for nid in new]
        for r in self.send(msgs, timeout=min(self.opts.round_timeout, 120.0)):
            if r.has_error():
                self.failures.append({"stage": "discover", "node_id": r.metadata.src_node_id,
                                      "error": clean_reason(f"{r.error.code}: "
                                                            f"{r.error.reason}")})
                continue
            try:
                node = _node_info(r)
            except (KeyError, TypeError, ValueError) as e:
                # A garbled answer is one node's fault: it is left out, the run goes on.
                self.failures.append({"stage": "discover", "node_id": r.metadata.src_node_id,
                                      "error": clean_reason(f"unreadable info answer "
                                                            f"({type(e).__name__}: {e})")})
                continue
            if self.num_partitions is None:
                self.num_partitions = node.num_partitions
            if node.num_partitions != self.num_partitions or not (
                    0 <= node.pid < self.num_partitions):
                self.failures.append({"stage": "discover", "node_id": node.node_id,
                                      "error": f"reports partition {node.pid} of "
                                               f"{node.num_partitions}; the federation has "
                                               f"{self.num_partitions} partitions"})
                continue
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

    def join(self) -> None:
        """Wait for every partition (at most `join-timeout` s; `min-nodes` of them suffice)."""
        def all_joined() -> bool:
            return self.num_partitions is not None and len(self.nodes) >= self.num_partitions

        if not self.wait_for(all_joined, self.opts.join_timeout):
            if len(self.nodes) < max(self.opts.min_nodes, 1):
                raise TimeoutError(
                    f"only {len(self.nodes)} of {self.num_partitions or '?'} partitions joined "
                    f"within {self.opts.join_timeout:.0f} s (min-nodes {self.opts.min_nodes})")

    # -- the driver's interface ----
    def _lose(self, rnd: int, stage: str, pid: int, reason: str, lost: dict[str, str]) -> None:
        reason = clean_reason(reason)
        lost[self.names[pid]] = reason
        self.failures.append({"round": rnd, "stage": stage, "partition": pid,
                              "client": self.names[pid], "reason": reason})

    def train_size(self, cid: int) -> int | None:
        """The training-set size partition `cid`'s node reported in its `query.info` answer."""
        info = self.infos.get(cid)
        return None if info is None else info.num_train

    def ready(self, rnd: int, clients: list[int]) -> bool:
        """At least `min-nodes` sampled nodes reachable, waiting up to `node-wait` s."""
        need = min(self.opts.min_nodes, len(clients))
        self.discover()
        if sum(c in self.nodes for c in clients) < need and not self.wait_for(
                lambda: sum(c in self.nodes for c in clients) >= need, self.opts.node_wait):
            self.failures.append({"round": rnd, "stage": "sample",
                                  "reason": f"fewer than {self.opts.min_nodes} reachable "
                                            f"nodes after {self.opts.node_wait:.0f} s"})
            return False
        return True

    def collect(self, rnd: int, stage: str, msgs: list[FlwrMessage], sent: dict[int, int]
                ) -> tuple[dict[int, FlwrMessage], dict[str, str]]:
        """Send `msgs`; the good replies by partition and the lost clients (name -> reason).

        A node's error or silence is also recorded under `failures` with `stage` (`sent` maps
        node ids to partitions).
        """
        got: dict[int, FlwrMessage] = {}
        lost: dict[str, str] = {}
        for r in self.send(msgs, timeout=self.opts.round_timeout):
            pid = sent.get(int(r.metadata.src_node_id))
            if pid is None:
                continue
            if r.has_error():
                self._lose(rnd, stage, pid, f"error {r.error.code}: {r.error.reason}", lost)
                continue
            got[pid] = r
        for pid in sent.values():
            if pid not in got and self.names[pid] not in lost:
                self._lose(rnd, stage, pid, f"no reply within {self.opts.round_timeout} s",
                           lost)
        return got, lost

    def share(self, rnd: int, peers: dict[int, list[int]]) -> dict[int, dict[int, Message]]:
        """A `query.share` message to each sampled node; its peer messages, unchanged.

        The ServerApp only relays: it forwards what a node addressed to each peer inside that
        peer's `train` message. A node that fails or is offline shares nothing this round.
        """
        msgs, sent = [], {}
        for cid, p in peers.items():
            node = self.nodes.get(cid)
            if node is None:
                continue
            content = RecordDict({RUN: self.run_record(**{
                "round": rnd, "client-names": self.names, "peers": [int(x) for x in p]})})
            msgs.append(FlwrMessage(content, dst_node_id=node.node_id, message_type="query.share",
                                    group_id=f"{self.key}-{rnd}-share"))
            sent[node.node_id] = cid
        got, _ = self.collect(rnd, "share", msgs, sent)
        out = {pid: {k: m.to(self.device) for k, m in get_messages(r.content, PEER).items()}
               for pid, r in got.items()}
        return {cid: out[cid] for cid in peers if cid in out}

    def exchange(self, rnd: int, outgoing: dict[int, Message],
                 inboxes: dict[int, dict[int, Message]] | None = None) -> Exchange:
        """A `train` message to each sampled node (with the peer messages addressed to it);
        replies within `round-timeout` s."""
        lost: dict[str, str] = {}
        sent: dict[int, int] = {}  # node_id -> pid
        msgs = []
        for cid, msg in outgoing.items():
            node = self.nodes.get(cid)
            if node is None:
                self._lose(rnd, "train", cid, "offline", lost)
                continue
            content = to_recorddict(msg)
            if inboxes and inboxes.get(cid):
                put_messages(content, inboxes[cid], INBOX)
            content[RUN] = self.run_record(**{"round": rnd, "client-names": self.names})
            msgs.append(FlwrMessage(content, dst_node_id=node.node_id, message_type="train",
                                    group_id=f"{self.key}-{rnd}"))
            sent[node.node_id] = cid
        got: dict[int, Message] = {}
        unreadable: dict[int, str] = {}
        for r in self.send(msgs, timeout=self.opts.round_timeout):
            pid = sent.get(int(r.metadata.src_node_id))
            if pid is None:
                continue
            if r.has_error():
                self._lose(rnd, "train", pid, f"error {r.error.code}: {r.error.reason}", lost)
                continue
            try:
                got[pid] = from_recorddict(r.content).to(self.device)
            except (KeyError, TypeError, ValueError) as e:   # MessageError is a ValueError
                # A node's reply that is not a fedvl Message is that node's fault, not the run's.
                unreadable[pid] = clean_reason(f"unreadable reply: {e}")
        for pid in sent.values():
            if pid not in got and pid not in unreadable and self.names[pid] not in lost:
                self._lose(rnd, "train", pid, f"no reply within {self.opts.round_timeout} s",
                           lost)
        # A node that answered (even unreadably) is not lost; too few of them and the round
        # would average a subset of the federation: the run stops instead (resumable).
        check_min_nodes(rnd, "train", len(got) + len(unreadable), len(outgoing),
                        self.opts.min_nodes, lost)
        # Sampled order, as in-process, so the aggregation's sums are bit-identical.
        replies = {cid: got[cid] for cid in outgoing if cid in got}
        return Exchange(delivered=list(sent.values()), replies=replies, lost=lost,
                        unreadable=unreadable)

    def evaluate(self, rnd: int, state: ServerState) -> dict[str, Any]:
        """Every reachable node tests the global model (or its own) on its own test split."""
        assert self.alg is not None
        model = self.alg.global_model(state)
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
            content[RUN] = self.run_record(**{"round": rnd, "client-names": self.names,
                                              "global-test": pid == gtest})
            msgs.append(FlwrMessage(content, dst_node_id=node.node_id, message_type="evaluate",
                                    group_id=f"{self.key}-{rnd}-eval"))
            sent[node.node_id] = pid
        got, lost = self.collect(rnd, "evaluate", msgs, sent)
        res = {pid: r.content[METRICS] for pid, r in got.items()}
        # Nodes offline at evaluation time count as lost too: the mean would cover fewer.
        for p in range(len(self.names)):
            if p not in res and self.names[p] not in lost:
                lost[self.names[p]] = "offline"
        check_min_nodes(rnd, "evaluate", len(res), len(self.names), self.opts.min_nodes, lost)
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
        # The clients `mean_accuracy` is the mean over (a node without test images is left out
        # of the mean by `mean_accuracy` itself).
        out["evaluated_clients"] = list(acc)
        out["mean_accuracy"] = mean_accuracy(acc.values())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Server-side bookkeeping only: client state stays on the nodes."""
        return {"config-key": self.key, "failures": self.failures,
                "eval_ledger": self.eval_ledger.state_dict()}

    def load_state_dict(self, ck: dict[str, Any]) -> None:
        """Restore the bookkeeping and tell the nodes which round their state must be from."""
        if ck.get("config-key") != self.key:
            raise ValueError(f"the checkpoint belongs to run config {ck.get('config-key')}, "
                             f"not {self.key}: resume with the run directory's config.yaml")
        self.failures = list(ck["failures"])
        self.eval_ledger.load_state_dict(ck["eval_ledger"])
        self.resume_round = int(ck["round"])

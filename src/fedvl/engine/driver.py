"""The round driver: one loop for every transport (in-process or Flower).

Per round: sample clients, `configure`, hand the messages to the transport, count the bytes
that crossed, `aggregate` the replies, write the round record, evaluate on schedule, then
checkpoint through the recorder. The transport decides how a message reaches a client and
what "evaluate" means there; the arithmetic (sampling, reply order, ledger) lives here once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fedvl.algorithms.base import Algorithm, ServerContext, ServerState, client_name
from fedvl.core.audit import round_audit, summary_audit, withheld_everything
from fedvl.core.bounds import bound_round
from fedvl.core.ledger import Ledger
from fedvl.core.message import Message
from fedvl.core.replies import ReplyRejected, ReplySpec, check_reply, shown, shown_text
from fedvl.engine.divergence import diverged_error
from fedvl.engine.logs import reported_epsilon
from fedvl.engine.recorder import RunRecorder, accuracy_vs_bytes
from fedvl.engine.threads import load_optimizer_modules
from fedvl.progress import emit, scope
from fedvl.seeding import derive_seed
from fedvl.timing import (
    SYNTHESIS,
    Accumulator,
    accumulating,
    client_sums,
    round_phases,
    summary_phases,
)

log = logging.getLogger("fedvl")
Progress = Callable[[int, dict[str, Any]], None]


@dataclass
class RoundConfig:
    """Round loop settings."""

    rounds: int
    client_ratio: float = 1.0
    eval_every: int = 1
    seed: int = 0
    min_replies: int = 1   # fewer valid replies: the round is skipped, the state kept


def sample_clients(num_clients: int, ratio: float, seed: int, rnd: int) -> list[int]:
    """Clients of round `rnd`: max(1, round(ratio*K)) without replacement, seeded by round."""
    m = max(1, int(round(ratio * num_clients)))
    if m >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(derive_seed(seed, rnd, 1))
    return sorted(int(i) for i in rng.choice(num_clients, size=m, replace=False))


def client_generator(seed: int, rnd: int, cid: int, stream: int = 2) -> torch.Generator:
    """The RNG a client uses in one round (independent of execution order).

    Stream 2 is the client's update; stream 3 its peer-sharing step (`SHARE_STREAM`).
    """
    return torch.Generator().manual_seed(derive_seed(seed, rnd, cid, stream))


SHARE_STREAM = 3
# Keys of a round record that measure time, not the computation (they differ between runs).
TIMING_KEYS = frozenset({"seconds", "client_seconds", "eval_seconds", "time", "time_by_phase",
                         "client_seconds_summed"})
Inboxes = dict[int, dict[int, Message]]   # receiver -> sender -> message


def round_record(rnd: int, clients: list[int], replies: dict[int, Message], ledger: Ledger
                 ) -> dict[str, Any]:
    """The training part of a round's metrics line."""
    record: dict[str, Any] = {"round": rnd, "sampled": clients}
    losses = [float(r.meta["train_loss"]) for r in replies.values() if "train_loss" in r.meta]
    if losses:
        record["train_loss"] = float(np.mean(losses))
    record.update({f"round_bytes_{k}": v for k, v in ledger.round_bytes(rnd).items()})
    return record


def evaluation_due(rnd: int, eval_every: int, rounds: int) -> bool:
    """Evaluate every `eval_every` rounds and after the last one."""
    return (rnd + 1) % eval_every == 0 or rnd + 1 == rounds


@dataclass
class Exchange:
    """What one round's delivery gave: who got a message, who answered, who was lost."""

    delivered: list[int]
    replies: dict[int, Message]                  # in sampled order
    lost: dict[str, str] = field(default_factory=dict)   # client name -> reason
    # Replies that arrived but could not be read as a Message: client id -> reason.
    unreadable: dict[int, str] = field(default_factory=dict)


class Transport(Protocol):
    """How the driver reaches clients: deliver messages, collect replies, evaluate."""

    num_clients: int
    names: list[str]   # client names, by client id (records and log lines use them)

    def ready(self, rnd: int, clients: list[int]) -> bool:
        """Whether round `rnd` can start with these sampled clients (False stops the run)."""

    def share(self, rnd: int, peers: dict[int, list[int]]) -> dict[int, dict[int, Message]]:
        """Peer topology: each client's messages to its peers (sender -> receiver -> message)."""

    def exchange(self, rnd: int, outgoing: dict[int, Message],
                 inboxes: Inboxes | None = None) -> Exchange:
        """Deliver each client's message (and its peers' messages) and return the replies in
        sampled order."""

    def evaluate(self, rnd: int, state: ServerState) -> dict[str, Any]:
        """Accuracy/loss per client of the global model (or of each client's own model)."""

    def state_dict(self) -> dict[str, Any]:
        """What the transport must keep in a checkpoint (merged into it)."""

    def load_state_dict(self, ck: dict[str, Any]) -> None:
        """Restore from a checkpoint written with `state_dict`."""

    def train_size(self, cid: int) -> int | None:
        """The training-set size client `cid` announced when it joined (None: not known yet).

        The driver asks once per client and keeps the first answer: a client cannot raise it
        later, and its replies' `num_examples` are bounded by it.
        """


def finite_state(value: Any) -> bool:
    """Whether every floating tensor in a (nested) server state is finite."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, Mapping):
        return all(finite_state(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(finite_state(v) for v in value)
    return True


class RoundDriver:
    """Runs an algorithm's rounds over a transport, recording into a run directory."""

    def __init__(self, algorithm: Algorithm, transport: Transport, cfg: RoundConfig,
                 recorder: RunRecorder | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.alg, self.transport, self.cfg, self.recorder = algorithm, transport, cfg, recorder
        self.device = torch.device(device)
        self.ledger = Ledger()
        self.history: list[dict[str, Any]] = []
        self.state: ServerState = {}
        self.start_round = 0
        self.rejected_peer: dict[str, str] = {}   # this round's: "sender->receiver" -> reason
        # Each client's training-set size as announced when the driver first met it: the
        # bound of its replies' `num_examples` (and FedNova's steps) for the whole run.
        self.announced: dict[int, int] = {}
        # Why the last round shows that training diverged (None: it does not): see `run`.
        self.diverged: str | None = None
        self._nonfinite: set[str] = set()   # this round's clients rejected for NaN/Inf values
        # Clients whose every reply held NaN/Inf (or lay beyond the absolute bound) since the
        # last round that had a usable reply.
        self._diverging: set[str] = set()
        self.elapsed = 0.0
        self.status = "created"

    def run_round(self, rnd: int) -> dict[str, Any] | None:
        """One communication round; its metrics record (None: too few clients, stop)."""
        t0 = time.perf_counter()
        clients = sample_clients(self.transport.num_clients, self.cfg.client_ratio,
                                 self.cfg.seed, rnd)
        if not self.transport.ready(rnd, clients):
            return None
        ctx = ServerContext(rnd, self.cfg.seed, self.device)
        self.rejected_peer = {}
        self.diverged, self._nonfinite = None, set()
        self.meet(clients)
        server = Accumulator()   # the server's own work: configure and aggregate
        with accumulating(server):
            outgoing = self.alg.configure(self.state, ctx, clients)
        t_clients = time.perf_counter()
        inboxes = self.peer_round(rnd, clients, ctx) if self.alg.topology == "peer" else None
        ex = self.transport.exchange(rnd, {cid: outgoing[cid] for cid in clients}, inboxes)
        client_seconds = time.perf_counter() - t_clients
        for cid in ex.delivered:
            self.ledger.record(rnd, "down", outgoing[cid])
        for reply in ex.replies.values():   # rejected ones crossed the network too
            if isinstance(reply, Message):
                self.ledger.record(rnd, "up", reply)
        replies, rejected = self.screen(rnd, outgoing, ex)
        skipped = len(replies) < max(1, self.cfg.min_replies)
        unfit = ""
        if not skipped:
            with accumulating(server):
                new = self.alg.aggregate(self.state, ctx, replies)
            # Replies within every bound can still combine into Inf (e.g. huge finite weights
            # under the plain mean): such a state would end every later round, so it is not kept.
            if finite_state(new):
                self.state = new
            else:
                unfit = "aggregating the valid replies gave NaN or Inf: server state unchanged"
                self.diverged = unfit
        if not skipped or not rejected or replies or not set(rejected) <= self._nonfinite:
            self._diverging = set()
        else:
            # A round of nothing but NaN, Inf or beyond-bound replies. One client alone (one
            # sampled per round) may be a hostile one and must not stop the run: it stops once
            # two clients in a row without a usable round between them sent nothing else.
            self._diverging |= set(rejected)
            if len(self._diverging) >= min(2, self.transport.num_clients):
                name, why = next(iter(rejected.items()))
                self.diverged = (f"every reply held NaN, Inf or unbounded values (client "
                                 f"{name}: {why})")
        record = round_record(rnd, clients, replies, self.ledger)
        if audit := round_audit(ex.replies, self.name):   # what the clients' guards saw
            record["upload_audit"] = audit
        eval_seconds = 0.0
        if evaluation_due(rnd, self.cfg.eval_every, self.cfg.rounds):
            t_eval = time.perf_counter()
            emit("evaluate", step=0, total=self.transport.num_clients)
            record.update(self.transport.evaluate(rnd, self.state))
            eval_seconds = time.perf_counter() - t_eval
        if ex.lost:
            record["lost"] = ex.lost
        if rejected:
            record["rejected"] = rejected
        if self.rejected_peer:
            record["rejected_peer"] = dict(self.rejected_peer)
        if skipped or unfit:
            record["skipped"] = unfit or (f"{len(replies)} valid replies, fewer than "
                                          f"min-replies {self.cfg.min_replies}: server state "
                                          f"unchanged")
            log.warning("round %d skipped: %s", rnd, record["skipped"])
        record["participants"] = sorted(replies)
        record["seconds"] = time.perf_counter() - t0
        # Where the round went: the clients' work (with its transport) and the evaluation.
        record["client_seconds"], record["eval_seconds"] = client_seconds, eval_seconds
        # Every reply that arrived took its client's time, rejected or not (`fedvl.timing`).
        summed = client_sums(ex.replies.values())
        record["time_by_phase"] = round_phases(record["seconds"], client_seconds, summed,
                                               server.total, server.get(SYNTHESIS), eval_seconds)
        record["client_seconds_summed"] = {"synthesis": round(summed[1], 6),
                                           "total": round(summed[0], 6)}
        record["time"] = time.time()   # wall clock at the round's end (timelines, `fedvl perf`)
        return record

    def name(self, cid: int) -> str:
        """Client `cid`'s name in records and log lines."""
        return client_name(self.transport.names, cid)

    def meet(self, clients: list[int]) -> None:
        """Learn the training-set size of each client met for the first time (kept for good)."""
        size_of = getattr(self.transport, "train_size", None)
        for cid in clients:
            if cid in self.announced or size_of is None:
                continue
            n = size_of(cid)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                self.announced[cid] = n

    def problem(self, reply: Any, spec_of: Callable[[], ReplySpec], cid: int,
                nonfinite: set[str] | None = None) -> str | None:
        """Why a client's reply (or peer message) cannot be used, or None; never raises.

        The spec gets the run's device and the bounds that follow from the client's announced
        training-set size; a rejection for NaN or Inf values adds the client's name to
        `nonfinite`. Whatever a client sends, a failure of the check itself is that
        reply's rejection (with the exception type), never the server's crash.
        """
        try:
            spec = spec_of()
            spec.devices = spec.devices | {self.device.type}
            n = self.announced.get(cid)
            if n is not None:
                spec.bounds = {**self.alg.meta_bounds(cid, n), **spec.bounds}
                for kind, most in self.alg.row_bounds(cid, n).items():
                    spec.max_rows[kind] = min(most, spec.max_rows.get(kind, most))
                for name, most in self.alg.count_bounds(cid, n).items():
                    spec.counts[name] = min(most, spec.counts.get(name, most))
            check_reply(reply, spec)
        except ReplyRejected as e:
            if e.nonfinite and nonfinite is not None:
                nonfinite.add(self.name(cid))
            return shown_text(str(e))
        except Exception as e:   # noqa: BLE001 - nothing a client sends may stop the server
            return shown_text(f"reply: the check failed on it ({type(e).__name__}: {e})")
        return None

    def screen(self, rnd: int, outgoing: dict[int, Message], ex: Exchange
               ) -> tuple[dict[int, Message], dict[str, str]]:
        """The replies that pass the method's `reply_spec` and the round's bound on what one
        reply can move, and why each other one was dropped.

        A dropped reply never reaches `aggregate`; the round goes on with the rest.
        """
        rejected = {self.name(cid): shown_text(reason) for cid, reason in ex.unreadable.items()}
        valid: dict[int, Message] = {}
        for cid, reply in ex.replies.items():
            if withheld_everything(reply):   # its guard kept back all it had: nothing to use
                continue
            why = self.problem(reply, lambda cid=cid: self.alg.reply_spec(outgoing[cid], cid),
                               cid, self._nonfinite)
            if why is not None:
                rejected[self.name(cid)] = why
                continue
            valid[cid] = reply
        for cid, e in self.beyond_bound(valid, outgoing).items():
            if e.nonfinite:
                self._nonfinite.add(self.name(cid))
            rejected[self.name(cid)] = shown_text(str(e))
            del valid[cid]
        for name, reason in rejected.items():
            log.warning("round %d: reply of client %s rejected: %s", rnd, name, reason)
        return valid, rejected

    def beyond_bound(self, messages: Mapping[Any, Message], sent: Mapping[Any, Message | None]
                     ) -> dict[Any, ReplyRejected]:
        """The messages (replies or peer messages) of one round beyond the bound on what one
        client can move (`fedvl.core.bounds`), each with why (`nonfinite`: beyond the absolute
        bound, as a diverging client's)."""
        return bound_round(messages, sent, self.alg.bounded_kinds,
                           dict.fromkeys(messages, self.alg.count_tensors))

    def peer_round(self, rnd: int, clients: list[int], ctx: ServerContext) -> Inboxes:
        """Collect the sampled clients' peer messages and sort them into inboxes.

        Each message is counted once, as `peer` traffic, when it is delivered; a client may
        address only the peers `neighbours` gave it.
        """
        peers = {c: self.alg.neighbours(c, clients, ctx) for c in clients}
        inboxes: Inboxes = {c: {} for c in clients}
        delivered: dict[tuple[int, int], Message] = {}
        pairs: dict[tuple[int, int], str] = {}
        for sender, msgs in self.transport.share(rnd, peers).items():
            if sender not in peers or not isinstance(msgs, Mapping):
                self.rejected_peer[f"{self.name(sender)}->?"] = (
                    "peer messages must come from a sampled client, as a dict receiver -> "
                    "Message")
                continue
            for receiver, msg in msgs.items():
                known = isinstance(receiver, int) and 0 <= receiver < self.transport.num_clients
                pair = f"{self.name(sender)}->{self.name(receiver) if known else shown(receiver)}"
                if receiver not in peers[sender]:
                    self.rejected_peer[pair] = (f"client {shown(receiver)} is not among this "
                                                f"sender's peers this round {peers[sender]}")
                    continue
                if isinstance(msg, Message):
                    self.ledger.record(rnd, "peer", msg)
                why = self.problem(msg, lambda s=sender: self.alg.peer_spec(s), sender)
                if why is not None:
                    # The receiver trains without it, as if the sender had not shared.
                    self.rejected_peer[pair] = why
                    continue
                delivered[sender, receiver] = msg
                pairs[sender, receiver] = pair
        # Every message of the round is sized against the round's others (no server tensor).
        refused = self.beyond_bound(delivered, {})
        for key, msg in delivered.items():
            if key in refused:
                self.rejected_peer[pairs[key]] = shown_text(str(refused[key]))
            else:
                inboxes[key[1]][key[0]] = msg
        for pair, why in self.rejected_peer.items():
            log.warning("round %d: peer message %s rejected: %s", rnd, pair, why)
        return inboxes

    # -- checkpoints --
    def save_checkpoint(self, rnd: int) -> None:
        """Everything the server needs to continue after round `rnd` with identical results."""
        if self.recorder is None:
            return
        self.recorder.save_checkpoint({
            "round": rnd,
            "server_state": self.state,
            "ledger": self.ledger.state_dict(),
            "history": self.history,
            "elapsed": self.elapsed,
            "announced": dict(self.announced),
            **self.transport.state_dict(),
        })

    def load_checkpoint(self) -> bool:
        """Restore from the recorder's checkpoint; False if there is none."""
        ck = None if self.recorder is None else self.recorder.load_checkpoint(self.device)
        if ck is None:
            return False
        self.state = ck["server_state"]
        self.ledger.load_state_dict(ck["ledger"])
        self.history = ck["history"]
        self.elapsed = ck["elapsed"]
        self.start_round = ck["round"] + 1
        self.announced = {int(c): int(n) for c, n in ck.get("announced", {}).items()}
        self.transport.load_state_dict(ck)
        return True

    def run(self, resume: bool = False, progress: Progress | None = None) -> dict[str, Any]:
        """Run (or continue) all rounds; returns the final metrics and ledger totals."""
        if not (resume and self.load_checkpoint()):
            self.state = self.alg.server_init()
        load_optimizer_modules()   # a one-time import, not a round's work (`time_by_phase`)
        self.status = "running"
        for rnd in range(self.start_round, self.cfg.rounds):
            t0 = time.perf_counter()
            # Progress events raised inside the round carry its number (`fedvl.progress`).
            with scope(round=rnd, rounds=self.cfg.rounds):
                emit("round")
                record = self.run_round(rnd)
            if record is None:
                self.status = "aborted"
                break
            if self.diverged is not None:
                # Later rounds would be skipped the same way: stop, keeping the last checkpoint.
                self.status = "diverged"
                kept = rnd - 1 if rnd > 0 and self.recorder is not None else None
                run_dir = None if self.recorder is None else self.recorder.dir
                raise diverged_error(rnd, self.diverged, run_dir, kept)
            self.history.append(record)
            self.elapsed += time.perf_counter() - t0
            if self.recorder is not None:
                self.recorder.write_metrics(self.history)
                if self.recorder.logs:   # ε is in the method's report, not in the row
                    self.recorder.logs.log_round(
                        record, reported_epsilon(self.alg.report(self.state)))
            self.save_checkpoint(rnd)
            emit("round_done", round=rnd, rounds=self.cfg.rounds,
                 mean_accuracy=record.get("mean_accuracy"))
            if progress is not None:
                progress(rnd, record)
        else:
            self.status = "completed"
        return self.result()

    def result(self) -> dict[str, Any]:
        """Final evaluation record merged with the ledger totals."""
        last = next((r for r in reversed(self.history) if "mean_accuracy" in r), {})
        keys = ("per_client_accuracy", "per_client_loss", "mean_accuracy", "global_accuracy",
                "mean_global_accuracy", "cross_accuracy", "inter_accuracy",
                "mean_inter_accuracy", "worst_accuracy", "global_test_accuracy",
                "holdout_accuracy", "mean_holdout_accuracy", "holdout_source")
        out = {k: last[k] for k in keys if k in last}
        totals = self.ledger.totals()
        out.update(totals)
        n = max(len(self.history), 1)
        out["bytes_per_round"] = {d: totals[f"bytes_{d}"] / n  # type: ignore[operator]
                                  for d in ("up", "down", "peer") if f"bytes_{d}" in totals}
        out["wall_seconds"] = self.elapsed
        out["round_seconds"] = self.elapsed / n
        out["client_seconds"] = sum(r.get("client_seconds", 0.0) for r in self.history)
        out["eval_seconds"] = sum(r.get("eval_seconds", 0.0) for r in self.history)
        out["accuracy_curve"] = [
            [r["round"], r["mean_accuracy"]] for r in self.history if "mean_accuracy" in r
        ]
        out["accuracy_vs_bytes"] = accuracy_vs_bytes(self.history)
        rejected = [{"round": r["round"], "client": c, "reason": why}
                    for r in self.history for c, why in r.get("rejected", {}).items()]
        rejected += [{"round": r["round"], "client": pair, "reason": why, "peer": True}
                     for r in self.history for pair, why in r.get("rejected_peer", {}).items()]
        out["rejected_replies"] = rejected
        out["skipped_rounds"] = [r["round"] for r in self.history if "skipped" in r]
        out["upload_audit"] = summary_audit(self.history)
        out.update(summary_phases(self.history))
        if any(math.isnan(v) for v in out.get("per_client_accuracy", {}).values()):
            out["warning"] = "some client has an empty test set"
        return out

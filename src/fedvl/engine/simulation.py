"""In-process simulation: sample clients, deliver messages, aggregate, evaluate, checkpoint."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedvl.algorithms.base import Algorithm, ClientContext, ServerContext
from fedvl.data.federated import FederatedDataset
from fedvl.engine.ledger import Ledger
from fedvl.engine.message import Message
from fedvl.engine.training import evaluate
from fedvl.seeding import derive_seed

CHECKPOINT = "checkpoint.pt"


@dataclass
class SimulationConfig:
    """Round loop settings."""

    rounds: int
    client_ratio: float = 1.0
    eval_every: int = 1
    seed: int = 0


def sample_clients(num_clients: int, ratio: float, seed: int, rnd: int) -> list[int]:
    """Clients of round `rnd`: max(1, round(ratio*K)) without replacement, seeded by round."""
    m = max(1, int(round(ratio * num_clients)))
    if m >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(derive_seed(seed, rnd, 1))
    return sorted(int(i) for i in rng.choice(num_clients, size=m, replace=False))


def client_generator(seed: int, rnd: int, cid: int) -> torch.Generator:
    """The RNG a client uses in one round (independent of execution order)."""
    return torch.Generator().manual_seed(derive_seed(seed, rnd, cid, 2))


def round_record(rnd: int, clients: list[int], replies: dict[int, Message], ledger: Ledger
                 ) -> dict[str, Any]:
    """The training part of a round's metrics line (both engines write the same record)."""
    record: dict[str, Any] = {"round": rnd, "sampled": clients}
    losses = [float(r.meta["train_loss"]) for r in replies.values() if "train_loss" in r.meta]
    if losses:
        record["train_loss"] = float(np.mean(losses))
    record.update({f"round_bytes_{k}": v for k, v in ledger.round_bytes(rnd).items()})
    return record


def evaluation_due(rnd: int, eval_every: int, rounds: int) -> bool:
    """Evaluate every `eval_every` rounds and after the last one."""
    return (rnd + 1) % eval_every == 0 or rnd + 1 == rounds


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Simulation:
    """Runs an algorithm over a federated dataset in one process."""

    def __init__(
        self,
        algorithm: Algorithm,
        fed: FederatedDataset,
        cfg: SimulationConfig,
        run_dir: Path | None = None,
        device: torch.device | str = "cpu",
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.alg, self.fed, self.cfg = algorithm, fed, cfg
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.device = torch.device(device)
        self.on_round = on_round
        self.ledger = Ledger()
        self.client_states: dict[int, Message] = {i: Message() for i in range(len(fed.clients))}
        self.data = [
            (c.x_train.to(self.device), c.y_train.to(self.device),
             c.x_test.to(self.device), c.y_test.to(self.device))
            for c in fed.clients
        ]
        self.real = [
            (c.x_real.to(self.device), c.y_real.to(self.device))
            if c.x_real is not None and c.y_real is not None else (None, None)
            for c in fed.clients
        ]
        self.history: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}
        self.start_round = 0
        self.elapsed = 0.0

    # -- client side --
    def context(self, cid: int, rnd: int) -> ClientContext:
        """The ClientContext of client `cid` in round `rnd`."""
        x, y, _, _ = self.data[cid]
        return ClientContext(cid=cid, name=self.fed.clients[cid].name, x=x, y=y,
                             num_classes=self.fed.num_classes, state=self.client_states[cid],
                             generator=client_generator(self.cfg.seed, rnd, cid), round=rnd,
                             device=self.device, x_real=self.real[cid][0],
                             y_real=self.real[cid][1])

    # -- round loop --
    def run_round(self, rnd: int) -> dict[str, Any]:
        """One communication round; returns its metrics record."""
        t0 = time.perf_counter()
        clients = sample_clients(len(self.fed.clients), self.cfg.client_ratio, self.cfg.seed, rnd)
        ctx = ServerContext(rnd, self.cfg.seed, self.device)
        outgoing = self.alg.configure(self.state, ctx, clients)
        replies: dict[int, Message] = {}
        for cid in clients:
            msg = outgoing[cid]
            self.ledger.record(rnd, "down", msg)
            # A copy stands in for the network hop: no half can alias the other's tensors.
            reply = self.alg.client_update(msg.copy(), self.context(cid, rnd))
            self.ledger.record(rnd, "up", reply)
            replies[cid] = reply.copy()
        self.state = self.alg.aggregate(self.state, ctx, replies)
        record = round_record(rnd, clients, replies, self.ledger)
        if evaluation_due(rnd, self.cfg.eval_every, self.cfg.rounds):
            record.update(self.evaluate(rnd))
        record["seconds"] = time.perf_counter() - t0
        return record

    def evaluate(self, rnd: int) -> dict[str, Any]:
        """Per-client accuracy/loss of the global model, or of each client's own model."""
        names = self.fed.client_names
        out: dict[str, Any] = {}
        model = self.alg.global_model(self.state)
        if model is not None:
            acc, loss = {}, {}
            for name, (_, _, xt, yt) in zip(names, self.data, strict=True):
                acc[name], loss[name] = evaluate(model, xt, yt)
            out["per_client_accuracy"], out["per_client_loss"] = acc, loss
            if self.fed.global_test is not None:
                xg, yg = (t.to(self.device) for t in self.fed.global_test)
                out["global_test_accuracy"] = evaluate(model, xg, yg)[0]
        else:
            # Personalised: client k's model on its own test (local) and on everyone's (global).
            cross = np.zeros((len(names), len(names)))
            loss = {}
            for i in range(len(names)):
                m = self.alg.client_model(self.context(i, rnd))
                for j, (_, _, xt, yt) in enumerate(self.data):
                    cross[i, j], lj = evaluate(m, xt, yt)
                    if i == j:
                        loss[names[i]] = lj
            out["per_client_accuracy"] = {n: float(cross[i, i]) for i, n in enumerate(names)}
            out["per_client_loss"] = loss
            out["global_accuracy"] = {n: float(cross[i].mean()) for i, n in enumerate(names)}
            out["cross_accuracy"] = cross.tolist()
            out["mean_global_accuracy"] = float(cross.mean())
        out["mean_accuracy"] = float(np.mean(list(out["per_client_accuracy"].values())))
        return out

    # -- checkpoints --
    def save_checkpoint(self, rnd: int) -> None:
        """Everything needed to continue after round `rnd` with identical results."""
        if self.run_dir is None:
            return
        _atomic_save({
            "round": rnd,
            "server_state": self.state,
            "client_states": {i: (m.arrays, m.meta) for i, m in self.client_states.items()},
            "ledger": self.ledger.state_dict(),
            "history": self.history,
            "elapsed": self.elapsed,
        }, self.run_dir / CHECKPOINT)

    def load_checkpoint(self) -> bool:
        """Restore from the run directory's checkpoint; False if there is none."""
        if self.run_dir is None or not (self.run_dir / CHECKPOINT).is_file():
            return False
        ck = torch.load(self.run_dir / CHECKPOINT, map_location=self.device, weights_only=False)
        self.state = ck["server_state"]
        self.client_states = {int(i): Message(a, m) for i, (a, m) in ck["client_states"].items()}
        self.ledger.load_state_dict(ck["ledger"])
        self.history = ck["history"]
        self.elapsed = ck["elapsed"]
        self.start_round = ck["round"] + 1
        return True

    def _write_metrics(self) -> None:
        if self.run_dir is None:
            return
        path = self.run_dir / "metrics.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        os.replace(tmp, path)

    def run(self, resume: bool = False, progress: Callable[[int, dict], None] | None = None
            ) -> dict[str, Any]:
        """Run (or continue) all rounds; returns the final metrics and ledger totals."""
        if not (resume and self.load_checkpoint()):
            self.state = self.alg.server_init()
        for rnd in range(self.start_round, self.cfg.rounds):
            t0 = time.perf_counter()
            record = self.run_round(rnd)
            self.history.append(record)
            self.elapsed += time.perf_counter() - t0
            self._write_metrics()
            self.save_checkpoint(rnd)
            if progress is not None:
                progress(rnd, record)
        return self.result()

    def result(self) -> dict[str, Any]:
        """Final evaluation record merged with the ledger totals."""
        last = next((r for r in reversed(self.history) if "mean_accuracy" in r), {})
        keys = ("per_client_accuracy", "per_client_loss", "mean_accuracy", "global_accuracy",
                "mean_global_accuracy", "cross_accuracy", "global_test_accuracy")
        out = {k: last[k] for k in keys if k in last}
        out.update(self.ledger.totals())
        out["bytes_per_round"] = {
            "up": self.ledger.totals()["bytes_up"] / max(len(self.history), 1),
            "down": self.ledger.totals()["bytes_down"] / max(len(self.history), 1),
        }
        out["wall_seconds"] = self.elapsed
        out["round_seconds"] = self.elapsed / max(len(self.history), 1)
        out["accuracy_curve"] = [
            [r["round"], r["mean_accuracy"]] for r in self.history if "mean_accuracy" in r
        ]
        if any(math.isnan(v) for v in out.get("per_client_accuracy", {}).values()):
            out["warning"] = "some client has an empty test set"
        return out

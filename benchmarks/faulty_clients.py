"""One faulty client in a FedAvg federation: what each aggregation rule and the reply check do.

  python benchmarks/faulty_clients.py --out /tmp/faulty \
      --result benchmarks/results/faulty-clients-digits-offline-cpu.json
Runs FedAvg on the embedded DIGITS (5 domains, offline) with client `--client` replaced by a
faulty one from round `--from-round` on, for every fault x rule: `scaled` uploads its trained
weights times 1e6 (finite, so the reply check lets it through: only the rule can resist it),
`nan` uploads NaN in one tensor, `shape` one tensor with an extra axis (the check drops both).
The fault is injected by wrapping the method's client half, as a hostile node would answer.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from provenance import machine, write_result

from fedvl.algorithms.fedavg import FedAvg
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.run.experiment import run_experiment

BASE = RunConfig(method="fedavg", benchmark="digits-offline", rounds=30, eval_every=10,
                 train_cap=200, test_cap=200, threads=1, seed=0,
                 model_args={"width": 16, "depth": 3, "norm": "instance"})
RULES = ("samples", "median", "trimmed-mean")


def _fault(kind: str):
    """The reply transformation of a faulty client."""
    def scaled(r: Message) -> Message:
        w = r.arrays["weights"]
        for k, v in w.items():
            if v.is_floating_point():
                w[k] = v * 1e6
        return r

    def nan(r: Message) -> Message:
        w = r.arrays["weights"]
        k = next(k for k, v in w.items() if v.is_floating_point())
        w[k] = torch.full_like(w[k], float("nan"))
        return r

    def shape(r: Message) -> Message:
        w = r.arrays["weights"]
        k = next(iter(w))
        w[k] = w[k].unsqueeze(0)
        return r

    return {"none": lambda r: r, "scaled": scaled, "nan": nan, "shape": shape}[kind]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--client", type=int, default=1)
    p.add_argument("--from-round", type=int, default=2)
    a = p.parse_args()
    original = FedAvg.client_update
    rows = {}
    for fault in ("none", "scaled", "nan", "shape"):
        change = _fault(fault)

        def update(self, msg, ctx, change=change):
            reply = original(self, msg, ctx)
            return change(reply) if ctx.cid == a.client and ctx.round >= a.from_round else reply

        FedAvg.client_update = update  # type: ignore[method-assign]
        for rule in RULES:
            cfg = dataclasses.replace(BASE, aggregation=rule, trim=0.2)
            s = run_experiment(cfg, out=Path(a.out) / f"{fault}-{rule}")
            rows[f"{fault}/{rule}"] = {
                "mean_accuracy": s["mean_accuracy"],
                "per_client_accuracy": s["per_client_accuracy"],
                "rejected_replies": len(s["rejected_replies"]),
                "first_rejection": (s["rejected_replies"] or [{}])[0].get("reason"),
                "wall_seconds": s["wall_seconds"],
            }
            print(fault, rule, f"{s['mean_accuracy']:.4f}", len(s["rejected_replies"]))
    FedAvg.client_update = original  # type: ignore[method-assign]
    write_result(a.result, machine("CPU only"), {
        "config": BASE.to_dict(), "faulty_client": a.client, "faulty_from_round": a.from_round,
        "trim": 0.2, "runs": rows,
        "note": "FedAvg, embedded DIGITS offline (5 clients, 200 train / 200 test each), "
                "ConvNet width 16, 30 rounds, 1 local epoch; one client faulty from round 2 on. "
                "CPU scale."})
    print(f"written: {a.result}")


if __name__ == "__main__":
    main()

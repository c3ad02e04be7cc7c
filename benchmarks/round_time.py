"""Wall time per FedAvg round on cifar10-dirichlet with 10 and 100 clients (ConvNet width 32).

  python benchmarks/round_time.py --data-dir ../shared/data --clients 10,100 --rounds 3
Writes benchmarks/results/core-round-time.json. Every client is sampled each round and trains
one local epoch; the whole 20k-image training set is split among the clients, so the work per
round is the same for 10 and 100 clients and the difference is per-client overhead.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
import torch
from provenance import write_result

from fedvl.config import RunConfig
from fedvl.run.assemble import build_federation
from fedvl.run.experiment import run_experiment


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--clients", default="10,100")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--train-cap", type=int, help="training images kept per client")
    p.add_argument("--threads", type=int)
    p.add_argument("--result", default="benchmarks/results/core-round-time.json")
    a = p.parse_args()
    rows = {}
    for k in [int(c) for c in a.clients.split(",")]:
        cfg = RunConfig(method="fedavg", benchmark="cifar10-dirichlet", data_dir=a.data_dir,
                        num_clients=k, alpha=0.5, rounds=a.rounds, train_cap=a.train_cap,
                        test_cap=200, threads=a.threads, eval_every=a.rounds,
                        model_args={"width": a.width, "depth": 3, "norm": "instance"})
        fed = build_federation(cfg)
        s = run_experiment(cfg, out=Path("runs/round-time") / f"k{k}", fed=fed)
        hist = [json.loads(x) for x in
                (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        # The last round also evaluates; report training rounds separately from it.
        train_rounds = [h["seconds"] for h in hist if "mean_accuracy" not in h]
        rows[str(k)] = {
            "round_seconds_train_only": train_rounds,
            "mean_round_seconds_train_only": float(np.mean(train_rounds)) if train_rounds
            else None,
            "round_seconds_with_eval": [h["seconds"] for h in hist if "mean_accuracy" in h],
            "train_samples_total": sum(c.num_train for c in fed.clients),
            "images_per_second": sum(c.num_train for c in fed.clients) / float(
                np.mean(train_rounds)) if train_rounds else None,
        }
    write_result(a.result, f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads", {
        "scale": {"model": "convnet", "width": a.width, "depth": 3, "batch_size": 32,
                  "local_epochs": 1, "alpha": 0.5, "client_ratio": 1.0},
        "clients": rows,
    })
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

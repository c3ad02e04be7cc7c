"""Cost of the engine: wall time per FedAvg round, embedded engine vs Flower simulation.

  python benchmarks/flower_vs_embedded.py --data-dir /work/shared/data --clients 10,50

Same model/data on both: cifar10-dirichlet (alpha 0.5), ConvNet width 32, at most
`--train-cap` training images per client, every client sampled, one local epoch, evaluation
only after the last round.
Embedded: one process, `--threads` torch threads (default 1). Flower: `run_simulation`
(Ray), one virtual SuperNode per client, `--client-cpus` CPUs per ClientApp actor (1 -> as
many parallel actors as cores), each actor using `--threads` torch threads. With 1 thread the
embedded engine uses one core and Flower all cores: the comparison is "one process" vs "the
same machine through Flower", which is what a user switching engines gets.
Reported per round: train-only round times (the last round also evaluates and is listed
separately), and for Flower the start-up (Ray + node discovery) and the first round
(actor cold start: imports, data loading) separately from the warm rounds.
Writes benchmarks/results/flower-vs-embedded.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
from provenance import machine, write_result

from fedvl.config import RunConfig
from fedvl.run.experiment import run_experiment


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stats(hist: list[dict]) -> dict:
    train = [h["seconds"] for h in hist if "mean_accuracy" not in h]
    return {
        "round_seconds_train_only": train,
        "round_seconds_with_eval": [h["seconds"] for h in hist if "mean_accuracy" in h],
        "mean_round_seconds_train_only": float(np.mean(train)) if train else None,
        "mean_warm_round_seconds_train_only": float(np.mean(train[1:])) if len(train) > 1
        else None,
        "final_mean_accuracy": hist[-1].get("mean_accuracy"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--clients", default="10,50")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--train-cap", type=int, default=150,
                   help="training images kept per client (class-stratified)")
    p.add_argument("--test-cap", type=int, default=50)
    p.add_argument("--client-cpus", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in the embedded engine and in every ClientApp")
    p.add_argument("--out", default="/tmp/fedvl-flower-vs-embedded")
    p.add_argument("--result", default="benchmarks/results/flower-vs-embedded.json")
    a = p.parse_args()

    from fedvl.flower.server_app import ServerOptions
    from fedvl.flower.simulate import simulate

    rows = {}
    for k in [int(c) for c in a.clients.split(",")]:
        cfg = RunConfig(method="fedavg", benchmark="cifar10-dirichlet", data_dir=a.data_dir,
                        num_clients=k, alpha=0.5, rounds=a.rounds, train_cap=a.train_cap,
                        test_cap=a.test_cap, eval_every=a.rounds, seed=0, threads=a.threads,
                        model_args={"width": a.width, "depth": 3, "norm": "instance"})
        t0 = time.perf_counter()
        emb = run_experiment(cfg, out=Path(a.out) / f"embedded-k{k}")
        emb_total = time.perf_counter() - t0
        t0 = time.perf_counter()
        flw = simulate([(cfg, ServerOptions(out=str(Path(a.out) / f"flower-k{k}")))],
                       client_cpus=a.client_cpus)[0]
        flw_total = time.perf_counter() - t0
        e, f = _stats(_rows(Path(emb["run_dir"]))), _stats(_rows(Path(flw["run_dir"])))
        rows[str(k)] = {
            "train_samples_total": sum(emb["train_samples"].values()),
            "embedded": {**e, "total_seconds": emb_total},
            "flower_simulation": {**f, "total_seconds": flw_total,
                                  "startup_seconds": flw_total - flw["wall_seconds"]},
            "same_accuracy_curve": emb["accuracy_curve"] == flw["accuracy_curve"],
            "ratio_warm_train_round_flower_over_embedded": (
                f["mean_warm_round_seconds_train_only"] / e["mean_warm_round_seconds_train_only"]
                if f["mean_warm_round_seconds_train_only"] and
                e["mean_warm_round_seconds_train_only"] else None),
        }
        print(k, json.dumps(rows[str(k)], indent=1), flush=True)
    import flwr

    write_result(a.result, machine(f"{a.threads} torch threads per process, flwr "
                                   f"{flwr.__version__}, Python {platform.python_version()}"), {
        "scale": {"benchmark": "cifar10-dirichlet", "alpha": 0.5, "model": "convnet",
                  "width": a.width, "depth": 3, "train_cap_per_client": a.train_cap,
                  "test_cap_per_client": a.test_cap, "rounds": a.rounds, "local_epochs": 1,
                  "batch_size": 32, "client_ratio": 1.0, "eval": "after the last round",
                  "flower_client_cpus": a.client_cpus},
        "clients": rows,
    })
    print(f"wrote {a.result}")


if __name__ == "__main__":
    main()

"""Baselines x seeds on one benchmark, plus centralised training on the pooled data.

Writes benchmarks/results/core-<benchmark>.json. Example (the recorded runs):
  python benchmarks/core_baselines.py --benchmark digits-offline --rounds 20 --seeds 0,1,2
  python benchmarks/core_baselines.py --benchmark digits --data-dir ../shared/data \
      --train-cap 2000 --test-cap 1000 --rounds 20 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from provenance import write_result

from fedvl.config import RunConfig
from fedvl.core.training import evaluate
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.eval.comparison import run_bench
from fedvl.eval.mmd import heterogeneity
from fedvl.run.assemble import build_env, build_federation
from fedvl.run.experiment import run_experiment
from fedvl.safeload import load_torch

METHODS = "fedavg,fedprox,fednova,scaffold,moon,fedavgm,fedadam,local"


def pooled(fed: FederatedDataset) -> FederatedDataset:
    """One client holding every client's training data (centralised training)."""
    c = ClientData("pooled", torch.cat([c.x_train for c in fed.clients]),
                   torch.cat([c.y_train for c in fed.clients]),
                   torch.cat([c.x_test for c in fed.clients]),
                   torch.cat([c.y_test for c in fed.clients]))
    return FederatedDataset(fed.name + "-pooled", [c], fed.num_classes, fed.mean, fed.std)


def centralised(cfg: RunConfig, seeds: list[int], out: Path) -> dict:
    """Per-domain accuracy of a model trained on the union of all clients' data."""
    per_seed = []
    for seed in seeds:
        c = replace(cfg, method="fedavg", seed=seed)
        fed = build_federation(c)
        run_dir = out / "centralised" / f"seed{seed}"
        run_experiment(c, out=run_dir, fed=pooled(fed))
        ck = load_torch(run_dir / "checkpoint.pt", "checkpoint")
        model = build_env(c, fed, torch.device("cpu")).model_fn()
        model.load_state_dict(ck["server_state"]["model"])
        per_seed.append({cl.name: evaluate(model, cl.x_test, cl.y_test)[0] for cl in fed.clients})
    names = list(per_seed[0])
    means = [float(np.mean(list(s.values()))) for s in per_seed]
    return {
        "per_client_accuracy": {n: {"mean": float(np.mean([s[n] for s in per_seed])),
                                    "std": float(np.std([s[n] for s in per_seed], ddof=1))
                                    if len(per_seed) > 1 else 0.0} for n in names},
        "mean_accuracy": {"mean": float(np.mean(means)),
                          "std": float(np.std(means, ddof=1)) if len(means) > 1 else 0.0,
                          "n": len(means)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--benchmark", default="digits-offline")
    p.add_argument("--data-dir")
    p.add_argument("--train-cap", type=int)
    p.add_argument("--test-cap", type=int)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--threads", type=int)
    p.add_argument("--work", default="runs/core-bench")
    p.add_argument("--result")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    cfg = RunConfig(benchmark=a.benchmark, data_dir=a.data_dir, train_cap=a.train_cap,
                    test_cap=a.test_cap, rounds=a.rounds, threads=a.threads,
                    model_args={"width": a.width, "depth": 3, "norm": "instance"})
    work = Path(a.work) / a.benchmark
    t0 = time.time()
    comp = run_bench(cfg, a.methods.split(","), seeds, work, progress=False)
    central = centralised(cfg, seeds, work)
    het = heterogeneity(build_federation(replace(cfg, seed=0)), samples=200)
    result = {
        "scale": {"model": "convnet", "width": a.width, "depth": 3, "norm": "instance",
                  "rounds": a.rounds, "local_epochs": cfg.local_epochs,
                  "batch_size": cfg.batch_size, "lr": cfg.lr, "momentum": cfg.momentum,
                  "train_cap_per_client": a.train_cap, "test_cap_per_client": a.test_cap,
                  "seeds": seeds},
        "accuracy_note": "fractions in [0,1]; mean +- sample std over seeds; per-client = "
                         "global model on that client's test set (own model for 'local')",
        "methods": comp["methods"],
        "centralised": central,
        "heterogeneity": het,
        "total_seconds": time.time() - t0,
    }
    out = Path(a.result or f"benchmarks/results/core-{a.benchmark}.json")
    write_result(out, f"{platform.processor() or platform.machine()}, "
                      f"{torch.get_num_threads()} torch threads, CPU only", result)
    print(f"wrote {out}")
    for m, e in comp["methods"].items():
        print(f"{m:10s} {100 * e['mean_accuracy']['mean']:6.2f} ± "
              f"{100 * e['mean_accuracy']['std']:.2f}")
    print(f"{'central':10s} {100 * central['mean_accuracy']['mean']:6.2f}")


if __name__ == "__main__":
    main()

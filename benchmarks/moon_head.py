"""MOON against FedAvg with and without its contrastive term, at 1 and 5 local epochs.

  python benchmarks/moon_head.py --out benchmarks/results/moon-head-cpu.json
MOON with `mu=0` is FedAvg on MOON's model (the ConvNet's features through the projection head
Linear-ReLU-Linear, then the classifier): comparing the three arms separates what the
contrastive term does from what the head does, and the local epochs show whether the head only
needs more steps (the MOON paper trains 10 local epochs per round).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from provenance import write_result

ARMS = {"fedavg": ["--method", "fedavg"],
        "moon mu=0 (FedAvg on MOON's model)": ["--method", "moon", "--method-arg", "mu=0"],
        "moon mu=1 (default)": ["--method", "moon"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", default="1,5")
    p.add_argument("--run-args", default="--benchmark digits-offline --train-cap 300 "
                   "--test-cap 200 --rounds 15", help="fedvl run arguments of every arm")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    rows: dict[str, dict] = {}
    work = Path(tempfile.mkdtemp(prefix="fedvl-moon-"))
    for epochs in a.epochs.split(","):
        for name, args in ARMS.items():
            accs, curves = [], []
            for seed in seeds:
                run = work / f"{epochs}-{len(rows)}-{seed}"
                subprocess.run(["fedvl", "run", *a.run_args.split(), *args, "--local-epochs",
                                epochs, "--seed", str(seed), "--out", str(run), "--quiet"],
                               check=True, stdout=subprocess.DEVNULL)
                s = json.loads((run / "summary.json").read_text())
                accs.append(s["mean_accuracy"])
                curves.append([acc for _, acc in s["accuracy_curve"]])
            key = f"{name}, {epochs} local epoch(s)"
            rows[key] = {"mean_accuracy": statistics.mean(accs),
                         "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                         "per_seed": accs,
                         "curve_mean": [statistics.mean(c) for c in zip(*curves, strict=True)]}
            print(f"{key}: {100 * rows[key]['mean_accuracy']:.2f} ± {100 * rows[key]['std']:.2f}",
                  flush=True)
    shutil.rmtree(work, ignore_errors=True)
    write_result(a.out, f"{os.cpu_count()}-core CPU", {"run_args": a.run_args, "seeds": seeds,
                                                       "arms": rows})


if __name__ == "__main__":
    main()

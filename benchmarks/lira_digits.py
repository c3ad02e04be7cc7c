"""LiRA on DIGITS at CPU scale: FedAvg on raw data, FedLGD on local virtual data, local-only.

  python benchmarks/lira_digits.py --out /tmp/lira --shadows 16 \
      --result benchmarks/results/lira-digits-cpu.json
Trains the three target runs (`fedvl run`, skipped when finished), attacks client `mnist` of
each with `fedvl privacy` (finished shadows are reused), and writes one results file with the
commands, the attacks' AUC / TPR and each run's accuracy.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import time
from pathlib import Path

from provenance import machine, write_result

RUN = ("--benchmark digits --data-dir ../shared/data --train-cap 300 --test-cap 300 --rounds 10 "
       "--eval-every 5 --threads 1 --quiet")
METHODS = {"fedavg": "", "local": "", "fedlgd": "--local-data virtual --ipc 10"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--shadows", type=int, default=16)
    p.add_argument("--client", default="mnist")
    p.add_argument("--result", required=True)
    a = p.parse_args()
    out = Path(a.out)
    commands, results = [], {}
    for m, extra in METHODS.items():
        run_dir = out / m
        run = f"fedvl run {RUN} --method {m} {extra} --out {run_dir}".replace("  ", " ")
        attack = f"fedvl privacy {run_dir} --client {a.client} --shadows {a.shadows} --quiet"
        commands += [run, attack]
        if not (run_dir / "summary.json").is_file():
            subprocess.run(shlex.split(run), check=True, stdout=subprocess.DEVNULL)
        t0 = time.perf_counter()
        subprocess.run(shlex.split(attack), check=True, stdout=subprocess.DEVNULL)
        priv = json.loads((run_dir / "privacy.json").read_text())
        summ = json.loads((run_dir / "summary.json").read_text())
        results[m] = {
            "per_client_accuracy": summ["per_client_accuracy"],
            "mean_accuracy": summ["mean_accuracy"],
            "attack_seconds": time.perf_counter() - t0,
            "attacks": {k: {x: v[x] for x in v if x != "roc"} for k, v in priv["attacks"].items()},
        }
    write_result(a.result, machine(), {
        "commands": commands,
        "client": a.client,
        "shadows": a.shadows,
        "methods": results,
    })
    print(f"written: {a.result}")


if __name__ == "__main__":
    main()

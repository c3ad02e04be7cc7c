"""Record DP-FedDM against DP-FedAvg/FedProx at matched epsilon as one results file.

  python benchmarks/record_dp_comparison.py --matched matched.json \
      --run sigma1=runs/dp/sigma1 --run sigma3=runs/dp/sigma3 --run none=runs/dp/nodp \
      --command "..." --result benchmarks/results/dp-feddm-vs-dpfedavg-cpu.json

Each `--run NAME=DIR` is a finished `fedvl bench` directory; for each method and seed the file
keeps the final and best mean client accuracy, the global test accuracy, the accuracy curve
([round, mean client accuracy] per evaluated round), the noise multiplier and the epsilon and
delta per client that the run reported (`summary.json` `privacy`). `--matched` is the JSON
that `benchmarks/dp_matched_noise.py` printed for the same federation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def method_runs(bench_dir: Path) -> dict[str, dict[str, dict]]:
    """Per method and seed: accuracy, curve and privacy of every finished run under `bench_dir`."""
    out: dict[str, dict[str, dict]] = {}
    for summary_file in sorted(bench_dir.glob("*/seed*/summary.json")):
        s = json.loads(summary_file.read_text())
        privacy = s.get("privacy") or {}
        out.setdefault(s["method"], {})[f"seed{s['seed']}"] = {
            "mean_accuracy": s["mean_accuracy"],
            "best_accuracy": max((acc for _, acc in s["accuracy_curve"]),
                                 default=s["mean_accuracy"]),
            "global_test_accuracy": s.get("global_test_accuracy"),
            "accuracy_curve": s["accuracy_curve"],
            "noise_multiplier": privacy.get("noise_multiplier", 0.0),
            "epsilon": privacy.get("epsilon"),
            "delta": privacy.get("delta"),
            "wall_seconds": s["wall_seconds"],
        }
    if not out:
        raise SystemExit(f"{bench_dir}: no finished run (no */seed*/summary.json)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--run", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--matched", required=True, help="dp_matched_noise.py's JSON output")
    p.add_argument("--command", required=True, help="the commands that produced the runs")
    p.add_argument("--result", required=True)
    p.add_argument("--note", default="")
    p.add_argument("--plot", default="", help="also draw the accuracy curves to this PNG")
    a = p.parse_args()
    runs = {}
    for item in a.run:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--run {item!r} must look like NAME=DIR")
        runs[name] = method_runs(Path(path))
    record = {
        "command": a.command,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch "
                   f"{torch.__version__}",
        "note": a.note,
        "matched_noise": json.loads(Path(a.matched).read_text()),
        "runs": runs,
    }
    Path(a.result).write_text(json.dumps(record, indent=2))
    print(f"written: {a.result}")
    if a.plot:
        plot_curves(runs, a.plot)
        print(f"written: {a.plot}")


def plot_curves(runs: dict[str, dict[str, dict]], path: str) -> None:
    """One panel per setting: each method's mean client accuracy per round (seed mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(3.6 * len(runs), 3.2), sharey=True,
                             squeeze=False)
    for ax, (name, methods) in zip(axes[0], runs.items(), strict=True):
        for method, seeds in sorted(methods.items()):
            curves = [dict(r["accuracy_curve"]) for r in seeds.values()]
            rounds = sorted(set.intersection(*(set(c) for c in curves)))
            mean = [100 * sum(c[t] for c in curves) / len(curves) for t in rounds]
            sigma = next(iter(seeds.values()))["noise_multiplier"]
            ax.plot([t + 1 for t in rounds], mean, marker="o", ms=3,
                    label=f"{method} (σ {sigma:.2f})" if sigma else method)
        ax.set_title(name)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("mean client accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

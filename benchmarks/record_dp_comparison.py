"""Record DP-FedDM against DP-FedAvg/FedProx at matched epsilon as one results file.

  python benchmarks/record_dp_comparison.py --matched matched-seed0.json \
      --matched matched-seed1.json --run sigma1=runs/dp/sigma1 --run none=runs/dp/nodp \
      --command "..." --result benchmarks/results/dp-feddm-vs-dpfedavg-cpu.json

Each `--run NAME=DIR` is a finished `fedvl bench` directory; for each method and seed the file
keeps the final and best mean client accuracy, the global test accuracy, the accuracy curve
([round, mean client accuracy] per evaluated round), the noise multiplier and the epsilon and
delta per client that the run reported (`summary.json` `privacy`), and per setting and method
the mean and sample std over seeds with the epsilon range over clients and seeds. `--matched`
(once per seed) is the JSON that `benchmarks/dp_matched_noise.py --seed S` printed for the
same federation: the split, hence each client's matched noise, depends on the seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from provenance import machine, write_result


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


def summarise(seeds: dict[str, dict]) -> dict:
    """Mean and sample std over seeds of one setting's method, with its epsilon range."""

    def stat(key: str) -> dict:
        xs = [r[key] for r in seeds.values() if r[key] is not None]
        return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                "n": len(xs)}

    eps = [e for r in seeds.values() for e in (r["epsilon"] or {}).values()]
    return {"mean_accuracy": stat("mean_accuracy"), "best_accuracy": stat("best_accuracy"),
            "global_test_accuracy": stat("global_test_accuracy"),
            "noise_multiplier": sorted({r["noise_multiplier"] for r in seeds.values()}),
            "epsilon_range": [min(eps), max(eps)] if eps else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--run", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--matched", action="append", required=True,
                   help="dp_matched_noise.py's JSON output, once per seed")
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
    matched = {}
    for path in a.matched:
        m = json.loads(Path(path).read_text())
        seed = m.get("setting", {}).get("seed")
        if seed is None:
            raise SystemExit(f"--matched {path}: no setting.seed (re-run dp_matched_noise.py)")
        matched[f"seed{seed}"] = m
    # The command is the recorded runs', not this script's.
    write_result(a.result, machine(), {
        "command": a.command,
        "note": a.note,
        "matched_noise": matched,
        "summary": {name: {method: summarise(seeds) for method, seeds in methods.items()}
                    for name, methods in runs.items()},
        "runs": runs,
    })
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
            # The matched noise depends on the seed's split, so a legend shows its range.
            sigmas = sorted({r["noise_multiplier"] for r in seeds.values()} - {0.0})
            label = method
            if sigmas:
                span = f"{sigmas[0]:.2f}" + (f"–{sigmas[-1]:.2f}" if len(sigmas) > 1 else "")
                label = f"{method} (σ {span})"
            ax.plot([t + 1 for t in rounds], mean, marker="o", ms=3, label=label)
        ax.set_title(name)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("mean client accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

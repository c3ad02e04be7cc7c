"""Tuned against untuned: `fedvl tune` with the same trial budget per method, then `fedvl bench
--tuned` against the bench at the defaults, on the same seeds, benchmark and rounds.

Three `fedvl` processes, one after another: the search (validation rows of the clients'
training data), the tuned comparison and the default one (both on the test sets). The file
records each command, its wall time, each method's best trial and trial states, and both
comparisons' accuracies.

    python benchmarks/tune_vs_default.py   # writes tune-vs-default-digits-offline-cpu.json
    python benchmarks/tune_vs_default.py --methods fedavg,fedprox,feddm,fedvck \
        --benchmark cifar10-dirichlet --rounds 10 --train-cap 200 --test-cap 200 --trials 8 \
        --run-args "--data-dir ../shared/data --alpha 0.5 --num-clients 10 --eval-every 2" \
        --out benchmarks/results/tune-vs-default-cifar10-a05-amd-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import machine, write_result

ROOT = Path(__file__).resolve().parent.parent


def fedvl(args: list[str], env: dict[str, str]) -> float:
    """Run `fedvl ARGS` from the repository root; its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedvl.cli", *args], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return round(time.perf_counter() - t0, 1)


def accuracies(comp: dict) -> dict[str, dict]:
    """Per method: final, best and global-test accuracy (mean, std, n over seeds), wall seconds
    per run and its own settings."""
    return {m: {"mean_accuracy": e["mean_accuracy"], "best_accuracy": e.get("best_accuracy"),
                "global_test_accuracy": e.get("global_test_accuracy"),
                "wall_seconds": e.get("wall_seconds"), "settings": e.get("settings", {})}
            for m, e in comp["methods"].items()}


def main() -> None:
    """Tune, bench tuned, bench at the defaults; write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="fedavg,fedprox")
    ap.add_argument("--benchmark", default="digits-offline")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train-cap", type=int, default=100)
    ap.add_argument("--test-cap", type=int, default=100)
    ap.add_argument("--seeds", default="0,1,2", help="seeds of both comparisons")
    ap.add_argument("--run-args", default="",
                    help="further run flags for all three commands, one shell string (e.g. "
                         "\"--data-dir ../shared/data --alpha 0.5 --num-clients 10\")")
    ap.add_argument("--keep", help="directory to keep the runs in (default: a temporary one)")
    ap.add_argument("--out", default="benchmarks/results/tune-vs-default-digits-offline-cpu.json")
    ap.add_argument("--tabulate", action="store_true",
                    help="tabulate the finished search and runs under --keep (the same "
                         "arguments as the run that made them) without starting any")
    a = ap.parse_args()
    if a.tabulate and not a.keep:
        ap.error("--tabulate needs --keep DIR, the directory of the earlier run")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    common = ["--methods", a.methods, "--benchmark", a.benchmark, "--rounds", str(a.rounds),
              "--train-cap", str(a.train_cap), "--test-cap", str(a.test_cap), "--quiet",
              *shlex.split(a.run_args)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.keep or tmp).resolve()
        tune_dir, tuned_dir, default_dir = work / "tune", work / "bench-tuned", work / "bench"
        commands = {
            "tune": ["tune", *common, "--trials", str(a.trials), "--out", str(tune_dir)],
            "bench_tuned": ["bench", *common, "--seeds", a.seeds, "--tuned", str(tune_dir),
                            "--out", str(tuned_dir)],
            "bench_default": ["bench", *common, "--seeds", a.seeds, "--out",
                              str(default_dir)],
        }
        if a.tabulate:
            # Each bench reuses its finished runs; --report-only makes a missing one an error
            # in the table instead of a new run.
            for k in ("bench_tuned", "bench_default"):
                fedvl([*commands[k], "--report-only"], env)
            seconds = None
        else:
            seconds = {k: fedvl(v, env) for k, v in commands.items()}
        trials = json.loads((tune_dir / "trials.json").read_text())
        tuned = json.loads((tuned_dir / "comparison.json").read_text())
        default = json.loads((default_dir / "comparison.json").read_text())
    search = {m: {"best": e["best"] and {k: v for k, v in e["best"].items() if k != "config"},
                  "states": e["states"], "finished": e["finished"],
                  "values": [t["value"] for t in e["trials"]],
                  "space": e["space"]}
              for m, e in trials["methods"].items()}
    fields = {
        "what": "fedvl tune with the same trial budget per method (scored on validation rows "
                "carved from the clients' training data), then fedvl bench --tuned against "
                "fedvl bench at the defaults on the test sets",
        "commands": {k: "fedvl " + shlex.join(v) for k, v in commands.items()},
        "seconds": seconds if seconds is not None else
        "not recorded: tabulated afterwards (--tabulate) from runs that were made in parallel "
        "processes; each method's wall_seconds per run are in the comparisons",
        "trials_per_method": a.trials, "val_fraction": trials["val_fraction"],
        "search": search,
        "tuned": accuracies(tuned),
        "default": accuracies(default),
    }
    path = write_result(a.out, machine(), fields)
    print(f"written: {path}")


if __name__ == "__main__":
    main()

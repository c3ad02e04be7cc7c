"""FedVCK's paper forms against the public code's, one code form switched on at a time.

  python benchmarks/fedvck_paper_forms.py --rounds 5 --train-cap 200 --test-cap 100 --seeds 0,1,2

Arms on digits-offline: the paper's defaults (`init=noise`, `contrastive=paper`,
`importance_weights=linear`, `latent_stats=batch`, first-convolution padding 1), then each of
the code's forms alone: `init=real`, `contrastive=code`, `importance_weights=softmax`,
`latent_stats=running`, `--model-arg first_padding=3`. Every (arm, seed) is a fresh
`fedvl run` process; the results JSON holds the command, per arm the mean ± std over seeds of
`mean_accuracy` from each run's summary.json, and the wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_result

# Arm name -> (method options, model options) switched from the paper's defaults.
ARMS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "paper (defaults)": ({}, {}),
    "init=real": ({"init": "real"}, {}),
    "contrastive=code": ({"contrastive": "code"}, {}),
    "importance_weights=softmax": ({"importance_weights": "softmax"}, {}),
    "latent_stats=running": ({"latent_stats": "running"}, {}),
    "first_padding=3": ({}, {"first_padding": "3"}),
}


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean, sample std (ddof 1, as `fedvl bench`) and count."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "n": len(values)}


def one_run(args: list[str], work: Path) -> dict:
    """One `fedvl run` in a fresh process: its summary's accuracy and the wall seconds."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "fedvl.cli", "run", *args, "--out", str(work),
                        "--quiet"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"fedvl run {' '.join(args)} failed ({p.returncode}):\n{p.stderr}")
    s = json.loads((work / "summary.json").read_text())
    return {"mean_accuracy": s["mean_accuracy"], "process_seconds": wall,
            "engine_wall_seconds": s.get("wall_seconds"),
            "method_args": s.get("method_args"), "model_args": s.get("model_args")}


def main() -> None:
    """Run every arm over the seeds and write the results JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--train-cap", type=int, default=200)
    ap.add_argument("--test-cap", type=int, default=100)
    ap.add_argument("--arms", help="comma-separated subset of: " + ", ".join(ARMS))
    ap.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="FedVCK option for every arm (e.g. steps=1000 on a GPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", default="benchmarks/results/fedvck-paper-forms-cpu.json")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    names = a.arms.split(",") if a.arms else list(ARMS)
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; allowed: {', '.join(ARMS)}")
    base = ["--method", "fedvck", "--benchmark", "digits-offline", "--rounds", str(a.rounds),
            "--train-cap", str(a.train_cap), "--test-cap", str(a.test_cap),
            "--device", a.device, *(["--threads", str(a.threads)] if a.threads else [])]
    for kv in a.method_arg:
        base += ["--method-arg", kv]
    load_start = list(os.getloadavg())
    t_all = time.perf_counter()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fedvck-forms-") as tmp:
        for name in names:
            margs, model_args = ARMS[name]
            args = [*base, *[x for k, v in margs.items() for x in ("--method-arg", f"{k}={v}")],
                    *[x for k, v in model_args.items() for x in ("--model-arg", f"{k}={v}")]]
            runs = {}
            for seed in seeds:
                work = Path(tmp) / f"{len(rows)}-{seed}"
                runs[seed] = one_run([*args, "--seed", str(seed)], work)
            acc = mean_std([r["mean_accuracy"] for r in runs.values()])
            rows[name] = {"method_args": margs, "model_args": model_args,
                          "mean_accuracy": acc,
                          "process_seconds": mean_std([r["process_seconds"]
                                                       for r in runs.values()]),
                          "runs": runs}
            print(f"{name:28s} {100 * acc['mean']:.2f} ± {100 * acc['std']:.2f} "
                  f"({sum(r['process_seconds'] for r in runs.values()):.0f} s)", flush=True)
    write_result(a.out, f"{os.cpu_count()}-core {a.device}, load average {load_start} at the "
                 f"start, {list(os.getloadavg())} at the end", {
                     "setting": {"benchmark": "digits-offline", "rounds": a.rounds,
                                 "train_cap": a.train_cap, "test_cap": a.test_cap,
                                 "seeds": seeds, "method_args_every_arm": a.method_arg,
                                 "fedvl_run_args": base},
                     "arms": rows, "wall_seconds": time.perf_counter() - t_all})


if __name__ == "__main__":
    main()

"""A data-centric method's round before and after a change of code, interleaved, with its FLOPs.

Runs `fedvl run --method M --seed 91 --train-cap 100 --rounds 1` (the default two workers) for
each method, alternating the two source trees (`--before-src`, e.g. a `git worktree` of the old
commit, and this checkout's `src`) so both see the same background load, and records the wall
time of the process, the run's round seconds and its accuracy. The GFLOP of the round are counted
once per tree in-process with one worker (every convolution and matrix product, forward and
backward, with torch's FLOP formulas: `fedvl.perf.synthesis.FlopCount`); a configuration gives the
same numbers on every worker count, so one worker counts what two run.

    git worktree add /tmp/before 0d35ef7
    python benchmarks/synthesis_round_ab.py --before-src /tmp/before/src \
        --methods fedvck,feddm --reps 3 --out benchmarks/results/synthesis-round-ab-cpu.json
    python benchmarks/synthesis_round_ab.py --before-src /tmp/before/src --methods fedlgd \
        --run-args "" --no-flops --reps 2 --out benchmarks/results/default-run-ab-cpu.json

`--run-args ""` times the default `fedvl run` (FedLGD, 20 rounds). Every run gets its own cache
directory holding only the cached benchmark images (`*.npz` of `$FEDVL_CACHE_DIR`), so no run
reuses another's distilled local virtual sets.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_result

HERE = Path(__file__).resolve().parent
AFTER_SRC = HERE.parent / "src"

# Runs in either tree: the old one has no fedvl.perf.synthesis, so the counter is spelled out.
COUNT = r"""
import json, sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from fedvl.config import RunConfig, resolve_model_args
from fedvl.run.experiment import run_experiment

class Count(TorchDispatchMode):
    total = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        f = flop_registry.get(func._overloadpacket)
        if f is not None:
            Count.total += int(f(*args, **kwargs, out_val=out))
        return out

cfg = resolve_model_args(RunConfig(method=sys.argv[1], seed=91, train_cap=100, rounds=1,
                                   workers=1))
with Count():
    s = run_experiment(cfg, out=sys.argv[2])
print(json.dumps({"gflop": Count.total / 1e9, "mean_accuracy": s["mean_accuracy"]}))
"""


def env_for(src: Path) -> dict[str, str]:
    """The environment that makes `src`'s fedvl the one imported."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
    return env


def fresh_cache(tmp: Path) -> Path:
    """A cache directory with the benchmark images of $FEDVL_CACHE_DIR and nothing else."""
    d = Path(tempfile.mkdtemp(dir=tmp, prefix="cache-"))
    src = os.environ.get("FEDVL_CACHE_DIR")
    if src and Path(src).is_dir():
        for f in Path(src).glob("*.npz"):
            (d / f.name).symlink_to(f.resolve())
    return d


def timed_run(src: Path, method: str, out: Path, run_args: list[str]) -> dict[str, float]:
    """One `fedvl run` of `method` with `src`'s code: process wall, round seconds, accuracy."""
    cmd = [sys.executable, "-m", "fedvl.cli", "run", "--method", method, *run_args, "--quiet",
           "--out", str(out)]
    env = env_for(src)
    env["FEDVL_CACHE_DIR"] = str(fresh_cache(out.parent))
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    s = json.loads((out / "summary.json").read_text())
    return {"process_seconds": wall, "round_seconds": s["wall_seconds"],
            "client_seconds": s["client_seconds"], "mean_accuracy": s["mean_accuracy"]}


def main() -> None:
    """Run the interleaved comparison and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-src", required=True, help="the old tree's src directory")
    ap.add_argument("--methods", default="fedvck,feddm")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-flops", action="store_true")
    ap.add_argument("--run-args", default="--seed 91 --train-cap 100 --rounds 1",
                    help="fedvl run arguments besides --method")
    ap.add_argument("--out", default="benchmarks/results/synthesis-round-ab-cpu.json")
    a = ap.parse_args()
    trees = {"before": Path(a.before_src).resolve(), "after": AFTER_SRC}
    methods = [m for m in a.methods.split(",") if m]
    load_start = os.getloadavg()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {m: {t: [] for t in trees}
                                                          for m in methods}
    flops: dict[str, dict[str, object]] = {m: {} for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for m in methods:
                order = list(trees) if rep % 2 == 0 else list(reversed(trees))
                for t in order:
                    r = timed_run(trees[t], m, Path(tmp) / f"{m}-{t}-{rep}",
                                  shlex.split(a.run_args))
                    runs[m][t].append(r)
                    print(m, t, rep, {k: round(v, 3) for k, v in r.items()}, flush=True)
        if not a.no_flops:
            for m in methods:
                for t, src in trees.items():
                    out = subprocess.run([sys.executable, "-c", COUNT, m, str(Path(tmp) / "c")],
                                         env=env_for(src), check=True, capture_output=True,
                                         text=True).stdout.strip().splitlines()[-1]
                    flops[m][t] = json.loads(out)
                    print(m, t, flops[m][t], flush=True)
    summary = {}
    for m in methods:
        med = {t: statistics.median(r["round_seconds"] for r in runs[m][t]) for t in trees}
        summary[m] = {"median_round_seconds": med,
                      "median_process_seconds": {t: statistics.median(
                          r["process_seconds"] for r in runs[m][t]) for t in trees},
                      "speedup_round": med["before"] / med["after"],
                      "gflop_round": {t: flops[m].get(t, {}).get("gflop") for t in trees}}
    write_result(a.out, {"cpu_count": os.cpu_count(), "load_average_start": load_start,
                         "load_average_end": os.getloadavg()}, {
        "setting": f"fedvl run --method M {a.run_args} (digits-offline, 5 clients, ConvNet "
                   "width 32, default 2 workers x 1 thread, a fresh cache of distilled sets per "
                   "run); GFLOP counted with 1 worker",
        "summary": summary, "runs": runs, "flops": flops,
    })
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

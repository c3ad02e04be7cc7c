"""Interleaved A/B of fedvl's allocator setting (`fedvl.engine.allocator`) on `fedvl run`.

  python benchmarks/allocator_ab.py --data-dir ../shared/data --reps 3 \
      --baseline-src /tmp/snap/src --result benchmarks/results/allocator-cpu.json

Each repetition runs, each in a fresh process, the perf workload (CIFAR-10, 10 clients x 200
images, Dirichlet 0.5, ConvNet width 32, FedAvg, 8 rounds) with `--workers 1` and `--workers 2`,
once with freed memory kept (fedvl's default) and once with `FEDVL_MALLOC=default` (glibc's own
thresholds), and, with `--baseline-src`, the same run on another source tree (the sequential
engine before parallel clients, with `--threads 2`). It records each run's median warm round
(rounds 2 to 7; the last round also evaluates), its minor page faults and peak RSS.
`--arms` picks a subset of the four fedvl arms; `--other-src LABEL=PATH` adds a run of another
source tree with `--workers 2` (an earlier commit, to measure one change on its own), and
`--flag-arm "LABEL=FLAGS"` a run of this tree with `--workers 2` and extra `fedvl run` flags
(`--arms ""` runs the flag arms alone).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_result

RUN = ["run", "--benchmark", "cifar10-dirichlet", "--num-clients", "10", "--train-cap", "200",
       "--test-cap", "100", "--alpha", "0.5", "--rounds", "8", "--eval-every", "8",
       "--method", "fedavg", "--quiet"]


def one(arm: str, extra: list[str], env: dict[str, str], data_dir: str, out: Path
        ) -> dict[str, object]:
    """Run `fedvl run` once in a child process; its warm round, faults, peak RSS, accuracy."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedvl.cli", *RUN, "--data-dir", data_dir,
                    "--out", str(out), *extra], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    history = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    warm = [r["seconds"] for r in history[1:-1]]
    summary = json.loads((out / "summary.json").read_text())
    return {"arm": arm, "warm_round_seconds": statistics.median(warm),
            "round_seconds": [r["seconds"] for r in history], "wall_seconds": wall,
            "minor_page_faults": after.ru_minflt - before.ru_minflt,
            # ru_maxrss of children is the largest child so far: an upper bound after the first.
            "max_child_rss_mib_so_far": after.ru_maxrss / 1024,
            "mean_accuracy": summary["mean_accuracy"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--baseline-src", default=None,
                   help="a source tree (its src/ folder) run with --threads 2 as the baseline")
    p.add_argument("--other-src", action="append", default=[], metavar="LABEL=PATH",
                   help="another source tree (its src/ folder) run with --workers 2")
    p.add_argument("--flag-arm", action="append", default=[], metavar="LABEL=FLAGS",
                   help="this tree with --workers 2 and the extra fedvl run FLAGS")
    p.add_argument("--arms", default="kept2,default2,kept1,default1",
                   help="fedvl arms to run: kept2, default2, kept1, default1 (comma-separated)")
    p.add_argument("--result", default="benchmarks/results/allocator-cpu.json")
    a = p.parse_args()
    base_env = {k: v for k, v in os.environ.items() if k != "FEDVL_MALLOC"}
    glibc = {**base_env, "FEDVL_MALLOC": "default"}
    known: dict[str, tuple[str, list[str], dict[str, str]]] = {
        "kept2": ("kept, 2 workers", ["--workers", "2"], base_env),
        "default2": ("glibc default, 2 workers", ["--workers", "2"], glibc),
        "kept1": ("kept, 1 worker", ["--workers", "1"], base_env),
        "default1": ("glibc default, 1 worker", ["--workers", "1"], glibc),
    }
    names = [n for n in a.arms.split(",") if n]
    bad = sorted(set(names) - set(known))
    if bad:
        p.error(f"unknown arm(s) {bad}; allowed: {sorted(known)}")
    arms = [known[n] for n in names]
    for spec in a.other_src:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            p.error(f"--other-src wants LABEL=PATH, got {spec!r}")
        arms.append((f"{label}, 2 workers", ["--workers", "2"], {**base_env, "PYTHONPATH": path}))
    for spec in a.flag_arm:
        label, sep, flags = spec.partition("=")
        if not sep or not label or not flags:
            p.error(f"--flag-arm wants LABEL=FLAGS, got {spec!r}")
        # Flags come last, so a --workers among them wins.
        arms.append((f"{label} ({flags})", ["--workers", "2", *shlex.split(flags)],
                     base_env))
    if a.baseline_src:
        arms.append(("baseline sequential engine, 2 torch threads", ["--threads", "2"],
                     {**base_env, "PYTHONPATH": a.baseline_src}))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for k, (arm, extra, env) in enumerate(arms):
                row = one(arm, extra, env, a.data_dir, Path(tmp) / f"r{rep}-{k}")
                row["rep"] = rep
                rows.append(row)
                print(f"{rep} {arm:45s} {row['warm_round_seconds']:.3f} s/round "
                      f"{row['minor_page_faults']:>9d} faults acc {row['mean_accuracy']:.4f}",
                      flush=True)
    medians = {arm: statistics.median(r["warm_round_seconds"] for r in rows if r["arm"] == arm)
               for arm, _, _ in arms}
    write_result(a.result, {"platform": platform.platform(), "processor": platform.processor(),
                            "cpu_count": os.cpu_count()},
                 {"median_warm_round_seconds": medians, "runs": rows})
    print(json.dumps(medians, indent=2))


if __name__ == "__main__":
    main()

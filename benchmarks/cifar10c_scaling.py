"""cifar10c: wall time per round and peak memory against the number of clients (19, 38, 57).

  python benchmarks/cifar10c_scaling.py --out /tmp/c10c-scale \
      --result benchmarks/results/cifar10c-scaling-cpu.json
Every configuration runs in its own process (`fedvl run`), so its peak resident memory
(ru_maxrss of that child) is its own: FedAvg with 1, 2 and 3 Dirichlet partitions per corruption
(19, 38, 57 clients over the same 171,000 training images), every client sampled every round,
then FedLGD on all 57 clients with a 0.2 client ratio. CPU scale: ConvNet width 16, 2 rounds.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from provenance import machine, write_result

COMMON = ("--benchmark cifar10c --data-dir ../shared/data --rounds 2 --eval-every 2 --threads 1 "
          "--width 16 --quiet")
RUNS = {
    "fedavg-19": "--method fedavg --partitions 1",
    "fedavg-38": "--method fedavg --partitions 2",
    "fedavg-57": "--method fedavg --partitions 3",
    "fedlgd-57-ratio0.2": "--method fedlgd --partitions 3 --client-ratio 0.2 "
                          "--method-arg warmup_steps=10 --method-arg local_dm_steps=2 "
                          "--method-arg server_gm_steps=5 --method-arg dsa=false",
}


def _child(cmd: str) -> None:
    """Run one `fedvl run` in this process and print its peak memory (KiB) last."""
    from fedvl.cli import main as fedvl_main

    rc = fedvl_main(shlex.split(cmd)[1:])
    print(json.dumps({"rc": rc, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    p.add_argument("--result")
    p.add_argument("--child")
    a = p.parse_args()
    if a.child:
        _child(a.child)
        return
    rows = {}
    for name, extra in RUNS.items():
        run_dir = Path(a.out) / name
        cmd = f"fedvl run {COMMON} {extra} --out {run_dir}"
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, __file__, "--child", cmd], capture_output=True,
                             text=True, check=True)
        wall = time.perf_counter() - t0
        child = json.loads(res.stdout.strip().splitlines()[-1])
        summary = json.loads((run_dir / "summary.json").read_text())
        rows[name] = {
            "command": cmd,
            "clients": len(summary["per_client_accuracy"]),
            "round_seconds": summary["round_seconds"],
            "process_wall_seconds": wall,
            "peak_rss_mib": child["maxrss_kib"] / 1024,
            "mean_accuracy": summary["mean_accuracy"],
        }
        print(name, json.dumps(rows[name]))
    write_result(a.result, machine("1 torch thread per run"), {"runs": rows,
              "note": "CPU scale (ConvNet width 16, 2 rounds, 1 thread); cifar10c severity 3, "
                      "alpha 2, cache warm (generation is measured separately in "
                      "docs/cifar10c.md). process_wall_seconds includes loading the 19 "
                      "corruptions from the cache and building the clients."})
    print(f"written: {a.result}")


if __name__ == "__main__":
    main()

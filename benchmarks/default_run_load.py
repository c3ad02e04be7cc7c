"""The default `fedvl run` quiet and beside busy processes, with libgomp's default wait and with
fedvl's passive wait (`GOMP_SPINCOUNT=300000` restores libgomp's default, which also keeps fedvl
from setting its own). Each run starts with an empty cache, in a fresh process.

    python benchmarks/default_run_load.py --load 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from omp_wait import _kill_tree, busy
from provenance import write_result

ARMS = {"passive wait (fedvl's)": {}, "libgomp's default wait": {"GOMP_SPINCOUNT": "300000"}}


def run_once(extra_env: dict[str, str]) -> dict[str, float]:
    """Wall seconds and mean accuracy of one default run with an empty cache."""
    tmp = Path(tempfile.mkdtemp(prefix="fedvl-default-"))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(extra_env, FEDVL_CACHE_DIR=str(tmp / "cache"))
    t = time.perf_counter()
    subprocess.run([shutil.which("fedvl") or "fedvl", "run", "--out", str(tmp / "run"),
                    "--quiet"], env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    return {"seconds": round(wall, 1), "mean_accuracy": summary["mean_accuracy"]}


def main() -> None:
    """Quiet runs of both arms, then both arms beside `--load` busy processes."""
    import multiprocessing

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/default-run-load-cpu.json")
    args = ap.parse_args()
    out: dict[str, dict[str, dict[str, float]]] = {"quiet": {}, f"{args.load} busy": {}}
    for cond in out:
        procs = []
        if cond != "quiet":
            procs = [multiprocessing.Process(target=busy, args=(time.time() + 3600,),
                                             daemon=True) for _ in range(args.load)]
            for p in procs:
                p.start()
        try:
            for arm, env in ARMS.items():
                out[cond][arm] = run_once(env)
                print(cond, arm, out[cond][arm], flush=True)
        finally:
            for p in procs:
                _kill_tree(p)
    write_result(args.out, f"{platform.machine()}, {os.cpu_count()} cores",
                 {"runs": "fedvl run --quiet (the bare default run: since 2026-11-26 "
                          "--preset quickstart, before that FedLGD's full defaults)",
                  "busy_processes": args.load, "results": out,
                  "load_average_at_end": list(os.getloadavg())})


if __name__ == "__main__":
    main()

"""Choose the bare `fedvl run` setting: candidate settings timed end to end with an empty cache.

  python benchmarks/quickstart_choice.py --out benchmarks/results/quickstart-choice-cpu.json \
      --candidate 'NAME=fedvl run args' ...
Each candidate runs `--reps` times in a fresh process with a fresh FEDVL_CACHE_DIR (as a new
user's first run) and records the process wall time, its peak resident memory, the phases of
`summary.json`, and the mean accuracy, so that the default can be picked on measured time and
accuracy together. An empty candidate times the default run as a user runs it:

  python benchmarks/quickstart_choice.py --out /tmp/default.json --reps 3 --candidate 'default='
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from provenance import write_result


def one_run(args: list[str]) -> dict:
    """One fresh-process run with an empty cache: wall seconds, peak memory, phases, accuracy."""
    work = Path(tempfile.mkdtemp(prefix="fedvl-qs-"))
    env = dict(os.environ, FEDVL_CACHE_DIR=str(work / "cache"))
    argv = [shutil.which("fedvl") or "fedvl", "run", *args, "--out", str(work / "run"),
            "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    # wait4 gives this child's own peak RSS; RUSAGE_CHILDREN would be the maximum over all runs.
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv)
    s = json.loads((work / "run" / "summary.json").read_text())
    shutil.rmtree(work, ignore_errors=True)
    return {"process_seconds": wall, "max_rss_kb": usage.ru_maxrss,
            "engine_wall_seconds": s.get("wall_seconds"),
            "time_by_phase": s.get("time_by_phase"), "mean_accuracy": s["mean_accuracy"],
            "method": s["method"], "rounds": s["rounds"],
            "bytes_by_kind": s.get("bytes_by_kind")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--candidate", action="append", required=True,
                   help="NAME=arguments of fedvl run")
    a = p.parse_args()
    rows = {}
    load_start = list(os.getloadavg())
    for cand in a.candidate:
        name, _, rest = cand.partition("=")
        runs = [one_run(shlex.split(rest)) for _ in range(a.reps)]
        rows[name] = {"args": rest, "runs": runs,
                      "median_process_seconds": statistics.median(
                          r["process_seconds"] for r in runs),
                      "mean_accuracy": runs[0]["mean_accuracy"]}
        print(f"{name}: {rows[name]['median_process_seconds']:.1f} s, "
              f"{rows[name]['mean_accuracy']:.4f}", flush=True)
    write_result(a.out, f"{os.cpu_count()}-core CPU, load average {load_start} at the start, "
                 f"{list(os.getloadavg())} at the end", {
                     "setting": "fresh process and empty FEDVL_CACHE_DIR per run (a new "
                                "user's first run)", "candidates": rows})


if __name__ == "__main__":
    main()

"""Time the default `fedvl run` end to end (a fresh process, as a user runs it).

  python benchmarks/default_run.py --out /tmp/default-run
Writes benchmarks/results/default-run-fedlgd.json: wall time, peak memory, the load average
before and at the end (a busy machine makes the time an upper bound) and the run's summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from provenance import provenance


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="/tmp/default-run")
    p.add_argument("--result", default="benchmarks/results/default-run-fedlgd.json")
    p.add_argument("extra", nargs="*", help="extra `fedvl run` arguments")
    a = p.parse_args()
    shutil.rmtree(a.out, ignore_errors=True)
    argv = [shutil.which("fedvl") or "fedvl", "run", "--out", a.out, "--quiet", *a.extra]
    load_before = list(os.getloadavg())
    t0 = time.perf_counter()
    subprocess.run(argv, check=True)
    elapsed = time.perf_counter() - t0
    rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    summary = json.loads((Path(a.out) / "summary.json").read_text())
    Path(a.result).write_text(json.dumps({
        **provenance(),
        "runs": " ".join(shlex.quote(x) for x in ["fedvl", *argv[1:]]),
        "machine": f"{os.cpu_count()}-core CPU, torch default threads",
        "load_average_before": load_before,
        "elapsed_seconds": elapsed,
        "max_rss_kb": rss_kb,
        "engine_wall_seconds": summary.get("wall_seconds"),
        "method": summary["method"],
        "benchmark": summary["benchmark"],
        "rounds": summary["rounds"],
        "per_client_accuracy": summary["per_client_accuracy"],
        "mean_accuracy": summary["mean_accuracy"],
        "bytes_up": summary["bytes_up"],
        "bytes_down": summary["bytes_down"],
        "bytes_by_kind": summary["bytes_by_kind"],
    }, indent=2))
    print(f"{elapsed:.1f} s, mean accuracy {summary['mean_accuracy']:.4f} -> {a.result}")


if __name__ == "__main__":
    main()

"""What each command imports before it works: `python -X importtime` per command, per tree.

  python benchmarks/startup_imports.py --before-src /tmp/before/src \
      --out benchmarks/results/startup-imports-cpu.json
For each command (run from a fresh process, cached data unless the row says empty cache) it
records the wall time and the third-party packages imported with their cumulative import time,
for this tree and optionally for an older one (`--before-src`, e.g. a `git worktree`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_result

COMMANDS = {
    "fedvl --help": ["--help"],
    "fedvl run --help": ["run", "--help"],
    "fedvl run --method fedavg --rounds 1 (cached data)": [
        "run", "--method", "fedavg", "--rounds", "1", "--quiet"],
    "fedvl run --method fedavg --rounds 1 (empty cache)": [
        "run", "--method", "fedavg", "--rounds", "1", "--quiet"],
}
LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def one(src: str, argv: list[str], cache: Path, empty: bool) -> dict:
    """Wall seconds and {top-level package: cumulative ms} of one fresh process."""
    if empty:
        shutil.rmtree(cache, ignore_errors=True)
    out = Path(tempfile.mkdtemp(prefix="fedvl-imp-"))
    extra = ["--out", str(out / "run")] if argv[0] == "run" and "--help" not in argv else []
    env = dict(os.environ, PYTHONPATH=src, FEDVL_CACHE_DIR=str(cache))
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "fedvl.cli", *argv, *extra],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    shutil.rmtree(out, ignore_errors=True)
    tops: dict[str, float] = {}
    for m in LINE.finditer(proc.stderr):
        name = m.group(4)
        root = name.split(".")[0]
        if root in ("fedvl",) or root.startswith("_"):
            continue
        # Cumulative time of a package's outermost import (its first appearance's total).
        tops[root] = max(tops.get(root, 0.0), int(m.group(2)) / 1000)
    big = {k: round(v, 1) for k, v in sorted(tops.items(), key=lambda kv: -kv[1]) if v >= 20}
    return {"seconds": round(wall, 2), "returncode": proc.returncode, "imports_ms": big}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--before-src", help="src/ of an older tree to compare with")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    trees = {"now": str(Path(__file__).resolve().parents[1] / "src")}
    if a.before_src:
        trees["before"] = a.before_src
    rows: dict[str, dict] = {}
    for label, argv in COMMANDS.items():
        rows[label] = {}
        for tree, src in trees.items():
            cache = Path(tempfile.gettempdir()) / f"fedvl-imp-cache-{tree}"
            empty = "empty cache" in label
            if not empty:
                one(src, ["run", "--method", "fedavg", "--rounds", "1", "--quiet"], cache, False)
            runs = [one(src, argv, cache, empty) for _ in range(a.reps)]
            rows[label][tree] = {"median_seconds": statistics.median(r["seconds"] for r in runs),
                                 "seconds": [r["seconds"] for r in runs],
                                 "imports_ms_first_run": runs[0]["imports_ms"]}
            print(label, tree, rows[label][tree]["median_seconds"],
                  list(runs[0]["imports_ms"])[:8], flush=True)
    write_result(a.out, f"{os.cpu_count()}-core CPU, load {list(os.getloadavg())} at the end",
                 {"setting": "python -X importtime -m fedvl.cli ..., a fresh process per run; "
                  "imports_ms: third-party top-level packages >= 20 ms, cumulative",
                  "trees": trees, "rows": rows})


if __name__ == "__main__":
    main()

"""Every registered method with `--preset smoke` (2 rounds on digits-offline), timed end to end.

Each run is a fresh `fedvl run --method M --preset smoke` process (start-up included), with its
own cache of distilled sets (the benchmark images are shared), one after another on an
otherwise quiet machine. The goal: every method under a minute. Each row also counts the
replies the server rejected: an honest run has none, so one is a reply bound that is too tight
for that method (`--run-args` runs every method in another setting, e.g. on local virtual
sets larger than the clients' real data).

    python benchmarks/smoke_preset.py --out benchmarks/results/smoke-preset-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_result

# What a method needs besides `--preset smoke` on digits-offline (FedDF, FCCL: a public set).
EXTRA = {"feddf": ["--public", "digits-offline"], "fccl": ["--public", "digits-offline"]}
# FedBN (`fedbn`, every BASE+fedbn) keeps BatchNorm layers local: it needs a model with some.
BATCH_NORM_ADDONS = {"fedbn"}


def extra_args(method: str) -> list[str]:
    """The flags `method` needs besides `--preset smoke`."""
    if method.rpartition("+")[2] in BATCH_NORM_ADDONS:
        return ["--norm", "batch"]
    return EXTRA.get(method, [])


def methods() -> list[str]:
    """Every registered method name, composed ones too (as `fedvl list` prints them)."""
    out = subprocess.run([sys.executable, "-m", "fedvl.cli", "list"], check=True,
                         capture_output=True, text=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("methods:"))
    return [m.strip() for m in line.split(":", 1)[1].split(",") if m.strip()]


def main() -> None:
    """Time every method's smoke run and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", help="comma-separated subset (default: every method)")
    ap.add_argument("--run-args", default="",
                    help="more `fedvl run` flags for every run, e.g. '--local-data virtual'")
    ap.add_argument("--out", default="benchmarks/results/smoke-preset-cpu.json")
    a = ap.parse_args()
    more = shlex.split(a.run_args)
    names = a.methods.split(",") if a.methods else methods()
    rows = {}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for m in names:
            cache = Path(tmp) / f"cache-{m}"
            cache.mkdir()
            for f in Path(os.environ.get("FEDVL_CACHE_DIR", "/nonexistent")).glob("*.npz"):
                (cache / f.name).symlink_to(f.resolve())
            out = Path(tmp) / m
            env = dict(os.environ, FEDVL_CACHE_DIR=str(cache))
            t = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "fedvl.cli", "run", "--method", m,
                                "--preset", "smoke", *extra_args(m), *more, "--quiet",
                                "--out", str(out)],
                               env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t
            row: dict = {"seconds": wall, "exit": p.returncode, "extra_args": extra_args(m)}
            if p.returncode == 0:
                s = json.loads((out / "summary.json").read_text())
                # An honest run has no rejected reply: one here is a bound that is too tight.
                row.update(mean_accuracy=s.get("mean_accuracy"), round_seconds=s["wall_seconds"],
                           time_by_phase=s.get("time_by_phase"),
                           rejected_replies=len(s.get("rejected_replies") or []))
            else:
                row["error"] = p.stderr.strip().splitlines()[-1:] if p.stderr else []
            rows[m] = row
            print(f"{m:22s} {wall:6.1f} s  exit {p.returncode}  "
                  f"acc {row.get('mean_accuracy')}", flush=True)
    slowest = max(rows, key=lambda k: rows[k]["seconds"])
    under_a_minute = all(r["seconds"] < 60 and r["exit"] == 0 for r in rows.values())
    write_result(a.out, {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                         "load_average_start": load_start, "load_average_end": os.getloadavg()}, {
        "setting": "fedvl run --method M --preset smoke (digits-offline, 5 clients, 2 rounds, "
                   "100 training and 100 test images per client)"
                   + (f" {a.run_args}" if a.run_args else ""),
        "runs_with_rejected_replies": sorted(m for m, r in rows.items()
                                             if r.get("rejected_replies")),
        "slowest": {"method": slowest, "seconds": rows[slowest]["seconds"]},
        "all_under_a_minute": under_a_minute, "runs": rows})
    print(f"slowest: {slowest} {rows[slowest]['seconds']:.1f} s; all under a minute: "
          f"{under_a_minute}")

if __name__ == "__main__":
    main()

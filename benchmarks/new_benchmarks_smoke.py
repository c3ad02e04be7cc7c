"""One short FedAvg run on each of `office-caltech10` and `cifar100-dirichlet`: mean accuracy and
wall time, each a fresh `fedvl run` process (start-up and data loading included).

    python benchmarks/new_benchmarks_smoke.py --out benchmarks/results/new-benchmarks-smoke-cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import machine, write_result

BENCHMARKS = ("office-caltech10", "cifar100-dirichlet")


def run(benchmark: str, data_dir: str, rounds: int, out: Path) -> dict[str, object]:
    """One `fedvl run` of FedAvg on `benchmark`: its command, exit code, seconds and accuracy."""
    # `--method fedavg` named: the run's default method is fedlgd.
    cmd = ["fedvl", "run", "--method", "fedavg", "--benchmark", benchmark, "--data-dir",
           data_dir, "--rounds", str(rounds), "--threads", "1", "--quiet", "--out", str(out)]
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "fedvl.cli", *cmd[1:]], capture_output=True,
                       text=True)
    row: dict[str, object] = {"command": " ".join(cmd[:-2]), "exit": p.returncode,
                              "process_seconds": round(time.perf_counter() - t, 1)}
    if p.returncode != 0:
        row["error"] = p.stderr.strip().splitlines()[-3:]
        return row
    s = json.loads((out / "summary.json").read_text())
    row.update({k: s.get(k) for k in ("mean_accuracy", "per_client_accuracy", "wall_seconds",
                                      "rounds", "threads")})
    return row


def main() -> None:
    """Run both benchmarks one after the other and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/new-benchmarks-smoke-cpu.json")
    a = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for b in BENCHMARKS:
            rows[b] = run(b, a.data_dir, a.rounds, Path(tmp) / b)
            print(b, rows[b], flush=True)
    write_result(a.out, machine("1 torch thread per run"), {
        "what": "FedAvg with the run defaults but --rounds and --threads 1; mean_accuracy is "
                "the unweighted mean over clients after the last round (fraction); "
                "process_seconds includes start-up and data loading",
        "runs": rows})


if __name__ == "__main__":
    main()

"""FedGAN against FedAvg on the embedded benchmark, one seed, a few rounds: a smoke comparison
(accuracy per round, wall time, bytes per round), each a fresh `fedvl run` process.

    python benchmarks/fedgan_smoke.py --out benchmarks/results/fedgan-smoke-cpu.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import machine, write_result

METHODS = ("fedavg", "fedgan")
KEPT = ("mean_accuracy", "per_client_accuracy", "accuracy_curve", "wall_seconds",
        "bytes_per_round", "bytes_by_kind", "bytes_up", "bytes_down", "method_args", "seed",
        "threads", "rejected_replies")


def run(method: str, args: argparse.Namespace, out: Path) -> dict[str, object]:
    """One `fedvl run` of `method` in a fresh process: its command, exit code, process seconds
    and the summary fields in KEPT (the last lines of its error output if it failed)."""
    flags = {"--method": method, "--benchmark": args.benchmark, "--rounds": args.rounds,
             "--threads": 1, "--seed": args.seed}
    argv = [str(v) for pair in flags.items() for v in pair]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fedvl.cli", "run", *argv, "--quiet",
                           "--out", str(out)], capture_output=True, text=True, check=False)
    seconds = round(time.perf_counter() - started, 1)
    summary = out / "summary.json"
    found = json.loads(summary.read_text()) if done.returncode == 0 else {}
    return {"command": shlex.join(["fedvl", "run", *argv]), "exit": done.returncode,
            "process_seconds": seconds, **{k: found.get(k) for k in KEPT if found},
            **({} if found else {"error": done.stderr.strip().splitlines()[-3:]})}


def main() -> None:
    """Run both methods one after the other and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--benchmark", default="digits-offline")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/fedgan-smoke-cpu.json")
    a = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in METHODS:
            rows[m] = run(m, a, Path(tmp) / m)
            print(m, {k: rows[m].get(k) for k in ("exit", "mean_accuracy", "wall_seconds")},
                  flush=True)
    write_result(a.out, machine("1 torch thread per run, the two runs one after the other"), {
        "what": "a smoke comparison, one seed: FedGAN (its defaults) against FedAvg with the "
                "run defaults but --benchmark, --rounds, --seed and --threads 1; mean_accuracy "
                "is the unweighted mean over clients after the last round (fraction), "
                "accuracy_curve the same after each round; process_seconds includes start-up "
                "and data loading; not the 3-seed comparison of FedVCK's Tables 2/3",
        "runs": rows})


if __name__ == "__main__":
    main()

"""Memory and time per round against the number of clients (10, 100, 1,000) at a fixed cohort.

digits-offline with `--partitions P` (5 styles x P Dirichlet(0.5) clients), the same 10,000
training images split ever finer, 10 clients sampled per round (`--client-ratio 10/N`), FedAvg
and SCAFFOLD (which keeps control variates for the clients it has seen), ConvNet width 32.
Each run is its own `fedvl run` process on warm disk caches; its peak RSS is sampled from
/proc every 50 ms, its round and evaluation times come from `metrics.jsonl`. The final
evaluation of every client runs on the workers, so fewer, larger clients peak higher there.
Idle clients should cost only their data: no model, optimiser or augmented copy is kept for a
client outside the round.

    python benchmarks/client_scaling.py --clients 10,100,1000 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from provenance import machine, write_result

from fedvl.perf.harness import run_process

COHORT = 10
TRAIN_PER_STYLE = 2000
TEST_PER_STYLE = 500


def run(method: str, clients: int, rounds: int, workers: int, out: Path) -> dict:
    """One `fedvl run` process: peak RSS, wall time, warm round and evaluation seconds."""
    parts = clients // 5
    cmd = [sys.executable, "-c", "from fedvl.cli import main; raise SystemExit(main())", "run",
           "--method", method, "--benchmark", "digits-offline", "--partitions", str(parts),
           "--train-cap", str(TRAIN_PER_STYLE), "--test-cap", str(TEST_PER_STYLE),
           "--client-ratio", str(COHORT / clients), "--rounds", str(rounds),
           "--eval-every", str(rounds), "--workers", str(workers), "--out", str(out), "--quiet"]
    # The peak is sampled from /proc (fedvl perf's sampler): a child's ru_maxrss starts at the
    # parent's resident size at fork, which here holds every federation built for the caches.
    start = time.perf_counter()
    code, _, peak, tail, _ = run_process(cmd, timeout=3600)
    wall = time.perf_counter() - start
    if code != 0 or peak is None:
        raise SystemExit(f"{method} with {clients} clients failed: {tail[-2000:]}")
    hist = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    train = [r["seconds"] - r.get("eval_seconds", 0.0) for r in hist]
    return {"method": method, "clients": clients, "partitions_per_style": parts,
            "cohort": COHORT, "peak_rss_mib": round(peak / 2**20, 1),
            "wall_seconds": round(wall, 2), "warm_round_seconds": round(
                statistics.median(train[1:]), 3), "round_seconds": [round(t, 3) for t in train],
            "final_eval_seconds": round(hist[-1].get("eval_seconds", 0.0), 2),
            "mean_accuracy": json.loads((out / "summary.json").read_text())["mean_accuracy"]}


def main() -> None:
    """Run every (method, clients) pair and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument("--methods", default="fedavg,scaffold")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/client-scaling-cpu.json")
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    # Fill the disk caches (rendered styles, partitions) first, so that no measured run pays
    # for generating images or importing the partitioner.
    from fedvl.config import RunConfig
    from fedvl.run.assemble import build_federation

    for n in counts:
        build_federation(RunConfig(benchmark="digits-offline", partitions=n // 5,
                                   train_cap=TRAIN_PER_STYLE, test_cap=TEST_PER_STYLE))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            for n in counts:
                row = run(method, n, args.rounds, args.workers, Path(tmp) / f"{method}-{n}")
                print(row, flush=True)
                rows.append(row)
    write_result(args.out, machine("shared"), {
        "setting": f"digits-offline, {TRAIN_PER_STYLE} train / {TEST_PER_STYLE} test images "
                   f"per style split into clients/5 Dirichlet(0.5) clients per style, "
                   f"{COHORT} clients per round, ConvNet width 32 depth 3, batch 32, 1 local "
                   f"epoch, {args.workers} workers, evaluation of every client after the "
                   "last round only",
        "rows": rows})


if __name__ == "__main__":
    main()

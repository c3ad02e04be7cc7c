"""Where a `fedvl run` peaks in memory: its resident set sampled every 20 ms, split at the first
round's start, the end of the last round's training and its evaluation.

    python benchmarks/rss_timeline.py --data-dir ../shared/data --reps 2 [--src OTHER/src]

The run is the perf workload (CIFAR-10, 10 clients x 200 images, Dirichlet 0.5, ConvNet width
32, FedAvg, 8 rounds, evaluation in the last round only, 2 workers); `--src` runs another source
tree (`git archive <commit> src`) instead of the installed fedvl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import machine, write_result

RUN = ["run", "--benchmark", "cifar10-dirichlet", "--num-clients", "10", "--train-cap", "200",
       "--test-cap", "100", "--alpha", "0.5", "--rounds", "8", "--eval-every", "8",
       "--method", "fedavg", "--workers", "2", "--quiet"]


def sample(data_dir: str, out: Path, src: str | None) -> dict[str, object]:
    """Run once; the peak RSS (MiB) before the first round, in training, in the evaluation."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "fedvl.cli", *RUN, "--data-dir", data_dir,
                             "--out", str(out)], env=env, stdout=subprocess.DEVNULL)
    samples: list[tuple[float, int]] = []
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS"):
                    samples.append((time.time(), int(line.split()[1]) // 1024))
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.02)
    if proc.wait() != 0:
        raise SystemExit(f"fedvl run failed with exit status {proc.returncode}")
    history = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    first = history[0]["time"] - history[0]["seconds"]
    last = history[-1]
    eval_start = last["time"] - last["eval_seconds"]

    def peak(a: float, b: float) -> int:
        return max((r for t, r in samples if a <= t < b), default=0)

    return {"peak_before_first_round_mib": peak(0, first),
            "peak_in_training_mib": peak(first, eval_start),
            "peak_in_evaluation_and_after_mib": peak(eval_start, float("inf")),
            "peak_mib": max(r for _, r in samples),
            "eval_seconds": last["eval_seconds"],
            "mean_accuracy": json.loads((out / "summary.json").read_text())["mean_accuracy"],
            "startup_seconds": round(first - t0, 2)}


def main() -> None:
    """Measure and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--src", default=None, help="another source tree's src/ folder")
    ap.add_argument("--result", default="benchmarks/results/rss-timeline-cpu.json")
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            row = sample(a.data_dir, Path(tmp) / f"r{rep}", a.src)
            print(row, flush=True)
            runs.append(row)
    write_result(a.result, machine(), {"src": a.src or "installed fedvl", "runs": runs})


if __name__ == "__main__":
    main()

"""The upload audit of every method that sends image-shaped tensors, on tiny default runs.

Each case runs `fedvl run`'s engine on digits-offline (5 clients, 3 x 28 x 28) with the method's
default settings unless the case names others, once with `--upload-guard 1` (audit only: what
each client would send) and once with the default guard (what it withholds). Per case: the
largest and smallest per-(client, round) |Pearson r| of an upload with the sender's private
images, how many (client, round) uploads pass the default guard, how many the guard withheld,
and whether the run completed. Writes benchmarks/results/upload-audit-cpu.json. The recorded run:
  python benchmarks/upload_audit.py
`--baseline` measures instead how close a client's private images are to one another (the
largest |r| of each image with another of the same client, and of the client's mean image with
its images), which is how to read an audit value on this data; the recorded run:
  python benchmarks/upload_audit.py --baseline \
      --out benchmarks/results/upload-audit-baseline-cpu.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from provenance import write_result

from fedvl.config import RunConfig
from fedvl.core.audit import DEFAULT_GUARD, max_correlation
from fedvl.run.assemble import build_federation
from fedvl.run.experiment import run_experiment

# (label, method, method args, train cap per client, rounds)
CASES: list[tuple[str, str, dict[str, Any], int, int]] = [
    ("feddm (init=real, default)", "feddm", {}, 100, 2),
    ("feddm init=noise", "feddm", {"init": "noise"}, 100, 2),
    ("feddm init=noise ipc=1, 1 image per class, 100 steps (default)", "feddm",
     {"init": "noise", "ipc": 1, "min_class_count": 1}, 10, 1),
    ("feddm init=noise ipc=1, 1 image per class, 400 steps", "feddm",
     {"init": "noise", "ipc": 1, "min_class_count": 1, "steps": 400}, 10, 1),
    ("feddm init=noise ipc=1, 1 image per class, 1500 steps", "feddm",
     {"init": "noise", "ipc": 1, "min_class_count": 1, "steps": 1500}, 10, 1),
    ("fedvck init=real (the reference code's default)", "fedvck", {"init": "real"}, 100, 2),
    ("fedvck (init=noise, default)", "fedvck", {"init": "noise"}, 100, 2),
    ("fedmix (mean_batch=0, default)", "fedmix", {}, 100, 2),
    ("fedmix mean_batch=2", "fedmix", {"mean_batch": 2}, 100, 2),
    ("desa (anchors from noise, default)", "desa", {}, 100, 2),
    ("centralised (raw data by design)", "centralised", {}, 100, 1),
]


def run_case(method: str, args: dict[str, Any], cap: int, rounds: int, guard: float,
             out: Path) -> dict[str, Any]:
    """One run: its audit entries and the rounds it skipped."""
    cfg = RunConfig(method=method, method_args=args, benchmark="digits-offline",
                    train_cap=cap, test_cap=100, rounds=rounds, upload_guard=guard)
    summary = run_experiment(cfg, out=out)
    return {"audit": summary["upload_audit"],
            "skipped_rounds": summary.get("skipped_rounds", [])}


def baseline(cap: int) -> list[dict[str, Any]]:
    """Per client: the largest and median |r| of each private image with its nearest other
    private image, and the largest |r| of the client's mean image with one of its images."""
    fed = build_federation(RunConfig(benchmark="digits-offline", train_cap=cap, test_cap=100))
    rows = []
    for c in fed.clients:
        x = c.x_train.reshape(len(c.x_train), -1)
        nearest = torch.stack([max_correlation(x[i:i + 1], torch.cat([x[:i], x[i + 1:]]))[0]
                               for i in range(len(x))])
        rows.append({"client": c.name, "images": len(x),
                     "nearest_other_max": float(nearest.max()),
                     "nearest_other_median": float(nearest.median()),
                     "client_mean_max": float(max_correlation(x.mean(0, keepdim=True), x)[0])})
    return rows


def main() -> None:
    """Run every case (or those whose label contains --only) and write the results file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the cases whose label contains this")
    ap.add_argument("--out", default="benchmarks/results/upload-audit-cpu.json")
    ap.add_argument("--baseline", action="store_true",
                    help="measure how close each client's private images are to one another")
    a = ap.parse_args()
    machine = f"2-core shared CPU (x86_64), torch {torch.__version__}, other jobs running"
    if a.baseline:
        rows = baseline(100)
        print(rows)
        write_result(a.out, machine, {"benchmark": "digits-offline",
                                      "train_cap_per_client": 100, "clients": rows})
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, method, args, cap, rounds) in enumerate(CASES):
            if a.only not in label:
                continue
            off = run_case(method, args, cap, rounds, 1.0, Path(tmp) / f"{i}-off")
            on = run_case(method, args, cap, rounds, DEFAULT_GUARD, Path(tmp) / f"{i}-on")
            corr = [e["max_corr"] for e in off["audit"]]
            row = {"case": label, "method": method, "method_args": args,
                   "train_cap_per_client": cap, "rounds": rounds,
                   "uploads_audited": len(corr),
                   "max_corr": max(corr, default=None), "min_corr": min(corr, default=None),
                   "above_guard": sum(c > DEFAULT_GUARD for c in corr),
                   "withheld_with_guard": sum(e["withheld"] for e in on["audit"]),
                   "skipped_rounds_with_guard": on["skipped_rounds"],
                   "completed": True}
            rows.append(row)
            print(row, flush=True)
    write_result(a.out, machine, {"guard": DEFAULT_GUARD,
                                                "benchmark": "digits-offline", "cases": rows})


if __name__ == "__main__":
    main()

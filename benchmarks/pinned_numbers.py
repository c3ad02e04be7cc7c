"""Pin what a fixed set of runs computes, so that a restructuring can prove it changed nothing.

  python benchmarks/pinned_numbers.py --out benchmarks/results/pinned-numbers-cpu.json
  python benchmarks/pinned_numbers.py --check benchmarks/results/pinned-numbers-cpu.json

Runs FedAvg, SCAFFOLD, FedLGD, DESA, FedDM and VHL on digits-offline with `--preset smoke`
(2 rounds, 100 training and test images per client), each in a fresh `fedvl run` process with
one torch thread, and keeps the numbers of each `summary.json` that training computes: per-client
accuracy and loss, the mean, the accuracy curve and the bytes per kind. `--check` runs the same
and compares them exactly (bit for bit: float equality), printing every difference; it exits
non-zero if any. Exact equality holds on one machine and torch build; another CPU may round
differently, so a check is meaningful against a file recorded on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import write_result

METHODS = ("fedavg", "scaffold", "fedlgd", "desa", "feddm", "vhl")
KEYS = ("per_client_accuracy", "per_client_loss", "mean_accuracy", "accuracy_curve",
        "bytes_up", "bytes_down", "bytes_by_kind", "train_samples")


def pinned(method: str, work: Path) -> dict:
    """The pinned numbers of one smoke run of `method`."""
    out = work / method
    cmd = [sys.executable, "-m", "fedvl.cli", "run", "--method", method, "--benchmark",
           "digits-offline", "--preset", "smoke", "--threads", "1", "--out", str(out),
           "--quiet"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}")
    s = json.loads((out / "summary.json").read_text())
    return {k: s.get(k) for k in KEYS}


def differences(old: object, new: object, where: str = "") -> list[str]:
    """Every path at which `new` differs from `old` (exact comparison)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in differences(old.get(k), new.get(k), f"{where}/{k}")]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True))
                for d in differences(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def main() -> None:
    """Record the pinned numbers, or check them against a recorded file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", help="write the numbers here")
    group.add_argument("--check", help="compare with the numbers recorded here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedvl-pinned-") as tmp:
        runs = {m: pinned(m, Path(tmp)) for m in METHODS}
    if a.out:
        write_result(a.out, f"{os.cpu_count()}-core CPU, one torch thread per run",
                     {"setting": "digits-offline --preset smoke --threads 1", "runs": runs})
        print(f"written: {a.out}")
        return
    found = differences(json.loads(Path(a.check).read_text())["runs"], runs)
    for d in found:
        print(d)
    print(f"{len(found)} difference(s) against {a.check}")
    raise SystemExit(1 if found else 0)


if __name__ == "__main__":
    main()

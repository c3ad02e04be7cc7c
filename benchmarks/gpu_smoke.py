"""Every method (and the DP, stacked, bf16 and per-client-model variants) with `--preset smoke`
on a GPU, beside the same run on the CPU: same seed, both recorded, accuracy compared.

    python benchmarks/gpu_smoke.py --out benchmarks/results/gpu-smoke-h200.json

Each run is a fresh `fedvl run` process with its own cache of distilled sets. The GPU runs go
`--gpu-jobs` at a time on the one GPU, the CPU runs `--cpu-jobs` at a time (one torch thread
each) beside them: wall times include process start and that contention, so they say a run
finishes, not how fast. A run passes when it exits 0 on both devices and the two mean
accuracies are within `--tolerance` (2 points: float rounding differs between the devices and
a smoke run's 2 rounds amplify it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from provenance import machine, write_result
from smoke_preset import extra_args, methods

VARIANTS = {
    "dp-fedavg": ["--method", "fedavg", "--method-arg", "dp_noise=1.0"],
    "dp-feddm": ["--method", "feddm", "--method-arg", "dp_noise=1.0", "--method-arg",
                 "init=noise"],
    "fedavg-stacked": ["--method", "fedavg", "--stack-clients"],
    "fedprox-bf16": ["--method", "fedprox", "--autocast", "bf16"],
    "desa-alternate": ["--method", "desa", "--client-models", "alternate"],
}


def flags(name: str) -> list[str]:
    """The `fedvl run` flags of configuration `name` (a method or a variant)."""
    if name in VARIANTS:
        return list(VARIANTS[name])
    return ["--method", name, *extra_args(name)]


def run_one(name: str, device: str, work: Path, timeout: float) -> dict:
    """One smoke run of `name` on `device`: exit code, wall seconds, mean accuracy, last lines."""
    out = work / f"{name}-{device}"
    env = {**os.environ, "FEDVL_CACHE_DIR": str(work / f"cache-{name}-{device}")}
    cmd = [sys.executable, "-m", "fedvl.cli", "run", *flags(name), "--benchmark",
           "digits-offline", "--preset", "smoke", "--seed", "0", "--device", device,
           "--out", str(out), "--quiet"]
    if device == "cpu":
        cmd += ["--threads", "1"]
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        rc, tail = p.returncode, (p.stderr or p.stdout).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, [f"timed out after {timeout:.0f} s"]
    row: dict = {"rc": rc, "wall_s": round(time.perf_counter() - start, 2)}
    summary = out / "summary.json"
    if rc == 0 and summary.is_file():
        row["mean_accuracy"] = json.loads(summary.read_text()).get("mean_accuracy")
    else:
        row["last_lines"] = tail
    return row


def main() -> None:
    """Run every configuration on both devices and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", help="comma-separated subset (default: every method and "
                                      "variant)")
    ap.add_argument("--gpu-jobs", type=int, default=8)
    ap.add_argument("--cpu-jobs", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--out", default="benchmarks/results/gpu-smoke.json")
    a = ap.parse_args()
    names = a.methods.split(",") if a.methods else [*methods(), *VARIANTS]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, \
            ThreadPoolExecutor(a.gpu_jobs) as gpu, ThreadPoolExecutor(a.cpu_jobs) as cpu:
        work = Path(tmp)
        futures = {n: (gpu.submit(run_one, n, a.device, work, a.timeout),
                       cpu.submit(run_one, n, "cpu", work, a.timeout)) for n in names}
        rows = {}
        for n, (fg, fc) in futures.items():
            g, c = fg.result(), fc.result()
            ok = g["rc"] == 0 and c["rc"] == 0 and abs(
                g["mean_accuracy"] - c["mean_accuracy"]) <= a.tolerance
            rows[n] = {a.device: g, "cpu": c, "pass": ok}
            acc = (f"{g.get('mean_accuracy', float('nan')):.3f} vs "
                   f"{c.get('mean_accuracy', float('nan')):.3f}")
            print(f"{'ok  ' if ok else 'FAIL'} {n:22s} rc {g['rc']}/{c['rc']} {acc} "
                  f"{g.get('last_lines', '')}", flush=True)
    passed = sum(r["pass"] for r in rows.values())
    print(f"{passed} of {len(rows)} configurations pass")
    gpu_name = ""
    try:
        import torch
        gpu_name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    except ImportError:
        pass
    write_result(a.out, machine(gpu_name), {
        "what": "fedvl run --preset smoke on digits-offline, seed 0, on the GPU and on the CPU "
                "(1 thread), every method and variant",
        "tolerance": a.tolerance, "gpu_jobs": a.gpu_jobs, "cpu_jobs": a.cpu_jobs,
        "wall_s_total": round(time.perf_counter() - start, 1), "passed": passed,
        "configurations": len(rows), "runs": rows})
    sys.exit(0 if passed == len(rows) else 1)


if __name__ == "__main__":
    main()

"""Speed under load: OpenMP's spin-waiting threads against passive ones.

A server gradient-matching step (FedLGD's global refresh: a double backward through the ConvNet,
width 32, 100 synthetic and 320 real 28-px images) runs on 2 torch threads in a fresh process
per setting, with `OMP_WAIT_POLICY` unset (libgomp's default: a thread that reaches a barrier
spins about 300,000 times before it sleeps), `PASSIVE` (it sleeps at once) or
`GOMP_SPINCOUNT=10000` (a short spin), and with 1 thread as the reference.
Each setting runs on an otherwise quiet machine and beside two kinds of load: `--load` pure
Python busy loops (one per core by default), and one other torch process on every core running
the same step with libgomp's default wait (another training job on a shared machine, whose
threads spin at barriers too). Settings are interleaved over `--reps` repetitions so they see
the same background.

    python benchmarks/omp_wait.py --reps 3 --out benchmarks/results/omp-wait-cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time

from provenance import write_result

CHILD = r"""
import json, sys, time
import torch
import torch.nn.functional as F
from fedvl.models.base import build_model

torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
model = build_model("convnet", 3, 10, 28, width=32, depth=3, norm="instance")
params = list(model.parameters())
xs = torch.randn(100, 3, 28, 28, requires_grad=True)
ys = torch.arange(10).repeat_interleave(10)
xr = torch.randn(320, 3, 28, 28)
yr = torch.arange(10).repeat_interleave(32)

def step():
    gr = torch.autograd.grad(F.cross_entropy(model(xr), yr), params)
    gs = torch.autograd.grad(F.cross_entropy(model(xs), ys), params, create_graph=True)
    loss = sum(((a - b) ** 2).sum() for a, b in zip(gs, gr))
    torch.autograd.grad(loss, [xs])

step()
t = time.perf_counter()
for _ in range(int(sys.argv[2])):
    step()
print(json.dumps((time.perf_counter() - t) / int(sys.argv[2]) * 1000))
"""

# name -> (torch threads, environment for libgomp)
SETTINGS = {"2 threads, default wait": (2, {}),
            "2 threads, passive wait": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
            "2 threads, spin 10k": (2, {"GOMP_SPINCOUNT": "10000"}),
            "1 thread": (1, {})}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def busy(stop_at: float) -> None:
    """Keep one core busy until `stop_at` (a competing process on a shared machine)."""
    x = 0
    while time.time() < stop_at:
        x += 1


def torch_load(stop_at: float) -> None:
    """Another torch job on every core until `stop_at`: the measured step in a loop."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    loop = CHILD.replace("for _ in range(int(sys.argv[2])):", "while time.time() < "
                         f"{stop_at}:")
    subprocess.run([sys.executable, "-c", loop, str(os.cpu_count() or 2), "1"], env=env,
                   capture_output=True, check=False)


def measure(threads: int, omp: dict[str, str], steps: int) -> float:
    """Milliseconds per step in a fresh process with that thread count and libgomp setting."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env.update(omp)
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(steps)], env=env,
                         capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def _kill_tree(p: multiprocessing.Process) -> None:
    """Stop a load process and the torch child it started."""
    subprocess.run(["pkill", "-P", str(p.pid)], check=False)
    p.kill()


def main() -> None:
    """Run every setting quiet and under load; write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2,
                    help="busy processes beside the measured one in the loaded condition")
    ap.add_argument("--out", default="benchmarks/results/omp-wait-cpu.json")
    args = ap.parse_args()
    conds = ("quiet", "python load", "torch load")
    results: dict[str, dict[str, list[float]]] = {c: {} for c in conds}
    for cond in conds:
        procs = []
        stop_at = time.time() + 3600
        if cond == "python load":
            procs = [multiprocessing.Process(target=busy, args=(stop_at,), daemon=True)
                     for _ in range(args.load)]
        elif cond == "torch load":
            procs = [multiprocessing.Process(target=torch_load, args=(stop_at,), daemon=True)]
        if procs:
            for p in procs:
                p.start()
            time.sleep(3)   # the load is running before the first measurement
        try:
            for _ in range(args.reps):
                for name, (threads, omp) in SETTINGS.items():
                    ms = measure(threads, omp, args.steps)
                    results[cond].setdefault(name, []).append(round(ms, 1))
                    print(cond, name, f"{ms:.0f} ms/step", flush=True)
        finally:
            for p in procs:
                _kill_tree(p)
    summary = {cond: {name: statistics.median(v) for name, v in r.items()}
               for cond, r in results.items()}
    write_result(args.out, f"{platform.processor() or platform.machine()}, "
                 f"{os.cpu_count()} cores",
                 {"load_processes": args.load, "steps_per_measurement": args.steps,
                  "ms_per_step": results, "median_ms_per_step": summary,
                  "load_average_at_end": list(os.getloadavg())})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

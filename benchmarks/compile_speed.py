"""Speed: a training step of the perf workload's ConvNet, eager against `torch.compile`.

The model (width 32 or as given, depth 3, 32 px, batch 32, SGD with momentum 0.9) is compiled
once with the default inductor backend; the compile time is the first three steps' wall time.
Eager and compiled steps are then timed in interleaved repetitions on the same model.

    python benchmarks/compile_speed.py --reps 3
    python benchmarks/compile_speed.py --device cuda --width 128 \
        --out benchmarks/results/compile-speed-gpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from provenance import write_result

from fedvl.engine.allocator import keep_freed_memory
from fedvl.models.base import build_model


def main() -> None:
    """Measure and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--out", default="benchmarks/results/compile-speed-cpu.json")
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, 32, 32, generator=gen).to(dev)
    y = torch.randint(0, 10, (200,), generator=gen).to(dev)
    model = build_model("convnet", 3, 10, 32, seed=0, width=args.width, depth=3).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def steps(forward: Callable[[torch.Tensor], torch.Tensor], n: int) -> float:
        """Milliseconds per step of `n` SGD steps through `forward`."""
        sync()
        t = time.perf_counter()
        for _ in range(n):
            idx = torch.randint(0, 200, (32,), generator=gen).to(dev)
            loss = F.cross_entropy(forward(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sync()
        return (time.perf_counter() - t) / n * 1000

    t = time.perf_counter()
    compiled = torch.compile(model)
    steps(compiled, 3)
    compile_s = time.perf_counter() - t
    steps(model, 3)
    eager, fast = [], []
    for rep in range(args.reps):
        eager.append(steps(model, args.steps))
        fast.append(steps(compiled, args.steps))
        print(rep, f"eager {eager[-1]:.2f} ms, compiled {fast[-1]:.2f} ms", flush=True)
    med_e, med_c = statistics.median(eager), statistics.median(fast)
    machine = (f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}"
               if dev.type == "cuda" else f"{os.cpu_count()}-core CPU ({platform.machine()}), "
               f"torch {torch.__version__}, 1 torch thread")
    write_result(args.out, machine, {
        "setting": f"ConvNet width {args.width} depth 3, 32 px, batch 32, SGD momentum 0.9, "
                   "torch.compile default (inductor)",
        "compile_and_first_3_steps_seconds": round(compile_s, 1),
        "eager_ms_per_step": [round(v, 2) for v in eager],
        "compiled_ms_per_step": [round(v, 2) for v in fast],
        "speedup": round(med_e / med_c, 3)})
    print(f"eager {med_e:.2f} ms, compiled {med_c:.2f} ms, compile {compile_s:.1f} s")


if __name__ == "__main__":
    main()

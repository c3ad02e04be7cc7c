"""How much slower a client's training step runs when two run at once, on threads or processes.

One training step: the perf workload's ConvNet (width 32, depth 3, 32 px), SGD with momentum
0.9, batch 32, one torch thread, freed memory kept. Milliseconds per step of one model alone,
of two models on two threads of one process (fedvl's `--workers 2`) and of two models in two
processes (started together at a barrier), interleaved over repetitions; and how often each
training thread waited (voluntary context switches per step).

    python benchmarks/step_contention.py --reps 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from fedvl.engine.allocator import keep_freed_memory
from fedvl.models.base import build_model

WARMUP = 20


def _train(steps: int, seed: int) -> tuple[float, float]:
    """Milliseconds per step of `steps` SGD steps on one thread, after a warm-up, and the
    thread's voluntary context switches (waits) per step."""
    torch.set_num_threads(1)
    model = build_model("convnet", 3, 10, 32, seed=seed, width=32, depth=3)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (200,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    t, waits = 0.0, 0
    for s in range(WARMUP + steps):
        if s == WARMUP:
            t = time.perf_counter()
            waits = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        idx = torch.randint(0, 200, (32,), generator=gen)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    ms = (time.perf_counter() - t) / steps * 1000
    return ms, (resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - waits) / steps


def _threads(n: int, steps: int) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = [(0.0, 0.0)] * n

    def one(i: int) -> None:
        out[i] = _train(steps, i)

    ths = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return out


def _proc(q: mp.Queue, bar: mp.Barrier, steps: int, seed: int) -> None:  # type: ignore[type-arg]
    keep_freed_memory()
    bar.wait()
    q.put(_train(steps, seed))


def _processes(n: int, steps: int) -> list[tuple[float, float]]:
    ctx = mp.get_context("fork")
    q, bar = ctx.Queue(), ctx.Barrier(n)
    ps = [ctx.Process(target=_proc, args=(q, bar, steps, i)) for i in range(n)]
    for p in ps:
        p.start()
    out = [q.get() for _ in ps]
    for p in ps:
        p.join()
    return out


def main() -> None:
    """Measure and write the JSON."""
    from provenance import write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/step-contention-cpu.json")
    args = ap.parse_args()
    keep_freed_memory()
    rows: dict[str, list[float]] = {"alone": [], "2 threads": [], "2 processes": []}
    waits: dict[str, list[float]] = {k: [] for k in rows}
    for rep in range(args.reps):
        for name, got in (("alone", _threads(1, args.steps)),
                          ("2 threads", _threads(2, args.steps)),
                          ("2 processes", _processes(2, args.steps))):
            rows[name].append(statistics.mean(ms for ms, _ in got))
            waits[name].append(statistics.mean(w for _, w in got))
        print(rep, {k: round(v[-1], 2) for k, v in rows.items()},
              {k: round(v[-1], 1) for k, v in waits.items()}, flush=True)
    med = {k: round(statistics.median(v), 2) for k, v in rows.items()}
    write_result(args.out, f"{os.cpu_count()}-core CPU ({platform.machine()}), torch "
                 f"{torch.__version__}", {
                     "ms_per_step": rows, "median_ms_per_step": med,
                     "voluntary_context_switches_per_step": waits,
                     "slowdown_when_two_run": {k: round(med[k] / med["alone"], 3)
                                               for k in ("2 threads", "2 processes")}})
    print(med)


if __name__ == "__main__":
    main()

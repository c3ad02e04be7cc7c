"""Training FLOPs of the perf workload and the machine's dense-matmul rate, its real ceiling.

`round_flops` counts, with `torch.utils.flop_counter.FlopCounterMode`, the floating-point
operations of one round of the workload: every client's batches, forward, loss and backward,
at the batch sizes the engines use (the last batch of a client may be smaller). The counter
sees matrix products and convolutions only (elementwise work such as normalisation, ReLU,
pooling and the optimiser step is not counted), so the figure is the workload's useful
compute, the same for every engine that runs its steps. `matmul_rate` times a square fp32
matrix product large enough to be compute-bound: the rate no training loop on this machine
can beat with the same threads.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

# Side of the square matrices timed on the CPU: 2 * 2048^3 = 17.2 GFLOP per product, large
# enough that the BLAS kernel, not memory or call overhead, sets the time.
CPU_MATMUL_N = 2048
# A GPU needs larger products to fill its units.
GPU_MATMUL_N = 8192


def training_step_flops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """FLOPs of one training step of `model` on batch (x, y): forward, cross-entropy, backward."""
    # A copy: the counted backward must not leave gradients on the caller's model.
    net = copy.deepcopy(model).train()
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(net(x), y).backward()
    return int(counter.get_total_flops())


def batch_sizes(n: int, batch_size: int) -> list[int]:
    """The batch sizes of one epoch over `n` images (the last one may be smaller)."""
    return [min(batch_size, n - i) for i in range(0, n, batch_size)]


def round_flops(model: torch.nn.Module, train: Iterable[tuple[torch.Tensor, torch.Tensor]],
                batch_size: int) -> int:
    """FLOPs of one round: one epoch of training steps over every client's (x, y)."""
    per_size: dict[int, int] = {}   # counted once per distinct batch size
    total = 0
    for x, y in train:
        for b in batch_sizes(len(y), batch_size):
            if b not in per_size:
                per_size[b] = training_step_flops(model, x[:b], y[:b])
            total += per_size[b]
    return total


def matmul_rate(threads: int, device: str = "cpu", n: int | None = None, repeats: int = 5
                ) -> dict[str, Any]:
    """GFLOP/s of an n x n fp32 matrix product on `device` with `threads` torch threads (CPU),
    best of `repeats` (the one least slowed by other work), and how it was measured."""
    dev = torch.device(device)
    n = n or (GPU_MATMUL_N if dev.type == "cuda" else CPU_MATMUL_N)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g, device=g.device).to(dev)
        b = torch.randn(n, n, generator=g, device=g.device).to(dev)
        out = torch.empty(n, n, device=dev)

        def sync() -> None:
            # The product is timed when the device has run it, not when it was queued.
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        torch.matmul(a, b, out=out)   # warm-up: thread pool, kernel selection
        sync()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            torch.matmul(a, b, out=out)
            sync()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    info: dict[str, Any] = {"gflops": 2 * n**3 / best / 1e9, "n": n, "dtype": "float32",
                            "repeats": repeats, "best_seconds": best, "device": str(dev)}
    if dev.type == "cpu":
        info["threads"] = threads
    else:
        # Whether cuBLAS may use TF32 for fp32 products, which changes the rate.
        info["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    return info

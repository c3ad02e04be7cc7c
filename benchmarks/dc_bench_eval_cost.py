"""What `fedvl distill --protocol dc-bench`'s evaluation costs on this machine.

  python benchmarks/dc_bench_eval_cost.py --out benchmarks/results/dc-bench-eval-cost-amd-cpu.json

Times fedvl's evaluation loop (`fedvl.distill.evaluate.train_on_set`: DSA, SGD 0.01, momentum
0.9, weight decay 5e-4, batch 256) on one ConvNet-3 width 128 with instance norm, training on a
CIFAR-shaped IPC-10 set (100 images: one step per epoch), one torch thread, and extrapolates to
the protocol's 5 models x 1,000 epochs per evaluated set.
"""

from __future__ import annotations

import argparse
import time

import torch
from provenance import machine, write_result

from fedvl.distill.evaluate import EvalConfig, train_on_set
from fedvl.models.base import build_model

MODELS, EPOCHS = 5, 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20, help="timed epochs (after 2 of warm-up)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(100, 3, 32, 32)
    y = torch.arange(10).repeat_interleave(10)
    model = build_model("convnet", 3, 10, 32, seed=0, width=128, depth=3, norm="instance")
    g = torch.Generator().manual_seed(0)
    train_on_set(model, x, y, EvalConfig(epochs=2), g)   # warm-up
    t0 = time.perf_counter()
    train_on_set(model, x, y, EvalConfig(epochs=a.epochs), g)
    per_epoch = (time.perf_counter() - t0) / a.epochs
    write_result(a.out, machine("one torch thread"), {
        "command": f"python benchmarks/dc_bench_eval_cost.py --epochs {a.epochs} --out {a.out}",
        "seconds_per_epoch": per_epoch,
        "protocol_hours_per_set": per_epoch * EPOCHS * MODELS / 3600,
        "protocol_hours_distilled_and_random_real": 2 * per_epoch * EPOCHS * MODELS / 3600})
    print(f"{per_epoch:.3f} s per epoch; {2 * per_epoch * EPOCHS * MODELS / 3600:.2f} h for "
          "the protocol's two sets")


if __name__ == "__main__":
    main()

"""Speed: the ConvNet's strided 2x2 average pool against torch's `avg_pool2d` kernel on CPU.

Per activation shape (one torch thread), forward time of both, interleaved over repetitions so
both see the same background load; then a whole training step (SGD, cross-entropy) of the
ConvNet with either pool, and whether the weights after the steps are identical.

    python benchmarks/pool_speed.py --reps 5
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.models.convnet import ConvNet
from fedvl.models.pooling import AvgPool2x2, _Pool2x2, _strided_pays

SHAPES = [(n, w, s, s) for w in (32, 128) for n in (32, 420) for s in (32, 28, 14, 7)]


def timed(fn, iters: int) -> float:
    """Milliseconds per call of `fn` after one warm-up call."""
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1000


def kernel_model(model: ConvNet) -> ConvNet:
    """A copy of `model` with torch's own AvgPool2d in place of the strided pool."""
    out = copy.deepcopy(model)
    for i, layer in enumerate(out.features):
        if isinstance(layer, AvgPool2x2):
            out.features[i] = nn.AvgPool2d(2, 2)
    return out


def main() -> None:
    """Measure and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/pool-speed-cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pools = []
    for shape in SHAPES:
        if shape[2] % 2:
            continue
        x = torch.randn(*shape)
        iters = max(2, int(2e7 / x.numel()))
        k, s = [], []
        for _ in range(args.reps):
            k.append(timed(lambda x=x: F.avg_pool2d(x, 2, 2), iters))
            s.append(timed(lambda x=x: _Pool2x2.apply(x), iters))
        row = {"shape": list(shape), "kernel_ms": round(statistics.median(k), 3),
               "strided_ms": round(statistics.median(s), 3), "used": "strided"
               if _strided_pays(x) else "kernel"}
        row["speedup"] = round(row["kernel_ms"] / row["strided_ms"], 2)
        pools.append(row)
        print(row, flush=True)
    steps = []
    for size, width in ((28, 32), (32, 32), (32, 128)):
        torch.manual_seed(0)
        fast = ConvNet(3, 10, size, width=width)
        slow = kernel_model(fast)
        x, y = torch.randn(32, 3, size, size), torch.randint(0, 10, (32,))
        times: dict[str, list[float]] = {"strided": [], "kernel": []}
        for _ in range(args.reps):
            for name, model in (("strided", fast), ("kernel", slow)):
                opt = torch.optim.SGD(model.parameters(), lr=0.01)

                def step(model=model, opt=opt, x=x, y=y) -> None:
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                times[name].append(timed(step, 10))
        same = all(torch.equal(p, q) for p, q in zip(fast.parameters(), slow.parameters(),
                                                      strict=True))
        row = {"image_size": size, "width": width, "batch": 32,
               "kernel_ms": round(statistics.median(times["kernel"]), 2),
               "strided_ms": round(statistics.median(times["strided"]), 2),
               "identical_weights": same}
        steps.append(row)
        print(row, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python benchmarks/pool_speed.py " + shlex.join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core shared CPU ({platform.machine()}), torch "
                   f"{torch.__version__}, 1 torch thread",
        "pool_forward": pools, "train_step": steps}, indent=1) + "\n")


if __name__ == "__main__":
    main()

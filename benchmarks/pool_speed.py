"""Speed: the ConvNet's strided 2x2 average pool against torch's `avg_pool2d` kernel on CPU.

Per activation shape (one torch thread), forward time of both, interleaved over repetitions so
both see the same background load; the backward of both, and of the strided pool's earlier
backward (a reshape of the expanded gradient); then a whole training step (SGD, cross-entropy)
of the ConvNet with the kernel, the strided pool, and the strided pool with its earlier backward,
and whether the weights after the steps are identical.

    python benchmarks/pool_speed.py --reps 5
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import statistics
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from provenance import write_result
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


def reshape_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    """The strided pool's earlier backward: the expanded gradient reshaped (one slow copy)."""
    n, c, h2, w2 = grad.shape
    spread = (grad * 0.25)[:, :, :, None, :, None].expand(n, c, h2, 2, w2, 2)
    return spread.reshape(n, c, 2 * h2, 2 * w2)


@contextlib.contextmanager
def earlier_backward() -> Iterator[None]:
    """Swap the strided pool's backward for the earlier one inside the block."""
    now = _Pool2x2.backward
    _Pool2x2.backward = staticmethod(reshape_backward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        _Pool2x2.backward = staticmethod(now)  # type: ignore[method-assign]


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
    backs = []
    for shape in SHAPES:
        if shape[2] % 2:
            continue
        x = torch.randn(*shape)
        g = torch.randn(shape[0], shape[1], shape[2] // 2, shape[3] // 2)
        iters = max(2, int(2e7 / x.numel()))
        times = {"kernel": [], "reshape": [], "strided": []}
        with torch.no_grad():
            for _ in range(args.reps):
                times["kernel"].append(timed(lambda g=g, x=x: torch.ops.aten.avg_pool2d_backward(
                    g, x, [2, 2], [2, 2], [0, 0], False, True, None), iters))
                times["reshape"].append(timed(lambda g=g: reshape_backward(None, g), iters))
                times["strided"].append(timed(lambda g=g: _Pool2x2.backward(None, g), iters))
        brow: dict[str, object] = {"shape": list(shape)}
        brow.update({f"{k}_ms": round(statistics.median(v), 3) for k, v in times.items()})
        brow["speedup_over_reshape"] = round(brow["reshape_ms"] / brow["strided_ms"], 2)
        backs.append(brow)
        print(brow, flush=True)
    steps = []
    for size, width in ((28, 32), (32, 32), (32, 128)):
        torch.manual_seed(0)
        fast = ConvNet(3, 10, size, width=width)
        slow = kernel_model(fast)
        x, y = torch.randn(32, 3, size, size), torch.randint(0, 10, (32,))
        earlier = copy.deepcopy(fast)
        times: dict[str, list[float]] = {"strided": [], "kernel": [], "reshape_backward": []}
        for _ in range(args.reps):
            for name, model in (("strided", fast), ("kernel", slow),
                                ("reshape_backward", earlier)):
                opt = torch.optim.SGD(model.parameters(), lr=0.01)

                def step(model=model, opt=opt, x=x, y=y) -> None:
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                with (earlier_backward() if name == "reshape_backward"
                      else contextlib.nullcontext()):
                    times[name].append(timed(step, 10))
        same = all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(
            fast.parameters(), slow.parameters(), earlier.parameters(), strict=True))
        row = {"image_size": size, "width": width, "batch": 32,
               "kernel_ms": round(statistics.median(times["kernel"]), 2),
               "strided_ms": round(statistics.median(times["strided"]), 2),
               "strided_reshape_backward_ms": round(statistics.median(
                   times["reshape_backward"]), 2),
               "identical_weights": same}
        steps.append(row)
        print(row, flush=True)
    write_result(args.out, f"{os.cpu_count()}-core shared CPU ({platform.machine()}), torch "
                 f"{torch.__version__}, 1 torch thread",
                 {"pool_forward": pools, "pool_backward": backs, "train_step": steps})

if __name__ == "__main__":
    main()

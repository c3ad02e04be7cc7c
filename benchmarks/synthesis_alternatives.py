"""Alternatives to the synthesis step's building blocks, measured against what fedvl runs.

Each row times fedvl's way and an alternative in the same process, interleaved, on one torch
thread per computation (a client's), and keeps the minimum and the median over repetitions:

- `gm_norm`: one class's gradient-matching step (CE gradient of 10 real images, the same with
  a graph for 10 synthetic ones, the squared difference, its gradient w.r.t. the synthetic
  images) on the width-32 ConvNet with its GroupNorm, with a GroupNorm written in elementary
  ops, and with `F.instance_norm`; with the relative difference of the image gradient.
- `pass_split`: a DM step's real pass (no graph) and synthetic pass (forward and image
  gradient) one after the other, and the real pass on a second thread while the synthetic
  forward runs (each pass on one thread, so the gradient is the same bit for bit).
- `gn_double_backward_share`: the share of a FedLGD server matching step (`fedvl perf
  --distill`'s `target-gradient` case) spent under GroupNorm's double backward
  (`NativeGroupNormBackward0`), from torch's profiler.

    python benchmarks/synthesis_alternatives.py \
        --out benchmarks/results/synthesis-alternatives-amd-cpu.json
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from provenance import machine, write_result


def timed(fns: dict[str, Callable[[], object]], reps: int, inner: int) -> dict[str, dict]:
    """Milliseconds per call of each function: min and median over `reps` interleaved blocks
    of `inner` calls (after two warm-up calls each)."""
    for f in fns.values():
        f()
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for rep in range(reps):
        order = list(fns) if rep % 2 == 0 else list(reversed(fns))
        for k in order:
            t = time.perf_counter()
            for _ in range(inner):
                fns[k]()
            times[k].append((time.perf_counter() - t) / inner * 1e3)
    return {k: {"min_ms": min(v), "median_ms": statistics.median(v)} for k, v in times.items()}


def gm_norm(reps: int) -> dict:
    """One class's gradient-matching step under three forms of instance norm."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from fedvl.models.base import build_model

    class Elementary(nn.Module):
        def __init__(self, gn: nn.GroupNorm) -> None:
            super().__init__()
            self.weight, self.bias, self.eps = gn.weight, gn.bias, gn.eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mu = x.mean((2, 3), keepdim=True)
            d = x - mu
            var = (d * d).mean((2, 3), keepdim=True)
            return (d * torch.rsqrt(var + self.eps) * self.weight[:, None, None]
                    + self.bias[:, None, None])

    class Instance(Elementary):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.instance_norm(x, weight=self.weight, bias=self.bias, eps=self.eps)

    base = build_model("convnet", 3, 10, 28, seed=0, width=32, depth=3, norm="instance")
    models = {"groupnorm (fedvl)": base}
    for name, cls in (("elementary ops", Elementary), ("F.instance_norm", Instance)):
        m = copy.deepcopy(base)
        for i, layer in enumerate(m.features):
            if isinstance(layer, nn.GroupNorm):
                m.features[i] = cls(layer)
        models[name] = m
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(10, 3, 28, 28, generator=g).requires_grad_()
    xr = torch.randn(10, 3, 28, 28, generator=g)
    y = torch.randint(0, 10, (10,), generator=g)

    def step(model: nn.Module) -> torch.Tensor:
        params = list(model.parameters())
        gr = torch.autograd.grad(F.cross_entropy(model(xr), y), params)
        gs = torch.autograd.grad(F.cross_entropy(model(xs), y), params, create_graph=True)
        loss = sum(((a - b) ** 2).sum() for a, b in zip(gs, gr, strict=True))
        return torch.autograd.grad(loss, xs)[0]

    ref = step(base)
    rows = timed({k: (lambda m=m: step(m)) for k, m in models.items()}, reps, 10)
    for k, m in models.items():
        rows[k]["relative_difference"] = float((step(m) - ref).norm() / ref.norm())
    return rows


def pass_split(reps: int) -> dict:
    """A DM step's two passes in sequence, and split over two threads."""
    import torch

    from fedvl.models.base import build_model

    model = build_model("convnet", 3, 10, 28, seed=0, width=32, depth=3, norm="instance")
    g = torch.Generator().manual_seed(0)
    xr = torch.randn(320, 3, 28, 28, generator=g)   # FedDM: 32 real images per class
    xs = torch.randn(100, 3, 28, 28, generator=g).requires_grad_()   # 10 per class
    pool = ThreadPoolExecutor(1, initializer=lambda: torch.set_num_threads(1))

    def real() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model.embed(xr[i:i + 32]) for i in range(0, len(xr), 32)])

    def syn() -> torch.Tensor:
        return torch.cat([model.embed(xs[i:i + 32]) for i in range(0, len(xs), 32)])

    def finish(zr: torch.Tensor, zs: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(((zs.mean(0) - zr.mean(0)) ** 2).sum(), xs)[0]

    def sequential() -> torch.Tensor:
        zr = real()
        return finish(zr, syn())

    def split() -> torch.Tensor:
        job = pool.submit(real)
        zs = syn()
        return finish(job.result(), zs)

    same = bool(torch.equal(sequential(), split()))
    rows = timed({"sequential (fedvl)": sequential, "real pass on a second thread": split},
                 reps, 10)
    pool.shutdown()
    return {**rows, "same_gradient_bit_for_bit": same}


def gn_double_backward_share(steps: int) -> dict:
    """Share of a FedLGD server matching step under GroupNorm's double backward."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fedvl.perf.synthesis import build_cases

    case = build_cases(["target-gradient"], "digits-offline", None, 100, 0, 32,
                       torch.device("cpu"))[0]
    for _ in range(3):
        case.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            case.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gn = next((e.cpu_time_total for e in events if e.key == "NativeGroupNormBackward0"), 0.0)
    conv = sum(e.self_cpu_time_total for e in events
               if e.key in ("aten::mkldnn_convolution", "aten::convolution_backward"))
    return {"steps": steps, "step_ms": total / steps / 1e3,
            "share_under_groupnorm_double_backward": gn / total,
            "share_in_convolutions": conv / total}


def main() -> None:
    """Measure each alternative and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/synthesis-alternatives-cpu.json")
    a = ap.parse_args()
    from fedvl.engine.allocator import keep_freed_memory

    keep_freed_memory()   # as the command line does: freed activations stay in the process
    import torch

    torch.set_num_threads(1)
    load_start = os.getloadavg()
    result = {"gm_norm": gm_norm(a.reps), "pass_split": pass_split(a.reps),
              "gn_double_backward_share": gn_double_backward_share(5)}
    for k, v in result.items():
        print(k, v, flush=True)
    write_result(a.out, machine(f"1 torch thread per computation; load average at start "
                                f"{[round(x, 2) for x in load_start]}"), {
        "setting": "ConvNet width 32 depth 3 (instance norm) on 28 px, 3-channel images; "
                   f"min and median over {a.reps} interleaved blocks",
        **result})


if __name__ == "__main__":
    main()

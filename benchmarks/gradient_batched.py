"""Gradient matching with every class at once (`fedvl.distill.class_gradients`) against one class
at a time, on one device.

    python benchmarks/gradient_batched.py --device cuda --out RESULT.json

The `fedvl perf --distill` gradient objective (a fresh random ConvNet per step, DSA, client 0
of digits-offline, 100 real images) stepped both ways: steps/s (median of timed blocks), aten
ops and host syncs per step. `--classes-cap` is not needed: the op count is per step.
"""

from __future__ import annotations

import argparse

import torch
from provenance import machine, write_result


def main() -> None:
    """Measure both paths and write the JSON."""
    from fedvl.config import RunConfig
    from fedvl.perf.synthesis import build_case, measure
    from fedvl.run.assemble import build_federation

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--train-cap", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default="benchmarks/results/gradient-batched-cpu.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cfg = RunConfig(benchmark="digits-offline", train_cap=a.train_cap, seed=0,
                    model_args={"width": a.width, "depth": 3})
    fed = build_federation(cfg)
    rows = {}
    for name, batched in (("per-class loop", False), ("all classes at once", True)):
        case = build_case("gradient", cfg, fed, device, batched=batched)
        r = measure(case, device, a.seconds)
        rows[name] = {k: r[k] for k in ("steps_per_second", "ops_per_step", "syncs_per_step",
                                         "gflop_per_step", "timed_steps")}
        print(f"{name:15s} {r['steps_per_second']:8.2f} steps/s {r['ops_per_step']:6d} ops "
              f"{r['syncs_per_step']:3d} syncs")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else ""
    write_result(a.out, machine(gpu), {"device": a.device, "threads": a.threads,
                                       "width": a.width, "train_cap": a.train_cap,
                                       "paths": rows})


if __name__ == "__main__":
    main()

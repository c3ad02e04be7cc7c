"""Where a distribution-matching step's time goes (torch.profiler), against the forward and
backward of its images.

The step is the default run's warm-up step (FedLGD on digits-offline: ConvNet width 32 depth 3,
a fresh random network per step, 32 real images per class, IPC 10, DSA) on one torch thread;
the reference is one training forward+backward (parameter gradients, mean CE) over the same
number of images (10 x 32 real + 100 synthetic) through the same network.

    python benchmarks/dm_profile.py --steps 20
    python benchmarks/dm_profile.py --device cuda --width 128 \
        --out benchmarks/results/dm-profile-gpu.json

On a GPU the profile ranks operators by their time on the device, and every timed span ends
with a synchronisation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from provenance import machine, write_result

from fedvl.algorithms import make_algorithm
from fedvl.config import RunConfig, resolve_model_args
from fedvl.distill.client_sets import distill_client
from fedvl.run.assemble import build_env, build_federation
from fedvl.seeding import generator


def main() -> None:
    """Time DM steps and training steps, profile a few DM steps, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--width", type=int, default=32, help="ConvNet width (the default run: 32)")
    ap.add_argument("--out", default="benchmarks/results/dm-profile-cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    cfg = resolve_model_args(RunConfig(model_args={"width": args.width, "depth": 3}))
    fed = build_federation(cfg)
    alg = make_algorithm(cfg.method, build_env(cfg, fed, device), cfg.method_args)
    p, c = alg.p, fed.clients[0]
    xc, yc = c.x_train.to(device), c.y_train.to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def dm(steps: int) -> None:
        distill_client(xc, yc, fed.num_classes, alg._random_model, p.ipc, steps,
                       generator(0, 0, 5), p.init, p.batch_real, p.lr_img, p.dsa)
        sync()

    n = fed.num_classes * p.batch_real + fed.num_classes * p.ipc
    model = alg._random_model(1).to(device)
    x = torch.randn(n, *c.x_train.shape[1:], device=device)
    y = torch.randint(0, fed.num_classes, (n,), device=device)

    def train_step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        sync()

    dm_ms, fb_ms = [], []
    dm(1)
    train_step()
    for _ in range(args.reps):
        t = time.perf_counter()
        dm(args.steps)
        dm_ms.append((time.perf_counter() - t) / args.steps * 1000)
        t = time.perf_counter()
        for _ in range(5):
            train_step()
        fb_ms.append((time.perf_counter() - t) / 5 * 1000)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        dm(5)

    def own(e: object) -> float:
        # Microseconds of the operator itself: on the device for a GPU run, else on the CPU.
        if device.type == "cuda":
            return float(getattr(e, "self_device_time_total", 0.0))
        return float(getattr(e, "self_cpu_time_total", 0.0))
    events = prof.key_averages()
    total = sum(own(e) for e in events) or 1.0
    ops = sorted(events, key=lambda e: -own(e))[:12]
    top = [{"op": e.key, "self_ms_per_step": round(own(e) / 1000 / 5, 2),
            "share": round(own(e) / total, 3), "calls_per_step": e.count / 5}
           for e in ops]
    res = {
        "setting": f"FedLGD warm-up DM step of the default run: ConvNet width {args.width} "
                   f"depth 3, {p.batch_real} real images per class, IPC {p.ipc}, DSA {p.dsa}",
        "dm_step_ms": [round(v, 1) for v in dm_ms],
        "train_forward_backward_ms": [round(v, 1) for v in fb_ms],
        "images": n,
        "ratio_dm_to_forward_backward": round(statistics.median(dm_ms)
                                              / statistics.median(fb_ms), 2),
        "profile_top_ops": top,
    }
    print(json.dumps({k: v for k, v in res.items() if k != "profile_top_ops"}))
    for row in top:
        print(row)
    write_result(args.out, f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
                 if device.type == "cuda" else machine("1 torch thread"), res)


if __name__ == "__main__":
    main()

"""FedDM's client synthesis of one round, client by client against stacked (`--stack-clients`).

    python benchmarks/stacked_synthesis.py --device cuda --out RESULT.json

FedDM (its default options but `--steps`) on the first `--clients` clients of digits-offline
(`--train-cap` images each, a `--width` ConvNet of depth 3): seconds per round of the clients'
`client_update` one after another against `client_update_stacked` (median of `--reps`, on
`--threads` threads), and the aten ops and host syncs per synthesis step: the stacked step of
all clients against the sum of each client's step alone (`fedvl.perf.synthesis.FlopCount`,
the count of 2 steps minus that of 1, so the one-off setup drops out), with the CPU's
chunked forwards and with whole batches, as an accelerator runs them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any
from unittest import mock

import torch
from provenance import machine, write_result

# A chunk no batch reaches: every forward on all of its images at once.
WHOLE = 1 << 30


def device_op_counter(tracked: list[torch.Tensor] | None) -> Any:
    """A `FlopCount` that also counts the ops with an input on the device (`device_ops`): the
    kernels a GPU would launch, where the rest (the host's draws) run on the CPU."""
    from torch.utils._pytree import tree_flatten

    from fedvl.perf.synthesis import FlopCount

    class Counter(FlopCount):
        device_ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            inputs = [t for t in tree_flatten((args, kwargs or {}))[0]
                      if isinstance(t, torch.Tensor)]
            self.device_ops += self._device(inputs)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Counter(tracked)


def main() -> None:
    """Measure both paths and write the JSON."""
    from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
    from fedvl.config import RunConfig, resolve_model_args
    from fedvl.core.message import Message
    from fedvl.distill.stacked_synthesis import stacked_synthesize
    from fedvl.distill.synthesize import synthesize
    from fedvl.run.assemble import build_env, build_federation

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--train-cap", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/stacked-synthesis-cpu.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cfg = RunConfig(benchmark="digits-offline", train_cap=a.train_cap, seed=0,
                    num_clients=a.clients, model_args={"width": a.width, "depth": 3})
    fed = build_federation(cfg)
    alg = make_algorithm("feddm", build_env(resolve_model_args(cfg), fed, device),
                         {"steps": a.steps})
    clients = list(range(a.clients))
    sent = alg.configure(alg.server_init(), ServerContext(0), clients)

    def items() -> list[tuple[Message, ClientContext]]:
        # Fresh generators every time: each repetition does the same work.
        return [(sent[c], ClientContext(
            cid=c, name=fed.clients[c].name, x=fed.clients[c].x_train.to(device),
            y=fed.clients[c].y_train.to(device), num_classes=fed.num_classes, state=Message(),
            generator=torch.Generator().manual_seed(c), round=0, device=device))
            for c in clients]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(run: Any) -> tuple[float, list[Message]]:
        times, out = [], []
        for _ in range(a.reps + 1):   # the first is a warm-up
            work = items()
            sync()
            t = time.perf_counter()
            out = run(work)
            sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:]), out

    seq, one = timed(lambda work: [alg.client_update(m, c) for m, c in work])
    stk, together = timed(alg.client_update_stacked)
    diff = max(float((r.get("synthetic_images")["x"] - s.get("synthetic_images")["x"])
                     .abs().max()) for r, s in zip(one, together, strict=True))

    loop = sys.modules[synthesize.__module__]

    def count(stacked: bool, steps: int, whole: bool) -> Any:
        setups = [alg.client_setup(m, c) for m, c in items()]
        gens = [c.generator for _, c in items()]
        tracked = None if device.type == "cuda" else [
            t for s, o in setups for t in (s.images, s.labels, o.real.x, o.real.y,
                                           *o.extractor.base.parameters())]
        # `whole`: every forward on all of its images, as on an accelerator (the CPU chunks).
        with device_op_counter(tracked) as fc, mock.patch.object(loop, "CPU_CHUNK",
                                                         WHOLE if whole else loop.CPU_CHUNK):
            if stacked:
                stacked_synthesize([s for s, _ in setups], [o for _, o in setups], steps, gens,
                                   chunk=WHOLE if whole else None)
            else:
                for (s, o), g in zip(setups, gens, strict=True):
                    synthesize(s, o, steps, g)
        return fc

    def per_step(stacked: bool, whole: bool) -> dict[str, Any]:
        one_step, two = count(stacked, 1, whole), count(stacked, 2, whole)
        return {"ops_per_step": two.ops - one_step.ops,
                "device_ops_per_step": two.device_ops - one_step.device_ops,
                "syncs_per_step": two.syncs - one_step.syncs,
                "gflop_per_step": (two.total - one_step.total) / 1e9}

    rows = {}
    for name, stacked, secs in (("client by client", False, seq), ("stacked", True, stk)):
        rows[name] = {"seconds_per_round": secs, "seconds_per_step": secs / a.steps,
                      **per_step(stacked, False),
                      "whole_batches": per_step(stacked, True)}
        print(f"{name:17s} {secs:7.3f} s/round {rows[name]['ops_per_step']:6d} ops/step "
              f"({rows[name]['whole_batches']['ops_per_step']} in whole batches, "
              f"{rows[name]['whole_batches']['device_ops_per_step']} on the device) "
              f"{rows[name]['syncs_per_step']:3d} syncs/step")
    images = [len(r.get("synthetic_labels")["y"]) for r in one]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else ""
    write_result(a.out, machine(gpu), {
        "device": a.device, "threads": a.threads, "benchmark": "digits-offline",
        "clients": a.clients, "train_cap": a.train_cap, "width": a.width, "depth": 3,
        "steps": a.steps, "reps": a.reps, "synthetic_images_per_client": images,
        "what": "FedDM client_update of every client of a round (default options but steps): "
                "one after another against client_update_stacked; ops per synthesis step of "
                "all clients",
        "paths": rows, "speedup": seq / stk,
        "max_image_difference": diff})


if __name__ == "__main__":
    main()

"""The engines `fedvl perf` runs in-house: the bare loop, fedvl embedded (threads, stacked
clients or processes), fedvl on Flower.

Each runs in its own process (`python -m fedvl.perf.engines ENGINE WORKLOAD ARRAYS OUT
WORKERS`) so that its start-up and memory are its own, and writes the row contract of
`fedvl.perf.workload`: wall-clock round starts and ends, final mean client accuracy, setting.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("bare", "embedded", "workers", "stacked", "processes", "flower")
# The engines that run on a GPU (`--device cuda`); the others train on the CPU only.
DEVICE_ENGINES = ("bare", "embedded", "workers", "stacked")


def run_bare(w: Any, arrays: str, workers: int) -> dict[str, Any]:
    """One model, no federation: one optimiser over every client's images in turn."""
    import torch

    from fedvl.engine.driver import client_generator
    from fedvl.perf.workload import build_net, load_arrays, mean_client_accuracy

    torch.set_num_threads(workers)
    device = torch.device(w.device)
    data = load_arrays(arrays)
    train = [(x.to(device), y.to(device)) for x, y in data.train]
    model = build_net(w, data).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=w.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    starts, ends = [], []
    for rnd in range(w.rounds):
        starts.append(time.time())
        model.train()
        for k, (x, y) in enumerate(train):
            # The batch order of client k in round rnd, from the stream fedvl's clients use.
            order = torch.randperm(len(y), generator=client_generator(w.seed, rnd, k), device="cpu")
            order = order.to(device)
            for i in range(0, len(y), w.batch_size):
                idx = order[i:i + w.batch_size]
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x[idx]), y[idx]).backward()
                opt.step()
        _synchronize(device)
        ends.append(time.time())
    where = "on the GPU" if device.type == "cuda" else f"{workers} torch threads"
    return {"round_starts": starts, "round_ends": ends,
            "accuracy": mean_client_accuracy(model, data),
            "setting": f"single model, {where}"}


def _synchronize(device: Any) -> None:
    # A round ends when the device has run its kernels, not when Python has queued them.
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _config(w: Any, workers: int | None, stack: bool = False) -> Any:
    from fedvl.config import RunConfig

    return RunConfig(method="fedavg", benchmark=w.benchmark, data_dir=w.data_dir,
                     num_clients=w.clients, train_cap=w.train_per_client,
                     test_cap=w.test_per_client, alpha=w.alpha, seed=w.seed,
                     model_args=w.model_args(), rounds=w.rounds, batch_size=w.batch_size,
                     lr=w.lr, momentum=w.momentum, eval_every=w.rounds, workers=workers,
                     device=w.device, partitions=w.partitions, stack_clients=stack)


def _rounds(history: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    # A round's end is its record's wall-clock time; its training part excludes evaluation.
    ends = [r["time"] - r.get("eval_seconds", 0.0) for r in history]
    starts = [r["time"] - r["seconds"] for r in history]
    return starts, ends


def run_embedded(w: Any, workers: int, out: Path, stack: bool = False) -> dict[str, Any]:
    """`fedvl run` in this process (its own data loading), clients on `workers` threads, or
    (`stack`) a round's clients as one vectorised model."""
    from fedvl.run.experiment import run_experiment

    s = run_experiment(_config(w, workers, stack), out=out / "run")
    history = [json.loads(x) for x in (out / "run" / "metrics.jsonl").open()]
    starts, ends = _rounds(history)
    return {"round_starts": starts, "round_ends": ends, "accuracy": s["mean_accuracy"],
            "eval_seconds": s.get("eval_seconds"),
            "setting": "fedvl embedded, a round's clients stacked (--stack-clients)" if stack
            else f"fedvl embedded, {workers} worker(s) x 1 torch thread"}


def run_flower(w: Any, workers: int, out: Path) -> dict[str, Any]:
    """fedvl on Flower's simulation engine (Ray), `workers` client actors of one CPU each."""
    from fedvl.flower.server_app import ServerOptions
    from fedvl.flower.simulate import simulate

    cfg = _config(w, None)
    [s] = simulate([(cfg, ServerOptions(out=str(out / "flower"), round_timeout=3600,
                                        join_timeout=600))], ray_cpus=workers)
    history = [json.loads(x) for x in (out / "flower" / "metrics.jsonl").open()]
    starts, ends = _rounds(history)
    return {"round_starts": starts, "round_ends": ends, "accuracy": s["mean_accuracy"],
            "setting": f"fedvl on Flower simulation (Ray), {workers} actor(s) x 1 CPU"}


def main(argv: list[str]) -> int:
    """Entry point of one engine's process."""
    from fedvl.perf.workload import Workload

    engine, wjson, arrays, out_json, workers = argv[:5]
    w, n, out = Workload.from_json(wjson), int(workers), Path(out_json).parent
    if engine == "bare":
        row = run_bare(w, arrays, n)
    elif engine == "embedded":
        row = run_embedded(w, 1, out)
    elif engine == "workers":
        row = run_embedded(w, n, out)
    elif engine == "stacked":
        row = run_embedded(w, 1, out, stack=True)
    elif engine == "processes":
        from fedvl.perf.processes import run_processes

        row = run_processes(w, arrays, n)
    elif engine == "flower":
        row = run_flower(w, n, out)
    else:
        raise SystemExit(f"unknown engine '{engine}'; allowed: {', '.join(ENGINES)}")
    if w.device.startswith("cuda"):
        import torch

        row["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(out_json).write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

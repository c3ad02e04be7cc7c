"""FedAvg on persistent worker processes: the design pfl-research uses, on fedvl's training.

`fedvl perf`'s `processes` engine, which measures the alternative to `--workers` threads: N
processes start once and each loads the client arrays once (never pickled per round); every
round the parent sends the global weights once per process (not once per client), each process
trains its share of the clients (client k on process k mod N, one torch thread, fedvl's
`local_train` with the client's own generator, as the embedded engine) and sends back one
sample-weighted sum of its clients' weights, and the parent adds the N sums.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any


def _worker(wjson: str, arrays: str, rank: int, size: int, conn: Connection) -> None:
    import torch

    from fedvl.core.training import TrainConfig, local_train
    from fedvl.engine.allocator import keep_freed_memory
    from fedvl.engine.driver import client_generator
    from fedvl.perf.workload import Workload, build_net, load_arrays

    torch.set_num_threads(1)
    keep_freed_memory()
    w = Workload.from_json(wjson)
    data = load_arrays(arrays)
    mine = [(k, *data.train[k]) for k in range(rank, len(data.train), size)]
    model = build_net(w, data)
    cfg = TrainConfig(lr=w.lr, momentum=w.momentum, batch_size=w.batch_size)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        rnd, weights = msg
        total: dict[str, torch.Tensor] = {}
        count = 0
        for k, x, y in mine:
            model.load_state_dict(weights)
            local_train(model, x, y, cfg, client_generator(w.seed, rnd, k))
            for name, t in model.state_dict().items():
                part = t.detach().double() * len(y)
                total[name] = total[name] + part if name in total else part
            count += len(y)
        conn.send((total, count))


def run_processes(w: Any, arrays: str, workers: int) -> dict[str, Any]:
    """FedAvg rounds on `workers` persistent processes; the row contract of the perf engines."""
    import torch
    import torch.multiprocessing as mp

    from fedvl.perf.workload import build_net, load_arrays, mean_client_accuracy

    torch.set_num_threads(1)
    data = load_arrays(arrays)
    model = build_net(w, data)
    ctx = mp.get_context("spawn")
    links, procs = [], []
    try:
        for rank in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(w.to_json(), arrays, rank, workers, child),
                               daemon=True)
            proc.start()
            links.append(parent)
            procs.append(proc)
        for link in links:
            if link.recv() != "ready":
                raise RuntimeError("a worker process did not start")
        starts, ends = [], []
        for rnd in range(w.rounds):
            starts.append(time.time())
            state = model.state_dict()
            for link in links:
                link.send((rnd, state))
            sums: dict[str, torch.Tensor] = {}
            n = 0
            for link in links:
                total, count = link.recv()
                for name, t in total.items():
                    sums[name] = sums[name] + t if name in sums else t
                n += count
            model.load_state_dict({name: (t / n).to(state[name].dtype)
                                   for name, t in sums.items()})
            ends.append(time.time())
        for link in links:
            link.send(None)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    return {"round_starts": starts, "round_ends": ends,
            "accuracy": mean_client_accuracy(model, data),
            "setting": f"fedvl training on {workers} persistent processes x 1 torch thread "
                       "(pfl-research's design)"}

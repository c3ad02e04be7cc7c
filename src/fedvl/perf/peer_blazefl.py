"""The perf workload on BlazeFL: its thread-pool client trainer and server-handler protocol.

Run in BlazeFL's interpreter (which must also have fedvl):
`python -m fedvl.perf.peer_blazefl WORKLOAD_JSON ARRAYS OUT_JSON WORKERS`.

BlazeFL's recommended mode is multi-threaded (`ThreadPoolClientTrainer`): clients train on
`WORKERS` threads of one process and exchange flat parameter tensors by reference
(`serialize_model` / `deserialize_model`), with no pickling. BlazeFL is a set of protocols
that the user's code fills in; here the client step is the workload's (SGD with momentum, one
epoch, fedvl's per-round client seed) and the server averages weighted by sample counts.
The round loop is BlazeFL's documented one: sample, downlink, `local_process`, uplink, `load`.
"""

from __future__ import annotations

import copy
import importlib.metadata
import queue
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from blazefl.core import (
    BaseServerHandler,
    ThreadPoolClientTrainer,
    deserialize_model,
    serialize_model,
)

from fedvl.perf.workload import (
    ClientArrays,
    Workload,
    build_net,
    engine_main,
    load_arrays,
    mean_client_accuracy,
)
from fedvl.seeding import derive_seed

# fedvl's engines draw a client's batch order from stream 2 of (seed, round, client).
_CLIENT_STREAM = 2


@dataclass
class Downlink:
    """What the server broadcasts: the flat global parameters and the round they belong to."""

    params: torch.Tensor
    round: int


@dataclass
class Uplink:
    """What a client returns: its flat trained parameters and its training-sample count."""

    cid: int
    params: torch.Tensor
    num_samples: int


class Server(BaseServerHandler[Uplink, Downlink]):
    """FedAvg server on BlazeFL's handler protocol: every client, sample-weighted mean."""

    def __init__(self, net: torch.nn.Module, num_clients: int, rounds: int) -> None:
        self.net = net
        self.num_clients = num_clients
        self.rounds = rounds
        self.round = 0
        self.buffer: list[Uplink] = []

    def sample_clients(self) -> list[int]:
        """Every client, every round."""
        return list(range(self.num_clients))

    def downlink_package(self) -> Downlink:
        """The current global parameters as one flat tensor."""
        return Downlink(serialize_model(self.net), self.round)

    def is_stopped(self) -> bool:
        """True once the workload's rounds are done."""
        return self.round >= self.rounds

    def load(self, payload: Uplink) -> bool:
        """Buffer one client's update; aggregate when the round's last one arrives."""
        self.buffer.append(payload)
        if len(self.buffer) < self.num_clients:
            return False
        self.global_update(self.buffer)
        self.buffer = []
        self.round += 1
        return True

    def global_update(self, buffer: list[Uplink]) -> None:
        """Replace the global parameters by the sample-weighted mean of the clients'."""
        total = sum(u.num_samples for u in buffer)
        if total == 0:
            return
        mean = torch.zeros_like(buffer[0].params)
        for u in buffer:
            mean.add_(u.params, alpha=u.num_samples / total)
        deserialize_model(self.net, mean)


class Trainer(ThreadPoolClientTrainer[Uplink, Downlink]):
    """Clients trained on BlazeFL's thread pool, `num_parallels` at a time."""

    def __init__(self, w: Workload, data: ClientArrays, template: torch.nn.Module,
                 num_parallels: int) -> None:
        self.w = w
        self.data = data
        self.template = template
        self.num_parallels = num_parallels
        self.device = "cpu"
        self.device_count = 0
        self.cache: list[Uplink] = []
        self.stop_event = threading.Event()
        # BlazeFL's pool starts new threads every round, so local models are recycled through
        # a queue (at most `num_parallels` exist); the broadcast overwrites their weights.
        self._free: queue.SimpleQueue[torch.nn.Module] = queue.SimpleQueue()

    def worker(self, cid: int, device: str, payload: Downlink,
               stop_event: threading.Event) -> Uplink:
        """One client's round: load the broadcast, one epoch of SGD, return the weights."""
        try:
            model = self._free.get_nowait()
        except queue.Empty:
            model = copy.deepcopy(self.template)
        try:
            return self._train(model, cid, payload, stop_event)
        finally:
            self._free.put(model)

    def _train(self, model: torch.nn.Module, cid: int, payload: Downlink,
               stop_event: threading.Event) -> Uplink:
        deserialize_model(model, payload.params)
        x, y = self.data.train[cid]
        opt = torch.optim.SGD(model.parameters(), lr=self.w.lr, momentum=self.w.momentum)
        g = torch.Generator().manual_seed(derive_seed(self.w.seed, payload.round, cid,
                                                      _CLIENT_STREAM))
        order = torch.randperm(len(y), generator=g, device=g.device)
        model.train()
        for i in range(0, len(y), self.w.batch_size):
            if stop_event.is_set():
                break
            idx = order[i:i + self.w.batch_size]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        return Uplink(cid, serialize_model(model), len(y))

    def uplink_package(self) -> list[Uplink]:
        """The round's client updates, in client order; empties the cache."""
        out, self.cache = self.cache, []
        return out


def run(w: Workload, arrays: str, workers: int) -> dict[str, object]:
    """Run the workload on BlazeFL; the result row `fedvl perf` reads."""
    # BlazeFL's threads share one process: one intra-op thread each, so `workers` threads use
    # `workers` cores instead of oversubscribing them.
    torch.set_num_threads(1)
    data = load_arrays(arrays)
    net = build_net(w, data)
    server = Server(net, len(data.train), w.rounds)
    trainer = Trainer(w, data, net, workers)
    starts: list[float] = []
    ends: list[float] = []
    while not server.is_stopped():
        starts.append(time.time())
        clients = server.sample_clients()
        trainer.local_process(server.downlink_package(), clients)
        for pack in trainer.uplink_package():
            server.load(pack)
        ends.append(time.time())
    t = time.time()
    accuracy = mean_client_accuracy(server.net, data)
    eval_seconds = time.time() - t
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    ver = importlib.metadata.version("blazefl")
    setting = (f"BlazeFL {ver} ThreadPoolClientTrainer, {workers} threads x 1 torch thread, "
               f"Python {sys.version.split()[0]} (GIL {'on' if gil else 'off'}), "
               f"torch {torch.__version__}")
    return {"round_starts": starts, "round_ends": ends, "accuracy": accuracy,
            "eval_seconds": eval_seconds, "setting": setting, "version": ver}


def main(argv: list[str] | None = None) -> int:
    """Entry point: WORKLOAD_JSON ARRAYS OUT_JSON WORKERS."""
    return engine_main("fedvl.perf.peer_blazefl", run, argv)


if __name__ == "__main__":
    sys.exit(main())

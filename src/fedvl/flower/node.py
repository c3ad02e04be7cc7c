"""What a SuperNode knows: its own partition of the benchmark, and the algorithm's client half."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import torch

from fedvl.algorithms.base import Algorithm, Env, make_algorithm
from fedvl.config import RunConfig, validate
from fedvl.data.federated import ClientData
from fedvl.data.spec import spec_of
from fedvl.engine.allocator import keep_freed_memory
from fedvl.engine.threads import CLIENT_THREADS, load_optimizer_modules
from fedvl.registry import BENCHMARKS
from fedvl.run.assemble import (
    FederationShape,
    build_env,
    build_federation,
    data_options,
    resolve_device,
)


def config_key(text: str) -> str:
    """Short stable id of one run config (keys node caches and persistent state)."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def partition_names(cfg: RunConfig) -> list[str] | None:
    """Client names of a benchmark known without loading data (None when data decides).

    A benchmark that declares them (`BenchmarkSpec.client_names`) builds each client alone.
    """
    names = spec_of(cfg.benchmark).client_names
    return None if names is None else names(data_options(cfg))


def load_partition(cfg: RunConfig, pid: int) -> tuple[ClientData, int, dict[str, Any], int,
                                                      tuple[torch.Tensor, torch.Tensor] | None]:
    """(own ClientData, num_classes, dataset info, num_partitions, public global test set).

    A benchmark whose client names are known up front (digits-offline) builds only the node's
    own client, the same as that client of the whole federation. Other benchmarks partition a
    shared source deterministically (e.g. Dirichlet over CIFAR-10's labels), so the node builds
    the partitioning and keeps only its own slice; the other slices are dropped at once.
    """
    if cfg.local_data == "virtual":
        # The node distils only its own client's local virtual set from its own data.
        from fedvl.run.assemble import with_client_virtual_data

        data, k, info, n, gtest = load_partition(replace(cfg, local_data="real"), pid)
        info = {**info, "local_data": "virtual", "ipc": cfg.ipc,
                "virtual_steps": cfg.virtual_steps}
        return with_client_virtual_data(cfg, data, pid, k), k, info, n, gtest
    names = partition_names(cfg)
    if names is not None:
        if not 0 <= pid < len(names):
            raise ValueError(f"partition-id {pid} out of range 0..{len(names) - 1} "
                             f"for benchmark '{cfg.benchmark}'")
        fed = BENCHMARKS.get(cfg.benchmark)(data_options(cfg, only_client=pid))
        return (fed.clients[0], fed.num_classes, _with_norm(fed), len(names), fed.global_test)
    fed = _shared_federation(cfg)
    if not 0 <= pid < len(fed.clients):
        raise ValueError(f"partition-id {pid} out of range 0..{len(fed.clients) - 1} "
                         f"for benchmark '{cfg.benchmark}'")
    return fed.clients[pid], fed.num_classes, _with_norm(fed), len(fed.clients), fed.global_test


NORM = "_normalisation"  # info entry carrying the (public) mean/std of the benchmark


def _with_norm(fed: Any) -> dict[str, Any]:
    return {**fed.info, NORM: {"mean": list(fed.mean), "std": list(fed.std)}}


_FED: dict[str, Any] = {}


def _shared_federation(cfg: RunConfig) -> Any:
    """The partitioned benchmark, built once per process and config.

    In simulation one Ray actor hosts many virtual nodes, so the partitioning is computed once
    per actor rather than once per node; a real SuperNode only ever asks for its own partition.
    """
    key = config_key(repr(sorted(cfg.to_dict().items(), key=lambda kv: kv[0])))
    if key not in _FED:
        _FED.clear()
        _FED[key] = build_federation(cfg)
    return _FED[key]


@dataclass
class NodeRun:
    """A node's cached view of one run config: its data and the algorithm (client half)."""

    cfg: RunConfig
    pid: int
    data: ClientData
    num_classes: int
    info: dict[str, Any]
    num_partitions: int
    device: torch.device
    global_test: tuple[torch.Tensor, torch.Tensor] | None = None
    algorithm: Algorithm | None = None
    env: Env | None = None

    def ensure_algorithm(self, client_names: list[str]) -> Algorithm:
        """The algorithm built from the config and the federation's public shape."""
        if self.algorithm is None:
            c, h, w = (int(s) for s in self.data.x_train.shape[1:])
            shape = FederationShape(self.num_classes, (c, h, w), list(client_names))
            self.env = build_env(self.cfg, shape, self.device)
            self.algorithm = make_algorithm(self.cfg.method, self.env, self.cfg.method_args)
        return self.algorithm

    def ready_to_train(self) -> None:
        """Pay the first optimiser's one-time imports now, before a reply's clock starts.

        Only messages that train call this: Flower starts a process per message, and one that
        answers a `query.info` or evaluates has no use for torch's compiler front end (0.8 s).
        """
        load_optimizer_modules()   # microseconds once the modules are in


_CACHE: dict[tuple[str, int], NodeRun] = {}


def node_run(text: str, cfg: RunConfig, pid: int) -> NodeRun:
    """The cached NodeRun for (config, partition) in this process."""
    key = (config_key(text), pid)
    # Client work runs on one torch thread on every transport (`engine.threads`).
    torch.set_num_threads(CLIENT_THREADS)
    keep_freed_memory()
    if key not in _CACHE:
        validate(cfg)
        device = resolve_device(cfg.device)
        data, k, info, n, gtest = load_partition(cfg, pid)
        data = replace(data, **{f: getattr(data, f).to(device) for f in
                                ("x_train", "y_train", "x_test", "y_test", "x_real", "y_real")
                                if getattr(data, f, None) is not None})
        if len(_CACHE) > 8:
            _CACHE.clear()
        _CACHE[key] = NodeRun(cfg, pid, data, k, info, n, device, gtest)
    return _CACHE[key]

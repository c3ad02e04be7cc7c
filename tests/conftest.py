"""Shared fixtures and helpers: tiny federations, small method settings, the method lists.

Test files import helpers from here, never from one another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedvl.config import RunConfig
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.registry import ADDONS, ALGORITHMS

SHARED_DATA = Path(os.environ.get("FEDVL_SHARED_DATA",
                                  Path(__file__).resolve().parents[2] / "shared" / "data"))


def make_toy_federation(num_clients: int = 3, n_train: int = 48, n_test: int = 24,
                        num_classes: int = 4, size: int = 8, seed: int = 0) -> FederatedDataset:
    """Class-dependent blobs with a per-client shift: learnable, heterogeneous, tiny."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(num_classes, 3, size, size, generator=g)
    clients = []
    for k in range(num_clients):
        shift = 0.5 * torch.randn(1, 3, 1, 1, generator=g)

        def draw(n: int, k: int = k, shift: torch.Tensor = shift) -> tuple:
            y = torch.arange(n) % num_classes
            x = protos[y] + shift + 0.5 * torch.randn(n, 3, size, size, generator=g)
            return x, y

        xtr, ytr = draw(n_train)
        xte, yte = draw(n_test)
        clients.append(ClientData(f"c{k}", xtr, ytr, xte, yte))
    return FederatedDataset("toy", clients, num_classes, (0.5,) * 3, (0.5,) * 3)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the files so that the two workers finish together: the long ones first.

    The workers take a file at a time in this order (`--dist loadfile`, with xdist's reordering
    by test count switched off), two each to start with. A `slow` test declares the seconds its
    file takes (`pytest.mark.slow(seconds=...)`, measured on a 2-core machine); the longest
    files start at once, one per worker, and the other slow files follow among the short ones,
    so whichever worker frees first takes the next, instead of one worker running the Ray and
    Flower deployments alone after the short files ran out.
    """
    seconds: dict[Any, float] = {}
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            seconds[item.path] = max(seconds.get(item.path, 0.0),
                                     float(mark.kwargs.get("seconds", 20.0)))
    slow = sorted(seconds, key=lambda path: -seconds[path])
    fast = [path for path in dict.fromkeys(item.path for item in items) if path not in seconds]
    # Each worker starts with two files: the n longest first, then n short ones.
    n = int(getattr(config, "workerinput", {}).get("workercount", 1))
    order = slow[:n] + fast[:n]
    rest_slow, rest_fast = slow[n:], fast[n:]
    for i, path in enumerate(rest_fast):
        order.append(path)
        if i < len(rest_slow):
            order.append(rest_slow[i])
    order += rest_slow[len(rest_fast):]
    rank = {path: i for i, path in enumerate(order)}
    items.sort(key=lambda item: rank[item.path])   # stable within a file


@pytest.fixture(autouse=True)
def _one_thread():
    """Run each test on one torch thread."""
    # Tests use tiny tensors: on a shared 2-core machine extra threads only add contention.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def toy_fed() -> FederatedDataset:
    """The default toy federation (3 clients, 48 training images each)."""
    return make_toy_federation()


@pytest.fixture
def tiny_cfg() -> RunConfig:
    """Three rounds of FedAvg with a width-8 ConvNet."""
    return RunConfig(method="fedavg", benchmark="digits-offline", rounds=3, batch_size=16,
                     lr=0.05, momentum=0.0, model="convnet",
                     model_args={"width": 8, "depth": 2, "norm": "instance"})


@pytest.fixture(scope="session")
def _public_source(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The cache files of the public set small_cfg's FedDF and FCCL read, rendered once."""
    from fedvl.run.assemble import build_public

    root = tmp_path_factory.mktemp("public-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDVL_CACHE_DIR", str(root))
        build_public(small_cfg("feddf"), (3, 8, 8))
    return sorted(root.glob("*.npz"))


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              _public_source: list[Path]) -> Path:
    """A fresh fedvl cache directory for this test, holding only the rendered public set."""
    import shutil

    cache = tmp_path / "cache"
    cache.mkdir()
    # A copy, not a link: a test may damage files in its cache. Rendering them again costs
    # about a second per test; copying, milliseconds.
    for f in _public_source:
        shutil.copyfile(f, cache / f.name)
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def shared_data() -> Path:
    """The shared data directory (the test is skipped without it)."""
    if not (SHARED_DATA / "digits" / "mnist.npz").is_file():
        pytest.skip(f"shared data directory not found at {SHARED_DATA}")
    return SHARED_DATA


def short_default_run(method: str, out: Path) -> dict:
    """Five tiny rounds of `method` on the embedded default benchmark; its summary."""
    from fedvl.run.assemble import build_federation
    from fedvl.run.experiment import run_experiment

    cfg = RunConfig(method=method, benchmark="digits-offline", train_cap=200, test_cap=40,
                    rounds=5, local_epochs=2, threads=1,
                    model_args={"width": 8, "depth": 2, "norm": "instance"})
    return run_experiment(cfg, out=out, fed=build_federation(cfg))


# -- every method, at the smallest size ------------------------------------------------------------
# Small settings for methods whose defaults are sized for real runs.
SMALL_ARGS: dict[str, dict[str, Any]] = {
    "fedlgd": {"ipc": 2, "server_ipc": 2, "warmup_steps": 2, "local_dm_steps": 1,
               "server_gm_steps": 1, "refresh_period": 1, "refresh_count": 2, "batch_real": 4,
               "dsa": False},
    "fedvck": {"ipc": 2, "steps": 2, "batch_real": 4, "server_epochs": 2, "server_batch": 16,
               "topk": 2, "dsa": False},
    "feddm": {"ipc": 2, "steps": 2, "batch_real": 4, "server_epochs": 1, "server_batch_size": 8},
    "fedd3": {"ipc": 2, "steps": 2, "batch_real": 4, "server_epochs": 1, "server_batch_size": 8},
    "fedlapdp": {"ipc": 1, "outer_loop": 1, "steps": 1, "image_steps": 1, "batch_real": 4,
                 "radius_epochs": 1, "server_epochs": 1, "server_batch_size": 8, "dsa": False},
    "fedaf": {"ipc": 2, "steps": 2, "batch_real": 4, "server_epochs": 1, "server_batch_size": 8,
              "projections": 8, "dsa": False},
    "desa": {"ipc": 2, "anchor_steps": 2, "batch_real": 4, "dsa": False},
    "feddf": {"public_batch": 8},
    "fccl": {"public_batch": 8, "pretrain_epochs": 1},
    "fedgen": {"server_steps": 2, "server_batch": 8, "hidden_dim": 16, "gen_batch": 8},
    "fedgan": {"gan_steps": 2, "gan_batch": 8, "noise_dim": 8, "ngf": 4, "ndf": 4,
               "syn_batch": 4},
    "dynafed": {"trajectory_length": 3, "expert_rounds": 1, "average_min": 1, "syn_steps": 2,
                "iterations": 2, "ipc": 2, "finetune_epochs": 2, "dsa": False},
    "dense": {"server_epochs": 2, "g_steps": 2, "syn_batch": 4, "kd_batch": 4, "noise_dim": 8,
              "ngf": 4},
    "dfrd": {"server_iters": 1, "gen_steps": 1, "kd_steps": 1, "batch": 4, "noise_dim": 8,
             "ngf": 4},
    "coboosting": {"server_epochs": 2, "g_steps": 2, "syn_batch": 4, "kd_batch": 4,
                   "noise_dim": 8, "ngf": 4},
}
# Run settings some methods need (FedDF and FCCL learn on an unlabelled public set).
RUN_EXTRA: dict[str, dict[str, Any]] = {"feddf": {"public": "digits-offline", "public_size": 16},
                                        "fccl": {"public": "digits-offline", "public_size": 16}}
VIRTUAL = {"virtual_per_class": 4}
# The tiny ConvNet every matrix runs, and the model options some methods need on top: FedBN (and
# every BASE+fedbn) keeps BatchNorm layers local, so it needs a model that has some.
TINY_MODEL: dict[str, Any] = {"width": 8, "depth": 2, "norm": "instance"}
MODEL_EXTRA: dict[str, dict[str, Any]] = {"fedbn": {"norm": "batch"}}


def small_args(name: str) -> dict[str, Any]:
    """The small method options of `name` (plain or BASE+ADDON)."""
    base = name.partition("+")[0]
    out = dict(SMALL_ARGS.get(base, {}))
    fields = {f.name for f in dataclasses.fields(ALGORITHMS.get(name).Params)}
    if "virtual_per_class" in fields:
        out.update(VIRTUAL)
    return out


def small_model_args(name: str) -> dict[str, Any]:
    """The tiny ConvNet's options for method `name` (plain or BASE+ADDON)."""
    key = getattr(ALGORITHMS.get(name), "addon_name", None) or name
    return {**TINY_MODEL, **MODEL_EXTRA.get(key, {})}


def small_cfg(name: str, rounds: int = 3) -> RunConfig:
    """A tiny run of method `name` (width-8 ConvNet, batch 8, 2 of 3 clients per round)."""
    return RunConfig(method=name, method_args=small_args(name), rounds=rounds, batch_size=8,
                     lr=0.05, momentum=0.0, client_ratio=0.67,
                     model_args=small_model_args(name), **RUN_EXTRA.get(name, {}))


@contextlib.contextmanager
def cpu_as_device() -> Iterator[None]:
    """Run the block as if the run's device were not the CPU: a tensor factory that names no
    device makes a `meta` tensor, which fails at its first use with the run's (CPU) tensors,
    where on a GPU it would have been a CPU tensor meeting CUDA ones. Clients must run inline
    (`workers=1`): torch's default device is per thread."""
    with torch.device("meta"):
        yield


def _method_lists() -> tuple[list[str], list[str]]:
    """(every base method plus every add-on on fedavg, every other BASE+ADDON composition)."""
    # Registered names without '+': the base methods and the add-ons registered under their
    # own name (`vhl` is the add-on on fedavg).
    matrix = [n for n in ALGORITHMS.names() if "+" not in n]
    covered = {getattr(ALGORITHMS.get(n), "addon_name", None) for n in matrix}
    matrix += [f"fedavg+{a}" for a in ADDONS.names()
               if a not in covered and f"fedavg+{a}" in ALGORITHMS]
    composed = [n for n in ALGORITHMS.names() if "+" in n and n not in matrix]
    return matrix, composed


# Derived from the registry, so a new method or add-on joins every matrix by registering itself.
# METHODS: each base method and each add-on (on fedavg): the behaviour matrices run these.
# COMPOSED: the other BASE+ADDON names: a cheap check that each builds and runs one round.
METHODS, COMPOSED = _method_lists()


@pytest.fixture
def short_tmp() -> Any:
    """A fresh directory with a short path, removed afterwards.

    For tests that compare a whole error line naming a run directory: error lines are bounded
    (300 characters), and pytest's own temporary paths grow with the worker's name under
    pytest-xdist, enough to push the line past the bound and shorten it.
    """
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="fv"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def resumed_after_crash(cfg: RunConfig, fed: FederatedDataset, run_dir: Path,
                        monkeypatch: pytest.MonkeyPatch, at_round: int = 2,
                        before_crash: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """The summary of `cfg` stopped inside round `at_round`'s aggregation (after the round
    before was checkpointed), then resumed from `run_dir`; `before_crash(state)` may inspect
    the server state the interrupted round started from."""
    from fedvl.run import assemble
    from fedvl.run.experiment import resume_experiment, run_experiment

    cls = ALGORITHMS.get(cfg.method)
    original = cls.aggregate

    def crashing(self, state, ctx, replies):
        if ctx.round == at_round:
            if before_crash is not None:
                before_crash(state)
            raise KeyboardInterrupt
        return original(self, state, ctx, replies)

    monkeypatch.setattr(cls, "aggregate", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out=run_dir, fed=fed)
    monkeypatch.setattr(cls, "aggregate", original)
    monkeypatch.setattr(assemble, "build_federation", lambda c: fed)
    return resume_experiment(run_dir)


# -- fakes shared by several files -----------------------------------------------------------------
class FakeGrid:
    """Flower Grid stand-in delivering each Message to fedvl's real ClientApp in this process.

    One Context per node, so client state lives on the node; node id = 100 * generation +
    partition id.
    """

    def __init__(self, num_nodes: int,
                 drop: Callable[[int, str, int], bool] | None = None,
                 state_dir: str | None = None) -> None:
        from flwr.app import Context, RecordDict
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.task_id, TaskIdentity.run_id = 1, 1
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        extra = {"state-dir": state_dir} if state_dir else {}
        self.contexts = {pid: Context(run_id=1, node_id=100 + pid,
                                      node_config={"partition-id": pid, **extra},
                                      state=RecordDict(), run_config={})
                         for pid in range(num_nodes)}
        self.online = {100 + pid: pid for pid in range(num_nodes)}
        self.drop = drop or (lambda pid, mtype, rnd: False)
        self.outbox: dict[str, object] = {}
        self.count = 0

    def get_node_ids(self) -> list[int]:
        """The node ids online now."""
        return list(self.online)

    def push_messages(self, messages) -> list[str]:
        """Deliver each message to its node's ClientApp now (unless dropped); their ids."""
        from fedvl.flower.client_app import app

        ids = []
        for m in messages:
            self.count += 1
            m.metadata._message_id = f"m{self.count}"
            ids.append(m.metadata.message_id)
            pid = self.online.get(m.metadata.dst_node_id)
            run = m.content["fedvl.run"]
            rnd = int(run["round"]) if "round" in run else -1
            if pid is None or self.drop(pid, m.metadata.message_type, rnd):
                continue
            self.outbox[m.metadata.message_id] = app(m, self.contexts[pid])
        return ids

    def pull_messages(self, ids) -> list:
        """The replies ready for `ids` (each handed out once)."""
        return [self.outbox.pop(i) for i in list(ids) if i in self.outbox]

    def restart(self, pid: int) -> None:
        """The node of `pid` goes away and comes back with a new id (its state is lost)."""
        from flwr.app import RecordDict

        old = next(n for n, p in self.online.items() if p == pid)
        del self.online[old]
        self.online[old + 100] = pid
        self.contexts[pid].state = RecordDict()


def run_on_grid(grid: FakeGrid, cfg: RunConfig, tmp_path: Path, resume: bool = False,
                name: str = "run", **opts: Any) -> dict:
    """Run fedvl's ServerApp logic on `grid` into tmp_path/name; its summary."""
    from fedvl.flower.server_app import FlowerRun, ServerOptions

    o = ServerOptions(out=str(tmp_path / name), **opts)
    run = FlowerRun(grid, cfg, o, resume=True) if resume else FlowerRun(grid, cfg, o)
    return run.run()


def write_medmnist(root: Path, name: str, num_classes: int, rgb: bool,
                   n_train: int = 120, n_test: int = 40) -> Path:
    """An archive laid out like the official ones: uint8 images, labels of shape (N, 1)."""
    rng = np.random.default_rng(0)
    shape = (28, 28, 3) if rgb else (28, 28)
    arrays = {}
    for split, n in (("train", n_train), ("val", 10), ("test", n_test)):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % num_classes).astype(np.uint8)[:, None]
    path = root / "medmnist" / f"{name}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path

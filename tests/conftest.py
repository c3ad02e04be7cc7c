"""Shared fixtures: tiny learnable federations and the shared data directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fedvl.config import RunConfig
from fedvl.data.federated import ClientData, FederatedDataset

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


@pytest.fixture(autouse=True)
def _one_thread():
    # Tests use tiny tensors: on a shared 2-core machine extra threads only add contention.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def toy_fed() -> FederatedDataset:
    return make_toy_federation()


@pytest.fixture
def tiny_cfg() -> RunConfig:
    return RunConfig(method="fedavg", benchmark="digits-offline", rounds=3, batch_size=16,
                     lr=0.05, momentum=0.0, model="convnet",
                     model_args={"width": 8, "depth": 2, "norm": "instance"})


@pytest.fixture
def shared_data() -> Path:
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

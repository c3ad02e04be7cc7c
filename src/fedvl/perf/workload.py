"""The perf workload: one FedAvg setting, its client arrays and model, shared by every engine.

Every engine `fedvl perf` compares trains the same fedvl ConvNet (same initial weights) on the
same client arrays, exported once to an `.npz` (`x{k}`, `y{k}`, `xt{k}`, `yt{k}` per client k),
with SGD at the same learning rate, momentum and batch size, one local epoch per round, every
client every round, sample-weighted averaging. An engine reports the wall-clock time
(`time.time()`) at which each round started and ended and the final mean client accuracy.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Workload:
    """What every engine runs: data, model and FedAvg settings."""

    benchmark: str = "cifar10-dirichlet"
    data_dir: str | None = None
    clients: int = 10
    train_per_client: int = 200
    test_per_client: int = 100
    alpha: float = 0.5
    width: int = 32
    depth: int = 3
    norm: str = "instance"
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    rounds: int = 6
    seed: int = 0
    device: str = "cpu"
    partitions: int | None = None   # clients per domain (digits-offline, ...); None: default

    def to_json(self) -> str:
        """The workload as one JSON line (passed to each engine's process)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Workload:
        """The workload of `to_json`'s text."""
        return cls(**json.loads(text))

    def model_args(self) -> dict[str, Any]:
        """fedvl ConvNet options of the workload."""
        return {"width": self.width, "depth": self.depth, "norm": self.norm}


@dataclass
class ClientArrays:
    """The exported clients: training and test tensors per client, and the label space."""

    train: list[tuple[torch.Tensor, torch.Tensor]]
    test: list[tuple[torch.Tensor, torch.Tensor]]
    num_classes: int

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the images."""
        c, h, w = self.train[0][0].shape[1:]
        return int(c), int(h), int(w)

    @property
    def num_clients(self) -> int:
        """How many clients were exported."""
        return len(self.train)

    @property
    def images_per_round(self) -> int:
        """Training images one round visits (every client, one epoch)."""
        return sum(len(y) for _, y in self.train)


def export_arrays(w: Workload, path: str | Path) -> Path:
    """Build the workload's federation with fedvl's loader and write its arrays to `path`."""
    from fedvl.config import RunConfig
    from fedvl.run.assemble import build_federation

    cfg = RunConfig(benchmark=w.benchmark, data_dir=w.data_dir, num_clients=w.clients,
                    train_cap=w.train_per_client, test_cap=w.test_per_client, alpha=w.alpha,
                    seed=w.seed, partitions=w.partitions)
    fed = build_federation(cfg)
    arrays: dict[str, np.ndarray] = {"num_classes": np.array(fed.num_classes)}
    for k, c in enumerate(fed.clients):
        arrays.update({f"x{k}": c.x_train.numpy(), f"y{k}": c.y_train.numpy(),
                       f"xt{k}": c.x_test.numpy(), f"yt{k}": c.y_test.numpy()})
    path = Path(path)
    np.savez(path, **arrays)
    return path


def load_arrays(path: str | Path) -> ClientArrays:
    """The client arrays written by `export_arrays`."""
    with np.load(path) as f:
        k = sum(1 for name in f.files if name.startswith("xt"))
        t = {name: torch.from_numpy(f[name]) for name in f.files}
    return ClientArrays([(t[f"x{i}"], t[f"y{i}"]) for i in range(k)],
                        [(t[f"xt{i}"], t[f"yt{i}"]) for i in range(k)], int(t["num_classes"]))


def build_net(w: Workload, data: ClientArrays) -> torch.nn.Module:
    """The workload's ConvNet with the initial weights every engine starts from: those of
    `fedvl run` with the workload's seed."""
    from fedvl.models.base import build_model
    from fedvl.run.assemble import model_seed

    c, h, _ = data.image_shape
    return build_model("convnet", c, data.num_classes, h, seed=model_seed(w.seed),
                       **w.model_args())


def mean_client_accuracy(model: torch.nn.Module, data: ClientArrays) -> float:
    """Mean over clients of the model's accuracy on each client's test arrays."""
    from fedvl.core.training import evaluate, mean_accuracy

    device = next(model.parameters()).device
    return mean_accuracy(evaluate(model, x.to(device), y.to(device))[0] for x, y in data.test)


def engine_main(module: str, run: Callable[[Workload, str, int], dict[str, Any] | None],
                argv: list[str] | None = None) -> int:
    """A peer process's entry point: WORKLOAD_JSON ARRAYS OUT_JSON WORKERS -> its row file."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        print(f"usage: python -m {module} WORKLOAD_JSON ARRAYS OUT_JSON WORKERS",
              file=sys.stderr)
        return 2
    row = run(Workload.from_json(args[0]), args[1], int(args[3]))
    if row is not None:   # a multi-process peer writes from one process only
        Path(args[2]).write_text(json.dumps(row))
    return 0

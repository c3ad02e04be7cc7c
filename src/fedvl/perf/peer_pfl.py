"""The perf workload on pfl-research: FederatedAveraging on its simulated backend, distributed.

Run under torchrun (pfl's documented launcher for PyTorch), one process per worker:
`python -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node=WORKERS
-m fedvl.perf.peer_pfl WORKLOAD_JSON ARRAYS OUT_JSON WORKERS`.

Every process runs pfl's `FederatedAlgorithm.run`; pfl shards each round's cohort across the
processes (balanced by client sample counts), sums each process's weighted updates and
all-reduces the sums once per round (gloo on CPU); the central optimiser (SGD, lr 1) applies
the mean. Client data are pfl's in-memory `Dataset`, which pfl's guide calls the fastest
representation when everything fits in RAM. Rank 0 writes OUT_JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

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


class PflNet(torch.nn.Module):
    """The workload's ConvNet with the `loss` and `metrics` methods pfl's PyTorchModel needs."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The ConvNet's logits."""
        return self.net(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        """Mean cross-entropy of a batch (the training loss)."""
        self.train(not eval)
        return F.cross_entropy(self.net(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict[str, Any]:
        """Summed loss and correct count, weighted by the batch size (pfl's metric form)."""
        from pfl.metrics import Weighted

        self.train(not eval)
        logits = self.net(x)
        n = len(y)
        return {"loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), n),
                "accuracy": Weighted(float((logits.argmax(1) == y).sum()), n)}


def run(w: Workload, arrays: str, workers: int) -> dict[str, Any] | None:
    """Run the workload on pfl in this torchrun process; rank 0 returns the result row."""
    # pfl follows LOCAL_RANK onto a GPU when one exists; the comparison is on CPU.
    os.environ.setdefault("PFL_PYTORCH_DEVICE", "cpu")
    # One intra-op thread per process: torchrun starts `workers` processes for `workers` cores.
    torch.set_num_threads(1)
    # pfl joins torchrun's torch.distributed group when its PyTorch ops are first imported.
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    class NoEvalFedAvg(FederatedAveraging):
        """pfl's FedAvg without the per-user evaluation pfl does in round 0 (the workload has
        no evaluation during training)."""

        def get_next_central_contexts(self, *args: Any, **kwargs: Any) -> Any:
            contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
            if contexts is not None:
                contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
            return contexts, model, metrics

    class Clock(TrainingProcessCallback):
        """Round start and end times; tells the dataset which round it is serving."""

        def __init__(self) -> None:
            self.round = 0
            self.starts: list[float] = []
            self.ends: list[float] = []

        def on_train_begin(self, *, model: Any) -> Metrics:
            self.starts.append(time.time())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics: Metrics, model: Any, *,
                                    central_iteration: int) -> tuple[bool, Metrics]:
            now = time.time()
            self.ends.append(now)
            self.round = central_iteration + 1
            if self.round < w.rounds:
                self.starts.append(now)
            return False, Metrics()

    data = load_arrays(arrays)
    net = build_net(w, data)
    # pfl seeds its samplers from NumPy's global RNG: the same seed on every process keeps
    # their cohorts in step.
    np.random.seed(w.seed)
    clock = Clock()
    k = len(data.train)
    fed = FederatedDataset(
        functools.partial(_user_dataset, Dataset, w, data, clock),
        get_user_sampler("minimize_reuse", list(range(k))),
        # pfl's documented way to spread unequal clients evenly over the processes.
        user_id_to_weight={c: max(1, len(y)) for c, (_, y) in enumerate(data.train)})
    model = PyTorchModel(
        model=PflNet(net),
        local_optimizer_create=functools.partial(torch.optim.SGD, momentum=w.momentum),
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    backend = SimulatedBackend(training_data=fed, val_data=fed,
                               postprocessors=[WeightByDatapoints()])
    params = NNAlgorithmParams(central_num_iterations=w.rounds,
                               evaluation_frequency=w.rounds + 1,
                               train_cohort_size=k, val_cohort_size=None)
    train = NNTrainHyperParams(local_num_epochs=1, local_learning_rate=w.lr,
                               local_batch_size=w.batch_size)
    NoEvalFedAvg().run(algorithm_params=params, backend=backend, model=model,
                       model_train_params=train, callbacks=[clock],
                       send_metrics_to_platform=False)
    dist = get_default_framework_module().distributed
    if dist.global_rank != 0:
        return None
    t = time.time()
    accuracy = mean_client_accuracy(net, data)
    eval_seconds = time.time() - t
    ver = importlib.metadata.version("pfl")
    setting = (f"pfl {ver} FederatedAveraging + SimulatedBackend, torchrun {dist.world_size} "
               f"processes (gloo) x 1 torch thread, in-memory Dataset, WeightByDatapoints, "
               f"torch {torch.__version__}")
    return {"round_starts": clock.starts, "round_ends": clock.ends, "accuracy": accuracy,
            "eval_seconds": eval_seconds, "setting": setting, "version": ver}


def _user_dataset(dataset_cls: Any, w: Workload, data: ClientArrays, clock: Any,
                  uid: int) -> Any:
    # pfl batches a user's data in stored order, so the round's shuffle happens here, drawn
    # from the same (seed, round, client) stream as fedvl's engines.
    x, y = data.train[uid]
    g = torch.Generator().manual_seed(derive_seed(w.seed, clock.round, uid, _CLIENT_STREAM))
    order = torch.randperm(len(y), generator=g, device=g.device)
    return dataset_cls((x[order], y[order]), user_id=uid)


def main(argv: list[str] | None = None) -> int:
    """Entry point (under torchrun): WORKLOAD_JSON ARRAYS OUT_JSON WORKERS."""
    code = engine_main("fedvl.perf.peer_pfl", run, argv)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())

"""One labelled image set split over `--num-clients` clients by `--partition`.

The shape shared by the single-dataset label-skew benchmarks (CIFAR-10, MedMNIST,
Fashion-MNIST): the whole training split is partitioned, `train_cap` then keeps at most that
many images of each client's share, class-stratified (so its label mix is unchanged), and each
client's test set is drawn from the official test split to follow its label mix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.partition import matched_test_indices
from fedvl.data.sources import DataOptions
from fedvl.data.transforms import PixelImages, stratified_subset, to_tensor_images


def split_labelled(benchmark: str, train: tuple[np.ndarray, np.ndarray],
                   test: tuple[np.ndarray, np.ndarray], num_classes: int, opts: DataOptions,
                   *, size: int, channels: int, mean: tuple[float, ...],
                   std: tuple[float, ...], default_alpha: float, streams: tuple[int, int],
                   info: dict[str, Any] | None = None) -> FederatedDataset:
    """Clients of uint8 images `train` split by `opts`; `streams` tag the cap and test draws.

    Each benchmark keeps its own two stream tags so its clients stay the same across versions.
    """
    x_tr, y_tr = train
    x_te, y_test = test
    split = opts.label_split(default_alpha)
    parts = split.split(y_tr, opts.num_clients, opts.seed, num_classes)
    parts = [idx[stratified_subset(y_tr[idx], opts.train_cap,
                                   np.random.default_rng([opts.seed, streams[0], i]))]
             for i, idx in enumerate(parts)]
    # Kept as uint8 until read: clients copy their rows, evaluation reads batches.
    x_test = PixelImages(x_te, size, channels, mean, std)
    test_size = opts.test_cap or max(100, len(y_test) // opts.num_clients)
    clients = []
    for i, idx in enumerate(parts):
        y_i = y_tr[idx]
        te = matched_test_indices(y_test, np.bincount(y_i, minlength=num_classes), test_size,
                                  np.random.default_rng([opts.seed, streams[1], i]))
        clients.append(ClientData(
            name=f"client{i}",
            # Only the kept images are converted (not the whole split when clients are capped).
            x_train=to_tensor_images(x_tr[idx], size, channels, mean, std),
            y_train=torch.from_numpy(y_i),
            x_test=x_test[torch.from_numpy(te)],
            y_test=torch.from_numpy(y_test[te]),
        ))
    return FederatedDataset(
        benchmark, clients, num_classes, mean, std,
        global_test=(x_test, torch.from_numpy(y_test)),
        info={**(info or {}), **split.info(), "num_clients": opts.num_clients},
    )

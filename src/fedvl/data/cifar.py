"""CIFAR-10 with label skew over N clients (`--partition`, Dirichlet by default), read from
`<data-dir>/cifar10.npz`."""

from __future__ import annotations

import numpy as np
import torch

from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.partition import matched_test_indices
from fedvl.data.sources import DataOptions, check_images, check_labels, load_npz, require_data_dir
from fedvl.data.spec import BenchmarkSpec, declare_benchmark
from fedvl.data.transforms import PixelImages, stratified_subset, to_tensor_images

# Dataset-condensation statistics for CIFAR-10.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2023, 0.1994, 0.2010)
DEFAULT_ALPHA = 0.5  # when --alpha is not given


@declare_benchmark("cifar10-dirichlet", BenchmarkSpec(
    label_split="always", count_clients=lambda opts: opts.num_clients,
    reads=frozenset({"num_clients"})))
def cifar10_dirichlet(opts: DataOptions) -> FederatedDataset:
    """CIFAR-10 split by `--partition` (default Dirichlet(alpha)); each client's test set
    follows its label mix.

    The whole training set is partitioned; `train_cap` then keeps at most that many images of
    each client's share, class-stratified, so the client's label mix is unchanged.
    """
    opts.refuse_partitions("cifar10-dirichlet", "splits one dataset over --num-clients "
                           "clients")
    path = require_data_dir(opts, "cifar10-dirichlet") / "cifar10.npz"
    arr = load_npz(path, ("x_train", "y_train", "x_test", "y_test"))
    x_train = check_images(arr["x_train"], path, "x_train")
    y_tr = check_labels(arr["y_train"], path, "y_train", 10, x_train, "x_train")
    x_te = check_images(arr["x_test"], path, "x_test")
    y_test = check_labels(arr["y_test"], path, "y_test", 10, x_te, "x_test")
    split = opts.label_split(DEFAULT_ALPHA)
    parts = split.split(y_tr, opts.num_clients, opts.seed, 10)
    parts = [idx[stratified_subset(y_tr[idx], opts.train_cap,
                                   np.random.default_rng([opts.seed, 11, i]))]
             for i, idx in enumerate(parts)]
    size = opts.image_size or 32
    # Kept as uint8 until read: clients copy their rows, evaluation reads batches.
    x_test = PixelImages(x_te, size, 3, MEAN, STD)
    test_size = opts.test_cap or max(100, len(y_test) // opts.num_clients)
    clients = []
    for i, idx in enumerate(parts):
        y_i = y_tr[idx]
        te = matched_test_indices(y_test, np.bincount(y_i, minlength=10), test_size,
                                  np.random.default_rng([opts.seed, 13, i]))
        clients.append(ClientData(
            name=f"client{i}",
            # Only the kept images are converted (not all 50,000 when clients are capped).
            x_train=to_tensor_images(x_train[idx], size, 3, MEAN, STD),
            y_train=torch.from_numpy(y_i),
            x_test=x_test[torch.from_numpy(te)],
            y_test=torch.from_numpy(y_test[te]),
        ))
    return FederatedDataset(
        "cifar10-dirichlet", clients, 10, MEAN, STD,
        global_test=(x_test, torch.from_numpy(y_test)),
        info={**split.info(), "num_clients": opts.num_clients},
    )

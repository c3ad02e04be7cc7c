"""CIFAR-10 and CIFAR-100 with label skew over N clients (`--partition`, Dirichlet by default),
read from `<data-dir>/cifar10.npz` and `<data-dir>/cifar100.npz`; the unsplit CIFAR-100 file is
also the `cifar100` benchmark, one client, whose training images are FedDF's `--public cifar100`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.labelled import split_labelled
from fedvl.data.sources import DataOptions, check_images, check_labels, load_npz, require_data_dir
from fedvl.data.spec import BenchmarkSpec, declare_benchmark
from fedvl.data.transforms import stratified_subset, to_tensor_images

# Dataset-condensation statistics for CIFAR-10 and CIFAR-100.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2023, 0.1994, 0.2010)
MEAN100 = (0.5071, 0.4866, 0.4409)
STD100 = (0.2673, 0.2564, 0.2762)
DEFAULT_ALPHA = 0.5  # when --alpha is not given
_KEYS = ("x_train", "y_train", "x_test", "y_test")

Arrays = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
Factory = Callable[[DataOptions], FederatedDataset]


def load_cifar(opts: DataOptions, benchmark: str, file: str, num_classes: int) -> Arrays:
    """((x_train, y_train), (x_test, y_test)) of `<data-dir>/<file>`, checked."""
    path = require_data_dir(opts, benchmark) / file
    arr = load_npz(path, _KEYS)
    x_tr = check_images(arr["x_train"], path, "x_train")
    y_tr = check_labels(arr["y_train"], path, "y_train", num_classes, x_tr, "x_train")
    x_te = check_images(arr["x_test"], path, "x_test")
    y_te = check_labels(arr["y_test"], path, "y_test", num_classes, x_te, "x_test")
    return (x_tr, y_tr), (x_te, y_te)


def _label_skew(name: str, file: str, num_classes: int, mean: tuple[float, ...],
                std: tuple[float, ...], streams: tuple[int, int]) -> Factory:
    """Register benchmark `name`: `<data-dir>/<file>` split over `--num-clients` clients."""

    @declare_benchmark(name, BenchmarkSpec(
        label_split="always", count_clients=lambda opts: opts.num_clients,
        reads=frozenset({"num_clients"})))
    def build(opts: DataOptions) -> FederatedDataset:
        """The training set split by `--partition` (default Dirichlet(alpha)); each client's
        test set follows its label mix, and the whole test set is the global one.

        The whole training set is partitioned; `train_cap` then keeps at most that many images
        of each client's share, class-stratified, so the client's label mix is unchanged.
        """
        opts.refuse_partitions(name, "splits one dataset over --num-clients clients")
        train, test = load_cifar(opts, name, file, num_classes)
        return split_labelled(name, train, test, num_classes, opts, size=opts.image_size or 32,
                              channels=3, mean=mean, std=std, default_alpha=DEFAULT_ALPHA,
                              streams=streams)

    return build


# Each keeps its own stream tags: a CIFAR-100 client's draws never repeat a CIFAR-10 client's.
cifar10_dirichlet = _label_skew("cifar10-dirichlet", "cifar10.npz", 10, MEAN, STD, (11, 13))
# CIFAR-100 is the shared 100/50-per-class subset (docs/datasets.md).
cifar100_dirichlet = _label_skew("cifar100-dirichlet", "cifar100.npz", 100, MEAN100, STD100,
                                 (31, 37))


@declare_benchmark("cifar100", BenchmarkSpec(count_clients=lambda opts: 1))
def cifar100(opts: DataOptions) -> FederatedDataset:
    """CIFAR-100 unsplit, one client: the pooled reference, and `--public cifar100`."""
    opts.refuse_partition("cifar100", "has one client")
    opts.refuse_partitions("cifar100", "has one client")
    (x_tr, y_tr), (x_te, y_te) = load_cifar(opts, "cifar100", "cifar100.npz", 100)
    rng = np.random.default_rng([opts.seed, 41])
    tr = stratified_subset(y_tr, opts.train_cap, rng)
    te = stratified_subset(y_te, opts.test_cap, rng)
    size = opts.image_size or 32
    client = ClientData("cifar100", to_tensor_images(x_tr[tr], size, 3, MEAN100, STD100),
                        torch.from_numpy(y_tr[tr]),
                        to_tensor_images(x_te[te], size, 3, MEAN100, STD100),
                        torch.from_numpy(y_te[te]))
    return FederatedDataset("cifar100", [client], 100, MEAN100, STD100)

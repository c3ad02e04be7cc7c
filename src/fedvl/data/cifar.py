"""CIFAR-10 with label skew over N clients (`--partition`, Dirichlet by default), read from
`<data-dir>/cifar10.npz`."""

from __future__ import annotations

from fedvl.data.federated import FederatedDataset
from fedvl.data.labelled import split_labelled
from fedvl.data.sources import DataOptions, check_images, check_labels, load_npz, require_data_dir
from fedvl.data.spec import BenchmarkSpec, declare_benchmark

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
    return split_labelled("cifar10-dirichlet", (x_train, y_tr), (x_te, y_test), 10, opts,
                          size=opts.image_size or 32, channels=3, mean=MEAN, std=STD,
                          default_alpha=DEFAULT_ALPHA, streams=(11, 13))

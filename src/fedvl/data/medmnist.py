"""MedMNIST v2 (2D, single-label) with label skew (`--partition`, Dirichlet by default), from
`<data-dir>/medmnist/<name>.npz`.

Any official MedMNIST v2 archive works (keys `train_images`, `train_labels`, `val_*`,
`test_*`); `--dataset` names the file, e.g. `pneumoniamnist`, `organamnist`, `pathmnist`.
The official `val` split is not used: the runs do no model selection, and keeping the training
split as published keeps client data sizes comparable with papers that train on it alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedvl.data.federated import FederatedDataset
from fedvl.data.labelled import split_labelled
from fedvl.data.sources import DataError, DataOptions, load_npz, require_data_dir
from fedvl.data.spec import BenchmarkSpec, declare_benchmark

# The official MedMNIST examples normalise with mean 0.5 / std 0.5; it also matches DIGITS.
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
KEYS = ("train_images", "train_labels", "test_images", "test_labels")
UNUSED_KEYS = ("val_images", "val_labels")
DEFAULT_ALPHA = 0.5  # when --alpha is not given


def medmnist_path(data_dir: Path, dataset: str) -> Path:
    """`<data_dir>/medmnist/<dataset>.npz`, refusing names that would leave that folder."""
    if (not dataset or Path(dataset).name != dataset or dataset in (".", "..")
            or not dataset.isprintable()):
        raise DataError(f"MedMNIST dataset name {dataset!r} must be a plain file stem, "
                        "e.g. 'pneumoniamnist'")
    return data_dir / "medmnist" / f"{dataset.removesuffix('.npz')}.npz"


def _labels(y: np.ndarray, path: Path, key: str) -> np.ndarray:
    """Official (N, 1) integer labels -> int64 (N,); multi-label sets are refused by name."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(f"'{path}' array '{key}' has shape {y.shape}; only single-label "
                        "MedMNIST sets (labels N or N x 1) are supported")
    if not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        raise DataError(f"'{path}' array '{key}' must hold non-negative integer labels, "
                        f"got {y.dtype}")
    return y.astype(np.int64)


def _images(x: np.ndarray, path: Path, key: str) -> np.ndarray:
    """Grey (N, H, W) or RGB (N, H, W, 3) uint8 images, checked."""
    if x.dtype != np.uint8 or not (x.ndim == 3 or (x.ndim == 4 and x.shape[-1] in (1, 3))):
        raise DataError(f"'{path}' array '{key}' must be uint8 N x H x W (grey) or "
                        f"N x H x W x 3 (RGB), got {x.dtype} {x.shape}")
    return x


@declare_benchmark("medmnist", BenchmarkSpec(label_split="always",
                                             count_clients=lambda opts: opts.num_clients,
                                             reads=frozenset({"dataset", "num_clients"})))
def medmnist(opts: DataOptions) -> FederatedDataset:
    """A MedMNIST v2 set split by `--partition` (default Dirichlet(alpha)); each client's test
    set follows its label mix.

    The official train split is partitioned; `train_cap` then keeps at most that many images of
    each client's share, class-stratified. The global test set is the whole official test split.
    """
    opts.refuse_partitions("medmnist", "splits one dataset over --num-clients clients")
    path = medmnist_path(require_data_dir(opts, "medmnist"), opts.dataset)
    if not path.is_file():
        raise DataError(f"missing MedMNIST file '{path}' (--dataset {opts.dataset}); expected "
                        f"an official MedMNIST v2 .npz with arrays {', '.join(KEYS)} "
                        f"({', '.join(UNUSED_KEYS)} are not used)")
    arr = load_npz(path, KEYS)
    x_tr = _images(arr["train_images"], path, "train_images")
    x_te = _images(arr["test_images"], path, "test_images")
    y_tr = _labels(arr["train_labels"], path, "train_labels")
    y_test = _labels(arr["test_labels"], path, "test_labels")
    for split, x, y in (("train", x_tr, y_tr), ("test", x_te, y_test)):
        if len(x) != len(y) or len(y) == 0:
            raise DataError(f"'{path}': {split}_images has {len(x)} images but "
                            f"{split}_labels has {len(y)} labels (need the same, > 0)")
    # The label space is the union of both splits, so a class absent from train still counts.
    num_classes = int(max(y_tr.max(), y_test.max())) + 1
    return split_labelled(
        "medmnist", (x_tr, y_tr), (x_te, y_test), num_classes, opts,
        size=opts.image_size or 28, channels=3, mean=MEAN, std=STD, default_alpha=DEFAULT_ALPHA,
        streams=(17, 19),
        info={"dataset": opts.dataset, "native_size": int(x_tr.shape[1]),
              "native_channels": 1 if x_tr.ndim == 3 else int(x_tr.shape[-1]),
              "val_split": "unused"})

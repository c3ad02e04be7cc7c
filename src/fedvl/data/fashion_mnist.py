"""Fashion-MNIST (Xiao et al. 2017) with label skew over `--num-clients` clients, read from the
original IDX files: `<data-dir>/fashion-mnist/`, or without `--data-dir` where Debian's
`dataset-fashion-mnist` package installs them (`/usr/share/datasets/fashion-mnist/`).

The four files keep their published names (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
`t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`), gzip-compressed (`.gz`, as published and
as the package ships them) or not.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from fedvl.data.federated import FederatedDataset
from fedvl.data.labelled import split_labelled
from fedvl.data.sources import DataError, DataOptions, shown_path
from fedvl.data.spec import BenchmarkSpec, declare_benchmark

SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
PACKAGE = "dataset-fashion-mnist"
FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
         "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
# The commonly used Fashion-MNIST normalisation (mean and std of the training pixels).
MEAN = (0.2860,)
STD = (0.3530,)
NUM_CLASSES = 10
DEFAULT_ALPHA = 0.5  # when --alpha is not given
# IDX header: magic (0, 0, type 0x08 = unsigned byte, number of dimensions), then each size.
_UBYTE = 0x08
_MAX_ITEMS = 10_000_000   # far above the 70,000 published images: a crafted header is refused


def fashion_dir(opts: DataOptions) -> Path:
    """The folder holding the four IDX files: under `--data-dir`, else the Debian package's."""
    return Path(opts.data_dir) / "fashion-mnist" if opts.data_dir else SYSTEM_DIR


def _file(folder: Path, stem: str) -> Path:
    """`folder/stem.gz` or `folder/stem`, whichever exists (one clear error when neither)."""
    for path in (folder / f"{stem}.gz", folder / stem):
        if path.is_file():
            return path
    hint = (f"install Debian's {PACKAGE} package (apt-get install {PACKAGE}) or pass "
            "--data-dir DIR with the files in DIR/fashion-mnist/")
    raise DataError(f"missing Fashion-MNIST file '{shown_path(folder / stem)}[.gz]': {hint}")


def _open(path: Path) -> BinaryIO:
    """The file's bytes, decompressed when it is gzip (by its magic, not its name)."""
    with path.open("rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else path.open("rb")  # type: ignore[return-value]


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes with `ndim` dimensions, checked against its header.

    Only the bytes the header announces are read (and one more, to refuse trailing data), so a
    crafted header or a decompression bomb cannot make it allocate more than the sizes it states,
    which are themselves bounded.
    """
    try:
        with _open(path) as f:
            head = f.read(4 + 4 * ndim)
            if len(head) < 4 + 4 * ndim:
                raise DataError(f"'{shown_path(path)}' is too short to be an IDX file")
            zero, kind, dims = struct.unpack(">HBB", head[:4])
            if zero != 0 or kind != _UBYTE or dims != ndim:
                raise DataError(f"'{shown_path(path)}' is not an IDX file of unsigned bytes "
                                f"with {ndim} dimension(s) (header {head[:4].hex()})")
            shape = struct.unpack(f">{ndim}I", head[4:])
            count = int(np.prod(shape, dtype=np.int64))
            if shape[0] == 0 or shape[0] > _MAX_ITEMS or count > _MAX_ITEMS * 28 * 28:
                raise DataError(f"'{shown_path(path)}' announces shape {shape}; expected "
                                f"1 to {_MAX_ITEMS} items of at most 28 x 28 pixels")
            body = f.read(count + 1)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"'{shown_path(path)}' cannot be read: {e}") from e
    if len(body) != count:
        raise DataError(f"'{shown_path(path)}' holds {len(body)}{'+' if len(body) > count else ''}"
                        f" bytes of data; its header announces {count} (shape {shape})")
    # A writable copy: torch refuses to share memory with read-only bytes.
    return np.frombuffer(body, dtype=np.uint8).reshape(shape).copy()


def load_fashion_mnist(folder: Path) -> tuple[np.ndarray, ...]:
    """(train images, train labels, test images, test labels) from `folder`, checked."""
    x_tr = read_idx(_file(folder, FILES["train_images"]), 3)
    y_tr = read_idx(_file(folder, FILES["train_labels"]), 1)
    x_te = read_idx(_file(folder, FILES["test_images"]), 3)
    y_te = read_idx(_file(folder, FILES["test_labels"]), 1)
    for split, x, y in (("train", x_tr, y_tr), ("t10k", x_te, y_te)):
        if len(x) != len(y):
            raise DataError(f"Fashion-MNIST in '{shown_path(folder)}': {split} has {len(x)} "
                            f"images but {len(y)} labels")
        if y.max() >= NUM_CLASSES:
            raise DataError(f"Fashion-MNIST in '{shown_path(folder)}': {split} labels must be "
                            f"0-{NUM_CLASSES - 1}, found {int(y.max())}")
    return x_tr, y_tr.astype(np.int64), x_te, y_te.astype(np.int64)


@declare_benchmark("fashion-mnist", BenchmarkSpec(
    needs_data_dir=False, label_split="always", count_clients=lambda opts: opts.num_clients,
    reads=frozenset({"num_clients"})))
def fashion_mnist(opts: DataOptions) -> FederatedDataset:
    """Fashion-MNIST split by `--partition` (default Dirichlet(alpha)); each client's test set
    follows its label mix; the whole t10k split is the global test set."""
    opts.refuse_partitions("fashion-mnist", "splits one dataset over --num-clients clients")
    folder = fashion_dir(opts)
    x_tr, y_tr, x_te, y_te = load_fashion_mnist(folder)
    return split_labelled("fashion-mnist", (x_tr, y_tr), (x_te, y_te), NUM_CLASSES, opts,
                          size=opts.image_size or 28, channels=1, mean=MEAN, std=STD,
                          default_alpha=DEFAULT_ALPHA, streams=(23, 29),
                          info={"source": str(folder)})

"""Fashion-MNIST from its original IDX files: the package location, crafted files, public set."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from fedvl.data.fashion_mnist import FILES, SYSTEM_DIR, fashion_mnist, read_idx
from fedvl.data.sources import DataError, DataOptions


def write_idx(path: Path, a: np.ndarray, *, compress: bool = True, header: bytes | None = None,
              extra: bytes = b"") -> None:
    """An IDX file of unsigned bytes, as published (header, then the raw array)."""
    head = header if header is not None else (
        struct.pack(">HBB", 0, 0x08, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape))
    data = head + a.astype(np.uint8).tobytes() + extra
    if compress:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def fake_fashion(root: Path, n_train: int = 120, n_test: int = 60) -> Path:
    """DIR/fashion-mnist/ with small random IDX files in the published names."""
    folder = root / "fashion-mnist"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    write_idx(folder / FILES["train_images"], rng.integers(0, 256, (n_train, 28, 28)))
    write_idx(folder / FILES["train_labels"], np.arange(n_train) % 10)
    # Uncompressed files are read too.
    write_idx(folder / FILES["test_images"], rng.integers(0, 256, (n_test, 28, 28)),
              compress=False)
    write_idx(folder / FILES["test_labels"], np.arange(n_test) % 10, compress=False)
    return folder


def test_label_skew_clients_from_idx_files(tmp_path):
    fake_fashion(tmp_path)
    # 5 clients x 2 shards of the 120 label-sorted images: 12 images, one class, per shard.
    fed = fashion_mnist(DataOptions(data_dir=str(tmp_path), num_clients=5, partition="shards",
                                    shards_per_client=2, test_cap=10, seed=1))
    assert [c.name for c in fed.clients] == [f"client{i}" for i in range(5)]
    assert fed.image_shape == (1, 28, 28) and fed.num_classes == 10
    assert sum(len(c.y_train) for c in fed.clients) == 120
    assert all(len(set(c.y_train.tolist())) <= 2 for c in fed.clients)
    assert len(fed.global_test[1]) == 60


@pytest.mark.parametrize("case, message", [
    ("magic", "is not an IDX file of unsigned bytes"),
    ("huge", "announces shape"),
    ("short", "bytes of data; its header announces"),
    ("trailing", r"\+ bytes of data"),
    ("label", "labels must be 0-9"),
    ("count", "has 120 images but 119 labels"),
    ("gzip", "cannot be read"),
])
def test_crafted_files_get_one_clear_error(tmp_path, case, message):
    folder = fake_fashion(tmp_path)
    labels = folder / (FILES["train_labels"] + ".gz")
    images = folder / (FILES["train_images"] + ".gz")
    y = np.arange(120) % 10
    if case == "magic":
        write_idx(labels.with_suffix(""), y, header=struct.pack(">HBBI", 0, 0x0D, 1, 120))
    elif case == "huge":   # 2^32 - 1 images of 28 x 28 announced: refused before any read
        write_idx(images.with_suffix(""), np.zeros((1, 28, 28)),
                  header=struct.pack(">HBB3I", 0, 8, 3, 2**32 - 1, 28, 28))
    elif case == "short":
        write_idx(labels.with_suffix(""), y[:50], header=struct.pack(">HBBI", 0, 8, 1, 120))
    elif case == "trailing":
        write_idx(labels.with_suffix(""), y, extra=b"\x00")
    elif case == "label":
        write_idx(labels.with_suffix(""), np.full(120, 10))
    elif case == "count":
        write_idx(labels.with_suffix(""), y[:119])
    else:
        labels.write_bytes(b"\x1f\x8b" + b"not gzip at all")
    with pytest.raises(DataError, match=message):
        fashion_mnist(DataOptions(data_dir=str(tmp_path), num_clients=2))


def test_missing_files_name_the_package(tmp_path):
    (tmp_path / "fashion-mnist").mkdir()
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist(DataOptions(data_dir=str(tmp_path)))


def test_idx_reader_bounds_what_it_reads(tmp_path):
    # A gzip bomb: a small header over gigabytes of zeros is never decompressed past the header's
    # size plus one byte.
    path = tmp_path / "bomb.gz"
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">HBBI", 0, 8, 1, 4) + b"\x01\x02\x03\x04")
        f.write(bytes(1 << 20))
    with pytest.raises(DataError, match=r"5\+ bytes of data; its header announces 4"):
        read_idx(path, 1)


def test_the_installed_package_files(tmp_path):
    """The real files where Debian's package puts them (CI installs the package)."""
    if not (SYSTEM_DIR / (FILES["train_images"] + ".gz")).is_file():
        if os.environ.get("CI"):
            pytest.fail(f"CI must install dataset-fashion-mnist ({SYSTEM_DIR} is empty)")
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    from fedvl.config import RunConfig
    from fedvl.run.experiment import run_experiment

    # As a benchmark of its own: 70,000 images read, 4 clients of 50 images each trained.
    cfg = RunConfig(method="fedavg", benchmark="fashion-mnist", num_clients=4, train_cap=50,
                    test_cap=50, rounds=1, batch_size=16, threads=1,
                    model_args={"width": 8, "depth": 2})
    summary = run_experiment(cfg, tmp_path / "run")
    assert summary["mean_accuracy"] > 0.1
    # As FedDF's unlabelled public set of a digits-offline run.
    cfg = RunConfig(method="feddf", public="fashion-mnist", public_size=32, train_cap=40,
                    test_cap=20, rounds=1, batch_size=16, threads=1,
                    method_args={"public_batch": 16}, model_args={"width": 8, "depth": 2})
    assert run_experiment(cfg, tmp_path / "feddf")["rounds"] == 1

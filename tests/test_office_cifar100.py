"""The `office-caltech10`, `cifar100-dirichlet` and `cifar100` benchmarks and `--public cifar100`:
on the shared files when present (skipped otherwise), and on small fake files that never skip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedvl.config import RunConfig, validate
from fedvl.data import DataError, DataOptions
from fedvl.data.office_caltech import CLASS_NAMES, DOMAINS, held_out
from fedvl.data.spec import spec_of
from fedvl.registry import BENCHMARKS
from tests.conftest import SHARED_DATA

OFFICE = SHARED_DATA / "office_caltech10"
CIFAR100 = SHARED_DATA / "cifar100.npz"
needs_office = pytest.mark.skipif(not (OFFICE / "amazon.npz").is_file(),
                                  reason=f"Office-Caltech-10 files not found in {OFFICE}")
needs_cifar100 = pytest.mark.skipif(not CIFAR100.is_file(), reason=f"{CIFAR100} not found")


def _office_files(root: Path, per_class: int = 10, x_dtype: type = np.uint8) -> Path:
    """Fake domain files: `per_class` 8x8 images of each class, pixel (0, 0) = the image index."""
    folder = root / "office_caltech10"
    folder.mkdir(parents=True)
    for d, name in enumerate(DOMAINS):
        n = per_class * len(CLASS_NAMES) + d       # domains of different sizes
        x = np.zeros((n, 8, 8, 3), dtype=x_dtype)
        x[:, 0, 0, 0] = np.arange(n) % 256
        x[:, 0, 0, 1] = np.arange(n) // 256
        np.savez(folder / f"{name}.npz", x=x, y=np.arange(n) % 10,
                 class_names=np.array(CLASS_NAMES), source_paths=np.array(["p"] * n))
    return root


def _cifar100_file(root: Path, n_train: int = 300, n_test: int = 200) -> Path:
    """A fake CIFAR-100 file: random 32x32x3 images, labels cycling through the 100 classes."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        arrays[f"x_{split}"] = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        arrays[f"y_{split}"] = np.arange(n) % 100
    np.savez(root / "cifar100.npz", **arrays)
    return root


def _ids(x: torch.Tensor) -> set[int]:
    """The image indices the fake files wrote into pixel (0, 0), read back from normalised x."""
    px = torch.round((x[:, :2, 0, 0] * 0.5 + 0.5) * 255).long()
    return set((px[:, 0] + 256 * px[:, 1]).tolist())


@pytest.mark.shared_data
@needs_office
def test_office_caltech10_on_the_shared_files():
    """Four clients, 10 classes, 64x64x3, a ceil(20 %) stratified test share per domain."""
    fed = BENCHMARKS.get("office-caltech10")(DataOptions(data_dir=str(SHARED_DATA)))
    assert fed.client_names == list(DOMAINS) and fed.num_classes == 10
    assert fed.image_shape == (3, 64, 64)
    assert [(c.num_train, len(c.y_test)) for c in fed.clients] == [
        (766, 192), (898, 225), (125, 32), (236, 59)]
    for c in fed.clients:       # every class on both sides of the split
        assert (c.class_counts(10) > 0).all() and (torch.bincount(c.y_test, minlength=10) > 0).all()
    small = BENCHMARKS.get("office-caltech10")(DataOptions(
        data_dir=str(SHARED_DATA), domains=["webcam", "dslr"], image_size=28, partitions=2,
        train_cap=30, test_cap=10))
    assert small.client_names == ["dslr-0", "dslr-1", "webcam-0", "webcam-1"]
    assert small.image_shape == (3, 28, 28)
    assert all(c.num_train <= 30 and len(c.y_test) <= 10 for c in small.clients)


def test_office_split_is_disjoint_stratified_and_fixed(tmp_path):
    """Train and test share no image, each class gives its share, and the run seed does not
    move the split (only `--train-cap` / `--test-cap` draws)."""
    root = _office_files(tmp_path)
    make = BENCHMARKS.get("office-caltech10")
    fed = make(DataOptions(data_dir=str(root), seed=0))
    again = make(DataOptions(data_dir=str(root), seed=0))
    other_seed = make(DataOptions(data_dir=str(root), seed=5))
    assert fed.client_names == list(DOMAINS) and fed.image_shape == (3, 64, 64)
    for d, (c, c2, c3) in enumerate(zip(fed.clients, again.clients, other_seed.clients,
                                        strict=True)):
        n = 100 + d
        train, test = _ids(c.x_train), _ids(c.x_test)
        assert not train & test and len(train | test) == n
        assert len(test) == int(np.ceil(0.2 * n))
        per_class = torch.bincount(c.y_test, minlength=10)     # 10 or 11 images per class
        assert per_class.min() >= 2 and per_class.max() <= 3
        assert torch.equal(c.x_test, c2.x_test) and torch.equal(c.x_test, c3.x_test)
        assert torch.equal(c.y_train, c2.y_train)
    # The split of a domain does not depend on which other domains are chosen.
    alone = make(DataOptions(data_dir=str(root), domains=["dslr"]))
    assert torch.equal(alone.clients[0].x_test, fed.clients[2].x_test)
    y = np.arange(157) % 10
    assert np.array_equal(held_out(y, "dslr"), held_out(y, "dslr"))


def test_office_partitions_2_doubles_the_clients(tmp_path):
    root = _office_files(tmp_path, per_class=20)
    fed = BENCHMARKS.get("office-caltech10")(DataOptions(data_dir=str(root), partitions=2))
    assert len(fed.clients) == 8
    assert spec_of("office-caltech10").num_clients(DataOptions(partitions=2)) == 8
    assert spec_of("office-caltech10").num_clients(DataOptions(domains=["dslr"])) == 1
    assert fed.client_names[:2] == ["amazon-0", "amazon-1"]
    assert fed.info["client_groups"] == [d for d in DOMAINS for _ in range(2)]
    one = BENCHMARKS.get("office-caltech10")(DataOptions(data_dir=str(root)))
    # The K clients of a domain split its training images between them.
    assert sum(c.num_train for c in fed.clients[:2]) == one.clients[0].num_train


@pytest.mark.shared_data
@needs_cifar100
def test_cifar100_dirichlet_and_public_cifar100_on_the_shared_file():
    from fedvl.run.assemble import build_public

    fed = BENCHMARKS.get("cifar100-dirichlet")(DataOptions(data_dir=str(SHARED_DATA),
                                                           num_clients=4, alpha=0.5))
    assert len(fed.clients) == 4 and fed.num_classes == 100 and fed.image_shape == (3, 32, 32)
    assert sum(c.num_train for c in fed.clients) == 10000
    assert fed.global_test is not None and len(fed.global_test[1]) == 5000
    cfg = validate(RunConfig(method="feddf", benchmark="digits-offline", public="cifar100",
                             public_size=64, data_dir=str(SHARED_DATA)))
    assert build_public(cfg, (3, 28, 28)).shape == (64, 3, 28, 28)


def test_public_cifar100_is_the_training_images_without_labels(tmp_path):
    from fedvl.run.assemble import build_public

    root = _cifar100_file(tmp_path)
    pooled = BENCHMARKS.get("cifar100")(DataOptions(data_dir=str(root)))
    assert pooled.client_names == ["cifar100"] and pooled.clients[0].num_train == 300
    cfg = validate(RunConfig(method="feddf", public="cifar100", public_size=1000,
                             data_dir=str(root)))
    x = build_public(cfg, (3, 32, 32))
    # Every training image, in a seeded order, and no test image.
    assert x.shape == (300, 3, 32, 32)
    rows = {tuple(r.tolist()) for r in pooled.clients[0].x_train[:, 0, 0, :4]}
    assert {tuple(r.tolist()) for r in x[:, 0, 0, :4]} == rows
    fed = BENCHMARKS.get("cifar100-dirichlet")(DataOptions(data_dir=str(root), num_clients=3))
    assert len(fed.clients) == 3 and sum(c.num_train for c in fed.clients) == 300


def test_missing_or_malformed_files_name_the_file_and_what_is_expected(tmp_path):
    make = BENCHMARKS.get
    with pytest.raises(DataError, match=r"missing data file '.*office_caltech10/amazon\.npz'; "
                                        r"expected an \.npz archive with arrays x, y, "
                                        r"class_names"):
        make("office-caltech10")(DataOptions(data_dir=str(tmp_path)))
    with pytest.raises(DataError, match=r"missing data file '.*cifar100\.npz'; expected an "
                                        r"\.npz archive with arrays x_train, y_train"):
        make("cifar100-dirichlet")(DataOptions(data_dir=str(tmp_path)))
    with pytest.raises(DataError, match=r"unknown office-caltech10 domain\(s\) \['art'\]"):
        make("office-caltech10")(DataOptions(data_dir=str(tmp_path), domains=["art"]))
    floats = _office_files(tmp_path / "f", x_dtype=np.float32)
    with pytest.raises(DataError, match=r"amazon\.npz' array 'x' must hold uint8 images .* got "
                                        r"float32 \(100, 8, 8, 3\)"):
        make("office-caltech10")(DataOptions(data_dir=str(floats)))
    bad = tmp_path / "b"
    _office_files(bad)
    np.savez(bad / "office_caltech10" / "dslr.npz", x=np.zeros((4, 8, 8, 3), np.uint8),
             y=np.arange(4), class_names=np.array(CLASS_NAMES[::-1]))
    with pytest.raises(DataError, match=r"dslr\.npz' names classes .*; expected \['back_pack'"):
        make("office-caltech10")(DataOptions(data_dir=str(bad)))
    _cifar100_file(tmp_path)
    with np.load(tmp_path / "cifar100.npz") as z:
        arrays = dict(z)
    np.savez(tmp_path / "cifar100.npz", **{**arrays, "y_train": arrays["y_train"] + 50})
    with pytest.raises(DataError, match=r"cifar100\.npz' array 'y_train' holds labels "
                                        r"50\.\.149; allowed: 0\.\.99"):
        make("cifar100-dirichlet")(DataOptions(data_dir=str(tmp_path)))
    np.savez(tmp_path / "cifar100.npz", **{**arrays, "x_test": arrays["x_test"][..., :2]})
    with pytest.raises(DataError, match=r"cifar100\.npz' array 'x_test' must hold uint8 images"):
        make("cifar100")(DataOptions(data_dir=str(tmp_path)))

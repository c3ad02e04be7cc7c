"""`--partition`: the shards and dominant label splits, and the benchmarks that use them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedvl.config import ConfigError, RunConfig, from_dict, validate
from fedvl.data.partition import (
    PARTITIONS,
    LabelSplit,
    dirichlet_partition,
    dominant_partition,
    shards_partition,
)
from fedvl.data.sources import DataError, DataOptions
from tests.conftest import write_medmnist

BALANCED = np.repeat(np.arange(10), 100)          # 10 classes x 100 samples
UNBALANCED = np.repeat([0, 1, 2], [300, 90, 30])  # a MedMNIST-like skew


def _disjoint(parts: list[np.ndarray], n: int) -> np.ndarray:
    """All indices of `parts`, checked to be in range and assigned at most once."""
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat), "an index is given to two clients"
    assert flat.min() >= 0 and flat.max() < n
    assert all(np.array_equal(p, np.sort(p)) for p in parts)
    return flat


@pytest.mark.parametrize("clients, k", [(10, 2), (20, 2), (5, 4), (10, 1), (50, 2)])
def test_shards_cover_every_sample_once_with_k_classes_each(clients, k):
    parts = shards_partition(BALANCED, clients, k, seed=0)
    flat = _disjoint(parts, len(BALANCED))
    assert len(flat) == len(BALANCED)                  # coverage: every sample exactly once
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= k                # k shards of equal size (+-1 each)
    # Shards of balanced classes hold one class each, and no client gets a class twice.
    assert [len(np.unique(BALANCED[p])) for p in parts] == [k] * clients


def test_shards_on_uneven_labels_still_cover_everything():
    y = np.repeat(np.arange(7), [50, 3, 20, 41, 9, 60, 17])
    parts = shards_partition(y, 6, 2, seed=3)
    assert len(_disjoint(parts, len(y))) == len(y)
    # A shard straddling a class boundary brings both classes (as in McMahan et al.).
    assert all(1 <= len(np.unique(y[p])) <= 4 for p in parts)


@pytest.mark.parametrize("split", [lambda seed: shards_partition(BALANCED, 10, 2, seed=seed),
                                   lambda seed: dominant_partition(BALANCED, 10, 0.8, seed=seed)],
                         ids=["shards", "dominant"])
def test_split_deterministic_from_the_seed(split):
    a, b, c = split(5), split(5), split(6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_shards_refuse_more_shards_than_samples():
    with pytest.raises(ValueError, match=r"more shards than samples; allowed: "
                                         r"--shards-per-client at most 3"):
        shards_partition(np.arange(10) % 2, 3, 4, seed=0)
    with pytest.raises(ValueError, match="allowed: at most 10 clients"):
        shards_partition(np.arange(10) % 2, 11, 1, seed=0)
    with pytest.raises(ValueError, match="shards per client must be >= 1"):
        shards_partition(BALANCED, 2, 0, seed=0)


@pytest.mark.parametrize("clients, share", [(10, 0.8), (20, 0.5), (100, 0.9), (7, 0.8),
                                            (3, 1.0)])
def test_dominant_share_and_class_per_client(clients, share):
    parts = dominant_partition(BALANCED, clients, share, seed=0)
    flat = _disjoint(parts, len(BALANCED))
    sizes = {len(p) for p in parts}
    assert len(sizes) == 1                              # every client the same size
    n = sizes.pop()
    for i, p in enumerate(parts):
        counts = np.bincount(BALANCED[p], minlength=10)
        assert counts.argmax() == i % 10                 # client i's class: i mod classes
        assert abs(counts[i % 10] / n - share) <= 0.5 / n  # the share, within rounding
        others = np.delete(counts, i % 10)
        assert others.max() - others.min() <= 1          # the rest spread evenly
    if clients % 10 == 0:
        # VHL's setting (balanced classes, a multiple of the classes as clients): all used.
        assert len(flat) == len(BALANCED)


def test_dominant_on_unbalanced_classes_keeps_the_share():
    parts = dominant_partition(UNBALANCED, 6, 0.7, seed=1)
    _disjoint(parts, len(UNBALANCED))
    n = len(parts[0])
    assert n > 0 and all(len(p) == n for p in parts)
    supply = np.bincount(UNBALANCED)
    used = sum(np.bincount(UNBALANCED[p], minlength=3) for p in parts)
    assert (used <= supply).all()
    # The scarcest class sets the size: one more sample per client would not fit.
    assert any(used[c] + 2 > supply[c] for c in range(3))
    for i, p in enumerate(parts):
        assert abs(np.bincount(UNBALANCED[p], minlength=3)[i % 3] / n - 0.7) <= 0.5 / n


def test_dominant_refuses_impossible_settings():
    with pytest.raises(ValueError, match=r"allowed: 0\.1 \(1 / 10 classes\) to 1"):
        dominant_partition(BALANCED, 10, 0.05, seed=0)
    with pytest.raises(ValueError, match="at least 2 classes"):
        dominant_partition(np.zeros(20, dtype=np.int64), 2, 0.8, seed=0)
    with pytest.raises(ValueError, match=r"cannot give each of 2000 clients a sample.*"
                                         r"allowed: fewer clients"):
        dominant_partition(BALANCED, 2000, 0.8, seed=0)
    # A class the labels never hold cannot dominate client 3.
    with pytest.raises(ValueError, match=r"class\(es\) \[3\] hold \[0\]"):
        dominant_partition(np.repeat([0, 1, 2], 10), 4, 0.8, seed=0, num_classes=4)


def test_label_split_dispatch_info_and_errors():
    d = LabelSplit("dirichlet", alpha=0.3)
    assert all(np.array_equal(a, b) for a, b in zip(
        d.split(BALANCED, 4, 0), dirichlet_partition(BALANCED, 4, 0.3, 0), strict=True))
    assert d.info() == {"partition": "dirichlet", "alpha": 0.3}
    assert LabelSplit("shards", shards_per_client=3).info() == {
        "partition": "shards", "shards_per_client": 3}
    assert LabelSplit("dominant", dominant_share=0.6).info() == {
        "partition": "dominant", "dominant_share": 0.6}
    with pytest.raises(ValueError, match="allowed: dirichlet, shards, dominant"):
        LabelSplit("iid")
    # Benchmarks ask DataOptions, whose errors are DataErrors naming what is allowed.
    with pytest.raises(DataError, match="allowed: dirichlet, shards, dominant"):
        DataOptions(partition="iid").label_split(0.5)
    split = DataOptions(partition="dominant", alpha=0.1).label_split(0.5)
    assert (split.kind, split.alpha, split.dominant_share) == ("dominant", 0.1, 0.8)


def test_config_fields_are_checked_and_forwarded():
    cfg = validate(from_dict({"partition": "shards", "shards_per_client": 3,
                              "dominant_share": 0.6}))
    assert (cfg.partition, cfg.shards_per_client, cfg.dominant_share) == ("shards", 3, 0.6)
    with pytest.raises(ConfigError, match="allowed: " + ", ".join(PARTITIONS)):
        validate(from_dict({"partition": "iid"}))
    with pytest.raises(ConfigError, match="dominant_share"):
        validate(from_dict({"dominant_share": 1.5}))
    with pytest.raises(ConfigError, match="shards_per_client"):
        validate(from_dict({"shards_per_client": 0}))


def test_digits_offline_splits_each_style_by_the_partition():
    from fedvl.data.embedded import split_domain
    from fedvl.data.offline import make_digits_offline
    from fedvl.run.assemble import build_federation

    cfg = RunConfig(benchmark="digits-offline", domains=["handwritten", "printed-clean"],
                    partitions=3, partition="shards", shards_per_client=2, train_cap=60,
                    test_cap=30)
    fed = build_federation(cfg)
    assert fed.info["partition"] == "shards" and fed.info["shards_per_client"] == 2
    assert "alpha" not in fed.info and len(fed.clients) == 6
    raw = make_digits_offline(seed=0, train_per_client=60, test_per_client=30,
                              clients=["handwritten", "printed-clean"])
    for d, (_, (_, ytr, _, yte)) in enumerate(raw.items()):
        want = split_domain(ytr, yte, 3, LabelSplit("shards", shards_per_client=2), 0, d)
        got = fed.clients[3 * d: 3 * d + 3]
        assert [c.y_train.tolist() for c in got] == [ytr[tr].tolist() for tr, _ in want]
        # Each style's 60 images are all dealt out.
        assert sum(c.num_train for c in got) == 60
    fed = build_federation(RunConfig(benchmark="digits-offline", domains=["handwritten"],
                                     partitions=2, partition="dominant", dominant_share=0.5,
                                     train_cap=100, test_cap=30))
    assert fed.info["partition"] == "dominant" and fed.info["dominant_share"] == 0.5
    for i, c in enumerate(fed.clients):
        assert int(c.y_train.bincount(minlength=10).argmax()) == i


def test_fixed_domain_benchmarks_refuse_a_partition(tmp_path):
    from fedvl.registry import BENCHMARKS

    with pytest.raises(DataError, match=r"'digits-offline' has one client per style unless "
                                        r"--partitions is 2 or more, so --partition dominant"):
        BENCHMARKS.get("digits-offline")(DataOptions(partition="dominant"))
    with pytest.raises(DataError, match=r"'digits' has one client per domain.*allowed here: "
                                        r"--partition dirichlet"):
        BENCHMARKS.get("digits")(DataOptions(partition="shards", data_dir=str(tmp_path)))
    with pytest.raises(DataError, match=r"'cifar10c' has one client per corruption"):
        BENCHMARKS.get("cifar10c")(DataOptions(partition="shards", partitions=1))


@pytest.mark.parametrize("benchmark", ["digits", "cifar10-dirichlet", "medmnist"])
def test_benchmarks_without_domains_to_split_refuse_partitions(tmp_path, benchmark):
    from fedvl.registry import BENCHMARKS

    with pytest.raises(DataError, match=rf"'{benchmark}' .* so --partitions 4 has no domains "
                                        r"to split; --partitions applies to cifar10c, "
                                        r"digits-offline"):
        BENCHMARKS.get(benchmark)(DataOptions(partitions=4, data_dir=str(tmp_path)))


def _write_cifar(root: Path, n_train: int = 400, n_test: int = 100) -> None:
    rng = np.random.default_rng(0)
    np.savez(root / "cifar10.npz",
             x_train=rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
             y_train=np.arange(n_train) % 10,
             x_test=rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
             y_test=np.arange(n_test) % 10)


def test_cifar10_dirichlet_benchmark_takes_every_partition(tmp_path):
    from fedvl.data.cifar import cifar10_dirichlet

    _write_cifar(tmp_path)
    base = {"data_dir": str(tmp_path), "num_clients": 5, "seed": 4}
    fed = cifar10_dirichlet(DataOptions(**base, partition="shards", shards_per_client=2))
    assert fed.info == {"partition": "shards", "shards_per_client": 2, "num_clients": 5}
    assert [len(c.y_train.unique()) for c in fed.clients] == [2] * 5
    assert sum(c.num_train for c in fed.clients) == 400
    fed = cifar10_dirichlet(DataOptions(**base, partition="dominant", dominant_share=0.6))
    assert fed.info["partition"] == "dominant" and fed.info["dominant_share"] == 0.6
    for i, c in enumerate(fed.clients):
        counts = c.y_train.bincount(minlength=10)
        assert int(counts.argmax()) == i and float(counts[i]) / c.num_train == pytest.approx(
            0.6, abs=0.5 / c.num_train)
        # The client's test set follows its training mix.
        assert int(c.y_test.bincount(minlength=10).argmax()) == i
    fed = cifar10_dirichlet(DataOptions(**base))
    assert fed.info == {"partition": "dirichlet", "alpha": 0.5, "num_clients": 5}
    with pytest.raises(ValueError, match="more shards than samples"):
        cifar10_dirichlet(DataOptions(**base, partition="shards", shards_per_client=100))


def test_medmnist_benchmark_takes_the_partition(tmp_path):
    from fedvl.data.medmnist import medmnist
    write_medmnist(tmp_path, "toymnist", num_classes=3, rgb=False, n_train=150)
    fed = medmnist(DataOptions(data_dir=str(tmp_path), dataset="toymnist", num_clients=3,
                               partition="dominant", dominant_share=0.8))
    assert fed.info["partition"] == "dominant" and "alpha" not in fed.info
    for i, c in enumerate(fed.clients):
        assert int(c.y_train.bincount(minlength=3).argmax()) == i
        assert c.num_train == 50   # balanced classes, clients a multiple of them: all used

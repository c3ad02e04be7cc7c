"""Data: class statistics, partitions, transforms, benchmark loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedvl.data.federated import class_channel_stats
from fedvl.data.partition import dirichlet_partition, matched_test_indices
from fedvl.data.sources import DataError, DataOptions, load_npz
from fedvl.data.transforms import stratified_subset, to_tensor_images


def test_class_stats_hand_checked():
    # Class 0: two 1x1x2 images with values {0, 2} and {4, 6}; class 1: one image {1, 1}.
    x = torch.tensor([[[[0.0, 2.0]]], [[[4.0, 6.0]]], [[[1.0, 1.0]]]])
    y = torch.tensor([0, 0, 1])
    mean, std, counts = class_channel_stats(x, y, 3)
    assert mean[:, 0].tolist() == [3.0, 1.0, 0.0]
    assert std[0, 0].item() == pytest.approx(np.std([0, 2, 4, 6]))
    assert std[1, 0].item() == 0.0
    assert counts.tolist() == [2, 1, 0]


def test_class_stats_multi_channel_matches_numpy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 4, 4, generator=g) * 2 + 1
    y = torch.randint(0, 5, (50,), generator=g)
    mean, std, _ = class_channel_stats(x, y, 5)
    for c in range(5):
        xc = x[y == c].transpose(0, 1).reshape(3, -1).numpy()
        assert np.allclose(mean[c].numpy(), xc.mean(1), atol=1e-5)
        assert np.allclose(std[c].numpy(), xc.std(1), atol=1e-5)


def test_dirichlet_partition_is_a_partition_and_skewed():
    labels = np.repeat(np.arange(10), 100)
    parts = dirichlet_partition(labels, 5, alpha=0.1, seed=0)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(labels) and len(np.unique(allidx)) == len(labels)
    # Small alpha: most clients are dominated by few classes.
    top_share = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]
    assert np.mean(top_share) > 0.3
    again = dirichlet_partition(labels, 5, alpha=0.1, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    iid = dirichlet_partition(labels, 5, alpha=1000.0, seed=0)
    assert max(np.bincount(labels[p], minlength=10).max() / len(p) for p in iid) < 0.2


def test_matched_test_indices_follow_train_mix():
    test_labels = np.repeat(np.arange(4), 50)
    idx = matched_test_indices(test_labels, np.array([30, 10, 0, 0]), 40,
                               np.random.default_rng(0))
    assert np.bincount(test_labels[idx], minlength=4).tolist() == [30, 10, 0, 0]


def test_stratified_subset_exact_and_balanced():
    y = np.repeat(np.arange(3), [60, 30, 10])
    idx = stratified_subset(y, 50, np.random.default_rng(0))
    assert len(idx) == 50 and np.bincount(y[idx]).tolist() == [30, 15, 5]
    assert len(stratified_subset(y, None, np.random.default_rng(0))) == 100


def test_to_tensor_images_gray_resize_normalise():
    x = np.full((2, 16, 16), 255, dtype=np.uint8)
    t = to_tensor_images(x, 28, 3, (0.5,) * 3, (0.5,) * 3)
    assert t.shape == (2, 3, 28, 28) and torch.allclose(t, torch.ones_like(t))
    with pytest.raises(ValueError, match="uint8"):
        to_tensor_images(x.astype(np.float32), 28, 3, (0.5,) * 3, (0.5,) * 3)


def test_load_npz_errors(tmp_path):
    with pytest.raises(DataError, match="missing data file"):
        load_npz(tmp_path / "a.npz", ("x",))
    np.savez(tmp_path / "b.npz", x=np.zeros(3))
    with pytest.raises(DataError, match=r"lacks array\(s\) \['y'\]"):
        load_npz(tmp_path / "b.npz", ("x", "y"))
    (tmp_path / "c.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a readable .npz"):
        load_npz(tmp_path / "c.npz", ("x",))


@pytest.mark.shared_data
def test_digits_benchmark_from_shared_data(shared_data):
    from fedvl.data.digits import digits

    fed = digits(DataOptions(data_dir=str(shared_data), train_cap=100, test_cap=50))
    assert fed.client_names == ["mnist", "usps", "mnistm"]
    assert fed.info["domains_missing"] == ["svhn", "synthdigits"]
    assert fed.image_shape == (3, 28, 28)
    for c in fed.clients:
        assert c.num_train == 100 and len(c.y_test) == 50
        assert c.x_train.min() >= -1.0001 and c.x_train.max() <= 1.0001
    fed2 = digits(DataOptions(data_dir=str(shared_data), domains=["usps"], train_cap=20))
    assert fed2.client_names == ["usps"]


@pytest.mark.shared_data
def test_cifar_dirichlet_from_shared_data(shared_data):
    from fedvl.data.cifar import cifar10_dirichlet

    fed = cifar10_dirichlet(DataOptions(data_dir=str(shared_data), num_clients=4, alpha=0.3,
                                        train_cap=500, test_cap=200))
    # The cap applies per client: every client keeps 500 of its (larger) Dirichlet share.
    assert len(fed.clients) == 4 and [c.num_train for c in fed.clients] == [500] * 4
    assert fed.global_test is not None and len(fed.global_test[1]) == 10000
    for c in fed.clients:
        tr = c.class_counts(10).float()
        te = torch.bincount(c.y_test, minlength=10).float()
        assert torch.allclose(tr / tr.sum(), te / te.sum(), atol=0.05)


def test_models_embed_head_contract():
    from fedvl.models import build_model

    for name, kw in [("convnet", {"width": 8}), ("alexnet", {"width": 8}),
                     ("resnet18", {"width": 4, "norm": "group"})]:
        m = build_model(name, 3, 10, 28, seed=0, **kw)
        x = torch.randn(2, 3, 28, 28)
        z = m.embed(x)
        assert z.shape == (2, m.feature_dim)
        assert torch.allclose(m.head(z), m(x), atol=1e-6)
        again = build_model(name, 3, 10, 28, seed=0, **kw)
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                     again.state_dict().values(), strict=True))
    assert build_model("convnet", 3, 10, 28, width=128).feature_dim == 128 * 3 * 3
    assert build_model("convnet", 3, 10, 32, width=128).feature_dim == 2048
    assert build_model("alexnet", 3, 10, 32).feature_dim == 3072
    with pytest.raises(ValueError, match="does not take option"):
        build_model("convnet", 3, 10, 28, colour="red")
    with pytest.raises(ValueError, match="unknown norm"):
        build_model("convnet", 3, 10, 28, norm="fancy")


def _benchmark_names() -> list[str]:
    from fedvl.registry import BENCHMARKS

    return BENCHMARKS.names()


@pytest.mark.parametrize("name", _benchmark_names())
def test_train_cap_is_per_client_on_every_benchmark(name):
    """`train_cap` = at most that many training images per client, keeping its label mix."""
    from fedvl.registry import BENCHMARKS
    from tests.conftest import SHARED_DATA

    # The file each benchmark reads by default (its presence stands for the whole set).
    needs = {"medmnist": "medmnist/pneumoniamnist.npz", "cifar10-dirichlet": "cifar10.npz",
             "cifar10c": "cifar10.npz"}
    if name == "imagefolder":
        pytest.skip("no image folders in the shared data; tests/test_loaders.py caps its clients")
    needs["npz-domains"] = "cifar10.npz"
    # Fashion-MNIST is read where Debian's package installs it (no --data-dir).
    data_dir = None if name == "fashion-mnist" else str(SHARED_DATA)
    from fedvl.data.fashion_mnist import FILES, SYSTEM_DIR
    if name == "fashion-mnist" and not (SYSTEM_DIR / f"{FILES['test_images']}.gz").is_file():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    if name not in ("digits-offline", "fashion-mnist") and not (
            SHARED_DATA / needs.get(name, "digits/mnist.npz")).is_file():
        pytest.skip(f"benchmark '{name}' needs the shared data directory")
    # Two cheap corruptions: generating all 19 takes minutes and tests nothing more here.
    extra = {"corruptions": ["contrast", "gaussian_noise"]} if name == "cifar10c" else {}
    if name == "npz-domains":   # one domain: the other top-level .npz files name other classes
        extra = {"domains": ["cifar10"]}
    opts = DataOptions(data_dir=data_dir, num_clients=4, alpha=0.5, test_cap=20, **extra)
    full = BENCHMARKS.get(name)(opts) if name != "digits-offline" else None
    cap = 40
    fed = BENCHMARKS.get(name)(DataOptions(**{**opts.__dict__, "train_cap": cap}))
    for i, c in enumerate(fed.clients):
        available = full.clients[i].num_train if full is not None else cap
        assert c.num_train == min(cap, available), (name, c.name)
        if full is not None and available > cap:
            share = full.clients[i].class_counts(fed.num_classes).float() / available
            mix = c.class_counts(fed.num_classes).float() / cap
            assert torch.allclose(share, mix, atol=1.0 / cap + 1e-6), (name, c.name)


def test_dirichlet_partition_tops_up_when_the_minimum_cannot_be_drawn():
    """Two classes, alpha 0.05, ten clients: flwr-datasets gives up; no client is left empty."""
    from fedvl.data.partition import top_up

    y = np.array([0] * 300 + [1] * 700)
    parts = dirichlet_partition(y, 10, 0.05, seed=0, min_partition_size=2)
    allidx = np.concatenate(parts)
    assert len(allidx) == 1000 and len(np.unique(allidx)) == 1000
    assert min(len(p) for p in parts) >= 2
    assert all(np.array_equal(a, b) for a, b in
               zip(parts, dirichlet_partition(y, 10, 0.05, seed=0), strict=True))
    moved = top_up([np.arange(0), np.arange(5, 10), np.arange(10, 40)], 3,
                   np.random.default_rng(0))
    assert [len(p) for p in moved] == [3, 5, 27] and len(np.unique(np.concatenate(moved))) == 35


def test_dirichlet_partition_is_cached_and_a_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    import sys

    from fedvl.data import partition

    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path))
    y = np.random.default_rng(0).integers(0, 10, 3000)
    first = partition.dirichlet_partition(y, 8, 0.3, 5)
    files = list((tmp_path / "partitions").glob("dirichlet-*.npz"))
    assert len(files) == 1
    calls = []
    monkeypatch.setattr(partition, "_flwr_dirichlet",
                        lambda *a: calls.append(a) or sys.exit("must not be called"))
    again = partition.dirichlet_partition(y, 8, 0.3, 5)
    assert not calls and all((a == b).all() for a, b in zip(first, again, strict=True))
    monkeypatch.undo()
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path))
    # Another seed is another file; a truncated or overlapping file is recomputed.
    partition.dirichlet_partition(y, 8, 0.3, 6)
    assert len(list((tmp_path / "partitions").glob("*.npz"))) == 2
    files[0].write_bytes(files[0].read_bytes()[:100])
    assert all((a == b).all() for a, b in
               zip(first, partition.dirichlet_partition(y, 8, 0.3, 5), strict=True))
    np.savez(files[0], **{f"p{i}": first[0] for i in range(8)})   # not disjoint
    assert all((a == b).all() for a, b in
               zip(first, partition.dirichlet_partition(y, 8, 0.3, 5), strict=True))


def test_pixel_images_read_exactly_what_the_whole_conversion_gives():
    from fedvl.data.transforms import PixelImages, to_tensor_images

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(37, 30, 30, 3), dtype=np.uint8)
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    whole = to_tensor_images(raw, 32, 3, mean, std)
    lazy = PixelImages(raw, 32, 3, mean, std)
    assert len(lazy) == 37 and lazy.shape == whole.shape
    assert torch.equal(lazy[5:21], whole[5:21])
    idx = torch.tensor([0, 3, 36])
    assert torch.equal(lazy[idx], whole[idx])
    assert torch.equal(lazy.to("cpu").tensor(), whole)
    # Evaluation slices it in batches and gets what the float tensor gives.
    from fedvl.core.training import evaluate
    from fedvl.models import build_model

    model = build_model("convnet", 3, 10, 32, width=4, depth=1)
    y = torch.from_numpy(rng.integers(0, 10, size=37))
    assert evaluate(model, lazy, y, batch_size=8) == evaluate(model, whole, y, batch_size=8)
    with pytest.raises(ValueError, match="uint8"):
        PixelImages(raw.astype(np.float32), 32, 3, mean, std)

"""The `cifar10c` benchmark on a tiny fake `cifar10.npz`: split, cache, seeds and options."""

from __future__ import annotations

import json
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from fedvl.config import ConfigError, RunConfig, from_dict, validate
from fedvl.data import cifar10c as c10c
from fedvl.data.cifar10c import (
    CORRUPTIONS,
    build_cifar10c,
    cache_dir,
    corrupt_images,
    split_corruption,
)
from fedvl.data.sources import DataError
from fedvl.data.transforms import to_tensor_images

needs_library = pytest.mark.skipif(find_spec("imagecorruptions") is None,
                                   reason="imagecorruptions-imaug is not installed")
# Fast ones (well under a millisecond per 32 x 32 image), in canonical order.
CHEAP = ["gaussian_noise", "brightness", "contrast"]
N = 200


@pytest.fixture
def fake_dir(tmp_path, monkeypatch):
    """A data dir whose `cifar10.npz` has 200 random 32 x 32 test images, 20 per class."""
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (N, 32, 32, 3), dtype=np.uint8)
    y = rng.permutation(np.arange(N) % 10).astype(np.int64)
    np.savez(tmp_path / "cifar10.npz", x_test=x, y_test=y)
    return tmp_path


def _source(d):
    with np.load(d / "cifar10.npz") as z:
        return z["x_test"], z["y_test"]


def _build(d, **kw):
    return build_cifar10c(d, **{"corruptions": CHEAP, **kw})


def _same(a, b) -> bool:
    return a.client_names == b.client_names and all(
        torch.equal(getattr(p, f), getattr(q, f))
        for p, q in zip(a.clients, b.clients, strict=True)
        for f in ("x_train", "y_train", "x_test", "y_test"))


@needs_library
def test_every_corruption_runs_seeded_and_leaves_the_global_rng_alone():
    x = np.random.default_rng(1).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    np.random.seed(123)
    for name in CORRUPTIONS:
        out = corrupt_images(x, name, 3)
        assert out.shape == x.shape and out.dtype == np.uint8, name
        # glass_blur and impulse_noise use their own RNGs: seeded too, so the output repeats.
        assert np.array_equal(out, corrupt_images(x, name, 3)), name
    assert not np.array_equal(corrupt_images(x, "gaussian_noise", 1),
                              corrupt_images(x, "gaussian_noise", 5))
    after = np.random.random()
    np.random.seed(123)
    assert after == np.random.random()


def test_split_is_disjoint_covers_everything_and_test_mix_follows_train_mix():
    y = np.random.default_rng(0).permutation(np.arange(10_000) % 10)
    parts = split_corruption(y, 3, 2.0, seed=0, index=9)
    everything = np.concatenate([np.concatenate(p) for p in parts])
    assert np.array_equal(np.sort(everything), np.arange(10_000))
    assert all(tr.max() < 9000 <= te.min() for tr, te in parts)
    pool = np.bincount(y[9000:], minlength=10)
    train = np.stack([np.bincount(y[tr], minlength=10) for tr, _ in parts])
    test = np.stack([np.bincount(y[te], minlength=10) for _, te in parts])
    # Each class of the test pool is cut with the shares its training images got.
    assert np.all(np.abs(test - pool * train / train.sum(0)) <= 1)
    for tr_mix, te_mix in zip(train / train.sum(1, keepdims=True),
                              test / test.sum(1, keepdims=True), strict=True):
        assert 0.5 * np.abs(tr_mix - te_mix).sum() < 0.05
    # Dirichlet(2) over 3 clients gives visibly different label mixes.
    assert (train / train.sum(1, keepdims=True)).std(0).max() > 0.05


def test_split_keeps_a_test_image_for_every_client_under_a_tiny_alpha():
    y = np.random.default_rng(3).permutation(np.arange(1000) % 10)
    for seed in range(5):
        parts = split_corruption(y, 3, 0.01, seed=seed, index=0)
        assert all(len(tr) >= 2 and len(te) >= 1 for tr, te in parts)
        assert len(np.unique(np.concatenate([np.concatenate(p) for p in parts]))) == 1000


@needs_library
def test_clients_hold_the_corrupted_images_of_their_split(fake_dir):
    fed = _build(fake_dir)
    assert fed.client_names == [f"{c}-{i}" for c in CHEAP for i in range(3)]
    assert fed.image_shape == (3, 32, 32) and fed.num_classes == 10
    assert fed.info["alpha"] == 2.0 and fed.info["severity"] == 3
    x, y = _source(fake_dir)
    for ci, name in enumerate(CHEAP):
        xc = corrupt_images(x, name, 3)
        parts = split_corruption(y, 3, 2.0, 0, CORRUPTIONS.index(name))
        for i, (tr, te) in enumerate(parts):
            c = fed.clients[3 * ci + i]
            assert torch.equal(c.x_train, to_tensor_images(xc[tr], 32, 3, c10c.MEAN, c10c.STD))
            assert torch.equal(c.x_test, to_tensor_images(xc[te], 32, 3, c10c.MEAN, c10c.STD))
            assert c.y_train.tolist() == y[tr].tolist() and c.y_test.tolist() == y[te].tolist()
        assert sum(len(tr) + len(te) for tr, te in parts) == N
    # Pixels stay in [0, 1] (no normalisation, as FedLGD and DESA feed them).
    assert 0 <= fed.clients[0].x_train.min() and fed.clients[0].x_train.max() <= 1


@needs_library
def test_cache_hit_is_identical_and_does_not_regenerate(fake_dir, monkeypatch):
    first = _build(fake_dir)
    files = sorted(cache_dir().glob("*.npz"))
    assert len(files) == len(CHEAP) and not list(cache_dir().glob("*.tmp"))

    def fail(*a, **k):
        raise AssertionError("cache miss: images were regenerated")

    monkeypatch.setattr(c10c, "corrupt_images", fail)
    assert _same(first, _build(fake_dir))


@needs_library
def test_damaged_cache_files_are_rebuilt(fake_dir, monkeypatch):
    first = _build(fake_dir)
    files = {p.name.split("-s")[0]: p for p in cache_dir().glob("*.npz")}
    size = files["brightness"].stat().st_size
    files["brightness"].write_bytes(files["brightness"].read_bytes()[: size // 2])  # truncated
    raw = bytearray(files["contrast"].read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte inside the image data: the zip CRC fails
    files["contrast"].write_bytes(bytes(raw))
    made = []
    real = c10c.corrupt_images
    monkeypatch.setattr(c10c, "corrupt_images",
                        lambda x, name, *a: made.append(name) or real(x, name, *a))
    assert _same(first, _build(fake_dir))
    assert sorted(made) == ["brightness", "contrast"]
    assert files["brightness"].stat().st_size == size
    made.clear()
    _build(fake_dir)
    assert made == []


@needs_library
def test_seeds_change_the_split_not_the_images(fake_dir):
    a, b = _build(fake_dir, seed=0), _build(fake_dir, seed=0)
    assert _same(a, b)
    c = _build(fake_dir, seed=1)
    assert any(not torch.equal(p.y_train, q.y_train)
               for p, q in zip(a.clients, c.clients, strict=True))
    # The same images, dealt differently: one corruption's clients hold the same multiset.
    def pool(fed, name):
        cs = [cl for cl in fed.clients if cl.name.startswith(name)]
        return torch.cat([cl.x_train for cl in cs] + [cl.x_test for cl in cs]).sum(0)
    assert torch.allclose(pool(a, "contrast"), pool(c, "contrast"), atol=1e-3)


@needs_library
def test_caps_image_size_partitions_and_subset_order(fake_dir):
    fed = _build(fake_dir, corruptions=["contrast", "gaussian_noise"], partitions=2,
                 train_cap=10, test_cap=3, image_size=28, alpha=100.0)
    assert fed.client_names == ["gaussian_noise-0", "gaussian_noise-1", "contrast-0",
                                "contrast-1"]
    assert fed.image_shape == (3, 28, 28)
    assert all(c.num_train == 10 and len(c.y_test) == 3 for c in fed.clients)


def test_unknown_corruptions_and_bad_options_are_named(fake_dir):
    with pytest.raises(DataError, match=r"unknown cifar10c corruption\(s\) \['fogg'\]; "
                                        r"allowed: gaussian_noise, shot_noise, .*saturate"):
        build_cifar10c(fake_dir, corruptions=["fog", "fogg"])
    with pytest.raises(ConfigError, match=r"'corruptions' = \['fog', 'nope'\] is invalid; "
                                          r"allowed: gaussian_noise, .*saturate"):
        validate(from_dict({"corruptions": "fog,nope"}))
    assert validate(from_dict({"corruptions": "fog,snow"})).corruptions == ["fog", "snow"]
    for bad in ({"severity": 0}, {"severity": 6}, {"partitions": 0}):
        with pytest.raises(ConfigError):
            validate(from_dict(bad))
    with pytest.raises(DataError, match="severity must be an integer 1..5"):
        build_cifar10c(fake_dir, severity=6)
    with pytest.raises(DataError, match="--data-dir"):
        build_cifar10c(None)


def test_missing_library_says_how_to_install(monkeypatch):
    def missing(name):
        raise c10c.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(c10c.metadata, "version", missing)
    with pytest.raises(DataError, match="pip install imagecorruptions-imaug"):
        c10c.library_version()


@needs_library
def test_run_config_reaches_the_benchmark(fake_dir, tmp_path):
    """`--corruptions/--severity/--partitions` and the benchmark's own alpha default (2)."""
    from fedvl.cli import main
    from fedvl.run.assemble import build_federation

    fed = build_federation(RunConfig(benchmark="cifar10c", data_dir=str(fake_dir),
                                     corruptions=["contrast"], severity=2, partitions=2))
    assert fed.client_names == ["contrast-0", "contrast-1"]
    assert fed.info["alpha"] == 2.0 and fed.info["severity"] == 2
    fed = build_federation(RunConfig(benchmark="cifar10c", data_dir=str(fake_dir),
                                     corruptions=["contrast"], alpha=0.3))
    assert fed.info["alpha"] == 0.3 and len(fed.clients) == 3
    out = tmp_path / "run"
    assert main(["run", "--benchmark", "cifar10c", "--data-dir", str(fake_dir), "--method",
                 "fedavg", "--corruptions", "brightness,contrast", "--severity", "2",
                 "--rounds", "1", "--client-ratio", "0.5", "--width", "4", "--depth", "1",
                 "--out", str(out), "--quiet"]) == 0
    info = json.loads((out / "summary.json").read_text())["dataset_info"]
    assert info["corruptions"] == ["brightness", "contrast"] and info["alpha"] == 2.0

"""The generic loaders `npz-domains` and `imagefolder` on small generated files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedvl.data.domains import imagefolder, npz_domains
from fedvl.data.sources import DataError, DataOptions


def _labels(n: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % k).astype(np.int64)


def _save(path: Path, x_train, y_train, x_test, y_test, **extra) -> None:
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, **extra)


@pytest.fixture
def npz_dir(tmp_path: Path) -> Path:
    """Three 8x8 domains: RGB uint8 NHWC, RGB float NCHW, grey uint8 NHW; 4 classes."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (24, 8, 8, 3), dtype=np.uint8)
    _save(tmp_path / "a.npz", a, _labels(24, 4, 1), a[:8], _labels(8, 4, 2))
    b = rng.random((20, 3, 8, 8)).astype(np.float32)
    _save(tmp_path / "b.npz", b, _labels(20, 4, 3), b[:8], _labels(8, 4, 4))
    c = rng.integers(0, 256, (16, 8, 8), dtype=np.uint8)
    _save(tmp_path / "c.npz", c, _labels(16, 4, 5), c[:8], _labels(8, 4, 6))
    return tmp_path


def _pixels(x: np.ndarray) -> torch.Tensor:
    """uint8 N x H x W x C -> the loaders' normalised N x C x H x W."""
    return (torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5


def test_npz_domains_one_client_per_domain(npz_dir: Path) -> None:
    fed = npz_domains(DataOptions(data_dir=str(npz_dir)))
    assert fed.client_names == ["a", "b", "c"] and fed.num_classes == 4
    assert fed.image_shape == (3, 8, 8)
    with np.load(npz_dir / "a.npz") as z:
        a_x, a_y = z["x_train"], z["y_train"]
    with np.load(npz_dir / "b.npz") as z:
        b_x = z["x_train"]
    with np.load(npz_dir / "c.npz") as z:
        c_x, c_yte = z["x_train"], z["y_test"]
    a, b, c = fed.clients
    assert torch.equal(a.y_train, torch.from_numpy(a_y))
    assert torch.allclose(a.x_train, _pixels(a_x), atol=1e-6)
    # NCHW floats in 0..1 are taken channel-first, rounded to the uint8 grid.
    want_b = _pixels(np.rint(b_x.transpose(0, 2, 3, 1) * 255).astype(np.uint8))
    assert torch.allclose(b.x_train, want_b, atol=1e-6)
    # A grey domain beside colour ones is repeated to RGB.
    assert torch.allclose(c.x_train, _pixels(np.repeat(c_x[..., None], 3, -1)), atol=1e-6)
    assert torch.equal(c.y_test, torch.from_numpy(c_yte))
    assert [cl.num_train for cl in fed.clients] == [24, 20, 16]


def test_npz_domains_options(npz_dir: Path) -> None:
    grey = npz_domains(DataOptions(data_dir=str(npz_dir), domains=["c"], image_size=4))
    assert grey.client_names == ["c"] and grey.image_shape == (1, 4, 4)
    capped = npz_domains(DataOptions(data_dir=str(npz_dir), train_cap=8, test_cap=4))
    assert [c.num_train for c in capped.clients] == [8, 8, 8]
    assert all(len(c.y_test) == 4 for c in capped.clients)
    # Stratified: 8 of 4 balanced classes keeps 2 of each.
    assert capped.clients[0].class_counts(4).tolist() == [2, 2, 2, 2]
    split = npz_domains(DataOptions(data_dir=str(npz_dir), partitions=2,
                                    partition="shards", shards_per_client=2))
    assert split.client_names == ["a-0", "a-1", "b-0", "b-1", "c-0", "c-1"]
    assert split.info["client_groups"] == ["a", "a", "b", "b", "c", "c"]
    assert split.clients[0].num_train + split.clients[1].num_train == 24
    for cl in split.clients:
        assert int((cl.class_counts(4) > 0).sum()) == 2


def _error(tmp_path: Path, match: str, **opts) -> None:
    with pytest.raises(DataError, match=match):
        npz_domains(DataOptions(data_dir=str(tmp_path), **opts))


def test_npz_domains_errors(tmp_path: Path) -> None:
    _error(tmp_path, r"no \.npz file in .*x_train, y_train, x_test, y_test")
    x = np.zeros((10, 8, 8, 3), np.uint8)
    y = _labels(10, 2, 0)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x)
    _error(tmp_path, r"'.*d\.npz' lacks array\(s\) \['y_test'\]; it has \['x_test', 'x_train', "
                     r"'y_train'\]")
    _save(tmp_path / "d.npz", x, y, x, y, class_names=np.array(["u", "v"]))
    _save(tmp_path / "e.npz", x, np.full(10, 5), x, y)
    _error(tmp_path, r"e\.npz' array 'y_train' holds labels 5\.\.5; allowed: 0\.\.1")
    _save(tmp_path / "e.npz", x, y - 1, x, y)
    _error(tmp_path, r"e\.npz' array 'y_train' holds labels -1\.\.0; allowed: 0\.\.1")
    _save(tmp_path / "e.npz", x, y, x, y, class_names=np.array(["u", "w"]))
    _error(tmp_path, r"e\.npz' names classes \['u', 'w'\] but .*d\.npz' names \['u', 'v'\]")
    _save(tmp_path / "e.npz", np.zeros((10, 6, 6, 3), np.uint8), y, x, y)
    _error(tmp_path, r"not all square of one size \('.*d\.npz' 'x_train' 8x8; '.*e\.npz' "
                     r"'x_train' 6x6\); pass --image-size N")
    assert npz_domains(DataOptions(data_dir=str(tmp_path), image_size=6)).image_shape == (3, 6, 6)
    _save(tmp_path / "e.npz", x, y[:9], x, y)
    _error(tmp_path, r"e\.npz' has 10 images in 'x_train' but 9 labels in 'y_train'")
    _save(tmp_path / "e.npz", x.astype(np.int16), y, x, y)
    _error(tmp_path, r"e\.npz' array 'x_train' has dtype int16; allowed: .*uint8 0\.\.255 or "
                     r"float 0\.\.1")
    _save(tmp_path / "e.npz", x.astype(np.float32) + 2, y, x, y)
    _error(tmp_path, r"e\.npz' array 'x_train' holds float values 2\.\.2; allowed")
    _save(tmp_path / "e.npz", np.zeros((10, 5, 5, 5), np.uint8), y, x, y)
    _error(tmp_path, r"e\.npz' array 'x_train' has shape \(10, 5, 5, 5\); allowed: N x H x W")
    _save(tmp_path / "e.npz", x, y.astype(np.float32), x, y)
    _error(tmp_path, r"e\.npz' array 'y_train' must hold integer labels")
    _error(tmp_path, r"unknown domain\(s\) \['z'\] in .*allowed \(\.npz files\): d, e",
           domains=["z"])
    _error(tmp_path, r"one client per domain unless --partitions", domains=["d"],
           partition="shards")


# --------------------------------------------------------------------------------------------
# imagefolder
# --------------------------------------------------------------------------------------------

COLOURS = {"cat": (250, 10, 10), "dog": (10, 10, 250), "emu": (10, 250, 10)}


def _write_images(folder: Path, cls: str, n: int, suffix: str = ".png") -> None:
    folder = folder / cls
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (12, 10), COLOURS[cls]).save(folder / f"{i:03d}{suffix}")


def _domain(root: Path, classes=("dog", "cat"), n_train: int = 4, n_test: int = 2,
            suffix: str = ".png") -> Path:
    for cls in classes:  # created out of order: labels must follow the sorted names
        _write_images(root / "train", cls, n_train, suffix)
        _write_images(root / "test", cls, n_test, suffix)
    return root


def test_imagefolder_domains(tmp_path: Path) -> None:
    _domain(tmp_path / "photos")
    _domain(tmp_path / "scans", suffix=".jpg", n_train=3)
    (tmp_path / "photos" / "train" / "cat" / "notes.txt").write_text("not an image")
    fed = imagefolder(DataOptions(data_dir=str(tmp_path)))
    assert fed.client_names == ["photos", "scans"] and fed.num_classes == 2
    assert fed.info["class_names"] == ["cat", "dog"]
    assert fed.image_shape == (3, 32, 32)
    assert [c.num_train for c in fed.clients] == [8, 6]
    assert [len(c.y_test) for c in fed.clients] == [4, 4]
    for c in fed.clients:
        red = c.x_train[:, 0].mean((1, 2))
        # cat (label 0) is red, dog (label 1) blue: labels follow the sorted class names.
        assert bool((red[c.y_train == 0] > 0.8).all()) and bool((red[c.y_train == 1] < -0.8).all())
    small = imagefolder(DataOptions(data_dir=str(tmp_path), image_size=8, domains=["scans"],
                                    train_cap=2))
    assert small.client_names == ["scans"] and small.image_shape == (3, 8, 8)
    assert small.clients[0].class_counts(2).tolist() == [1, 1]


def test_imagefolder_single_domain(tmp_path: Path) -> None:
    root = _domain(tmp_path / "office", classes=("emu", "cat", "dog"))
    fed = imagefolder(DataOptions(data_dir=str(root), partitions=2, partition="shards",
                                  shards_per_client=1))
    assert fed.client_names == ["office-0", "office-1"] and fed.num_classes == 3
    assert sum(c.num_train for c in fed.clients) == 12


def _folder_error(root: Path, match: str, **opts) -> None:
    with pytest.raises(DataError, match=match):
        imagefolder(DataOptions(data_dir=str(root), **opts))


def test_imagefolder_errors(tmp_path: Path) -> None:
    _folder_error(tmp_path, r"no domain folder in .*DIR/<domain>/\{train,test\}/<class>")
    _domain(tmp_path / "a")
    _domain(tmp_path / "b", classes=("cat", "emu"))
    _folder_error(tmp_path, r"domain 'b' has different classes from domain 'a': missing "
                            r"\['dog'\], extra \['emu'\]")
    _folder_error(tmp_path, r"unknown domain\(s\) \['c'\] .*allowed \(domain folders\): a, b",
                  domains=["c"])
    (tmp_path / "c" / "train" / "cat").mkdir(parents=True)
    _folder_error(tmp_path, r"domain 'c' lacks its test folder '.*c/test'", domains=["a", "c"])
    (tmp_path / "c" / "test").mkdir()
    (tmp_path / "c" / "train" / "dog").mkdir()
    _folder_error(tmp_path, r"class folder '.*c/train/cat' holds no image; allowed files: "
                            r"\*\.png, \*\.jpg, \*\.jpeg", domains=["a", "c"])
    _write_images(tmp_path / "c" / "train", "cat", 2)
    _write_images(tmp_path / "c" / "train", "dog", 2)
    _write_images(tmp_path / "c" / "test", "emu", 2)
    _folder_error(tmp_path, r"domain 'c': test class folder\(s\) \['emu'\] have no train "
                            r"folder; allowed classes: cat, dog", domains=["a", "c"])
    bad = tmp_path / "a" / "train" / "dog" / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    _folder_error(tmp_path, r"image file '.*broken\.png' cannot be read as an image",
                  domains=["a"])

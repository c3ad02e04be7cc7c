"""SynthDigits regeneration: determinism, image statistics, cache, and the `digits` domain."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedvl.data import synthdigits
from fedvl.data.digits import digits
from fedvl.data.sources import DataError, DataOptions
from fedvl.data.synthdigits import cache_path, make_synthdigits


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def small() -> tuple[np.ndarray, ...]:
    return make_synthdigits(seed=1, n_train=60, n_test=20, cache=False)


def test_same_seed_same_bytes_other_seed_differs(small) -> None:
    again = make_synthdigits(seed=1, n_train=60, n_test=20, cache=False)
    for a, b in zip(small, again, strict=True):
        assert a.tobytes() == b.tobytes()
    other = make_synthdigits(seed=2, n_train=60, n_test=20, cache=False)
    assert other[0].tobytes() != small[0].tobytes()
    # The test set has its own stream: its size never changes the training images.
    wider = make_synthdigits(seed=1, n_train=60, n_test=7, cache=False)
    assert wider[0].tobytes() == small[0].tobytes()


def test_shapes_range_and_labels(small) -> None:
    x_tr, y_tr, x_te, y_te = small
    assert x_tr.shape == (60, 32, 32, 3) and x_tr.dtype == np.uint8
    assert x_te.shape == (20, 32, 32, 3) and x_te.dtype == np.uint8
    assert y_tr.dtype == np.int64 and y_te.dtype == np.int64
    assert np.bincount(y_tr, minlength=10).tolist() == [6] * 10
    assert np.bincount(y_te, minlength=10).tolist() == [2] * 10
    assert x_tr.min() <= 10 and x_tr.max() >= 245
    # Text and background contrast in every image, not just across the set.
    spread = x_tr.reshape(60, -1).max(1).astype(int) - x_tr.reshape(60, -1).min(1)
    assert np.median(spread) > 100 and spread.min() > 40
    # Colour backgrounds: the channels differ (not grey images repeated three times).
    assert np.abs(x_tr[..., 0].astype(int) - x_tr[..., 2]).mean() > 20


def test_labelled_digit_sits_in_the_centre() -> None:
    # Centre-digit labelling: with the ink of one image's mask, the middle column band holds
    # ink in every image, the outer bands only where a neighbour digit is drawn.
    from fedvl.data.offline.glyphs import render_masks

    rng = np.random.default_rng(0)
    labels = np.arange(40) % 10
    fill, _ = render_masks(labels, rng, height=(14.0, 24.0), angle=12.0, shift=2.0,
                            neighbour_p=0.0, stroke_p=0.0, size=32)
    assert fill.shape == (40, 32, 32)
    ink = fill > 0.5
    assert ink[:, :, 12:20].any(axis=(1, 2)).all()
    assert not ink[:, :, :3].any() and not ink[:, :, 29:].any()


def test_cache_written_once_and_bad_cache_regenerated(tmp_path: Path) -> None:
    a = make_synthdigits(seed=3, n_train=20, n_test=10)
    path = cache_path(3, 20, 10)
    assert path.is_file() and path.parent == tmp_path / "cache"
    assert not list(path.parent.glob("*.tmp"))
    b = make_synthdigits(seed=3, n_train=20, n_test=10)
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    path.write_bytes(b"not an archive")
    c = make_synthdigits(seed=3, n_train=20, n_test=10)
    assert all(np.array_equal(u, v) for u, v in zip(a, c, strict=True))
    with pytest.raises(ValueError, match="n_train >= 1"):
        make_synthdigits(n_train=0)


def _fake_domain(path: Path, n: int, side: int, channels: int, value: int) -> None:
    rng = np.random.default_rng(side)
    shape = (n, side, side) if channels == 1 else (n, side, side, channels)
    x = np.full(shape, value, dtype=np.uint8)
    y = rng.permutation(np.arange(n) % 10).astype(np.int64)
    np.savez(path, x_train=x, y_train=y, x_test=x[: n // 2], y_test=y[: n // 2])


def test_digits_regenerates_synthdigits_unless_its_file_exists(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(synthdigits, "DEFAULT_TRAIN", 30)
    monkeypatch.setattr(synthdigits, "DEFAULT_TEST", 10)
    root = tmp_path / "data" / "digits"
    root.mkdir(parents=True)
    _fake_domain(root / "mnist.npz", 20, 28, 1, 0)
    opts = DataOptions(data_dir=str(tmp_path / "data"), domains=["mnist", "synthdigits"])
    fed = digits(opts)
    assert fed.client_names == ["mnist", "synthdigits"]
    assert fed.clients[1].num_train == 30 and fed.image_shape == (3, 28, 28)
    assert fed.info["sources"]["synthdigits"].startswith("regenerated (seed 0, 30 train")
    # Unnamed, it is not added: the default federation is the files present.
    assert digits(DataOptions(data_dir=str(tmp_path / "data"))).client_names == ["mnist"]
    # A user's file wins over the regeneration.
    _fake_domain(root / "synthdigits.npz", 40, 32, 3, 255)
    fed = digits(opts)
    assert fed.clients[1].num_train == 40 and bool((fed.clients[1].x_train == 1.0).all())
    assert fed.info["sources"]["synthdigits"] == f"file {root / 'synthdigits.npz'}"


def test_missing_svhn_says_it_is_never_generated(tmp_path: Path) -> None:
    (tmp_path / "digits").mkdir()
    with pytest.raises(DataError, match=r"svhn\.npz' is missing; SVHN is never generated"):
        digits(DataOptions(data_dir=str(tmp_path), domains=["svhn"]))


@pytest.mark.shared_data
def test_four_domain_digits_with_synthdigits(shared_data: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synthdigits, "DEFAULT_TRAIN", 50)
    monkeypatch.setattr(synthdigits, "DEFAULT_TEST", 20)
    fed = digits(DataOptions(data_dir=str(shared_data), train_cap=30, test_cap=10,
                             domains=["mnist", "usps", "synthdigits", "mnistm"]))
    assert fed.client_names == ["mnist", "usps", "synthdigits", "mnistm"]
    assert fed.image_shape == (3, 28, 28)
    for c in fed.clients:
        assert c.num_train == 30 and len(c.y_test) == 10
        assert int(c.y_train.min()) >= 0 and int(c.y_train.max()) <= 9
        assert -1.0001 <= float(c.x_train.min()) and float(c.x_train.max()) <= 1.0001
    assert fed.info["domains_missing"] == ["svhn"]

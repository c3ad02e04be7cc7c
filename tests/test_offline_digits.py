"""Tests for the embedded offline "digits-offline" federation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedvl.data.offline import (
    CLIENT_NAMES,
    HANDWRITTEN_CLIENTS,
    builder,
    cache_path,
    handwritten_base_index,
    make_digits_offline,
    save_preview,
)
from fedvl.data.offline import bases as sk_bases

N_TRAIN, N_TEST = 80, 30


@pytest.fixture(scope="module")
def data() -> dict:
    return make_digits_offline(
        seed=3, train_per_client=N_TRAIN, test_per_client=N_TEST, cache=False
    )


def _saturation(x: np.ndarray) -> float:
    x = x.astype(np.float32)
    hi, lo = x.max(-1), x.min(-1)
    return float(np.where(hi > 0, (hi - lo) / np.maximum(hi, 1.0), 0.0).mean())


def _style_features(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32) / 255.0
    grey = x.mean(-1)
    edges = np.abs(np.diff(grey, axis=1)).mean((1, 2)) + np.abs(np.diff(grey, axis=2)).mean((1, 2))
    border = np.concatenate([grey[:, :3].reshape(len(x), -1), grey[:, -3:].reshape(len(x), -1)], 1)
    hi, lo = x.max(-1), x.min(-1)
    sat = np.where(hi > 0, (hi - lo) / np.maximum(hi, 1e-3), 0.0).mean((1, 2))
    return np.stack(
        [x.mean((1, 2, 3)), x.std((1, 2, 3)), sat, edges, border.mean(1), border.std(1)], 1
    )


def test_shapes_dtypes_order_and_classes(data: dict) -> None:
    assert tuple(data) == CLIENT_NAMES
    for name, (x_tr, y_tr, x_te, y_te) in data.items():
        assert x_tr.shape == (N_TRAIN, 28, 28, 3) and x_tr.dtype == np.uint8, name
        assert x_te.shape == (N_TEST, 28, 28, 3) and x_te.dtype == np.uint8, name
        assert y_tr.shape == (N_TRAIN,) and y_tr.dtype == np.int64, name
        assert y_te.shape == (N_TEST,) and y_te.dtype == np.int64, name
        assert set(np.unique(y_tr)) == set(range(10)), name
        assert set(np.unique(y_te)) <= set(range(10)), name
        # Roughly balanced: no class more than ~3x the uniform share.
        assert np.bincount(y_tr, minlength=10).max() <= 3 * N_TRAIN / 10, name
        # Images are not blank: there is a digit on something.
        assert x_tr.std() > 20, name


def test_same_seed_identical_different_seed_differs(data: dict) -> None:
    again = make_digits_offline(
        seed=3, train_per_client=N_TRAIN, test_per_client=N_TEST, cache=False
    )
    other = make_digits_offline(
        seed=4, train_per_client=N_TRAIN, test_per_client=N_TEST, cache=False
    )
    for name in CLIENT_NAMES:
        for a, b in zip(data[name], again[name]):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(data[name][0], other[name][0]), name
        assert not np.array_equal(data[name][2], other[name][2]), name


def test_client_subset_matches_full_run_and_keeps_canonical_order(data: dict) -> None:
    sub = make_digits_offline(
        seed=3,
        train_per_client=N_TRAIN,
        test_per_client=N_TEST,
        clients=["printed-clean", "handwritten"],
        cache=False,
    )
    assert list(sub) == ["handwritten", "printed-clean"]
    for name in sub:
        for a, b in zip(sub[name], data[name]):
            np.testing.assert_array_equal(a, b)


def test_handwritten_bases_disjoint_and_match_labels(data: dict) -> None:
    target = sk_bases.sklearn_digits()[1]
    index = handwritten_base_index(3, N_TRAIN, N_TEST)
    assert set(index) == set(HANDWRITTEN_CLIENTS)
    seen: set[int] = set()
    for name, (train_idx, test_idx) in index.items():
        train_set, test_set = set(train_idx.tolist()), set(test_idx.tolist())
        assert not train_set & test_set, f"{name}: a base image is in both train and test"
        assert not (train_set | test_set) & seen, f"{name}: base image shared with another client"
        seen |= train_set | test_set
        # The rendered images really come from these bases.
        np.testing.assert_array_equal(data[name][1], target[train_idx])
        np.testing.assert_array_equal(data[name][3], target[test_idx])


def test_default_split_uses_every_sklearn_image_exactly_once() -> None:
    index = handwritten_base_index(0)
    n_images = len(sk_bases.sklearn_digits()[1])
    union: list[int] = []
    for train_idx, test_idx in index.values():
        assert len(train_idx) == 1000 and len(test_idx) == 250
        for idx in (train_idx, test_idx):
            bases = np.unique(idx)
            union += bases.tolist()
            # Re-rendering is spread evenly: no base used more than ceil(n / n_bases) times.
            assert np.bincount(idx).max() <= math.ceil(len(idx) / len(bases))
        # Class-stratified split: every client holds every class.
        assert len(np.unique(sk_bases.sklearn_digits()[1][train_idx])) == 10
    assert sorted(union) == list(range(n_images))


def test_cache_round_trip_and_corruption(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path))
    kwargs = dict(seed=5, train_per_client=20, test_per_client=10)
    path = cache_path(5, 20, 10)
    assert path.parent == tmp_path and path.name == "digits-offline-v1-seed5-20-10.npz"

    first = make_digits_offline(**kwargs)
    assert path.exists()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no stray temp files

    def boom(*args, **kw):
        raise AssertionError("should have been served from the cache")

    with monkeypatch.context() as m:
        m.setattr(builder, "_generate_client", boom)
        cached = make_digits_offline(**kwargs)
    for name in CLIENT_NAMES:
        for a, b in zip(first[name], cached[name]):
            np.testing.assert_array_equal(a, b)

    for corrupt in (b"not an npz file", path.read_bytes()[: path.stat().st_size // 2]):
        path.write_bytes(corrupt)
        regenerated = make_digits_offline(**kwargs)
        for name in CLIENT_NAMES:
            for a, b in zip(first[name], regenerated[name]):
                np.testing.assert_array_equal(a, b)
        with np.load(path) as z:  # rewritten as a valid file
            assert f"{CLIENT_NAMES[0]}__x_train" in z.files


def test_partial_cache_is_extended(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path))
    make_digits_offline(seed=1, train_per_client=20, test_per_client=10, clients=["printed-clean"])
    with np.load(cache_path(1, 20, 10)) as z:
        assert {k.split("__")[0] for k in z.files} == {"printed-clean"}
    full = make_digits_offline(seed=1, train_per_client=20, test_per_client=10)
    assert tuple(full) == CLIENT_NAMES
    with np.load(cache_path(1, 20, 10)) as z:
        assert {k.split("__")[0] for k in z.files} == set(CLIENT_NAMES)


def test_unknown_client_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mnist") as info:
        make_digits_offline(clients=["handwritten", "mnist"], cache=False)
    for name in CLIENT_NAMES:
        assert name in str(info.value)
    with pytest.raises(ValueError):
        make_digits_offline(seed=-1, cache=False)
    with pytest.raises(ValueError):
        make_digits_offline(train_per_client=0, cache=False)


def test_styles_differ(data: dict) -> None:
    sat = {name: _saturation(split[0]) for name, split in data.items()}
    assert sat["handwritten"] < 0.01 and sat["handwritten-thick"] < 0.01
    assert sat["handwritten-color"] > 0.2 and sat["printed-clutter"] > 0.2
    assert sat["printed-clean"] > 0.2

    means = {name: float(split[0].mean()) for name, split in data.items()}
    assert means["handwritten"] < 70  # white strokes on a black frame
    assert means["handwritten-thick"] > means["handwritten"] + 25  # fills the frame
    for name in ("handwritten-color", "printed-clutter", "printed-clean"):
        assert abs(means[name] - means["handwritten"]) > 40, name

    # A linear classifier on six global image statistics tells the clients apart.
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def stack(part: int) -> tuple[np.ndarray, np.ndarray]:
        feats = [_style_features(split[part]) for split in data.values()]
        labels = [np.full(len(f), i) for i, f in enumerate(feats)]
        return np.concatenate(feats), np.concatenate(labels)

    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    clf.fit(*stack(0))
    assert clf.score(*stack(2)) > 0.8


def test_save_preview_writes_grid(data: dict, tmp_path) -> None:
    from PIL import Image

    out = tmp_path / "preview.png"
    save_preview(data, str(out), per_client=4)
    with Image.open(out) as img:
        assert img.format == "PNG"
        width, height = img.size
    assert height > len(CLIENT_NAMES) * 28 and width > 4 * 28


def test_partitions_split_each_style_into_disjoint_dirichlet_clients():
    from fedvl.data.embedded import digits_offline, split_domain
    from fedvl.data.sources import DataOptions

    whole = digits_offline(DataOptions(train_cap=60, test_cap=20, domains=["handwritten",
                                                                           "printed-clean"]))
    fed = digits_offline(DataOptions(train_cap=60, test_cap=20, partitions=3, alpha=1.0,
                                     domains=["handwritten", "printed-clean"]))
    assert fed.client_names == [f"{d}-{i}" for d in ("handwritten", "printed-clean")
                                for i in range(3)]
    assert fed.info["client_groups"] == ["handwritten"] * 3 + ["printed-clean"] * 3
    for d, base in enumerate(whole.clients):
        mine = fed.clients[3 * d: 3 * d + 3]
        # The three clients hold exactly the style's training images, each once.
        assert sum(c.num_train for c in mine) == base.num_train
        got = torch.cat([c.x_train for c in mine])
        assert sorted(map(tuple, got.flatten(1)[:, :8].tolist())) == sorted(
            map(tuple, base.x_train.flatten(1)[:, :8].tolist()))
        assert all(len(c.y_test) > 0 for c in mine)
    y = np.repeat(np.arange(10), 6)
    a = split_domain(y, y[:20], 4, 0.5, seed=1, index=0)
    assert [p.tolist() for p, _ in a] == [p.tolist() for p, _ in split_domain(
        y, y[:20], 4, 0.5, seed=1, index=0)]
    assert sorted(np.concatenate([p for p, _ in a]).tolist()) == list(range(60))


def test_digits_read_without_sklearn_equal_load_digits() -> None:
    """The bundled CSV read directly (no scikit-learn import) gives load_digits' arrays."""
    from sklearn.datasets import load_digits

    assert sk_bases._digits_csv() is not None
    images, target = sk_bases.sklearn_digits()
    bunch = load_digits()
    np.testing.assert_array_equal(images, (bunch.images / 16.0).astype(np.float32))
    np.testing.assert_array_equal(target, bunch.target.astype(np.int64))

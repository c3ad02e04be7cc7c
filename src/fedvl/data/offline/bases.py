"""The handwritten base images: scikit-learn's 1797 digits, split disjointly across clients."""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import numpy as np

from fedvl.data.offline.clients import (
    HANDWRITTEN_CLIENTS,
    STREAM_PICK_TEST,
    STREAM_PICK_TRAIN,
    STREAM_SPLIT,
    check_seed,
    check_sizes,
    client_rng,
)


def _digits_csv() -> Path | None:
    """scikit-learn's bundled `digits.csv.gz`, located without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=1)
def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits as read-only (images in [0, 1], int64 labels)."""
    # Importing scikit-learn costs about 1.5 s of a first run; its digits are one CSV file
    # (64 pixel columns, then the label), which is what `load_digits` reads too.
    path = _digits_csv()
    if path is not None:
        data = np.loadtxt(path, delimiter=",")
        pixels, labels = data[:, :-1].reshape(-1, 8, 8), data[:, -1]
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, labels = bunch.images, bunch.target
    images = (pixels / 16.0).astype(np.float32)
    target = labels.astype(np.int64)
    images.setflags(write=False)
    target.setflags(write=False)
    return images, target


def _base_split(seed: int, test_fraction: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Disjoint (train, test) base indices of each handwritten client, stratified by class."""
    _, target = sklearn_digits()
    # One RNG shared by all handwritten clients: the split must be decided jointly.
    rng = np.random.default_rng([seed, 0, STREAM_SPLIT])
    n_clients = len(HANDWRITTEN_CLIENTS)
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {
        name: ([], []) for name in HANDWRITTEN_CLIENTS
    }
    for c in range(10):
        chunks = np.array_split(rng.permutation(np.flatnonzero(target == c)), n_clients)
        for k, name in enumerate(HANDWRITTEN_CLIENTS):
            # Rotate which client receives the larger leftover chunks so totals stay even.
            chunk = chunks[(k + c) % n_clients]
            n_test = 0
            if test_fraction > 0:
                n_test = min(max(1, round(len(chunk) * test_fraction)), len(chunk) - 1)
            parts[name][1].append(chunk[:n_test])
            parts[name][0].append(chunk[n_test:])
    return {
        name: (np.sort(np.concatenate(tr)), np.sort(np.concatenate(te)))
        for name, (tr, te) in parts.items()
    }


def _expand(bases: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Per-sample base indices: every base used ceil(n / len(bases)) times at most."""
    if n == 0 or len(bases) == 0:
        return np.zeros(0, dtype=np.int64)
    reps = math.ceil(n / len(bases))
    return np.concatenate([rng.permutation(bases) for _ in range(reps)])[:n].astype(np.int64)


def handwritten_base_index(
    seed: int = 0, train_per_client: int = 1000, test_per_client: int = 250
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-sample sklearn-digits indices behind each handwritten client's (train, test) images."""
    seed = check_seed(seed)
    n_train, n_test = check_sizes(train_per_client, test_per_client)
    split = _base_split(seed, n_test / (n_train + n_test))
    out = {}
    for name, (train_bases, test_bases) in split.items():
        out[name] = (
            _expand(train_bases, n_train, client_rng(seed, name, STREAM_PICK_TRAIN)),
            _expand(test_bases, n_test, client_rng(seed, name, STREAM_PICK_TEST)),
        )
    return out

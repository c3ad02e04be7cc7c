"""The cached builder: renders the requested clients, or reads them from the disk cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedvl.data.cache import cache_root, save_npz_atomic
from fedvl.data.offline import handwritten, printed
from fedvl.data.offline.bases import handwritten_base_index, sklearn_digits
from fedvl.data.offline.clients import (
    CLIENT_NAMES,
    STREAM_RENDER_TEST,
    STREAM_RENDER_TRAIN,
    check_seed,
    check_sizes,
    client_rng,
)
from fedvl.data.offline.imageops import SIZE

# Bump whenever the generated pixels change, so stale caches are never reused.
_CACHE_VERSION = "v1"
_FIELDS = ("x_train", "y_train", "x_test", "y_test")

Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _generate_client(
    name: str, seed: int, n_train: int, n_test: int, base_index: Mapping | None
) -> Split:
    """One client's (x_train, y_train, x_test, y_test), rendered from its own random streams."""
    out: list[np.ndarray] = []
    for stream, n, part in ((STREAM_RENDER_TRAIN, n_train, 0), (STREAM_RENDER_TEST, n_test, 1)):
        rng = client_rng(seed, name, stream)
        if name in handwritten.RENDERERS:
            assert base_index is not None
            base = base_index[name][part]
            y = sklearn_digits()[1][base].astype(np.int64)
            x = (handwritten.RENDERERS[name](base, rng) if n
                 else np.zeros((0, SIZE, SIZE, 3), np.uint8))
        else:
            y = printed.balanced_labels(n, rng)
            x = printed.RENDERERS[name](y, rng) if n else np.zeros((0, SIZE, SIZE, 3), np.uint8)
        out += [np.ascontiguousarray(x, dtype=np.uint8), np.ascontiguousarray(y, dtype=np.int64)]
    return out[0], out[1], out[2], out[3]


def cache_path(seed: int = 0, train_per_client: int = 1000, test_per_client: int = 250) -> Path:
    """Cache file for one configuration; its directory is $FEDVL_CACHE_DIR or ~/.cache/fedvl."""
    name = f"digits-offline-{_CACHE_VERSION}-seed{seed}-{train_per_client}-{test_per_client}.npz"
    return cache_root() / name


def valid_split(split: Split, n_train: int, n_test: int) -> bool:
    """Whether a cached client has the shapes, dtypes and label range asked for."""
    x_tr, y_tr, x_te, y_te = split
    for x, y, n in ((x_tr, y_tr, n_train), (x_te, y_te, n_test)):
        if x.shape != (n, SIZE, SIZE, 3) or x.dtype != np.uint8:
            return False
        if y.shape != (n,) or y.dtype != np.int64 or (n and (y.min() < 0 or y.max() > 9)):
            return False
    return True


def _load_cache(path: Path, n_train: int, n_test: int) -> dict[str, Split] | None:
    """Valid clients stored in the cache; None when the file exists but is unreadable."""
    if not path.exists():
        return {}
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = set(z.files)
            found = {}
            for name in CLIENT_NAMES:
                if all(f"{name}__{f}" in keys for f in _FIELDS):
                    # np.array copies, forcing the full read (and CRC check) right here.
                    split = tuple(np.array(z[f"{name}__{f}"]) for f in _FIELDS)
                    if not valid_split(split, n_train, n_test):
                        return None
                    found[name] = split
            return found
    except Exception:  # noqa: BLE001 - any unreadable cache is simply regenerated
        return None


def _write_cache(path: Path, data: Mapping[str, Split]) -> None:
    """Store the clients in one .npz, as `<client>__<field>` arrays."""
    arrays = {f"{name}__{f}": arr for name, split in data.items() for f, arr in zip(_FIELDS, split)}
    save_npz_atomic(path, arrays, "digits-offline")


def _resolve_clients(clients: Sequence[str] | str | None) -> list[str]:
    """The asked-for client names in CLIENT_NAMES order (all when None); unknown names raise."""
    if clients is None:
        return list(CLIENT_NAMES)
    if isinstance(clients, str):
        clients = (clients,)
    for name in clients:
        if name not in CLIENT_NAMES:
            raise ValueError(
                f"unknown digits-offline client {name!r}; allowed names: {', '.join(CLIENT_NAMES)}"
            )
    wanted = set(clients)
    return [name for name in CLIENT_NAMES if name in wanted]


def make_digits_offline(
    seed: int = 0,
    train_per_client: int = 1000,
    test_per_client: int = 250,
    clients: Sequence[str] | None = None,
    cache: bool = True,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Build the five-style digits federation: {client: (x_train, y_train, x_test, y_test)}.

    Images are uint8 (N, 28, 28, 3), labels int64 (N,), keys in CLIENT_NAMES order. The three
    handwritten clients use disjoint sklearn base images, and within each client no base image
    is shared by train and test; train bases are re-rendered with fresh jitter to reach
    ``train_per_client`` (likewise for test), see :func:`handwritten_base_index`.
    """
    seed = check_seed(seed)
    n_train, n_test = check_sizes(train_per_client, test_per_client)
    names = _resolve_clients(clients)

    path = cache_path(seed, n_train, n_test)
    stored: dict[str, Split] = {}
    rewrite = False
    if cache:
        loaded = _load_cache(path, n_train, n_test)
        # An unreadable file is dropped entirely and rebuilt below.
        stored = loaded if loaded is not None else {}
        rewrite = loaded is None
    missing = [name for name in names if name not in stored]
    if missing:
        base_index = None
        if any(name in handwritten.RENDERERS for name in missing):
            base_index = handwritten_base_index(seed, n_train, n_test)
        for name in missing:
            stored[name] = _generate_client(name, seed, n_train, n_test, base_index)
        if cache:
            rewrite = True
    if cache and rewrite:
        _write_cache(path, {name: stored[name] for name in CLIENT_NAMES if name in stored})
    return {name: stored[name] for name in names}

"""Label-skew partitions via flwr-datasets, on a light {label} table indexing our own arrays.

A partition is cached on disk by its labels and settings: a later run with the same split
skips flwr-datasets (and its seconds of imports) altogether.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np

from fedvl.data.cache import cache_root, save_npz_atomic

# Bump when the partition of the same inputs changes (a new flwr-datasets rule, a new top-up).
PARTITION_CACHE_VERSION = 1


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    min_partition_size: int = 2,
) -> list[np.ndarray]:
    """Split sample indices over clients with a per-class Dirichlet(alpha) prior.

    flwr-datasets' `DirichletPartitioner` redraws until every client has `min_partition_size`
    samples and gives up after ten draws, which happens with few classes and a small alpha
    (two classes, alpha 0.05, ten clients). Then its one-pass partition (no minimum, as FedVCK's
    reference splits) is topped up: each client below the minimum gets samples moved from the
    currently largest client (drawn from `seed`), so no client is left empty.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if num_clients == 1:
        return [np.arange(len(labels))]
    minimum = min(min_partition_size, len(labels) // num_clients)
    key = hashlib.sha256(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    key.update(repr((num_clients, float(alpha), int(seed), minimum,
                     PARTITION_CACHE_VERSION)).encode())
    path = cache_root() / "partitions" / f"dirichlet-{key.hexdigest()[:24]}.npz"
    cached = _load_parts(path, num_clients, len(labels))
    if cached is not None:
        return cached
    try:
        parts = _flwr_dirichlet(labels, num_clients, alpha, seed, minimum)
    except ValueError as e:
        if "max number of attempts" not in str(e):
            raise
        parts = top_up(_flwr_dirichlet(labels, num_clients, alpha, seed, 0), minimum,
                       np.random.default_rng([seed, 17]))
    save_npz_atomic(path, {f"p{i}": p for i, p in enumerate(parts)}, "partition")
    return parts


def _load_parts(path: Path, num_clients: int, n: int) -> list[np.ndarray] | None:
    """The cached partition at `path`, or None when absent or not a valid one (then rebuilt)."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as f:
            parts = [np.asarray(f[f"p{i}"], dtype=np.int64) for i in range(num_clients)]
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    # A partition is disjoint and within range; anything else is a damaged file.
    if len(flat) and (flat.min() < 0 or flat.max() >= n or len(np.unique(flat)) != len(flat)):
        return None
    return parts


def _flwr_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
                    minimum: int) -> list[np.ndarray]:
    import warnings

    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    table = Dataset.from_dict({"label": labels.astype(np.int64), "idx": np.arange(len(labels))})
    part = DirichletPartitioner(
        num_partitions=num_clients,
        partition_by="label",
        alpha=alpha,
        min_partition_size=minimum,
        self_balancing=False,
        shuffle=True,
        seed=seed,
    )
    part.dataset = table
    with warnings.catch_warnings():
        # Each redraw warns; the outcome (success, or the fallback) is what matters.
        warnings.filterwarnings("ignore", message=".*min_partition_size.*")
        # Column access in numpy format: iterating the rows costs seconds at 50,000 labels.
        return [np.sort(np.asarray(part.load_partition(i).with_format("numpy")["idx"],
                                   dtype=np.int64))
                for i in range(num_clients)]


def top_up(parts: list[np.ndarray], minimum: int, rng: np.random.Generator
           ) -> list[np.ndarray]:
    """Move samples from the largest part to every part smaller than `minimum`."""
    parts = [p.copy() for p in parts]
    for i in range(len(parts)):
        while len(parts[i]) < minimum:
            donor = max(range(len(parts)), key=lambda j: len(parts[j]))
            if len(parts[donor]) <= minimum:
                break
            k = int(rng.integers(len(parts[donor])))
            parts[i] = np.sort(np.append(parts[i], parts[donor][k]))
            parts[donor] = np.delete(parts[donor], k)
    return parts


def apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """`total` split into integers proportional to `weights` (largest remainders; equal shares
    when every weight is 0)."""
    w = weights.astype(float) if weights.sum() > 0 else np.ones(len(weights))
    quota = w / w.sum() * total
    out = np.floor(quota).astype(int)
    order = np.argsort(-(quota - out), kind="stable")
    out[order[: total - out.sum()]] += 1
    return out


def matched_test_indices(
    test_labels: np.ndarray,
    train_counts: np.ndarray,
    size: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Draw `size` test indices whose class proportions follow a client's training counts."""
    want = apportion(size, train_counts)
    picked = []
    for c, k in enumerate(want):
        if k == 0:
            continue
        pool = np.flatnonzero(test_labels == c)
        picked.append(rng.choice(pool, size=min(k, len(pool)), replace=False))
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)

"""Label-skew partitions via flwr-datasets, on a light {label} table indexing our own arrays."""

from __future__ import annotations

import numpy as np


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    min_partition_size: int = 2,
) -> list[np.ndarray]:
    """Split sample indices over clients with a per-class Dirichlet(alpha) prior."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if num_clients == 1:
        return [np.arange(len(labels))]
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    table = Dataset.from_dict({"label": labels.astype(np.int64), "idx": np.arange(len(labels))})
    part = DirichletPartitioner(
        num_partitions=num_clients,
        partition_by="label",
        alpha=alpha,
        min_partition_size=min(min_partition_size, len(labels) // num_clients),
        self_balancing=False,
        shuffle=True,
        seed=seed,
    )
    part.dataset = table
    return [np.sort(np.asarray(part.load_partition(i)["idx"], dtype=np.int64))
            for i in range(num_clients)]


def matched_test_indices(
    test_labels: np.ndarray,
    train_counts: np.ndarray,
    size: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Draw `size` test indices whose class proportions follow a client's training counts."""
    props = train_counts / max(train_counts.sum(), 1)
    want = np.floor(props * size).astype(int)
    order = np.argsort(-(props * size - want), kind="stable")
    want[order[: size - want.sum()]] += 1
    picked = []
    for c, k in enumerate(want):
        if k == 0:
            continue
        pool = np.flatnonzero(test_labels == c)
        picked.append(rng.choice(pool, size=min(k, len(pool)), replace=False))
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)

"""Label-skew partitions of a benchmark's training labels over its clients (`--partition`).

* `dirichlet`: per-class Dirichlet(alpha) shares, via flwr-datasets on a light {label} table
  indexing our own arrays. It is cached on disk by its labels and settings: a later run with
  the same split skips flwr-datasets (and its seconds of imports) altogether.
* `shards`: McMahan et al. 2017's pathological split, k classes per client.
* `dominant`: one dominant class per client holding a fixed share of its samples (VHL's
  `long-tail` split, read per client).

Every split is a list of disjoint, sorted index arrays, one per client, drawn from the seed.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedvl.data.cache import cache_root, save_npz_atomic
from fedvl.defaults import (
    DEFAULT_DOMINANT_SHARE,
    DEFAULT_PARTITION,
    DEFAULT_SHARDS_PER_CLIENT,
    PARTITIONS,
)

# Bump when the partition of the same inputs changes (a new flwr-datasets rule, a new top-up).
PARTITION_CACHE_VERSION = 1

# Stream ids of the draws of the shard and dominant splits (with the split's seed).
_SHARDS_STREAM = 31
_DOMINANT_STREAM = 37


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


def shards_partition(labels: np.ndarray, num_clients: int, shards_per_client: int,
                     seed: int) -> list[np.ndarray]:
    """McMahan et al. 2017's split: sort by label, cut num_clients * k shards, k per client.

    The samples are ordered by label (randomly within a class), cut into num_clients * k
    contiguous shards of equal size (+-1: every sample is assigned once) and the shards dealt
    out at random. A client dealt two shards of the same class swaps one with another client
    where a swap gives both distinct classes, so each client holds k classes whenever the
    labels allow it (McMahan et al. leave such repeats to chance). A shard that straddles a
    class boundary brings both classes, as in the original.
    """
    n, k = len(labels), shards_per_client
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if k < 1:
        raise ValueError(f"shards per client must be >= 1, got {k}")
    total = num_clients * k
    if total > n:
        fit = (f"--shards-per-client at most {n // num_clients}" if n >= num_clients
               else f"at most {n} clients")
        raise ValueError(f"the shards partition cuts {num_clients} clients x {k} shards = "
                         f"{total} shards from {n} samples, more shards than samples; "
                         f"allowed: {fit}")
    rng = np.random.default_rng([int(seed), _SHARDS_STREAM])
    order = rng.permutation(n)
    order = order[np.argsort(labels[order], kind="stable")]
    shards = np.array_split(order, total)
    main = np.array([np.bincount(labels[s]).argmax() for s in shards])
    deal = rng.permutation(total).reshape(num_clients, k)
    _distinct_classes(deal, main)
    return [np.sort(np.concatenate([shards[j] for j in row])).astype(np.int64)
            for row in deal]


def _distinct_classes(deal: np.ndarray, main: np.ndarray) -> None:
    """Swap shards between clients (rows of `deal`, in place) until no client holds two
    shards of one class (`main[shard]`), where such swaps exist.

    Each swap removes a repeat from one client without adding one to the other, so the total
    count of repeats falls and the loop ends; the scan order is fixed, so the result depends
    only on the dealt shards.
    """
    def repeats_at(i: int) -> list[int]:
        seen: set[int] = set()
        out = []
        for a, s in enumerate(deal[i]):
            if int(main[s]) in seen:
                out.append(a)
            seen.add(int(main[s]))
        return out

    clients = len(deal)
    for i in range(clients):
        for a in repeats_at(i):
            mine = {int(main[s]) for b, s in enumerate(deal[i]) if b != a}
            for j in range(clients):
                if j == i:
                    continue
                done = False
                for b, s in enumerate(deal[j]):
                    theirs = {int(main[t]) for c, t in enumerate(deal[j]) if c != b}
                    if int(main[s]) not in mine and int(main[deal[i, a]]) not in theirs:
                        deal[i, a], deal[j, b] = s, deal[i, a]
                        done = True
                        break
                if done:
                    break


def dominant_counts(num_clients: int, num_classes: int, share: float, size: int
                    ) -> np.ndarray:
    """Samples per (client, class) of the dominant split with `size` samples per client.

    Client i's dominant class is i mod num_classes and gets round(share * size) samples; the
    rest is spread evenly over the other classes, the remainder going to the classes after
    the dominant one (so no class is favoured across clients).
    """
    out = np.zeros((num_clients, num_classes), dtype=np.int64)
    top = int(round(share * size))
    for i in range(num_clients):
        d = i % num_classes
        others = [(d + j) % num_classes for j in range(1, num_classes)]
        out[i, d] = top
        out[i, others] = apportion(size - top, np.ones(len(others)))
    return out


def dominant_partition(labels: np.ndarray, num_clients: int, share: float, seed: int,
                       num_classes: int | None = None) -> list[np.ndarray]:
    """One dominant class per client: class i mod K makes up `share` of client i's samples.

    The rest of each client's samples are spread evenly over the other K - 1 classes. This is
    VHL's `long-tail` split (Tang et al. 2022, Tab. 3) read per client: every client gets the
    same number of samples, the largest the class counts allow, so with balanced classes and
    a multiple of K clients every sample is used (as in VHL's 10- and 100-client CIFAR-10
    runs); with unbalanced classes the samples a class cannot place are left out.
    """
    k = int(num_classes if num_classes is not None else (labels.max() + 1 if len(labels) else 0))
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if k < 2:
        raise ValueError(f"the dominant partition needs at least 2 classes, got {k}")
    if not 1.0 / k <= share <= 1.0:
        raise ValueError(f"dominant share {share!r} is outside the range where the class "
                         f"dominates; allowed: {1.0 / k:.4g} (1 / {k} classes) to 1")
    supply = np.bincount(labels, minlength=k)[:k]

    def fits(size: int) -> bool:
        return bool((dominant_counts(num_clients, k, share, size).sum(0) <= supply).all())

    # Every column sum grows with the size, so the largest size that fits is found by bisection.
    lo, hi = 0, len(labels) // num_clients
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        need = dominant_counts(num_clients, k, share, 1).sum(0)
        short = [c for c in range(k) if need[c] > supply[c]]
        raise ValueError(f"the dominant partition cannot give each of {num_clients} clients a "
                         f"sample: class(es) {short} hold {[int(supply[c]) for c in short]} "
                         f"training samples, fewer than the {[int(need[c]) for c in short]} "
                         f"that one sample per client takes; allowed: fewer clients")
    want = dominant_counts(num_clients, k, share, lo)
    rng = np.random.default_rng([int(seed), _DOMINANT_STREAM])
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(k):
        pool = rng.permutation(np.flatnonzero(labels == c))
        cuts = np.cumsum(want[:, c])
        for i in range(num_clients):
            parts[i].append(pool[cuts[i] - want[i, c]: cuts[i]])
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


@dataclass(frozen=True)
class LabelSplit:
    """How a label-skew benchmark splits its training labels over clients (`--partition`)."""

    kind: str = DEFAULT_PARTITION
    alpha: float = 0.5                                  # dirichlet
    shards_per_client: int = DEFAULT_SHARDS_PER_CLIENT  # shards
    dominant_share: float = DEFAULT_DOMINANT_SHARE      # dominant

    def __post_init__(self) -> None:
        if self.kind not in PARTITIONS:
            raise ValueError(f"partition {self.kind!r} is unknown; allowed: "
                             f"{', '.join(PARTITIONS)}")
        if self.kind == "dirichlet" and not self.alpha > 0:
            raise ValueError(f"Dirichlet alpha must be > 0, got {self.alpha!r}")
        if self.kind == "shards" and self.shards_per_client < 1:
            raise ValueError(f"shards per client must be >= 1, got {self.shards_per_client!r}")
        if self.kind == "dominant" and not 0 < self.dominant_share <= 1:
            raise ValueError(f"dominant share must be in (0, 1], got {self.dominant_share!r}")

    def split(self, labels: np.ndarray, num_clients: int, seed: int,
              num_classes: int | None = None) -> list[np.ndarray]:
        """Sample indices of each of `num_clients` clients (disjoint, sorted)."""
        if num_clients > len(labels):
            # Checked before any per-client array exists: a count of 2^63 is refused, not
            # allocated (the partitioners build arrays of one entry per client).
            raise ValueError(f"{num_clients} clients cannot split {len(labels)} training "
                             f"images; allowed: 1..{len(labels)} clients")
        if self.kind == "shards":
            return shards_partition(labels, num_clients, self.shards_per_client, seed)
        if self.kind == "dominant":
            return dominant_partition(labels, num_clients, self.dominant_share, seed,
                                      num_classes)
        return dirichlet_partition(labels, num_clients, self.alpha, seed)

    def info(self) -> dict[str, object]:
        """The split as `FederatedDataset.info` entries (its kind and its one setting)."""
        setting: dict[str, object] = {
            "dirichlet": {"alpha": self.alpha},
            "shards": {"shards_per_client": self.shards_per_client},
            "dominant": {"dominant_share": self.dominant_share},
        }[self.kind]
        return {"partition": self.kind, **setting}


def as_split(alpha_or_split: float | LabelSplit) -> LabelSplit:
    """A LabelSplit: given, or Dirichlet with the given concentration."""
    if isinstance(alpha_or_split, LabelSplit):
        return alpha_or_split
    return LabelSplit("dirichlet", alpha=float(alpha_or_split))


def _load_parts(path: Path, num_clients: int, n: int) -> list[np.ndarray] | None:
    """The cached partition at `path`, or None when absent or not a valid one (then rebuilt)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
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

    # Arrow format: the partitioner's label column and each partition's indices come back as
    # Arrow arrays; the default and numpy formats convert them row by row (seconds at 60,000).
    table = Dataset.from_dict({"label": labels.astype(np.int64),
                               "idx": np.arange(len(labels))}).with_format("arrow")
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
        return [np.sort(np.asarray(part.load_partition(i)["idx"].to_numpy(), dtype=np.int64))
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

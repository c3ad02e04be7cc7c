"""The embedded `digits-offline` benchmark: generated from package-shipped data, no network."""

from __future__ import annotations

import numpy as np
import torch

from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.partition import LabelSplit, as_split, matched_test_indices
from fedvl.data.sources import DataError, DataOptions
from fedvl.data.spec import BenchmarkSpec, declare_benchmark
from fedvl.data.transforms import to_tensor_images
from fedvl.seeding import derive_seed

MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
# `--partitions P` splits each style by `--partition` (Dirichlet(--alpha), this concentration
# when unset).
DEFAULT_ALPHA = 0.5
# The most images digits-offline renders per client and split (its "data size"). A handwritten
# client has about 600 distinct base digits; beyond that more images only re-render them with
# new jitter, so a larger cap adds time and memory, not data.
MAX_PER_CLIENT = 5000
_SPLIT_STREAM = 23
_TEST_STREAM = 29


def split_domain(ytr: np.ndarray, yte: np.ndarray, partitions: int,
                 alpha: float | LabelSplit, seed: int, index: int, num_classes: int = 10
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) indices of the `partitions` clients of domain number `index`.

    Training images are split by `alpha`: a LabelSplit, or the concentration of a per-class
    Dirichlet draw; each client gets a test set of len(yte) / partitions images whose classes
    follow its training mix (drawn from the domain's test images, as cifar10-dirichlet's
    clients).
    """
    if partitions == 1:
        return [(np.arange(len(ytr)), np.arange(len(yte)))]
    parts = as_split(alpha).split(ytr, partitions, derive_seed(seed, _SPLIT_STREAM, index),
                                  num_classes)
    size = max(1, len(yte) // partitions)
    return [(p, matched_test_indices(yte, np.bincount(ytr[p], minlength=num_classes), size,
                                     np.random.default_rng(derive_seed(seed, _TEST_STREAM,
                                                                       index, i))))
            for i, p in enumerate(parts)]


def _styles(opts: DataOptions) -> list[str]:
    """The styles `--domains` chooses, in the benchmark's order (all of them when unset)."""
    from fedvl.data.offline import CLIENT_NAMES

    # An empty domain list (`--domains ""`) means no subset, as for `digits`, not no clients.
    if not opts.domains:
        return list(CLIENT_NAMES)
    bad = [d for d in opts.domains if d not in CLIENT_NAMES]
    if bad:
        raise DataError(f"unknown digits-offline domain(s) {bad}; allowed: "
                        + ", ".join(CLIENT_NAMES))
    return [n for n in CLIENT_NAMES if n in opts.domains]


def _sizes(opts: DataOptions) -> tuple[int, int]:
    """Images per style (train, test): the caps, clipped to the benchmark's size."""
    # 600 per client keeps the default `fedvl run` well inside 3 minutes on 2 CPU cores.
    # Caps are clipped to the benchmark's size before anything is rendered: a cap names at most
    # how many images a client keeps, not how many to allocate.
    return min(opts.train_cap or 600, MAX_PER_CLIENT), min(opts.test_cap or 250, MAX_PER_CLIENT)


def client_names(opts: DataOptions) -> list[str]:
    """The clients' names: one per style, or `<style>-<i>` for `--partitions` 2 or more."""
    parts = opts.partitions_or(1)
    styles = _styles(opts)
    train, _ = _sizes(opts)
    if parts > train:
        # The split refuses this too; checked first so that 2^63 names are never listed.
        raise DataError(f"{parts} clients cannot split {train} training images; allowed: "
                        f"1..{train} clients")
    return styles if parts == 1 else [f"{s}-{i}" for s in styles for i in range(parts)]


@declare_benchmark("digits-offline", BenchmarkSpec(
    needs_data_dir=False, partitions=1, label_split="split-domains", client_names=client_names,
    reads=frozenset({"domains"})))
def digits_offline(opts: DataOptions) -> FederatedDataset:
    """Five digit styles (handwritten, textured, cluttered print, clean print, thick) offline.

    One client per style, or `--partitions P` clients per style split by `--partition`
    (default Dirichlet(`--alpha`)); with one client per style there is nothing to split.
    With `only_client` set, only that client's style is rendered and only that client built.
    """
    from fedvl.data.offline import make_digits_offline

    train, test = _sizes(opts)
    styles = _styles(opts)
    parts, split = opts.partitions_or(1), opts.label_split(DEFAULT_ALPHA)
    if parts == 1:
        opts.refuse_partition("digits-offline", "has one client per style unless --partitions "
                              "is 2 or more")
    wanted = styles
    if opts.only_client is not None:
        if not 0 <= opts.only_client < len(styles) * parts:
            raise DataError(f"digits-offline client {opts.only_client} out of range "
                            f"0..{len(styles) * parts - 1}")
        wanted = [styles[opts.only_client // parts]]
    raw = make_digits_offline(seed=opts.seed, train_per_client=train, test_per_client=test,
                              clients=wanted)
    size = opts.image_size or 28
    clients = []
    for d, name in enumerate(styles):
        if name not in raw:
            continue
        xtr, ytr, xte, yte = raw[name]
        # The split of a style depends on its position `d` among the chosen styles, so a
        # client built alone is the same client as in the whole federation.
        for i, (tr, te) in enumerate(split_domain(ytr, yte, parts, split, opts.seed, d)):
            if opts.only_client is not None and opts.only_client != d * parts + i:
                continue
            clients.append(ClientData(
                name=name if parts == 1 else f"{name}-{i}",
                x_train=to_tensor_images(xtr[tr], size, 3, MEAN, STD),
                y_train=torch.from_numpy(ytr[tr]).long(),
                x_test=to_tensor_images(xte[te], size, 3, MEAN, STD),
                y_test=torch.from_numpy(yte[te]).long(),
            ))
    info: dict[str, object] = {"domains": styles}
    for name, cap, kept in (("train_cap", opts.train_cap, train),
                            ("test_cap", opts.test_cap, test)):
        if cap is not None and cap > kept:
            info[f"{name}_clipped_to"] = kept   # the run records what it really used
    if parts > 1:
        # Every client of a style shares its domain (heterogeneity's within/between groups).
        info.update(partitions=parts, **split.info(),
                    client_groups=[s for s in styles for _ in range(parts)])
    return FederatedDataset("digits-offline", clients, 10, MEAN, STD, info=info)

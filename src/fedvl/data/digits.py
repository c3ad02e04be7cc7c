"""DIGITS feature-shift benchmark: one client per domain, read from `<data-dir>/digits/*.npz`.

SynthDigits is the one domain that needs no file: when `--domains` names `synthdigits` and
`<data-dir>/digits/synthdigits.npz` is absent, a regeneration of Ganin & Lempitsky's recipe is
rendered (`fedvl.data.synthdigits`, cached). A file, when present, always wins: it is the
user's copy (the original, or their own). SVHN is only ever read from `svhn.npz`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.sources import (
    DataError,
    DataOptions,
    check_images,
    check_labels,
    load_npz,
    require_data_dir,
    shown_path,
)
from fedvl.data.spec import BenchmarkSpec, declare_benchmark
from fedvl.data.transforms import stratified_subset, to_tensor_images

# Order of the five DIGITS domains in the seed papers; svhn/synthdigits are used when present.
DOMAINS = ("mnist", "svhn", "usps", "synthdigits", "mnistm")
# One convention for every domain (FedLGD's): 28x28x3, mean 0.5 / std 0.5 per channel.
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
# The regenerated SynthDigits is a fixed data set, like the released file: its seed is not the
# run seed, which draws the `--train-cap` / `--test-cap` subsets as for every other domain.
SYNTHDIGITS_SEED = 0
_KEYS = ("x_train", "y_train", "x_test", "y_test")
_SVHN_HINT = ("SVHN is never generated: convert the official train_32x32.mat / test_32x32.mat "
              "to this file with arrays x_train, x_test (uint8 N x 32 x 32 x 3) and y_train, "
              "y_test (int labels 0..9, the official label 10 of digit 0 stored as 0)")


def _domain_arrays(root: Path, domain: str
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """(x_train, y_train, x_test, y_test, source) of one domain, checked."""
    path = root / f"{domain}.npz"
    if domain == "synthdigits" and not path.is_file():
        from fedvl.data import synthdigits

        # The sizes are read when called, so tests can render a few images only.
        n_train, n_test = synthdigits.DEFAULT_TRAIN, synthdigits.DEFAULT_TEST
        x_tr, y_tr, x_te, y_te = synthdigits.make_synthdigits(SYNTHDIGITS_SEED, n_train, n_test)
        return x_tr, y_tr, x_te, y_te, (f"regenerated (seed {SYNTHDIGITS_SEED}, "
                                        f"{n_train} train / {n_test} test)")
    arr = load_npz(path, _KEYS)
    # Checked before use: a wrong dtype or shape would otherwise fail deep in training.
    x_tr = check_images(arr["x_train"], path, "x_train")
    x_te = check_images(arr["x_test"], path, "x_test")
    y_tr = check_labels(arr["y_train"], path, "y_train", 10, x_tr, "x_train")
    y_te = check_labels(arr["y_test"], path, "y_test", 10, x_te, "x_test")
    return x_tr, y_tr, x_te, y_te, f"file {path}"


def count_domains(opts: DataOptions) -> int:
    """The clients a run will have: the `--domains` named, else the domain files present."""
    if opts.domains:
        return len(opts.domains)
    root = Path(opts.data_dir or ".").expanduser() / "digits"
    return sum((root / f"{d}.npz").is_file() for d in DOMAINS)


@declare_benchmark("digits", BenchmarkSpec(count_clients=count_domains,
                                                reads=frozenset({"domains"})))
def digits(opts: DataOptions) -> FederatedDataset:
    """DIGITS: MNIST, SVHN, USPS, SynthDigits, MNIST-M (those whose files exist, or the
    `--domains` named; a named `synthdigits` without its file is regenerated)."""
    opts.refuse_partition("digits", "has one client per domain")
    opts.refuse_partitions("digits", "has one client per domain")
    root = require_data_dir(opts, "digits") / "digits"
    if opts.domains:
        bad = [d for d in opts.domains if d not in DOMAINS]
        if bad:
            raise DataError(f"unknown digits domain(s) {bad}; allowed: {', '.join(DOMAINS)}")
        wanted = [d for d in DOMAINS if d in opts.domains]
        for d in wanted:
            if d != "synthdigits" and not (root / f"{d}.npz").is_file():
                hint = f"; {_SVHN_HINT}" if d == "svhn" else ""
                raise DataError(f"digits domain '{d}' was requested but "
                                f"{shown_path(root / (d + '.npz'))} is missing{hint}")
    else:
        wanted = [d for d in DOMAINS if (root / f"{d}.npz").is_file()]
        if not wanted:
            raise DataError(f"no DIGITS domain files found in {shown_path(root)}; expected some "
                            "of " + ", ".join(f"{d}.npz" for d in DOMAINS))
    size = opts.image_size or 28
    clients = []
    sources = {}
    for i, d in enumerate(wanted):
        x_tr, y_tr, x_te, y_te, sources[d] = _domain_arrays(root, d)
        rng = np.random.default_rng([opts.seed, 7, i])
        tr = stratified_subset(y_tr, opts.train_cap, rng)
        te = stratified_subset(y_te, opts.test_cap, rng)
        clients.append(ClientData(
            name=d,
            x_train=to_tensor_images(x_tr[tr], size, 3, MEAN, STD),
            y_train=torch.from_numpy(y_tr[tr]),
            x_test=to_tensor_images(x_te[te], size, 3, MEAN, STD),
            y_test=torch.from_numpy(y_te[te]),
        ))
    missing = [d for d in DOMAINS if d not in wanted]
    return FederatedDataset("digits", clients, 10, MEAN, STD,
                            info={"domains": wanted, "domains_missing": missing,
                                  "sources": sources})

"""DIGITS feature-shift benchmark: one client per domain, read from `<data-dir>/digits/*.npz`."""

from __future__ import annotations

import numpy as np
import torch

from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.sources import DataError, DataOptions, load_npz, require_data_dir
from fedvl.data.transforms import stratified_subset, to_tensor_images
from fedvl.registry import register_benchmark

# Order of the five DIGITS domains in the seed papers; svhn/synthdigits are used when present.
DOMAINS = ("mnist", "svhn", "usps", "synthdigits", "mnistm")
# One convention for every domain (FedLGD's): 28x28x3, mean 0.5 / std 0.5 per channel.
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)


@register_benchmark("digits")
def digits(opts: DataOptions) -> FederatedDataset:
    """DIGITS: MNIST, SVHN, USPS, SynthDigits, MNIST-M (those whose files exist)."""
    root = require_data_dir(opts, "digits") / "digits"
    if opts.domains:
        bad = [d for d in opts.domains if d not in DOMAINS]
        if bad:
            raise DataError(f"unknown digits domain(s) {bad}; allowed: {', '.join(DOMAINS)}")
        wanted = [d for d in DOMAINS if d in opts.domains]
        for d in wanted:
            if not (root / f"{d}.npz").is_file():
                raise DataError(f"digits domain '{d}' was requested but '{root / (d + '.npz')}' "
                                "is missing")
    else:
        wanted = [d for d in DOMAINS if (root / f"{d}.npz").is_file()]
        if not wanted:
            raise DataError(f"no DIGITS domain files found in '{root}'; expected some of "
                            + ", ".join(f"{d}.npz" for d in DOMAINS))
    size = opts.image_size or 28
    clients = []
    for i, d in enumerate(wanted):
        arr = load_npz(root / f"{d}.npz", ("x_train", "y_train", "x_test", "y_test"))
        rng = np.random.default_rng([opts.seed, 7, i])
        tr = stratified_subset(arr["y_train"], opts.train_cap, rng)
        te = stratified_subset(arr["y_test"], opts.test_cap, rng)
        clients.append(ClientData(
            name=d,
            x_train=to_tensor_images(arr["x_train"][tr], size, 3, MEAN, STD),
            y_train=torch.from_numpy(arr["y_train"][tr].astype(np.int64)),
            x_test=to_tensor_images(arr["x_test"][te], size, 3, MEAN, STD),
            y_test=torch.from_numpy(arr["y_test"][te].astype(np.int64)),
        ))
    missing = [d for d in DOMAINS if d not in wanted]
    return FederatedDataset("digits", clients, 10, MEAN, STD,
                            info={"domains": wanted, "domains_missing": missing})

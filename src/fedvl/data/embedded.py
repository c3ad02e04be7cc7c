"""The embedded `digits-offline` benchmark: generated from package-shipped data, no network."""

from __future__ import annotations

import torch

from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.sources import DataError, DataOptions
from fedvl.data.transforms import to_tensor_images
from fedvl.registry import register_benchmark

MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)


@register_benchmark("digits-offline")
def digits_offline(opts: DataOptions) -> FederatedDataset:
    """Five digit styles (handwritten, textured, cluttered print, clean print, thick) offline."""
    from fedvl.data.offline import CLIENT_NAMES, make_digits_offline

    # 600 per client keeps the default `fedvl run` well inside 3 minutes on 2 CPU cores.
    train = opts.train_cap or 600
    test = opts.test_cap or 250
    if opts.domains:
        bad = [d for d in opts.domains if d not in CLIENT_NAMES]
        if bad:
            raise DataError(f"unknown digits-offline domain(s) {bad}; allowed: "
                            + ", ".join(CLIENT_NAMES))
    # An empty domain list (`--domains ""`) means no subset, as for `digits`, not no clients.
    raw = make_digits_offline(seed=opts.seed, train_per_client=train, test_per_client=test,
                              clients=opts.domains or None)
    size = opts.image_size or 28
    clients = [
        ClientData(
            name=name,
            x_train=to_tensor_images(xtr, size, 3, MEAN, STD),
            y_train=torch.from_numpy(ytr).long(),
            x_test=to_tensor_images(xte, size, 3, MEAN, STD),
            y_test=torch.from_numpy(yte).long(),
        )
        for name, (xtr, ytr, xte, yte) in raw.items()
    ]
    return FederatedDataset("digits-offline", clients, 10, MEAN, STD,
                            info={"domains": list(raw)})

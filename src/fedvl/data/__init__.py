"""Benchmarks (offline first), federated datasets and partitioners."""

# Importing a benchmark module registers it.
from fedvl.data import (  # noqa: F401
    cifar,
    cifar10c,
    digits,
    domains,
    embedded,
    fashion_mnist,
    medmnist,
    office_caltech,
)
from fedvl.data.federated import ClientData, FederatedDataset, class_channel_stats
from fedvl.data.sources import DataError, DataOptions

__all__ = ["ClientData", "DataError", "DataOptions", "FederatedDataset", "class_channel_stats"]

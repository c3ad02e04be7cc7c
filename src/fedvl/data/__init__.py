"""Benchmarks (offline first), federated datasets and partitioners."""

from fedvl.data import cifar, digits, embedded, medmnist  # noqa: F401  (registers benchmarks)
from fedvl.data.federated import ClientData, FederatedDataset, class_channel_stats
from fedvl.data.sources import DataError, DataOptions

__all__ = ["ClientData", "DataError", "DataOptions", "FederatedDataset", "class_channel_stats"]

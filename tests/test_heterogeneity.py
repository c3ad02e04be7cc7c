"""The heterogeneity measure separates shifted clients from identically distributed ones."""

from __future__ import annotations

import torch

from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.eval.heterogeneity import heterogeneity, mmd2_rbf


def _fed(shift: float) -> FederatedDataset:
    g = torch.Generator().manual_seed(0)
    clients = []
    for k in range(3):
        x = torch.randn(200, 3, 4, 4, generator=g) + shift * k
        y = torch.zeros(200, dtype=torch.long)
        clients.append(ClientData(f"c{k}", x, y, x[:10], y[:10]))
    return FederatedDataset("t", clients, 1, (0.0,) * 3, (1.0,) * 3)


def test_mmd_zero_for_same_distribution_positive_for_shift():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(300, 5, generator=g), torch.randn(300, 5, generator=g)
    assert abs(mmd2_rbf(a, b, (1.0, 2.0))) < 0.02
    assert mmd2_rbf(a, b + 2.0, (1.0, 2.0)) > 0.2


def test_heterogeneity_report():
    iid = heterogeneity(_fed(0.0), samples=100)
    shifted = heterogeneity(_fed(1.0), samples=100)
    assert shifted["mean_pairwise_mmd2"] > 10 * max(shifted["mean_within_client_mmd2"], 1e-3)
    assert iid["mean_pairwise_mmd2"] < 0.05
    assert len(shifted["pairwise_mmd2"]) == 3 and shifted["pairwise_mmd2"][0][0] == 0

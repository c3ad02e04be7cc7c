"""The heterogeneity measure separates shifted clients from identically distributed ones."""

from __future__ import annotations

import torch

from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.eval.mmd import heterogeneity, mmd2_rbf


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


def test_groups_split_pairs_into_same_and_different_domain():
    # Two domains of two clients each: shift by domain only.
    g = torch.Generator().manual_seed(0)
    clients = []
    for k, dom in enumerate((0, 0, 1, 1)):
        x = torch.randn(200, 3, 4, 4, generator=g) + 1.5 * dom
        y = torch.zeros(200, dtype=torch.long)
        clients.append(ClientData(f"c{k}", x, y, x[:10], y[:10]))
    fed = FederatedDataset("t", clients, 1, (0.0,) * 3, (1.0,) * 3,
                           info={"client_groups": ["a", "a", "b", "b"]})
    h = heterogeneity(fed, samples=100)
    pair = h["pairwise_mmd2"]
    assert abs(h["mean_within_group_mmd2"] - (pair[0][1] + pair[2][3]) / 2) < 1e-6
    cross = [pair[i][j] for i in (0, 1) for j in (2, 3)]
    assert abs(h["mean_between_group_mmd2"] - sum(cross) / 4) < 1e-6
    assert h["mean_between_group_mmd2"] > 10 * h["mean_within_group_mmd2"]
    assert "groups" not in heterogeneity(_fed(1.0), samples=50)


def test_given_bandwidths_put_two_analyses_on_one_scale():
    fed = _fed(1.0)
    first = heterogeneity(fed, samples=50)
    again = heterogeneity(_fed(0.5), samples=50, bandwidths=tuple(first["bandwidths"]))
    assert again["bandwidths"] == first["bandwidths"]
    assert heterogeneity(_fed(0.5), samples=50)["bandwidths"] != first["bandwidths"]


def test_pixel_histograms_are_densities_per_channel_of_de_normalised_pixels():
    from fedvl.eval.shift import pixel_histograms

    x = torch.full((4, 3, 2, 2), -1.0)  # de-normalised with mean 0.5, std 0.5: pixel 0
    x[:, 1] = 1.0  # channel 1: pixel 1
    fed = FederatedDataset("t", [ClientData("a", x, torch.zeros(4, dtype=torch.long), x, x)],
                           1, (0.5,) * 3, (0.5,) * 3)
    h = pixel_histograms(fed, bins=4)["a"]
    assert len(h) == 3 and all(sum(v) * 0.25 == 1.0 for v in h)
    assert h[0][0] == 4.0 and h[1][-1] == 4.0


def test_fedvl_heterogeneity_writes_real_and_virtual_matrices_and_figures(tmp_path, capsys):
    import json

    from fedvl.cli import main

    out = tmp_path / "het"
    assert main(["heterogeneity", "--benchmark", "digits-offline", "--train-cap", "40",
                 "--test-cap", "10", "--ipc", "2", "--virtual-steps", "3", "--width", "8",
                 "--depth", "2", "--samples", "20", "--tsne-points", "20",
                 "--out", str(out)]) == 0
    res = json.loads((out / "heterogeneity.json").read_text())
    n = len(res["clients"])
    for kind in ("pixels", "features"):
        real, virt = res[kind]["real"], res[kind]["virtual"]
        assert len(real["pairwise_mmd2"]) == n == len(virt["pairwise_mmd2"])
        assert virt["bandwidths"] == real["bandwidths"]  # one scale for before and after
    # ipc 2 per class a client holds (tiny clients may miss a class), 20 real images each.
    assert 0 < res["tsne"]["virtual"] <= n * 10 * 2
    assert res["tsne"]["total"] == n * 20 + res["tsne"]["virtual"]
    for f in ("pixel_histograms", "mmd_pixels", "mmd_features", "tsne"):
        assert (out / f"{f}.png").stat().st_size > 0 and (out / f"{f}.svg").is_file()
    assert "local virtual" in capsys.readouterr().out

"""Virtual data under label skew: clients distil only the classes they own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from PIL import Image

from fedvl.algorithms.base import make_algorithm
from fedvl.algorithms.fedlgd import pool_class_stats
from fedvl.config import RunConfig
from fedvl.data.federated import ClientData, FederatedDataset, class_channel_stats
from fedvl.distill.client_sets import distill_client, owned_ipc
from fedvl.distill.synthetic import SyntheticSet
from fedvl.engine.simulation import Simulation, SimulationConfig
from fedvl.models.base import build_model
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation


def _drop(client: ClientData, keep: dict[int, int]) -> ClientData:
    """The client with at most keep[c] training images of class c (absent classes: none)."""
    idx = []
    for c, n in keep.items():
        idx.append((client.y_train == c).nonzero().flatten()[:n])
    sel = torch.cat(idx)
    return replace(client, x_train=client.x_train[sel], y_train=client.y_train[sel])


@pytest.fixture
def skewed_fed() -> FederatedDataset:
    """Three clients of a 4-class toy federation; class 3 belongs to nobody, class 2 to one
    client only, and client 2 holds just 3 images of class 1 (below the ownership minimum)."""
    fed = make_toy_federation(num_clients=3, n_train=48)
    keeps = [{0: 12, 1: 12}, {0: 12, 2: 12}, {0: 12, 1: 3}]
    return replace(fed, clients=[_drop(c, k) for c, k in zip(fed.clients, keeps, strict=True)])


def _model_fn(seed: int) -> torch.nn.Module:
    return build_model("convnet", 3, 4, 8, seed=seed, width=8, depth=2)


@pytest.mark.parametrize("init", ["real", "stats", "noise"])
def test_client_distils_only_owned_classes(skewed_fed: FederatedDataset, init: str) -> None:
    c = skewed_fed.clients[2]  # 12 images of class 0, 3 of class 1
    syn = distill_client(c.x_train, c.y_train, 4, _model_fn, ipc=2, steps=2,
                         generator=torch.Generator().manual_seed(0), init=init)
    assert syn.ipc == [2, 0, 0, 0]
    assert set(syn.labels.tolist()) == {0}


def test_owned_ipc_rule() -> None:
    y = torch.tensor([0] * 10 + [1] * 9 + [2] * 30)
    assert owned_ipc(y, 4, 5) == [5, 0, 5, 0]
    assert owned_ipc(y, 4, 5, min_count=1) == [5, 5, 5, 0]
    # A client too small to own any class still distils the classes it has.
    assert owned_ipc(torch.tensor([1, 1, 3]), 4, 2) == [0, 2, 0, 2]
    with pytest.raises(ValueError, match="no training images"):
        owned_ipc(torch.zeros(0, dtype=torch.long), 4, 2)


def test_stats_init_gives_no_blank_images_for_absent_classes() -> None:
    x = torch.randn(20, 3, 4, 4) + 3.0
    y = torch.tensor([0] * 10 + [2] * 10)
    syn = distill_client(x, y, 3, lambda s: build_model("convnet", 3, 3, 4, seed=s, width=4,
                                                        depth=1),
                         ipc=3, steps=0, generator=torch.Generator().manual_seed(1), init="stats")
    assert syn.ipc == [3, 0, 3]
    # Every image is drawn around its own class's statistics (mean ~3), none is a zero image.
    assert bool((syn.images.detach().abs().flatten(1).sum(1) > 0).all())


def test_count_weighted_pooling_equals_statistics_of_the_union() -> None:
    g = torch.Generator().manual_seed(0)
    xa, ya = torch.randn(30, 3, 4, 4, generator=g), torch.tensor([0] * 25 + [1] * 5)
    xb, yb = 2 + 3 * torch.randn(12, 3, 4, 4, generator=g), torch.tensor([1] * 12)
    stats = []
    for x, y in ((xa, ya), (xb, yb)):
        m, s, n = class_channel_stats(x, y, 3)
        stats.append({"mean": m, "std": s, "count": n.float()})
    mean, std, count = pool_class_stats(stats, "count")
    m_all, s_all, n_all = class_channel_stats(torch.cat([xa, xb]), torch.cat([ya, yb]), 3)
    torch.testing.assert_close(mean, m_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(std, s_all, atol=1e-5, rtol=1e-5)
    assert count.tolist() == n_all.float().tolist()
    # The uniform rule averages over the clients holding the class, never over zeros.
    mean_u, _, _ = pool_class_stats(stats, "uniform")
    torch.testing.assert_close(mean_u[0], stats[0]["mean"][0])
    torch.testing.assert_close(mean_u[1], (stats[0]["mean"][1] + stats[1]["mean"][1]) / 2)


def test_png_grid_has_one_row_per_present_class(tmp_path) -> None:
    syn = SyntheticSet(torch.zeros(4, 3, 6, 6), torch.tensor([1, 1, 3, 3]), 5)
    syn.save_png(tmp_path / "g.png", (0.5,) * 3, (0.5,) * 3, pad=2)
    img = Image.open(tmp_path / "g.png")
    assert img.size == (2 * 8 + 2, 2 * 8 + 2)  # 2 classes present -> 2 rows, not 5


def test_fedlgd_runs_on_skewed_clients(skewed_fed: FederatedDataset) -> None:
    cfg = RunConfig(method="fedlgd", rounds=2, batch_size=8, lr=0.05, momentum=0.0,
                    model_args={"width": 8, "depth": 2, "norm": "instance"},
                    method_args={"warmup_steps": 2, "local_dm_steps": 1, "server_gm_steps": 1,
                                 "refresh_period": 1, "refresh_count": 1, "batch_real": 4,
                                 "ipc": 2, "server_ipc": 2})
    env = build_env(cfg, skewed_fed, torch.device("cpu"))
    alg = make_algorithm("fedlgd", env, cfg.method_args)
    sim = Simulation(alg, skewed_fed, SimulationConfig(rounds=2, seed=0))
    out = sim.run()
    assert 0.0 <= out["mean_accuracy"] <= 1.0
    local = [st.arrays["synthetic_labels"]["local"] for st in sim.client_states.values()]
    assert [sorted(set(y.tolist())) for y in local] == [[0, 1], [0, 2], [0]]
    # No client holds class 3, so the global set has none of it.
    assert sorted(set(sim.state["global_y"].tolist())) == [0, 1, 2]


def test_local_virtual_data_follow_owned_classes(skewed_fed: FederatedDataset, tmp_path,
                                                 monkeypatch) -> None:
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = RunConfig(method="fedavg", rounds=1, local_data="virtual", ipc=2, virtual_steps=1,
                    virtual_batch_real=4, batch_size=8, model_args={"width": 8, "depth": 2,
                                                                    "norm": "instance"})
    out = run_experiment(cfg, out=tmp_path / "run", fed=skewed_fed)
    assert 0.0 <= out["mean_accuracy"] <= 1.0
    assert out["train_samples"] == {"c0": 4, "c1": 4, "c2": 2}

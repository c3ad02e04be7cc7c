"""Stacked (vmapped) client training matches `local_train` client by client.

Tolerance: after 3-6 SGD steps with momentum, every weight within 1e-5 absolute plus 1e-4
relative of sequential training; vmap regroups the sums, so bit equality is not expected.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fedvl.core.stacked import stackable, stacked_local_train
from fedvl.core.training import TrainConfig, local_train
from fedvl.models import build_model
from tests.conftest import make_toy_federation, small_cfg

ATOL, RTOL = 1e-5, 1e-4


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 12, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


@pytest.mark.parametrize("cfg", [TrainConfig(lr=0.05, momentum=0.9, batch_size=8),
                                 TrainConfig(lr=0.1, momentum=0.0, weight_decay=1e-3,
                                             batch_size=5, local_epochs=2),
                                 TrainConfig(lr=0.05, momentum=0.5, batch_size=4,
                                             local_steps=3)])
def test_stacked_equals_sequential_per_client(cfg):
    model = build_model("convnet", 3, 5, 12, width=4, depth=2, seed=0)
    # Unequal clients: different sizes, so different step counts and a ragged last batch;
    # one starts from other weights.
    data = [_data(n, s) for n, s in ((19, 1), (8, 2), (30, 3))]
    other = build_model("convnet", 3, 5, 12, width=4, depth=2, seed=7).state_dict()
    weights = [model.state_dict(), model.state_dict(), other]
    stacked = stacked_local_train(copy.deepcopy(model), weights, data, cfg,
                                  [torch.Generator().manual_seed(10 + c) for c in range(3)])
    for c, ((x, y), w) in enumerate(zip(data, weights, strict=True)):
        ref = copy.deepcopy(model)
        ref.load_state_dict(w)
        stats = local_train(ref, x, y, cfg, torch.Generator().manual_seed(10 + c))
        state, got = stacked[c]
        assert (got.steps, got.samples) == (stats.steps, stats.samples)
        assert got.mean_loss == pytest.approx(stats.mean_loss, rel=1e-4)
        for name, t in ref.state_dict().items():
            assert torch.allclose(state[name], t, atol=ATOL, rtol=RTOL), (c, name)
        assert not torch.equal(state["classifier.weight"], w["classifier.weight"])


def test_batchnorm_models_are_refused():
    model = build_model("convnet", 3, 5, 12, width=4, depth=1, norm="batch")
    assert not stackable(model)
    with pytest.raises(ValueError, match="BatchNorm"):
        stacked_local_train(model, [model.state_dict()], [_data(4, 0)], TrainConfig(),
                            [torch.Generator()])


def test_a_run_with_stacked_clients_matches_the_plain_run(tmp_path, monkeypatch):
    import dataclasses

    from fedvl.algorithms.base import make_algorithm
    from fedvl.algorithms.fedavg import FedAvg
    from fedvl.run.assemble import build_env
    from fedvl.run.experiment import run_experiment

    fed = make_toy_federation(num_clients=4, n_train=24, n_test=12)
    cfg = dataclasses.replace(small_cfg("fedavg"), rounds=3, workers=1)
    plain = run_experiment(cfg, out=tmp_path / "plain", fed=fed)
    calls = []
    original = FedAvg.client_update_stacked

    def counted(self, items):
        calls.append(len(items))
        return original(self, items)
    monkeypatch.setattr(FedAvg, "client_update_stacked", counted)
    stacked = run_experiment(dataclasses.replace(cfg, stack_clients=True),
                             out=tmp_path / "stacked", fed=fed)
    assert calls and all(n > 1 for n in calls)
    for name, acc in plain["per_client_loss"].items():
        assert stacked["per_client_loss"][name] == pytest.approx(acc, rel=1e-3, abs=1e-4)
    assert stacked["bytes_up"] == plain["bytes_up"]
    # Methods with extra loss terms or corrections keep client-by-client training.
    env = build_env(cfg, fed, torch.device("cpu"))
    assert make_algorithm("fedavg", env).stack_ready()
    for name in ("fedprox", "scaffold", "moon", "fedlgd"):
        assert not make_algorithm(name, env).stack_ready()

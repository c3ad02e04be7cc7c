"""FedLAP-DP pins: the layer-wise cosine matching loss and the DP target checked by hand, the
trust-region rules (cosine learning rate, radius vote, the client's radius pick, the server's
stop and projection), DP settings refused, and a client's epsilon growing with its rounds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedvl.algorithms import fedlapdp
from fedvl.algorithms.base import ClientContext, make_algorithm
from fedvl.algorithms.fedlapdp import cosine_lr, parameter_distance, vote_radius
from fedvl.config import RunConfig
from fedvl.core.dp import compute_epsilon, poisson_batch
from fedvl.core.message import Message
from fedvl.distill.dp_gradient_matching import RealGradients, layer_cosine_distance, match_loss
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation, small_args

TINY = {"width": 8, "depth": 2, "norm": "instance"}


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=2, n_train=16, n_test=8)


def _alg(fed, **args):
    cfg = RunConfig(method="fedlapdp", model_args=TINY)
    return make_algorithm("fedlapdp", build_env(cfg, fed, torch.device("cpu")),
                          {**small_args("fedlapdp"), **args})


def _tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 3))


def test_layer_cosine_distance_and_mse_term_by_hand():
    # One linear layer: a 2x3 weight gradient (two rows) and its 2-element bias (one row).
    gw_r = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    gw_s = torch.tensor([[0.0, 2.0, 0.0], [2.0, 2.0, 0.0]])
    gb_r, gb_s = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    # Rows: cos 0 and cos 1 -> mean of (1, 0) = 0.5; bias: 1 - 1/sqrt(2).
    want = 0.5 + (1 - 1 / math.sqrt(2))
    got = layer_cosine_distance([gw_s, gb_s], [gw_r, gb_r])
    assert float(got) == pytest.approx(want, abs=1e-6)
    mse = ((gw_s - gw_r) ** 2).sum() + ((gb_s - gb_r) ** 2).sum()   # 1 + 4 + 1 + 1 + 1 = 8
    assert float(match_loss([gw_s, gb_s], [gw_r, gb_r], 0.1)) == pytest.approx(
        want + 0.1 * float(mse), abs=1e-6)
    # A conv gradient: rows are output channels, the mean taken over them.
    conv_r, conv_s = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    cos = F.cosine_similarity(conv_r.reshape(4, -1), conv_s.reshape(4, -1), dim=1, eps=0)
    assert float(layer_cosine_distance([conv_s], [conv_r])) == pytest.approx(
        float((1 - cos).mean()), abs=1e-5)


def test_real_target_without_dp_is_the_poisson_batch_mean_gradient():
    model = _tiny()
    x, y = torch.randn(10, 2, 3), torch.arange(10) % 3
    real = RealGradients(x, y, batch=4)
    got = real(model, torch.Generator().manual_seed(5))
    idx = poisson_batch(10, 0.4, torch.Generator().manual_seed(5))
    want = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]),
                               list(model.parameters()))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want, strict=True))


def test_dp_target_is_clipped_summed_noised_over_the_expected_batch():
    model = _tiny()
    x, y = 3 * torch.randn(10, 2, 3), torch.arange(10) % 3
    clip, sigma = 0.5, 2.0
    real = RealGradients(x, y, batch=4, noise_multiplier=sigma, clip=clip)
    try:
        got = real(model, torch.Generator().manual_seed(5))
    finally:
        real.close()
    # By hand: the same Poisson draw, each record's gradient clipped jointly, then the noise.
    g = torch.Generator().manual_seed(5)
    idx = poisson_batch(10, 0.4, g)
    total = torch.zeros(6 * 3 + 3)
    for i in idx.tolist():
        gi = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]),
                                 list(model.parameters()))
        flat = torch.cat([t.flatten() for t in gi])
        total += flat * min(1.0, clip / float(flat.norm()))
    noise = torch.randn(len(total), generator=g) * sigma * clip
    want = (total + noise) / (0.4 * 10)
    assert torch.allclose(torch.cat([t.flatten() for t in got]), want, atol=1e-5)
    assert real.privacy_spent(7) == (compute_epsilon(sigma, 0.4, 7, 1 / 100), 1 / 100)


def test_cosine_learning_rate_and_radius_vote():
    assert cosine_lr(0.1, 5, 0) == 0.1
    assert cosine_lr(0.1, 0, 200) == pytest.approx(0.1)
    assert cosine_lr(0.1, 99, 199) == pytest.approx(0.05)
    assert cosine_lr(0.1, 198, 199) == cosine_lr(0.1, 500, 199) == 1e-6
    radii = [2.0, 0.5, 30.0, -1.0]   # clipped to [0, 10] first: 2, 0.5, 10, 0
    assert vote_radius(radii, "min", 10.0) == 0.0
    assert vote_radius(radii, "max", 10.0) == 10.0
    assert vote_radius(radii, "avg", 10.0) == pytest.approx(12.5 / 4)
    assert vote_radius(radii, "median", 10.0) == pytest.approx(1.25)
    assert vote_radius(radii, "constant", 10.0) == vote_radius([], "min", 10.0) == 10.0
    a, b = [torch.ones(2, 2), torch.zeros(3)], [torch.zeros(2, 2), torch.full((3,), 2.0)]
    assert float(parameter_distance(a, b)) == pytest.approx(math.sqrt(4 + 12))


def test_client_radius_is_the_distance_at_the_least_real_loss(fed, monkeypatch):
    alg = _alg(fed, radius_epochs=3, radius=0.8)
    losses = iter([3.0, 1.0, 2.0])
    dists = iter([0.5, 0.7, 0.9])
    monkeypatch.setattr(fedlapdp, "mean_loss", lambda *a: torch.tensor(next(losses)))
    monkeypatch.setattr(fedlapdp, "parameter_distance", lambda *a: torch.tensor(next(dists)))
    c = fed.clients[0]
    args = (alg.new_model(), c.x_train[:4], c.y_train[:4], c.x_train, c.y_train, 0.1,
            torch.Generator().manual_seed(0))
    assert alg.client_radius(*args) == pytest.approx(0.7)
    losses, dists = iter([3.0, 1.0, 2.0]), iter([0.5, 0.9, 0.7])
    assert alg.client_radius(*args) == 0.8   # capped at `radius`


@pytest.mark.parametrize("trust", ["stop", "project", "none"])
def test_server_training_keeps_to_the_trust_region(fed, trust):
    alg = _alg(fed, server_epochs=4, server_trust=trust)
    c = fed.clients[0]
    model = alg.new_model()
    start = [p.detach().clone() for p in model.parameters()]
    epochs = alg.server_train(model, c.x_train, c.y_train, 1e-3, 0.5,
                              torch.Generator().manual_seed(0))
    moved = float(parameter_distance(list(model.parameters()), start))
    if trust == "stop":   # the first epoch already ends outside the tiny ball
        assert epochs == 1 and moved >= 1e-3
    elif trust == "project":
        assert epochs == 4 and moved <= 1e-3 * (1 + 1e-4)
    else:
        assert epochs == 4 and moved > 1e-3


def test_dp_settings_that_would_leak_are_refused_and_auto_resolves(fed):
    for args, what in (({"init": "real"}, "'init' = 'real'"),
                       ({"radius_vote": "min"}, "'radius_vote' = 'min'")):
        with pytest.raises(ConfigError, match=what):
            _alg(fed, dp_noise=1.0, **args)
    plain, dp = _alg(fed), _alg(fed, dp_noise=1.0)
    rules = ("init", "carry_images", "mse_weight", "radius", "radius_vote", "lr_net")
    assert [plain.rule(r) for r in rules] == ["real", False, 0.1, 10.0, "min", 0.1]
    assert [dp.rule(r) for r in rules] == ["noise", True, 0.0, 1.5, "constant", 0.002]
    assert _alg(fed, dp_noise=1.0, radius=3.0, lr_net=0.5).radius == 3.0
    assert plain.upload_exemption() and dp.upload_exemption() is None
    with pytest.raises(ConfigError, match="cosine_rounds"):
        _alg(fed, cosine_rounds=1)


def test_epsilon_is_reported_and_grows_with_the_rounds(fed):
    alg = _alg(fed, dp_noise=1.0, steps=2)
    c = fed.clients[0]
    ctx = ClientContext(0, c.name, c.x_train, c.y_train, fed.num_classes, Message(),
                        torch.Generator().manual_seed(0), 0)
    msg = alg.configure(alg.server_init(), None, [0])[0]   # type: ignore[arg-type]
    eps = []
    for rnd in range(2):
        ctx.round = rnd
        reply = alg.client_update(msg, ctx)
        eps.append(reply.meta["epsilon"])
        assert reply.meta["dp_steps"] == 2 * (rnd + 1) and "radius" not in reply.meta
    delta = 1 / (10 * 16)
    assert eps[1] > eps[0] > 0
    assert eps[1] == pytest.approx(compute_epsilon(1.0, 4 / 16, 4, delta))
    assert reply.meta["delta"] == pytest.approx(delta)


def test_a_dp_run_reports_epsilon_and_its_radii(fed, tmp_path):
    cfg = RunConfig(method="fedlapdp", model_args=TINY, rounds=1, batch_size=8,
                    client_ratio=1.0,
                    method_args={**small_args("fedlapdp"), "dp_noise": 1.0})
    s = run_experiment(cfg, out=tmp_path / "r", fed=fed)
    assert set(s["privacy"]["epsilon"]) == {"c0", "c1"}
    assert all(e > 0 for e in s["privacy"]["epsilon"].values())
    assert s["fedlapdp"]["radius"] == [1.5]   # the code's constant DP radius

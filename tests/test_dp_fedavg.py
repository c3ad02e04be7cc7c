"""DP-FedAvg: example-level DP-SGD in the local training of the weight-averaging methods.

The mechanism is checked by hand on a tiny model (per-sample clipping, noise from the client's
generator, the proximal term added after privatisation), epsilon against the accountant for
every step a client took, the noise-multiplier inverse, the refusals, and that small noise still
learns while large noise does not.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedvl.algorithms.base import ClientContext, Env, ServerContext, make_algorithm
from fedvl.algorithms.fedprox import ProximalTerm
from fedvl.config import RunConfig
from fedvl.core.dp import (
    PerSampleGradients,
    compute_epsilon,
    default_delta,
    dp_sgd_train,
    noise_multiplier_for,
    privatise,
)
from fedvl.core.message import Message
from fedvl.core.training import TrainConfig
from fedvl.models.base import build_model
from fedvl.options import ConfigError
from fedvl.run.assemble import build_federation
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation

MODEL = {"width": 8, "depth": 2, "norm": "instance"}
# VFTL: FedAvg after a server pre-training that reads no client data.
DP_METHODS = ("fedavg", "fedprox", "fednova", "scaffold", "feddyn", "vftl")


def _tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.ReLU(inplace=True), nn.Linear(4, 3))


def _data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 2, 3, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def _hand_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sample's CE gradient over all parameters, flattened, one backward per sample."""
    rows = []
    for i in range(len(y)):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def _cfg(name: str, **kw) -> RunConfig:
    return RunConfig(**{"method": name, "rounds": 2, "batch_size": 8, "lr": 0.05,
                        "momentum": 0.0, "client_ratio": 1.0, "model_args": MODEL, **kw})


# -- the mechanism -------------------------------------------------------------------------------
def test_per_sample_gradients_are_each_samples_own_and_clip_to_at_most_c():
    model = _tiny()
    x, y = _data()
    per = PerSampleGradients(model)
    grads, losses = per(x, y)
    per.close()
    flat = torch.cat([g.reshape(len(y), -1) for g in grads], 1)
    torch.testing.assert_close(flat, _hand_grads(model, x, y), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses, F.cross_entropy(model(x), y, reduction="none"))
    # The in-place activation is restored and no hook is left behind.
    assert model[2].inplace and not any(m._forward_hooks for m in model.modules())
    clip = 1.5
    norms = flat.norm(dim=1)
    assert (norms > clip).any() and (norms < clip).any()   # both sides of the clip occur
    for i in range(len(y)):
        one = [g[i : i + 1] for g in grads]
        out, _ = privatise(one, clip, 0.0, 1.0, torch.Generator().manual_seed(0))
        got = torch.cat([o.flatten() for o in out])
        assert float(got.norm()) <= clip * (1 + 1e-6)
        if norms[i] < clip:   # a gradient inside the ball is left alone
            torch.testing.assert_close(got, flat[i])


def test_privatised_step_is_the_hand_computed_noisy_mean_of_clipped_gradients():
    model = _tiny()
    x, y = _data(10)
    w0 = torch.cat([p.detach().flatten() for p in model.parameters()])
    # Anchor the proximal term elsewhere, so its gradient is not zero.
    prox = ProximalTerm(model, mu=0.3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    w1 = torch.cat([p.detach().flatten() for p in model.parameters()])
    anchor = torch.cat([a.flatten() for a in prox.anchor])
    sigma, clip, lr, batch = 0.7, 0.5, 0.1, 4
    q = batch / len(y)
    # By hand: the Poisson draw, then one noise vector over all coordinates, both from g.
    g = torch.Generator().manual_seed(11)
    take = (torch.rand(len(y), generator=g, dtype=torch.float64) < q).nonzero().flatten()
    assert 0 < len(take) < len(y)
    rows = _hand_grads(model, x[take], y[take])
    scale = (clip / rows.norm(dim=1)).clamp(max=1.0)
    noise = torch.randn(rows.shape[1], generator=g) * sigma * clip
    private = ((rows * scale[:, None]).sum(0) + noise) / (q * len(y))
    expected = w1 - lr * (private + prox.mu * (w1 - anchor))

    cfg = TrainConfig(lr=lr, momentum=0.0, batch_size=batch, local_steps=1)
    stats = dp_sgd_train(model, x, y, cfg, torch.Generator().manual_seed(11),
                         noise_multiplier=sigma, clip=clip, terms=(prox,))
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert stats.steps == 1 and stats.samples == len(take)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got, w0)


def test_an_empty_poisson_batch_is_still_a_noisy_step():
    model = _tiny()
    x, y = _data(10)
    x, y = torch.cat([x] * 100), torch.cat([y] * 100)
    n = len(y)
    # Rate 1/n: a seed whose draw includes no record (about 37% of seeds do).
    seed = next(s for s in range(50) if not bool(
        (torch.rand(n, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
         < 1 / n).any()))
    g = torch.Generator().manual_seed(seed)
    torch.rand(n, generator=g, dtype=torch.float64)
    w0 = torch.cat([p.detach().flatten() for p in model.parameters()])
    noise = torch.randn(len(w0), generator=g) * 2.0   # sigma 1, clip 2, expected batch 1
    cfg = TrainConfig(lr=0.1, momentum=0.0, batch_size=1, local_steps=1)
    stats = dp_sgd_train(model, x, y, cfg, torch.Generator().manual_seed(seed),
                         noise_multiplier=1.0, clip=2.0)
    assert stats.samples == 0 and stats.steps == 1
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(got, w0 - 0.1 * noise)


# -- accounting ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DP_METHODS)
def test_epsilon_per_client_is_the_accountant_epsilon_of_every_step_taken(name, tmp_path):
    fed = make_toy_federation(num_clients=3, n_train=24, n_test=12)
    cfg = _cfg(name, rounds=3, client_ratio=0.67,
               method_args={"dp_noise": 1.1, "dp_clip": 0.8})
    summary = run_experiment(cfg, out=tmp_path / "run", fed=fed)
    priv = summary["privacy"]
    assert priv["noise_multiplier"] == 1.1 and priv["clip"] == 0.8
    assert set(priv["epsilon"]) <= set(fed.client_names) and priv["epsilon"]
    for client, eps in priv["epsilon"].items():
        steps = priv["dp_steps"][client]
        # 3 Poisson steps per round (24 records, batch 8): a multiple of 3, at most 3 rounds.
        assert steps % 3 == 0 and 3 <= steps <= 9, (client, steps)
        assert priv["delta"][client] == default_delta(24)
        assert eps == compute_epsilon(1.1, 8 / 24, steps, default_delta(24))
    # Someone was sampled twice or more: epsilon composes over rounds, not one round's steps.
    assert max(priv["dp_steps"].values()) > 3
    rows = [r for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if r]
    assert all('"train_loss"' not in r for r in rows)   # an unprivatised statistic stays home


def test_client_reply_carries_epsilon_of_all_its_steps_so_far():
    fed = make_toy_federation(num_clients=1, n_train=20)
    env = Env(model_fn=lambda num_classes=None, seed=None: build_model(
        "convnet", 3, 4, 8, seed=0, **MODEL), num_classes=4, num_clients=1,
        train=TrainConfig(lr=0.05, batch_size=5, local_epochs=2), client_names=["c0"])
    alg = make_algorithm("fedavg", env, {"dp_noise": 1.3, "dp_delta": 1e-4})
    state = alg.server_init()
    c = fed.clients[0]
    client_state = Message({})
    for rnd, steps in ((0, 8), (1, 16)):
        ctx = ClientContext(0, "c0", c.x_train, c.y_train, 4, client_state,
                            torch.Generator().manual_seed(rnd), rnd)
        reply = alg.client_update(alg.configure(state, ServerContext(rnd), [0])[0], ctx)
        assert reply.meta["dp_steps"] == steps and reply.meta["delta"] == 1e-4
        assert reply.meta["epsilon"] == compute_epsilon(1.3, 5 / 20, steps, 1e-4)
        assert "train_loss" not in reply.meta
        state = alg.aggregate(state, ServerContext(rnd), {0: reply})
    assert alg.report(state)["privacy"]["epsilon"] == {"c0": compute_epsilon(1.3, 0.25, 16,
                                                                             1e-4)}


@pytest.mark.parametrize("eps, delta, rate, steps", [(1.0, 1e-5, 0.01, 1000),
                                                     (4.0, 1e-4, 0.16, 70),
                                                     (0.5, 1e-3, 1.0, 10)])
def test_noise_multiplier_round_trips(eps, delta, rate, steps):
    sigma = noise_multiplier_for(eps, delta, rate, steps)
    got = compute_epsilon(sigma, rate, steps, delta)
    assert eps - 0.02 <= got <= eps
    # A little less noise overshoots the target: sigma is (close to) the smallest that fits.
    assert compute_epsilon(sigma * 0.97, rate, steps, delta) > eps


def test_noise_multiplier_refuses_impossible_targets():
    with pytest.raises(ValueError, match="epsilon > 0"):
        noise_multiplier_for(0.0, 1e-5, 0.1, 10)
    with pytest.raises(ValueError, match="unknown accountant"):
        noise_multiplier_for(1.0, 1e-5, 0.1, 10, accountant="gdp")


# -- refusals ------------------------------------------------------------------------------------
def test_batchnorm_model_is_refused(tmp_path):
    fed = make_toy_federation(num_clients=2, n_train=16, n_test=8)
    cfg = _cfg("fedavg", model_args={**MODEL, "norm": "batch"},
               method_args={"dp_noise": 1.0})
    with pytest.raises(ValueError, match="cannot use a network with BatchNorm"):
        run_experiment(cfg, out=tmp_path / "bn", fed=fed)
    run_experiment(_cfg("fedavg", rounds=1, model_args={**MODEL, "norm": "batch"}),
                   out=tmp_path / "plain", fed=fed)   # fine without DP


@pytest.mark.parametrize("args, message", [
    ({"dp_noise": -0.5}, "fedavg option 'dp_noise' = -0.5 is invalid; must be >= 0"),
    ({"dp_clip": 0.0}, "fedavg option 'dp_clip' = 0.0 is invalid; must be > 0"),
    ({"dp_clip": -1.0}, "fedavg option 'dp_clip' = -1.0 is invalid; must be > 0"),
    ({"dp_delta": 1.0}, "fedavg option 'dp_delta' = 1.0 is invalid; must be in"),
])
def test_bad_dp_options_are_refused(args, message, tmp_path):
    fed = make_toy_federation(num_clients=2, n_train=16, n_test=8)
    with pytest.raises(ConfigError) as info:
        run_experiment(_cfg("fedavg", method_args=args), out=tmp_path / "r", fed=fed)
    assert message in str(info.value)


@pytest.mark.parametrize("name, message", [
    ("fedavg+vhl", "method 'fedavg+vhl' cannot run DP-SGD (dp_noise > 0): VHLAddon.loss_terms"),
    ("moon", "method 'moon' has no option(s) ['dp_noise']"),
])
def test_methods_whose_local_training_dp_does_not_cover_refuse(name, message, tmp_path):
    fed = make_toy_federation(num_clients=2, n_train=16, n_test=8)
    args = {"dp_noise": 1.0, **({"virtual_per_class": 2} if "vhl" in name else {})}
    with pytest.raises(ConfigError) as info:
        run_experiment(_cfg(name, method_args=args), out=tmp_path / "r", fed=fed)
    assert message in str(info.value)
    if "cannot run" in message:
        can = "methods that can: fedavg, feddyn, fednova, fedprox, scaffold, vftl"
        assert can in str(info.value)


def test_stacked_training_stays_refused_under_dp():
    env = Env(model_fn=lambda num_classes=None, seed=None: build_model(
        "convnet", 3, 4, 8, seed=0, **MODEL), num_classes=4, num_clients=2, train=TrainConfig())
    assert make_algorithm("fedavg", env).stack_ready()
    assert not make_algorithm("fedavg", env, {"dp_noise": 0.5}).stack_ready()


# -- utility -------------------------------------------------------------------------------------
def test_small_noise_still_learns_and_large_noise_hurts(tmp_path):
    torch.set_num_threads(1)
    base = RunConfig(method="fedavg", benchmark="digits-offline", rounds=6, batch_size=16,
                     lr=0.5, momentum=0.0, train_cap=96, test_cap=60, model_args=MODEL,
                     workers=1)
    fed = build_federation(base)
    acc = {}
    for sigma in (0.3, 30.0):
        cfg = dataclasses.replace(base, method_args={"dp_noise": sigma, "dp_clip": 1.0})
        acc[sigma] = run_experiment(cfg, out=tmp_path / str(sigma), fed=fed)["mean_accuracy"]
    chance = 1 / fed.num_classes
    assert acc[0.3] > chance + 0.08, acc
    assert acc[30.0] < acc[0.3] - 0.08, acc
    assert not math.isnan(acc[30.0])

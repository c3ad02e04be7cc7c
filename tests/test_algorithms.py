"""Behaviours of the baselines that can silently break."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedvl.algorithms.base import ClientContext, make_algorithm
from fedvl.algorithms.fednova import effective_steps
from fedvl.core.message import Message
from fedvl.core.training import local_train
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation


def _run(cfg, fed, tmp_path, name):
    return run_experiment(cfg, out=tmp_path / name, fed=fed)


def _final_weights(cfg, fed, tmp_path, name):
    _run(cfg, fed, tmp_path, name)
    ck = torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    return ck["server_state"]["model"]


def _assert_same(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol), k


def test_fedprox_mu0_equals_fedavg(tiny_cfg, toy_fed, tmp_path):
    a = _final_weights(tiny_cfg, toy_fed, tmp_path, "avg")
    cfg = dataclasses.replace(tiny_cfg, method="fedprox", method_args={"mu": 0.0})
    b = _final_weights(cfg, toy_fed, tmp_path, "prox")
    _assert_same(a, b)


def test_fedprox_positive_mu_differs_and_pulls_toward_global(tiny_cfg, toy_fed, tmp_path):
    a = _final_weights(tiny_cfg, toy_fed, tmp_path, "avg")
    cfg = dataclasses.replace(tiny_cfg, method="fedprox", method_args={"mu": 10.0}, rounds=1)
    b = _final_weights(cfg, toy_fed, tmp_path, "prox")
    a1 = _final_weights(dataclasses.replace(tiny_cfg, rounds=1), toy_fed, tmp_path, "avg1")
    init = make_algorithm("fedavg", build_env(tiny_cfg, toy_fed, torch.device("cpu")))
    w0 = init.server_init()["model"]
    # A strong proximal term keeps the first-round model closer to its starting point.
    dist = lambda w: sum(float((w[k] - w0[k]).norm()) for k in w0)  # noqa: E731
    assert dist(b) < dist(a1)
    assert any(not torch.allclose(a[k], b[k]) for k in a)


def test_fednova_equal_steps_equals_fedavg(tiny_cfg, tmp_path):
    # Equal client sizes and batch size -> equal local steps -> identical aggregation.
    fed = make_toy_federation(n_train=48)
    cfg = dataclasses.replace(tiny_cfg, momentum=0.5)
    a = _final_weights(cfg, fed, tmp_path, "avg")
    b = _final_weights(dataclasses.replace(cfg, method="fednova"), fed, tmp_path, "nova")
    _assert_same(a, b, atol=1e-5)


def test_fednova_unequal_steps_differs(tiny_cfg, tmp_path):
    fed = make_toy_federation(n_train=48)
    fed.clients[0].x_train = fed.clients[0].x_train[:16]
    fed.clients[0].y_train = fed.clients[0].y_train[:16]
    a = _final_weights(tiny_cfg, fed, tmp_path, "avg")
    b = _final_weights(dataclasses.replace(tiny_cfg, method="fednova"), fed, tmp_path, "nova")
    assert any(not torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_effective_steps():
    assert effective_steps(5, 0.0) == 5
    # With momentum, a_k approaches tau / (1 - rho) for long runs.
    assert effective_steps(1000, 0.9) == pytest.approx(1000 / 0.1 - 0.9 / 0.01 * (1 - 0.9**1000),
                                                       rel=1e-9)


def test_fedavg_one_client_equals_centralised_sgd(tiny_cfg, tmp_path):
    fed = make_toy_federation(num_clients=1)
    cfg = dataclasses.replace(tiny_cfg, rounds=3, momentum=0.0)
    w_fed = _final_weights(cfg, fed, tmp_path, "one")
    # Centralised: one model, SGD for 3 epochs with the same per-round batch order.
    from fedvl.engine.simulation import client_generator

    env = build_env(cfg, fed, torch.device("cpu"))
    model = env.model_fn()
    c = fed.clients[0]
    for rnd in range(3):
        local_train(model, c.x_train, c.y_train, env.train, client_generator(cfg.seed, rnd, 0))
    _assert_same(w_fed, model.state_dict(), atol=1e-6)


def test_scaffold_server_variate_is_mean_of_client_variates(tiny_cfg, toy_fed, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, method="scaffold", client_ratio=0.67, rounds=4)
    _run(cfg, toy_fed, tmp_path, "sc")
    ck = torch.load(tmp_path / "sc" / "checkpoint.pt", weights_only=True)
    c = ck["server_state"]["c"]
    locals_ = [ck["client_states"][i][0].get("control_variates") for i in range(3)]
    for name, ct in c.items():
        parts = [loc[name] if loc is not None else torch.zeros_like(ct) for loc in locals_]
        assert torch.allclose(ct, sum(parts) / 3, atol=1e-6), name
    assert any(float(t.abs().sum()) > 0 for t in c.values())


def test_scaffold_correction_applied_after_each_step(tiny_cfg, toy_fed):
    env = build_env(tiny_cfg, toy_fed, torch.device("cpu"))
    alg = make_algorithm("scaffold", env)
    state = alg.server_init()
    # A non-zero server variate must move the client's result by -lr * steps * c.
    c = {k: torch.full_like(v, 0.01) for k, v in state["c"].items()}
    cl = toy_fed.clients[0]

    def run(cv):
        msg = Message({"weights": state["model"], "control_variates": cv})
        ctx = ClientContext(0, "c0", cl.x_train, cl.y_train, 4, Message(),
                            torch.Generator().manual_seed(0), 0)
        return alg.client_update(msg, ctx)

    r0 = run({k: torch.zeros_like(v) for k, v in c.items()})
    r1 = run(c)
    assert int(r1.meta["steps"]) == 3
    w0, w1 = r0.get("weights"), r1.get("weights")
    diffs = [float((w0[k] - w1[k]).abs().max()) for k in c]
    assert max(diffs) > 1e-4


def test_ledger_bytes_fedavg(tiny_cfg, toy_fed, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, client_ratio=0.67, rounds=3)
    s = _run(cfg, toy_fed, tmp_path, "led")
    env = build_env(cfg, toy_fed, torch.device("cpu"))
    model = env.model_fn()
    param_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    sampled = 2
    assert s["bytes_up"] == param_bytes * sampled * 3
    assert s["bytes_down"] == param_bytes * sampled * 3
    assert s["bytes_up"] + s["bytes_down"] == 2 * param_bytes * sampled * 3
    assert set(s["bytes_by_kind"]) == {"weights"}


def test_scaffold_ledger_counts_control_variates(tiny_cfg, toy_fed, tmp_path):
    s = _run(dataclasses.replace(tiny_cfg, method="scaffold", rounds=1), toy_fed, tmp_path, "s")
    kinds = s["bytes_by_kind"]
    assert kinds["control_variates"]["up"] > 0 and kinds["control_variates"]["down"] > 0


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fednova", "scaffold", "moon",
                                    "fedavgm", "fedadam", "local"])
def test_every_method_learns_toy_problem(method, tiny_cfg, toy_fed, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, method=method, rounds=4)
    s = _run(cfg, toy_fed, tmp_path, method)
    assert s["mean_accuracy"] > 0.5, s["per_client_accuracy"]  # chance is 0.25


def test_local_reports_local_and_global_accuracy(tiny_cfg, toy_fed, tmp_path):
    s = _run(dataclasses.replace(tiny_cfg, method="local"), toy_fed, tmp_path, "loc")
    assert set(s["global_accuracy"]) == set(s["per_client_accuracy"])
    assert len(s["cross_accuracy"]) == 3 and s["bytes_up"] == 0


def test_fedavgm_zero_momentum_unit_lr_equals_fedavg(tiny_cfg, toy_fed, tmp_path):
    a = _final_weights(tiny_cfg, toy_fed, tmp_path, "avg")
    cfg = dataclasses.replace(tiny_cfg, method="fedavgm",
                              method_args={"server_lr": 1.0, "server_momentum": 0.0})
    _assert_same(a, _final_weights(cfg, toy_fed, tmp_path, "m"), atol=1e-6)


def test_uniform_vs_sample_weighting_differ(tiny_cfg, tmp_path):
    fed = make_toy_federation()
    fed.clients[0].x_train = fed.clients[0].x_train[:8]
    fed.clients[0].y_train = fed.clients[0].y_train[:8]
    a = _final_weights(dataclasses.replace(tiny_cfg, rounds=1), fed, tmp_path, "s")
    b = _final_weights(dataclasses.replace(tiny_cfg, rounds=1, aggregation="uniform"), fed,
                       tmp_path, "u")
    assert any(not torch.allclose(a[k], b[k]) for k in a)


def test_bad_method_option_is_named(tiny_cfg, toy_fed, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, method="fedprox", method_args={"nu": 1})
    with pytest.raises(ValueError, match="'nu'.*allowed: .*mu"):
        _run(cfg, toy_fed, tmp_path, "bad")
    cfg = dataclasses.replace(tiny_cfg, method="fedprox", method_args={"mu": "big"})
    with pytest.raises(ValueError, match="'mu' must be a number"):
        _run(cfg, toy_fed, tmp_path, "bad2")

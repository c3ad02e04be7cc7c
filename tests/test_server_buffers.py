"""Server optimisers move parameters only; BatchNorm buffers take the plain weighted average."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.core.message import Message
from fedvl.core.params import parameter_keys, weighted_average
from fedvl.core.training import evaluate
from fedvl.engine.simulation import client_generator
from fedvl.run.assemble import build_env
from tests.conftest import make_toy_federation

BN = {"width": 8, "depth": 2, "norm": "batch"}


def _unequal_fed():
    # Client 0 keeps 16 examples (1 step of batch 16), the others 48 (3 steps): unequal tau_k.
    fed = make_toy_federation(n_train=48)
    fed.clients[0].x_train = fed.clients[0].x_train[:16]
    fed.clients[0].y_train = fed.clients[0].y_train[:16]
    return fed


def _ctx(fed, cid, rnd):
    c = fed.clients[cid]
    return ClientContext(cid=cid, name=c.name, x=c.x_train, y=c.y_train,
                         num_classes=fed.num_classes, state=Message(),
                         generator=client_generator(0, rnd, cid), round=rnd)


def test_parameter_keys_exclude_buffers(tiny_cfg, toy_fed):
    env = build_env(dataclasses.replace(tiny_cfg, model_args=BN), toy_fed, torch.device("cpu"))
    model = env.model_fn()
    keys = parameter_keys(model)
    sd = model.state_dict()
    assert keys < set(sd)
    assert {k for k in sd if k not in keys} == {k for k, _ in model.named_buffers()}
    assert any(k.endswith("running_var") for k in sd if k not in keys)


@pytest.mark.parametrize("method", ["fednova", "fedavgm", "fedadam"])
def test_server_rules_leave_bn_buffers_at_the_weighted_average(method, tiny_cfg):
    fed = _unequal_fed()
    cfg = dataclasses.replace(tiny_cfg, method=method, model_args=BN, momentum=0.5)
    env = build_env(cfg, fed, torch.device("cpu"))
    alg = make_algorithm(method, env)
    state = alg.server_init()
    params = alg.parameter_keys()
    buffers = [k for k in state["model"] if k not in params]
    assert any(k.endswith("running_var") for k in buffers)
    rule_moved_params = False
    for rnd in range(3):
        msgs = alg.configure(state, ServerContext(rnd), [0, 1, 2])
        replies = {c: alg.client_update(m, _ctx(fed, c, rnd)) for c, m in msgs.items()}
        assert len({r.meta["steps"] for r in replies.values()}) > 1
        avg = weighted_average([r.get("weights") for r in replies.values()],
                               [float(r.meta["num_examples"]) for r in replies.values()])
        state = alg.aggregate(state, ServerContext(rnd), replies)
        new = state["model"]
        for k in buffers:
            assert torch.equal(new[k], avg[k]), (rnd, k)
            if new[k].is_floating_point():
                assert torch.isfinite(new[k]).all(), (rnd, k)
            if k.endswith("running_var"):
                assert (new[k] > 0).all(), (rnd, k)
        rule_moved_params |= any(not torch.allclose(new[k], avg[k]) for k in params)
    # The server rule itself still applies to the parameters.
    assert rule_moved_params
    acc, loss = evaluate(alg.global_model(state), fed.clients[1].x_test, fed.clients[1].y_test)
    assert math.isfinite(loss) and 0.0 <= acc <= 1.0


@pytest.mark.parametrize("correction", ["flower", "none"])
def test_fedadam_matches_flowers_fedadam_with_its_bias_correction(correction, tiny_cfg, toy_fed):
    # Flower's FedAdam scales its learning rate by sqrt(1 - b2^(r+1)) / (1 - b1^(r+1)) at its
    # round r; `bias_correction=flower` gives the same weights over three server steps, the
    # default (FedOpt's Algorithm 2, no correction) differs from it.
    pytest.importorskip("flwr")
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAdam as FlowerFedAdam

    cfg = dataclasses.replace(tiny_cfg, method="fedadam")
    env = build_env(cfg, toy_fed, torch.device("cpu"))
    alg = make_algorithm("fedadam", env, {"bias_correction": correction, "server_lr": 0.1,
                                          "tau": 1e-3})
    state = alg.server_init()
    keys = list(state["model"])
    init = [state["model"][k].double().numpy() for k in keys]
    ref = FlowerFedAdam(initial_parameters=ndarrays_to_parameters(init), eta=0.1, beta_1=0.9,
                        beta_2=0.99, tau=1e-3)
    g = torch.Generator().manual_seed(0)
    for rnd in range(1, 4):
        clients = [{k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=torch.float64)
                    for k, v in ((k, torch.from_numpy(a)) for k, a in zip(keys, init))}
                   for _ in range(3)]
        avg = {k: sum(c[k] for c in clients) / 3 for k in keys}
        state = alg.server_update({**state, "model": {k: v.double() for k, v in
                                                      state["model"].items()}}, avg, {})
        res = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(
            [c[k].numpy() for k in keys]), 1, {})) for c in clients]
        params, _ = ref.aggregate_fit(rnd, res, [])
        flower = parameters_to_ndarrays(params)
        init = [state["model"][k].numpy() for k in keys]
    gap = max(float(abs(a - b).max()) for a, b in zip(init, flower))
    if correction == "flower":
        assert gap < 1e-9
    else:
        assert gap > 1e-4

"""DynaFed pins: the trajectory-matching loss and its gradient against a linear model unrolled
by hand (the public code's equations), the synthesis round and the fine-tuning after it, the
matching loss falling over the synthesis, clients getting exactly FedAvg's messages, BatchNorm
in the unroll, the pseudo set surviving a resume, and the option rules."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.algorithms.dynafed import FINETUNE_STREAM
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.distill.trajectory import soft_cross_entropy, trajectory_matching_loss, unroll_sgd
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation, resumed_after_crash

TINY = {"width": 8, "depth": 2, "norm": "instance"}
# Two checkpoints (theta_0, theta_1): the synthesis runs in round 1 (0-based), one pair only.
SHORT = {"trajectory_length": 2, "expert_rounds": 1, "average_min": 1, "syn_steps": 2,
         "iterations": 2, "ipc": 2, "finetune_epochs": 2, "dsa": False}


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=24, n_test=12)


def _alg(fed, norm: str = "instance", **args):
    cfg = RunConfig(method="dynafed", batch_size=8, lr=0.05, momentum=0.0,
                    model_args={**TINY, "norm": norm})
    return make_algorithm("dynafed", build_env(cfg, fed, torch.device("cpu")), args)


def _client(fed, k: int, rnd: int) -> ClientContext:
    c = fed.clients[k]
    return ClientContext(k, c.name, c.x_train, c.y_train, fed.num_classes, Message(),
                         torch.Generator().manual_seed(100 * rnd + k), rnd)


def _round(alg, fed, state: dict, rnd: int) -> tuple[dict, dict[int, Message]]:
    """One round with every client; the new state and the replies."""
    ctx = ServerContext(rnd)
    sent = alg.configure(state, ctx, [0, 1, 2])
    replies = {k: alg.client_update(sent[k].copy(), _client(fed, k, rnd)) for k in range(3)}
    return alg.aggregate(state, ctx, replies), replies


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the central computation, by hand -------------------------------------------------------------
class Linear(nn.Module):
    """f(x) = x W^T: the inner gradient has a closed form."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t()


def _softmax(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _by_hand(x, y_logits, w0, w_star, lr, steps):
    """The code's unroll for f = x W^T: kd_loss = mean(-softmax(Y) log softmax(xW^T)) over the
    n x C entries has gradient (softmax(xW^T) - softmax(Y))^T x / (n C); after `steps` full-batch
    steps W_N, the loss is ||W_N - W*||^2 / ||W_0 - W*||^2."""
    n, c = y_logits.shape
    w = w0.copy()
    for _ in range(steps):
        w = w - lr * (_softmax(x @ w.T) - _softmax(y_logits)).T @ x / (n * c)
    return ((w - w_star) ** 2).sum() / ((w0 - w_star) ** 2).sum()


def test_soft_cross_entropy_is_the_codes_kd_loss():
    # softmax([0, ln 3]) = [1/4, 3/4], softmax([0, 0]) = [1/2, 1/2]; the mean runs over the
    # two entries: -(0.5 ln 0.25 + 0.5 ln 0.75) / 2.
    got = soft_cross_entropy(torch.tensor([[0.0, math.log(3)]]), torch.zeros(1, 2))
    assert math.isclose(float(got), -(0.5 * math.log(0.25) + 0.5 * math.log(0.75)) / 2,
                        rel_tol=1e-6)


def test_matching_loss_and_its_lr_gradient_equal_the_hand_unrolled_linear_model():
    x = np.array([[1.0, 2.0], [-1.0, 0.5], [0.0, -1.5]])
    y_logits = np.array([[2.0, 0.0], [0.0, 1.0], [-1.0, 1.0]])
    w0 = np.array([[0.5, -0.2], [0.1, 0.3]])
    w_star = np.array([[0.2, 0.4], [0.6, -0.5]])
    lr, steps = 0.7, 3
    want = _by_hand(x, y_logits, w0, w_star, lr, steps)
    h = 1e-6   # central difference of the hand formula: the second-order path through lr
    want_dlr = (_by_hand(x, y_logits, w0, w_star, lr + h, steps)
                - _by_hand(x, y_logits, w0, w_star, lr - h, steps)) / (2 * h)

    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    images = t(x).requires_grad_(True)
    labels = t(y_logits).requires_grad_(True)
    eta = t(lr).requires_grad_(True)
    model = Linear(t(w0))
    start, target = {"w": t(w0)}, {"w": t(w_star)}
    everything = torch.arange(3)
    end = unroll_sgd(model, start, images, labels, eta, [everything] * steps)
    loss = trajectory_matching_loss(end, start, target)
    assert math.isclose(float(loss.detach()), want, rel_tol=1e-12)
    (dlr,) = torch.autograd.grad(loss, [eta])
    assert math.isclose(float(dlr), want_dlr, rel_tol=1e-6)
    assert torch.equal(model.w.detach(), t(w0))   # the template is never moved


# -- the schedule ----------------------------------------------------------------------------------
def test_pseudo_set_is_made_at_the_configured_round_and_then_fine_tunes(fed):
    alg = _alg(fed, **{**SHORT, "trajectory_length": 3, "expert_rounds": 2})
    state = alg.server_init()
    assert len(state["trajectory"]) == 1 and state["pseudo_x"] is None
    for rnd in (0, 1):   # plain FedAvg while the trajectory grows
        state, replies = _round(alg, fed, state, rnd)
        assert state["pseudo_x"] is None and len(state["trajectory"]) == rnd + 2
        assert _same(state["model"], alg.average(replies))
        assert _same(state["trajectory"][-1], alg.checkpoint(state["model"]))
    state, replies = _round(alg, fed, state, 2)   # round L = 3 (1-based): synthesis
    assert state["synthesis_round"] == 2 and state["trajectory"] == []
    assert state["pseudo_x"].shape == (2 * fed.num_classes, *fed.image_shape)
    assert state["pseudo_y"].shape == (2 * fed.num_classes, fed.num_classes)
    assert not _same(state["model"], alg.average(replies))   # fine-tuned after averaging
    pseudo = state["pseudo_x"].clone()
    state, replies = _round(alg, fed, state, 3)   # later rounds: the same set fine-tunes
    assert torch.equal(state["pseudo_x"], pseudo)
    tuned = alg.load_model(alg.average(replies), torch.device("cpu"))
    alg.finetune(tuned, state["pseudo_x"], state["pseudo_y"],
                 ServerContext(3).stream(FINETUNE_STREAM))
    assert _same(state["model"], tuned.state_dict())


def test_matching_loss_falls_over_the_synthesis(fed):
    # One start/target pair and full batches: every iteration scores the same unroll. Faster
    # label and lr steps than the code's, so that 15 iterations show it.
    alg = _alg(fed, **{**SHORT, "iterations": 15, "lr_label": 0.1, "lr_lr": 1e-2,
                       "weight_averaging": False})
    state, _ = _round(alg, fed, alg.server_init(), 0)
    out = alg.synthesize(state, ServerContext(1))
    first, last = out["matching_loss"]
    assert last < 0.8 * first, (first, last)


def test_clients_get_only_weights_and_fedavgs_bytes(fed, tmp_path):
    cfg = RunConfig(method="fedavg", rounds=3, batch_size=8, lr=0.05, momentum=0.0,
                    model_args=TINY)
    base = run_experiment(cfg, out=tmp_path / "fedavg", fed=fed)
    dyn = run_experiment(dataclasses.replace(cfg, method="dynafed", method_args=SHORT),
                         out=tmp_path / "dynafed", fed=fed)
    assert dyn["bytes_by_kind"] == base["bytes_by_kind"] == {
        "weights": {"up": base["bytes_up"], "down": base["bytes_down"]}}
    # Round 0 is FedAvg's to the bit; the synthesis round (1) and the next are not.
    losses = [[json.loads(r)["per_client_loss"] for r in (tmp_path / d / "metrics.jsonl").open()]
              for d in ("fedavg", "dynafed")]
    assert losses[0][0] == losses[1][0]
    assert all(a != b for a, b in zip(losses[0][1:], losses[1][1:], strict=True))
    alg = _alg(fed, **SHORT)
    state, _ = _round(alg, fed, alg.server_init(), 0)
    state = alg.synthesize(state, ServerContext(1))
    sent = alg.configure(state, ServerContext(2), [0, 1])
    assert set(sent[0].arrays) == {"weights"} and _same(sent[0].get("weights"), state["model"])


def test_batchnorm_unroll_keeps_the_template_and_fine_tuning_refreshes_it(fed):
    alg = _alg(fed, norm="batch", **SHORT)
    model = alg.new_model().train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    start = alg.checkpoint(model.state_dict())
    x = torch.randn(4, *fed.image_shape, requires_grad=True)
    y = torch.zeros(4, fed.num_classes, requires_grad=True)
    lr = torch.tensor(0.1, requires_grad=True)
    end = unroll_sgd(model, start, x, y, lr, [torch.arange(4)] * 2)
    target = {n: v + 0.01 for n, v in start.items()}
    gx, glr = torch.autograd.grad(trajectory_matching_loss(end, start, target), [x, lr])
    assert bool(torch.isfinite(gx).all()) and gx.abs().sum() > 0 and torch.isfinite(glr)
    assert _same(dict(model.named_buffers()), before)
    alg.finetune(model, x.detach(), y.detach(), torch.Generator().manual_seed(0))
    assert not torch.equal(dict(model.named_buffers())["features.1.running_mean"],
                           before["features.1.running_mean"])


def test_resume_after_the_synthesis_keeps_the_pseudo_set(fed, tmp_path, monkeypatch):
    cfg = RunConfig(method="dynafed", method_args=SHORT, rounds=3, batch_size=8, lr=0.05,
                    momentum=0.0, model_args=TINY)
    full = run_experiment(cfg, out=tmp_path / "full", fed=fed)

    def made_in_round_1(state):   # so the resumed run must read the pseudo set back
        assert state["pseudo_x"] is not None

    resumed = resumed_after_crash(cfg, fed, tmp_path / "cut", monkeypatch,
                                  before_crash=made_in_round_1)
    for key in ("per_client_accuracy", "per_client_loss", "dynafed"):
        assert resumed[key] == full[key], key


@pytest.mark.parametrize("args, bad", [
    ({"trajectory_length": 3, "expert_rounds": 3}, "'expert_rounds' = 3"),
    ({"trajectory_length": 6, "expert_rounds": 2, "min_start": 4}, "'min_start' = 4"),
    ({"expert_rounds": 1}, "'average_min' = 2"),
])
def test_a_start_and_target_that_cannot_fit_are_one_clear_error(fed, args, bad):
    with pytest.raises(ConfigError, match=bad):
        _alg(fed, **args)


"""FedDyn: the client's linear term and the server's correction, against numbers worked out by
hand from the paper's updates (and the reference code's form, which gives the same numbers);
the client and server states a run keeps; the options it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fedvl.algorithms.base import ClientContext, Env, ServerContext, make_algorithm
from fedvl.core.message import Message
from fedvl.core.training import TrainConfig
from fedvl.models.base import FedModel
from fedvl.options import ConfigError
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation, small_cfg

W, B = "classifier.weight", "classifier.bias"


class TwoParameters(FedModel):
    """logits = w * mean(x) + b with (w, b) = (1, 2) and one class: its cross-entropy is 0 with
    zero gradient, so local SGD moves the weights by FedDyn's two terms alone."""

    def __init__(self) -> None:
        super().__init__()
        self.feature_dim, self.num_classes = 1, 1
        self.classifier = nn.Linear(1, 1)
        with torch.no_grad():
            self.classifier.weight.fill_(1.0)
            self.classifier.bias.fill_(2.0)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1).mean(1, keepdim=True)


def _pair(w: float, b: float) -> dict[str, torch.Tensor]:
    return {W: torch.tensor([[w]]), B: torch.tensor([b])}


def _close(got: dict[str, torch.Tensor], w: float, b: float) -> None:
    torch.testing.assert_close(got[W], torch.tensor([[w]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[B], torch.tensor([b]), rtol=0, atol=1e-6)


def test_two_rounds_match_the_hand_computed_updates():
    """alpha = 0.5, lr = 0.1, 2 plain SGD steps, m = 3 clients, theta = (1, 2).

    With a zero CE gradient, a step from w is w - lr (alpha (w - theta) - g_k): the first step
    gives theta + lr g_k, the second theta + lr (2 - alpha lr) g_k = theta + 0.195 g_k.
    Round 0, clients 0 and 1, g_0 = (0.2, -0.4), g_1 = (-0.6, 0), g_2 = (0.1, 0.1) and
    h = (g_0 + g_1 + g_2) / 3 = (-0.1, -0.1) (h = mean_k g_k holds from the zero start):
      theta_0 = (1.039, 1.922), theta_1 = (0.883, 2.0)
      g_0 <- g_0 - 0.5 (0.039, -0.078) = (0.1805, -0.361);  g_1 <- (-0.5415, 0)
      h <- h - (0.5 / 3) ((0.039, -0.078) + (-0.117, 0)) = (-0.087, -0.087)
      theta <- mean(theta_0, theta_1) - h / 0.5 = (0.961, 1.961) + (0.174, 0.174)
             = (1.135, 2.135)
    (The reference code's form: a_k = -g_k / alpha, a_k += theta_k - theta, theta = mean of
    the participants + mean of all m a_k = (0.961, 1.961) + (0.522, 0.522) / 3: the same.)
    Round 1, client 0 alone: theta_0 = (1.135, 2.135) + 0.195 (0.1805, -0.361)
      = (1.1701975, 2.064605); h <- h - (0.5 / 3) (0.0351975, -0.070395)
      = (-0.09286625, -0.0752675); theta <- theta_0 - h / 0.5 = (1.35593, 2.21514).
    """
    env = Env(model_fn=lambda num_classes=None, seed=None: TwoParameters(), num_classes=1,
              num_clients=3, train=TrainConfig(lr=0.1, momentum=0.0, local_steps=2,
                                               batch_size=4))
    alg = make_algorithm("feddyn", env, {"alpha_coef": 0.5})
    state = alg.server_init()
    assert set(state["h"]) == {W, B}
    state["h"] = _pair(-0.1, -0.1)
    states = {0: Message({"gradients": _pair(0.2, -0.4)}),
              1: Message({"gradients": _pair(-0.6, 0.0)})}

    def update(rnd: int, clients: list[int]) -> dict[int, Message]:
        msgs = alg.configure(state, ServerContext(rnd), clients)
        out = {}
        for k in clients:
            ctx = ClientContext(k, f"c{k}", torch.randn(4, 3, 2, 2),
                                torch.zeros(4, dtype=torch.long), 1, states[k],
                                torch.Generator().manual_seed(k), rnd)
            out[k] = alg.client_update(msgs[k], ctx)
        return out

    replies = update(0, [0, 1])
    _close(replies[0].get("weights"), 1.039, 1.922)
    _close(replies[1].get("weights"), 0.883, 2.0)
    _close(states[0].get("gradients"), 0.1805, -0.361)
    _close(states[1].get("gradients"), -0.5415, 0.0)
    state = alg.aggregate(state, ServerContext(0), replies)
    _close(state["h"], -0.087, -0.087)
    _close(state["model"], 1.135, 2.135)
    _close(alg.global_model(state).state_dict(), 1.135, 2.135)   # the served model

    replies = update(1, [0])
    _close(replies[0].get("weights"), 1.1701975, 2.064605)
    state = alg.aggregate(state, ServerContext(1), replies)
    _close(state["h"], -0.09286625, -0.0752675)
    _close(state["model"], 1.35593, 2.21514)


def test_a_run_keeps_h_equal_to_the_mean_of_every_client_state(tmp_path):
    # Sampled clients (2 of 3 per round) on a ConvNet: the server's h and the clients' g_k
    # are kept apart (the checkpoint holds both), yet h = (1/m) sum over all m clients of g_k.
    fed = make_toy_federation(num_clients=3, n_train=24, n_test=12)
    cfg = dataclasses.replace(small_cfg("feddyn", rounds=3), method_args={"alpha_coef": 0.1})
    run_experiment(cfg, out=tmp_path / "r", fed=fed)
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    h = ck["server_state"]["h"]
    grads = [arrays["gradients"] for arrays, _ in ck["client_states"].values()
             if "gradients" in arrays]
    assert 2 <= len(grads) <= 3
    for name, hn in h.items():
        assert hn.abs().max() > 0, name
        torch.testing.assert_close(hn, sum(g[name] for g in grads) / 3, rtol=1e-4, atol=1e-7)


def test_robust_rules_are_refused():
    env = Env(model_fn=lambda num_classes=None, seed=None: TwoParameters(), num_classes=1,
              num_clients=3, train=TrainConfig(), aggregation="median")
    with pytest.raises(ConfigError, match="method 'feddyn' does not average client models"):
        make_algorithm("feddyn", env)
    with pytest.raises(ConfigError, match=r"option 'alpha_coef' = 0.0 is invalid; must be > 0"):
        make_algorithm("feddyn", dataclasses.replace(env, aggregation="samples"),
                       {"alpha_coef": 0})


def test_max_grad_norm_clips_each_step_as_the_reference_code():
    """alpha = 0.5, lr = 0.1, one step from theta = (1, 2) with g_0 = (3, -4): the step's
    gradient is -g_0 (the proximal term is 0 at theta), norm 5. Clipped to 1 it is (-0.6, 0.8),
    so theta_0 = (1.06, 1.92); unclipped theta_0 = theta + 0.1 g_0 = (1.3, 1.6)."""
    env = Env(model_fn=lambda num_classes=None, seed=None: TwoParameters(), num_classes=1,
              num_clients=1, train=TrainConfig(lr=0.1, momentum=0.0, local_steps=1,
                                               batch_size=4))
    for args, want in (({"max_grad_norm": 1.0}, (1.06, 1.92)), ({}, (1.3, 1.6))):
        alg = make_algorithm("feddyn", env, {"alpha_coef": 0.5, **args})
        state = alg.server_init()
        msg = alg.configure(state, ServerContext(0), [0])[0]
        ctx = ClientContext(0, "c0", torch.randn(4, 3, 2, 2), torch.zeros(4, dtype=torch.long),
                            1, Message({"gradients": _pair(3.0, -4.0)}),
                            torch.Generator().manual_seed(0), 0)
        _close(alg.client_update(msg, ctx).get("weights"), *want)
    with pytest.raises(ConfigError, match="max_grad_norm > 0 cannot run with dp_noise > 0"):
        make_algorithm("feddyn", env, {"max_grad_norm": 10.0, "dp_noise": 1.0})

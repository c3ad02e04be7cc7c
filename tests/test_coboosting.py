"""Co-Boosting: its own terms against numbers worked out by hand from the official code
(rong-dai/Co-Boosting `datafree/synthesis/coboost.py`: the hard-sample CE, the adversarial
term, the ensemble re-weighting; `datafree_kd.py` `cb_kd_train`: the perturbation), and one
server round.

DENSE's generator, BN-statistics prior and distillation loss are tested in tests/test_dense.py;
the malformed uploads the server refuses are cases of tests/test_tampered_replies.py; the
conformance matrices (declared kinds, resume, workers, private data) cover it by registration.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedvl.algorithms.base import ServerContext, make_algorithm
from fedvl.algorithms.coboosting import (
    adversarial_loss,
    generator_loss,
    hard_sample_ce,
    mixing_weights,
    ods_perturb,
    weight_step,
)
from fedvl.algorithms.dense import Ensemble
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation, small_args

TINY = {"width": 8, "depth": 2, "norm": "instance"}
LN3 = math.log(3)


class Fixed(nn.Module):
    """A client model whose logits are the same row for every input."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = torch.tensor([logits])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(len(x), -1)


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=16, n_test=8)


def _cfg(**kw) -> RunConfig:
    base = {"method": "coboosting", "method_args": small_args("coboosting"), "rounds": 1,
            "batch_size": 8, "lr": 0.05, "momentum": 0.0, "model_args": TINY}
    return RunConfig(**{**base, **kw})


# -- the hard-sample objective, by hand -----------------------------------------------------------
def test_hard_sample_ce_weighs_each_sample_by_how_far_the_ensemble_is_from_its_label():
    # Row 0: softmax (3/4, 1/4), label 0: p = 3/4, CE = ln(4/3), factor 1/4. Row 1: softmax
    # (1/2, 1/2), label 1: p = 1/2, CE = ln 2, factor 1/2. power 2 squares the factors.
    logits = torch.tensor([[LN3, 0.0], [0.0, 0.0]], requires_grad=True)
    y = torch.tensor([0, 1])
    got = hard_sample_ce(logits, y, 1.0)
    assert got.item() == pytest.approx((math.log(4 / 3) / 4 + math.log(2) / 2) / 2, rel=1e-6)
    assert hard_sample_ce(logits, y, 2.0).item() == pytest.approx(
        (math.log(4 / 3) / 16 + math.log(2) / 4) / 2, rel=1e-6)
    assert hard_sample_ce(logits, y, 0.0).item() == pytest.approx(
        (math.log(4 / 3) + math.log(2)) / 2, rel=1e-6)
    # The factor carries no gradient: d/dlogits = factor * (softmax - onehot) / 2.
    got.backward()
    want = torch.tensor([[0.25 * -0.25, 0.25 * 0.25], [0.5 * 0.5, 0.5 * -0.5]]) / 2
    assert torch.allclose(logits.grad, want, atol=1e-7)


def test_adversarial_term_is_minus_t_squared_kl_over_every_sample():
    # T = 3. Row 0: teacher / 3 = (ln 3, 0) -> (3/4, 1/4), student / 3 = (0, ln 3) -> (1/4, 3/4):
    # KL = ln(3) / 2. Row 1 agrees on the argmax and still counts (no mask, unlike DENSE):
    # student / 3 = (ln 2, 0) -> (2/3, 1/3): KL = 3/4 ln(9/8) + 1/4 ln(3/4).
    t = torch.tensor([[3 * LN3, 0.0], [3 * LN3, 0.0]])
    s = torch.tensor([[0.0, 3 * LN3], [3 * math.log(2), 0.0]])
    row1 = 0.75 * math.log(9 / 8) + 0.25 * math.log(0.75)
    want = -9 * (LN3 / 2 + row1) / 2
    assert adversarial_loss(s, t, 3.0).item() == pytest.approx(want, rel=1e-5)


def test_generator_loss_weighs_bn_hard_ce_and_adversarial_terms():
    # Ensemble logits (ln 3, 0), label 0: hard CE = ln(4/3) / 4; student (0, ln 3) at T = 1:
    # KL = ln(3) / 2. Total = 0.5 * 2 + 2 * hard + 3 * (-KL).
    t = torch.tensor([[LN3, 0.0]])
    s = torch.tensor([[0.0, LN3]])
    out = generator_loss(t, s, torch.tensor([0]), torch.tensor(2.0), 0.5, 2.0, 3.0, 1.0, 1.0)
    assert out.oh.item() == pytest.approx(math.log(4 / 3) / 4, rel=1e-6)
    assert out.adv.item() == pytest.approx(-LN3 / 2, rel=1e-5)
    want = 0.5 * 2 + 2 * math.log(4 / 3) / 4 - 3 * LN3 / 2
    assert out.total.item() == pytest.approx(want, rel=1e-5)
    assert generator_loss(t, None, torch.tensor([0]), torch.tensor(0.0), 0, 1, 0, 1, 3).adv == 0


# -- the ensemble re-weighting, by hand -----------------------------------------------------------
def test_weighted_ensemble_is_the_normalised_weighted_mean_of_the_logits():
    teacher = Ensemble([Fixed([2.0, 0.0]), Fixed([0.0, 2.0])])
    x = torch.zeros(3, 1)
    # (1/4 (2, 0) + 3/4 (0, 2)) / 1 = (0.5, 1.5); weights (0.1, 0.3) mix the same.
    for w in ([0.25, 0.75], [0.1, 0.3]):
        got = teacher(x, mixing_weights(torch.tensor(w), 3))
        assert torch.allclose(got, torch.tensor([[0.5, 1.5]] * 3))


def test_weight_step_moves_each_weight_by_the_sign_of_its_gradient():
    # Members (2, 0) and (0, 2), w = (1/2, 1/2): D = (1, 1), S = 1, label 0:
    # dCE/dD = softmax(D) - e_0 = (-1/2, 1/2); dD/dw_1 = (f_1 - D) / S = (1, -1) -> dCE/dw_1 = -1,
    # dD/dw_2 = (-1, 1) -> dCE/dw_2 = +1: w_1 grows by the step, w_2 shrinks by it.
    teacher = Ensemble([Fixed([2.0, 0.0]), Fixed([0.0, 2.0])])
    x, y = torch.zeros(2, 1), torch.tensor([0, 0])
    w = torch.tensor([0.5, 0.5])
    assert torch.allclose(weight_step(teacher, x, y, w, w, 0.1), torch.tensor([0.6, 0.4]))
    # The same signs from (0.95, 0.05) (D = (1.9, 0.1)); the step leaves [0, 1] both ways and
    # is clipped back to it.
    w = torch.tensor([0.95, 0.05])
    assert torch.equal(weight_step(teacher, x, y, w, w, 0.1), torch.tensor([1.0, 0.0]))
    # A label the second member favours turns both signs round.
    y1 = torch.tensor([1, 1])
    w = torch.tensor([0.5, 0.5])
    assert torch.allclose(weight_step(teacher, x, y1, w, w, 0.1), torch.tensor([0.4, 0.6]))


def test_perturbation_is_a_signed_step_along_the_random_output_weights():
    # One member D(x) = x (identity on 2 features): sum_j r_j softmax(x / 4)_j with r = (1, -1)
    # is tanh((x_0 - x_1) / 8), increasing in x_0, decreasing in x_1: x moves by (+eps, -eps).
    member = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        member.weight.copy_(torch.eye(2))
    teacher = Ensemble([member.requires_grad_(False)])
    x = torch.tensor([[0.3, 0.1]])
    out = ods_perturb(teacher, mixing_weights(torch.ones(1), 1), x, 0.5,
                      torch.tensor([[1.0, -1.0]]))
    assert torch.allclose(out, torch.tensor([[0.8, -0.4]]))
    assert not out.requires_grad


# -- one server round -----------------------------------------------------------------------------
def _round(fed, **args) -> dict:
    cfg = _cfg(method_args={**small_args("coboosting"), **args})
    alg = make_algorithm("coboosting", build_env(cfg, fed, torch.device("cpu")), cfg.method_args)
    g = torch.Generator().manual_seed(0)
    # Three different teachers (identical ones give every weight a zero gradient).
    replies = {c: Message({"weights": {k: v + c * torch.randn(v.shape, generator=g)
                                       if v.is_floating_point() else v
                                       for k, v in alg.client_new_model(c).state_dict().items()}})
               for c in range(3)}
    return alg.aggregate(alg.server_init(), ServerContext(round=0), replies)["log"]


def test_reweighting_starts_in_the_second_epoch_with_the_decayed_step(fed):
    # One epoch: the pool is empty when the weights could move, so they stay 1/3. Two epochs:
    # one batch (kd_batch 4 = the pool of 4), a step of 0.01 * 0.99 up or down (0: a zero
    # gradient). weight_lr 0: the plain mean throughout.
    uniform = pytest.approx([1 / 3] * 3)
    assert list(_round(fed, server_epochs=1)["ensemble_weights"].values()) == uniform
    log = _round(fed)
    moves = sorted(abs(v - 1 / 3) for v in log["ensemble_weights"].values())
    assert all(m == pytest.approx(0.0099, abs=1e-6) or m < 1e-6 for m in moves), moves
    assert moves[-1] == pytest.approx(0.0099, abs=1e-6)
    assert log["pool_images"] == 2 * small_args("coboosting")["syn_batch"]
    assert list(_round(fed, weight_lr=0.0)["ensemble_weights"].values()) == uniform


def test_a_run_uploads_once_sends_nothing_down_and_reports_its_weights(fed, tmp_path):
    s = run_experiment(_cfg(), out=tmp_path / "r", fed=fed)
    assert s["bytes_by_kind"]["weights"]["down"] == 0
    assert s["coboosting"]["teachers"] == 3 and s["coboosting"]["bn_layers"] == 0
    assert set(s["coboosting"]["ensemble_weights"]) == {"0", "1", "2"}
    assert (tmp_path / "r" / "coboosting_generated.png").is_file()
    assert all(0.0 <= a <= 1.0 for a in s["per_client_accuracy"].values())

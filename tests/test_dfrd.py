"""DFRD pins: its own generator terms (transferability, the l2 diversity) and the weighted
ensemble checked by hand on tiny tensors, the EMA update of the generator's copy, the per-class
client weights and the label draws from the counts, and one server round: FedAvg's average,
then distilled, the EMA copy made after round 0 and averaged after round 1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.algorithms.dense import Ensemble
from fedvl.algorithms.dfrd import (
    class_weights,
    ema_update,
    generator_loss,
    transferability_loss,
)
from fedvl.algorithms.fedgen import diversity_loss, draw_labels
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.core.params import weighted_average
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from tests.conftest import make_toy_federation

TINY = {"width": 8, "depth": 2, "norm": "instance"}
SMALL = {"server_iters": 1, "gen_steps": 2, "kd_steps": 1, "batch": 4, "noise_dim": 8,
         "ngf": 4}


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=16, n_test=8)


def _alg(fed, **args):
    cfg = RunConfig(method="dfrd", batch_size=8, lr=0.05, momentum=0.0, model_args=TINY)
    return make_algorithm("dfrd", build_env(cfg, fed, torch.device("cpu")), {**SMALL, **args})


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (p / q).log()).sum()


def test_transferability_averages_kl_over_rows_the_ensemble_gets_right_and_global_wrong():
    # Rows: ensemble right & global wrong (in M), both right, ensemble wrong & global wrong.
    e = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0]], requires_grad=True)
    g = torch.tensor([[0.0, 1.0], [0.0, 2.0], [2.0, 0.0]], requires_grad=True)
    y = torch.tensor([0, 1, 1])
    t = 2.0
    want = -_kl(F.softmax(g[0] / t, 0), F.softmax(e[0] / t, 0))   # M = {0}: mean over 1 row
    loss = transferability_loss(e, g, y, t)
    assert torch.isclose(loss, want)
    loss.backward()
    assert g.grad is None and e.grad is not None and e.grad[1:].abs().sum() == 0
    # No row in M: 0, not NaN.
    assert transferability_loss(e.detach(), g.detach(), torch.tensor([1, 0, 1]), t) == 0


def test_generator_loss_is_fidelity_ce_plus_weighted_terms_and_l2_diversity_by_hand():
    e, g, y = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([0])
    # Two samples: noise distance mean((1-0)^2, (0-2)^2) = 2.5, image distance
    # mean((0-3)^2) = 9; the mean over the 2x2 pairs (diagonal 0) halves the product.
    h, x = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[[[0.0]]], [[[3.0]]]])
    div = math.exp(-2.5 * 9 / 2)
    parts = generator_loss(e, g, y, h, x, 1.0, 0.5, 2.0)
    assert torch.isclose(parts.fidelity, F.cross_entropy(e, y))
    assert torch.isclose(parts.transfer, -_kl(F.softmax(g[0], 0), F.softmax(e[0], 0)))
    assert torch.isclose(parts.diversity, torch.tensor(div))
    assert torch.isclose(parts.total, parts.fidelity + 0.5 * parts.transfer + 2.0 * div)
    off = generator_loss(e, None, y, h, x, 1.0, 0.5, 0.0)
    assert off.transfer == 0 and off.diversity == 0 and torch.isclose(off.total, off.fidelity)
    # The l2 distance by one matrix product equals the pairwise definition.
    z, im = torch.randn(5, 3), torch.randn(5, 7)
    pair = (im[:, None] - im[None]).pow(2).mean(2) * (z[:, None] - z[None]).pow(2).mean(2)
    assert torch.isclose(diversity_loss(z, im, "l2"), torch.exp(-pair.mean()), rtol=1e-5)
    with pytest.raises(ValueError, match="allowed: l1, l2"):
        diversity_loss(z, im, "cos")


def test_weighted_ensemble_sums_each_members_logits_times_its_weight():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    x = torch.randn(3, 2)
    w = torch.tensor([[1.0, 0.25, 0.0], [0.0, 0.75, 1.0]])   # members x samples
    ens = Ensemble([a, b])
    want = torch.stack([w[0, i] * a(x[i]) + w[1, i] * b(x[i]) for i in range(3)])
    assert torch.allclose(ens(x, w), want)
    assert torch.allclose(ens(x), (a(x) + b(x)) / 2)   # DENSE's plain mean unchanged


def test_ema_copy_starts_as_the_generator_then_averages_floats_only():
    first = {"w": torch.tensor([2.0, 4.0]), "bn.num_batches_tracked": torch.tensor(3)}
    assert all(torch.equal(ema_update(None, first, 0.9)[k], first[k]) for k in first)
    later = {"w": torch.tensor([0.0, 8.0]), "bn.num_batches_tracked": torch.tensor(7)}
    ema = ema_update(first, later, 0.75)
    assert torch.allclose(ema["w"], torch.tensor([0.75 * 2.0, 0.75 * 4 + 0.25 * 8]))
    assert ema["bn.num_batches_tracked"] == 7


def test_class_weights_are_each_clients_share_and_labels_follow_the_counts():
    counts = torch.tensor([[3.0, 0.0, 1.0], [1.0, 0.0, 3.0]])   # clients x classes
    assert torch.allclose(class_weights(counts, "counts"),
                          torch.tensor([[0.75, 0.25], [0.0, 0.0], [0.25, 0.75]]))
    assert torch.allclose(class_weights(counts, "uniform"), torch.full((3, 2), 0.5))
    g = torch.Generator().manual_seed(0)
    y = draw_labels(torch.tensor([4.0, 0.0, 12.0]), 4000, "prior", g, torch.device("cpu"))
    share = torch.bincount(y, minlength=3).float() / 4000
    assert share[1] == 0 and abs(float(share[2]) - 0.75) < 0.03


def test_a_round_distils_the_fedavg_average_and_keeps_an_ema_copy(fed):
    alg = _alg(fed)
    state = alg.server_init()
    assert state["ema"] is None
    for rnd in range(2):
        sent = alg.configure(state, ServerContext(rnd), [0, 1])
        replies = {k: alg.client_update(sent[k].copy(), ClientContext(
            k, fed.clients[k].name, fed.clients[k].x_train, fed.clients[k].y_train,
            fed.num_classes, Message(), torch.Generator().manual_seed(k), rnd))
            for k in (0, 1)}
        counts = replies[0].get("statistics")["label_counts"]
        assert torch.equal(counts, torch.bincount(fed.clients[0].y_train, minlength=4).float())
        avg = weighted_average([r.get("weights") for r in replies.values()], [16.0, 16.0])
        before = state
        state = alg.aggregate(state, ServerContext(rnd), replies)
        # The distilled global model starts from FedAvg's average and moves away from it.
        assert any(not torch.equal(state["model"][n], avg[n]) for n in avg
                   if avg[n].is_floating_point())
        assert state["log"]["ema_samples"] is (rnd == 1)
        gen = state["generator"]
        if rnd == 0:
            assert all(torch.equal(state["ema"][n], gen[n]) for n in gen)
        else:
            n = "embedding.weight"
            assert torch.allclose(state["ema"][n], 0.5 * before["ema"][n] + 0.5 * gen[n])
    # No distillation: FedAvg's average exactly.
    plain = _alg(fed, server_iters=0)
    s0 = plain.server_init()
    out = plain.aggregate(s0, ServerContext(0), replies)
    assert all(torch.equal(out["model"][n], avg[n]) for n in avg)
    assert out["log"] is None and out["ema"] is None


def test_bad_option_is_one_clear_error(fed):
    with pytest.raises(ConfigError, match="weighting"):
        _alg(fed, weighting="by-size")
    with pytest.raises(ConfigError, match="ema_decay"):
        _alg(fed, ema_decay=1.5)

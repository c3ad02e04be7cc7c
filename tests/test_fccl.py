"""FCCL pins: the cross-correlation loss and the non-forgetting distillation against by-hand
computations of their formulas, the pretraining schedule, and which model each teacher is."""

from __future__ import annotations

import math

import pytest
import torch

from fedvl.algorithms import fccl
from fedvl.algorithms.base import ClientContext, make_algorithm
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.models.base import build_model
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from tests.conftest import TINY_MODEL, make_toy_federation


def _by_hand_loss(own: list[list[float]], target: list[list[float]], w: float) -> float:
    """sum_i (C_ii - 1)^2 + w sum_{i != j} (C_ij + 1)^2 with plain loops: each column
    standardised by its batch mean and unbiased std, C_ij = sum_b a_bi t_bj / B."""
    b, c = len(own), len(own[0])

    def standardised(z: list[list[float]]) -> list[list[float]]:
        cols = []
        for j in range(c):
            col = [z[r][j] for r in range(b)]
            mean = sum(col) / b
            std = math.sqrt(sum((v - mean) ** 2 for v in col) / (b - 1))
            cols.append([(v - mean) / std for v in col])
        return [[cols[j][r] for j in range(c)] for r in range(b)]

    a, t = standardised(own), standardised(target)
    loss = 0.0
    for i in range(c):
        for j in range(c):
            cij = sum(a[r][i] * t[r][j] for r in range(b)) / b
            loss += (cij - 1) ** 2 if i == j else w * (cij + 1) ** 2
    return loss


def test_cross_correlation_loss_is_the_formula():
    g = torch.Generator().manual_seed(0)
    own = torch.randn(5, 3, generator=g, dtype=torch.float64)
    target = torch.randn(5, 3, generator=g, dtype=torch.float64)
    for w in (0.0051, 1.0):
        got = fccl.cross_correlation_loss(own, target, w)
        assert float(got) == pytest.approx(_by_hand_loss(own.tolist(), target.tolist(), w),
                                           rel=1e-12)
    # The off-diagonal term pulls C_ij toward -1 (the code's `add_(1)`), not toward 0: with
    # identical logits (C_ii = (B-1)/B under the unbiased std) it is the only part left that a
    # weight of 1 can make large.
    same = fccl.cross_correlation_loss(own, own, 0.0)
    assert float(same) == pytest.approx(3 * (1 / 5) ** 2, rel=1e-12)


def test_cross_correlation_gradient_reaches_only_the_own_logits():
    own = torch.randn(6, 4, requires_grad=True)
    target = torch.randn(6, 4, requires_grad=True)
    fccl.cross_correlation_loss(own, target.detach(), 0.0051).backward()
    assert own.grad is not None and own.grad.abs().sum() > 0 and target.grad is None
    # A constant column standardises to zero instead of 0/0.
    flat = torch.cat([torch.ones(6, 1), torch.randn(6, 3)], 1)
    assert torch.isfinite(fccl.cross_correlation_loss(flat, target.detach(), 0.0051))


def _softmax(row: list[float]) -> list[float]:
    e = [math.exp(v) for v in row]
    return [v / sum(e) for v in e]


def test_non_forgetting_term_is_two_batch_mean_kls_from_the_teachers():
    x = make_toy_federation(num_clients=1, n_train=4, n_test=1).clients[0].x_train
    intra, inter, student = (build_model("convnet", 3, 4, 8, seed=s, **TINY_MODEL)
                             for s in (1, 2, 3))
    logits = student(x)
    term = fccl.NonForgettingTerm(intra, inter)
    got = term(student, x, torch.zeros(4, dtype=torch.long), torch.zeros(4, 1), logits)
    want = 0.0
    with torch.no_grad():
        for teacher in (intra, inter):
            for row_t, row_s in zip(teacher(x).tolist(), logits.tolist(), strict=True):
                p, q = _softmax(row_t), _softmax(row_s)
                want += sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q,
                                                                                 strict=True)) / 4
    assert float(got.detach()) == pytest.approx(want, rel=1e-5)
    got.backward()
    assert all(p.grad is None for t in (intra, inter) for p in t.parameters())
    assert not intra.training and not inter.training


def test_pretraining_follows_the_reference_cosine_one_epoch_late():
    lr, lo = 1e-3, fccl.PRETRAIN_LR_MIN
    assert fccl.cosine_lr(lr, 0, 50) == fccl.cosine_lr(lr, 1, 50) == pytest.approx(lr)
    assert fccl.cosine_lr(lr, 26, 50) == pytest.approx(lo + 0.5 * (lr - lo))
    # The last epoch (49) trains at t = 48: the floor is never reached.
    last = lo + 0.5 * (lr - lo) * (1 + math.cos(math.pi * 48 / 50))
    assert fccl.cosine_lr(lr, 49, 50) == pytest.approx(last) and last > lo


def _env(**kw):
    fed = make_toy_federation(num_clients=2, n_train=16, n_test=4)
    cfg = RunConfig(method="fccl", rounds=2, batch_size=8, model_args=TINY_MODEL, **kw)
    return fed, build_env(cfg, fed, torch.device("cpu"))


def test_fccl_needs_a_public_set():
    _, env = _env()
    with pytest.raises(ConfigError, match="'fccl' needs an unlabelled public set: --public"):
        make_algorithm("fccl", env, {})


def test_teachers_are_the_pretrained_model_and_the_model_before_the_round(monkeypatch):
    fed, env = _env(public="digits-offline", public_size=12)
    alg = make_algorithm("fccl", env, {"public_batch": 6, "pretrain_epochs": 2})
    seen: list[tuple[dict, dict]] = []
    real = fccl.NonForgettingTerm.__init__

    def spy(self, intra, inter):
        seen.append(({k: v.clone() for k, v in intra.state_dict().items()},
                     {k: v.clone() for k, v in inter.state_dict().items()}))
        real(self, intra, inter)

    monkeypatch.setattr(fccl.NonForgettingTerm, "__init__", spy)
    moved: list[bool] = []
    collaborate = alg._collaborate

    def spy_collaborate(model, x, target, gen):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        collaborate(model, x, target, gen)
        moved.append(any(not torch.equal(before[k], v) for k, v in model.state_dict().items()))

    monkeypatch.setattr(alg, "_collaborate", spy_collaborate)
    c = fed.clients[0]
    ctx = ClientContext(cid=0, name=c.name, x=c.x_train, y=c.y_train, num_classes=4,
                        state=Message(), generator=torch.Generator().manual_seed(0), round=0)
    first = alg.client_update(Message(), ctx)
    fresh = alg.client_new_model(0).state_dict()
    intra0, inter0 = seen[0]
    # Round 0: both teachers are the pretrained model, which differs from the initialisation.
    assert all(torch.equal(intra0[k], inter0[k]) for k in intra0)
    assert any(not torch.equal(intra0[k], fresh[k]) for k in intra0)
    own, kept = fccl.split_state(ctx.state.arrays["weights"])
    assert all(torch.equal(kept[k], intra0[k]) for k in intra0)

    ctx.generator, ctx.round = torch.Generator().manual_seed(1), 1
    alg.client_update(Message({"logits": {"public": first.arrays["logits"]["public"]}}), ctx)
    intra1, inter1 = seen[1]
    # Round 1: the intra teacher is still the pretrained model; the inter teacher is the model
    # the client ended round 0 with, before this round's collaborative step.
    assert all(torch.equal(intra1[k], intra0[k]) for k in intra0)
    assert all(torch.equal(inter1[k], own[k]) for k in own)
    # The collaborative step ran in round 1 only (round 0 had no mean logits) and moved the model.
    assert len(moved) == 1 and moved[0]
    after, kept1 = fccl.split_state(ctx.state.arrays["weights"])
    assert all(torch.equal(kept1[k], intra0[k]) for k in intra0)
    assert any(not torch.equal(after[k], own[k]) for k in own)
    assert first.arrays["logits"]["public"].shape == (12, 4)

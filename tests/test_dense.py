"""DENSE: its generator losses against numbers worked out by hand from the official code's
equations (zj-jayzhang/DENSE `helpers/utils.py` DeepInversionHook, kldiv; `helpers/
synthesizers.py` AdvSynthesizer), its generator, and what travels in a run.

The malformed uploads DENSE's server refuses are cases of tests/test_tampered_replies.py; the
conformance matrices (declared kinds, resume, workers, private data) cover it by registration.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from fedvl.algorithms.base import ServerContext, make_algorithm
from fedvl.algorithms.dense import (
    BatchNormPrior,
    Ensemble,
    ImageGenerator,
    adversarial_loss,
    bn_statistics_loss,
    generator_loss,
    kd_loss,
)
from fedvl.config import ConfigError, RunConfig
from fedvl.core.message import Message
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation, small_args

TINY = {"width": 8, "depth": 2, "norm": "batch"}


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=16, n_test=8)


def _cfg(**kw) -> RunConfig:
    base = {"method": "dense", "method_args": small_args("dense"), "rounds": 1,
            "batch_size": 8, "lr": 0.05, "momentum": 0.0, "model_args": TINY}
    return RunConfig(**{**base, **kw})


def _bn(mean: list[float], var: list[float]) -> nn.BatchNorm2d:
    """A BatchNorm layer in eval mode with these running statistics, eps 0, gamma 1, beta 0."""
    bn = nn.BatchNorm2d(len(mean), eps=0.0)
    bn.running_mean.copy_(torch.tensor(mean))
    bn.running_var.copy_(torch.tensor(var))
    return bn.eval()


# -- the generator's losses, by hand ---------------------------------------------------------------
def test_bn_statistics_term_of_one_layer():
    # Channel 0 holds 1, 3, 5, 7: mean 4, biased variance (9 + 1 + 1 + 9) / 4 = 5; channel 1
    # holds 0, 0, 2, 2: mean 1, variance 1. Running mean (0.5, -1), running variance (2, 1):
    # ||(2 - 5, 1 - 1)|| + ||(0.5 - 4, -1 - 1)|| = 3 + sqrt(12.25 + 4).
    x = torch.tensor([[[[1.0, 3.0]], [[0.0, 0.0]]], [[[5.0, 7.0]], [[2.0, 2.0]]]])
    got = bn_statistics_loss(_bn([0.5, -1.0], [2.0, 1.0]), x)
    assert got.item() == pytest.approx(3 + math.sqrt(16.25), rel=1e-5)


def test_bn_prior_sums_each_layer_of_each_model_on_that_layers_input():
    # Model A: two BatchNorm layers in a row; model B: one; model C: none (GroupNorm).
    # x = 1, 2, 3, 6: mean 3, variance 3.5.
    #   A.0 (mean 1, var 4): |4 - 3.5| + |1 - 3| = 2.5; its output (x - 1) / 2 = 0, .5, 1, 2.5
    #       has mean 1, variance 0.875;
    #   A.1 (mean 0, var 1): |1 - 0.875| + |0 - 1| = 1.125;
    #   B.0 (mean 2, var 2): |2 - 3.5| + |2 - 3| = 2.5.
    a = nn.Sequential(_bn([1.0], [4.0]), _bn([0.0], [1.0]))
    b = nn.Sequential(_bn([2.0], [2.0]))
    c = nn.Sequential(nn.GroupNorm(1, 1))
    x = torch.tensor([1.0, 2.0, 3.0, 6.0]).view(4, 1, 1, 1)
    prior = BatchNormPrior([a, b, c])
    assert len(prior.layers) == 3
    with prior.hooked():
        for m in (a, b, c):
            m(x)
        assert prior.loss().item() == pytest.approx(2.5 + 1.125 + 2.5, rel=1e-5)
    prior.terms.clear()
    a(x + 1)   # hooks are gone after the block
    assert prior.loss().item() == 0.0


def test_adversarial_term_counts_only_disagreements():
    # Row 0 agrees (both argmax 0): no term. Row 1: student softmax (1/4, 3/4), teacher
    # (3/4, 1/4): KL = 3/4 ln 3 - 1/4 ln 3 = ln(3) / 2. Row 2: student (1/5, 4/5), teacher
    # (2/3, 1/3): KL = 2/3 ln((2/3) / (1/5)) + 1/3 ln((1/3) / (4/5)). Mean over all 3 rows,
    # negated.
    s = torch.tensor([[1.0, 0.0], [0.0, math.log(3)], [0.0, math.log(4)]])
    t = torch.tensor([[2.0, 0.0], [math.log(3), 0.0], [math.log(2), 0.0]])
    row2 = 2 / 3 * math.log(10 / 3) + 1 / 3 * math.log(5 / 12)
    want = -(math.log(3) / 2 + row2) / 3
    assert adversarial_loss(s, t).item() == pytest.approx(want, rel=1e-5)


def test_generator_loss_weighs_ce_of_the_mean_logits_bn_and_adversarial_terms():
    class Fixed(nn.Module):
        def __init__(self, logits: list[float]) -> None:
            super().__init__()
            self.logits = torch.tensor([logits])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.logits.expand(len(x), -1)

    # Clients' logits (2 ln 3, 1) and (0, -1): the ensemble's mean is (ln 3, 0), softmax
    # (3/4, 1/4): CE toward label 0 = -ln(3/4). The student (0, ln 3) disagrees: L_adv =
    # -ln(3) / 2 (as above). Total = 0.5 * 2 + 2 * CE + 3 * L_adv.
    teacher = Ensemble([Fixed([2 * math.log(3), 1.0]), Fixed([0.0, -1.0])])
    t = teacher(torch.zeros(1, 1))
    s = torch.tensor([[0.0, math.log(3)]])
    out = generator_loss(t, s, torch.tensor([0]), torch.tensor(2.0), 0.5, 2.0, 3.0)
    assert out.oh.item() == pytest.approx(-math.log(0.75), rel=1e-5)
    assert out.adv.item() == pytest.approx(-math.log(3) / 2, rel=1e-5)
    want = 0.5 * 2 + 2 * -math.log(0.75) + 3 * -math.log(3) / 2
    assert out.total.item() == pytest.approx(want, rel=1e-5)
    # Without a student (adv_weight 0) the term is absent, not computed.
    assert generator_loss(t, None, torch.tensor([0]), torch.tensor(0.0), 1, 1, 0).adv == 0


def test_distillation_loss_is_t_squared_kl_per_sample():
    # T = 2: teacher (2 ln 3, 0) / 2 -> softmax (3/4, 1/4); student (0, 0) -> (1/2, 1/2).
    # KL = 3/4 ln(3/2) + 1/4 ln(1/2); twice the same row: the batch mean is that KL; x T^2 = 4.
    s = torch.zeros(2, 2)
    t = torch.tensor([[2 * math.log(3), 0.0]] * 2)
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert kd_loss(s, t, 2.0).item() == pytest.approx(4 * kl, rel=1e-5)


def test_generator_is_the_codes_at_its_size_and_draws_pixels():
    # models/generator.py with nz 256, ngf 64, 32 px, 3 channels: 2,328,899 parameters.
    gen = ImageGenerator(256, 64, (3, 32, 32))
    assert sum(p.numel() for p in gen.parameters()) == 2_328_899
    x = ImageGenerator(8, 4, (1, 28, 28))(torch.randn(5, 8))
    assert x.shape == (5, 1, 28, 28) and 0 <= x.min() and x.max() <= 1


# -- what travels ---------------------------------------------------------------------------------
def _state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_mixed_architectures_upload_only_their_own_weights_and_nothing_comes_down(fed, tmp_path):
    cfg = _cfg(client_models=["convnet", "alexnet"])   # convnet, alexnet, convnet
    s = run_experiment(cfg, out=tmp_path / "r", fed=fed)
    alg = make_algorithm("dense", build_env(cfg, fed, torch.device("cpu")), cfg.method_args)
    sizes = [_state_bytes(alg.client_new_model(c).state_dict()) for c in range(3)]
    assert sizes[0] != sizes[1]
    assert s["bytes_by_kind"] == {"weights": {"up": sum(sizes), "down": 0}}
    assert s["rejected_replies"] == [] and s["skipped_rounds"] == []
    # Three teachers; BatchNorm statistics from the two BN ConvNets (depth 2), none from AlexNet.
    assert s["dense"]["teachers"] == 3 and s["dense"]["bn_layers"] == 4
    assert s["dense"]["pool_images"] == 2 * small_args("dense")["syn_batch"]
    assert all(0.0 <= a <= 1.0 for a in s["per_client_accuracy"].values())


def test_instance_norm_drops_the_bn_term_with_one_warning(fed, tmp_path, caplog):
    cfg = _cfg(rounds=2, model_args={**TINY, "norm": "instance"})
    with caplog.at_level(logging.WARNING, logger="fedvl.algorithms.dense"):
        s = run_experiment(cfg, out=tmp_path / "r", fed=fed)
    said = [r for r in caplog.records if "BatchNorm" in r.getMessage()]
    assert len(said) == 1 and "bn_weight" in said[0].getMessage()
    assert s["dense"]["bn_layers"] == 0


def test_a_later_round_distils_on_from_the_current_global_model(fed):
    cfg = _cfg(method_args={**small_args("dense"), "student_lr": 1e-30})
    alg = make_algorithm("dense", build_env(cfg, fed, torch.device("cpu")), cfg.method_args)
    state = alg.server_init()
    other = {k: v + 1 if v.is_floating_point() else v for k, v in state["model"].items()}
    replies = {c: Message({"weights": alg.client_new_model(c).state_dict()}) for c in range(2)}
    out = alg.aggregate({**state, "model": other}, ServerContext(round=1), replies)
    for k in alg.new_model().state_dict():
        if "running" not in k and "num_batches" not in k:   # BN statistics move in train mode
            assert torch.allclose(out["model"][k], other[k]), k


def test_a_kept_generator_is_trained_on_and_kept_in_the_server_state(fed):
    cfg = _cfg(method_args={**small_args("dense"), "reset_generator": False})
    alg = make_algorithm("dense", build_env(cfg, fed, torch.device("cpu")), cfg.method_args)
    state = alg.server_init()
    replies = {c: Message({"weights": alg.client_new_model(c).state_dict()}) for c in range(2)}
    out = alg.aggregate(state, ServerContext(round=0), replies)
    moved = [k for k, v in state["generator"].items() if not torch.equal(v, out["generator"][k])]
    assert "l1.weight" in moved


def test_images_whose_side_is_not_a_multiple_of_4_are_one_clear_error():
    odd = make_toy_federation(num_clients=2, n_train=8, n_test=4, size=10)
    with pytest.raises(ConfigError, match="multiples of 4.*10x10"):
        make_algorithm("dense", build_env(_cfg(), odd, torch.device("cpu")))

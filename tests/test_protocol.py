"""Protocol options: `--lr-decay`, the `centralised` reference, `fedvl bench --target-acc`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fedvl.cli import main
from fedvl.config import RunConfig
from fedvl.core.training import TrainConfig, local_train
from fedvl.eval.comparison import render_markdown, rounds_to_target, summarize
from fedvl.models.base import build_model
from fedvl.run.experiment import run_experiment
from tests.conftest import METHODS, make_toy_federation, small_cfg


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=24, n_test=12)


# -- --lr-decay ----------------------------------------------------------------------------------
def _update(cfg: TrainConfig, rnd: int) -> dict[str, torch.Tensor]:
    """The change one local step of round `rnd` makes to a fixed model on fixed data."""
    toy = make_toy_federation(num_clients=1, n_train=8)
    model = build_model("convnet", 3, 4, 8, seed=0, width=8, depth=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    local_train(model, toy.clients[0].x_train, toy.clients[0].y_train, cfg.at_round(rnd),
                torch.Generator().manual_seed(0))
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def test_round_t_trains_at_lr_times_decay_to_the_t():
    cfg = TrainConfig(lr=0.1, momentum=0.0, local_steps=1, batch_size=8, lr_decay=0.5)
    assert cfg.lr_at(0) == 0.1 and cfg.lr_at(2) == pytest.approx(0.025)
    first, third = _update(cfg, 0), _update(cfg, 2)
    # Plain SGD, one step from the same weights on the same batch: the update is -lr * grad.
    # A conv bias that feeds an instance norm has zero gradient by construction: the norm
    # subtracts it again. Every weight must move, and every parameter must scale by 0.25.
    assert all(d.abs().sum() > 0 for n, d in first.items() if n.endswith("weight"))
    for n, d in first.items():
        # Equal up to the float32 rounding of weight - lr * grad (weights ~0.1: ~1e-8).
        assert torch.allclose(third[n], 0.25 * d, rtol=1e-4, atol=1e-7), n


def test_no_decay_leaves_the_config_and_the_numbers_unchanged():
    cfg = TrainConfig(lr=0.1, momentum=0.0, local_steps=2, batch_size=4)
    assert cfg.lr_decay == 1.0 and cfg.at_round(7) is cfg and cfg.lr_at(7) == 0.1
    a, b = _update(cfg, 0), _update(cfg, 9)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_training_refuses_a_run_config_with_a_decay():
    model = build_model("convnet", 3, 4, 8, seed=0, width=8, depth=2)
    with pytest.raises(ValueError, match=r"is per round.*cfg\.at_round\(round\)"):
        local_train(model, torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long),
                    TrainConfig(lr_decay=0.9), torch.Generator())


def test_decay_changes_rounds_after_the_first_only(fed, tmp_path):
    base = replace(small_cfg("fedavg", rounds=2), client_ratio=1.0)
    plain = run_experiment(base, out=tmp_path / "a", fed=fed)
    same = run_experiment(replace(base, lr_decay=1.0), out=tmp_path / "b", fed=fed)
    decayed = run_experiment(replace(base, lr_decay=0.5), out=tmp_path / "c", fed=fed)
    assert plain["accuracy_curve"] == same["accuracy_curve"]
    assert decayed["accuracy_curve"][0] == plain["accuracy_curve"][0]
    assert decayed["accuracy_curve"][1] != plain["accuracy_curve"][1]


LR = 0.0123
# Methods whose clients train no model with the run's optimiser (they distil; the server trains
# with its own learning rate).
NO_CLIENT_SGD = {"feddm", "fedvck", "fedd3", "fedaf", "fedlapdp"}
# Optimisers a server makes once at the run's learning rate before the first round (VFTL's
# pre-training on the virtual data).
SERVER_START_SGD = {"vftl": 1}


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.usefixtures("tmp_cache")
def test_every_method_trains_at_the_decayed_rate(name, fed, tmp_path, monkeypatch):
    seen: list[float] = []
    real = torch.optim.SGD

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, params, lr: float = 1e-3, *args, **kwargs) -> None:
            seen.append(lr)
            super().__init__(params, lr, *args, **kwargs)

    monkeypatch.setattr(torch.optim, "SGD", Spy)
    cfg = replace(small_cfg(name, rounds=2), lr=LR, lr_decay=0.5, client_ratio=1.0)
    run_experiment(cfg, out=tmp_path / "r", fed=fed)
    if name not in NO_CLIENT_SGD:
        assert LR in seen, (name, seen)
    if LR in seen:   # round 0 trained at lr: round 1 must train at lr * 0.5, never at lr again
        assert LR * 0.5 in seen, (name, seen)
        assert seen.count(LR) == seen.count(LR * 0.5) + SERVER_START_SGD.get(name, 0), (
            name, seen)


# -- centralised -----------------------------------------------------------------------------------
def test_centralised_pools_once_and_takes_fedavg_steps(fed, tmp_path, monkeypatch):
    from fedvl.algorithms import centralised

    calls: list[tuple[int, int | None, float]] = []
    real = centralised.local_train

    def spy(model, x, y, cfg, generator, **kw):
        calls.append((len(y), cfg.local_steps, cfg.lr))
        return real(model, x, y, cfg, generator, **kw)

    monkeypatch.setattr(centralised, "local_train", spy)
    cfg = replace(small_cfg("centralised", rounds=2), client_ratio=1.0, lr_decay=0.5)
    out = run_experiment(cfg, out=tmp_path / "full", fed=fed)
    # FedAvg's round: 3 clients x 1 epoch x ceil(24 / 8) steps = 9 steps, on all 72 images.
    assert calls == [(72, 9, cfg.lr), (72, 9, cfg.lr * 0.5)]
    assert out["federated"] is False and "not a federated method" in out["reference"]
    assert out["pooled_train_samples"] == 72
    raw = sum(c.x_train.numel() * 4 for c in fed.clients)
    assert out["bytes_by_kind"]["raw_images"] == {"up": raw, "down": 0}   # uploaded once
    assert out["bytes_down"] == 0

    calls.clear()
    cfg = replace(small_cfg("centralised", rounds=3), client_ratio=0.67, local_steps=2)
    run_experiment(cfg, out=tmp_path / "part", fed=fed)
    rows = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").open()]
    # Two of three clients per round: 2 x 2 steps on the data uploaded so far.
    seen: set[int] = set()
    for row, (n, steps, _) in zip(rows, calls, strict=True):
        seen |= set(row["participants"])
        assert steps == 4 and n == 24 * len(seen)


# -- bench --target-acc ----------------------------------------------------------------------------
def _run(seed: int, curve: list[float]) -> dict:
    return {"seed": seed, "run_dir": f"r{seed}", "per_client_accuracy": {"a": curve[-1]},
            "mean_accuracy": curve[-1], "bytes_up": 1, "bytes_down": 1, "bytes_by_kind": {},
            "bytes_per_round": {"up": 1, "down": 1}, "wall_seconds": 1.0,
            "accuracy_curve": [[r, a] for r, a in enumerate(curve)]}


def test_rounds_to_target_on_a_known_curve():
    assert rounds_to_target([[0, 0.1], [1, 0.5], [2, 0.7]], 0.5) == 2   # 1-based
    assert rounds_to_target([[0, 0.6]], 0.5) == 1
    assert rounds_to_target([[0, 0.1], [1, 0.4]], 0.5) is None
    assert rounds_to_target(None, 0.5) is None
    # Evaluated every other round: the round index, not the position in the curve.
    assert rounds_to_target([[1, 0.2], [3, 0.55]], 0.5) == 4


def test_target_rounds_speed_up_and_best_accuracy():
    summaries = {
        "fedavg": [_run(0, [0.1, 0.3, 0.5, 0.6]), _run(1, [0.2, 0.5, 0.55, 0.4])],
        "fast": [_run(0, [0.5, 0.6, 0.7, 0.7]), _run(1, [0.1, 0.2, 0.3, 0.3])],
        "slow": [_run(0, [0.1, 0.1, 0.2, 0.2]), _run(1, [0.1, 0.2, 0.2, 0.3])],
    }
    comp = summarize(RunConfig(), summaries, None, target_acc=0.5)
    assert comp["target_accuracy"] == 0.5
    m = comp["methods"]
    assert m["fedavg"]["target"] == {"per_seed": [3, 2], "reached": 2, "n": 2,
                                     "mean_rounds": 2.5, "speed_up": 1.0}
    assert m["fast"]["target"]["per_seed"] == [1, None]
    assert m["fast"]["target"]["mean_rounds"] == 1.0 and m["fast"]["target"]["speed_up"] == 2.5
    assert m["slow"]["target"]["mean_rounds"] is None and m["slow"]["target"]["speed_up"] is None
    # Best over rounds, per seed, then over seeds; next to the final accuracy.
    assert m["fedavg"]["best_accuracy"]["mean"] == pytest.approx(0.575)
    assert m["fedavg"]["mean_accuracy"]["mean"] == pytest.approx(0.5)
    md = render_markdown(comp)
    assert ("| mean ± std | best ± std | best at round | seeds | rounds to 50% | "
            "speed-up vs fedavg |") in md
    assert "| 50.00 ± 14.14 | 57.50 ± 3.54 | 3.5 | 2 | 2.5 | 1.00x |" in md
    assert "| 2 | 1.0 (1/2 seeds) | 2.50x |" in md
    assert "| 2 | not reached | — |" in md
    # Without FedAvg in the bench there is nothing to speed up against.
    comp = summarize(RunConfig(), {"fast": summaries["fast"]}, None, target_acc=0.5)
    assert "speed_up" in comp["methods"]["fast"]["target"]
    assert comp["methods"]["fast"]["target"]["speed_up"] is None
    assert "speed-up" not in render_markdown(comp) and "rounds to 50%" in render_markdown(comp)
    # Without a target: no such columns, no `target` entries.
    comp = summarize(RunConfig(), summaries, None)
    assert "target" not in comp["methods"]["fedavg"] and "rounds to" not in render_markdown(comp)


def test_cli_target_acc_must_be_a_fraction(tmp_path, capsys):
    rc = main(["bench", "--benchmark", "digits-offline", "--methods", "fedavg", "--seeds", "0",
               "--target-acc", "60", "--out", str(tmp_path / "b"), "--report-only"])
    assert rc == 2 and "--target-acc 60.0 is not an accuracy; allowed: a fraction in (0, 1]" \
        in capsys.readouterr().err

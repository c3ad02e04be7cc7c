"""`--autocast bf16`: local training's forward passes in bfloat16, off by default."""

from __future__ import annotations

import json

import pytest
import torch

from fedvl.config import ConfigError, RunConfig, validate
from fedvl.core.stacked import stacked_local_train
from fedvl.core.training import TrainConfig, autocast_context, local_train
from fedvl.models.base import build_model
from fedvl.run.experiment import run_experiment


def _data(seed: int, n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _model() -> torch.nn.Module:
    return build_model("convnet", 3, 10, 16, seed=0, width=8, depth=2)


def _train(autocast: str) -> dict[str, torch.Tensor]:
    model = _model()
    x, y = _data(1)
    cfg = TrainConfig(lr=0.05, momentum=0.9, batch_size=16, local_epochs=2, autocast=autocast)
    local_train(model, x, y, cfg, torch.Generator().manual_seed(2))
    return model.state_dict()


def test_bf16_trains_close_to_float32_and_differently() -> None:
    fp32, bf16 = _train("none"), _train("bf16")
    assert all(v.dtype == torch.float32 for v in bf16.values())   # weights stay float32
    w32, w16 = fp32["classifier.weight"], bf16["classifier.weight"]
    assert not torch.equal(w32, w16)                               # autocast did something
    assert (w16 - w32).norm() / w32.norm() < 0.05
    assert torch.equal(bf16["classifier.weight"], _train("bf16")["classifier.weight"])


def test_autocast_context_runs_matmuls_in_bfloat16_and_refuses_unknown_kinds() -> None:
    a = torch.randn(4, 4)
    with autocast_context("bf16", a.device):
        assert (a @ a).dtype == torch.bfloat16
    with autocast_context("none", a.device):
        assert (a @ a).dtype == torch.float32
    with pytest.raises(ValueError, match="allowed: none, bf16"):
        autocast_context("fp8", a.device)


def test_stacked_clients_follow_autocast() -> None:
    data = [_data(3), _data(4, 40)]
    cfg = TrainConfig(lr=0.05, momentum=0.9, batch_size=16, autocast="bf16")
    start = _model().state_dict()
    stacked = stacked_local_train(_model(), [start, start], data, cfg,
                                  [torch.Generator().manual_seed(k) for k in (5, 6)])
    for k, (x, y) in enumerate(data):
        one = _model()
        local_train(one, x, y, cfg, torch.Generator().manual_seed(5 + k))
        w, ws = one.state_dict()["classifier.weight"], stacked[k][0]["classifier.weight"]
        # bf16 rounding differs between the vectorised and the plain kernels.
        assert (ws - w).norm() / w.norm() < 0.05


def test_a_bf16_run_gives_the_same_numbers_on_any_worker_count(tmp_path) -> None:
    rows = []
    for workers in (1, 3):
        cfg = RunConfig(method="fedavg", benchmark="digits-offline", train_cap=32, test_cap=16,
                        rounds=2, model_args={"width": 8, "depth": 2}, autocast="bf16",
                        workers=workers)
        run_experiment(cfg, out=tmp_path / f"w{workers}")
        rows.append([json.loads(x) for x in (tmp_path / f"w{workers}" / "metrics.jsonl").open()])
    for a, b in zip(*rows, strict=True):
        assert a["per_client_loss"] == b["per_client_loss"]
        assert a["train_loss"] == b["train_loss"]


def test_unknown_autocast_is_one_config_error() -> None:
    with pytest.raises(ConfigError, match="autocast"):
        validate(RunConfig(autocast="fp16"))

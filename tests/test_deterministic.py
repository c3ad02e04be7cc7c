"""`--deterministic`: the option, the settings a run holds while it runs, and the CPU's numbers.

On the CPU torch's kernels are deterministic already, so a run gives the same numbers with and
without the option; inside the run the settings are on, after it (finished or failed) the
process has its own settings back. Flower nodes apply the option per message.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from fedvl.config import ConfigError, RunConfig, dump_yaml, from_dict, load_yaml, validate
from fedvl.engine.driver import TIMING_KEYS
from fedvl.engine.simulation import Simulation
from fedvl.run import assemble
from fedvl.run.assemble import (
    CUBLAS_WORKSPACE,
    CUBLAS_WORKSPACE_CONFIG,
    Determinism,
    determinism,
    deterministic_mode,
    use_determinism,
)
from fedvl.run.experiment import check_experiment, resume_experiment, run_experiment
from tests.conftest import make_toy_federation, small_cfg

OFF = Determinism(False, False, False, False, None)


@pytest.fixture(autouse=True)
def _settings_kept(monkeypatch):
    """Every test starts from torch's defaults and leaves the process as it found it."""
    before = determinism()
    monkeypatch.delenv(CUBLAS_WORKSPACE_CONFIG, raising=False)
    use_determinism(OFF)
    yield
    use_determinism(before)


def _recording_rounds(monkeypatch) -> list[Determinism]:
    """The settings in force at each round of a run (recorded from inside the round loop)."""
    seen: list[Determinism] = []
    original = Simulation.run_round

    def recording(self, rnd):
        seen.append(determinism())
        return original(self, rnd)

    monkeypatch.setattr(Simulation, "run_round", recording)
    return seen


def _numbers(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _states(run_dir: Path) -> dict:
    ck = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    return {k: ck[k] for k in ("server_state", "client_states")}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# -- the option ------------------------------------------------------------------------------
def test_the_option_lives_in_the_engine_section_and_defaults_off():
    assert RunConfig().deterministic is False
    cfg = RunConfig(deterministic=True)
    assert cfg.deterministic is True and cfg.engine.deterministic is True
    assert from_dict({"deterministic": True}).engine.deterministic is True


def test_a_value_that_is_no_bool_is_refused():
    with pytest.raises(ConfigError, match=r"config field 'deterministic'.*true/false"):
        validate(from_dict({"deterministic": "yes"}))


def test_config_yaml_records_it_only_when_set(tmp_path):
    dump_yaml(RunConfig(), tmp_path / "off.yaml")
    assert "deterministic" not in (tmp_path / "off.yaml").read_text()
    dump_yaml(RunConfig(deterministic=True), tmp_path / "on.yaml")
    assert "deterministic: true" in (tmp_path / "on.yaml").read_text()
    assert load_yaml(tmp_path / "on.yaml").deterministic is True
    (tmp_path / "user.yaml").write_text("method: fedavg\ndeterministic: true\n")
    assert load_yaml(tmp_path / "user.yaml").engine.deterministic is True


def test_the_flag_reaches_the_config_and_the_dry_run_checks_under_it(monkeypatch):
    from fedvl.cli import build_parser, config_from_args

    args = build_parser().parse_args(["run", "--method", "fedavg", "--deterministic",
                                      "--dry-run"])
    cfg = config_from_args(args)
    assert args.dry_run and cfg.deterministic is True
    assert config_from_args(build_parser().parse_args(["run", "--method", "fedavg"])
                            ).deterministic is False
    seen = []
    build = assemble.build_method

    def recording(*a, **k):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return build(*a, **k)

    monkeypatch.setattr(assemble, "build_method", recording)
    small = dataclasses.replace(small_cfg("fedavg"), deterministic=True)
    check_experiment(small, fed=make_toy_federation())
    assert seen == [True] and not torch.are_deterministic_algorithms_enabled()


# -- the settings ----------------------------------------------------------------------------
def test_deterministic_mode_sets_everything_and_restores_the_previous_settings():
    torch.backends.cudnn.benchmark = True
    before = determinism()
    with deterministic_mode(True):
        assert determinism() == Determinism(True, False, True, False, CUBLAS_WORKSPACE)
        assert os.environ[CUBLAS_WORKSPACE_CONFIG] == ":4096:8"
    assert determinism() == before
    assert CUBLAS_WORKSPACE_CONFIG not in os.environ


def test_a_workspace_setting_and_warn_only_mode_of_the_caller_are_kept(monkeypatch):
    monkeypatch.setenv(CUBLAS_WORKSPACE_CONFIG, ":16:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    before = determinism()
    with deterministic_mode(True):
        # Errors inside the run, whatever the caller chose; the caller's workspace stays.
        assert determinism() == Determinism(True, False, True, False, ":16:8")
    assert determinism() == before
    with deterministic_mode(False):   # off: nothing is touched
        assert determinism() == before


def test_settings_are_restored_when_the_block_raises():
    with pytest.raises(KeyboardInterrupt), deterministic_mode(True):
        raise KeyboardInterrupt
    assert determinism() == OFF


# -- runs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fedavg", "vhl"])
def test_a_cpu_run_gives_the_same_numbers_with_and_without_it(method, tmp_path, monkeypatch):
    fed = make_toy_federation()
    seen = _recording_rounds(monkeypatch)
    cfg = small_cfg(method, rounds=2)
    off = run_experiment(cfg, out=tmp_path / "off", fed=fed)
    assert [s.algorithms for s in seen] == [False, False]
    on = run_experiment(dataclasses.replace(cfg, deterministic=True), out=tmp_path / "on",
                        fed=fed)
    assert seen[2:] == [Determinism(True, False, True, False, CUBLAS_WORKSPACE)] * 2
    assert determinism() == OFF and not torch.are_deterministic_algorithms_enabled()
    assert on["per_client_accuracy"] == off["per_client_accuracy"]
    assert on["per_client_loss"] == off["per_client_loss"]
    assert _numbers(tmp_path / "on") == _numbers(tmp_path / "off")
    assert _same(_states(tmp_path / "on"), _states(tmp_path / "off"))


def test_a_failed_run_restores_the_settings_and_resume_runs_deterministic(tmp_path,
                                                                          monkeypatch):
    fed = make_toy_federation()
    cfg = dataclasses.replace(small_cfg("fedavg", rounds=2), deterministic=True)
    original = Simulation.run_round
    seen: list[bool] = []

    def crashing(self, rnd):
        seen.append(torch.are_deterministic_algorithms_enabled())
        if rnd == 1 and len(seen) == 2:
            raise KeyboardInterrupt
        return original(self, rnd)

    monkeypatch.setattr(Simulation, "run_round", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out=tmp_path / "r", fed=fed)
    assert seen == [True, True] and determinism() == OFF
    assert "deterministic: true" in (tmp_path / "r" / "config.yaml").read_text()
    # The resumed run reads the option back from config.yaml (its own data: no `fed` here).
    monkeypatch.setattr(assemble, "build_federation", lambda c: fed)
    resume_experiment(tmp_path / "r")
    assert seen == [True, True, True] and determinism() == OFF


# -- Flower ----------------------------------------------------------------------------------
def test_a_flower_node_handles_each_message_under_its_runs_setting():
    pytest.importorskip("flwr")
    from types import SimpleNamespace

    from flwr.app import ConfigRecord, RecordDict

    from fedvl.flower.client_app import deterministic_mod
    from fedvl.flower.records import RUN, config_to_text

    def message(cfg: RunConfig) -> SimpleNamespace:
        return SimpleNamespace(content=RecordDict({RUN: ConfigRecord(
            {"config": config_to_text(cfg)})}))

    seen = []

    def handler(msg, context):
        seen.append(determinism())
        return "reply"

    assert deterministic_mod(message(RunConfig(deterministic=True)), None, handler) == "reply"
    assert deterministic_mod(message(RunConfig()), None, handler) == "reply"
    assert seen == [Determinism(True, False, True, False, CUBLAS_WORKSPACE), OFF]
    assert determinism() == OFF


def test_a_flower_server_runs_under_the_setting(tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    from tests.conftest import FakeGrid, run_on_grid

    seen = _recording_driver_rounds(monkeypatch)
    cfg = RunConfig(method="fedavg", benchmark="digits-offline",
                    domains=["handwritten", "printed-clean"], train_cap=16, test_cap=8,
                    rounds=1, local_steps=1, batch_size=8, threads=1, deterministic=True,
                    model_args={"width": 8, "depth": 2, "norm": "instance"})
    s = run_on_grid(FakeGrid(2), cfg, tmp_path, round_timeout=30)
    assert s["flower"]["status"] == "completed"
    assert seen == [True] and determinism() == OFF


def _recording_driver_rounds(monkeypatch) -> list[bool]:
    """Whether deterministic kernels were on at each round of a Flower run's driver."""
    from fedvl.engine.driver import RoundDriver

    seen: list[bool] = []
    original = RoundDriver.run_round

    def recording(self, *a, **k):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return original(self, *a, **k)

    monkeypatch.setattr(RoundDriver, "run_round", recording)
    return seen


def test_gpu_only_kernels_are_swapped_for_deterministic_ones_with_the_same_values():
    """Under --deterministic on an accelerator, DSA's scale/rotate sampling and ResNet's global
    pooling avoid the two ops whose CUDA backward torch refuses (grid_sample,
    adaptive_avg_pool2d); the replacements give grid_sample's values and input gradients."""
    from fedvl.devices import needs_deterministic_kernels
    from fedvl.distill.augment import bilinear_sample

    cpu, elsewhere = torch.zeros(1), torch.zeros(1, device="meta")
    assert not needs_deterministic_kernels(elsewhere)
    use_determinism(Determinism(True, False, True, False, CUBLAS_WORKSPACE))
    assert needs_deterministic_kernels(elsewhere) and not needs_deterministic_kernels(cpu)
    use_determinism(OFF)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 7, 9, generator=g, dtype=torch.float64, requires_grad=True)
    angle = torch.tensor([0.0, 0.6, -2.5], dtype=torch.float64)
    scale = torch.tensor([1.0, 1.3, 0.7], dtype=torch.float64)   # corners fall outside
    theta = torch.zeros(3, 2, 3, dtype=torch.float64)
    theta[:, 0, 0], theta[:, 0, 1] = scale * angle.cos(), -angle.sin()
    theta[:, 1, 0], theta[:, 1, 1] = angle.sin(), scale * angle.cos()
    theta[:, :, 2] = torch.tensor([0.1, -0.2], dtype=torch.float64)
    grid = torch.nn.functional.affine_grid(theta, list(x.shape), align_corners=True)
    ref = torch.nn.functional.grid_sample(x, grid, align_corners=True)
    out = bilinear_sample(x, grid)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    (g_out,) = torch.autograd.grad((out * w).sum(), x)
    torch.testing.assert_close(g_out, g_ref, rtol=1e-12, atol=1e-12)
    feats = torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(feats.mean((2, 3)),
                               torch.nn.functional.adaptive_avg_pool2d(feats, 1).flatten(1))

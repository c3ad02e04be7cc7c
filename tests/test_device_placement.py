"""Every tensor is made on the device it is used on, and a synthesis step never waits on it.

CI has no GPU, so a tensor made on the CPU and used with CUDA ones cannot crash here as it did
on a GPU (FedDM's rho-ball draw, VFA's virtual features). `cpu_as_device` makes such a tensor
a `meta` one, which fails at its first use with the run's tensors; the method matrices of
`test_conformance.py` run every method and composition under it, this file the variants
(DP, stacked clients, FedDM's stacked synthesis, bf16 autocast, per-client architectures) and
every synthesis objective of `fedvl perf --distill`. Host syncs are counted as a GPU would see
them (`fedvl.perf.synthesis.FlopCount`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedvl.config import RunConfig
from fedvl.perf.synthesis import OBJECTIVES, FlopCount, build_case
from fedvl.run.experiment import run_experiment
from tests.conftest import cpu_as_device, make_toy_federation, small_cfg


def test_the_guard_catches_a_factory_without_a_device():
    x = torch.ones(3)
    with cpu_as_device(), pytest.raises(RuntimeError, match="device"):
        _ = x + torch.randn(3)   # the CPU tensor a GPU run would have mixed with CUDA ones
    with cpu_as_device():
        assert torch.equal(x + torch.ones(3, device="cpu"), 2 * x)


VARIANTS = {
    "dp-fedavg": ("fedavg", {"dp_noise": 1.0}, {}),
    "dp-feddm": ("feddm", {"dp_noise": 1.0, "init": "noise"}, {}),
    "dp-fedlapdp": ("fedlapdp", {"dp_noise": 1.0, "dsa": True}, {}),
    # Every client of the round, so that the round is stacked (one client runs alone).
    "stacked": ("fedavg", {}, {"stack_clients": True, "client_ratio": 1.0}),
    "stacked-feddm": ("feddm", {}, {"stack_clients": True, "client_ratio": 1.0}),
    "bf16": ("fedprox", {}, {"autocast": "bf16"}),
    "alternate": ("desa", {}, {"client_models": ["alternate"]}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_make_tensors_on_their_device(variant, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    method, margs, run = VARIANTS[variant]
    cfg = small_cfg(method, rounds=1)
    cfg = dataclasses.replace(cfg, method_args={**cfg.method_args, **margs}, workers=1, **run)
    fed = make_toy_federation(num_clients=2, n_train=16, n_test=8)
    with cpu_as_device():
        out = run_experiment(cfg, out=tmp_path / "r", fed=fed)
    assert out["rounds"] == 1 and out["rejected_replies"] == []


@pytest.fixture(scope="module")
def synthesis_setup():
    """A 4-class toy federation and a tiny ConvNet, as `fedvl perf --distill` builds them."""
    fed = make_toy_federation(num_clients=2, n_train=48, n_test=8, size=8)
    cfg = RunConfig(benchmark="toy", seed=0, model_args={"width": 8, "depth": 2})
    return cfg, fed


@pytest.mark.parametrize("name", [o for o in OBJECTIVES if o != "vhl-generator"])
def test_a_synthesis_step_is_on_device_and_never_waits(name, synthesis_setup):
    cfg, fed = synthesis_setup
    with cpu_as_device():
        case = build_case(name, cfg, fed, torch.device("cpu"), batched=True)
        case.step()
    case.step()
    with FlopCount(case.device_tensors) as count:
        case.step()
    assert count.syncs == 0, count.sync_names
    assert count.ops > 0


def test_the_sync_count_sees_a_read_of_the_device():
    x = torch.randn(4)
    with FlopCount([x]) as count:
        host = torch.rand(4, generator=torch.Generator().manual_seed(0), device="cpu")
        float(host.sum())                      # a host scalar: no wait on a GPU
        y = x * 2
        float(y.sum())                         # a device scalar read back: a sync
        _ = y[y > 0]                           # a boolean mask: a sync
        labels = torch.tensor([0, 1, 1], device="cpu") + y[:3].long() * 0
        torch.bincount(labels)                 # on a GPU: reads the maximum back
        labels.repeat_interleave(labels)       # on a GPU: reads the total back
        labels.repeat_interleave(2)            # a fixed size: no read
    assert count.syncs == 4, count.sync_names


def test_gradient_matching_ops_are_bounded_whatever_the_classes():
    """Past `GROUPED_TWICE_MAX_CLASSES` the op count is constant; below it the grouped double
    backward (a few ops per class) stays under that constant."""
    from fedvl.distill.class_gradients import GROUPED_TWICE_MAX_CLASSES

    ops = {}
    for k in (4, GROUPED_TWICE_MAX_CLASSES, 2 * GROUPED_TWICE_MAX_CLASSES, 64):
        fed = make_toy_federation(num_clients=1, n_train=4 * k, n_test=4, num_classes=k, size=8)
        cfg = RunConfig(benchmark="toy", seed=0, model_args={"width": 8, "depth": 2})
        case = build_case("gradient", cfg, fed, torch.device("cpu"), batched=True)
        case.step()
        counts = []
        # DSA draws its transforms per step, which moves a step's count by up to ~40 ops: the
        # fewest over six steps is the step's own cost.
        for _ in range(6):
            with FlopCount(case.device_tensors) as count:
                case.step()
            counts.append(count.ops)
        ops[k] = min(counts)
    top = GROUPED_TWICE_MAX_CLASSES
    assert abs(ops[64] - ops[2 * top]) <= 8, ops
    assert ops[4] <= ops[top] <= ops[2 * top] + 8, ops


def test_moving_to_the_cpu_keeps_every_value():
    from fedvl.devices import module_to, to_device
    from fedvl.models.base import build_model

    t = torch.arange(6, device="cpu").view(2, 3)
    assert torch.equal(to_device(t, "cpu"), t)
    model = build_model("convnet", 1, 4, 8, seed=0, width=4, depth=1, norm="batch")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = module_to(model, torch.device("cpu"))
    assert moved is model
    assert all(torch.equal(before[k], v) for k, v in moved.state_dict().items())


def test_local_training_steps_never_wait_on_the_device():
    """Plain and stacked local training: no step reads the device back (the loss is summed on
    it and read once at the end), so the reads do not grow with the steps. (DP-SGD sums its
    loss the same way; under this counter its per-sample gradients take seconds a step.)"""
    from fedvl.core.stacked import stacked_local_train
    from fedvl.core.training import TrainConfig, local_train
    from fedvl.models.base import build_model

    model = build_model("convnet", in_channels=1, num_classes=4, image_size=8, seed=0,
                        width=4, depth=1, norm="instance")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 1, 8, 8, generator=g), torch.randint(0, 4, (24,), generator=g)
    tracked = [x, y, *model.parameters(), *model.buffers()]

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(1)

    runs = {
        "plain": lambda cfg: local_train(model, x, y, cfg, gen()),
        "stacked": lambda cfg: stacked_local_train(model, [model.state_dict()] * 2,
                                                   [(x, y)] * 2, cfg, [gen(), gen()]),
    }
    for name, run in runs.items():
        syncs = []
        for steps in (1, 3):
            with FlopCount(tracked) as count:
                run(TrainConfig(lr=0.1, momentum=0.9, local_steps=steps, batch_size=8))
            syncs.append(count.syncs)
        assert syncs[0] == syncs[1] <= 2, (name, syncs)

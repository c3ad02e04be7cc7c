"""Per-client architectures (`--client-models`) and methods that need one architecture."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedvl.algorithms.base import make_algorithm
from fedvl.cli import main
from fedvl.config import ConfigError, RunConfig, validate
from fedvl.models.alexnet import AlexNet
from fedvl.models.base import client_architectures
from fedvl.models.convnet import ConvNet
from fedvl.run.assemble import build_env, build_federation
from fedvl.run.experiment import run_experiment


@pytest.fixture(scope="module")
def fed():
    return build_federation(RunConfig(benchmark="digits-offline", train_cap=40, test_cap=20))


def _cfg(**kw) -> RunConfig:
    return RunConfig(rounds=1, batch_size=16, model_args={"width": 8, "depth": 2,
                                                          "norm": "instance"}, **kw)


def test_assignment_rules():
    assert client_architectures("convnet", None, 3) == ["convnet"] * 3
    assert client_architectures("convnet", ["alternate"], 5) == [
        "convnet", "alexnet", "convnet", "alexnet", "convnet"]
    assert client_architectures("convnet", ["alexnet", "resnet18", "convnet"], 4) == [
        "alexnet", "resnet18", "convnet", "alexnet"]
    assert client_architectures("convnet", ["alexnet"], 2) == ["alexnet", "alexnet"]


def test_unknown_architecture_is_refused():
    with pytest.raises(ConfigError, match="client_models.*allowed: registered model names"):
        validate(_cfg(client_models=["convnet", "vgg"]))


def test_weight_averaging_method_refuses_a_mixed_federation(fed, capsys):
    env = build_env(_cfg(client_models=["alternate"]), fed, torch.device("cpu"))
    with pytest.raises(ValueError, match="'fedavg' needs one architecture for every client.*"
                                         "alexnet, convnet.*accept mixed architectures: "
                                         "coboosting, dense, desa, fccl, feddf, fedhe, "
                                         "fedproto, local"):
        make_algorithm("fedavg", env)
    assert main(["run", "--method", "scaffold", "--client-models", "alternate", "--rounds", "1",
                 "--quiet", "--width", "8"]) == 2
    err = capsys.readouterr().err
    assert "'scaffold' needs one architecture" in err and err.count("\n") == 1


def test_local_training_runs_each_clients_own_architecture(fed, tmp_path):
    cfg = _cfg(method="local", client_models=["alternate"])
    out = run_experiment(cfg, out=tmp_path / "r", fed=fed)
    assert all(0.0 <= a <= 1.0 for a in out["per_client_accuracy"].values())
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    env = build_env(cfg, fed, torch.device("cpu"))
    alg = make_algorithm("local", env)
    kinds = []
    for cid, (arrays, _) in sorted(ck["client_states"].items()):
        model = alg.client_new_model(cid)
        model.load_state_dict(arrays["weights"])  # the saved weights fit that architecture
        kinds.append(type(model))
    assert kinds == [ConvNet, AlexNet, ConvNet, AlexNet, ConvNet]


def test_one_named_architecture_is_the_run_model(fed, tmp_path):
    cfg = _cfg(method="fedavg", client_models=["alexnet"])
    env = build_env(cfg, fed, torch.device("cpu"))
    assert not env.mixed_models and isinstance(env.model_fn(), AlexNet)
    base = run_experiment(dataclasses.replace(cfg, client_models=None, model="alexnet",
                                              model_args={"width": 8}), out=tmp_path / "a",
                          fed=fed)
    same = run_experiment(cfg, out=tmp_path / "b", fed=fed)
    assert same["per_client_accuracy"] == base["per_client_accuracy"]

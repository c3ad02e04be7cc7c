"""VFTL: FedAvg from a global model pre-trained on VHL's virtual dataset."""

from __future__ import annotations

import dataclasses

import torch

from fedvl.algorithms.base import make_algorithm
from fedvl.algorithms.vftl import pretrain
from fedvl.config import RunConfig
from fedvl.core.training import evaluate
from fedvl.perf.synthesis import FlopCount
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation

SMALL = {"virtual_per_class": 8}


def _cfg(method: str, **method_args) -> RunConfig:
    return RunConfig(method=method, method_args=method_args, rounds=2, batch_size=8, lr=0.05,
                     momentum=0.5, client_ratio=0.67,
                     model_args={"width": 8, "depth": 2, "norm": "instance"})


def _run(cfg: RunConfig, fed, out) -> tuple[dict, dict]:
    """The run's summary and its final server state."""
    summary = run_experiment(cfg, out=out, fed=fed)
    return summary, torch.load(out / "checkpoint.pt", weights_only=True)["server_state"]


def _alg(method: str, fed, **args):
    env = build_env(_cfg(method), fed, torch.device("cpu"))
    return make_algorithm(method, env, args)


def test_no_pretraining_is_fedavg_number_for_number(tmp_path):
    fed = make_toy_federation()
    a, sa = _run(_cfg("fedavg"), fed, tmp_path / "fedavg")
    b, sb = _run(_cfg("vftl", pretrain_epochs=0, **SMALL), fed, tmp_path / "vftl")
    for key in ("accuracy_curve", "per_client_accuracy", "per_client_loss", "bytes_up",
                "bytes_down"):
        assert a[key] == b[key], key
    assert sa["model"].keys() == sb["model"].keys()
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])


def test_pretraining_moves_the_start_and_learns_the_virtual_classes():
    fed = make_toy_federation()
    plain = _alg("fedavg", fed).server_init()["model"]
    alg = _alg("vftl", fed, pretrain_epochs=5, **SMALL)
    state = alg.server_init()
    c, v = fed.num_classes, alg.num_virtual
    head = [k for k in state["model"] if state["model"][k].shape[0] == c + v]
    assert head, "the classifier has C + V outputs"
    # The trunk starts where FedAvg's does (same seed) and pre-training moves it.
    trunk = [k for k in plain if k in state["model"] and plain[k].shape == state["model"][k].shape
             and plain[k].is_floating_point()]
    assert trunk and any(not torch.equal(plain[k], state["model"][k]) for k in trunk)
    # It classifies the virtual data (labels C + k) far better than chance over C + V outputs.
    data = alg.virtual_dataset()
    acc, _ = evaluate(alg.global_model(state), data.normalised(), data.labels + c)
    assert acc > 3 / (c + v), acc
    report = alg.report(state)["vftl"]
    assert len(report["pretrain_loss"]) == 5 and report["pretrain_loss"][-1] < \
        report["pretrain_loss"][0]


def test_it_pretrains_on_the_virtual_data_of_vhl():
    fed = make_toy_federation()
    mine = _alg("vftl", fed, **SMALL).virtual_dataset()
    vhls = _alg("vhl", fed, **SMALL).virtual_dataset()
    assert torch.equal(mine.images, vhls.images) and torch.equal(mine.labels, vhls.labels)
    # And the same model: VHL's initial weights before pre-training.
    vftl = _alg("vftl", fed, **SMALL)
    start = vftl.new_model().state_dict()
    vhl_start = _alg("vhl", fed, **SMALL).server_init()["model"]
    assert all(torch.equal(start[k], vhl_start[k]) for k in vhl_start)


def test_same_seed_same_run_and_another_seed_differs(tmp_path):
    fed = make_toy_federation()
    cfg = _cfg("vftl", pretrain_epochs=2, **SMALL)
    a, sa = _run(cfg, fed, tmp_path / "a")
    b, sb = _run(cfg, fed, tmp_path / "b")
    assert a["accuracy_curve"] == b["accuracy_curve"] and a["vftl"] == b["vftl"]
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
    c = _alg("vftl", fed, pretrain_epochs=2, **SMALL)
    c.env = dataclasses.replace(c.env, seed=1)
    assert c.server_init()["pretrain"] != sa["pretrain"]


def test_only_weights_travel(tmp_path):
    fed = make_toy_federation()
    s = run_experiment(_cfg("vftl", pretrain_epochs=1, **SMALL), out=tmp_path / "r", fed=fed)
    assert set(s["bytes_by_kind"]) == {"weights"}


def test_a_pretraining_step_never_waits_on_the_device():
    fed = make_toy_federation()
    alg = _alg("vftl", fed, pretrain_epochs=3, **SMALL)
    model = alg.new_model()
    data = alg.virtual_dataset()
    x, y = data.normalised(), data.labels + fed.num_classes
    cfg = dataclasses.replace(alg.pretrain_config(), batch_size=8)
    with FlopCount([x, y, *model.parameters()]) as count:
        curve = pretrain(model, x, y, cfg, torch.Generator().manual_seed(0))
    # 3 epochs of 4 steps without a scalar read or a data-sized output of device data (the
    # curve's one copy to the host, after the last step, is not such an op).
    assert len(curve["loss"]) == 3 and count.ops > 0 and count.syncs == 0, count.sync_names

"""FedLGD: schedule, regulariser detach, degenerate case, bytes of the global virtual data."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fedvl.algorithms.base import make_algorithm
from fedvl.algorithms.fedlgd import ClientSets, GlobalSupConTerm
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation

SMALL = {"ipc": 2, "server_ipc": 2, "warmup_steps": 3, "local_dm_steps": 2,
         "server_gm_steps": 3, "refresh_period": 2, "refresh_count": 2, "batch_real": 4,
         "dsa": False}


@pytest.fixture
def cfg(tmp_path, monkeypatch) -> RunConfig:
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    return RunConfig(method="fedlgd", rounds=5, batch_size=8, lr=0.05, momentum=0.0,
                     model_args={"width": 8, "depth": 2, "norm": "instance"},
                     method_args=dict(SMALL), ipc=2, virtual_steps=3, virtual_batch_real=4)


def test_schedule_refreshes_exactly_every_tau(cfg, toy_fed):
    env = build_env(cfg, toy_fed, torch.device("cpu"))
    alg = make_algorithm("fedlgd", env, {**SMALL, "refresh_period": 5, "refresh_count": 10})
    local = [r for r in range(100) if alg.local_refresh(r)]
    glob = [r for r in range(100) if alg.global_refresh(r)]
    assert local == list(range(5, 51, 5))
    assert glob == list(range(0, 51, 5))
    none = make_algorithm("fedlgd", env, {**SMALL, "refresh_count": 0})
    assert not any(none.local_refresh(r) or none.global_refresh(r) for r in range(100))


def test_run_logs_refreshes_and_counts_global_bytes(cfg, toy_fed, tmp_path):
    s = run_experiment(cfg, out=tmp_path / "r", fed=toy_fed)
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    log = ck["server_state"]["log"]
    assert [e["round"] for e in log if e.get("global_refresh")] == [0, 2, 4]
    assert [e["round"] for e in log if "local_refresh" in e] == [2, 4]
    kinds = s["bytes_by_kind"]
    # Global virtual data goes down (once per version and client), never up.
    assert kinds["synthetic_images"]["down"] > 0 and kinds["synthetic_images"]["up"] == 0
    per_set = 2 * 4 * 3 * 8 * 8 * 4  # server_ipc * classes * C*H*W * float32
    assert kinds["synthetic_images"]["down"] % per_set == 0
    # Versions sent: after round 0 (init+refresh) and after round 2 -> 2 versions x 3 clients.
    assert kinds["synthetic_images"]["down"] == 2 * 3 * per_set
    assert kinds["statistics"]["up"] > 0 and "gradients" not in kinds


def test_no_refresh_no_reg_equals_fedavg_on_virtual_data(cfg, toy_fed, tmp_path):
    margs = {**SMALL, "refresh_count": 0, "lambda_reg": 0.0, "server_ipc": 0}
    a = dataclasses.replace(cfg, method="fedavg", method_args={}, local_data="virtual")
    b = dataclasses.replace(cfg, method="fedlgd", method_args=margs, local_data="virtual")
    run_experiment(a, out=tmp_path / "a", fed=toy_fed)
    run_experiment(b, out=tmp_path / "b", fed=toy_fed)
    wa = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["server_state"]["model"]
    wb = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["server_state"]["model"]
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k
    # And the regulariser does change the result.
    c = dataclasses.replace(b, method_args={**margs, "server_ipc": 2, "lambda_reg": 1.0})
    run_experiment(c, out=tmp_path / "c", fed=toy_fed)
    wc = torch.load(tmp_path / "c" / "checkpoint.pt", weights_only=True)["server_state"]["model"]
    assert any(not torch.allclose(wa[k], wc[k], atol=1e-5) for k in wa)


@pytest.mark.parametrize("detach", [True, False])
def test_detach_stops_gradient_into_global_virtual_features(detach):
    from fedvl.models import build_model

    model = build_model("convnet", 3, 4, 8, seed=0, width=8, depth=2)
    xg = torch.randn(8, 3, 8, 8, requires_grad=True)
    yg = torch.arange(8) % 4
    term = GlobalSupConTerm(xg, yg, 1.0, 0.07, detach=detach)
    x = torch.randn(6, 3, 8, 8)
    y = torch.arange(6) % 4
    z, logits = model.features_and_logits(x)
    term(model, x, y, z, logits).backward()
    if detach:
        assert xg.grad is None
    else:
        assert xg.grad is not None and float(xg.grad.abs().sum()) > 0


def test_a_provided_local_set_above_its_own_ipc_is_taken(cfg, tmp_path):
    """--local-data virtual at a run IPC above FedLGD's own: a client trains on the whole
    provided set plus the global one, more images than it holds, and its replies count."""
    fed = make_toy_federation(num_clients=2, n_train=8)
    c = dataclasses.replace(cfg, rounds=3, local_data="virtual", ipc=2,
                            method_args={**SMALL, "ipc": 1})
    run_experiment(c, out=tmp_path / "v", fed=fed)
    rounds = [json.loads(line) for line in (tmp_path / "v" / "metrics.jsonl").open()]
    assert [r.get("rejected", {}) for r in rounds] == [{}, {}, {}]


def test_class_grad_variant_uploads_gradients(cfg, tmp_path):
    fed = make_toy_federation(num_clients=2)
    c = dataclasses.replace(cfg, rounds=1, method_args={**SMALL, "gm_target": "class_grad"})
    s = run_experiment(c, out=tmp_path / "g", fed=fed)
    assert s["bytes_by_kind"]["gradients"]["up"] > 0


def test_bad_option_named(cfg, toy_fed, tmp_path):
    with pytest.raises(ValueError, match="gm_target"):
        run_experiment(dataclasses.replace(cfg, method_args={"gm_target": "magic"}),
                       out=tmp_path / "x", fed=toy_fed)


def test_client_sets_read_and_write_the_stored_form():
    """A client's typed state holds its local set and the global one it was sent; its state
    Message keeps the names checkpoints and Flower nodes hold ("local", "global")."""
    lx, ly = torch.randn(2, 3, 4, 4), torch.tensor([0, 1])
    gx, gy = torch.randn(4, 3, 4, 4), torch.tensor([0, 0, 1, 1])
    state = Message({"synthetic_images": {"local": lx}, "synthetic_labels": {"local": ly}})
    sets = ClientSets.load(state)
    assert sets.global_set is None and torch.equal(sets.training_set()[0], lx)
    assert sets.receipt(Message(meta={"version": 3})) == {"version": 3, "has_global": False}
    sets.receive(Message({"synthetic_images": {"global": gx}, "synthetic_labels": {"global": gy}},
                         {"version": 3}))
    assert torch.equal(sets.training_set()[1], torch.cat([ly, gy]))
    sets.save(state)
    assert torch.equal(state.arrays["synthetic_images"]["global"], gx)
    assert torch.equal(state.arrays["synthetic_labels"]["local"], ly)
    assert ClientSets.load(state).receipt(Message(meta={"version": 3}))["has_global"]


def test_warmup_random_networks_differ_by_seed(toy_fed, tiny_cfg):
    """The warm-up draws a fresh random network per seed (not the run's one initial model)."""
    env = build_env(tiny_cfg, toy_fed, torch.device("cpu"))
    alg = make_algorithm("fedlgd", env, {})
    a, b, a2 = alg._random_model(1), alg._random_model(2), alg._random_model(1)
    pa, pb, pa2 = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, a2))
    assert not torch.equal(pa, pb)
    assert torch.equal(pa, pa2)

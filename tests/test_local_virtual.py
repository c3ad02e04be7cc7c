"""One owner of local virtual data: FedLGD's warm-up and `--local-data virtual` agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fedvl.run.assemble as assemble
from fedvl.config import RunConfig
from fedvl.distill.client_sets import VirtualSetSpec, client_virtual_set, owned_ipc
from fedvl.models.base import build_model
from fedvl.run.experiment import run_experiment

LGD = {"ipc": 2, "server_ipc": 2, "warmup_steps": 3, "local_dm_steps": 1, "server_gm_steps": 1,
       "refresh_period": 2, "refresh_count": 1, "batch_real": 4}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fedlgd_warmup_equals_local_virtual_data_for_the_same_setting(cache, toy_fed,
                                                                      tmp_path):
    base = RunConfig(method="fedlgd", rounds=3, batch_size=8, lr=0.05, momentum=0.0,
                     model_args={"width": 8, "depth": 2, "norm": "instance"},
                     method_args=dict(LGD))
    own = run_experiment(base, out=tmp_path / "own", fed=toy_fed)
    virtual = dataclasses.replace(base, local_data="virtual", ipc=2, virtual_steps=3,
                                  virtual_batch_real=4, virtual_init="real")
    pre = run_experiment(virtual, out=tmp_path / "pre", fed=toy_fed)
    for key in ("per_client_accuracy", "per_client_loss", "bytes_up", "bytes_down"):
        assert own[key] == pre[key], key


def test_client_set_is_cached_per_client_and_keyed_by_its_data(cache, toy_fed):
    c = toy_fed.clients[0]

    def model(seed: int) -> torch.nn.Module:
        return build_model("convnet", 3, 4, 8, seed=seed, width=8, depth=2)

    spec = VirtualSetSpec(ipc=2, steps=2, batch_real=4)
    a = client_virtual_set(c.x_train, c.y_train, 4, model, spec, run_seed=0, client=0)
    b = client_virtual_set(c.x_train, c.y_train, 4, model, spec, run_seed=0, client=0)
    assert b.meta.get("cached") and torch.equal(a.images, b.images)
    assert len(list(cache.glob("local-virtual-*.pt"))) == 1
    # Other data (e.g. another cap) or another seed never reuse the cached set.
    d = client_virtual_set(c.x_train[:-4], c.y_train[:-4], 4, model, spec, run_seed=0, client=0)
    e = client_virtual_set(c.x_train, c.y_train, 4, model, spec, run_seed=1, client=0)
    assert not d.meta.get("cached") and not e.meta.get("cached")
    assert len(list(cache.glob("local-virtual-*.pt"))) == 3


def test_flower_node_distils_only_its_own_client(cache, monkeypatch):
    pytest.importorskip("flwr")
    from fedvl.flower.node import load_partition

    calls = []
    original = assemble.client_virtual_set

    def counting(x, y, *args, **kw):
        calls.append(len(y))
        return original(x, y, *args, **kw)

    monkeypatch.setattr(assemble, "client_virtual_set", counting)
    cfg = RunConfig(benchmark="digits-offline", train_cap=60, test_cap=20, local_data="virtual",
                    ipc=1, virtual_steps=1, virtual_batch_real=4,
                    model_args={"width": 8, "depth": 2, "norm": "instance"})
    data, _, info, _, _ = load_partition(cfg, 2)
    assert calls == [60]
    assert info["local_data"] == "virtual" and data.x_real is not None
    ipc = owned_ipc(data.y_real, 10, 1)
    assert data.y_train.tolist() == [c for c, n in enumerate(ipc) for _ in range(n)]

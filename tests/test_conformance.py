"""Every registered method (and every BASE+ADDON composition) keeps the engine's contract.

For each: the server state survives torch.save/load, only the payload kinds the method declares
travel in each direction, a run interrupted and resumed from its checkpoint ends with the same
numbers as an uninterrupted one, and every client state survives Flower's record format.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.registry import ALGORITHMS
from fedvl.run.experiment import resume_experiment, run_experiment
from tests.conftest import make_toy_federation

# Small settings for methods whose defaults are sized for real runs.
SMALL_ARGS = {
    "fedlgd": {"ipc": 2, "server_ipc": 2, "warmup_steps": 2, "local_dm_steps": 1,
               "server_gm_steps": 1, "refresh_period": 1, "refresh_count": 2, "batch_real": 4,
               "dsa": False},
    "fedvck": {"ipc": 2, "steps": 2, "batch_real": 4, "server_epochs": 2, "server_batch": 16,
               "topk": 2, "dsa": False},
    "feddm": {"ipc": 2, "steps": 2, "batch_real": 4, "server_epochs": 1, "server_batch_size": 8},
    "desa": {"ipc": 2, "anchor_steps": 2, "batch_real": 4, "dsa": False},
    "feddf": {"public_batch": 8},
    "fedgen": {"server_steps": 2, "server_batch": 8, "hidden_dim": 16, "gen_batch": 8},
}
# Run settings some methods need (FedDF distils on an unlabelled public set).
RUN_EXTRA = {"feddf": {"public": "digits-offline", "public_size": 16}}
VIRTUAL = {"virtual_per_class": 4}


def _args(name: str) -> dict:
    base, _, addon = name.partition("+")
    out = dict(SMALL_ARGS.get(base, {}))
    cls = ALGORITHMS.get(name)
    fields = {f.name for f in dataclasses.fields(cls.Params)}
    if "virtual_per_class" in fields:
        out.update(VIRTUAL)
    return out


def _cfg(name: str, rounds: int = 3) -> RunConfig:
    return RunConfig(method=name, method_args=_args(name), rounds=rounds, batch_size=8, lr=0.05,
                     momentum=0.0, client_ratio=0.67,
                     model_args={"width": 8, "depth": 2, "norm": "instance"},
                     **RUN_EXTRA.get(name, {}))


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=24, n_test=12)


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_declared_kinds_state_and_resume(name, fed, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = _cfg(name)
    full = run_experiment(cfg, out=tmp_path / "full", fed=fed)
    # Every honest reply (and peer message) passes the method's own reply check.
    assert full["rejected_replies"] == [] and full["skipped_rounds"] == [], name

    # Only declared kinds travel, per direction.
    declared = ALGORITHMS.get(name).declared_kinds()
    for kind, by_dir in full["bytes_by_kind"].items():
        for direction in ("down", "up", "peer"):
            if by_dir.get(direction, 0) > 0:
                assert kind in declared[direction], (name, kind, direction)

    # The server state is plain data that survives torch.save/load.
    ck = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    buf = io.BytesIO()
    torch.save(ck["server_state"], buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=True)
    assert _equal(again, ck["server_state"]), name

    # Interrupted inside round 2 (after round 1 was checkpointed), then resumed.
    cls = ALGORITHMS.get(name)
    original = cls.aggregate

    def crashing(self, state, ctx, replies):
        if ctx.round == 2:
            raise KeyboardInterrupt
        return original(self, state, ctx, replies)

    monkeypatch.setattr(cls, "aggregate", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out=tmp_path / "cut", fed=fed)
    monkeypatch.setattr(cls, "aggregate", original)
    from fedvl.run import assemble

    monkeypatch.setattr(assemble, "build_federation", lambda c: fed)
    resumed = resume_experiment(tmp_path / "cut")
    for key in ("per_client_accuracy", "per_client_loss", "bytes_up", "bytes_down"):
        assert resumed[key] == full[key], (name, key)


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_client_state_survives_flower_records(name, fed, tmp_path, monkeypatch):
    records = pytest.importorskip("fedvl.flower.records")
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    run_experiment(_cfg(name, rounds=2), out=tmp_path / "r", fed=fed)
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    for cid, (arrays, meta) in ck["client_states"].items():
        state = Message(arrays, meta)
        back = records.from_recorddict(records.to_recorddict(state, records.STATE),
                                       records.STATE)
        assert back.meta == state.meta, (name, cid)
        assert set(back.arrays) == set(state.arrays), (name, cid)
        for kind, tensors in state.arrays.items():
            assert list(back.arrays[kind]) == list(tensors), (name, cid, kind)
            for n, t in tensors.items():
                b = back.arrays[kind][n]
                assert b.dtype == t.dtype and torch.equal(b, t.cpu()), (name, cid, kind, n)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k])
                                                                     for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y)
                                                               for x, y in zip(a, b))
    return a == b

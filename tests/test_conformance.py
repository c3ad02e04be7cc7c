"""Every registered method (and every add-on, on FedAvg) keeps the engine's contract.

For each: the server state survives torch.save/load, only the payload kinds the method declares
travel in each direction, a run interrupted and resumed from its checkpoint ends with the same
numbers as an uninterrupted one, and every client state survives Flower's record format.
Every other BASE+ADDON composition builds, runs one round with honest replies only, and sends
only the kinds it declares. Both runs make every tensor on the device it is used on
(`cpu_as_device`: what crashed on a GPU fails here).
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from fedvl.core.message import Message
from fedvl.registry import ALGORITHMS
from fedvl.run.experiment import run_experiment
from tests.conftest import (
    COMPOSED,
    METHODS,
    cpu_as_device,
    make_toy_federation,
    resumed_after_crash,
    small_cfg,
)


@pytest.fixture(scope="module")
def fed():
    """Three clients with 24 training images each."""
    return make_toy_federation(num_clients=3, n_train=24, n_test=12)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.usefixtures("tmp_cache")
def test_declared_kinds_state_and_resume(name, fed, tmp_path, monkeypatch):
    cfg = small_cfg(name)
    # Clients inline, every tensor factory checked for its device (a GPU's crash, on the CPU).
    with cpu_as_device():
        full = run_experiment(dataclasses.replace(cfg, workers=1), out=tmp_path / "full", fed=fed)
    # Every honest reply (and peer message) passes the method's own reply check.
    assert full["rejected_replies"] == [] and full["skipped_rounds"] == [], name

    _only_declared_kinds(name, full)

    # The server state is plain data that survives torch.save/load.
    ck = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    buf = io.BytesIO()
    torch.save(ck["server_state"], buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=True)
    assert _equal(again, ck["server_state"]), name

    # Interrupted inside round 2 (after round 1 was checkpointed), then resumed.
    resumed = resumed_after_crash(cfg, fed, tmp_path / "cut", monkeypatch)
    for key in ("per_client_accuracy", "per_client_loss", "bytes_up", "bytes_down"):
        assert resumed[key] == full[key], (name, key)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.usefixtures("tmp_cache")
def test_client_state_survives_flower_records(name, fed, tmp_path):
    records = pytest.importorskip("fedvl.flower.records")
    run_experiment(small_cfg(name, rounds=2), out=tmp_path / "r", fed=fed)
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


@pytest.mark.parametrize("name", COMPOSED)
@pytest.mark.usefixtures("tmp_cache")
def test_composition_builds_and_runs_a_round(name, fed, tmp_path):
    with cpu_as_device():
        out = run_experiment(dataclasses.replace(small_cfg(name, rounds=1), workers=1),
                             out=tmp_path / "r", fed=fed)
    assert out["rounds"] == 1 and out["method"] == name
    assert out["rejected_replies"] == [] and out["skipped_rounds"] == [], name
    _only_declared_kinds(name, out)


def _only_declared_kinds(name: str, summary: dict) -> None:
    """Only the payload kinds `name` declares travelled, per direction."""
    declared = ALGORITHMS.get(name).declared_kinds()
    for kind, by_dir in summary["bytes_by_kind"].items():
        for direction in ("down", "up", "peer"):
            if by_dir.get(direction, 0) > 0:
                assert kind in declared[direction], (name, kind, direction)


def _equal(a, b) -> bool:
    """Equal nested state: same types, dtypes and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k])
                                                                     for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y)
                                                               for x, y in zip(a, b))
    return a == b

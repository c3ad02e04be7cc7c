"""The peer adapters of `fedvl perf`: availability probes and a tiny run of each peer.

A peer's run needs its framework installed for the interpreter `peers.default_python(name)`
picks ($FEDVL_PEER_PYTHON_<NAME>, else this one); without it the run test skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedvl.perf import peers
from fedvl.perf.workload import Workload


def _tiny_arrays(path: Path, clients: int = 2, n_train: int = 16, n_test: int = 8,
                 num_classes: int = 4, size: int = 8) -> Path:
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {"num_classes": np.array(num_classes)}
    for k in range(clients):
        for key, n in ((f"x{k}", n_train), (f"xt{k}", n_test)):
            arrays[key] = rng.standard_normal((n, 3, size, size)).astype(np.float32)
        arrays[f"y{k}"] = rng.integers(0, num_classes, n_train).astype(np.int64)
        arrays[f"yt{k}"] = rng.integers(0, num_classes, n_test).astype(np.int64)
    np.savez(path, **arrays)
    return path


def test_peer_names_and_commands() -> None:
    assert peers.PEERS == ("pfl", "blazefl")
    cmd = peers.command("pfl", "/py", "{}", "a.npz", "o.json", 3)
    assert cmd[:3] == ["/py", "-m", "torch.distributed.run"]
    assert "--nproc_per_node=3" in cmd and cmd[-4:] == ["{}", "a.npz", "o.json", "3"]
    cmd = peers.command("blazefl", "/py", "{}", "a.npz", "o.json", 2)
    assert cmd == ["/py", "-m", "fedvl.perf.peer_blazefl", "{}", "a.npz", "o.json", "2"]
    with pytest.raises(ValueError):
        peers.command("nope", "/py", "{}", "a.npz", "o.json", 1)


@pytest.mark.parametrize("python", ["/nonexistent/python3", "/bin/false"])
@pytest.mark.parametrize("name", peers.PEERS)
def test_unavailable_gives_a_reason(name: str, python: str) -> None:
    why = peers.unavailable(name, python)
    assert isinstance(why, str) and name in why and "\n" not in why
    with pytest.raises(RuntimeError):
        peers.version(name, python)


def test_unknown_peer_is_unavailable() -> None:
    assert "unknown peer" in (peers.unavailable("flute", sys.executable) or "")


@pytest.mark.slow(seconds=5)
@pytest.mark.parametrize("name", peers.PEERS)
def test_peer_runs_tiny_workload(name: str, tmp_path: Path) -> None:
    python = peers.default_python(name)
    why = peers.unavailable(name, python)
    if why is not None:
        pytest.skip(why)
    w = Workload(clients=2, train_per_client=16, test_per_client=8, width=4, depth=1,
                 batch_size=8, rounds=2, seed=3)
    arrays = _tiny_arrays(tmp_path / "arrays.npz")
    out = tmp_path / "row.json"
    cmd = peers.command(name, python, w.to_json(), str(arrays), str(out), 2)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(out.read_text())
    starts, ends = row["round_starts"], row["round_ends"]
    assert len(starts) == len(ends) == 2
    times = [t for pair in zip(starts, ends) for t in pair]
    assert times == sorted(times) and starts[0] < ends[0] < ends[1]
    assert 0.0 <= row["accuracy"] <= 1.0
    assert row["version"] == peers.version(name, python)
    assert row["setting"] and "\n" not in row["setting"]

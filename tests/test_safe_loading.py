"""No file fedvl reads can run code: crafted pickles are refused with one line, nothing runs.

Each crafted file holds an object whose `__reduce__` would create a marker file when
unpickled; the property is that the marker never appears and the error is one line naming
the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from fedvl.cli import main
from fedvl.config import RunConfig, dump_yaml
from fedvl.distill.synthetic import SyntheticSet
from fedvl.safeload import UnsafeFileError, load_torch, plain


class Payload:
    """Creates `marker` when unpickled (what an attacker's file would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _crafted(path: Path, marker: Path, zip_format: bool) -> None:
    """A checkpoint-looking file that runs code when loaded with the full unpickler."""
    obj = {"round": 0, "server_state": Payload(marker)}
    if zip_format:
        torch.save(obj, path)
    else:
        path.write_bytes(pickle.dumps(obj))


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch-zip", "raw-pickle"])
def test_crafted_checkpoint_is_refused_on_resume_and_runs_nothing(tmp_path, capsys, zip_format):
    """`fedvl run --resume DIR` with a crafted checkpoint.pt: one line naming it, no marker."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = RunConfig(method="fedavg", rounds=2, train_cap=8, test_cap=4,
                    model_args={"width": 4, "depth": 1})
    dump_yaml(cfg, run / "config.yaml")
    marker = tmp_path / "MARKER"
    _crafted(run / "checkpoint.pt", marker, zip_format)
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert err.count("\n") == 1 and err.startswith("fedvl: error: checkpoint ")
    assert str(run / "checkpoint.pt") in err and "refused" in err
    # The run directory is left as it was for the user to inspect.
    assert (run / "checkpoint.pt").exists()


def test_crafted_synthetic_set_is_refused(tmp_path):
    """`SyntheticSet.load` (fedvl distill's output, fedvl privacy's input) runs nothing."""
    marker = tmp_path / "MARKER"
    path = tmp_path / "synthetic.pt"
    torch.save({"format": "fedvl-synthetic-v1", "images": Payload(marker)}, path)
    with pytest.raises(UnsafeFileError, match="synthetic set file .*synthetic.pt.*refused"):
        SyntheticSet.load(path)
    assert not marker.exists()


def test_crafted_local_virtual_cache_is_recomputed_not_run(tmp_path, monkeypatch):
    """A crafted file in the local-virtual-set cache is deleted and recomputed, never run."""
    from fedvl.distill import client_sets
    from fedvl.models.base import build_model

    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 1, 8, 8, generator=g), torch.arange(20) % 2
    spec = client_sets.VirtualSetSpec(ipc=1, steps=1, init="noise", batch_real=2)

    def model(seed: int) -> torch.nn.Module:
        return build_model("convnet", 1, 2, 8, seed=seed, width=4, depth=1)

    first = client_sets.client_virtual_set(x, y, 2, model, spec, 0, 0)
    (cached,) = (tmp_path / "cache").glob("local-virtual-*.pt")
    marker = tmp_path / "MARKER"
    torch.save({"images": Payload(marker), "labels": y}, cached)
    again = client_sets.client_virtual_set(x, y, 2, model, spec, 0, 0)
    assert not marker.exists()
    assert torch.equal(first.tensors()[0], again.tensors()[0])


def test_plain_makes_numpy_values_loadable(tmp_path):
    """What fedvl writes (numpy scalars and arrays included) loads with the safe unpickler."""
    ck = {"round": np.int64(3), "loss": np.float32(0.5), "hist": [{"a": np.arange(3)}],
          "t": (torch.ones(2), np.bool_(True))}
    torch.save(plain(ck), tmp_path / "ck.pt")
    back = load_torch(tmp_path / "ck.pt", "checkpoint")
    assert back["round"] == 3 and isinstance(back["round"], int)
    assert torch.equal(back["hist"][0]["a"], torch.arange(3))
    assert back["t"][1] is True

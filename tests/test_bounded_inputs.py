"""Inputs past every sensible size: one clear line, bounded memory, nothing lost.

Huge caps are clipped before data are built, values no float32 holds are refused with the
config, a diverging run stops with one line and keeps its last checkpoint, a full disk names
the file, error lines stay short, and labels out of range are named before a model is built.
"""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest
import torch

from fedvl.algorithms.fedavg import FedAvg
from fedvl.cli import main
from fedvl.data.sources import MAX_CAP, DataOptions
from fedvl.options import ERROR_LINE_LIMIT

TINY = ["--method", "fedavg", "--train-cap", "20", "--test-cap", "10", "--width", "4",
        "--depth", "1", "--batch-size", "8", "--workers", "1", "--quiet"]


def _one_error_line(err: str) -> str:
    """The single `fedvl: error:` line of stderr (log warnings may precede it)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("fedvl: error: ")]
    assert len(lines) == 1 and err.endswith(lines[0] + "\n"), err
    assert len(lines[0]) <= ERROR_LINE_LIMIT and lines[0].isprintable(), lines[0]
    return lines[0]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))


def test_huge_caps_are_clipped_before_anything_is_built(monkeypatch):
    """`--train-cap 99999999999999999999`: clipped to the data size before anything is built."""
    opts = DataOptions(train_cap=10**20, test_cap=10**30)
    assert opts.train_cap == MAX_CAP and opts.test_cap == MAX_CAP
    from fedvl.data import embedded

    # A small limit keeps the test fast; the rule (render at most the limit) is the same.
    monkeypatch.setattr(embedded, "MAX_PER_CLIENT", 30)
    fed = embedded.digits_offline(DataOptions(train_cap=10**20, test_cap=10**20,
                                              domains=["printed-clean"]))
    (client,) = fed.clients
    assert client.num_train == 30 and len(client.y_test) == 30
    assert fed.info["train_cap_clipped_to"] == 30 and fed.info["test_cap_clipped_to"] == 30
    small = embedded.digits_offline(DataOptions(train_cap=20, test_cap=10,
                                                domains=["printed-clean"]))
    assert "train_cap_clipped_to" not in small.info and small.clients[0].num_train == 20


def test_huge_caps_pass_the_dry_run_through_the_command_line(capsys, monkeypatch):
    """`fedvl run --train-cap 99999999999999999999 --dry-run`: a passing check, not an error."""
    from fedvl.data import embedded

    monkeypatch.setattr(embedded, "MAX_PER_CLIENT", 30)
    argv = ["run", "--method", "fedavg", "--width", "4", "--depth", "1", "--train-cap",
            "99999999999999999999", "--test-cap", str(2**64), "--dry-run"]
    assert main(argv) == 0
    assert "passed every check" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--lr", "1e308"), ("--lr", "inf"), ("--lr", "nan"),
                                         ("--weight-decay", "1e39"), ("--alpha", "-inf")])
def test_non_finite_or_overflowing_settings_fail_the_dry_run(capsys, flag, value):
    """Values that are infinite in float32 are refused by the config check, one line."""
    assert main(["run", *TINY, f"{flag}={value}", "--dry-run"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert flag.lstrip("-").replace("-", "_") in line and "finite" in line


def test_a_diverging_run_stops_with_one_line_and_keeps_its_checkpoint(short_tmp, capsys,
                                                                       monkeypatch):
    """Training that turns NaN at round 1: exit 2, one line, round 0's checkpoint resumable."""
    original = FedAvg.client_update
    calls = []

    def blowing_up(self, msg, client):
        reply = original(self, msg, client)
        calls.append(1)
        if len(calls) > 5:   # round 0's five clients train normally
            for t in reply.arrays["weights"].values():
                t.fill_(float("nan"))
        return reply

    monkeypatch.setattr(FedAvg, "client_update", blowing_up)
    out = short_tmp / "run"
    assert main(["run", *TINY, "--rounds", "3", "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "training diverged at round 1" in line and "checkpoint of round 0 kept" in line
    assert f"fedvl run --resume {out}" in line
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ck["round"] == 0 and not (out / "summary.json").exists()
    monkeypatch.setattr(FedAvg, "client_update", original)
    assert main(["run", "--resume", str(out), "--quiet"]) == 0


def test_divergence_in_the_first_round_leaves_nothing(tmp_path, capsys):
    """`--lr 1e30`: every reply is NaN in round 0; one line, nothing to resume, nothing left."""
    out = tmp_path / "run"
    assert main(["run", *TINY, "--lr", "1e30", "--rounds", "2", "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "training diverged at round 0" in line and "nothing is kept" in line
    assert not out.exists()


def test_full_disk_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """No space left while writing round 1's checkpoint: one line naming it; round 0's is kept."""
    real = Path.write_bytes
    writes = []

    def full(self, data):
        if self.name == "checkpoint.pt.tmp":
            writes.append(1)
            if len(writes) > 1:
                raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    out = tmp_path / "run"
    assert main(["run", *TINY, "--rounds", "2", "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"cannot write '{out / 'checkpoint.pt'}': No space left on device" in line
    assert torch.load(out / "checkpoint.pt", weights_only=True)["round"] == 0
    assert not (out / "checkpoint.pt.tmp").exists()
    monkeypatch.setattr(Path, "write_bytes", real)
    assert main(["run", "--resume", str(out), "--quiet"]) == 0


def test_argparse_errors_are_one_bounded_line(capsys):
    """A value argparse itself refuses (not a number) is one short line too, not a usage dump."""
    with pytest.raises(SystemExit) as e:
        main(["run", "--lr", "x" * 100_000])
    assert e.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "argument --lr: invalid float value" in line


def test_a_100000_character_value_gives_a_short_error_line(capsys):
    """A 100,000-character `--domains` is elided in the error, not echoed whole."""
    assert main(["run", *TINY, "--domains", "x" * 100_000, "--dry-run"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "unknown digits-offline domain" in line and "…" in line
    assert "allowed: handwritten" in line   # the tail (what is allowed) survives the cut


def _npz_domain(path: Path, y_train: np.ndarray, class_names: list[str] | None = None) -> None:
    """A tiny npz-domains file with the given training labels."""
    rng = np.random.default_rng(0)
    n = len(y_train)
    arrays = {"x_train": rng.integers(0, 256, (n, 8, 8), dtype=np.uint8), "y_train": y_train,
              "x_test": rng.integers(0, 256, (2, 8, 8), dtype=np.uint8),
              "y_test": np.array([0, 1])}
    if class_names is not None:
        arrays["class_names"] = np.array(class_names)
    np.savez(path, **arrays)


@pytest.mark.parametrize("names", [None, ["a", "b"]], ids=["inferred classes", "class_names"])
def test_label_out_of_range_names_the_label_and_the_range(tmp_path, capsys, names):
    """Labels of 10^7 in an npz-domains file: the error names the label and the allowed range."""
    _npz_domain(tmp_path / "d1.npz", np.array([0, 1, 0, 1]), names)
    _npz_domain(tmp_path / "d2.npz", np.array([0, 1, 10**7, 1]), names)
    argv = ["run", *TINY, "--benchmark", "npz-domains", "--data-dir", str(tmp_path),
            "--dry-run"]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "d2.npz" in line and "10000000" in line and "0..1" in line
    assert "model" not in line

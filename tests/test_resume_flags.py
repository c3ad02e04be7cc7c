"""`--resume` never ignores a flag: `--rounds N` extends a run to the numbers of an N-round run,
any other changed setting is refused with one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedvl.cli import main

TINY = ["--benchmark", "digits-offline", "--train-cap", "20", "--test-cap", "10", "--width", "8",
        "--depth", "2", "--quiet"]
# Wall-clock figures differ between any two runs; everything else must not.
TIMING = {"seconds", "client_seconds", "eval_seconds", "time", "wall_seconds", "round_seconds",
          "time_by_phase", "round_time_by_phase", "client_seconds_summed", "run_dir",
          "setup_seconds"}


def records(run: Path) -> list[dict]:
    """metrics.jsonl without its timing keys."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def summary(run: Path) -> dict:
    """summary.json without its timing keys."""
    return {k: v for k, v in json.loads((run / "summary.json").read_text()).items()
            if k not in TIMING}


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    """The single stderr line of a refused command."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("method", [["--method", "fedavg", "--lr-decay", "0.9"],
                                    ["--method", "scaffold"]])
def test_rounds_extends_a_finished_run_to_a_fresh_runs_numbers(tmp_path: Path,
                                                               method: list[str]) -> None:
    short, full = tmp_path / "short", tmp_path / "full"
    assert main(["run", *TINY, *method, "--rounds", "2", "--out", str(short)]) == 0
    assert main(["run", *TINY, *method, "--rounds", "3", "--out", str(full)]) == 0
    # Flags equal to the stored ones are accepted alongside --rounds.
    assert main(["run", "--resume", str(short), "--rounds", "3", "--quiet", *method]) == 0
    assert records(short) == records(full)
    assert summary(short) == summary(full)
    assert "rounds: 3" in (short / "config.yaml").read_text()


def test_changed_flags_are_refused_naming_them(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main(["run", *TINY, "--method", "fedavg", "--rounds", "2", "--out", str(run)]) == 0
    before = (run / "metrics.jsonl").read_text()
    for flags, named in ((["--method", "scaffold"], "--method 'scaffold'"),
                         (["--lr", "0.5"], "--lr 0.5"),
                         (["--method-arg", "mu=0.1"], "--method-arg"),
                         (["--width", "16"], "--model-arg"),
                         (["--out", str(tmp_path / "elsewhere")], "--out")):
        assert main(["run", "--resume", str(run), *flags]) == 2
        line = one_error_line(capsys)
        assert named in line, line
    assert main(["run", "--resume", str(run), "--rounds", "1"]) == 2
    assert "fewer than the 2 rounds" in one_error_line(capsys)
    assert (run / "metrics.jsonl").read_text() == before
    assert "rounds: 2" in (run / "config.yaml").read_text()


def test_flower_resume_refuses_changed_flags(tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("flwr")
    run = tmp_path / "run"
    assert main(["run", *TINY, "--method", "fedavg", "--rounds", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["flower", "simulate", "--resume", str(run), "--rounds", "3"]) == 2
    assert "--rounds 3 differs from its 1" in one_error_line(capsys)

"""Who builds runs from what: the import rules around `fedvl.run`."""

from __future__ import annotations

import ast
from pathlib import Path

import fedvl

SRC = Path(fedvl.__file__).parent


def imported(path: Path) -> set[str]:
    """Every fedvl module a file imports (inside functions too), `from a import b` also as
    `a.b`."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {m for m in out if m.startswith("fedvl")}


def _under(*parts: str) -> list[Path]:
    return sorted(p for part in parts for p in (SRC / part).rglob("*.py"))


def test_flower_builds_its_runs_from_assemble_only():
    for path in _under("flower"):
        runner = {m for m in imported(path) if m.startswith("fedvl.run.experiment")}
        assert not runner, (path.name, runner)


def test_eval_takes_only_whole_runs_from_the_runner():
    # Shadow models (membership inference) are whole runs; everything else comes from assemble.
    for path in _under("eval"):
        runner = {m for m in imported(path) if m.startswith("fedvl.run.experiment.")}
        assert runner <= {"fedvl.run.experiment.run_experiment"}, (path.name, runner)


def test_assemble_does_not_know_the_runner_and_the_layers_below_know_neither():
    assert not {m for m in imported(SRC / "run" / "assemble.py")
                if m.startswith("fedvl.run.experiment")}
    for path in _under("algorithms", "core", "distill", "data", "models", "virtual", "engine"):
        run = {m for m in imported(path) if m == "fedvl.run" or m.startswith("fedvl.run.")}
        assert not run, (path.relative_to(SRC), run)


def test_the_flower_transport_does_not_import_the_server_app():
    assert not {m for m in imported(SRC / "flower" / "transport.py")
                if m.startswith("fedvl.flower.server_app")}

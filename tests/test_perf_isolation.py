"""`fedvl.perf` (its round loops and the peer adapters) is optional: the core never imports it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import fedvl

PACKAGE = Path(fedvl.__file__).parent

# Imports every fedvl module outside fedvl.perf, fills the registries, builds every command's
# parser and runs `fedvl list`, then prints the fedvl.perf modules that came along.
PROBE = """
import contextlib, importlib, io, json, sys
from pathlib import Path
import fedvl
from fedvl.cli import build_parser, main
root = Path(fedvl.__file__).parent
for f in sorted(root.rglob("*.py")):
    parts = f.relative_to(root.parent).with_suffix("").parts
    if parts[:2] == ("fedvl", "perf") or parts[-1] == "__main__":
        continue
    importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
build_parser()
with contextlib.redirect_stdout(io.StringIO()):
    main(["list"])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[:2] == ["fedvl", "perf"])))
"""


def test_the_core_runs_without_importing_perf() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def perf_imports(path: Path) -> list[tuple[int, bool]]:
    """(line, at module level) of every import of fedvl.perf in one source file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "fedvl.perf" or n.startswith("fedvl.perf.") for n in names):
            found.append((node.lineno, id(node) in top))
    return found


def test_only_the_perf_command_imports_perf_and_only_lazily() -> None:
    outside = {str(f.relative_to(PACKAGE)): perf_imports(f) for f in PACKAGE.rglob("*.py")
               if f.relative_to(PACKAGE).parts[0] != "perf"}
    importers = {f: lines for f, lines in outside.items() if lines}
    assert set(importers) == {"cli/perf.py"}
    assert not any(at_top for _, at_top in importers["cli/perf.py"])

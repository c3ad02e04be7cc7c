"""Every benchmark script still starts: `--help` of each in subprocesses, `bash -n` of the shell
scripts, and benchmarks/README.md names every script and every results file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
HARNESS = "provenance.py"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name != HARNESS)
SHELL = sorted(p.name for p in BENCH.glob("*.sh"))

# One interpreter runs the `--help` of several scripts in turn: most import torch and fedvl,
# which cost seconds per process, so a process per script would take minutes on two cores.
# Each script still runs as `__main__` with its own argv, and its exit code is kept.
DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
codes = {}
def text(out):
    s = out.getvalue()
    return s if len(s) < 3000 else s[:1000] + " [...] " + s[-2000:]
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
        codes[path] = {"rc": "returned without exiting", "out": text(out)}
    except SystemExit as e:
        rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        codes[path] = {"rc": rc, "out": text(out)}
    except BaseException:
        codes[path] = {"rc": "raised", "out": text(out) + traceback.format_exc()}
print(json.dumps(codes))
"""


def _run_batch(names: list[str]) -> dict[str, dict]:
    """`--help` of every script in `names` in one fresh interpreter: exit code and output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(BENCH)]))
    p = subprocess.run([sys.executable, "-c", DRIVER, *(f"benchmarks/{n}" for n in names)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0 or not p.stdout.strip():
        return {f"benchmarks/{n}": {"rc": f"driver exit {p.returncode}", "out": p.stderr[-4000:]}
                for n in names}
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def help_results() -> dict[str, dict]:
    """The `--help` results of every script, from two interpreters running side by side."""
    batches = [SCRIPTS[0::2], SCRIPTS[1::2]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        parts = list(pool.map(_run_batch, batches))
    return {k: v for part in parts for k, v in part.items()}


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name: str, help_results: dict[str, dict]) -> None:
    """`python benchmarks/NAME --help` exits 0 and prints a usage line."""
    res = help_results[f"benchmarks/{name}"]
    assert res["rc"] == 0, res["out"]
    assert "usage:" in res["out"], res["out"]


@pytest.mark.parametrize("name", SHELL)
def test_shell_syntax(name: str) -> None:
    """`bash -n` accepts the shell script."""
    p = subprocess.run(["bash", "-n", str(BENCH / name)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_readme_names_every_script_and_result() -> None:
    """The README's table lists every script, and every results file is named on the page."""
    readme = (BENCH / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", readme, flags=re.M))
    assert listed == set(SCRIPTS) | set(SHELL), "README table out of date"
    named = set(re.findall(r"`([\w.-]+\.json)`", readme))
    missing = sorted(p.name for p in (BENCH / "results").glob("*.json") if p.name not in named)
    assert not missing, f"results files the README does not name: {missing}"


def test_write_result_records_provenance(tmp_path: Path, monkeypatch) -> None:
    """write_result writes the command as run from the root, the date, machine and load."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--out", "a b"])
    from provenance import write_result

    out = write_result(tmp_path / "r.json", "here", {"rows": [1], "machine": "there"})
    doc = json.loads(out.read_text())
    assert doc["command"].endswith("python benchmarks/x.py --out 'a b'")
    assert doc["machine"] == "there" and doc["rows"] == [1]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", doc["date"]) and len(doc["load_average_at_end"]) == 3

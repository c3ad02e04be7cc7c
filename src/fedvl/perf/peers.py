"""Peer frameworks `fedvl perf` compares with: pfl-research (Apple) and BlazeFL.

Each peer runs in its own process, possibly under another interpreter than fedvl's (BlazeFL 3
needs a newer Python than pfl accepts): `python` names the interpreter, which must also have
fedvl importable. `command` gives the line that runs the peer on the workload at its fastest
documented CPU setting; the peer writes the same result JSON as fedvl's own engines.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

PEERS: tuple[str, ...] = ("pfl", "blazefl")

_MODULE = {"pfl": "pfl", "blazefl": "blazefl.core"}
_DIST = {"pfl": "pfl", "blazefl": "blazefl"}
_INSTALL = {
    "pfl": "pip install 'pfl==0.6.0' (Python 3.10-3.12, beside torch)",
    "blazefl": "BlazeFL 3 needs Python >= 3.13 with torch and fedvl: see docs/perf-peers.md",
}
# The probe imports what the peer's runner imports (torch, fedvl, the framework), so a reason
# is given here rather than as a traceback from inside the timed run.
_PROBE = ("import importlib.metadata as m, torch, fedvl.perf.workload, {module}; "
          "print(m.version({dist!r}))")
_PROBE_TIMEOUT = 120.0


def default_python(name: str) -> str:
    """The interpreter for peer `name`: $FEDVL_PEER_PYTHON_<NAME> if set, else this one."""
    return os.environ.get(f"FEDVL_PEER_PYTHON_{name.upper()}") or sys.executable


@functools.cache
def _probe(name: str, python: str) -> tuple[str | None, str | None]:
    """(version, None) when `python` can run peer `name`, else (None, reason)."""
    if name not in PEERS:
        return None, f"unknown peer {name!r} (known: {', '.join(PEERS)})"
    code = _PROBE.format(module=_MODULE[name], dist=_DIST[name])
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT, stdin=subprocess.DEVNULL)
    except OSError as e:
        return None, f"{name}: cannot run interpreter {python!r}: {e.strerror or e}"
    except subprocess.TimeoutExpired:
        return None, f"{name}: importing it with {python} took over {_PROBE_TIMEOUT:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return lines[-1].strip(), None
    err = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return None, f"{name} not usable with {python} ({err}): {_INSTALL[name]}"


def unavailable(name: str, python: str) -> str | None:
    """None when peer `name` can run with interpreter `python`, else a one-line reason."""
    return _probe(name, python)[1]


def version(name: str, python: str) -> str:
    """The installed version of peer `name` under `python` (RuntimeError if unavailable)."""
    ver, why = _probe(name, python)
    if ver is None:
        raise RuntimeError(why)
    return ver


def command(name: str, python: str, workload_json: str, arrays: str, out_json: str,
            workers: int) -> list[str]:
    """The command line that runs peer `name` with `workers` parallel workers."""
    args = [workload_json, arrays, out_json, str(workers)]
    if name == "blazefl":
        # One process, `workers` threads of BlazeFL's thread-pool trainer.
        return [python, "-m", "fedvl.perf.peer_blazefl", *args]
    if name == "pfl":
        # torchrun through the same interpreter, so its workers run that interpreter too;
        # --standalone picks a free local rendezvous port (runs may overlap).
        return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                f"--nproc_per_node={workers}", "-m", "fedvl.perf.peer_pfl", *args]
    raise ValueError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")

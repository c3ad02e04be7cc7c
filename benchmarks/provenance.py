"""The shared harness of the benchmark scripts: what every results file starts with (the exact
command, the date, the machine and its load) and how the file is written.

Every script that records a result calls `write_result`, so that a results file can always be
traced to the command that produced it and the conditions it ran under.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Variables that change what a benchmark measures: they belong to the command line.
_ENV_PREFIXES = ("FEDVL_",)
_ENV_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
              "CUDA_VISIBLE_DEVICES")


def command(argv: list[str] | None = None) -> str:
    """The running script's command line, reproducible from the repository root."""
    argv = sys.argv if argv is None else argv
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)]
    cwd = Path.cwd().resolve()
    if cwd == ROOT:
        script = Path(argv[0]).resolve()
        path = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
        return " ".join([*env, "python", shlex.join([str(path), *argv[1:]])])
    # Relative paths among the arguments hold only from where the script ran: say where.
    where = cwd.relative_to(ROOT) if cwd.is_relative_to(ROOT) else cwd
    return " ".join(["cd", shlex.quote(str(where)), "&&", *env, "python", shlex.join(argv)])


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages now."""
    return [round(x, 2) for x in os.getloadavg()]


def machine(detail: str = "") -> str:
    """This machine in a few words (CPU, cores, torch if imported), then `detail`."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    words = [cpu, f"{os.cpu_count()} cores"]
    # The installed metadata names torch's version without importing torch (seconds).
    try:
        words.append(f"torch {metadata.version('torch')}")
    except metadata.PackageNotFoundError:
        pass
    return ", ".join(words + ([detail] if detail else []))


def write_result(out: str | Path, machine: str | dict[str, object],
                 fields: dict[str, object], *, load: bool = True) -> Path:
    """Write a results JSON: the command, the date, `machine`, the load average at the end
    (unless `load` is false) and `fields`, which may override any of them."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    head: dict[str, object] = {"command": command(), "date": time.strftime("%Y-%m-%d"),
                               "machine": machine}
    if load:
        head["load_average_at_end"] = load_average()
    path.write_text(json.dumps({**head, **fields}, indent=1) + "\n")
    return path

"""What every results file starts with: the exact command, the date and the machine's load."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path


def provenance() -> dict[str, object]:
    """{'command', 'date', 'load_average_at_end'} for the running benchmark script."""
    return {"command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
            "date": time.strftime("%Y-%m-%d"),
            "load_average_at_end": list(os.getloadavg())}


def write_result(out: str | Path, machine: str, fields: dict[str, object]) -> None:
    """Write a results JSON: the command as run from the repository root, the date, `machine`
    and `fields`."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    script = f"benchmarks/{Path(sys.argv[0]).name}"
    path.write_text(json.dumps({"command": "python " + shlex.join([script, *sys.argv[1:]]),
                                "date": time.strftime("%Y-%m-%d"), "machine": machine,
                                **fields}, indent=1) + "\n")

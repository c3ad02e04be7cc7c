"""What every results file starts with: the exact command, the date and the machine's load."""

from __future__ import annotations

import os
import shlex
import sys
import time


def provenance() -> dict[str, object]:
    """{'command', 'date', 'load_average_at_end'} for the running benchmark script."""
    return {"command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
            "date": time.strftime("%Y-%m-%d"),
            "load_average_at_end": list(os.getloadavg())}

"""The command line asks libgomp for passive waits before torch loads, and keeps a user's choice."""

from __future__ import annotations

import os
import subprocess
import sys

# `report --help`: a command (so main sets the wait) whose start-up loads no torch.
PROBE = ("import os, sys; from fedvl.cli import main\ntry: main(['report', '--help'])\n"
         "except SystemExit: pass\n"
         "print('SPIN', os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")


def _spin(env_extra: dict[str, str], pre: str = "") -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", pre + PROBE], env=env, capture_output=True,
                         text=True, check=True).stdout
    return next(line for line in out.splitlines() if line.startswith("SPIN"))


def test_cli_sets_passive_waits_unless_the_user_chose_or_torch_is_loaded() -> None:
    assert _spin({}) == "SPIN None PASSIVE"
    assert _spin({"GOMP_SPINCOUNT": "5"}) == "SPIN 5 None"
    # Too late once torch's OpenMP runtime is loaded: nothing is set then.
    assert _spin({}, pre="import torch; ") == "SPIN None None"

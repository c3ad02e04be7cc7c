"""How torch's OpenMP threads wait at a barrier: briefly, not for milliseconds.

libgomp (the OpenMP runtime of torch's CPU builds) lets a thread that reaches a barrier spin
about 300,000 times before it sleeps. On a quiet machine that saves a wake-up; on a shared one
the spinning threads of several processes take turns burning the cores their partners need,
and a server gradient-matching step on 2 threads ran 8.5x slower than with threads that wait
passively (`benchmarks/results/omp-wait-cpu.json`). The command line therefore sets the spin
count before torch is imported; a value the user set in the environment is kept.
"""

from __future__ import annotations

import os
import sys

# libgomp's spin count before a waiting thread sleeps (`benchmarks/omp_wait.py` measures it).
SPIN_VAR, SPIN_COUNT = "GOMP_SPINCOUNT", "10000"
WAIT_VARS = ("OMP_WAIT_POLICY", SPIN_VAR)


def short_spin_waits() -> bool:
    """Set libgomp's spin count for this process unless torch is loaded or the user chose;
    whether it is now set by fedvl."""
    if "torch" in sys.modules or any(v in os.environ for v in WAIT_VARS):
        return False
    os.environ[SPIN_VAR] = SPIN_COUNT
    return True

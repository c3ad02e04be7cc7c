"""How torch's OpenMP threads wait at a barrier: they sleep at once instead of spinning.

libgomp (the OpenMP runtime of torch's CPU builds) lets a thread that reaches a barrier spin
about 300,000 times before it sleeps. On a quiet machine that saves a wake-up; on a shared one
the spinning threads burn the cores that their partner thread and the other processes need. A
server gradient-matching step on 2 threads (median of 3, `benchmarks/results/omp-wait-cpu.json`)
took 186 ms quiet, 1,497 ms beside two busy Python processes and 636 ms beside another torch
job with libgomp's default; with passive waiting 198, 355 and 334 ms (a short spin of 10,000:
192, 507 and 491 ms). The command line therefore asks for passive waiting before torch is
imported; a wait setting the user chose in the environment is kept.
"""

from __future__ import annotations

import os
import sys

POLICY_VAR, POLICY = "OMP_WAIT_POLICY", "PASSIVE"
WAIT_VARS = (POLICY_VAR, "GOMP_SPINCOUNT")


def passive_waits() -> bool:
    """Ask libgomp for passive waiting unless torch is loaded or the user chose a wait setting;
    whether fedvl set it."""
    if "torch" in sys.modules or any(v in os.environ for v in WAIT_VARS):
        return False
    os.environ[POLICY_VAR] = POLICY
    return True

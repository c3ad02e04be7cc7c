"""Keep freed tensor memory inside the process instead of handing it back to the kernel.

With glibc's default settings, every freed block above the (adaptive) mmap threshold and every
large free at the top of the heap goes back to the kernel, and the next training step's
activations fault the same pages in again. On a virtual machine each such page fault is costly:
a 10-client FedAvg round on CIFAR-10 took 1.06 s on one worker (2.7-4.2 million minor page
faults a run), and 0.70 s (0.4-1.1 million) once freed memory stayed in the process
(0.56 against 0.41 s on two workers; `benchmarks/results/allocator-cpu.json`).
`keep_freed_memory` pins glibc's mmap threshold at its maximum (32 MiB, so blocks up to that
size are recycled from the heap) and sets the trim threshold, which PyTorch's CPU tuning guide
gets by swapping in jemalloc or tcmalloc; here it is two `mallopt` calls on the allocator the
process already has. The price is memory that a run freed staying mapped: peak RSS of the
two-worker run rose by about 5 % (583 to 611-625 MiB). Blocks over 32 MiB (whole data
sets) are still mapped and unmapped directly, so memory that a run really frees returns to the
system. Setting `FEDVL_MALLOC=default` keeps glibc's defaults; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

ENV = "FEDVL_MALLOC"
# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above 4 MiB * sizeof(long): 32 MiB on 64-bit systems.
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of the heap that stays mapped; past this, glibc trims it. Setting
# either threshold turns glibc's adaptive thresholds off, so both are set; 64 MiB and 1 GiB
# gave the same round time and peak memory (allocator-cpu.json).
TRIM_THRESHOLD = 64 << 20

_done: bool | None = None
_lock = threading.Lock()


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    # Only glibc has these mallopt parameters (musl and macOS have no such knobs).
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; whether they are now in force."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        _done = False
        if os.environ.get(ENV, "").strip().lower() == "default":
            return False
        libc = _glibc()
        if libc is None:
            return False
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        # mallopt returns 1 on success; a refused value leaves glibc's default in place.
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        return _done

"""Seeds derived from the run seed, so no component depends on global RNG state."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import torch

# torch's global CPU generator is one per process: clients trained on concurrent threads would
# interleave their draws, so every seeded use of it holds this lock.
_GLOBAL_RNG = threading.RLock()


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends only on the integers `parts` (run seed, round, client, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0]
               >> np.uint64(1))


def generator(*parts: int) -> torch.Generator:
    """A torch.Generator seeded by `derive_seed(*parts)`."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def run_seed(seed: int, stream: int) -> int:
    """A 32-bit seed for one run-level stream (the same in every round) of run seed `seed`."""
    return int(np.random.SeedSequence([int(seed), int(stream)]).generate_state(1)[0])


def on_cpu() -> AbstractContextManager[object]:
    """Make the block's tensors and modules on the CPU whatever default device the caller set.

    A no-op when the default already is the CPU: `torch.device` as a context is a function
    mode that every torch call inside then passes through (a DM step that builds a network
    per step measured slower on a GPU with it).
    """
    if torch.get_default_device().type == "cpu":
        return nullcontext()
    return torch.device("cpu")


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block on torch's global RNG seeded with `seed`; the caller's RNG is restored.

    For code that can only draw from the global generator (layer initialisers). One thread at
    a time, so the block's draws depend on `seed` alone whatever runs beside it.
    """
    # Tensors and modules made inside are made on the CPU, whose generator the seed drives,
    # whatever default device the caller set; callers move them where they are used.
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]), on_cpu():
        # torch.manual_seed would also queue a seeding of every uninitialised accelerator
        # backend with a formatted stack trace each (1.3 ms a call, a quarter of building a
        # small ConvNet, which DM does every step); CUDA is seeded when it is in use, as before.
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
        yield

"""Torch CPU threads: resolved once per run so every process of the run uses the same count.

The thread count can change the order of float sums inside convolutions, so two processes
with different counts may disagree in the last bits; a run fixes one count and sends it along.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def resolve_threads(threads: int | None) -> int:
    """`threads`, or this process's current torch thread count when it is not set."""
    return int(threads) if threads else torch.get_num_threads()


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Use `threads` torch CPU threads inside the block, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)

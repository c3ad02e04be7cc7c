"""Torch CPU threads: resolved once per run so every process of the run uses the same count.

The thread count can change the order of float sums inside convolutions, so two processes
with different counts may disagree in the last bits; a run fixes one count and sends it along.
"""

from __future__ import annotations

import os
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


# Every client-side computation (training, peer sharing, evaluation on a client's split) runs on
# one torch thread, on every transport: a client's numbers then do not depend on how many
# workers run beside it or on the machine's core count. Speed comes from running clients
# concurrently (`--workers`), which scales better than intra-op threads on small models.
CLIENT_THREADS = 1


def load_optimizer_modules() -> None:
    """Build a throwaway torch optimiser, so its one-time imports are paid before round 0.

    The first optimiser of a process imports torch's compiler front end (`torch._dynamo`,
    0.8 s on a 2-core CPU); left to the first client's update, those seconds were counted as
    round 0's client training (a FedDM round, whose clients train nothing, showed 6 % of it).
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True, device="cpu")], lr=0.0)


def default_workers(device: torch.device | str, cores: int | None = None) -> int:
    """One worker per CPU core on the CPU; 1 on an accelerator (one device queue)."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type != "cpu":
        return 1
    return max(1, cores if cores is not None else (os.cpu_count() or 1))

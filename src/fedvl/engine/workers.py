"""Clients of a round on concurrent threads, each client on one torch thread.

PyTorch releases the GIL inside its kernels, so threads sharing the process's memory run
clients in parallel without copying data or weights to other processes. A client's result
depends only on its inputs and its own generator, never on the worker that ran it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

from fedvl.engine.threads import CLIENT_THREADS, torch_threads

K = TypeVar("K")
V = TypeVar("V")


def _pin_thread() -> None:
    # A new thread inherits the process-wide count lazily; pin it before its first op.
    torch.set_num_threads(CLIENT_THREADS)


class ClientPool:
    """Runs per-client tasks on `workers` threads (inline when 1); results in input order."""

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def map(self, fn: Callable[[K], V], keys: Iterable[K]) -> dict[K, V]:
        """{key: fn(key)} for every key, computed on the pool, in the order of `keys`.

        The first task to raise cancels the tasks not yet started and re-raises its error.
        """
        keys = list(keys)
        with torch_threads(CLIENT_THREADS):
            if self.workers == 1 or len(keys) <= 1:
                out: dict[K, V] = {}
                for k in keys:
                    try:
                        out[k] = fn(k)
                    except Exception as e:
                        e.add_note(f"raised by the task of client {k}")
                        raise
                return out
            pool = self._executor()
            # Each task runs in a copy of this thread's context: progress events raised on a
            # worker reach the caller's sink (`fedvl.progress`).
            futures: dict[K, Future[V]] = {
                k: pool.submit(contextvars.copy_context().run, fn, k) for k in keys}
            try:
                done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
                for k, f in futures.items():
                    if f in done and f.exception() is not None:
                        exc = f.exception()
                        if isinstance(exc, Exception):
                            exc.add_note(f"raised by the task of client {k} on a worker thread")
                        raise exc  # type: ignore[misc]
                return {k: f.result() for k, f in futures.items()}
            except BaseException:
                # Ctrl-C or a failed client: nothing new starts; running clients finish.
                for f in futures.values():
                    f.cancel()
                raise

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="fedvl-client",
                                                initializer=_pin_thread)
            return self._pool

    def close(self) -> None:
        """Stop the threads (waits for running tasks); the pool restarts on the next `map`."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

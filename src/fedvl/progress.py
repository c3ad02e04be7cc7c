"""Progress events from inside long work: which round, phase, client and step is running.

Opt-in and without effect on the numbers: code deep inside a run (a client's distillation
loop, the server's gradient matching, an evaluation) calls `emit`, which does nothing unless a
sink was installed with `reporting`. Events are plain dicts, e.g.
`{"phase": "distill", "round": 0, "rounds": 20, "client": "mnist", "client_id": 0,
"num_clients": 5, "step": 40, "total": 100}`; the fields the enclosing `scope`s set come first.

The sink lives in a context variable, so two runs in one process report to their own sinks;
fedvl's worker pools run each task in a copy of the submitting thread's context, so events
raised on worker threads reach the same sink. Every sink is called under a lock: it never runs
on two threads at once. Nothing here draws a random number or touches a tensor.

This module imports nothing of the project, so every layer may report through it.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TextIO

log = logging.getLogger("fedvl")

Event = dict[str, Any]
Sink = Callable[[Event], None]

# The phases fedvl reports, in words for status lines.
PHASE_WORDS = {
    "round": "starting",
    "clients": "clients trained",
    "train": "training",
    "distill": "distilling",
    "refresh": "refreshing local virtual data",
    "server_matching": "server gradient matching",
    "synthesis": "synthesis",
    "evaluate": "evaluating",
    "round_done": "done",
}


class _Guarded:
    """A sink called under a lock; the first exception it raises turns it off (with a warning).

    A display error must not end a run that has computed for an hour.
    """

    def __init__(self, sink: Sink) -> None:
        self.sink, self.lock, self.broken = sink, threading.Lock(), False

    def __call__(self, event: Event) -> None:
        with self.lock:
            if self.broken:
                return
            try:
                self.sink(event)
            except Exception as e:  # noqa: BLE001 - the run goes on without its progress
                self.broken = True
                log.warning("progress callback raised %s: %s; no more progress events this run",
                            type(e).__name__, " ".join(str(e).split())[:200])


_SINK: ContextVar[_Guarded | None] = ContextVar("fedvl_progress_sink", default=None)
_SCOPE: ContextVar[dict[str, Any] | None] = ContextVar("fedvl_progress_scope", default=None)


@contextmanager
def reporting(sink: Sink | None) -> Iterator[None]:
    """Send the events raised inside the block (on fedvl's worker threads too) to `sink`."""
    if sink is None:
        yield
        return
    token = _SINK.set(sink if isinstance(sink, _Guarded) else _Guarded(sink))
    try:
        yield
    finally:
        _SINK.reset(token)


def enabled() -> bool:
    """Whether a sink is listening (callers skip building costly event fields otherwise)."""
    return _SINK.get() is not None


@contextmanager
def scope(**fields: Any) -> Iterator[None]:
    """Add `fields` (round, client, phase, ...) to every event raised inside the block."""
    if _SINK.get() is None:
        yield
        return
    token = _SCOPE.set({**(_SCOPE.get() or {}), **fields})
    try:
        yield
    finally:
        _SCOPE.reset(token)


def emit(phase: str | None = None, **fields: Any) -> None:
    """Send one event (the enclosing scopes' fields, then `fields`) to the sink, if any.

    Without `phase` the event keeps its scope's phase ("synthesis" when none is set).
    """
    sink = _SINK.get()
    if sink is None:
        return
    event = {**(_SCOPE.get() or {}), **fields}
    if phase is not None:
        event["phase"] = phase
    event.setdefault("phase", "synthesis")
    sink(event)


@contextmanager
def heartbeat(every: float = 2.0, **fields: Any) -> Iterator[None]:
    """While the block runs (one call that reports nothing itself, e.g. a library's t-SNE),
    emit an event every `every` seconds with the whole seconds `elapsed`."""
    if _SINK.get() is None:
        yield
        return
    stop, start = threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            emit(elapsed=int(time.monotonic() - start), **fields)
    # The beating thread runs in a copy of this context: it reports to the same sink and scope.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,), daemon=True,
                              name="fedvl-progress-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Ticker:
    """Counts finished pieces of one phase (from any thread) and emits `step`/`total`."""

    def __init__(self, phase: str, total: int, **fields: Any) -> None:
        self.phase, self.total, self.fields = phase, total, fields
        self.done = 0
        self.lock = threading.Lock()

    def start(self) -> None:
        """Emit step 0: the phase has begun."""
        emit(self.phase, step=0, total=self.total, **self.fields)

    def tick(self, **fields: Any) -> None:
        """One more piece finished."""
        if not enabled():
            return
        with self.lock:
            self.done += 1
            step = self.done
        emit(self.phase, step=step, total=self.total, **{**self.fields, **fields})


def describe(event: Event) -> str:
    """One status line for an event, e.g. `round 1/20 · distilling mnist (2/5) · step 40/100`."""
    parts = []
    if "round" in event and event["round"] is not None:
        rounds = event.get("rounds")
        parts.append(f"round {event['round']}/{rounds}" if rounds else f"round {event['round']}")
    phase = str(event.get("phase", ""))
    words = str(event.get("label") or PHASE_WORDS.get(phase, phase))
    client = event.get("client")
    if client is not None and phase not in ("clients", "evaluate", "round_done"):
        cid, n = event.get("client_id"), event.get("num_clients")
        where = f" ({cid + 1}/{n})" if isinstance(cid, int) and n else ""
        words += f" {client}{where}"
    if event.get("model") is not None:
        words += f" · model {event['model']}/{event.get('models', '?')}"
    parts.append(words)
    if event.get("elapsed") is not None:
        parts.append(f"{event['elapsed']} s")
    if "total" in event and event.get("step") is not None:
        unit = event.get("unit", "step")
        parts.append(f"{unit} {event['step']}/{event['total']}"
                     if phase not in ("clients", "evaluate") or "unit" in event
                     else f"{event['step']}/{event['total']}")
    return " · ".join(p for p in parts if p)


class StatusLine:
    """A sink that keeps one status line on a terminal (or prints a line now and then to a file).

    Redrawn at most every `interval` seconds, so a fast loop costs nothing visible; on a
    stream that is not a terminal, one line every `file_interval` seconds, so a log shows the
    run is alive without thousands of lines.
    """

    def __init__(self, prefix: str = "", stream: TextIO | None = None, interval: float = 0.2,
                 file_interval: float = 5.0) -> None:
        self.prefix, self.stream = prefix, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if self.tty else file_interval
        self.last, self.width = 0.0, 0
        self.key: tuple[Any, Any] = (None, None)

    def __call__(self, event: Event) -> None:
        """Show `event` if the last redraw is old enough."""
        now = time.monotonic()
        # A new phase shows at once; steps inside one at most every `interval` seconds.
        key = (event.get("phase"), event.get("label"))
        if now - self.last < self.interval and key == self.key:
            return
        self.last, self.key = now, key
        self.show(describe(event))

    def show(self, text: str) -> None:
        """Write `text` as the status line now."""
        text = f"{self.prefix}{text}"
        if self.tty:
            pad = max(self.width - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the status line (a newline on a terminal)."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
        self.width = 0


class RoundBar:
    """`fedvl run`'s progress bar: whole rounds on the bar, what runs inside one beside it."""

    def __init__(self, rounds: int, desc: str, interval: float = 0.5) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=rounds, desc=desc, unit="round")
        self.interval, self.last = interval, 0.0

    def __call__(self, event: Event) -> None:
        """Advance on a finished round; otherwise show the phase (at most every `interval` s)."""
        if event.get("phase") == "round_done":
            done = int(event["round"]) + 1
            if done > self.bar.n:
                self.bar.update(done - self.bar.n)
            acc = event.get("mean_accuracy")
            self.bar.set_postfix_str("" if acc is None else f"mean_acc={acc:.3f}")
            self.last = time.monotonic()
            return
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        self.last = now
        status = describe({k: v for k, v in event.items() if k not in ("round", "rounds")})
        if event.get("round") is not None and int(event["round"]) > self.bar.n:
            # A resumed run: the bar starts at the rounds already done.
            self.bar.update(int(event["round"]) - self.bar.n)
        self.bar.set_postfix_str(status, refresh=True)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()

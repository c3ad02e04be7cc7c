"""Where a round's time goes: seconds per kind of work, measured from inside the work.

A client task (and the server's `configure` + `aggregate`) runs inside `accumulating()`, which
installs an `Accumulator`; code deep inside it wraps one kind of work in `timed(kind)`
("synthesis": the synthesis loop, virtual-data generators), which adds its seconds to the
innermost accumulator and does nothing when none is installed. A `timed` block inside another
of the same kind is not counted twice.

The accumulator lives in a context variable, so two runs in one process keep their own; fedvl's
worker pools run each task in a copy of the submitting thread's context, so a `timed` block on a
worker thread adds to the accumulator of the task that started it. Nothing here draws a random
number or touches a tensor: timing never changes a run's numbers.

A client's seconds travel to the server in its reply's metadata (`reply_meta`, `with_timing`);
the server reads them with `client_sums`, which ignores values that are not plausible
seconds, so a garbled or hostile value can neither crash the server nor reach a record.
`round_phases` turns a round's measurements into the phases of `metrics.jsonl`'s
`time_by_phase`, and `summary_phases` sums them for `summary.json`.

This module imports nothing of the project, so every layer may time through it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

SYNTHESIS = "synthesis"
# Reply metadata: a client's seconds in one round (its whole update, of which synthesis).
UPDATE_SECONDS, SYNTHESIS_SECONDS = "update_seconds", "synthesis_seconds"
# A reported value above this (about 116 days) is no honest round's.
MAX_SECONDS = 1e7
# The phases of a round, in the order they are shown; they sum to the round's `seconds`.
PHASES = ("client_synthesis", "client_training", "server_synthesis", "server_training",
          "evaluation", "other")
PHASE_WORDS = {"client_synthesis": "client synthesis", "client_training": "client training",
               "server_synthesis": "server synthesis", "server_training": "server training",
               "evaluation": "evaluation", "other": "other"}


class Accumulator:
    """Seconds per kind of work added by `timed` blocks (from any thread); `total`: the wall
    seconds of the `accumulating` blocks it collected for, once they have ended."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.total = 0.0
        self._lock = threading.Lock()

    def add(self, kind: str, seconds: float) -> None:
        """Add `seconds` of work of `kind`."""
        with self._lock:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def get(self, kind: str) -> float:
        """The seconds of `kind` so far."""
        with self._lock:
            return self.seconds.get(kind, 0.0)

    def meta(self) -> dict[str, float]:
        """The reply metadata that carries this block's seconds to the server."""
        # Synthesis on several threads at once could sum past the block's wall time.
        return {UPDATE_SECONDS: self.total, SYNTHESIS_SECONDS: min(self.get(SYNTHESIS),
                                                                   self.total)}


_ACC: ContextVar[Accumulator | None] = ContextVar("fedvl_timing_accumulator", default=None)
_OPEN: ContextVar[frozenset[str]] = ContextVar("fedvl_timing_open", default=frozenset())


@contextmanager
def accumulating(into: Accumulator | None = None) -> Iterator[Accumulator]:
    """Collect the `timed` seconds of the block (its worker threads' too) in `into` (a new
    accumulator when None), adding the block's wall seconds to its `total`."""
    acc = into if into is not None else Accumulator()
    tokens = _ACC.set(acc), _OPEN.set(frozenset())
    start = time.perf_counter()
    try:
        yield acc
    finally:
        acc.total += time.perf_counter() - start
        _OPEN.reset(tokens[1])
        _ACC.reset(tokens[0])


@contextmanager
def timed(kind: str) -> Iterator[None]:
    """Add the block's seconds to the innermost accumulator under `kind` (no-op without one)."""
    acc = _ACC.get()
    if acc is None or kind in _OPEN.get():
        yield
        return
    token = _OPEN.set(_OPEN.get() | {kind})
    start = time.perf_counter()
    try:
        yield
    finally:
        acc.add(kind, time.perf_counter() - start)
        _OPEN.reset(token)


def _seconds(v: Any) -> bool:
    # Exact types: a subclass could redefine the comparisons below.
    return type(v) in (int, float) and 0 <= v <= MAX_SECONDS


def reported(meta: Any) -> tuple[float, float] | None:
    """(update, synthesis) seconds from reply metadata, or None when absent or implausible."""
    if not isinstance(meta, Mapping):
        return None
    total, syn = meta.get(UPDATE_SECONDS), meta.get(SYNTHESIS_SECONDS)
    if not (_seconds(total) and _seconds(syn) and syn <= total):
        return None
    return float(total), float(syn)


def with_timing(reply: Any, *parts: Mapping[str, Any] | None) -> Any:
    """`reply` with the summed seconds of `parts` (each `Accumulator.meta()`) in its metadata;
    a reply without a metadata dict is returned as it is."""
    meta = getattr(reply, "meta", None)
    got = [r for r in map(reported, parts) if r is not None]
    if isinstance(meta, dict) and got:
        meta[UPDATE_SECONDS] = sum(t for t, _ in got)
        meta[SYNTHESIS_SECONDS] = sum(s for _, s in got)
    return reply


def client_sums(replies: Iterable[Any]) -> tuple[float, float]:
    """Summed (update, synthesis) seconds the replies report (implausible values left out)."""
    total = syn = 0.0
    for r in replies:
        try:
            got = reported(getattr(r, "meta", None))
        except Exception:   # noqa: BLE001 - a reply's objects are the sender's to choose
            got = None
        if got is not None:
            total, syn = total + got[0], syn + got[1]
    return total, syn


def round_phases(seconds: float, clients: float, summed: tuple[float, float],
                 server: float, server_synthesis: float, evaluation: float
                 ) -> dict[str, float]:
    """A round's seconds by phase: the clients' wall split in proportion to their summed
    synthesis and other seconds, the server's wall split by its synthesis, the evaluation,
    and the rest of the round ("other": transport, screening, recording)."""
    total, syn = summed   # `client_sums` of the round's replies
    # Clients run in parallel: their summed seconds exceed the wall; only the share is used.
    cs = clients * syn / total if total > 0 else 0.0
    ss = min(server_synthesis, server)
    out = {"client_synthesis": cs, "client_training": clients - cs, "server_synthesis": ss,
           "server_training": server - ss, "evaluation": evaluation}
    out["other"] = max(seconds - sum(out.values()), 0.0)
    return {k: round(max(v, 0.0), 6) for k, v in out.items()}


def summary_phases(history: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's timing keys from the round records (empty when none has `time_by_phase`,
    e.g. rounds recorded before these keys existed)."""
    rows = [(r["round"], r["time_by_phase"]) for r in history
            if isinstance(r.get("time_by_phase"), Mapping)]
    if not rows:
        return {}
    sums = [r["client_seconds_summed"] for r in history
            if isinstance(r.get("client_seconds_summed"), Mapping)]
    return {
        "time_by_phase": {p: round(sum(t.get(p, 0.0) for _, t in rows), 6) for p in PHASES},
        "round_time_by_phase": [{"round": rnd, **t} for rnd, t in rows],
        "client_seconds_summed": {k: round(sum(s.get(k, 0.0) for s in sums), 6)
                                  for k in ("synthesis", "total")},
    }


def shares(phases: Mapping[str, Any]) -> str:
    """One line of where the time went, e.g. `client synthesis 62 %, client training 3 %, ...`
    (phases under 0.5 % of the total left out; "" when nothing was measured)."""
    vals = {p: float(phases.get(p) or 0.0) for p in PHASES}
    total = sum(vals.values())
    if total <= 0:
        return ""
    parts = [f"{PHASE_WORDS[p]} {100 * v / total:.0f} %" for p, v in vals.items()
             if 100 * v / total >= 0.5]
    return ", ".join(parts)

"""Communication ledger: bytes up/down (and peer to peer) per round and per payload kind."""

from __future__ import annotations

from collections import defaultdict

from fedvl.core.message import Message

DIRECTIONS = ("up", "down", "peer")


class Ledger:
    """Counts the bytes of every message the engine carries.

    `up` is client to server, `down` server to client, `peer` client to client (counted once,
    when delivered, even where a relay such as Flower's ServerApp carries it). Peer entries
    appear only in runs that have peer traffic.
    """

    def __init__(self) -> None:
        self.rounds: dict[int, dict[str, dict[str, int]]] = {}

    def _slot(self, rnd: int, direction: str) -> dict[str, int]:
        if direction not in DIRECTIONS:
            raise ValueError(f"ledger direction '{direction}' is unknown; allowed: "
                             f"{', '.join(DIRECTIONS)}")
        return self.rounds.setdefault(rnd, {"up": {}, "down": {}}).setdefault(direction, {})

    def record(self, rnd: int, direction: str, msg: Message) -> None:
        """Add one message's bytes to round `rnd` in direction 'up', 'down' or 'peer'."""
        slot = self._slot(rnd, direction)
        for kind, n in msg.bytes_by_kind().items():
            slot[kind] = slot.get(kind, 0) + n

    def _has_peer(self) -> bool:
        return any("peer" in r for r in self.rounds.values())

    def round_bytes(self, rnd: int) -> dict[str, int]:
        """Total bytes of one round per direction."""
        r = self.rounds.get(rnd, {"up": {}, "down": {}})
        out = {"up": sum(r["up"].values()), "down": sum(r["down"].values())}
        if self._has_peer():
            out["peer"] = sum(r.get("peer", {}).values())
        return out

    def totals(self) -> dict[str, object]:
        """Whole-run totals: bytes_up, bytes_down (bytes_peer) and bytes_by_kind {kind: {dir}}."""
        dirs = DIRECTIONS if self._has_peer() else ("up", "down")
        by_kind: dict[str, dict[str, int]] = defaultdict(lambda: {d: 0 for d in dirs})
        for r in self.rounds.values():
            for d in dirs:
                for k, n in r.get(d, {}).items():
                    by_kind[k][d] += n
        out: dict[str, object] = {f"bytes_{d}": sum(v[d] for v in by_kind.values())
                                  for d in dirs}
        out["bytes_by_kind"] = dict(sorted(by_kind.items()))
        return out

    def state_dict(self) -> dict[int, dict[str, dict[str, int]]]:
        """Serialisable copy for checkpoints."""
        return {r: {d: dict(v) for d, v in x.items()} for r, x in self.rounds.items()}

    def load_state_dict(self, state: dict[int, dict[str, dict[str, int]]]) -> None:
        """Restore from `state_dict`."""
        self.rounds = {int(r): {d: dict(v) for d, v in x.items()} for r, x in state.items()}

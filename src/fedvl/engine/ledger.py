"""Communication ledger: bytes up/down per round and per payload kind."""

from __future__ import annotations

from collections import defaultdict

from fedvl.engine.message import Message


class Ledger:
    """Counts the bytes of every message the engine carries."""

    def __init__(self) -> None:
        self.rounds: dict[int, dict[str, dict[str, int]]] = {}

    def _slot(self, rnd: int, direction: str) -> dict[str, int]:
        return self.rounds.setdefault(rnd, {"up": {}, "down": {}})[direction]

    def record(self, rnd: int, direction: str, msg: Message) -> None:
        """Add one message's bytes to round `rnd` in direction 'up' or 'down'."""
        slot = self._slot(rnd, direction)
        for kind, n in msg.bytes_by_kind().items():
            slot[kind] = slot.get(kind, 0) + n

    def round_bytes(self, rnd: int) -> dict[str, int]:
        """Total up and down bytes of one round."""
        r = self.rounds.get(rnd, {"up": {}, "down": {}})
        return {"up": sum(r["up"].values()), "down": sum(r["down"].values())}

    def totals(self) -> dict[str, object]:
        """Whole-run totals: bytes_up, bytes_down and bytes_by_kind {kind: {up, down}}."""
        by_kind: dict[str, dict[str, int]] = defaultdict(lambda: {"up": 0, "down": 0})
        for r in self.rounds.values():
            for d in ("up", "down"):
                for k, n in r[d].items():
                    by_kind[k][d] += n
        return {
            "bytes_up": sum(v["up"] for v in by_kind.values()),
            "bytes_down": sum(v["down"] for v in by_kind.values()),
            "bytes_by_kind": dict(sorted(by_kind.items())),
        }

    def state_dict(self) -> dict[int, dict[str, dict[str, int]]]:
        """Serialisable copy for checkpoints."""
        return {r: {d: dict(v) for d, v in x.items()} for r, x in self.rounds.items()}

    def load_state_dict(self, state: dict[int, dict[str, dict[str, int]]]) -> None:
        """Restore from `state_dict`."""
        self.rounds = {int(r): {d: dict(v) for d, v in x.items()} for r, x in state.items()}

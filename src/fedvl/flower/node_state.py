"""A node's own client state on its own disk, so that a resumed run finds it again.

Client state (SCAFFOLD's c_i, a local model, FedLGD's local virtual sets) never leaves the
node. Between rounds it lives in Flower's `Context.state`; after every `train` message the
node also writes it to `<state-dir>/<config-key>/partition-<id>/round-<r>.pt`. A resumed run
tells each node the last round of the server's checkpoint, and the node continues from its
latest snapshot of that round or earlier (later snapshots belong to a round the server never
finished and are deleted).

The directory is the node config's `state-dir` (`--node-config "state-dir=/path"`), else the
one the server names for nodes sharing its disk (`fedvl flower simulate`: inside the run
directory), else `$FEDVL_CACHE_DIR/node-state` (default `~/.cache/fedvl/node-state`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedvl.core.message import Message
from fedvl.data.cache import cache_root
from fedvl.engine.recorder import atomic_write

_SNAPSHOT = re.compile(r"round-(\d+)\.pt")


def state_root(node_config: Mapping[str, Any], run: Mapping[str, Any]) -> Path:
    """Where this node keeps client state (node config, then the server's hint, then cache)."""
    if node_config.get("state-dir"):
        return Path(str(node_config["state-dir"])).expanduser()
    if run.get("state-dir"):
        return Path(str(run["state-dir"]))
    return cache_root() / "node-state"


def _folder(root: Path, key: str, pid: int) -> Path:
    return root / key / f"partition-{pid}"


def _snapshots(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    found = (_SNAPSHOT.fullmatch(p.name) for p in folder.iterdir())
    return {int(m.group(1)): folder / m.group(0) for m in found if m}


def save(root: Path, key: str, pid: int, rnd: int, state: Message) -> None:
    """Keep the state after round `rnd`, and the one before it (the server may resume there)."""
    folder = _folder(root, key, pid)
    folder.mkdir(parents=True, exist_ok=True)
    cpu = state.to("cpu")
    atomic_write(folder / f"round-{rnd}.pt",
                 lambda p: torch.save({"round": rnd, "arrays": cpu.arrays, "meta": cpu.meta}, p))
    older = [r for r in _snapshots(folder) if r < rnd]
    keep = {rnd, max(older)} if older else {rnd}
    for r, path in _snapshots(folder).items():
        if r not in keep:
            path.unlink(missing_ok=True)


def restore(root: Path, key: str, pid: int, upto: int) -> Message:
    """The latest state saved at round `upto` or earlier (empty when there is none)."""
    folder = _folder(root, key, pid)
    snaps = _snapshots(folder)
    for r, path in snaps.items():
        if r > upto:
            path.unlink(missing_ok=True)
    usable = [r for r in snaps if r <= upto]
    if not usable:
        return Message()
    ck = torch.load(snaps[max(usable)], map_location="cpu", weights_only=True)
    return Message(ck["arrays"], ck["meta"])

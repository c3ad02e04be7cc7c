"""When a run has diverged: its training produced NaN or Inf, so later rounds cannot recover.

A client whose local training blows up (`--lr 1e30`) sends non-finite weights or a non-finite
loss; the reply check drops them and the round is skipped. When that happens to every reply
of a round, or the valid replies aggregate to NaN/Inf, the rounds after it would be skipped the
same way: the round driver stops the run with one line (`TrainingDiverged`) and keeps the
previous round's checkpoint. One client's bad reply among valid ones is an ordinary rejection,
not a divergence.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# What the reply check says about non-finite values ("holds NaN or Inf values", "must be a
# finite number") and what the driver says when an aggregate is not finite.
NONFINITE_WORDS = ("NaN or Inf", "finite")


class TrainingDiverged(ValueError):
    """Training produced NaN or Inf; the message says where and how to resume."""


def _nonfinite(reason: Any) -> bool:
    return isinstance(reason, str) and any(w in reason for w in NONFINITE_WORDS)


def divergence(record: dict[str, Any]) -> str | None:
    """Why round `record` shows divergence (None when it does not)."""
    loss = record.get("train_loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        return f"the mean training loss is {loss}"
    skipped = record.get("skipped")
    if _nonfinite(skipped):
        return str(skipped)
    rejected = record.get("rejected") or {}
    if rejected and not record.get("participants") and all(map(_nonfinite, rejected.values())):
        name, why = next(iter(rejected.items()))
        return f"every reply held NaN or Inf values (client {name}: {why})"
    return None


def diverged_error(rnd: int, why: str, run_dir: Path | None, kept: int | None
                   ) -> TrainingDiverged:
    """The one-line error of a run stopped at round `rnd`; `kept` is the checkpointed round."""
    head = f"training diverged at round {rnd}: {why}"
    if run_dir is None:
        return TrainingDiverged(f"{head}; lower the learning rate (--lr)")
    if kept is None:
        return TrainingDiverged(f"{head}; no round was completed, so nothing is kept: lower the "
                                "learning rate (--lr) and start again")
    return TrainingDiverged(f"{head}; checkpoint of round {kept} kept in '{run_dir}': lower lr "
                            f"in {run_dir / 'config.yaml'} and resume with `fedvl run --resume "
                            f"{run_dir}`")

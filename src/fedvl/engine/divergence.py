"""When a run has diverged: its training produced NaN or Inf, so later rounds cannot recover.

A client whose local training blows up (`--lr 1e30`) sends non-finite weights (or finite ones
beyond the absolute bound of `fedvl.core.bounds`) or a non-finite loss; the reply check drops
them and the round is skipped. When that happens to every reply of a round (and, with one
client per round, to two clients in a row: one hostile client alone must not stop a run), or
the valid replies aggregate to NaN/Inf, the rounds after it would be skipped the same way: the
round driver stops the run with one line (`TrainingDiverged`) and keeps the previous round's
checkpoint. One client's bad reply among valid ones is an ordinary rejection, not a
divergence.
"""

from __future__ import annotations

from pathlib import Path


class TrainingDiverged(ValueError):
    """Training produced NaN or Inf; the message says where and how to resume."""


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

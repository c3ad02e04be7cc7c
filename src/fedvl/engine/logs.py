"""Experiment logs beside `metrics.jsonl`: TensorBoard event files and offline W&B runs (`--log`).

Every logger receives the same values: per round the numbers of the round's `metrics.jsonl`
row (`round_scalars`: a tag is the row's key, `key/client` for a per-client value) and each
client's ε where the method reports one; at the end of the run the PNG grids of virtual data
that the run saves. The step is the round index. A logger opens at the first round a process
runs, so a resumed run logs only the rounds it runs; TensorBoard also gets that round as its
`purge_step`, which hides whatever an interrupted attempt logged past its last checkpoint.
"""

from __future__ import annotations

import importlib.util
import math
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedvl.defaults import LOG_KINDS
from fedvl.options import ConfigError

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
# The W&B run id of a run directory, kept so a resumed run continues the same W&B run.
WANDB_ID = "fedvl-run-id"
WANDB_PROJECT = "fedvl"

# kind -> (module it needs, the command that installs it)
_PACKAGES = {"tensorboard": ("tensorboard", "pip install 'fedvl[logs]'"),
             "wandb": ("wandb", "pip install wandb")}
# Row keys holding one number, and row keys holding one number per client.
_SCALAR_KEYS = ("mean_accuracy", "global_test_accuracy", "mean_global_accuracy",
                "mean_inter_accuracy", "worst_accuracy", "train_loss", "round_bytes_up",
                "round_bytes_down", "round_bytes_peer")
_CLIENT_KEYS = ("per_client_accuracy", "per_client_loss")


def log_kinds(kinds: Sequence[str] | None) -> list[str]:
    """The distinct log kinds of a `log` option value, in the order given."""
    return list(dict.fromkeys(kinds or ()))


def check_logs(kinds: Sequence[str] | None) -> None:
    """Raise ConfigError for an unknown log kind or one whose package is missing (naming the
    command that installs it)."""
    for kind in log_kinds(kinds):
        if kind not in _PACKAGES:
            raise ConfigError(f"unknown log kind {kind!r}; allowed: {', '.join(LOG_KINDS)}")
        module, install = _PACKAGES[kind]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"--log {kind} needs the {module} package, which is not "
                              f"installed: {install}")


def _number(value: Any) -> float | None:
    """`value` as a float when it is a real number (bools, None and text are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def round_scalars(record: Mapping[str, Any],
                  epsilon: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The logged numbers of one round: its metrics row's, by key, and each client's ε."""
    out: dict[str, float] = {}
    for key in _SCALAR_KEYS:
        if (v := _number(record.get(key))) is not None:
            out[key] = v
    for key in _CLIENT_KEYS:
        for client, value in (record.get(key) or {}).items():
            if (v := _number(value)) is not None:
                out[f"{key}/{client}"] = v
    for client, value in (epsilon or {}).items():
        # ε may be infinite (no guarantee): kept, as summary.json keeps it.
        if (v := _number(value)) is not None and not math.isnan(v):
            out[f"epsilon/{client}"] = v
    return out


def reported_epsilon(report: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """Each client's ε in a method's `report()` (its `privacy` entry; None without DP)."""
    privacy = report.get("privacy")
    epsilon = privacy.get("epsilon") if isinstance(privacy, Mapping) else None
    return epsilon if isinstance(epsilon, Mapping) else None


def read_png(path: Path) -> np.ndarray:
    """A PNG file as an RGB uint8 array (height, width, 3)."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


class _Logger(Protocol):
    """What each kind of log does."""

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Log one round's numbers (tag -> value) at `step`."""

    def images(self, images: dict[str, np.ndarray], step: int) -> None:
        """Log RGB images (name -> height x width x 3 uint8) at `step`."""

    def close(self, failed: bool) -> None:
        """Write out what is buffered and end the log."""


class _TensorBoard:
    """Event files in RUN/tensorboard through torch's SummaryWriter."""

    def __init__(self, run_dir: Path, first_round: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # Old-style scalars (32-bit `simple_value`): TensorBoard's default loader shows no
        # double-precision scalars.
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=first_round)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """One scalar event per tag."""
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, step)
        # Flushed every round: a crash loses no round that reached the checkpoint.
        self.writer.flush()

    def images(self, images: dict[str, np.ndarray], step: int) -> None:
        """One image event per grid, tagged `images/NAME`."""
        for name, array in images.items():
            self.writer.add_image(f"images/{name}", array, step, dataformats="HWC")
        self.writer.flush()

    def close(self, failed: bool) -> None:
        """Flush and close the event file."""
        self.writer.close()


class _Wandb:
    """An offline Weights & Biases run in RUN/wandb (upload it later with `wandb sync`)."""

    def __init__(self, run_dir: Path, first_round: int, config: Mapping[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        folder = run_dir / WANDB_DIR
        folder.mkdir(exist_ok=True)
        id_file = folder / WANDB_ID
        run_id = id_file.read_text().strip() if first_round > 0 and id_file.is_file() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        # Offline whatever WANDB_MODE says: init's arguments take precedence over it.
        self.run = wandb.init(project=WANDB_PROJECT, name=run_dir.name, id=run_id,
                              dir=str(run_dir), mode="offline", config=dict(config),
                              resume="allow")

    def scalars(self, values: dict[str, float], step: int) -> None:
        """One history row per round."""
        self.run.log(dict(values), step=step)

    def images(self, images: dict[str, np.ndarray], step: int) -> None:
        """The grids as `wandb.Image`s, tagged `images/NAME`."""
        self.run.log({f"images/{name}": self.wandb.Image(array, caption=name)
                      for name, array in images.items()}, step=step)

    def close(self, failed: bool) -> None:
        """Finish the run, marked failed (exit code 1) when the run ended with an error."""
        self.run.finish(exit_code=1 if failed else 0)


class RunLogs:
    """The experiment loggers of one run directory, opened at the first round logged."""

    def __init__(self, run_dir: str | Path, kinds: Sequence[str] | None,
                 config: Mapping[str, Any] | None = None) -> None:
        self.dir = Path(run_dir)
        self.kinds = log_kinds(kinds)
        self.config = dict(config or {})
        self.open: list[_Logger] | None = None
        self.last_round: int | None = None   # the last round this process logged

    def __bool__(self) -> bool:
        """Whether the run logs anywhere."""
        return bool(self.kinds)

    def _start(self, first_round: int) -> list[_Logger]:
        """Open every logger, the first round this process logs being `first_round`."""
        if self.open is None:
            check_logs(self.kinds)
            self.open = [_TensorBoard(self.dir, first_round) if kind == "tensorboard"
                         else _Wandb(self.dir, first_round, self.config) for kind in self.kinds]
        return self.open

    def log_round(self, record: Mapping[str, Any],
                  epsilon: Mapping[str, Any] | None = None) -> None:
        """Log one finished round (its metrics row and each client's ε) at step = its round."""
        if not self.kinds:
            return
        rnd = int(record["round"])
        values = round_scalars(record, epsilon)
        for logger in self._start(rnd):
            logger.scalars(values, rnd)
        self.last_round = rnd

    def log_images(self, paths: Mapping[str, Path]) -> None:
        """Log PNG grids (name -> file) at the last round this process logged.

        A process that ran no round (a finished run resumed) logs none: the attempt that ran
        the last round did.
        """
        if not self.kinds or self.open is None or self.last_round is None or not paths:
            return
        images = {name: read_png(p) for name, p in paths.items()}
        for logger in self.open:
            logger.images(images, self.last_round)

    def close(self, failed: bool = False) -> None:
        """Flush and close every open logger (`failed`: the run ended with an error)."""
        loggers, self.open = self.open or [], None
        for logger in loggers:
            logger.close(failed)

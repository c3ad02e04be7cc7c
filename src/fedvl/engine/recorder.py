"""The run directory: config.yaml, metrics.jsonl, summary.json, checkpoint.pt, PNG grids,
and the experiment logs of `--log` (`fedvl.engine.logs`).

Every file is written next to its final name and moved into place with `os.replace`, so a
reader (or a resumed run) never sees a half-written file; a crash mid-write leaves at most a
temporary file, which the next write replaces.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fedvl.config import RunConfig, dump_yaml
from fedvl.engine.logs import RunLogs
from fedvl.safeload import UnsafeFileError, load_torch, plain

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CHECKPOINT = "checkpoint.pt"


def atomic_write(path: Path, write: Callable[[Path], None], tmp_name: str | None = None) -> None:
    """Call `write(tmp)` on a temporary path beside `path`, then move it into place."""
    tmp = path.with_name(tmp_name or path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        # A full disk, a quota, a read-only directory: one line naming the file; the earlier
        # version of the file (a resumable checkpoint) is untouched, as only `tmp` was written.
        why = e.strerror or " ".join(str(e).split()) or type(e).__name__
        raise RunWriteError(f"cannot write '{path}': {why}; the file's earlier version, if "
                            "any, is unchanged") from e
    finally:
        tmp.unlink(missing_ok=True)


class RunWriteError(OSError, ValueError):
    """A run-directory file could not be written (the message names it and why).

    An OSError to callers that handle I/O, a ValueError to the command line's one-line errors.
    """


def accuracy_vs_bytes(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per evaluated round: cumulative bytes (up + down + peer) so far and the accuracies."""
    out: list[dict[str, Any]] = []
    total = 0
    for r in history:
        total += sum(int(r.get(f"round_bytes_{d}", 0)) for d in ("up", "down", "peer"))
        if "mean_accuracy" in r:
            point = {"round": r["round"], "bytes": total, "mean_accuracy": r["mean_accuracy"]}
            if r.get("global_test_accuracy") is not None:
                point["global_test_accuracy"] = r["global_test_accuracy"]
            out.append(point)
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-round records of a run directory (`metrics.jsonl`; [] when absent)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _json_default(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    return str(v)


class RunRecorder:
    """Owns one run directory and every file in it."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError) as e:
            # A file in the way, no permission, a name too long: a one-line error, no traceback.
            why = (e.strerror if isinstance(e, OSError) else None) or str(e)
            raise ValueError(f"cannot create run directory {str(self.dir)!r}: {why}") from e
        self.logs = RunLogs(self.dir, None)   # none until `use_logs`

    def use_logs(self, cfg: RunConfig) -> None:
        """Also log each round and the PNG grids to the kinds of `cfg`'s `log` option."""
        self.logs = RunLogs(self.dir, cfg.engine.log, cfg.to_dict())

    def write_config(self, cfg: RunConfig) -> None:
        """The resolved run config (`config.yaml`), what a resumed run starts from."""
        atomic_write(self.dir / CONFIG, lambda p: dump_yaml(cfg, p))

    def write_metrics(self, history: list[dict[str, Any]]) -> None:
        """One JSON line per completed round (`metrics.jsonl`)."""
        text = "".join(json.dumps(r) + "\n" for r in history)
        atomic_write(self.dir / METRICS, lambda p: p.write_text(text))

    def write_summary(self, summary: dict[str, Any]) -> None:
        """The run's summary (`summary.json`)."""
        text = json.dumps(summary, indent=2, default=_json_default)
        atomic_write(self.dir / SUMMARY, lambda p: p.write_text(text))

    def write_error(self, text: str) -> None:
        """Why a run failed before it had anything to summarise (`error.txt`)."""
        atomic_write(self.dir / "error.txt", lambda p: p.write_text(text))

    def save_checkpoint(self, ck: dict[str, Any]) -> None:
        """The state a resumed run continues from (`checkpoint.pt`)."""
        # Plain containers, tensors and numbers only: what `load_checkpoint` accepts.
        buf = io.BytesIO()
        torch.save(plain(ck), buf)
        # Serialised first, written as bytes: a failed write is then an OSError naming the
        # file (torch's own writer reports a full disk as an internal RuntimeError).
        data = buf.getbuffer()
        atomic_write(self.dir / CHECKPOINT, lambda p: p.write_bytes(data))

    def load_checkpoint(self, map_location: torch.device | str = "cpu") -> dict[str, Any] | None:
        """The last checkpoint, or None when the directory has none.

        Read with the restricted unpickler (`fedvl.safeload`): a crafted file is refused
        with one line and nothing in it runs.
        """
        path = self.dir / CHECKPOINT
        if not path.is_file():
            return None
        try:
            ck = load_torch(path, "checkpoint", map_location)
        except UnsafeFileError:
            raise
        except ValueError as e:
            raise ValueError(f"{e} and cannot be resumed; delete it to start the run "
                             "afresh") from e
        if not isinstance(ck, dict) or "round" not in ck:
            raise ValueError(f"checkpoint '{path}' is not a fedvl checkpoint (no round)")
        return ck

    def save_images(self, sets: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    num_classes: int, mean: Sequence[float], std: Sequence[float]) -> list[str]:
        """Each named image set as a de-normalised PNG grid (one row per class), logged too."""
        from fedvl.distill.synthetic import SyntheticSet

        written, paths = [], {}
        for name, (x, y) in sets.items():
            classes = max(num_classes, int(y.max()) + 1 if len(y) else 0)
            syn = SyntheticSet(x.cpu(), y.cpu(), classes)
            # The image writer picks the format from the suffix, so the temporary keeps `.png`.
            atomic_write(self.dir / f"{name}.png", lambda p, s=syn: s.save_png(p, mean, std),
                         tmp_name=f"{name}.tmp.png")
            written.append(f"{name}.png")
            paths[name] = self.dir / f"{name}.png"
        self.logs.log_images(paths)
        return written


@contextmanager
def discard_failed_start(run_dir: str | Path) -> Iterator[None]:
    """Remove what the block wrote into `run_dir` if it fails before the run's first checkpoint.

    A directory the block created is removed whole (and the parents it created, when empty);
    in a directory that existed before, only entries that were not there are removed, so an
    earlier run's files are never lost. Once a checkpoint exists the run can be resumed with
    `fedvl run --resume`, so everything is kept.
    """
    run_dir = Path(run_dir)
    try:
        created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
        before = set(os.listdir(run_dir)) if not created and run_dir.is_dir() else None
    except (OSError, ValueError):
        # An unusable path: creating it fails inside the block, and there is nothing to undo.
        created, before = [], None
    try:
        yield
    except BaseException:
        if not (run_dir / CHECKPOINT).exists():
            _discard(run_dir, created, before)
        raise


def _discard(run_dir: Path, created: list[Path], before: set[str] | None) -> None:
    """Undo a failed start: see `discard_failed_start`."""
    if created:
        shutil.rmtree(run_dir, ignore_errors=True)
        # Parents only when empty: another run may have started in them meanwhile.
        for parent in created[1:]:
            try:
                parent.rmdir()
            except OSError:
                break
    elif before is not None and run_dir.is_dir():
        for name in set(os.listdir(run_dir)) - before:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

"""Disk caches of generated data: written whole or not at all."""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path

import numpy as np


def cache_root() -> Path:
    """fedvl's cache directory: `$FEDVL_CACHE_DIR`, else ~/.cache/fedvl."""
    return Path(os.environ.get("FEDVL_CACHE_DIR") or Path.home() / ".cache" / "fedvl"
                ).expanduser()


def save_npz_atomic(path: Path, arrays: dict[str, np.ndarray], what: str) -> None:
    """Write `arrays` to `path` as an uncompressed .npz through a temp file and a rename.

    Readers (other runs, other processes) never see a half-written cache; a write that fails
    (disk full, read-only cache) only warns, since the data can always be generated again.
    Uncompressed: generated images hardly compress, and loading stays a plain read.
    """
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = str(path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"))
        # os.open with 0o666 (not mkstemp's 0o600): the cache gets the umask's permissions.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        warnings.warn(f"could not write the {what} cache {path}: {e}", stacklevel=3)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)

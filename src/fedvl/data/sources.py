"""Options every benchmark factory receives, and checked loading of `.npz` archives."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DataError(ValueError):
    """A data file is missing or malformed; the message names the file and what was expected."""


@dataclass
class DataOptions:
    """Benchmark options resolved from the run config."""

    seed: int = 0
    data_dir: str | None = None
    domains: list[str] | None = None
    dataset: str = "pneumoniamnist"  # sub-dataset of benchmarks that have several (medmnist)
    train_cap: int | None = None    # training images kept per client (class-stratified)
    test_cap: int | None = None     # test images kept per client
    num_clients: int = 10
    alpha: float = 0.5
    image_size: int | None = None


def require_data_dir(opts: DataOptions, benchmark: str) -> Path:
    """The data directory, or a clear error saying the benchmark needs one."""
    if not opts.data_dir:
        raise DataError(
            f"benchmark '{benchmark}' reads files from a data directory: pass --data-dir DIR "
            "(e.g. --data-dir ../shared/data), or use the offline benchmark 'digits-offline'"
        )
    path = Path(opts.data_dir).expanduser()
    if not path.is_dir():
        raise DataError(f"data directory '{path}' does not exist")
    return path


def load_npz(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Load the named arrays of an `.npz`, with errors naming the file and the missing keys."""
    if not path.is_file():
        raise DataError(f"missing data file '{path}'")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in keys if k not in z.files]
            if missing:
                raise DataError(
                    f"data file '{path}' lacks array(s) {missing}; it has {sorted(z.files)}"
                )
            return {k: z[k] for k in keys}
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"data file '{path}' is not a readable .npz archive: {e}") from e

"""Options every benchmark factory receives, and checked loading of `.npz` archives."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedvl.data.partition import (
    DEFAULT_DOMINANT_SHARE,
    DEFAULT_PARTITION,
    DEFAULT_SHARDS_PER_CLIENT,
    PARTITIONS,
    LabelSplit,
)
from fedvl.data.spec import benchmarks_where, listed
from fedvl.defaults import MAX_CAP
from fedvl.options import printable


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
    alpha: float | None = None      # Dirichlet concentration; None: the benchmark's default
    image_size: int | None = None
    severity: int = 3               # corruption strength 1..5 (cifar10c)
    corruptions: list[str] | None = None  # subset of the corruptions (cifar10c); None: all
    partitions: int | None = None   # Dirichlet clients per domain; None: the benchmark's default
    partition: str = DEFAULT_PARTITION   # label split: dirichlet, shards or dominant
    shards_per_client: int = DEFAULT_SHARDS_PER_CLIENT   # classes per client (shards)
    dominant_share: float = DEFAULT_DOMINANT_SHARE       # share of the dominant class (dominant)
    # Build only this client (its index in the whole federation); honoured by the benchmarks
    # whose spec declares `client_names`, which then return a federation of that one client.
    only_client: int | None = None

    def __post_init__(self) -> None:
        # No dataset holds more images than an int64 index counts: larger caps mean "all" and
        # are clipped here, so no loader's arithmetic (quotas, apportioning) meets a 10^20.
        for name in ("train_cap", "test_cap"):
            cap = getattr(self, name)
            if cap is not None and cap > MAX_CAP:
                setattr(self, name, MAX_CAP)

    def alpha_or(self, default: float) -> float:
        """The Dirichlet concentration asked for, else the benchmark's own `default`."""
        return default if self.alpha is None else self.alpha

    def partitions_or(self, default: int) -> int:
        """The clients per domain asked for, else the benchmark's own `default`."""
        return default if self.partitions is None else self.partitions

    def label_split(self, default_alpha: float) -> LabelSplit:
        """The `--partition` asked for (Dirichlet with this benchmark's `default_alpha` unless
        `--alpha` is given)."""
        try:
            return LabelSplit(self.partition, alpha=self.alpha_or(default_alpha),
                              shards_per_client=self.shards_per_client,
                              dominant_share=self.dominant_share)
        except ValueError as e:
            raise DataError(str(e)) from e

    def refuse_partitions(self, benchmark: str, why: str) -> None:
        """Raise DataError when `--partitions` is given to a benchmark that has no domains to
        split (`why` says how its clients are made)."""
        if self.partitions is not None:
            raise DataError(
                f"benchmark '{benchmark}' {why}, so --partitions {self.partitions} has no "
                "domains to split; --partitions applies to "
                + listed(benchmarks_where(lambda s: s.partitions is not None)))

    def refuse_partition(self, benchmark: str, why: str) -> None:
        """Raise DataError when a non-default `--partition` is asked of a benchmark whose
        clients are fixed (`why` says how), where a label split has no meaning."""
        if self.partition != DEFAULT_PARTITION:
            always = benchmarks_where(lambda s: s.label_split == "always")
            split = benchmarks_where(lambda s: s.label_split == "split-domains")
            raise DataError(
                f"benchmark '{benchmark}' {why}, so --partition {self.partition} has nothing to "
                f"split; allowed here: --partition {DEFAULT_PARTITION} (the default, unused). "
                f"The partitions ({', '.join(PARTITIONS)}) apply to {listed(always)}, and to "
                f"{listed(split)} with --partitions 2 or more")


def require_data_dir(opts: DataOptions, benchmark: str) -> Path:
    """The data directory, or a clear error saying the benchmark needs one."""
    if not opts.data_dir:
        offline = benchmarks_where(lambda s: not s.needs_data_dir)
        raise DataError(
            f"benchmark '{benchmark}' reads files from a data directory: pass --data-dir DIR "
            "(e.g. --data-dir ../shared/data), or use a benchmark that needs none: "
            + listed(f"'{n}'" for n in offline)
        )
    try:
        path = Path(opts.data_dir).expanduser()
        ok = path.is_dir()
    except (OSError, ValueError, RuntimeError) as e:
        # A NUL byte, a name too long, `~nosuchuser`: not a directory this run can read.
        raise DataError(f"data directory {shown_path(opts.data_dir)} cannot be used: "
                        f"{printable(str(e))}") from e
    if not ok:
        what = "is not a directory" if path.exists() else "does not exist"
        raise DataError(f"data directory {shown_path(path)} {what}")
    return path


def shown_path(path: Path | str) -> str:
    """A path quoted for an error message, its control characters escaped."""
    return f"'{printable(str(path))}'"


# How every zip archive (so every .npz) starts: a local file header, or an empty archive.
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


def load_npz(path: Path, keys: tuple[str, ...], optional: tuple[str, ...] = ()
             ) -> dict[str, np.ndarray]:
    """Load the named arrays of an `.npz` (and those of `optional` it holds), with errors
    naming the file and what is wrong."""
    if not path.is_file():
        raise DataError(f"missing data file {shown_path(path)}; expected an .npz archive "
                        f"with arrays {', '.join(keys)} (layouts: docs/datasets.md)")
    name = shown_path(path)
    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except OSError as e:
        raise DataError(f"data file {name} cannot be read: {e.strerror or e}") from e
    if head[:4] not in _ZIP_MAGIC:
        # np.load would try a pickle here and blame `allow_pickle`, which is not the problem.
        what = "is empty" if not head else f"starts with {head!r}, not with the zip header 'PK'"
        raise DataError(f"data file {name} is not a readable .npz archive: it {what}")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in keys if k not in z.files]
            if missing:
                raise DataError(
                    f"data file {name} lacks array(s) {missing}; it has {sorted(z.files)}"
                )
            # z[k] reads the whole member, so a bad CRC or a short member fails right here.
            return {k: z[k] for k in (*keys, *(k for k in optional if k in z.files))}
    except DataError:
        raise
    except ValueError as e:
        if "allow_pickle" not in str(e):
            raise _unreadable(name, e) from e
        # Pickles can run code when loaded, so they are refused, not a sign of damage.
        raise DataError(f"data file {name} holds an array of Python objects (a pickle), which "
                        "is never loaded; store plain numeric arrays") from e
    except Exception as e:  # noqa: BLE001 - any failure to read the archive means a damaged file
        raise _unreadable(name, e) from e


def _unreadable(name: str, e: Exception) -> DataError:
    """The error of an archive that fails to read (a bad CRC, a short member, a bad header)."""
    detail = printable(" ".join(str(e).split()))[:200]
    return DataError(f"data file {name} is not a readable .npz archive ({type(e).__name__}: "
                     f"{detail}); it may be truncated or damaged: replace it with a good copy")


def check_images(x: np.ndarray, path: Path, key: str) -> np.ndarray:
    """`x` if it holds uint8 images N x H x W (grey) or N x H x W x C with C 1 or 3, else raise."""
    ok = x.dtype == np.uint8 and (x.ndim == 3 or (x.ndim == 4 and x.shape[-1] in (1, 3)))
    if not ok or min(x.shape[1:3], default=0) < 1:
        raise DataError(f"data file {shown_path(path)} array '{key}' must hold uint8 images "
                        f"N x H x W or N x H x W x C (C = 1 or 3), got {x.dtype} {x.shape}")
    if len(x) == 0:
        raise DataError(f"data file {shown_path(path)} array '{key}' holds no images")
    return x


def check_labels(y: np.ndarray, path: Path, key: str, num_classes: int,
                 images: np.ndarray | None = None, images_key: str = "") -> np.ndarray:
    """`y` as int64 labels 0..num_classes-1, one per image of `images`, else raise."""
    name = shown_path(path)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"data file {name} array '{key}' must hold integer labels, one per "
                        f"image (shape N), got {y.dtype} {y.shape}")
    if images is not None and len(images) != len(y):
        raise DataError(f"data file {name} has {len(images)} images in '{images_key}' but "
                        f"{len(y)} labels in '{key}'")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(f"data file {name} array '{key}' holds labels {int(y.min())}.."
                        f"{int(y.max())}; allowed: 0..{num_classes - 1}")
    return y.astype(np.int64)

"""CIFAR-10-C with 57 clients: the CIFAR-10 test set under 19 corruptions, 3 Dirichlet clients each.

The FedLGD / DESA benchmark reads 57 pre-computed client files whose generating script was never
published (methods-reference §8.2). This is the labelled reconstruction given there:

* every corruption is applied, at one `severity`, to all test images of `<data-dir>/cifar10.npz`
  (CIFAR-10-C is made from the test set), with the maintained `imagecorruptions-imaug` library;
* per corruption, the first 90 % of the images (official order) are the training pool and the
  last 10 % the test pool, as in DESA's raw `CIFAR10C` loader (`cifar10c_dataset.py:L8-59`);
* the training pool is split over `partitions` clients by a per-class Dirichlet(`alpha`) draw
  (or the split `--partition` names: shards, dominant), and each class of the test pool is cut
  with the same per-class shares, so every client's test label mix follows its training mix;
  19 x 3 = 57 clients named `<corruption>-<k>`.

Because the test pool holds the same base images for every corruption, no clean image is ever
trained on by one client and tested on by another. Corrupted images depend only on the source
images, the corruption and the severity (not on the run seed): like the released CIFAR-10-C they
are a fixed data set, generated once and cached; the run seed drives the split. See
docs/cifar10c.md.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedvl.data.cache import cache_root, save_npz_atomic
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.partition import LabelSplit, apportion, as_split, top_up
from fedvl.data.sources import (
    DataError,
    DataOptions,
    check_images,
    check_labels,
    load_npz,
    require_data_dir,
    shown_path,
)
from fedvl.data.spec import BenchmarkSpec, declare_benchmark
from fedvl.data.transforms import stratified_subset, to_tensor_images
from fedvl.defaults import CORRUPTIONS, DEFAULT_SEVERITY
from fedvl.seeding import derive_seed

# The 19 corruptions in the library's own order (15 "common" then 4 "validation"); client
# order follows it whatever order `--corruptions` names them in.
DEFAULT_ALPHA = 2.0       # the `preprocessed` (not `_alpha1`/`_alpha5`) files of FedLGD/DESA
DEFAULT_PARTITIONS = 3    # 19 x 3 = 57 clients
TRAIN_FRACTION = 0.9      # DESA's raw loader: first 90 % train, last 10 % test
NUM_CLASSES = 10
# FedLGD and DESA feed CIFAR-10-C unnormalised (ToTensor only): pixels stay in [0, 1].
MEAN = (0.0, 0.0, 0.0)
STD = (1.0, 1.0, 1.0)
LIBRARY = "imagecorruptions-imaug"

# Stream ids: derive_seed(run seed, stream, corruption index, ...) and the per-image seeds.
_SPLIT_STREAM = 43
_TEST_STREAM = 47
_CAP_STREAM = 53
_IMAGE_STREAM = 59
# Bump when the cached content changes for the same key (seeding scheme, file layout).
_CACHE_VERSION = 1


def check_corruptions(names: Sequence[str] | None) -> list[str]:
    """The selected corruptions in canonical order (all when none are named), else DataError."""
    if not names:
        return list(CORRUPTIONS)
    bad = [n for n in names if n not in CORRUPTIONS]
    if bad:
        raise DataError(f"unknown cifar10c corruption(s) {bad}; allowed: {', '.join(CORRUPTIONS)}")
    return [n for n in CORRUPTIONS if n in names]


def library_version() -> str:
    """Installed version of `imagecorruptions-imaug`, or a DataError saying how to install it."""
    try:
        return metadata.version(LIBRARY)
    except metadata.PackageNotFoundError:
        pass
    try:
        old = metadata.version("imagecorruptions")
    except metadata.PackageNotFoundError:
        old = None
    # Both distributions install the module `imagecorruptions`; only the fork works on NumPy 2.
    hint = (f"the original imagecorruptions {old} is installed instead, and 3 of its 19 "
            "corruptions crash on NumPy 2: pip uninstall imagecorruptions, then "
            if old else "")
    raise DataError(f"benchmark 'cifar10c' needs the package {LIBRARY}: {hint}"
                    f"pip install {LIBRARY} (or pip install 'fedvl[corruptions]')")


def image_seeds(name: str, severity: int, n: int) -> np.ndarray:
    """The uint32 seeds of images 0..n-1 under one corruption and severity."""
    # One seed per image: an image's corruption does not depend on which others are corrupted
    # with it, nor in which order or process.
    ss = np.random.SeedSequence([_IMAGE_STREAM, CORRUPTIONS.index(name), severity])
    return ss.generate_state(n) if n else np.zeros(0, np.uint32)


def corrupt_images(x: np.ndarray, name: str, severity: int, bar: Any = None) -> np.ndarray:
    """uint8 N x H x W x 3 images under one corruption; image j is seeded by (name, severity, j).

    The library draws from NumPy's global RNG, so it is seeded per image and its state is
    restored afterwards; `glass_blur` (numba) and `impulse_noise` (scikit-image) take their own
    `seed`, since they would otherwise draw fresh OS entropy.
    """
    library_version()
    from imagecorruptions import corrupt, corruption_dict

    check_corruptions([name])
    takes_seed = "seed" in inspect.signature(corruption_dict[name]).parameters
    seeds = image_seeds(name, severity, len(x))
    out = np.empty_like(x)
    state = np.random.get_state()
    try:
        for j, s in enumerate(seeds):
            np.random.seed(int(s))
            extra = {"seed": int(s)} if takes_seed else {}
            out[j] = corrupt(x[j], severity=severity, corruption_name=name, **extra)
            if bar is not None:
                bar.update(1)
    finally:
        np.random.set_state(state)
    return out


def cache_dir() -> Path:
    """Where corrupted sets are cached: `$FEDVL_CACHE_DIR/cifar10c` (default ~/.cache/fedvl)."""
    return cache_root() / "cifar10c"


def source_digest(x: np.ndarray) -> str:
    """sha256 of the source images (shape and bytes): the content part of the cache key."""
    h = hashlib.sha256(str((x.dtype.str, x.shape)).encode())
    h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def cache_key(digest: str, name: str, severity: int) -> dict[str, object]:
    """Everything the corrupted images depend on."""
    return {"v": _CACHE_VERSION, "source": digest, "corruption": name, "severity": severity,
            "library": f"{LIBRARY} {library_version()}", "seeding": "per-image"}


def cache_path(key: dict[str, object]) -> Path:
    """The cache file of one key (content-addressed: the name holds the key's hash)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{key['corruption']}-s{key['severity']}-{digest}.npz"


def _load_cached(path: Path, key: dict[str, object], shape: tuple[int, ...]) -> np.ndarray | None:
    """The cached images, or None when the file is absent, damaged or not this key's."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            # Reading a member whole checks its zip CRC, so a truncated or flipped file fails.
            stored = json.loads(str(z["key"]))
            images = np.array(z["images"])
    except Exception:  # noqa: BLE001 - any unreadable cache is rebuilt, never trusted
        return None
    if stored != key or images.shape != shape or images.dtype != np.uint8:
        return None
    return images


def _write_cached(path: Path, key: dict[str, object], images: np.ndarray) -> None:
    """Write atomically (temp file + rename), so no reader ever sees a half-written file."""
    save_npz_atomic(path, {"images": images, "key": np.array(json.dumps(key, sort_keys=True))},
                    "cifar10c")


def corrupted_sets(x: np.ndarray, names: Sequence[str], severity: int,
                   cache: bool = True) -> dict[str, np.ndarray]:
    """Each named corruption of `x` at `severity`: from the cache, else generated and cached."""
    digest = source_digest(x)
    keys = {n: cache_key(digest, n, severity) for n in names}
    out = {n: _load_cached(cache_path(keys[n]), keys[n], x.shape) if cache else None
           for n in names}
    missing = [n for n in names if out[n] is None]
    if missing:
        from tqdm import tqdm

        with tqdm(total=len(missing) * len(x), unit="img",
                  desc=f"cifar10c: corrupting at severity {severity}") as bar:
            for n in missing:
                bar.set_postfix_str(n)
                out[n] = corrupt_images(x, n, severity, bar)
                if cache:
                    _write_cached(cache_path(keys[n]), keys[n], out[n])
    return out


def split_corruption(y: np.ndarray, partitions: int, alpha: float | LabelSplit, seed: int,
                     index: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client, (train, test) indices into `y` for the corruption numbered `index`.

    The first 90 % is split by `alpha` (a LabelSplit, or the concentration of a per-class
    Dirichlet draw); each class of the last 10 % is cut with the shares its training images
    got, so test label mixes follow training mixes.
    """
    n_train = int(len(y) * TRAIN_FRACTION)
    y_tr = y[:n_train]
    parts = as_split(alpha).split(y_tr, partitions, derive_seed(seed, _SPLIT_STREAM, index),
                                  NUM_CLASSES)
    counts = np.stack([np.bincount(y_tr[p], minlength=NUM_CLASSES) for p in parts])
    rng = np.random.default_rng(derive_seed(seed, _TEST_STREAM, index))
    tests: list[list[np.ndarray]] = [[] for _ in parts]
    for k in range(NUM_CLASSES):
        pool = rng.permutation(n_train + np.flatnonzero(y[n_train:] == k))
        cuts = np.cumsum(apportion(len(pool), counts[:, k]))[:-1]
        for i, chunk in enumerate(np.split(pool, cuts)):
            tests[i].append(chunk)
    test_parts = [np.sort(np.concatenate(t)).astype(np.int64) for t in tests]
    if len(y) - n_train >= partitions:
        # A tiny alpha can leave a client training images but no test image; give it one.
        test_parts = top_up(test_parts, 1, rng)
    return list(zip(parts, test_parts, strict=True))


def build_cifar10c(
    data_dir: str | Path | None,
    *,
    seed: int = 0,
    severity: int = DEFAULT_SEVERITY,
    corruptions: Sequence[str] | None = None,
    partitions: int = DEFAULT_PARTITIONS,
    alpha: float | LabelSplit = DEFAULT_ALPHA,
    train_cap: int | None = None,
    test_cap: int | None = None,
    image_size: int | None = None,
    cache: bool = True,
) -> FederatedDataset:
    """The CIFAR-10-C federation from `<data_dir>/cifar10.npz` (see the module docstring).

    `alpha` is the Dirichlet concentration of each corruption's split, or a whole LabelSplit.
    """
    names = check_corruptions(corruptions)
    if severity not in (1, 2, 3, 4, 5):
        raise DataError(f"cifar10c severity must be an integer 1..5, got {severity!r}")
    if partitions < 1:
        raise DataError(f"cifar10c partitions must be >= 1, got {partitions!r}")
    if not isinstance(alpha, LabelSplit) and not alpha > 0:
        raise DataError(f"cifar10c alpha must be > 0, got {alpha!r}")
    split = as_split(alpha)
    library_version()  # before reading 85 MB: fail fast when the library is missing
    opts = DataOptions(data_dir=None if data_dir is None else str(data_dir))
    path = require_data_dir(opts, "cifar10c") / "cifar10.npz"
    arr = load_npz(path, ("x_test", "y_test"))
    x = check_images(arr["x_test"], path, "x_test")
    y = check_labels(arr["y_test"], path, "y_test", NUM_CLASSES, x, "x_test")
    if x.ndim != 4 or x.shape[-1] != 3 or min(x.shape[1:3]) < 32:
        raise DataError(f"data file {shown_path(path)} array 'x_test' must hold RGB images of at "
                        f"least 32 x 32 (the corruption library's minimum), got {x.shape}")
    size = image_size or int(x.shape[1])
    corrupted = corrupted_sets(x, names, severity, cache)
    clients = []
    for name in names:
        index = CORRUPTIONS.index(name)
        xc = corrupted.pop(name)  # dropped once its clients are built: one set in memory
        for i, (tr, te) in enumerate(split_corruption(y, partitions, split, seed, index)):
            rng = np.random.default_rng([seed, _CAP_STREAM, index, i])
            tr = tr[stratified_subset(y[tr], train_cap, rng)]
            te = te[stratified_subset(y[te], test_cap, rng)]
            clients.append(ClientData(
                name=f"{name}-{i}",
                x_train=to_tensor_images(xc[tr], size, 3, MEAN, STD),
                y_train=torch.from_numpy(y[tr]),
                x_test=to_tensor_images(xc[te], size, 3, MEAN, STD),
                y_test=torch.from_numpy(y[te]),
            ))
    return FederatedDataset(
        "cifar10c", clients, NUM_CLASSES, MEAN, STD,
        info={"corruptions": names, "severity": severity, "partitions": partitions,
              **split.info(), "train_fraction": TRAIN_FRACTION, "source_images": len(y),
              "library": f"{LIBRARY} {library_version()}",
              # The domain of each client: heterogeneity reports within/between corruptions.
              "client_groups": [c.name.rsplit("-", 1)[0] for c in clients]},
    )


@declare_benchmark("cifar10c", BenchmarkSpec(
    partitions=DEFAULT_PARTITIONS, label_split="split-domains",
    count_clients=lambda o: len(check_corruptions(o.corruptions)) * o.partitions_or(
        DEFAULT_PARTITIONS),
    reads=frozenset({"severity", "corruptions"})))
def cifar10c(opts: DataOptions) -> FederatedDataset:
    """CIFAR-10-C: 19 corruptions x `partitions` clients (57 by default), each corruption split
    by `--partition` (default Dirichlet(alpha))."""
    partitions = opts.partitions_or(DEFAULT_PARTITIONS)
    if partitions == 1:
        opts.refuse_partition("cifar10c", "has one client per corruption with --partitions 1")
    return build_cifar10c(
        opts.data_dir, seed=opts.seed, severity=opts.severity, corruptions=opts.corruptions,
        partitions=partitions,
        # `--alpha` left unset reaches the benchmark as None: this benchmark's default is 2.
        alpha=opts.label_split(DEFAULT_ALPHA),
        train_cap=opts.train_cap, test_cap=opts.test_cap, image_size=opts.image_size)

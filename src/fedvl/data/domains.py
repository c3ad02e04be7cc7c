"""Generic feature-shift benchmarks over a user's own data: one domain per `.npz` file
(`npz-domains`) or per image folder (`imagefolder`).

Both give one client per domain, or `--partitions K` clients per domain whose training labels
are split by `--partition` (Dirichlet(`--alpha`), 0.5 when unset, by default); images are
normalised with mean 0.5 / std 0.5 per channel as the DIGITS domains. The layouts are in
docs/datasets.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedvl.data.embedded import split_domain
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.sources import (
    DataError,
    DataOptions,
    check_labels,
    load_npz,
    require_data_dir,
    shown_path,
)
from fedvl.data.spec import BenchmarkSpec, declare_benchmark
from fedvl.data.transforms import stratified_subset, to_tensor_images
from fedvl.seeding import derive_seed

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
DEFAULT_ALPHA = 0.5
IMAGEFOLDER_SIZE = 32
_CAP_STREAM = 61
# One client per domain unless `--partitions` splits each domain.
SPEC = BenchmarkSpec(partitions=1, label_split="split-domains", reads=frozenset({"domains"}))

Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def federate_domains(benchmark: str, domains: dict[str, Split], num_classes: int,
                     opts: DataOptions, size: int, channels: int,
                     info: dict[str, object] | None = None) -> FederatedDataset:
    """Clients of uint8 N x H x W x C domains: one per domain, or `--partitions` per domain.

    `--train-cap` / `--test-cap` then keep at most that many images of each client,
    class-stratified.
    """
    parts = opts.partitions_or(1)
    split = opts.label_split(DEFAULT_ALPHA)
    if parts == 1:
        opts.refuse_partition(benchmark, "has one client per domain unless --partitions is 2 "
                              "or more")
    mean, std = (0.5,) * channels, (0.5,) * channels
    clients = []
    for d, (name, (xtr, ytr, xte, yte)) in enumerate(domains.items()):
        try:
            pieces = split_domain(ytr, yte, parts, split, opts.seed, d, num_classes)
        except ValueError as e:
            raise DataError(f"{benchmark} domain '{name}' cannot be split into {parts} "
                            f"clients: {e}") from e
        for i, (tr, te) in enumerate(pieces):
            rng = np.random.default_rng(derive_seed(opts.seed, _CAP_STREAM, d, i))
            tr = tr[stratified_subset(ytr[tr], opts.train_cap, rng)]
            te = te[stratified_subset(yte[te], opts.test_cap, rng)]
            clients.append(ClientData(
                name=name if parts == 1 else f"{name}-{i}",
                x_train=to_tensor_images(xtr[tr], size, channels, mean, std),
                y_train=torch.from_numpy(ytr[tr]).long(),
                x_test=to_tensor_images(xte[te], size, channels, mean, std),
                y_test=torch.from_numpy(yte[te]).long(),
            ))
    meta: dict[str, object] = {"domains": list(domains), **(info or {})}
    if parts > 1:
        # Every client of a domain shares it (heterogeneity's within/between groups).
        meta.update(partitions=parts, **split.info(),
                    client_groups=[n for n in domains for _ in range(parts)])
    return FederatedDataset(benchmark, clients, num_classes, mean, std, info=meta)


def _select(benchmark: str, available: dict[str, Path], opts: DataOptions, root: Path,
            what: str) -> dict[str, Path]:
    """The domains `--domains` names (all when unset), in the order found."""
    if not opts.domains:
        return available
    unknown = [d for d in opts.domains if d not in available]
    if unknown:
        raise DataError(f"{benchmark}: unknown domain(s) {unknown} in {shown_path(root)}; "
                        f"allowed ({what}): {', '.join(available)}")
    return {d: p for d, p in available.items() if d in opts.domains}


# --------------------------------------------------------------------------------------------
# npz-domains
# --------------------------------------------------------------------------------------------


def as_uint8_images(x: np.ndarray, path: Path, key: str) -> np.ndarray:
    """Images as uint8 N x H x W x C (C = 1 or 3), from uint8 0..255 or float 0..1 arrays laid
    out N x H x W, N x H x W x C or N x C x H x W; anything else raises DataError."""
    name = shown_path(path)
    allowed = ("allowed: N x H x W, N x H x W x C or N x C x H x W (C = 1 or 3), uint8 0..255 "
               "or float 0..1")
    if x.ndim == 3:
        x = x[..., None]
    elif x.ndim == 4 and x.shape[-1] not in (1, 3) and x.shape[1] in (1, 3):
        x = x.transpose(0, 2, 3, 1)
    if x.ndim != 4 or x.shape[-1] not in (1, 3) or min(x.shape[1:3]) < 1:
        raise DataError(f"data file {name} array '{key}' has shape {x.shape}; {allowed}")
    if len(x) == 0:
        raise DataError(f"data file {name} array '{key}' holds no images")
    if np.issubdtype(x.dtype, np.floating):
        lo, hi = float(x.min()), float(x.max())
        if not (np.isfinite(lo) and np.isfinite(hi) and lo >= 0.0 and hi <= 1.0):
            raise DataError(f"data file {name} array '{key}' holds float values {lo:g}..{hi:g}"
                            f"; {allowed}")
        # One uint8 pipeline for every source; a float image loses at most 1/510 per pixel.
        return np.rint(x * 255.0).astype(np.uint8)
    if x.dtype != np.uint8:
        raise DataError(f"data file {name} array '{key}' has dtype {x.dtype}; {allowed}")
    return np.ascontiguousarray(x)


def _labels(y: np.ndarray, path: Path, key: str) -> np.ndarray:
    """Integer labels N (or N x 1, as MedMNIST stores them), else DataError."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"data file {shown_path(path)} array '{key}' must hold integer labels, "
                        f"one per image (shape N or N x 1), got {y.dtype} {y.shape}")
    return y


def _common_size(arrays: list[tuple[Path, str, np.ndarray]], image_size: int | None,
                 benchmark: str) -> int:
    """`--image-size`, else the one square side every array shares (else DataError)."""
    if image_size:
        return image_size
    sides = {(x.shape[1], x.shape[2]) for _, _, x in arrays}
    if len(sides) == 1 and (side := next(iter(sides)))[0] == side[1]:
        return int(side[0])
    seen = {}
    for path, key, x in arrays:
        seen.setdefault((x.shape[1], x.shape[2]), f"{shown_path(path)} '{key}'")
    shown = "; ".join(f"{w} {h}x{wd}" for (h, wd), w in seen.items())
    raise DataError(f"{benchmark}: images are not all square of one size ({shown}); pass "
                    "--image-size N to resize them all to N x N")


@declare_benchmark("npz-domains", SPEC)
def npz_domains(opts: DataOptions) -> FederatedDataset:
    """One domain per `DIR/<domain>.npz` (arrays x_train, y_train, x_test, y_test)."""
    root = require_data_dir(opts, "npz-domains")
    found = {p.stem: p for p in sorted(root.glob("*.npz")) if p.is_file()}
    if not found:
        raise DataError(f"npz-domains: no .npz file in {shown_path(root)}; expected one "
                        f"<domain>.npz per domain with arrays {', '.join(NPZ_KEYS)} "
                        "(optional: class_names)")
    chosen = _select("npz-domains", found, opts, root, ".npz files")
    raw: dict[str, dict[str, np.ndarray]] = {}
    names: dict[str, tuple[str, ...]] = {}
    for d, path in chosen.items():
        arr = load_npz(path, NPZ_KEYS, optional=("class_names",))
        if "class_names" in arr:
            names[d] = tuple(str(c) for c in np.asarray(arr["class_names"]).ravel())
        raw[d] = {k: (as_uint8_images(arr[k], path, k) if k.startswith("x_")
                      else _labels(arr[k], path, k)) for k in NPZ_KEYS}
    if names:
        ref, ref_names = next(iter(names.items()))
        for d, mine in names.items():
            if mine != ref_names:
                raise DataError(f"npz-domains: {shown_path(chosen[d])} names classes "
                                f"{list(mine)} but {shown_path(chosen[ref])} names "
                                f"{list(ref_names)}; every file's class_names must be the same")
        num_classes = len(ref_names)
    else:
        num_classes = _inferred_classes(raw, chosen)
    if num_classes < 2:
        raise DataError(f"npz-domains: the labels of {', '.join(map(shown_path, chosen.values()))}"
                        f" name {max(num_classes, 0)} class(es); allowed: at least 2 classes, "
                        "labels 0..K-1")
    domains: dict[str, Split] = {}
    for d, r in raw.items():
        path = chosen[d]
        y_tr = check_labels(r["y_train"], path, "y_train", num_classes, r["x_train"], "x_train")
        y_te = check_labels(r["y_test"], path, "y_test", num_classes, r["x_test"], "x_test")
        domains[d] = (r["x_train"], y_tr, r["x_test"], y_te)
    arrays = [(chosen[d], k, raw[d][k]) for d in raw for k in ("x_train", "x_test")]
    size = _common_size(arrays, opts.image_size, "npz-domains")
    # Grey domains are repeated to RGB only when another domain is in colour.
    channels = 3 if any(x.shape[-1] == 3 for _, _, x in arrays) else 1
    info: dict[str, object] = {"num_classes": num_classes}
    if names:
        info["class_names"] = list(ref_names)
    return federate_domains("npz-domains", domains, num_classes, opts, size, channels, info)


def _inferred_classes(raw: dict[str, dict[str, np.ndarray]], paths: dict[str, Path]) -> int:
    """K, when the labels of every file together are exactly 0..K-1; else DataError.

    The classifier gets one output per class, so a stray label of 10^7 would ask for a model
    of 10^7 outputs: it is named here, with the range the other labels allow, instead.
    """
    found = [(d, k, r[k]) for d, r in raw.items() for k in ("y_train", "y_test") if len(r[k])]
    present = np.unique(np.concatenate([y for _, _, y in found])) if found else np.zeros(0)
    # The classes 0..K-1 that all appear; any label outside them is the one to name.
    k = int(np.argmax(present != np.arange(len(present)))) if len(present) else 0
    if len(present) and present[k] == k:
        k = len(present)
    for d, key, y in found:
        if y.min() < 0 or y.max() >= k:
            bad = int(y.min()) if y.min() < 0 else int(y.max())
            raise DataError(f"data file {shown_path(paths[d])} array '{key}' holds label {bad}; "
                            f"allowed: 0..{k - 1} (labels must number the classes 0..K-1 with "
                            "each class present in some file, or class_names must name them)")
    return k


# --------------------------------------------------------------------------------------------
# imagefolder
# --------------------------------------------------------------------------------------------


def _subdirs(path: Path) -> list[Path]:
    """Visible subfolders, sorted by name."""
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_files(folder: Path) -> list[Path]:
    """The .png / .jpg / .jpeg files of a class folder, sorted (other files are ignored)."""
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".")
                  and p.suffix.lower() in IMAGE_SUFFIXES)


def _read_image(path: Path, size: int) -> np.ndarray:
    """One image as uint8 size x size x 3 (Pillow: RGB, bicubic resize), else DataError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            # RGB always, as torchvision's ImageFolder loader: grey and palette files too.
            rgb = im.convert("RGB")
            if rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BICUBIC)
            return np.asarray(rgb, dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise DataError(f"image file {shown_path(path)} cannot be read as an image: "
                        f"{type(e).__name__}: {e}") from e


def _read_split(folder: Path, classes: list[str], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of one `<domain>/<split>` folder."""
    xs: list[np.ndarray] = []
    ys: list[int] = []
    for c, cls in enumerate(classes):
        sub = folder / cls
        if not sub.is_dir():
            continue  # a test split may lack a class
        files = _image_files(sub)
        if not files:
            raise DataError(f"imagefolder: class folder {shown_path(sub)} holds no image; "
                            f"allowed files: {', '.join(f'*{s}' for s in IMAGE_SUFFIXES)}")
        xs += [_read_image(p, size) for p in files]
        ys += [c] * len(files)
    if not xs:
        raise DataError(f"imagefolder: {shown_path(folder)} holds no image")
    return np.stack(xs), np.asarray(ys, dtype=np.int64)


@declare_benchmark("imagefolder", SPEC)
def imagefolder(opts: DataOptions) -> FederatedDataset:
    """One domain per `DIR/<domain>/{train,test}/<class>/*.png|jpg` (or DIR/{train,test}/<class>
    as one domain); class names sorted, the same classes in every domain."""
    root = require_data_dir(opts, "imagefolder")
    layout = ("expected DIR/<domain>/{train,test}/<class>/*.png|jpg, or DIR/{train,test}/"
              "<class>/*.png|jpg for one domain")
    if (root / "train").is_dir() or (root / "test").is_dir():
        found = {root.resolve().name or "domain": root}
    else:
        found = {p.name: p for p in _subdirs(root)}
    if not found:
        raise DataError(f"imagefolder: no domain folder in {shown_path(root)}; {layout}")
    chosen = _select("imagefolder", found, opts, root, "domain folders")
    classes: list[str] | None = None
    first = ""
    for d, path in chosen.items():
        for split in ("train", "test"):
            if not (path / split).is_dir():
                raise DataError(f"imagefolder domain '{d}' lacks its {split} folder "
                                f"{shown_path(path / split)}; {layout}")
        mine = [p.name for p in _subdirs(path / "train")]
        if not mine:
            raise DataError(f"imagefolder domain '{d}': {shown_path(path / 'train')} holds no "
                            f"class folder; {layout}")
        if classes is None:
            classes, first = mine, d
        elif mine != classes:
            missing = sorted(set(classes) - set(mine))
            extra = sorted(set(mine) - set(classes))
            raise DataError(f"imagefolder domain '{d}' has different classes from domain "
                            f"'{first}': missing {missing}, extra {extra}; every domain needs "
                            "the same class folders")
        stray = sorted({p.name for p in _subdirs(path / "test")} - set(mine))
        if stray:
            raise DataError(f"imagefolder domain '{d}': test class folder(s) {stray} have no "
                            f"train folder; allowed classes: {', '.join(mine)}")
    assert classes is not None
    if len(classes) < 2:
        raise DataError(f"imagefolder: one class folder ({classes[0]}) only; allowed: at least "
                        "2 classes")
    size = opts.image_size or IMAGEFOLDER_SIZE
    domains: dict[str, Split] = {}
    for d, path in chosen.items():
        domains[d] = (*_read_split(path / "train", classes, size),
                      *_read_split(path / "test", classes, size))
    return federate_domains("imagefolder", domains, len(classes), opts, size, 3,
                            {"class_names": classes})

"""Per-client distillation as federated methods use it: DM from class statistics with random nets.

`distill_client` is FedLGD's warm-up (and DESA's anchor synthesis with init 'noise');
`client_virtual_set` distils one client once and caches the result on disk, so every method
of a comparison trains on the same local virtual sets (`--local-data virtual`).

Under label skew a client distils only the classes it *owns*: those with at least
`MIN_CLASS_COUNT` training images (FedVCK's rule). A class it lacks gets no synthetic images at
all, rather than blank images (stats init) carrying its label or an error (real init).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fedvl.data.cache import cache_root
from fedvl.devices import module_to
from fedvl.distill.augment import DSAConfig
from fedvl.distill.samplers import RandomModelSampler, UniformClassSampler
from fedvl.distill.synthesize import DistributionMatching, synthesize
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models.base import FedModel
from fedvl.safeload import load_torch
from fedvl.seeding import derive_seed, generator

# A class with fewer images than this is not distilled by a client (FedVCK uses 10).
MIN_CLASS_COUNT = 10


def owned_ipc(y: torch.Tensor, num_classes: int, ipc: int,
              min_count: int = MIN_CLASS_COUNT) -> list[int]:
    """Images per class for a client: `ipc` for classes it owns (>= `min_count` images), else 0.

    A client owning no class by that rule (a very small client) distils every class it has at
    least one image of, so that it still has something to train on.
    """
    if ipc < 1:
        raise ValueError(f"ipc must be >= 1, got {ipc}")
    counts = torch.bincount(y.cpu(), minlength=num_classes)
    if int(counts.sum()) == 0:
        raise ValueError("a client with no training images cannot be distilled")
    owned = counts >= max(min_count, 1)
    if not bool(owned.any()):
        owned = counts > 0
    return [ipc if bool(o) else 0 for o in owned]


def init_set(init: str, ipc: int | list[int], x: torch.Tensor, y: torch.Tensor,
             num_classes: int, generator: torch.Generator, group: int = 8) -> SyntheticSet:
    """A synthetic set initialised from N(0,1) noise, class statistics, real samples or means
    of `group` real samples."""
    if init == "mean":
        return SyntheticSet.from_real_means(ipc, x, y, num_classes, generator, group)
    if init == "stats":
        return SyntheticSet.from_client_stats(ipc, x, y, num_classes, generator)
    if init == "noise":
        return SyntheticSet.noise(ipc, num_classes, tuple(x.shape[1:]), generator)
    if init == "real":
        return SyntheticSet.from_real(ipc, x, y, num_classes, generator)
    raise ValueError(f"unknown init '{init}'; allowed: stats, noise, real, mean")


def distill_client(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    random_model: Callable[[int], FedModel],
    ipc: int,
    steps: int,
    generator: torch.Generator,
    init: str = "stats",
    batch_real: int = 64,
    lr_img: float = 1.0,
    dsa: bool = True,
    min_count: int = MIN_CLASS_COUNT,
) -> SyntheticSet:
    """Distribution matching of a fresh set against one client's data with random networks.

    Only the classes the client owns (`owned_ipc`) get images. The set lives on `x`'s device;
    its initial pixels are drawn on the CPU generator so a seed gives the same start on every
    device.
    """
    per_class = owned_ipc(y, num_classes, ipc, min_count)
    syn = init_set(init, per_class, x.cpu(), y.cpu(), num_classes, generator)
    if x.device != syn.images.device:
        syn = syn.to(x.device)
    if steps > 0:
        device = x.device
        objective = DistributionMatching(
            real=UniformClassSampler(x, y, num_classes, batch_real),
            extractor=RandomModelSampler(lambda seed: module_to(random_model(seed), device)),
            num_classes=num_classes,
            dsa=DSAConfig() if dsa else None,
        )
        synthesize(syn, objective, steps, generator, lr_img=lr_img)
    return syn


def _cache_dir() -> Path:
    return cache_root()


# Stream ids of the per-client distillation generator: generator(derive_seed(seed, 29), k, 41).
VIRTUAL_SEED_STREAM = 29
VIRTUAL_CLIENT_STREAM = 41


@dataclass(frozen=True)
class VirtualSetSpec:
    """How a client's local virtual set is distilled (everything but the data and the seed)."""

    ipc: int
    steps: int
    init: str = "real"
    batch_real: int = 32
    lr_img: float = 1.0
    dsa: bool = True
    min_count: int = MIN_CLASS_COUNT


def _fingerprint(x: torch.Tensor, y: torch.Tensor, architecture: str) -> str:
    h = hashlib.sha256()
    for t in (x, y):
        c = t.detach().cpu().contiguous()
        h.update(str((c.dtype, tuple(c.shape))).encode())
        h.update(c.numpy().tobytes())
    h.update(architecture.encode())
    return h.hexdigest()


def client_virtual_set(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    random_model: Callable[[int], FedModel],
    spec: VirtualSetSpec,
    run_seed: int,
    client: int,
    cache: bool = True,
) -> SyntheticSet:
    """The local virtual set of client `client`: distilled once, cached on disk.

    The one owner of local virtual data: FedLGD's warm-up and `--local-data virtual` both come
    here, so the same data, settings, architecture and seed give the same set on every path
    (and a Flower node distils only its own client). The set is distilled on `x`'s device and
    returned on the CPU; the cache key covers the data themselves, so a changed split or cap
    never reuses a stale set.
    """
    seed = derive_seed(run_seed, VIRTUAL_SEED_STREAM)
    # The architecture's text form (layers and shapes) keys the cache with the data.
    arch = repr(random_model(0))
    key = {"data": _fingerprint(x, y, arch), "spec": dataclasses.asdict(spec), "seed": seed,
           "client": client, "num_classes": num_classes, "v": 3}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = _cache_dir() / f"local-virtual-{digest}.pt"
    meta = {"init": spec.init}
    if cache and path.is_file():
        try:
            blob = load_torch(path, "local virtual set cache")
            # The file must say it is this set (its key), not only sit under its name.
            if blob.get("key") != key:
                raise ValueError("cache key differs")
            return SyntheticSet(blob["images"], blob["labels"], num_classes,
                                {**meta, "cached": True})
        except Exception:  # noqa: BLE001 - a damaged cache is recomputed, never trusted
            path.unlink(missing_ok=True)
    g = generator(seed, client, VIRTUAL_CLIENT_STREAM)
    syn = distill_client(x, y, num_classes, random_model, spec.ipc, spec.steps, g, spec.init,
                         spec.batch_real, spec.lr_img, spec.dsa, min_count=spec.min_count)
    out = SyntheticSet(syn.images.detach().cpu(), syn.labels.cpu(), num_classes, syn.meta)
    if cache:
        _write_cache(path, {"images": out.images.detach(), "labels": out.labels, "key": key})
    return out


def _write_cache(path: Path, blob: dict) -> None:
    """Write a cache file through a temporary and a rename; a failed write only warns."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(blob, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        # A full disk or a read-only cache: the set is recomputed next time, the run goes on
        # (torch reports a short write as a RuntimeError).
        warnings.warn(f"could not write the local virtual set cache {path}: "
                      f"{' '.join(str(e).split())[:120]}", stacklevel=3)
    finally:
        tmp.unlink(missing_ok=True)

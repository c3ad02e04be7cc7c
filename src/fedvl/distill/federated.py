"""Per-client distillation as federated methods use it: DM from class statistics with random nets.

`distill_client` is FedLGD's warm-up (and DESA's anchor synthesis with init 'noise');
`local_virtual_data` distils every client once and caches the result on disk, so every method
of a comparison trains on the same local virtual sets (`--local-data virtual`).

Under label skew a client distils only the classes it *owns*: those with at least
`MIN_CLASS_COUNT` training images (FedVCK's rule). A class it lacks gets no synthetic images at
all, rather than blank images (stats init) carrying its label or an error (real init).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from fedvl.distill.augment import DSAConfig
from fedvl.distill.samplers import RandomModelSampler, UniformClassSampler
from fedvl.distill.synthesize import DistributionMatching, synthesize
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models.base import FedModel
from fedvl.seeding import generator

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
             num_classes: int, generator: torch.Generator) -> SyntheticSet:
    """A synthetic set initialised from N(0,1) noise, class statistics or real samples."""
    if init == "stats":
        return SyntheticSet.from_client_stats(ipc, x, y, num_classes, generator)
    if init == "noise":
        return SyntheticSet.noise(ipc, num_classes, tuple(x.shape[1:]), generator)
    if init == "real":
        return SyntheticSet.from_real(ipc, x, y, num_classes, generator)
    raise ValueError(f"unknown init '{init}'; allowed: stats, noise, real")


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
        syn = SyntheticSet(syn.images.to(x.device), syn.labels.to(x.device), num_classes,
                           syn.meta)
    if steps > 0:
        device = x.device
        objective = DistributionMatching(
            real=UniformClassSampler(x, y, num_classes, batch_real),
            extractor=RandomModelSampler(lambda seed: random_model(seed).to(device)),
            num_classes=num_classes,
            dsa=DSAConfig() if dsa else None,
        )
        synthesize(syn, objective, steps, generator, lr_img=lr_img)
    return syn


def _cache_dir() -> Path:
    return Path(os.environ.get("FEDVL_CACHE_DIR", Path.home() / ".cache" / "fedvl"))


def local_virtual_data(
    clients: list[tuple[torch.Tensor, torch.Tensor]],
    num_classes: int,
    random_model: Callable[[int], FedModel],
    key: dict[str, object],
    ipc: int,
    steps: int,
    seed: int,
    init: str = "stats",
    batch_real: int = 64,
    lr_img: float = 1.0,
    cache: bool = True,
    device: torch.device | str = "cpu",
    min_count: int = MIN_CLASS_COUNT,
) -> list[SyntheticSet]:
    """Distil every client's data once on `device` (cached on the CPU by `key` and settings)."""
    settings = {**key, "ipc": ipc, "steps": steps, "seed": seed, "init": init,
                "batch_real": batch_real, "lr_img": lr_img, "min_count": min_count, "v": 2}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()
                            ).hexdigest()[:16]
    path = _cache_dir() / f"local-virtual-{digest}.pt"
    if cache and path.is_file():
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            return [SyntheticSet(i, lab, num_classes, {"init": init, "cached": True})
                    for i, lab in zip(blob["images"], blob["labels"], strict=True)]
        except Exception:  # noqa: BLE001 - a damaged cache is recomputed, never trusted
            path.unlink(missing_ok=True)
    sets = []
    for k, (x, y) in enumerate(clients):
        g = generator(seed, k, 41)
        syn = distill_client(x.to(device), y.to(device), num_classes, random_model, ipc, steps,
                             g, init, batch_real, lr_img, min_count=min_count)
        sets.append(SyntheticSet(syn.images.detach().cpu(), syn.labels.cpu(), num_classes,
                                 syn.meta))
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"images": [s.images.detach() for s in sets],
                    "labels": [s.labels for s in sets], "settings": settings}, tmp)
        os.replace(tmp, path)
    return sets

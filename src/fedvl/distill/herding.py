"""Herding coresets: per class, the real images whose running feature mean tracks the class mean.

Greedy herding (Welling 2009, in the class-wise form of iCaRL, Rebuffi et al. 2017, Alg. 4):
with mu the mean feature of a class, pick at step k the not-yet-picked image i minimising
||mu - (phi_i + sum_{j<k} phi_pj) / k||, i.e. the image whose addition brings the running mean
of the picks closest to the class mean. Ties go to the lowest index. Features are used as
given (no L2 normalisation): the caller chooses the feature space.

A coreset *selects* real images: what it yields are private images, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def herding(features: torch.Tensor, m: int) -> torch.Tensor:
    """Indices (in pick order) of `m` rows of `features` [n, d] chosen greedily by herding."""
    n = int(features.shape[0])
    if m < 0 or m > n:
        raise ValueError(f"herding picks 0..{n} of {n} rows, not {m}")
    f = features.reshape(n, -1).double()
    mu = f.mean(0)
    total = torch.zeros_like(mu)
    free = torch.ones(n, dtype=torch.bool, device="cpu")
    picks: list[int] = []
    for k in range(1, m + 1):
        dist = ((mu - (total + f) / k) ** 2).sum(1)
        dist[~free] = float("inf")
        i = int(torch.argmin(dist))
        picks.append(i)
        free[i] = False
        total += f[i]
    return torch.tensor(picks, dtype=torch.long, device="cpu")


def herding_coreset(
    x: torch.Tensor, y: torch.Tensor, per_class: Sequence[int],
    features: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class c, herding's first min(per_class[c], n_c) images of (x, y) in `features`'
    space; returned as (images, labels), classes in order, each class's picks in pick order."""
    xs, ys = [], []
    for c, want in enumerate(per_class):
        idx = (y == c).nonzero().flatten()
        take = min(int(want), len(idx))
        if take == 0:
            continue
        pick = idx[herding(features(x[idx]), take).to(idx.device)]
        xs.append(x[pick])
        ys.append(y[pick])
    if not xs:
        return x[:0].clone(), y[:0].clone()
    return torch.cat(xs).clone(), torch.cat(ys).clone()

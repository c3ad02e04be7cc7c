"""How different clients' data are: Gaussian-kernel MMD between clients' samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedvl.data.federated import FederatedDataset
from fedvl.progress import emit


def mmd2_rbf(x: torch.Tensor, y: torch.Tensor, bandwidths: tuple[float, ...]) -> float:
    """Unbiased MMD^2 between two sample sets with a sum of RBF kernels of given bandwidths."""
    x, y = x.flatten(1).double(), y.flatten(1).double()
    z = torch.cat([x, y])
    d2 = torch.cdist(z, z).pow(2)
    k = sum(torch.exp(-d2 / (2 * b * b)) for b in bandwidths)
    n, m = len(x), len(y)
    kxx, kyy, kxy = k[:n, :n], k[n:, n:], k[:n, n:]
    sxx = (kxx.sum() - kxx.diagonal().sum()) / (n * (n - 1))
    syy = (kyy.sum() - kyy.diagonal().sum()) / (m * (m - 1))
    return float(sxx + syy - 2 * kxy.mean())


def median_bandwidths(reps: list[torch.Tensor], g: torch.Generator) -> tuple[float, ...]:
    """Median pairwise distance of the pooled sample times 2^{-1,0,1}."""
    pooled = torch.cat(reps).double()
    sub = pooled[torch.randperm(len(pooled), generator=g, device=g.device)[:1000]]
    d = torch.cdist(sub, sub)
    med = d[d > 0].median().item()
    return (0.5 * med, med, 2.0 * med)


def heterogeneity(fed: FederatedDataset, samples: int = 200, seed: int = 0,
                  features: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  bandwidths: tuple[float, ...] | None = None,
                  groups: list[str] | None = None) -> dict[str, Any]:
    """Pairwise client MMD^2 of training images (or `features`), with a within-client floor.

    The floor compares two disjoint halves of one client's data, so a pairwise value far above
    it means a real distribution shift. All entries share one bandwidth set to be comparable;
    pass `bandwidths` (e.g. another analysis' `"bandwidths"`) to compare two analyses.
    `groups` (default: the benchmark's `client_groups`, e.g. cifar10c's corruption of each
    client) adds the mean over pairs in the same group and over pairs in different groups.
    """
    groups = groups if groups is not None else fed.info.get("client_groups")
    g = torch.Generator().manual_seed(seed)
    halves = []
    for c in fed.clients:
        idx = torch.randperm(c.num_train, generator=g, device=g.device)[: 2 * samples]
        x = c.x_train[idx]
        if features is not None:
            with torch.no_grad():
                x = features(x)
        x = x.flatten(1)
        h = len(x) // 2
        halves.append((x[:h], x[h : 2 * h]))
    bw = tuple(bandwidths) if bandwidths else median_bandwidths([a for a, _ in halves], g)
    k = len(halves)
    pair = np.zeros((k, k))
    for i in range(k):
        for j in range(i + 1, k):
            pair[i, j] = pair[j, i] = mmd2_rbf(halves[i][0], halves[j][1], bw)
        emit(step=i + 1, total=k, unit="client")   # rows done, for a progress display
    floor = [mmd2_rbf(a, b, bw) for a, b in halves]
    off = pair[~np.eye(k, dtype=bool)] if k > 1 else np.zeros(1)
    grouped: dict[str, Any] = {}
    if groups is not None and len(set(groups)) > 1:
        if len(groups) != k:
            raise ValueError(f"{len(groups)} client groups for {k} clients")
        g_arr = np.array(groups)
        same = (g_arr[:, None] == g_arr[None, :]) & ~np.eye(k, dtype=bool)
        diff = g_arr[:, None] != g_arr[None, :]
        grouped = {"groups": list(groups),
                   "mean_between_group_mmd2": float(pair[diff].mean())}
        if same.any():
            grouped["mean_within_group_mmd2"] = float(pair[same].mean())
    return {
        "clients": fed.client_names,
        "pairwise_mmd2": pair.round(6).tolist(),
        "within_client_mmd2": [round(v, 6) for v in floor],
        "mean_pairwise_mmd2": float(off.mean()),
        "mean_within_client_mmd2": float(np.mean(floor)),
        "samples_per_client": samples,
        "bandwidths": list(bw),
        **grouped,
    }

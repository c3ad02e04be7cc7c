"""State-dict arithmetic used by aggregation rules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

StateDict = dict[str, torch.Tensor]


def clone_state(sd: Mapping[str, torch.Tensor]) -> StateDict:
    """Detached copy of a state dict."""
    return {k: v.detach().clone() for k, v in sd.items()}


def weighted_average(states: Sequence[Mapping[str, torch.Tensor]],
                     weights: Sequence[float]) -> StateDict:
    """Weighted mean of state dicts; integer buffers (e.g. BN step counters) come from the first."""
    total = float(sum(weights))
    if not states or total <= 0:
        raise ValueError("weighted_average needs at least one state with positive weight")
    out: StateDict = {}
    for k, v0 in states[0].items():
        if not torch.is_floating_point(v0):
            out[k] = v0.clone()
            continue
        acc = torch.zeros_like(v0)
        for sd, w in zip(states, weights, strict=True):
            acc.add_(sd[k], alpha=w / total)
        out[k] = acc
    return out


def robust_average(states: Sequence[Mapping[str, torch.Tensor]], rule: str,
                   trim: float = 0.2) -> StateDict:
    """Coordinate-wise median or trimmed mean of state dicts (sample counts play no part).

    `trimmed-mean` drops the floor(trim * n) largest and smallest values of every coordinate
    (fewer when that would leave nothing) before averaging: one client sending huge values can
    then move no coordinate by more than the spread of the others.
    """
    if not states:
        raise ValueError("robust_average needs at least one state")
    if rule not in ("median", "trimmed-mean"):
        raise ValueError(f"robust rule '{rule}' is unknown; allowed: median, trimmed-mean")
    n = len(states)
    cut = min(int(trim * n), (n - 1) // 2)
    out: StateDict = {}
    for k, v0 in states[0].items():
        if not torch.is_floating_point(v0):
            out[k] = v0.clone()
            continue
        stacked = torch.stack([sd[k] for sd in states])
        if rule == "median":
            # The mean of the two middle values for even n (torch.median returns the lower one).
            ordered = stacked.sort(dim=0).values
            out[k] = ordered[(n - 1) // 2: n // 2 + 1].mean(dim=0)
        else:
            out[k] = stacked.sort(dim=0).values[cut: n - cut].mean(dim=0)
    return out


def parameter_keys(model: torch.nn.Module) -> frozenset[str]:
    """State-dict keys of a model's parameters, i.e. everything but its buffers (BN statistics)."""
    return frozenset(name for name, _ in model.named_parameters(remove_duplicate=False))


def batch_norm_keys(model: torch.nn.Module) -> frozenset[str]:
    """State-dict keys of a model's BatchNorm layers (weight, bias, running mean and variance,
    step counter), chosen by layer type, not by name."""
    out: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            out |= {f"{prefix}.{k}" if prefix else k for k in module.state_dict()}
    return frozenset(out)

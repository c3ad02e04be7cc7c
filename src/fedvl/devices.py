"""Moving host-made tensors and models to the run's device without making the host wait.

A copy from ordinary (pageable) host memory to a GPU waits for the device's queue to drain
before it starts: each index batch, augmentation draw or fresh random network a synthesis step
sends over would stall the host until the GPU finished everything queued before it. From
pinned (page-locked) memory the copy is queued like a kernel and the host goes on; torch's
pinned-memory cache keeps the source alive until the copy is done. On the CPU these are plain
`.to` calls: the numbers never change.
"""

from __future__ import annotations

import torch
from torch import nn


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; a CPU tensor bound for a GPU goes through pinned memory, unwaited."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def copy_into(target: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t`'s values copied into `target` (on any device), from pinned memory, unwaited."""
    if target.device.type == "cuda" and t.device.type == "cpu":
        return target.copy_(t.pin_memory(), non_blocking=True)
    return target.copy_(t)


def module_to(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model` moved to `device` in place (as `model.to(device)`), its tensors copied unwaited."""
    device = torch.device(device)
    if device.type != "cuda":
        return model.to(device)
    with torch.no_grad():
        for p in model.parameters():
            if p.device.type == "cpu":
                p.data = p.data.pin_memory()
        for name, b in list(model.named_buffers()):
            if b.device.type == "cpu":
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, b.pin_memory())
    return model.to(device, non_blocking=True)


def needs_deterministic_kernels(t: torch.Tensor) -> bool:
    """Whether work on `t` must avoid ops torch runs only nondeterministically: deterministic
    mode (`--deterministic`) is on and `t` is on an accelerator (CPU kernels are deterministic)."""
    return torch.are_deterministic_algorithms_enabled() and t.device.type != "cpu"


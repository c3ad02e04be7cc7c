"""Several clients' local SGD as one vectorised model: stacked parameters under `torch.vmap`.

A round's clients of one architecture train together: client k's parameters are row k of
stacked tensors, each step's batches are stacked (shorter ones padded and masked out), and one
`vmap` of `torch.func.grad` over `functional_call` gives every client's gradient at once. On a
GPU that turns a cohort of small models into a few large kernels instead of many tiny ones.

Each client sees exactly what `local_train` gives it: the same batches from its own generator,
the mean cross-entropy over its real samples, and PyTorch's SGD update (momentum buffer started
from the first gradient, weight decay added to the gradient); a client whose batches are
exhausted holds still. The arithmetic is regrouped by vmap, so weights agree with
`local_train`'s to float rounding, not bit for bit (`tests/test_stacked.py` states the
tolerance). Models that normalise with batch statistics (BatchNorm in train mode) are refused:
their buffers would need per-client updates that vmap cannot write in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from fedvl.core.training import (
    TrainConfig,
    TrainStats,
    autocast_context,
    batch_indices,
    check_plain_sgd,
    check_round_config,
)
from fedvl.models.base import FedModel


def stackable(model: FedModel) -> bool:
    """Whether `model` can train stacked: no BatchNorm (its buffers change per batch)."""
    return not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                   for m in model.modules())


def _masked_ce(model: FedModel, params: dict[str, torch.Tensor],
               buffers: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    logits = functional_call(model, (params, buffers), (x,))
    per = F.cross_entropy(logits, y, reduction="none") * mask
    return per.sum() / mask.sum().clamp_min(1)


def stacked_local_train(
    model: FedModel,
    weights: Sequence[dict[str, torch.Tensor]],
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
    cfg: TrainConfig,
    generators: Sequence[torch.Generator],
) -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
    """Train K copies of `model` (client k from `weights[k]` on `data[k]`) together.

    Returns each client's trained state dict and its training stats, in input order.
    """
    check_round_config(cfg)
    check_plain_sgd(cfg, "stacked training")
    if not stackable(model):
        raise ValueError("stacked training needs a model without BatchNorm; this model "
                         "normalises with batch statistics")
    k = len(weights)
    if not (k == len(data) == len(generators)) or k == 0:
        raise ValueError(f"stacked training needs as many weights, data sets and generators "
                         f"(got {len(weights)}, {len(data)}, {len(generators)}), at least one")
    model.train()
    names = [n for n, _ in model.named_parameters()]
    buffers = {n: b for n, b in model.named_buffers()}
    params = {n: torch.stack([w[n].detach() for w in weights]).clone() for n in names}
    device = params[names[0]].device
    plans = [list(batch_indices(len(y), cfg.batch_size, cfg.local_epochs, cfg.local_steps, g))
             for (_, y), g in zip(data, generators, strict=True)]
    steps = max((len(p) for p in plans), default=0)
    width = max((len(b) for p in plans for b in p), default=0)
    def masked_ce(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                  m: torch.Tensor) -> torch.Tensor:
        with autocast_context(cfg.autocast, device):
            return _masked_ce(model, p, buffers, x, y, m)
    step = vmap(grad_and_value(masked_ce))
    momentum: dict[str, torch.Tensor] = {}
    # Summed on the device (float64, as on the host): a copy back per step would wait on it.
    loss_sums = torch.zeros(k, dtype=torch.float64, device=device)
    samples = [0] * k
    shape = data[0][0].shape[1:]
    for s in range(steps):
        x = torch.zeros(k, width, *shape, dtype=data[0][0].dtype, device=device)
        y = torch.zeros(k, width, dtype=torch.long, device=device)
        mask = torch.zeros(k, width, device=device)
        active = torch.zeros(k, dtype=torch.bool, device=device)
        for c, plan in enumerate(plans):
            if s < len(plan):
                idx = plan[s].to(data[c][0].device)
                n = len(idx)
                x[c, :n], y[c, :n], mask[c, :n] = data[c][0][idx], data[c][1][idx], 1.0
                active[c] = True
                samples[c] += n
        grads, losses = step(params, x, y, mask)
        with torch.no_grad():
            loss_sums += torch.where(active, losses, torch.zeros_like(losses)).double()
            for n in names:
                g = grads[n]
                if cfg.weight_decay:
                    g = g + cfg.weight_decay * params[n]
                if cfg.momentum:
                    # torch.optim.SGD: the buffer starts as the first gradient.
                    buf = g if n not in momentum else cfg.momentum * momentum[n] + g
                    on = active.view(-1, *[1] * (g.dim() - 1))
                    momentum[n] = torch.where(on, buf, momentum.get(n, buf))
                    g = buf
                on = active.view(-1, *[1] * (g.dim() - 1))
                params[n] = torch.where(on, params[n] - cfg.lr * g, params[n])
    out = []
    loss_sums = loss_sums.cpu()
    for c in range(k):
        state = {n: t.clone() for n, t in weights[c].items()}
        for n in names:
            state[n] = params[n][c].detach().clone()
        stats = TrainStats(len(plans[c]), samples[c], float(loss_sums[c]) / max(len(plans[c]), 1))
        out.append((state, stats))
    return out

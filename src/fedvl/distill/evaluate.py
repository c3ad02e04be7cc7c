"""Train fresh evaluation models on a (synthetic or real) set and test them, as DC/DM evaluate.

`local_train` has no augmentation hook and no lr schedule, and re-creating it per epoch would
reset momentum, so evaluation uses its own short loop (SGD lr 0.01, momentum 0.9, weight decay
5e-4, lr x0.1 halfway, per-sample DSA on every batch as in the DM paper's evaluation) and reuses
`batch_indices` and `evaluate` from the training engine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fedvl.distill.augment import DSAConfig, augment_batch
from fedvl.engine.training import batch_indices, evaluate
from fedvl.models.base import FedModel


@dataclass
class EvalConfig:
    """Evaluation-model training (reference `evaluate_synset` defaults, fewer epochs)."""

    epochs: int = 300
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 256
    # Mode S with per-image parameters, as DM evaluation calls DiffAugment without a seed.
    dsa: DSAConfig | None = field(default_factory=DSAConfig)


def train_on_set(model: FedModel, x: torch.Tensor, y: torch.Tensor, cfg: EvalConfig,
                 generator: torch.Generator) -> FedModel:
    """Train `model` in place on (x, y) for cfg.epochs epochs; returns it."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(y) / cfg.batch_size)
    decay_at = (cfg.epochs // 2 + 1) * per_epoch
    for step, idx in enumerate(batch_indices(len(y), cfg.batch_size, cfg.epochs, None,
                                             generator)):
        if step == decay_at:
            for grp in opt.param_groups:
                grp["lr"] = cfg.lr * 0.1
        xb, yb = x[idx], y[idx]
        if cfg.dsa is not None:
            xb = augment_batch(xb, generator, cfg.dsa)
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


def evaluate_set(
    x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
    model_fn: Callable[[int], FedModel], num_models: int, cfg: EvalConfig, seed: int = 0,
) -> dict[str, object]:
    """Test accuracy of `num_models` fresh models trained on (x, y): mean, std and each value."""
    accs = []
    for i in range(num_models):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        model = train_on_set(model_fn(seed * 1000 + i), x.detach(), y, cfg, g)
        accs.append(evaluate(model, x_test, y_test)[0])
    return {"mean": statistics.fmean(accs),
            "std": statistics.stdev(accs) if len(accs) > 1 else 0.0, "values": accs}

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

from fedvl.core.training import TrainConfig, evaluate, local_train
from fedvl.distill.augment import DSAConfig, augment_batch
from fedvl.models.base import FedModel
from fedvl.progress import emit, enabled, scope


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
    train = TrainConfig(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                        local_epochs=cfg.epochs, batch_size=cfg.batch_size)
    dsa = cfg.dsa
    augment = None if dsa is None else (lambda xb, g: augment_batch(xb, g, dsa))
    per_epoch = math.ceil(len(y) / cfg.batch_size)
    decay_at = (cfg.epochs // 2 + 1) * per_epoch
    after_step = None
    if enabled():
        # Epoch counts for a progress display; the hook reads nothing of the model.
        steps = [0]

        def after_step(_model: FedModel, _lr: float) -> None:
            steps[0] += 1
            if steps[0] % per_epoch == 0:
                emit(step=steps[0] // per_epoch, total=cfg.epochs, unit="epoch")
    local_train(model, x, y, train, generator, augment=augment, lr_decay_step=decay_at,
                after_step=after_step)
    return model


def evaluate_set(
    x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
    model_fn: Callable[[int], FedModel], num_models: int, cfg: EvalConfig, seed: int = 0,
) -> dict[str, object]:
    """Test accuracy of `num_models` fresh models trained on (x, y): mean, std and each value."""
    accs = []
    for i in range(num_models):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        with scope(model=i + 1, models=num_models):   # named in progress events
            model = train_on_set(model_fn(seed * 1000 + i), x.detach(), y, cfg, g)
        accs.append(evaluate(model, x_test, y_test)[0])
    return {"mean": statistics.fmean(accs),
            "std": statistics.stdev(accs) if len(accs) > 1 else 0.0, "values": accs}

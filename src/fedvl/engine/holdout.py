"""Clients never seen in training (`--holdout-clients`): how the federation's result serves them.

A method with a global model is scored as it is on each held-out client's test set. A
personalised method has no model for a newcomer, so the new client does what such a client can
do with its own labelled training data: it takes the training client's model that scores best
on that data, fine-tunes a copy for the run's local epochs with plain cross-entropy, and is
scored on its test set.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedvl.core.training import TrainConfig, evaluate, local_train, mean_accuracy
from fedvl.data.federated import ClientData
from fedvl.models.base import FedModel
from fedvl.seeding import generator

# Stream id of a held-out client's fine-tuning batch order.
FINETUNE_STREAM = 43


def holdout_scores(clients: Sequence[ClientData], global_model: FedModel | None,
                   client_models: Sequence[FedModel], train: TrainConfig, seed: int, rnd: int,
                   names: Sequence[str], device: torch.device) -> dict[str, Any]:
    """Per held-out client accuracy (`holdout_accuracy`) and its mean; for personalised
    methods also which training client's model each one adopted (`holdout_source`)."""
    acc: dict[str, float] = {}
    source: dict[str, str] = {}
    for k, c in enumerate(clients):
        x, y, xt, yt = (t.to(device) for t in (c.x_train, c.y_train, c.x_test, c.y_test))
        if global_model is not None:
            acc[c.name] = evaluate(global_model, xt, yt)[0]
            continue
        fit = [evaluate(m, x, y)[0] for m in client_models]
        best = int(np.argmax(fit))   # the first of equals: the order of the training clients
        model = copy.deepcopy(client_models[best])
        local_train(model, x, y, train.at_round(rnd), generator(seed, rnd, k, FINETUNE_STREAM))
        acc[c.name] = evaluate(model, xt, yt)[0]
        source[c.name] = names[best]
    out: dict[str, Any] = {"holdout_accuracy": acc,
                           "mean_holdout_accuracy": mean_accuracy(acc.values())}
    if source:
        out["holdout_source"] = source
    return out

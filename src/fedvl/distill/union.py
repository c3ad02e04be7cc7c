"""The server half of methods whose clients upload synthetic sets (FedDM, FedD3, FedAF): the form
of a set upload, the union of a round's uploads, and the global model's SGD on it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedvl.core.message import Message
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.core.training import LossTerm, TrainConfig, TrainStats, local_train
from fedvl.models.base import FedModel

# Server random stream (ServerContext.stream id) of the server training's batch order.
SERVER_TRAIN_STREAM = 67


@dataclass(frozen=True)
class ServerTraining:
    """The server's training on the union: epochs, learning rate, momentum, weight decay, batch
    and optimiser (SGD unless the method's options name `server_optimizer`)."""

    epochs: int
    lr: float
    momentum: float
    weight_decay: float
    batch_size: int
    optimizer: str = "sgd"

    @classmethod
    def of(cls, p: Any) -> ServerTraining:
        """The settings a method's options hold as `server_epochs`, `server_lr`,
        `server_momentum`, `server_weight_decay`, `server_batch_size` (and
        `server_optimizer`)."""
        return cls(p.server_epochs, p.server_lr, p.server_momentum, p.server_weight_decay,
                   p.server_batch_size, getattr(p, "server_optimizer", "sgd"))

    def config(self) -> TrainConfig:
        """The settings as the training loop's config."""
        return TrainConfig(lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                           local_epochs=self.epochs, batch_size=self.batch_size,
                           optimizer=self.optimizer)


def synthetic_set_spec(spec: ReplySpec, image_shape: tuple[int, ...], max_rows: int
                       ) -> ReplySpec:
    """`spec` requiring one set `x` of float32 images with class indices `y`, at most
    `max_rows` images: the server trains on the union, so every reply must take one dtype and
    one label form."""
    spec.exact["synthetic_images"] = {"x": TensorSpec((None, *image_shape), torch.float32)}
    spec.exact["synthetic_labels"] = {"y": TensorSpec((None,), torch.int64)}
    spec.max_rows["synthetic_images"] = max_rows
    return spec


def received_sets(replies: Mapping[int, Message], images: str = "x", labels: str = "y"
                  ) -> tuple[dict[int, Message], torch.Tensor | None, torch.Tensor | None]:
    """The replies that carry a synthetic set and the union of their sets, in reply order
    (None, None when none does). A client whose upload guard withheld its set sent none."""
    sending = {c: r for c, r in replies.items() if "synthetic_images" in r.arrays}
    if not sending:
        return sending, None, None
    x = torch.cat([r.arrays["synthetic_images"][images] for r in sending.values()])
    y = torch.cat([r.arrays["synthetic_labels"][labels] for r in sending.values()])
    return sending, x, y


def train_on_union(model: FedModel, x: torch.Tensor, y: torch.Tensor, training: ServerTraining,
                   generator: torch.Generator, terms: Sequence[LossTerm] = (),
                   after_step: Callable[[FedModel, float], None] | None = None,
                   sample_weight: torch.Tensor | None = None) -> TrainStats:
    """Train the global model in place on the union (x, y): CE plus `terms`."""
    return local_train(model, x, y, training.config(), generator, terms=terms,
                       after_step=after_step, sample_weight=sample_weight)

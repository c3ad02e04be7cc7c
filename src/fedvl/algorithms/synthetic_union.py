"""What servers that train one model on the union of the clients' synthetic sets share (FedDM,
FedD3): the form of a set upload, the sets a round's replies carry, the server's optimiser."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedvl.core.message import Message
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.core.training import TrainConfig


def synthetic_set_spec(spec: ReplySpec, image_shape: tuple[int, ...], max_rows: int
                       ) -> ReplySpec:
    """`spec` requiring one set `x` of float32 images with class indices `y`, at most
    `max_rows` images: the server trains on the union, so every reply must take one dtype and
    one label form."""
    spec.exact["synthetic_images"] = {"x": TensorSpec((None, *image_shape), torch.float32)}
    spec.exact["synthetic_labels"] = {"y": TensorSpec((None,), torch.int64)}
    spec.max_rows["synthetic_images"] = max_rows
    return spec


def received_sets(replies: Mapping[int, Message]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """(images, labels) of every reply that carries a set, in reply order; a client whose
    upload guard withheld its set sends none and is left out."""
    return {c: (r.arrays["synthetic_images"]["x"], r.arrays["synthetic_labels"]["y"])
            for c, r in replies.items() if "synthetic_images" in r.arrays}


def server_train_config(p: Any) -> TrainConfig:
    """The server's SGD on the union, from a method's `server_*` options (epochs, learning
    rate, momentum, weight decay, batch size)."""
    return TrainConfig(lr=p.server_lr, momentum=p.server_momentum,
                       weight_decay=p.server_weight_decay, local_epochs=p.server_epochs,
                       batch_size=p.server_batch_size)

"""Messages: the only thing the two halves of an algorithm exchange."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Scalar = bool | int | float | str
MetaValue = Scalar | list[int] | list[float] | list[str]

# Vocabulary of payload kinds; the ledger reports bytes under these names.
KINDS = (
    "weights",            # model parameters and buffers
    "updates",            # model deltas / pseudo-gradients
    "gradients",
    "control_variates",   # SCAFFOLD c, c_i
    "synthetic_images",   # distilled / virtual images
    "synthetic_labels",
    "logits",
    "prototypes",         # class-mean features or logits
    "statistics",         # per-class statistics (pixel moments, label counts)
    "generator",          # a generative model's weights (FedGen's feature generator)
    "discriminator",      # a GAN discriminator's weights (FedGAN)
    "mean_images",        # averages of groups of a client's private images (FedMix)
    "mean_labels",        # the matching averaged one-hot labels
    "optimizer",          # server optimiser state (never leaves the server in practice)
    # A client's private training data itself: only the `centralised` reference sends them
    # (it pools the data on the server by design; it is not a federated method).
    "raw_images",
    "raw_labels",
)


class MessageError(ValueError):
    """A message is malformed; the text names the offending field and what is allowed."""


@dataclass
class Message:
    """Named tensors grouped by payload kind, plus small scalar metadata."""

    arrays: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)

    def nbytes(self, kind: str | None = None) -> int:
        """Bytes of tensor payload, for one kind or all kinds.

        Only dense tensors with storage count: a malformed reply (a sparse or meta-device
        tensor, a non-tensor) is measured before it is rejected, and claims no bytes it lacks.
        """
        if not isinstance(self.arrays, Mapping):
            return 0
        kinds = [kind] if kind is not None else list(self.arrays)
        total = 0
        for k in kinds:
            tensors = self.arrays.get(k, {})
            for t in tensors.values() if isinstance(tensors, Mapping) else ():
                if (isinstance(t, torch.Tensor) and t.layout == torch.strided
                        and t.device.type != "meta"):
                    total += int(t.numel() * t.element_size())
        return total

    def bytes_by_kind(self) -> dict[str, int]:
        """Payload bytes per kind."""
        return {k: self.nbytes(k) for k in self.arrays} if isinstance(self.arrays, Mapping) else {}

    def copy(self) -> Message:
        """A deep copy on the CPU-side semantics of a network hop (no shared storage).

        What is not a tensor is carried over as it is, unchecked: a hop delivers whatever a
        client sent, and the receiver's reply check rejects it.
        """
        if not (isinstance(self.arrays, Mapping) and isinstance(self.meta, Mapping)
                and all(isinstance(d, Mapping) for d in self.arrays.values())):
            return _unchecked(self.arrays, self.meta)
        arrays = {k: {n: t.detach().clone() if isinstance(t, torch.Tensor) else t
                      for n, t in d.items()} for k, d in self.arrays.items()}
        return _unchecked(arrays, dict(self.meta))

    def to(self, device: torch.device | str) -> Message:
        """The same message with every tensor on `device`."""
        return Message(
            {k: {n: t.to(device) for n, t in d.items()} for k, d in self.arrays.items()},
            dict(self.meta),
        )

    def get(self, kind: str) -> dict[str, torch.Tensor]:
        """The tensors of one kind, or an error naming the kinds present."""
        if kind not in self.arrays:
            raise MessageError(f"message has no '{kind}' payload; it has {sorted(self.arrays)}")
        return self.arrays[kind]


def _unchecked(arrays: Any, meta: Any) -> Message:
    """A Message holding `arrays` and `meta` without the constructor's check."""
    msg = Message.__new__(Message)
    msg.arrays, msg.meta = arrays, meta
    return msg


def copy_reply(reply: Any) -> Any:
    """A network hop for a client's reply: a copy of a Message, anything else as it is.

    The server's reply check rejects what is not a Message; the hop must not fail on it first.
    """
    return reply.copy() if isinstance(reply, Message) else reply


def validate(msg: Message) -> None:
    """Check a message's structure: known kinds, str names, tensors, scalar metadata."""
    if not isinstance(msg.arrays, Mapping):
        raise MessageError("message arrays must be a dict kind -> {name: tensor}")
    for kind, tensors in msg.arrays.items():
        if kind not in KINDS:
            raise MessageError(f"unknown payload kind '{kind}'; allowed: {', '.join(KINDS)}")
        if not isinstance(tensors, Mapping):
            raise MessageError(f"payload '{kind}' must be a dict name -> tensor")
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise MessageError(
                    f"payload '{kind}' entry {name!r} must map a str to a torch.Tensor, "
                    f"got {type(t).__name__}"
                )
    for key, value in msg.meta.items():
        ok = isinstance(value, bool | int | float | str) or (
            isinstance(value, list) and all(isinstance(v, int | float | str) for v in value)
        )
        if not isinstance(key, str) or not ok:
            raise MessageError(
                f"meta '{key}' must be a bool/int/float/str or a list of int/float/str, "
                f"got {type(value).__name__}"
            )

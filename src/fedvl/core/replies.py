"""What a reply may hold, and the check every reply passes before the server uses it.

A federation's clients run on machines the server does not control: a reply may carry NaN or
Inf, a tensor of the wrong shape, a payload kind the method never sends or nonsense metadata.
`check_reply` turns each of these into one `ReplyRejected` naming the field and the reason, so
the engine can drop that reply and go on with the rest of the round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fedvl.core.message import Message


@dataclass(frozen=True)
class TensorSpec:
    """The shape (None: any size on that axis) and dtype (None: any) a tensor must have."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype | None = None

    @classmethod
    def like(cls, t: torch.Tensor) -> TensorSpec:
        """The spec of a tensor exactly like `t`."""
        return cls(tuple(t.shape), t.dtype)

    def mismatch(self, t: torch.Tensor) -> str | None:
        """Why `t` does not fit, or None."""
        if len(t.shape) != len(self.shape) or any(
                s is not None and s != n for s, n in zip(self.shape, t.shape, strict=True)):
            want = "x".join("*" if s is None else str(s) for s in self.shape) or "scalar"
            return f"shape {tuple(t.shape)} where {want} is expected"
        if self.dtype is not None and t.dtype != self.dtype:
            return f"dtype {t.dtype} where {self.dtype} is expected"
        return None


@dataclass
class ReplySpec:
    """What one reply may hold: its kinds, exact tensors for some kinds, required metadata.

    `exact[kind]` names every tensor that kind must hold (no more, no fewer), each with its
    spec; kinds not in `exact` are checked by the vocabulary's rules only (finite values;
    images of `image_shape`; labels and logits over `num_classes`).
    """

    kinds: frozenset[str]
    exact: dict[str, dict[str, TensorSpec]] = field(default_factory=dict)
    # kind -> the specs of tensors named '<prefix>/<key>' (e.g. per-class gradients "3/conv.w").
    keyed: dict[str, dict[str, TensorSpec]] = field(default_factory=dict)
    required_meta: frozenset[str] = frozenset()
    num_classes: int | None = None
    image_shape: tuple[int, ...] | None = None


class ReplyRejected(ValueError):
    """A reply failed its check; `field` names the offending part, `reason` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


# Metadata every method reads the same way: name -> (check, what is allowed).
_META_RULES = {
    "num_examples": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                     "a positive int"),
    "steps": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "a non-negative int"),
    "train_loss": (lambda v: isinstance(v, int | float) and not isinstance(v, bool)
                   and math.isfinite(v), "a finite number"),
}


def check_reply(msg: Message, spec: ReplySpec) -> None:
    """Raise `ReplyRejected` for the first thing in `msg` that `spec` does not allow."""
    for kind in msg.arrays:
        if kind not in spec.kinds:
            raise ReplyRejected(kind, f"payload kind this method never sends here (allowed: "
                                      f"{', '.join(sorted(spec.kinds)) or 'none'})")
    for kind, tensors in msg.arrays.items():
        for name, t in tensors.items():
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                raise ReplyRejected(f"{kind}/{name}", "holds NaN or Inf values")
    for kind, want in spec.exact.items():
        got = msg.arrays.get(kind)
        if got is None:
            continue
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise ReplyRejected(kind, f"tensor names differ from the server's (missing "
                                      f"{missing[:3]}, unexpected {extra[:3]})")
        for name, ts in want.items():
            why = ts.mismatch(got[name])
            if why:
                raise ReplyRejected(f"{kind}/{name}", why)
    for kind, want in spec.keyed.items():
        for name, t in msg.arrays.get(kind, {}).items():
            key = name.split("/", 1)[-1]
            if key not in want:
                raise ReplyRejected(f"{kind}/{name}", f"'{key}' is not one of the server's "
                                                      f"tensors")
            why = want[key].mismatch(t)
            if why:
                raise ReplyRejected(f"{kind}/{name}", why)
    _check_vocabulary(msg, spec)
    for key in spec.required_meta:
        if key not in msg.meta:
            raise ReplyRejected(f"meta/{key}", "missing")
    for key, (ok, allowed) in _META_RULES.items():
        if key in msg.meta and not ok(msg.meta[key]):
            raise ReplyRejected(f"meta/{key}", f"{msg.meta[key]!r} is not {allowed}")


def _check_vocabulary(msg: Message, spec: ReplySpec) -> None:
    """The rules that follow from a payload kind's meaning, whatever the method."""
    # Distilled sets, the centralised raw upload and FedMix's averaged images.
    for prefix in ("synthetic", "raw", "mean"):
        _check_images_and_labels(msg, spec, prefix)
    c = spec.num_classes
    for name, z in msg.arrays.get("logits", {}).items():
        if c is not None and (z.dim() == 0 or z.shape[-1] != c):
            raise ReplyRejected(f"logits/{name}",
                                f"shape {tuple(z.shape)}: the last axis must be the {c} classes")


def _check_images_and_labels(msg: Message, spec: ReplySpec, prefix: str) -> None:
    """`<prefix>_images` are float images of the run's shape, `<prefix>_labels` one class (or
    one row of class scores) per image."""
    images = msg.arrays.get(f"{prefix}_images", {})
    labels = msg.arrays.get(f"{prefix}_labels", {})
    for name, x in images.items():
        if not x.is_floating_point():
            raise ReplyRejected(f"{prefix}_images/{name}", f"dtype {x.dtype} is not floating")
        if spec.image_shape is not None and tuple(x.shape[1:]) != tuple(spec.image_shape):
            raise ReplyRejected(f"{prefix}_images/{name}",
                                f"shape {tuple(x.shape)} where N x {spec.image_shape} is expected")
    c = spec.num_classes
    for name, y in labels.items():
        if y.is_floating_point():   # soft labels: one row of class scores per image
            if y.dim() != 2 or (c is not None and y.shape[1] != c):
                raise ReplyRejected(f"{prefix}_labels/{name}",
                                    f"soft labels of shape {tuple(y.shape)}, not N x {c}")
        elif y.dim() != 1 or (c is not None and y.numel() and
                              (int(y.min()) < 0 or int(y.max()) >= c)):
            raise ReplyRejected(f"{prefix}_labels/{name}",
                                f"labels must be one class index in [0, {c}) per image")
    if images and labels:
        n_x = sum(int(x.shape[0]) for x in images.values())
        n_y = sum(int(y.shape[0]) for y in labels.values())
        if n_x != n_y:
            raise ReplyRejected(f"{prefix}_labels", f"{n_y} labels for {n_x} images")

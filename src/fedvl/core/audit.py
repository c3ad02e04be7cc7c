"""The upload audit: how close what a client sends is to its own private images.

On the client, before a message leaves it, every image-shaped tensor in the message (a tensor
whose trailing axes are the run's image shape, or whose rows are flattened images of that size)
is compared with the client's private training images by Pearson correlation: each image is
flattened, centred and scaled to unit length, so the correlation of two images is one dot
product and a whole comparison is a few chunked matrix products. The audit keeps the largest
|r| over every pair. The absolute value counts because a negated copy reveals as much as the
copy; centring and scaling make a brightened, dimmed or shifted copy (what the mean of an image
and a blank one is) score 1 as the copy itself does.

The guard withholds every tensor above its threshold, with the labels of that kind, before the
message is sent; the rest of the message still goes. A method whose setting uploads images
that start as private ones by design (FedDM and FedVCK with `init=real`; the centralised
reference's raw data) says so with `upload_exemption()`: its uploads are audited and warned
about once per client, not withheld.

Model parameters (weights, updates, gradients, control variates, a generator or a
discriminator) are not images and are not audited; DP-SGD is what protects them.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedvl.core.message import Message, MetaValue
from fedvl.defaults import DEFAULT_GUARD

log = logging.getLogger("fedvl")

# Parameter-shaped payloads: structured by parameter name, never images.
PARAMETER_KINDS = frozenset({"weights", "updates", "gradients", "control_variates", "generator",
                             "discriminator", "optimizer"})
# The labels that travel with an images kind: withheld with it, so no label outlives its image.
PAIRED_LABELS = {"synthetic_images": "synthetic_labels", "mean_images": "mean_labels",
                 "raw_images": "raw_labels"}
# Kinds that are the private images themselves by definition: scored 1 without comparing (an
# all-pairs comparison of a whole training set with itself would cost its square).
RAW_KINDS = frozenset({"raw_images"})
# Reply metadata that carries a client's audit of one round to the server.
CORR, TENSOR, WITHHELD = "upload_corr", "upload_tensor", "upload_withheld"
# Rows per side of one correlation block: 1024 x 4096 float32 = 16 MiB.
ROW_CHUNK, PRIVATE_CHUNK = 1024, 4096


def image_rows(t: torch.Tensor, image_shape: tuple[int, ...]) -> torch.Tensor | None:
    """`t` as rows of flattened images if it is image-shaped (trailing axes the image shape, or
    rows of that many values), else None."""
    d = math.prod(image_shape)
    if (t.layout != torch.strided or t.is_meta or not t.is_floating_point() or t.numel() == 0
            or d == 0):
        return None
    k = len(image_shape)
    if tuple(t.shape[-k:]) == tuple(image_shape) or (t.dim() >= 1 and t.shape[-1] == d):
        return t.detach().reshape(-1, d)
    return None


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row centred and scaled to unit length; a constant row stays zero (it matches no
    image: a blank image reveals nothing)."""
    x = torch.nan_to_num(x.float())
    x = x - x.mean(1, keepdim=True)
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def max_correlation(rows: torch.Tensor, private: Any) -> torch.Tensor:
    """For each row, the largest |Pearson r| with any of the `private` images (one value per
    row, in [0, 1]); `private` is anything sliceable into N x (image) tensors."""
    n = len(private)
    best = torch.zeros(len(rows), device="cpu")
    if n == 0 or len(rows) == 0:
        return best
    d = rows.shape[1]
    for j in range(0, n, PRIVATE_CHUNK):
        p = private[j:j + PRIVATE_CHUNK]
        p = _unit_rows(p.reshape(len(p), d))
        for i in range(0, len(rows), ROW_CHUNK):
            u = _unit_rows(rows[i:i + ROW_CHUNK].to(p.device))
            r = (u @ p.T).abs().amax(1).cpu()
            best[i:i + ROW_CHUNK] = torch.maximum(best[i:i + ROW_CHUNK], r)
    return best.clamp(0.0, 1.0)


def audit_message(msg: Message, private: Any, image_shape: tuple[int, ...]
                  ) -> dict[str, float]:
    """'kind/name' -> largest |r| with a private image, for every image-shaped tensor of `msg`."""
    out: dict[str, float] = {}
    for kind, tensors in msg.arrays.items():
        if kind in PARAMETER_KINDS:
            continue
        for name, t in tensors.items():
            rows = image_rows(t, image_shape)
            if rows is None:
                continue
            if kind in RAW_KINDS:
                out[f"{kind}/{name}"] = 1.0
            else:
                out[f"{kind}/{name}"] = float(max_correlation(rows, private).max())
    return out


@dataclass
class Audit:
    """One client's audit of what it sent in one round."""

    max_corr: float = 0.0
    tensor: str = ""                                   # 'kind/name' of the largest value
    withheld: list[str] = field(default_factory=list)  # kinds the guard kept back

    def merge(self, other: Audit | None) -> Audit:
        """The audit of both sendings (the larger value, every withheld kind)."""
        if other is None:
            return self
        top = self if self.max_corr >= other.max_corr else other
        return Audit(top.max_corr, top.tensor, sorted(set(self.withheld) | set(other.withheld)))

    def meta(self) -> dict[str, MetaValue]:
        """The reply metadata that carries this audit to the server."""
        return {CORR: self.max_corr, TENSOR: self.tensor, WITHHELD: bool(self.withheld)}


class UploadGuard:
    """Audits every message a process's clients send and withholds what copies a private image.

    `threshold` in (0, 1]: tensors with |r| above it are withheld (1 never withholds: |r| is at
    most 1). `exemption` (the method's `upload_exemption()`): uploads that start as private
    images by design; they are audited and warned about, once per client, not withheld.
    """

    def __init__(self, image_shape: tuple[int, ...], threshold: float = DEFAULT_GUARD,
                 exemption: str | None = None) -> None:
        self.image_shape = tuple(int(s) for s in image_shape)
        self.threshold, self.exemption = float(threshold), exemption
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def screen(self, msg: Message, private: Any, client: str) -> tuple[Message, Audit | None]:
        """`msg` as client `client` may send it, and its audit (None: nothing image-shaped)."""
        scores = audit_message(msg, private, self.image_shape)
        if not scores:
            return msg, None
        tensor = max(scores, key=lambda k: scores[k])
        audit = Audit(scores[tensor], tensor)
        over = sorted({k.split("/", 1)[0] for k, v in scores.items() if v > self.threshold})
        if not over:
            return msg, audit
        if self.exemption is not None:
            self._warn_once(client, audit)
            return msg, audit
        drop = set(over) | {PAIRED_LABELS[k] for k in over if k in PAIRED_LABELS}
        audit.withheld = sorted(drop)
        log.warning("client %s: upload withheld (%s correlates |r| = %.4f with a private "
                    "image, above --upload-guard %g): %s", client, tensor, audit.max_corr,
                    self.threshold, ", ".join(audit.withheld))
        kept = {k: v for k, v in msg.arrays.items() if k not in drop}
        return Message(kept, dict(msg.meta)), audit

    def screen_peers(self, sent: Mapping[Any, Any], private: Any, client: str
                     ) -> tuple[dict[Any, Any], Audit | None]:
        """A client's peer messages (receiver -> message) as its guard lets them go, and their
        merged audit. A message the guard emptied is not sent; one it cannot read travels as
        it is (the server's check rejects it)."""
        out: dict[Any, Any] = {}
        audit: Audit | None = None
        for r, m in sent.items():
            if not screenable(m):
                out[r] = m
                continue
            m, a = self.screen(m, private, client)
            audit = a.merge(audit) if a is not None else audit
            if m.arrays or a is None or not a.withheld:
                out[r] = m
        return out, audit

    def _warn_once(self, client: str, audit: Audit) -> None:
        with self._lock:
            if client in self._warned:
                return
            self._warned.add(client)
        log.warning("client %s sends %s, which correlates |r| = %.4f with a private image "
                    "(above --upload-guard %g); not withheld: %s", client, audit.tensor,
                    audit.max_corr, self.threshold, self.exemption)


def screenable(msg: Any) -> bool:
    """Whether `msg` is a Message whose arrays and metadata the upload guard can read."""
    return (isinstance(msg, Message) and isinstance(msg.arrays, Mapping)
            and isinstance(msg.meta, dict)
            and all(isinstance(d, Mapping) for d in msg.arrays.values()))


def exemption_of(algorithm: Any) -> str | None:
    """Why `algorithm`'s uploads may copy private images by design, or None (guarded)."""
    fn = getattr(algorithm, "upload_exemption", None)
    return fn() if callable(fn) else None


def with_audit(msg: Message, audit: Audit | None) -> Message:
    """`msg` with `audit` in its metadata (unchanged when there is nothing to report)."""
    if audit is not None:
        msg.meta.update(audit.meta())
    return msg


def round_audit(replies: dict[int, Any], name: Any) -> dict[str, dict[str, Any]]:
    """A round's audits as reported in its replies: client name -> max_corr, tensor, withheld.

    Values that do not have the audit's form are left out (the reply check names them)."""
    out: dict[str, dict[str, Any]] = {}
    for cid, r in replies.items():
        if not isinstance(r, Message) or not isinstance(r.meta, Mapping):
            continue
        v = r.meta.get(CORR)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
            continue
        tensor = r.meta.get(TENSOR, "")
        out[name(cid)] = {"max_corr": float(v),
                          "tensor": tensor[:100] if isinstance(tensor, str) else "",
                          "withheld": r.meta.get(WITHHELD) is True}
    return out


def summary_audit(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every round's audits as one list (summary.json's `upload_audit`)."""
    return [{"round": r["round"], "client": c, **a}
            for r in history for c, a in r.get("upload_audit", {}).items()]


def withheld_everything(msg: Any) -> bool:
    """Whether the guard kept back all that `msg` had to send (nothing left to aggregate)."""
    return (isinstance(msg, Message) and isinstance(msg.meta, Mapping)
            and msg.meta.get(WITHHELD) is True and not msg.arrays)

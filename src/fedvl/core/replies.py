"""What a reply may hold, and the check every reply passes before the server uses it.

A federation's clients run on machines the server does not control: a reply may be no message
at all, carry a numpy array, a sparse or meta tensor, NaN or Inf, a tensor of the wrong shape
or dtype, soft labels where the method takes class indices, a payload kind the method never
sends or metadata no honest client could produce (`num_examples = 10**400`, more examples than
it announced when it joined, FedNova steps it could not have taken). `check_reply` turns each
of these into one `ReplyRejected` naming the field and the reason, so the engine can drop that
reply and go on with the rest of the round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedvl.core.message import Message, MessageError, validate

# The dtype a tensor of each kind travels in (kinds with `exact` specs, e.g. weights, take the
# dtypes of what the server sent instead). Labels are class indices (int64) or, for methods
# that declare soft labels, one row of class probabilities (float32) per image.
KIND_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "synthetic_images": (torch.float32,), "raw_images": (torch.float32,),
    "mean_images": (torch.float32,), "logits": (torch.float32,),
    "prototypes": (torch.float32,), "statistics": (torch.float32,),
    "gradients": (torch.float32,), "updates": (torch.float32,),
    "control_variates": (torch.float32,),
    # Model states: float parameters, int64 counters (BatchNorm's num_batches_tracked).
    "weights": (torch.float32, torch.int64), "generator": (torch.float32, torch.int64),
    "discriminator": (torch.float32, torch.int64),
    "optimizer": (torch.float32, torch.int64),
}
# The largest count a float64 aggregation weight holds exactly: a bound for `num_examples`
# where the transport announced no training-set size.
MAX_COUNT = 2 ** 53
# Images travel normalised (per-channel mean/std), so a real pixel lies within a few units of 0;
# a value this far out is not an image but a way to blow up the server's training (1e30 images
# are finite, pass every other rule and turn the global model into Inf).
MAX_IMAGE_ABS = 1e3
# Longest value shown in a rejection reason: a reply's values are the sender's to choose.
SHOWN = 60


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
            want = "x".join("N" if s is None else str(s) for s in self.shape) or "scalar"
            return f"shape {shown(tuple(t.shape))} where {want} is expected"
        if self.dtype is not None and t.dtype != self.dtype:
            return f"dtype {t.dtype} where {self.dtype} is expected"
        return None


@dataclass
class ReplySpec:
    """What one reply may hold: its kinds, exact tensors for some kinds, required metadata.

    `exact[kind]` names every tensor that kind must hold (no more, no fewer), each with its
    spec; kinds not in `exact` are checked by the vocabulary's rules only (dense CPU tensors of
    the kind's dtype, finite values; images of `image_shape`; labels and logits over
    `num_classes`). `required` kinds must be present. `labels[prefix]` is the label form
    ("hard": class indices, "soft": rows of class probabilities) of `<prefix>_labels`; hard when
    not given, except FedMix's `mean` labels. `bounds[key]` is the inclusive integer range of
    metadata `key` (the engine adds the client's announced training-set size).
    """

    kinds: frozenset[str]
    exact: dict[str, dict[str, TensorSpec]] = field(default_factory=dict)
    # kind -> the specs of tensors named '<class>/<key>' (e.g. per-class gradients "3/conv.w"):
    # the class an index in [0, num_classes), and each class's block holding every key.
    keyed: dict[str, dict[str, TensorSpec]] = field(default_factory=dict)
    required_meta: frozenset[str] = frozenset()
    num_classes: int | None = None
    image_shape: tuple[int, ...] | None = None
    required: frozenset[str] = frozenset()
    labels: dict[str, str] = field(default_factory=dict)
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Device types a tensor may live on besides the CPU (the run's device, in-process).
    devices: frozenset[str] = frozenset({"cpu"})
    # kind -> the most rows (first-axis entries, over all its tensors) an honest client sends.
    max_rows: dict[str, int] = field(default_factory=dict)
    # kind -> names of tensors whose rows are class probabilities (soft labels that travel
    # outside an images/labels pair, e.g. FedAF's class-wise soft labels).
    probabilities: dict[str, frozenset[str]] = field(default_factory=dict)
    # "kind/name" -> the most a tensor of per-class counts may sum to (MAX_COUNT until the engine
    # knows the client's announced size): counts weight what they come with, so they are
    # bounded by what the client can have counted, not by size (`fedvl.core.bounds`).
    counts: dict[str, int] = field(default_factory=dict)


class ReplyRejected(ValueError):
    """A reply failed its check; `field` names the offending part, `reason` says why;
    `nonfinite` marks NaN or Inf values (what a diverging client sends)."""

    def __init__(self, field: str, reason: str, nonfinite: bool = False) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason, self.nonfinite = field, reason, nonfinite


def shown(value: Any) -> str:
    """`repr(value)`, elided to a few dozen characters (rejection reasons stay one short line)."""
    try:
        text = repr(value)
    except Exception as e:   # a hostile object's __repr__ may raise
        text = f"<{type(value).__name__}: repr failed with {type(e).__name__}>"
    return text if len(text) <= SHOWN else f"{text[:SHOWN - 15]}...({len(text)} chars)"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# Metadata the server reads, the same way whatever the method: name -> (check, what is allowed).
_META_RULES = {
    "num_examples": (lambda v: _is_int(v) and 0 < v <= MAX_COUNT,
                     f"a positive int (at most {MAX_COUNT})"),
    "steps": (lambda v: _is_int(v) and 0 <= v <= MAX_COUNT,
              f"a non-negative int (at most {MAX_COUNT})"),
    "train_loss": (lambda v: _is_number(v) and math.isfinite(v), "a finite number"),
    # DP accounting the server copies into summary.json (epsilon may be inf: no guarantee).
    "epsilon": (lambda v: _is_number(v) and not math.isnan(v) and v >= 0,
                "a non-negative number"),
    "delta": (lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "dp_steps": (lambda v: _is_int(v) and 0 <= v <= MAX_COUNT, "a non-negative int"),
    # FedLAP-DP's trust-region radius (the server also caps it at its own).
    "radius": (lambda v: _is_number(v) and math.isfinite(v) and v >= 0,
               "a finite non-negative number"),
    "version": (lambda v: _is_int(v) and 0 <= v <= MAX_COUNT, "a non-negative int"),
    "has_global": (lambda v: isinstance(v, bool), "a bool"),
    "latent_constraint": (lambda v: isinstance(v, bool), "a bool"),
    "anchor_set": (lambda v: isinstance(v, list) and all(_is_int(c) for c in v),
                   "a list of client ids"),
    # The client's upload audit (fedvl.core.audit) and FedMix's refused groups.
    "upload_corr": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "upload_withheld": (lambda v: isinstance(v, bool), "a bool"),
    "upload_tensor": (lambda v: isinstance(v, str) and len(v) <= 200, "a 'kind/name' string"),
    "refused_groups": (lambda v: _is_int(v) and 0 <= v <= MAX_COUNT, "a non-negative int"),
    # Not here: a client's seconds (`update_seconds`, `synthesis_seconds`) are only shown, never
    # computed with; `fedvl.timing.reported` leaves out an implausible value instead of
    # rejecting the reply over it.
}


def check_reply(msg: Any, spec: ReplySpec) -> None:
    """Raise `ReplyRejected` for the first thing in `msg` that `spec` does not allow.

    `msg` may be anything a client handed over: what is not a well-formed `Message` of dense
    tensors is rejected before any of its values is read.
    """
    _check_structure(msg, spec)
    for kind in msg.arrays:
        if kind not in spec.kinds:
            raise ReplyRejected(kind, f"payload kind this method never sends here (allowed: "
                                      f"{', '.join(sorted(spec.kinds)) or 'none'})")
    for kind in sorted(spec.required - set(msg.arrays)):
        raise ReplyRejected(kind, "missing: this reply must carry it")
    for kind, want in spec.exact.items():
        got = msg.arrays.get(kind)
        if got is None:
            continue
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise ReplyRejected(kind, f"tensor names differ from the server's (missing "
                                      f"{shown(missing[:3])}, unexpected {shown(extra[:3])})")
        for name, ts in want.items():
            why = ts.mismatch(got[name])
            if why:
                raise ReplyRejected(f"{kind}/{name}", why)
    for kind, want in spec.keyed.items():
        blocks: dict[str, set[str]] = {}
        for name, t in msg.arrays.get(kind, {}).items():
            cls, _, key = name.partition("/")
            if key not in want:
                raise ReplyRejected(f"{kind}/{shown(name)}", "not one of the server's tensors")
            if not (cls.isdigit() and (spec.num_classes is None
                                       or int(cls) < spec.num_classes)):
                raise ReplyRejected(f"{kind}/{shown(name)}",
                                    f"{shown(cls)} is not a class index in "
                                    f"[0, {spec.num_classes})")
            blocks.setdefault(cls, set()).add(key)
            why = want[key].mismatch(t)
            if why:
                raise ReplyRejected(f"{kind}/{name}", why)
        for cls, keys in blocks.items():
            if keys != set(want):
                raise ReplyRejected(f"{kind}/{cls}", f"class {cls} lacks "
                                                     f"{shown(sorted(set(want) - keys)[:3])}")
    for kind, most in spec.max_rows.items():
        rows = sum(int(t.shape[0]) if t.dim() else 1 for t in msg.arrays.get(kind, {}).values())
        if rows > most:
            raise ReplyRejected(kind, f"{rows} rows where this method sends at most {most}")
    _check_dtypes(msg, spec)
    for kind, tensors in msg.arrays.items():
        for name, t in tensors.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ReplyRejected(f"{kind}/{name}", "holds NaN or Inf values", nonfinite=True)
    _check_vocabulary(msg, spec)
    _check_counts(msg, spec)
    _check_meta(msg, spec)


def _check_structure(msg: Any, spec: ReplySpec) -> None:
    """A `Message` of str-named dense tensors on an allowed device, scalar metadata."""
    if not isinstance(msg, Message):
        raise ReplyRejected("reply", f"a {type(msg).__name__}, not a fedvl Message")
    if not isinstance(msg.arrays, Mapping) or not isinstance(msg.meta, Mapping):
        raise ReplyRejected("reply", "arrays and meta must be dicts")
    try:
        # A client may build its reply without the constructor's check (or alter it after).
        validate(msg)
    except MessageError as e:
        raise ReplyRejected("reply", shown_text(str(e))) from None
    for kind, tensors in msg.arrays.items():
        for name, t in tensors.items():
            where = f"{kind}/{shown(name)}"
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                # Subclasses may override any operation the server runs on them.
                raise ReplyRejected(where, f"a {type(t).__name__}, not a plain torch.Tensor")
            if t.layout != torch.strided:
                raise ReplyRejected(where, f"layout {t.layout}: only dense tensors are accepted")
            if t.device.type not in spec.devices:
                raise ReplyRejected(where, f"on device '{t.device.type}' (allowed: "
                                           f"{', '.join(sorted(spec.devices))})")
            if t.is_quantized or t.is_complex():
                raise ReplyRejected(where, f"dtype {t.dtype} is not a real number type")


def shown_text(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters (messages may quote what a client sent)."""
    return text if len(text) <= limit else f"{text[:limit - 20]}...({len(text)} chars)"


def _check_dtypes(msg: Message, spec: ReplySpec) -> None:
    """Each tensor in its kind's dtype; labels in the form the method takes."""
    for kind, tensors in msg.arrays.items():
        if kind.endswith("_labels"):
            form = label_form(spec, kind.removesuffix("_labels"))
            want = (torch.int64,) if form == "hard" else (torch.float32,)
            what = ("class indices (int64)" if form == "hard"
                    else "soft labels (float32 rows of class probabilities)")
        else:
            want = KIND_DTYPES.get(kind, (torch.float32,))
            what = " or ".join(str(d) for d in want)
        for name, t in tensors.items():
            exact = spec.exact.get(kind, {}).get(name)
            if exact is not None and exact.dtype is not None:
                continue   # checked against what the server sent
            if t.dtype not in want:
                raise ReplyRejected(f"{kind}/{name}", f"dtype {t.dtype}: this method takes "
                                                      f"{what} here")


def label_form(spec: ReplySpec, prefix: str) -> str:
    """The label form ("hard" or "soft") `spec` takes for `<prefix>_labels`."""
    return spec.labels.get(prefix, "soft" if prefix == "mean" else "hard")


def _check_meta(msg: Message, spec: ReplySpec) -> None:
    """Required metadata present, known keys of the right type, integers within bounds."""
    for key in sorted(spec.required_meta):
        if key not in msg.meta:
            raise ReplyRejected(f"meta/{key}", "missing")
    for key, (ok, allowed) in _META_RULES.items():
        if key in msg.meta and not ok(msg.meta[key]):
            v = msg.meta[key]
            raise ReplyRejected(f"meta/{key}", f"{shown(v)} is not {allowed}",
                                nonfinite=isinstance(v, float) and not math.isfinite(v))
    for key, (lo, hi) in spec.bounds.items():
        v = msg.meta.get(key)
        if v is not None and not (_is_int(v) and lo <= v <= hi):
            raise ReplyRejected(f"meta/{key}", f"{shown(v)} is outside [{lo}, {hi}] for this "
                                               f"client")


def _check_counts(msg: Message, spec: ReplySpec) -> None:
    """Each count tensor non-negative, summing to at most what the client can have counted."""
    for where, most in sorted(spec.counts.items()):
        kind, _, name = where.partition("/")
        t = msg.arrays.get(kind, {}).get(name)
        if t is None or not t.numel():
            continue
        if float(t.min()) < 0:
            raise ReplyRejected(where, "holds a negative count")
        total = float(t.double().sum())
        if total > most:
            raise ReplyRejected(where, f"counts sum to {total:.6g}, more than the {most} this "
                                       f"client can have counted")


def _check_vocabulary(msg: Message, spec: ReplySpec) -> None:
    """The rules that follow from a payload kind's meaning, whatever the method."""
    # Distilled sets, the centralised raw upload and FedMix's averaged images.
    for prefix in ("synthetic", "raw", "mean"):
        _check_images_and_labels(msg, spec, prefix)
    for kind, names in spec.probabilities.items():
        for name in sorted(names):
            t = msg.arrays.get(kind, {}).get(name)
            if t is not None:
                _check_probability_rows(f"{kind}/{name}", t, spec.num_classes)
    # Class statistics (FedLGD's per-class means and stds) describe normalised images, so they
    # lie where pixels do; counts among them are checked as counts.
    for name, t in msg.arrays.get("statistics", {}).items():
        if (f"statistics/{name}" not in spec.counts and t.is_floating_point() and t.numel()
                and float(t.abs().max()) > MAX_IMAGE_ABS):
            raise ReplyRejected(f"statistics/{name}",
                                f"values up to {float(t.abs().max()):.3g}; statistics of "
                                f"normalised images stay within +-{MAX_IMAGE_ABS:g}")
    c = spec.num_classes
    for name, z in msg.arrays.get("logits", {}).items():
        if c is not None and (z.dim() == 0 or z.shape[-1] != c):
            raise ReplyRejected(f"logits/{name}",
                                f"shape {shown(tuple(z.shape))}: the last axis must be the {c} "
                                f"classes")


def _check_images_and_labels(msg: Message, spec: ReplySpec, prefix: str) -> None:
    """`<prefix>_images` are float images of the run's shape, `<prefix>_labels` one class (or
    one row of class probabilities) per image, with as many labels as images."""
    images = msg.arrays.get(f"{prefix}_images", {})
    labels = msg.arrays.get(f"{prefix}_labels", {})
    if bool(images) != bool(labels):
        have, lack = ("images", "labels") if images else ("labels", "images")
        raise ReplyRejected(f"{prefix}_{lack}", f"missing: the reply sends {prefix}_{have}")
    for name, x in images.items():
        if spec.image_shape is not None and (
                x.dim() != len(spec.image_shape) + 1
                or tuple(x.shape[1:]) != tuple(spec.image_shape)):
            raise ReplyRejected(f"{prefix}_images/{name}",
                                f"shape {shown(tuple(x.shape))} where N x {spec.image_shape} "
                                f"is expected")
        if x.numel() and float(x.abs().max()) > MAX_IMAGE_ABS:
            raise ReplyRejected(f"{prefix}_images/{name}",
                                f"values up to {float(x.abs().max()):.3g}; normalised images "
                                f"stay within +-{MAX_IMAGE_ABS:g}")
    c = spec.num_classes
    soft = label_form(spec, prefix) == "soft"
    for name, y in labels.items():
        where = f"{prefix}_labels/{name}"
        if soft:   # one row of class probabilities per image
            _check_probability_rows(where, y, c)
        elif y.dim() != 1:
            raise ReplyRejected(where, f"shape {shown(tuple(y.shape))}: one class index per "
                                       f"image is expected")
        elif c is not None and y.numel() and (int(y.min()) < 0 or int(y.max()) >= c):
            bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
            raise ReplyRejected(where, f"label {bad} is outside the classes [0, {c})")
    if images and labels:
        n_x = sum(int(x.shape[0]) for x in images.values())
        n_y = sum(int(y.shape[0]) for y in labels.values())
        if n_x != n_y:
            raise ReplyRejected(f"{prefix}_labels", f"{n_y} labels for {n_x} images")


def _check_probability_rows(where: str, y: torch.Tensor, c: int | None) -> None:
    """`y` is N x c soft labels: every entry in [0, 1], every row summing to 1."""
    if y.dim() != 2 or (c is not None and y.shape[1] != c):
        raise ReplyRejected(where, f"soft labels of shape {shown(tuple(y.shape))}, not N x {c}")
    if y.numel() and (float(y.min()) < 0 or float(y.max()) > 1
                      or float((y.sum(1) - 1).abs().max()) > 1e-3):
        raise ReplyRejected(where, "soft labels must be rows of probabilities (each in [0, 1], "
                                   "summing to 1)")

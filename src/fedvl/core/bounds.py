"""How far one reply may move the server: a per-round bound on the size of each client's update.

`check_reply` judges a reply on its own, and a reply whose weights are all finite can still be
huge (1e38 everywhere): the plain mean of it and the honest models is Inf, and the run stops.
What is too big is only known against the round: `bound_round` measures each reply's update
(its weights minus the round's global weights, its control variates, logits, prototypes,
statistics, gradients) as a root-mean-square, and refuses a reply whose size exceeds
`RELATIVE_BOUND` times the round's second-largest size over the replies that carry the same
tensors: the largest size the other clients reached. Whichever one client lies, that reference
lies within the honest replies' range (a liar above it is measured against the largest honest
reply, a liar below it cannot lower it below the second-largest honest one), and it follows the
clients that learn the most: under strong label skew most clients hold one class and barely
move while one or two move 1,000x more, and a median would refuse exactly those. With fewer
than three replies, or a reference of 0, one client cannot be outvoted and the absolute bound
`ABSOLUTE_BOUND` alone applies (it holds in every round). Counts (FedHe's, FedProto's,
FedVCK's per-class counts) are bounded by counting, in `check_reply`, not by size. Images and
labels are bounded by value and form there too.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from fedvl.core.message import Message
from fedvl.core.replies import ReplyRejected

# A reply's size may be at most this many times the round's second-largest. On honest runs
# (`benchmarks/faulty_clients.py --suite honest`: every method and composition on digits-offline,
# unequal client sizes, lr 0.1 x 5 local epochs, mixed architectures) the largest ratio to the
# round's median was 3.98 and the largest of one honest size over another 14.8 (ConvNet against
# AlexNet logits): more than an honest reply faces against the second-largest size. 100
# leaves a margin of 6.8x over that, and a reply of 1e38, 1e30-scaled or a 1e6-scaled update
# lies orders of magnitude beyond it. A larger multiple costs nothing against those; a smaller
# one would not stop a liar who stays within it either (with five clients, a sign-flipped
# update 5x an honest one already reverses the mean): that is `--aggregation median`'s job.
RELATIVE_BOUND = 100.0
# The largest root-mean-square a bounded update or upload may have, whatever the round. The
# largest measured on honest runs was 5.1 (FedDF's public logits at lr 0.1); 1e3 is where a
# normalised pixel may lie (`fedvl.core.replies.MAX_IMAGE_ABS`), and a few replies of it sum far
# below float32's 3.4e38.
ABSOLUTE_BOUND = 1e3
# With fewer replies carrying a tensor, one client cannot be outvoted (of two, either may be
# the liar): the absolute bound alone applies.
MIN_REPLIES = 3

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Measure:
    """How a payload kind is sized: as a change from the tensors of kind `against` in the
    server's message (its model updates), or as sent (None); over the whole kind, or each
    tensor on its own (`per_tensor`: a kind that holds different quantities side by side);
    against the round's second-largest size (`relative`), or by the absolute bound alone."""

    against: str | None = None
    per_tensor: bool = False
    relative: bool = True


# What the vocabulary's kinds mean, for the bound: weights are a change from the global
# weights the server sent (as sent where it sent none, e.g. DENSE's one-shot models); updates,
# control variates (SCAFFOLD's dc_k) and gradients are changes already; logits and prototypes
# hold class means, counts and widths side by side. Statistics describe each client's own data
# (FedLGD's class means and stds of normalised pixels differ up to 15x between honest domains,
# measured), not a step everyone takes: no relative bound applies to them; `check_reply` bounds
# their values as it bounds pixels. Images, labels, soft labels and generator states are bounded
# elsewhere or never sent up.
BOUNDED_KINDS: dict[str, Measure] = {
    "weights": Measure(against="weights"),
    "updates": Measure(),
    "control_variates": Measure(),
    "gradients": Measure(),
    "logits": Measure(per_tensor=True),
    "prototypes": Measure(per_tensor=True),
    "statistics": Measure(per_tensor=True, relative=False),
}


def root_mean_square(tensors: Iterable[torch.Tensor]) -> float:
    """sqrt(mean of the squared values) over all of `tensors`, in float64 (values near
    float32's largest square to Inf in float32); 0.0 for no values."""
    total: torch.Tensor | None = None
    n = 0
    for t in tensors:
        if t.device.type not in ("cpu", "cuda"):   # no float64 on some accelerators
            t = t.cpu()
        sq = torch.linalg.vector_norm(t, dtype=torch.float64) ** 2
        total = sq if total is None else total + sq.to(total.device)
        n += t.numel()
    return math.sqrt(float(total) / n) if total is not None and n else 0.0


def _change(t: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    """`t` minus the server's `ref` (in float64: the difference of two finite float32 values
    may not be one), or `t` itself."""
    if ref is None or ref.shape != t.shape:
        return t
    return t.double() - ref.to(device=t.device, dtype=torch.float64)


def sizes(msg: Message, sent: Message | None, measures: Mapping[str, Measure],
          skip: Iterable[str] = ()) -> dict[str, float]:
    """The sizes (root-mean-square) of a reply's bounded parts: group -> size.

    A group is a kind ("weights") or, for a `per_tensor` kind, one of its tensors
    ("logits/public"). Integer tensors (BatchNorm's step counter) and the "kind/name" tensors in
    `skip` (counts, bounded by counting) are left out.
    """
    skipped = set(skip)
    out: dict[str, float] = {}
    for kind in sorted(set(msg.arrays) & set(measures)):
        m = measures[kind]
        ref = {} if sent is None or m.against is None else sent.arrays.get(m.against, {})
        parts = {name: _change(t, ref.get(name)) for name, t in sorted(msg.arrays[kind].items())
                 if t.is_floating_point() and f"{kind}/{name}" not in skipped}
        if not parts:
            continue
        if m.per_tensor:
            out.update({f"{kind}/{name}": root_mean_square([t]) for name, t in parts.items()})
        else:
            out[kind] = root_mean_square(parts.values())
    return out


def _what(group: str, measures: Mapping[str, Measure], sent: Message | None) -> str:
    """What a group's size measures, for a refusal's reason."""
    kind = group.partition("/")[0]
    m = measures.get(kind)
    if m is not None and m.against is not None and sent is not None and m.against in sent.arrays:
        return f"its change from the server's {m.against}"
    return "its values"


def bound_round(replies: Mapping[K, Message], sent: Mapping[K, Message | None],
                measures: Mapping[str, Measure],
                skip: Mapping[K, Iterable[str]] | None = None,
                relative: float = RELATIVE_BOUND, absolute: float = ABSOLUTE_BOUND
                ) -> dict[K, ReplyRejected]:
    """The replies of one round that exceed the bound, each with why (the others pass).

    A reply is refused when the size of one of its groups is above `absolute`, or, with at least
    `MIN_REPLIES` replies carrying that group and a positive second-largest size, above
    `relative` times that second-largest size. A refusal beyond the absolute bound is marked
    `nonfinite`, as NaN is: no converging training sends it.
    """
    skip = skip or {}
    out: dict[K, ReplyRejected] = {}
    measured: dict[K, dict[str, float]] = {}
    for key, msg in replies.items():
        try:
            measured[key] = sizes(msg, sent.get(key), measures, skip.get(key, ()))
        except Exception as e:   # noqa: BLE001 - nothing a client sends may stop the server
            out[key] = ReplyRejected("reply", f"its size could not be measured "
                                              f"({type(e).__name__})")
    references: dict[str, tuple[float, int]] = {}
    for group in sorted({g for s in measured.values() for g in s}):
        values = [s[group] for s in measured.values() if group in s]
        m = measures.get(group.partition("/")[0])
        if len(values) >= MIN_REPLIES and (m is None or m.relative):
            # The second-largest: one liar can neither raise it nor push it below an honest
            # reply's, and the client that learns the most is measured against the next one.
            references[group] = (sorted(values)[-2], len(values))
    for key, groups in measured.items():
        for group, size in groups.items():
            what = _what(group, measures, sent.get(key))
            if not size <= absolute:   # also catches NaN
                out[key] = ReplyRejected(group, f"root-mean-square of {what} is {size:.3g}, "
                                                f"beyond the absolute bound {absolute:g}",
                                         nonfinite=True)
                break
            ref, n = references.get(group, (0.0, 0))
            if ref > 0 and size > relative * ref:
                out[key] = ReplyRejected(group, f"root-mean-square of {what} is {size:.3g}, "
                                                f"{size / ref:.3g}x the next largest {ref:.3g} "
                                                f"of the round's {n} replies (at most "
                                                f"{relative:g}x)")
                break
    return out

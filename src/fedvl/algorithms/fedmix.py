"""FedMix (Yoon, Shin, Hwang & Yang, "FedMix: Approximation of Mixup under Mean Augmented
Federated Learning", ICLR 2021): FedAvg whose clients train on a first-order approximation of
global Mixup, using only averages of other clients' data.

Mean-augmented FL (the paper's MAFL): client k splits its local data into groups of M_k
(`mean_batch`) samples and averages each group, images and one-hot labels alike:
    x̄ = mean of M_k images,  ȳ = mean of their one-hot labels.
The server collects these means once per client and hands the pool of every client's means to
each client (X_g, Y_g). Round t:
  server -> clients: w_t; the means of the pool the client does not hold yet (`mean_images`,
                     `mean_labels`); a request for the client's own means until it has sent them.
  client k: SGD from w_t where each step on a batch (x_i, y_i), i = 1..B, draws for each i a
            mean (x̄_j, ȳ_j) from the pool (its own means included) and minimises, with
            u_i = (1 - λ) x_i and ℓ(u, y) = CE(f(u), y),
              mean_i [ (1 - λ) ℓ(u_i, y_i) + λ ℓ(u_i, ȳ_j)
                       + λ <∂[(1 - λ) ℓ(u, y_i)]/∂u at u_i, x̄_j> ]
            Uploads w_k, n_k, and its means the first time it is asked.
  server: w_{t+1} = sum_k p_k w_k (FedAvg); the uploaded means join the pool.

The three terms are the Taylor expansion of the global-Mixup loss
ℓ(f((1-λ)x_i + λx_j), (1-λ)y_i + λy_j) around u_i, to first order in λ x_j, without the
O(λ²) term λ² <∂ℓ(u, y_j)/∂u, x_j>; averaging over the x_j of one group turns x_j, y_j into
the group's x̄_j, ȳ_j. The factor (1 - λ) inside the derivative is that expansion's exact
first-order coefficient and what the reference code differentiates (its first loss term). The
input gradient is taken with `create_graph`, so the third term's gradient reaches the weights
(a Hessian-vector product), as in the reference code. At λ = 0 the
loss is CE(f(x), y) and the step is FedAvg's, run as such. The model is evaluated on unscaled
inputs x.

Deviations and choices: the paper exchanges the means once before training; here a client's
means travel with its first reply and reach the others from the next round on, so round 0
trains with each client's own means only (with partial participation the pool grows as new
clients are sampled). Groups are formed from a shuffle of the local data (a generator derived
from the client's, so FedAvg's batch order is untouched); a last group of fewer than M_k
samples is dropped, as in the Flower reference (adap/flower baselines/fedmix), whose defaults
these are: λ = 0.2 (its FEMNIST setting; CIFAR-10 0.05, CIFAR-100 0.1) and M_k = all local
samples (`mean_batch=0`). The reference draws one mean per batch and averages the third term
over a batch-mean gradient (an extra 1/B); here each sample draws its own mean and the input
gradient is per sample (exact for models without batch statistics; with BatchNorm it is the
gradient of the batch's summed loss). mean_batch = 1 would upload every private image itself
and is refused. Exact duplicate images in a group count once (real sets hold duplicates), and a
group of fewer than 2 distinct images sends no mean (counted in `fedmix_refused_groups`). A mean
can still be a scaled copy of one image (a group of one image and blank ones): the client's
upload guard (`--upload-guard`, docs/reliability.md) withholds such means.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedvl.algorithms.base import ClientContext, ServerContext, ServerState
from fedvl.algorithms.fedavg import FedAvg
from fedvl.algorithms.vhl import derived_generator
from fedvl.core.message import Message
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.core.training import TrainStats, local_train
from fedvl.models.base import FedModel
from fedvl.options import Choice, option
from fedvl.registry import register_algorithm

log = logging.getLogger("fedvl")

MEAN_IMAGES, MEAN_LABELS = "mean_images", "mean_labels"
# Meta key of the server's request for a client's means (sent until they have arrived).
SEND_MEANS = "send_means"
# Meta key of the groups a client refused to average (fewer than 2 distinct images).
REFUSED = "refused_groups"
# Purposes of generators derived from the client's round generator: the grouping of its data
# into means, and the per-sample draws of means during local training.
GROUPING_STREAM = 211
DRAW_STREAM = 212


def num_groups(n: int, mean_batch: int) -> int:
    """Groups `group_means` forms from `n` samples, before refusing any."""
    size = n if mean_batch == 0 else mean_batch
    return n // size if size >= 2 else 0


def distinct_members(x: torch.Tensor) -> torch.Tensor:
    """groups x size mask of each group's first copy of every image in it (x: groups x size x
    image): exact duplicates within a group count once."""
    g, size = x.shape[:2]
    _, ids = torch.unique(x.reshape(g * size, -1), dim=0, return_inverse=True)
    ranked, where = ids.reshape(g, size).sort(dim=1, stable=True)
    first = torch.ones_like(ranked, dtype=torch.bool)
    first[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
    return torch.zeros_like(first).scatter(1, where, first)


def group_means(x: torch.Tensor, y: torch.Tensor, num_classes: int, mean_batch: int,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Averages of consecutive groups of `mean_batch` samples (0: one group of all samples),
    after a shuffle drawn from `generator` if given: images (n x C x H x W) and one-hot labels
    averaged (n x num_classes). A last group smaller than `mean_batch` is dropped. Exact
    duplicate images in a group count once (with the first copy's label), and a group of fewer
    than 2 distinct images is refused: the "mean" of one image is that private image."""
    n = len(y)
    size = n if mean_batch == 0 else mean_batch
    groups = num_groups(n, mean_batch)
    if groups == 0:
        return x.new_zeros((0, *x.shape[1:])), x.new_zeros((0, num_classes))
    order = (torch.randperm(n, generator=generator,
                            device=generator.device).to(y.device) if generator is not None
             else torch.arange(n, device=y.device))
    keep = order[: groups * size]
    xs = x[keep].reshape(groups, size, *x.shape[1:])
    ys = F.one_hot(y[keep], num_classes).to(x.dtype).reshape(groups, size, num_classes)
    means_x, means_y = xs.mean(1), ys.mean(1)
    first = distinct_members(xs)
    count = first.sum(1)
    dup = count < size
    if bool(dup.any()):
        # Only groups holding a duplicate change: the others keep their plain mean's bits.
        w = first[dup].to(x.dtype)
        c = count[dup].clamp_min(1).to(x.dtype)
        means_x[dup] = (xs[dup] * w.reshape(*w.shape, *[1] * (x.dim() - 1))).sum(1) \
            / c.reshape(-1, *[1] * (x.dim() - 1))
        means_y[dup] = (ys[dup] * w[..., None]).sum(1) / c[:, None]
    ok = count >= 2
    return means_x[ok], means_y[ok]


def fedmix_loss(logits: torch.Tensor, u: torch.Tensor, y: torch.Tensor, xbar: torch.Tensor,
                ybar: torch.Tensor, lam: float) -> torch.Tensor:
    """The FedMix loss of a batch: `logits` = f(u) for the scaled inputs u = (1 - lam) x
    (u must require grad), labels y, and one drawn mean (xbar, ybar) per sample."""
    return F.cross_entropy(logits, y) + fedmix_correction(logits, u, y, xbar, ybar, lam)


def fedmix_correction(logits: torch.Tensor, u: torch.Tensor, y: torch.Tensor,
                      xbar: torch.Tensor, ybar: torch.Tensor, lam: float) -> torch.Tensor:
    """What FedMix adds to CE(f(u), y): -lam CE(f(u), y) + lam CE(f(u), ybar)
    + lam <d[(1 - lam) CE(f(u), y)]/du, xbar>, each averaged over the batch."""
    ce = F.cross_entropy(logits, y, reduction="none")
    # Summed, not averaged: the input gradient of sample i is then d l_i / d u_i itself.
    grad = torch.autograd.grad(((1 - lam) * ce).sum(), u, create_graph=True)[0]
    inner = (grad.flatten(1) * xbar.flatten(1)).sum(1)
    soft = F.cross_entropy(logits, ybar, reduction="none")
    return lam * (soft - ce + inner).mean()


class FedMixTerm:
    """FedMix's loss term for `local_train`, whose CE is computed on the scaled batch u: each
    sample draws one mean of the pool and the term adds the rest of the FedMix loss."""

    def __init__(self, lam: float, pool_x: torch.Tensor, pool_y: torch.Tensor,
                 rng: torch.Generator) -> None:
        self.lam, self.pool_x, self.pool_y, self.rng = lam, pool_x, pool_y, rng

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        # Drawn on the CPU (the run's generator, or torch's global one without it).
        j = torch.randint(len(self.pool_y), (len(y),), generator=self.rng,
                          device="cpu").to(y.device)
        return fedmix_correction(logits, x, y, self.pool_x[j], self.pool_y[j], self.lam)


def scaled_input(lam: float) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """The batch transform u = (1 - lam) x, marked for an input gradient."""
    def scale(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return ((1 - lam) * x).requires_grad_(True)
    return scale


def _mean_batch_ok(value: int) -> bool:
    return value == 0 or value >= 2


@register_algorithm("fedmix")
class FedMix(FedAvg):
    """FedAvg with FedMix's approximate global Mixup against the pool of clients' data means."""

    payload_kinds = {"down": frozenset({MEAN_IMAGES, MEAN_LABELS}),
                     "up": frozenset({MEAN_IMAGES, MEAN_LABELS})}
    # Its local step scales the inputs: add-ons written for FedAvg's step would see u, not x.
    accepts_addons = False

    @dataclass
    class Params:
        lam: float = option(0.2, "mixing weight λ of the approximated global Mixup (paper: "
                            "0.2 FEMNIST, 0.05 CIFAR-10, 0.1 CIFAR-100)", ge=0, lt=1,
                            tune=Choice(0.05, 0.1, 0.2))
        mean_batch: int = option(
            0, "samples averaged into one uploaded mean, the paper's M_k (0: all local samples)",
            check=_mean_batch_ok,
            allowed="allowed: 0 (one mean over all local samples) or an integer >= 2 (1 would "
                    "upload each private image itself)")

    # -- server ----------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        # means: cid -> (images, labels) uploaded; asked: clients whose reply to the request
        # arrived (with or without means); held: cid -> the pool members it has received.
        # refused: cid -> groups the client refused to average (fewer than 2 distinct images).
        return {**super().server_init(), "means": {}, "asked": [], "held": {}, "refused": {}}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        out = {}
        for c in clients:
            arrays: dict[str, Any] = {"weights": state["model"]}
            held = set(state["held"].get(c, []))
            new = [j for j in sorted(state["means"]) if j != c and j not in held]
            if new:
                arrays[MEAN_IMAGES] = {str(j): state["means"][j][0] for j in new}
                arrays[MEAN_LABELS] = {str(j): state["means"][j][1] for j in new}
            meta = {SEND_MEANS: True} if c not in state["asked"] else {}
            out[c] = Message(arrays, meta)
        return out

    def row_bounds(self, cid: int, announced: int) -> dict[str, int]:
        """At most one mean per group of `mean_batch` of the client's samples."""
        return {MEAN_IMAGES: num_groups(announced, self.p.mean_batch)}

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        if not sent.meta.get(SEND_MEANS):
            spec.kinds = spec.kinds - {MEAN_IMAGES, MEAN_LABELS}
            return spec
        spec.exact[MEAN_IMAGES] = {"x": TensorSpec((None, *self.env.image_shape))}
        spec.exact[MEAN_LABELS] = {"y": TensorSpec((None, self.env.num_classes))}
        return spec

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        new = super().aggregate(state, ctx, replies)
        means, asked = dict(state["means"]), set(state["asked"])
        refused = dict(state.get("refused", {}))
        held = {c: list(v) for c, v in state["held"].items()}
        for c, r in replies.items():
            # What configure sent it this round (the pool before this round's uploads).
            held[c] = sorted(set(held.get(c, [])) | (set(state["means"]) - {c}))
            if c not in asked:
                asked.add(c)
                n = r.meta.get(REFUSED, 0)
                if isinstance(n, int) and not isinstance(n, bool) and 0 < n < 2**31:
                    refused[c] = n
                if MEAN_IMAGES in r.arrays:
                    means[c] = (r.get(MEAN_IMAGES)["x"].detach().cpu(),
                                r.get(MEAN_LABELS)["y"].detach().cpu())
        return {**new, "means": means, "asked": sorted(asked), "held": held, "refused": refused}

    def report(self, state: ServerState) -> dict[str, Any]:
        out: dict[str, Any] = {
            "fedmix_pool_means": sum(int(x.shape[0]) for x, _ in state["means"].values())}
        refused = state.get("refused", {})
        if refused:
            out["fedmix_refused_groups"] = {self.env.client_name(c): n
                                            for c, n in sorted(refused.items())}
        return out

    # -- client ----------------------------------------------------------------------------------
    def own_means(self, client: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's means, computed once (grouping from a generator derived from its own)
        and kept in its state with the pool under its id."""
        key = str(client.cid)
        have = client.state.arrays.get(MEAN_IMAGES, {})
        if key in have:
            return have[key], client.state.arrays[MEAN_LABELS][key]
        if client.state.meta.get("own_means") == 0:   # too few samples for one group
            return group_means(client.x[:0], client.y[:0], self.env.num_classes, 2)
        x, y = group_means(client.x, client.y, self.env.num_classes, self.p.mean_batch,
                           derived_generator(client, GROUPING_STREAM))
        client.state.meta["own_means"] = len(y)
        refused = max(0, num_groups(len(client.y), self.p.mean_batch) - len(y))
        client.state.meta[REFUSED] = refused
        if refused:
            log.warning("client %s: %d FedMix group(s) of fewer than 2 distinct images: no mean "
                        "sent for them", client.name, refused)
        if len(y):
            self._store(client, {key: x}, {key: y})
        return x, y

    def _store(self, client: ClientContext, images: dict[str, torch.Tensor],
               labels: dict[str, torch.Tensor]) -> None:
        for kind, new in ((MEAN_IMAGES, images), (MEAN_LABELS, labels)):
            client.state.arrays[kind] = {**client.state.arrays.get(kind, {}),
                                         **{k: v.detach().cpu() for k, v in new.items()}}

    def pool(self, msg: Message, client: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        """X_g, Y_g as the client holds them: its own means and every received client's, in
        client order (whatever order they arrived in)."""
        self.own_means(client)
        if MEAN_IMAGES in msg.arrays:
            self._store(client, msg.get(MEAN_IMAGES), msg.get(MEAN_LABELS))
        images = client.state.arrays.get(MEAN_IMAGES, {})
        labels = client.state.arrays.get(MEAN_LABELS, {})
        keys = sorted(images, key=int)
        if not keys:
            return group_means(client.x[:0], client.y[:0], self.env.num_classes, 2)
        return (torch.cat([images[k] for k in keys]).to(client.device),
                torch.cat([labels[k] for k in keys]).to(client.device))

    def train(self, model: FedModel, msg: Message, client: ClientContext) -> TrainStats:
        pool_x, pool_y = self.pool(msg, client)
        # No mean to mix with yet, or λ = 0 (every term but CE(f(x), y) vanishes): FedAvg's
        # step, without the zero-weighted double backward that would only reorder sums.
        if len(pool_y) == 0 or self.p.lam == 0:
            return super().train(model, msg, client)
        term = FedMixTerm(self.p.lam, pool_x.to(client.x.dtype), pool_y.to(client.x.dtype),
                          derived_generator(client, DRAW_STREAM))
        return local_train(model, client.x, client.y, self.client_train(client),
                           client.generator, terms=(term,),
                           augment=scaled_input(self.p.lam))

    def reply(self, model: FedModel, stats: TrainStats, msg: Message,
              client: ClientContext) -> Message:
        out = super().reply(model, stats, msg, client)
        if msg.meta.get(SEND_MEANS):
            x, y = self.own_means(client)
            if len(y):
                out.arrays[MEAN_IMAGES] = {"x": x.clone()}
                out.arrays[MEAN_LABELS] = {"y": y.clone()}
            out.meta[REFUSED] = int(client.state.meta.get(REFUSED, 0))  # type: ignore[arg-type]
        return out

"""DESA (Huang et al. 2024): decentralised learning with synthetic anchors; no server model.

Every client keeps its own model (any architecture: `--client-models`). Peer to peer:
  once:        each client distils *anchors*, `ipc` images per class it owns, by distribution
               matching from N(0,1) noise with a freshly initialised network at every step
               (the run's `--model`, ConvNet by default, whatever the client's own model), and
               sends them to each peer the first time it addresses it. A client's global anchors
               are the per-class element-wise mean of its own and every anchor set it received.
  each round:  each sampled client sends its peers the logits of its current model (eval mode)
               on its global anchors, then trains one local pass over real ∪ anchors with
                 CE + lambda_reg * SupCon([z_batch; embed(anchor batch).detach()])
                    + lambda_kd * KD(f(a), t)
               where t is the mean of the peers' logits for the anchor batch a (only logits
               computed on the same anchor set count; there is no KD term before any arrive).
               KD is, by `kd_form`, the paper's Eq. 6 (`paper`, the default)
                 mean over a of KL(softmax(t) || softmax(f(a)))      (T = 1, no CE)
               or the public code's (`code`)
                 (1 - kd_weight) CE(f(a), y_a)
                   + kd_weight T^2 KL(softmax(t / T) || softmax(f(a) / T))  (T = 20)
               with that KL averaged over batch x classes (`kd_reduction=mean`).
The server only relays peer messages: it holds no model and aggregates nothing. Optional DP
anchors (`dp_noise` > 0): per-sample clipped, noised DM gradients, epsilon from the accountant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fedvl.algorithms.base import (
    NEIGHBOURHOODS,
    Algorithm,
    ClientContext,
    ServerContext,
    ServerState,
    neighbourhood,
    real_data,
)
from fedvl.core.contrastive import supcon_loss
from fedvl.core.dp import EPSILON_DELTA, delta_for, merge_privacy, privacy_report
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.core.training import local_train
from fedvl.devices import module_to
from fedvl.distill.client_sets import (
    MIN_CLASS_COUNT,
    VirtualSetSpec,
    client_virtual_set,
    owned_ipc,
)
from fedvl.distill.dp_matching import DPDistributionMatching, check_dp_setup
from fedvl.distill.losses import distillation_kl
from fedvl.distill.samplers import RandomModelSampler
from fedvl.distill.synthesize import synthesize
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm
from fedvl.seeding import derive_seed, generator

# Random streams: the DP anchors' generator and the fixed order of the KD anchor batches.
DP_ANCHOR_STREAM = 83
KD_ORDER_STREAM = 89
# How a client's state Message names the anchor sets it holds: its own, and peer k's.
OWN = "local"
PEER = "peer"
SENT_TO = "anchors_sent_to"

Pair = tuple[torch.Tensor, torch.Tensor]


def mean_anchors(sets: list[tuple[torch.Tensor, torch.Tensor]], num_classes: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class, the element-wise mean of the sets holding that class (slot i with slot i).

    With every class at every client this is the reference's plain mean over clients; a class
    only some clients own is averaged over those (sets with a different count of it are left
    out, so slots always pair up).
    """
    xs, ys = [], []
    for c in range(num_classes):
        parts = [x[y == c] for x, y in sets if bool((y == c).any())]
        if not parts:
            continue
        n = max(len(p) for p in parts)
        parts = [p for p in parts if len(p) == n]
        xs.append(torch.stack(parts).mean(0))
        ys.append(torch.full((n,), c, dtype=torch.long, device=parts[0].device))
    if not xs:
        raise ValueError("no anchor set holds any class")
    return torch.cat(xs), torch.cat(ys)


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, temperature: float,
            kd_weight: float, reduction: str) -> torch.Tensor:
    """(1 - w) CE(student, y) + w T^2 KL(softmax(teacher/T) || softmax(student/T)).

    `reduction='mean'` averages the KL over batch x classes (torch's KLDivLoss default, as the
    reference); 'batchmean' is the mathematical KL per sample.
    """
    kl = distillation_kl(student, teacher, temperature, reduction)
    return (1 - kd_weight) * F.cross_entropy(student, y) + kd_weight * temperature ** 2 * kl


# The KD term's form: `paper` (Eq. 6) or `code` (the public code's Hinton-style mix).
KD_FORMS = ("paper", "code")


def paper_kd_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Eq. 6: KL(softmax(teacher) || softmax(student)) per anchor, averaged over the batch."""
    # Eq. 6 has no temperature (T = 1); the target-first direction is Eq. 21's L_KL(y || M(x));
    # the per-sample KL sums over classes, the expectation over x^Syn is the batch mean. No CE:
    # the anchors' CE is Eq. 7's first term, which training on real ∪ anchors already gives.
    return distillation_kl(student, teacher, 1.0, "batchmean")


def anchor_kd(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, p: Any
              ) -> torch.Tensor:
    """The KD term (before lambda_kd) in the form `p.kd_form` names."""
    if p.kd_form == "paper":
        return paper_kd_loss(student, teacher)
    if p.kd_form == "code":
        return kd_loss(student, teacher, y, p.temperature, p.kd_weight, p.kd_reduction)
    raise ValueError(f"unknown kd_form '{p.kd_form}'; allowed: {', '.join(KD_FORMS)}")


class AnchorTerms:
    """DESA's two extra terms at each local step: SupCon toward anchors and KD on anchors."""

    def __init__(self, xa: torch.Tensor, ya: torch.Tensor, teacher: torch.Tensor | None,
                 p: Any, batch: int, order: torch.Tensor, gen: torch.Generator) -> None:
        self.xa, self.ya, self.teacher, self.p, self.batch = xa, ya, teacher, p, batch
        self.order, self.gen = order, gen
        self.kd_pos = 0
        self.reg_perm = torch.empty(0, dtype=torch.long, device="cpu")
        self.reg_pos = 0

    def _next_kd(self) -> torch.Tensor:
        # A fixed anchor order cycled batch by batch, as the reference's unshuffled KD loader.
        if self.kd_pos >= len(self.order):
            self.kd_pos = 0
        idx = self.order[self.kd_pos : self.kd_pos + self.batch]
        self.kd_pos += self.batch
        return idx

    def _next_reg(self) -> torch.Tensor:
        # A reshuffled pass over the anchors, as the reference's shuffled REG loader.
        if self.reg_pos >= len(self.reg_perm):
            self.reg_perm = torch.randperm(len(self.ya), generator=self.gen, device=self.gen.device)
            self.reg_pos = 0
        idx = self.reg_perm[self.reg_pos : self.reg_pos + self.batch]
        self.reg_pos += self.batch
        return idx

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        p = self.p
        loss = z.new_zeros(())
        if self.teacher is not None and p.lambda_kd > 0:
            idx = self._next_kd().to(self.xa.device)
            out = model(self.xa[idx])
            loss = loss + p.lambda_kd * anchor_kd(out, self.teacher[idx], self.ya[idx], p)
        if p.lambda_reg > 0:
            idx = self._next_reg().to(self.xa.device)
            with torch.no_grad():
                za = model.embed(self.xa[idx])
            loss = loss + p.lambda_reg * supcon_loss(
                torch.cat([z, za]), torch.cat([y, self.ya[idx]]),
                temperature=p.supcon_temperature, normalize=p.reg_similarity == "cosine")
        return loss


class GlobalAnchors(NamedTuple):
    """The mean of the anchor sets a client holds, and whose sets they are (sorted ids)."""

    x: torch.Tensor
    y: torch.Tensor
    ids: list[int]


@dataclass
class PeerState:
    """A DESA client's persistent state: the anchor sets it holds and who has its own.

    In the client's state Message (what checkpoints and Flower nodes keep) the sets are
    (images, labels) pairs under `synthetic_images` / `synthetic_labels`, its own named "local"
    and peer k's "peer<k>"; the peers it sent its anchors to are the meta `anchors_sent_to`,
    and DP anchors' privacy the meta `epsilon` and `delta`. `load` and `save` convert.
    """

    cid: int
    # Anchor sets by the client that distilled them; this client's own under `cid`.
    anchors: dict[int, Pair] = field(default_factory=dict)
    sent_to: set[int] = field(default_factory=set)
    # (epsilon, delta) spent on DP anchors; None without DP.
    privacy: tuple[float, float] | None = None

    @classmethod
    def load(cls, state: Message, cid: int) -> PeerState:
        """Client `cid`'s state as kept in `state`."""
        imgs = state.arrays.get("synthetic_images", {})
        labs = state.arrays.get("synthetic_labels", {})
        anchors = {cid if n == OWN else int(n.removeprefix(PEER)): (imgs[n], labs[n])
                   for n in imgs}
        sent = state.meta.get(SENT_TO, [])
        eps, delta = state.meta.get("epsilon"), state.meta.get("delta")
        privacy = ((float(eps), float(delta)) if isinstance(eps, int | float)
                   and isinstance(delta, int | float) else None)
        return cls(cid, anchors, {int(c) for c in sent} if isinstance(sent, list) else set(),
                   privacy)

    def save(self, state: Message) -> None:
        """Write this state into `state` (parts still empty stay absent)."""
        if self.anchors:
            names = {c: OWN if c == self.cid else f"{PEER}{c}" for c in sorted(self.anchors)}
            state.arrays["synthetic_images"] = {names[c]: self.anchors[c][0] for c in names}
            state.arrays["synthetic_labels"] = {names[c]: self.anchors[c][1] for c in names}
        if self.sent_to:
            state.meta[SENT_TO] = sorted(self.sent_to)
        if self.privacy is not None:
            state.meta.update(epsilon=self.privacy[0], delta=self.privacy[1])

    @property
    def own(self) -> Pair | None:
        """This client's own anchors, once distilled."""
        return self.anchors.get(self.cid)

    def receive(self, inbox: dict[int, Message], device: torch.device) -> None:
        """Keep the anchor sets that peers sent (each sends its own once)."""
        for sender, m in sorted(inbox.items()):
            if "synthetic_images" in m.arrays:
                self.anchors[sender] = (m.arrays["synthetic_images"]["anchors"].to(device),
                                        m.arrays["synthetic_labels"]["anchors"].to(device))

    def global_anchors(self, num_classes: int) -> GlobalAnchors | None:
        """The mean of every anchor set held (None before its own are distilled), summed in
        client-id order so that every client holding the same sets gets the same bits."""
        if self.own is None:
            return None
        ids = sorted(self.anchors)
        x, y = mean_anchors([self.anchors[c] for c in ids], num_classes)
        return GlobalAnchors(x, y, ids)


@register_algorithm("desa")
class DESA(Algorithm):
    """Serverless: synthetic anchors once, anchor logits every round, per-client models."""

    personalized = True
    topology = "peer"
    smoke_args = {"anchor_steps": 20}
    # The public code's DIGITS run (ubc-tea/DESA: --ipc 50, --inv_iters 1000, 256 real images
    # per class, --kd_iters 100 rounds).
    paper_args = {"ipc": 50, "anchor_steps": 1000, "batch_real": 256}
    paper_run = {"rounds": 100}
    mixed_models = True
    # Each client's anchors travel to its peers.
    shared_synthetic = "anchors_{client}"
    payload_kinds = {"peer": frozenset({"synthetic_images", "synthetic_labels", "logits"})}

    @dataclass
    class Params:
        # Defaults sized for a 2-core CPU; reference values in the comments.
        ipc: int = option(10, "anchor images per owned class (reference 50 on DIGITS; 0: no "
                          "anchors, hence no REG/KD)", ge=0)
        anchor_steps: int = option(100, "DM steps distilling the anchors (reference 1000)", ge=0)
        batch_real: int = option(64, "real images per class per DM step (reference 256)", ge=1)
        dsa: bool = option(True, "siamese DSA in anchor distillation (reference on; off with DP)")
        min_class_count: int = option(MIN_CLASS_COUNT, "a client distils only classes with at "
                                      "least this many images", ge=1)
        lambda_kd: float = option(1.0, "weight of the KD term (reference 1)", ge=0)
        lambda_reg: float = option(1.0, "weight of the SupCon term (reference 1)", ge=0)
        kd_form: str = option("paper", "KD term: paper (Eq. 6: per-anchor KL(softmax(t) || "
                              "softmax(f(a))) at T = 1, batch mean, no CE) or code (the public "
                              "code: (1 - kd_weight) CE + kd_weight T^2 KL at `temperature`, "
                              "`kd_reduction`)", choices=KD_FORMS)
        temperature: float = option(20.0, "KD temperature, kd_form=code only (reference 20; "
                                    "Eq. 6 has none)", gt=0)
        kd_weight: float = option(0.9, "KL share of the KD term, kd_form=code only; the rest is "
                                  "CE on the anchors (reference 0.9)", ge=0, le=1)
        kd_reduction: str = option("mean", "KL reduction, kd_form=code only: mean over batch x "
                                   "classes (reference, torch's KLDivLoss default) or batchmean "
                                   "(per sample)", choices=("mean", "batchmean"))
        supcon_temperature: float = option(0.07, "SupCon temperature (reference 0.07)", gt=0)
        reg_similarity: str = option("cosine", "SupCon similarity: cosine of L2-normalised "
                                     "features (reference) or dot (Eq. 5 as printed: raw "
                                     "feature products)", choices=("cosine", "dot"))
        neighbourhood: str = option("full", "peers a client sends to: every other sampled client "
                                    "(reference), a ring, or k random ones",
                                    choices=NEIGHBOURHOODS)
        k: int = option(2, "peers per client with neighbourhood=random", ge=1)
        dp_noise: float = option(0.0, "DP noise multiplier of the anchor distillation; 0: off "
                                 "(reference DP runs 0.6)", ge=0)
        dp_clip: float = option(2.0, "DP per-sample clipping norm (reference 2)", gt=0)
        dp_delta: float = option(0.0, "DP delta; 0: 1/(10 n) for n real images (the reference "
                                 "prints 1/n)", ge=0, lt=1)

    def __init__(self, env: Any, params: Any | None = None) -> None:
        super().__init__(env, params)
        if self.p.dp_noise > 0:
            # The anchors start from noise; a BatchNorm extractor would break per-sample clipping.
            check_dp_setup("noise", env.model_fn())

    # -- the server only relays ---------------------------------------------------------------
    def server_init(self) -> ServerState:
        return {k: {} for k in EPSILON_DELTA}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        return {c: Message() for c in clients}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        # The anchors are one release: epsilon and delta, and no running total of steps.
        return merge_privacy(state, replies, self.env.client_name, EPSILON_DELTA)

    def report(self, state: ServerState) -> dict[str, Any]:
        out: dict[str, Any] = {"traffic": "peer-to-peer: anchors once, anchor logits every "
                               "round; the server relays and holds no model"}
        if self.p.dp_noise > 0:
            out["privacy"] = privacy_report("DP anchor distillation", self.p.dp_noise,
                                            self.p.dp_clip, state, EPSILON_DELTA)
        return out

    def neighbours(self, cid: int, sampled: list[int], ctx: ServerContext) -> list[int]:
        # The first round is the anchor exchange, among every sampled client, so that all of
        # them average the same anchor sets; anchor logits then follow the neighbourhood.
        kind = "full" if ctx.round == 0 else self.p.neighbourhood
        return neighbourhood(kind, cid, sampled, self.p.k, ctx.seed, ctx.round)

    # -- client --------------------------------------------------------------------------------

    def _random_model(self, seed: int) -> FedModel:
        return self.env.model_fn(seed=seed)

    def _distil_anchors(self, client: ClientContext, state: PeerState) -> Pair:
        """Distil this client's anchors (once) into its `state`."""
        p = self.p
        x, y = real_data(client)
        if p.dp_noise > 0:
            syn, eps, delta = self._dp_anchors(x, y, client)
            state.privacy = (eps, delta)
        else:
            spec = VirtualSetSpec(ipc=p.ipc, steps=p.anchor_steps, init="noise",
                                  batch_real=p.batch_real, lr_img=1.0, dsa=p.dsa,
                                  min_count=p.min_class_count)
            syn = client_virtual_set(x, y, client.num_classes, self._random_model, spec,
                                     self.env.seed, client.cid)
        own = (syn.images.detach().to(client.device), syn.labels.to(client.device))
        state.anchors[client.cid] = own
        return own

    def _dp_anchors(self, x: torch.Tensor, y: torch.Tensor, client: ClientContext
                    ) -> tuple[SyntheticSet, float, float]:
        p, k = self.p, client.num_classes
        g = generator(derive_seed(self.env.seed, DP_ANCHOR_STREAM), client.cid, 0)
        per_class = owned_ipc(y, k, p.ipc, p.min_class_count)
        syn = SyntheticSet.noise(per_class, k, tuple(x.shape[1:]), g)
        syn = syn.to(x.device)
        device = x.device
        objective = DPDistributionMatching(
            x, y, RandomModelSampler(lambda s: module_to(self._random_model(s), device)), k,
            batch_per_class=p.batch_real, clip=p.dp_clip, noise_multiplier=p.dp_noise,
            delta=delta_for(p.dp_delta, len(y)))
        synthesize(syn, objective, p.anchor_steps, g, lr_img=1.0)
        eps, delta = objective.privacy_spent(p.anchor_steps)
        return syn, float(eps), float(delta)

    def peer_spec(self, sender: int) -> ReplySpec:
        """A peer's anchors (at most `ipc` float32 images per class, class indices) and its
        logits on the mean anchor set: the names and forms a receiver reads."""
        spec = super().peer_spec(sender)
        img, k = tuple(self.env.image_shape), self.env.num_classes
        spec.exact["synthetic_images"] = {"anchors": TensorSpec((None, *img), torch.float32)}
        spec.exact["synthetic_labels"] = {"anchors": TensorSpec((None,), torch.int64)}
        spec.exact["logits"] = {"anchors": TensorSpec((None, k), torch.float32)}
        spec.max_rows["synthetic_images"] = self.p.ipc * k
        return spec

    def share(self, client: ClientContext, peers: list[int]) -> dict[int, Message]:
        if self.p.ipc == 0:
            return {}
        state = PeerState.load(client.state, client.cid)
        own = state.own or self._distil_anchors(client, state)
        glob = state.global_anchors(client.num_classes)
        logits: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        if glob is not None and len(glob.ids) > 1:
            model = self.client_model(client)
            model.eval()
            with torch.no_grad():
                logits = {"anchors": model(glob.x)}
            meta["anchor_set"] = glob.ids
        out = {}
        for peer in peers:
            arrays: dict[str, dict[str, torch.Tensor]] = {}
            if peer not in state.sent_to:
                arrays["synthetic_images"] = {"anchors": own[0]}
                arrays["synthetic_labels"] = {"anchors": own[1]}
            if logits:
                arrays["logits"] = logits
            if arrays:
                out[peer] = Message(arrays, dict(meta))
        state.sent_to |= set(peers)
        state.save(client.state)
        return out

    def _teacher(self, inbox: dict[int, Message], glob: GlobalAnchors,
                 device: torch.device) -> list[torch.Tensor]:
        """The peers' logits on exactly this client's mean anchor set."""
        # Only logits computed on the very same anchor set are comparable (one row per
        # anchor: a peer's claim of the same set is not proof of it).
        return [m.arrays["logits"]["anchors"].to(device) for m in inbox.values()
                if "logits" in m.arrays and list(m.meta.get("anchor_set", [])) == glob.ids
                and m.arrays["logits"]["anchors"].shape[0] == len(glob.y)]

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        p = self.p
        state = PeerState.load(client.state, client.cid)
        state.receive(client.inbox, client.device)
        state.save(client.state)
        glob = state.global_anchors(client.num_classes) if p.ipc > 0 else None
        model = self.client_model(client)
        x, y = client.x, client.y
        terms = []
        teachers: list[torch.Tensor] = []
        if glob is not None:
            teachers = self._teacher(client.inbox, glob, client.device)
            teacher = torch.stack(teachers).mean(0) if teachers else None
            order = torch.randperm(len(glob.y), generator=generator(
                derive_seed(self.env.seed, KD_ORDER_STREAM), 0, 0), device="cpu").to(glob.x.device)
            if (teacher is not None and p.lambda_kd > 0) or p.lambda_reg > 0:
                terms.append(AnchorTerms(glob.x, glob.y, teacher, p, self.env.train.batch_size,
                                         order, client.generator))
            x, y = torch.cat([x, glob.x]), torch.cat([y, glob.y])
        stats = local_train(model, x, y, self.client_train(client), client.generator,
                            terms=terms)
        client.state.arrays["weights"] = clone_state(model.state_dict())
        meta: dict[str, Any] = {"num_examples": client.num_train, "steps": stats.steps,
                                "train_loss": stats.mean_loss, "kd_peers": len(teachers)}
        if state.privacy is not None:
            meta.update(epsilon=state.privacy[0], delta=state.privacy[1])
        return Message(meta=meta)

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        held = {cid: PeerState.load(st, cid) for cid, st in sorted(client_states.items())}
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for cid, peer_state in held.items():
            if peer_state.own is not None:
                out[self.shared_synthetic.format(client=self.env.client_name(cid))] = \
                    peer_state.own
        for peer_state in held.values():
            glob = peer_state.global_anchors(self.env.num_classes)
            if glob is not None and len(glob.ids) > 1:
                out["global_anchors"] = (glob.x, glob.y)
                break
        return out

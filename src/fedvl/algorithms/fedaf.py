"""FedAF (Wang et al., CVPR 2024): aggregation-free federated learning.

No official code exists. fedvl follows the paper's algorithm as far as the methods notes
reconstruct it; docs/fedaf.md lists every choice the paper leaves open and fedvl's pick.

Round t:
  server:  send the global model w_t and, from round 1 on, the global knowledge V = {v_c}: the
           class-wise mean logits of the clients' real data, pooled over last round's replies.
  client:  on the classes it owns (>= `min_class_count` images), under w_t (eval mode):
           its local knowledge V_k (class-wise mean logits of its real images) with class
           counts, and class-wise soft labels R_k (mean softmax(f(x) / tau) of its real
           images); then `steps` image-SGD steps on its condensed set S_k (kept across rounds,
           `persist`; first drawn by `init`) minimising
             L_loc = L_DM + lambda_loc * n * C * SWD^2({u_c}, {v_c})
           with L_DM the DM loss (per class, mean embedding of real vs synthetic images under
           siamese DSA) on the re-sampled model gamma * w_t + (1 - gamma) * w~ (w~ a freshly
           initialised network, `resample`), u_c the mean logits of S_k's class c under w_t, and
           SWD^2 the squared sliced Wasserstein distance between the two class-wise point sets
           (n classes both hold, C logits each; none in round 0) over `projections` random
           directions, scaled by n * C to the DM loss's sum over classes.
           Uploads S_k (images, class indices), V_k with its counts, and R_k.
  server:  V <- the count-weighted mean of the V_k (broadcast next round), R <- the same of the
           R_k; trains w (no weight averaging) on the union of this round's S_k for
           `server_epochs` epochs of SGD on CE + lambda_glob * LGKM, LGKM the symmetric KL
           between r_c and t_c = mean softmax(f(s) / tau) over the batch's images of class c,
           averaged over the batch's classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedvl.algorithms.base import (
    ClientContext,
    ServerContext,
    ServerState,
    TrainsOnUnion,
    real_data,
)
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.distill.augment import DSAConfig
from fedvl.distill.client_sets import init_set, owned_ipc
from fedvl.distill.losses import class_means, random_directions, sliced_wasserstein
from fedvl.distill.samplers import BlendedModelSampler, UniformClassSampler, eval_logits
from fedvl.distill.synthesize import DistributionMatching, Objective, synthesize
from fedvl.distill.synthetic import SyntheticSet
from fedvl.distill.union import SERVER_TRAIN_STREAM, ServerTraining, received_sets, train_on_union
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm

# Probabilities are clamped to this before a logarithm (a softmax entry may underflow to 0).
PROB_FLOOR = 1e-8
# The name of a client's condensed set in its state and in its upload.
KEPT = "kept"


def symmetric_kl(r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per row, (KL(r || t) + KL(t || r)) / 2 of two [n, C] rows of probabilities."""
    r, t = r.clamp_min(PROB_FLOOR), t.clamp_min(PROB_FLOOR)
    return 0.5 * ((r * (r.log() - t.log())).sum(1) + (t * (t.log() - r.log())).sum(1))


def lgkm_loss(logits: torch.Tensor, y: torch.Tensor, soft: torch.Tensor, present: torch.Tensor,
              temperature: float) -> torch.Tensor:
    """Local-global knowledge matching on one batch: for each class c in the batch that has a
    soft label r_c (`present`), the symmetric KL between r_c and t_c, the mean of
    softmax(logits / temperature) over the batch's rows of class c; averaged over those
    classes (0 when there is none)."""
    k = soft.shape[0]
    t, counts = class_means(F.softmax(logits / temperature, dim=1), y, k)
    use = (counts > 0) & present
    if not bool(use.any()):
        return logits.sum() * 0.0
    return symmetric_kl(soft[use], t[use]).mean()


class KnowledgeMatching:
    """lambda_glob * LGKM, a loss term of the server's training (`local_train`)."""

    def __init__(self, soft: torch.Tensor, present: torch.Tensor, weight: float,
                 temperature: float) -> None:
        self.soft, self.present, self.weight, self.t = soft, present, weight, temperature

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        return self.weight * lgkm_loss(logits, y, self.soft, self.present, self.t)


def knowledge_distance(u: torch.Tensor, v: torch.Tensor, directions: torch.Tensor
                       ) -> torch.Tensor:
    """L_CDC: the squared sliced Wasserstein distance between the point sets u and v ([n, C]),
    times n * C. For a random unit direction E[(d . theta)^2] = |d|^2 / C, so when the sorting
    pairs every class with itself this is, in expectation, sum_c |u_c - v_c|^2: the DM loss's
    convention (a sum over classes of squared distances), which keeps lambda_loc a weight
    relative to L_DM (without the factor the term is too small to act; docs/fedaf.md)."""
    return sliced_wasserstein(u, v, directions) * (u.shape[0] * u.shape[1])


@dataclass
class CollaborativeCondensation:
    """L_DM + weight * L_CDC between the class-wise mean logits of the synthetic images under
    the global model and the global knowledge of the same classes (`target`, rows in the
    order of `classes`); fresh random directions every step."""

    dm: DistributionMatching
    model: FedModel
    target: torch.Tensor
    classes: torch.Tensor
    weight: float
    projections: int

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
                 ) -> tuple[torch.Tensor, None]:
        loss, _ = self.dm(images, labels, generator)
        k = self.target.shape[1]
        # Un-augmented, as the real images the knowledge came from.
        u = class_means(self.model(images), labels, k)[0][self.classes]
        dirs = random_directions(self.projections, k, generator).to(images.device)
        return loss + self.weight * knowledge_distance(u, self.target, dirs), None


def pool_knowledge(values: torch.Tensor, counts: torch.Tensor, sizes: torch.Tensor,
                   rule: str = "count") -> tuple[torch.Tensor, torch.Tensor]:
    """Pool per-client class-wise rows `values` [K, C, D] into ([C, D], present [C]).

    `count`: class c's rows weighted by the clients' counts of c (`counts` [K, C], each cut to
    [0, that client's training-set size `sizes` [K]: a count is the client's claim);
    `uniform`: 1/K over the clients holding c. A class no client holds gets a zero row and
    present False.
    """
    if rule == "uniform":
        w = (counts > 0).to(values.dtype)
    else:
        w = torch.minimum(counts.clamp_min(0), sizes.to(counts.dtype)[:, None]).to(values.dtype)
    total = w.sum(0)
    present = total > 0
    pooled = (w[..., None] * values).sum(0) / total.clamp_min(1e-12)[:, None]
    return pooled * present[:, None].to(values.dtype), present


@register_algorithm("fedaf")
class FedAF(TrainsOnUnion):
    """Clients condense with global knowledge; the server trains on the condensed sets."""

    # Its clients train no model: a local-objective add-on has nothing to mix into.
    accepts_addons = False
    trains_client_models = False  # clients condense; only the server trains
    payload_kinds = {"down": frozenset({"weights", "prototypes"}),
                     "up": frozenset({"synthetic_images", "synthetic_labels", "prototypes",
                                      "logits"})}
    # Its real images per class, which weight its knowledge on the server.
    count_tensors = frozenset({"prototypes/counts"})
    smoke_args = {"steps": 20, "server_epochs": 5}
    # No official code: the budgets of the third-party tejarshaarigila/FedAF (main_fedaf.py:
    # ipc 50, 1000 condensation iterations with a real batch of ipc images per class, 500
    # server epochs at lr 0.001 per round, 20 rounds).
    paper_args = {"ipc": 50, "steps": 1000, "batch_real": 50, "server_epochs": 500,
                  "server_lr": 0.001}
    paper_run = {"rounds": 20}
    # The union of the clients' uploads the server received in the last round.
    shared_synthetic = "fedaf_received"

    # Defaults are sized for the 20-round default run on a 2-core CPU; docs/fedaf.md gives the
    # reason for each choice the paper leaves open.
    @dataclass
    class Params:
        ipc: int = option(10, "condensed images per owned class (third-party code: 50)", ge=1)
        init: str = option("noise", "the first S_k: noise, N(0, 1) pixels (no real image is "
                           "uploaded); mean, each image the mean of init_group random real "
                           "images of its class (the paper's); real, ipc real images per class "
                           "(the third-party code)", choices=("noise", "mean", "real"))
        init_group: int = option(8, "real images averaged into each image by init=mean", ge=2)
        persist: bool = option(True, "keep S_k across rounds and condense it further (the "
                               "paper's clients update their condensed data); off: a new set "
                               "every round (the third-party code)")
        steps: int = option(100, "condensation steps per round (third-party code: 1000)", ge=0)
        batch_real: int = option(32, "real images per class per step (third-party code: ipc)",
                                 ge=1)
        lr_img: float = option(1.0, "image learning rate, momentum 0.5 (third-party code: 1, "
                               "no momentum)", gt=0)
        dsa: bool = option(True, "siamese augmentation in L_DM (DM's; third-party code: none)")
        gamma: float = option(0.9, "weight of w_t in the re-sampled model gamma * w_t + "
                              "(1 - gamma) * w~ (third-party code: 0.9, w~ N(0, 1) noise)",
                              ge=0, le=1)
        resample: str = option("step", "a fresh network w~ every condensation step, or one per "
                               "round", choices=("step", "round"))
        lambda_loc: float = option(0.8, "weight of the sliced Wasserstein term on the client "
                                   "(third-party code: 0.8, without a gradient)", ge=0)
        projections: int = option(100, "random directions of the sliced Wasserstein distance",
                                  ge=1)
        temperature: float = option(2.0, "softmax temperature of the soft labels and of LGKM "
                                    "(third-party code: 2)", gt=0)
        knowledge_weighting: str = option(
            "count", "how the server pools V_k and R_k per class: count, by the clients' "
            "images of the class; uniform, alike over the clients holding it",
            choices=("count", "uniform"))
        min_class_count: int = option(10, "a client condenses only classes with at least this "
                                      "many images", ge=1)
        lambda_glob: float = option(0.8, "weight of LGKM on the server (third-party code: 0.8)",
                                    ge=0)
        server_epochs: int = option(20, "server training epochs per round (third-party code: "
                                    "500)", ge=0)
        server_lr: float = option(0.01, "server SGD learning rate (third-party code: 0.001)",
                                  gt=0)
        server_momentum: float = option(0.9, "server SGD momentum", ge=0, lt=1)
        server_weight_decay: float = option(5e-4, "server weight decay", ge=0)
        server_batch_size: int = option(256, "server batch size (third-party code: 256)", ge=1)

    def upload_exemption(self) -> str | None:
        """Why this setting's upload may copy private images (init=real), or None."""
        if self.p.init != "real":
            return None
        return ("FedAF init=real starts the condensed set from ipc real images per class and "
                "uploads it after `steps` condensation steps (docs/fedaf.md)")

    # -- server ------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        return {"model": clone_state(self.new_model().state_dict()), "knowledge": None,
                "present": None, "soft_labels": None, "last_x": None, "last_y": None}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        arrays: dict[str, dict[str, torch.Tensor]] = {"weights": state["model"]}
        if state["knowledge"] is not None:
            arrays["prototypes"] = {"logits": state["knowledge"], "present": state["present"]}
        msg = Message(arrays, {"round": ctx.round})
        return {c: msg for c in clients}

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        """The condensed set (float32 images, class indices, at most `ipc` per class), the
        local knowledge (class x class logits, class counts) and the class-wise soft labels
        (class x class rows of probabilities): what `aggregate` pools and trains on."""
        spec = super().reply_spec(sent, cid)
        img, k = tuple(self.env.image_shape), self.env.num_classes
        f32 = torch.float32
        spec.exact["synthetic_images"] = {"x": TensorSpec((None, *img), f32)}
        spec.exact["synthetic_labels"] = {"y": TensorSpec((None,), torch.int64)}
        spec.exact["prototypes"] = {"logits": TensorSpec((k, k), f32),
                                    "counts": TensorSpec((k,), f32)}
        spec.exact["logits"] = {"soft_labels": TensorSpec((k, k), f32)}
        spec.probabilities["logits"] = frozenset({"soft_labels"})
        spec.required |= {"prototypes", "logits"}
        # Counts are cut to the client's size, which the driver bounds by what it announced.
        spec.required_meta |= {"num_examples"}
        spec.max_rows["synthetic_images"] = self.p.ipc * k
        return spec

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        p = self.p
        protos = [r.arrays["prototypes"] for r in replies.values()]
        counts = torch.stack([q["counts"].float().cpu() for q in protos])
        sizes = torch.tensor([float(r.meta["num_examples"]) for r in replies.values()],
                             device="cpu")
        knowledge, present = pool_knowledge(torch.stack([q["logits"].float().cpu()
                                                         for q in protos]),
                                            counts, sizes, p.knowledge_weighting)
        soft, _ = pool_knowledge(torch.stack([r.arrays["logits"]["soft_labels"].float().cpu()
                                              for r in replies.values()]),
                                 counts, sizes, p.knowledge_weighting)
        new = {**state, "knowledge": knowledge, "present": present.float(),
               "soft_labels": soft}
        # A client whose upload guard withheld its set still shares its knowledge.
        _, x, y = received_sets(replies)
        if x is None or y is None:
            return new
        x, y = x.to(ctx.device), y.to(ctx.device)
        model = self.load_model(state["model"], ctx.device)
        terms = ()
        if p.lambda_glob > 0:
            terms = (KnowledgeMatching(soft.to(ctx.device), present.to(ctx.device),
                                       p.lambda_glob, p.temperature),)
        train_on_union(model, x, y, ServerTraining.of(p), ctx.stream(SERVER_TRAIN_STREAM),
                       terms=terms)
        new.update(model=clone_state(model.state_dict()), last_x=x.cpu(), last_y=y.cpu())
        return new

    # -- client ------------------------------------------------------------------------------
    def client_update(self, msg: Message, client: ClientContext) -> Message:
        p, k = self.p, client.num_classes
        model = self.load_model(msg.get("weights"), client.device)
        model.eval().requires_grad_(False)
        xr, yr = real_data(client)
        per_class = owned_ipc(yr, k, p.ipc, p.min_class_count)
        keep = torch.tensor(per_class, device=yr.device)[yr] > 0
        xo, yo = xr[keep], yr[keep]
        # Local knowledge and soft labels of the real images, under the received model.
        _, lg = eval_logits(model, xo)
        knowledge, counts = class_means(lg, yo, k)
        soft = class_means(F.softmax(lg / p.temperature, dim=1), yo, k)[0]
        # A class it does not condense gets a uniform row: every row stays a distribution, and
        # its count of 0 gives it no weight at the server.
        soft[counts == 0] = 1.0 / k
        syn = self._condensed_set(client, per_class, xo, yo)
        synthesize(syn, self._objective(msg, model, per_class, xo, yo, client), p.steps,
                   client.generator, lr_img=p.lr_img)
        x, y = syn.tensors()
        if p.persist:
            client.state.arrays["synthetic_images"] = {KEPT: x.cpu()}
            client.state.arrays["synthetic_labels"] = {KEPT: y.cpu()}
        return Message({"synthetic_images": {"x": x}, "synthetic_labels": {"y": y},
                        "prototypes": {"logits": knowledge.float(),
                                       "counts": counts.float()},
                        "logits": {"soft_labels": soft.float()}},
                       {"num_examples": int(len(yr)), "synthetic": int(len(y))})

    def _condensed_set(self, client: ClientContext, per_class: list[int], x: torch.Tensor,
                       y: torch.Tensor) -> SyntheticSet:
        """The set this client condensed in an earlier round (`persist`), or a new one."""
        k, kept = client.num_classes, client.state.arrays.get("synthetic_images")
        if self.p.persist and kept is not None:
            return SyntheticSet(kept[KEPT].to(client.device),
                                client.state.arrays["synthetic_labels"][KEPT].to(client.device),
                                k, {"init": "kept"})
        # Drawn on the CPU generator: the same start on every device.
        syn = init_set(self.p.init, per_class, x.cpu(), y.cpu(), k, client.generator,
                       self.p.init_group)
        return syn.to(client.device)

    def _objective(self, msg: Message, model: FedModel, per_class: list[int], x: torch.Tensor,
                   y: torch.Tensor, client: ClientContext) -> Objective:
        """L_DM on the re-sampled model, plus the sliced Wasserstein pull toward the global
        knowledge once the server has some (from round 1 on)."""
        p, k, device = self.p, client.num_classes, client.device
        dm = DistributionMatching(
            real=UniformClassSampler(x, y, k, p.batch_real),
            extractor=BlendedModelSampler(model, lambda s: self.env.model_fn(seed=s).to(device),
                                          p.gamma, per_step=p.resample == "step"),
            num_classes=k, dsa=DSAConfig() if p.dsa else None)
        if p.lambda_loc == 0 or "prototypes" not in msg.arrays:
            return dm
        served = msg.arrays["prototypes"]
        both = torch.tensor(per_class, device="cpu") > 0
        both &= served["present"].cpu() > 0
        classes = both.nonzero().flatten()
        if len(classes) == 0:
            return dm
        return CollaborativeCondensation(dm, model, served["logits"].to(device)[classes.to(device)],
                                         classes.to(device), p.lambda_loc, p.projections)

"""FedVCK (2024): federated learning by condensing each client's valuable knowledge.

Defaults follow the paper (AAAI 2025); where the public code (`Youth-49/FedVCK_2024`) differs,
its form is an option value (docs/fedvck.md has the table).
Round r:
  client: importance weights w = sigmoid(gamma * (CE(z) - bias)) of its real images under the
          ensemble z = (1 - lam) f_r + lam f_{r-1} (f_{r-1}: the global model it received last
          round, kept in its state; the received model alone in its first round); per class,
          real batches drawn afresh each step with p = w / sum(w) within the class (Eq. 8;
          `importance_weights=softmax`: the code's softmax(w)); a condensed set of its owned
          classes (>= 10 images), started from N(0, 1) noise (`init=real`: the code's default),
          optimised by kernel MMD on the embeddings of the received model with the latent
          constraint (real batch in train mode, the synthetic batch normalised with the real
          batch's BatchNorm statistics, Eq. 4; `latent_stats=running`: the code's running
          statistics; only BatchNorm models are affected); uploads the set and per-class
          feature/logit prototypes of its real data with counts.
  server: count-weighted logit prototypes (Eq. 12); each class's `topk` hard negatives HN(c)
          are the largest entries of its logit prototype among the other classes (Eq. 13); the
          round's sets join the synthetic history (the last `history` rounds when set), on which
          the global model is trained with CE + beta * L_rc (Eq. 16, beta 1): Eq. 15, the
          projected feature's dot product with its class's prototype (mean embedding of the
          kept history under the previous round's model, Eq. 14) against those of HN(c) only.
          `contrastive=code` (the public code): the top-k with the class itself forced in, a
          batch-count-weighted SupCon over L2-normalised features and prototypes with the
          positive in the denominator, and beta cut 10x at half the epochs.
Fixes to the reference: with `contrastive=code`, beta is cut by 10x at half the server epochs
of each round and restored the next round (the reference's decay compounds across rounds); the
projector's gradients are zeroed every batch (the reference zeroes them once per round);
consecutive real batches are fresh draws (the reference slides a stride-1 window over one
pre-drawn list).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.algorithms.base import Algorithm, ClientContext, ServerContext, ServerState, real_data
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.distill.augment import DSAConfig, augment_batch
from fedvl.distill.client_sets import MIN_CLASS_COUNT, owned_ipc
from fedvl.distill.losses import KERNELS
from fedvl.distill.samplers import (
    WEIGHTINGS,
    FixedModelSampler,
    ImportanceClassSampler,
    eval_logits,
    weights_from_logits,
)
from fedvl.distill.synthesize import (
    LATENT_STATS,
    DistributionMatching,
    synthesize,
)
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models.base import FedModel, has_batch_stats
from fedvl.options import IntRange, LogUniform, Uniform, option
from fedvl.registry import register_algorithm

# Server random streams (ids of ServerContext.stream / run_seed).
PROJECTOR_STREAM = 71
SERVER_TRAIN_STREAM = 73
# The reference's smallest condensed class under `ratio` sizing.
MIN_RATIO_IPC = 5
PROJECTOR_HIDDEN = 128


def class_budget(y: torch.Tensor, num_classes: int, ipc: int, ratio: float,
                 min_count: int = MIN_CLASS_COUNT) -> list[int]:
    """Condensed images per class: `ipc`, or max(5, ceil(n_c * ratio)) when ratio > 0; owned
    classes only (`owned_ipc`'s rule), 0 for the others."""
    owned = owned_ipc(y, num_classes, 1, min_count)
    if ratio <= 0:
        return [ipc * o for o in owned]
    counts = torch.bincount(y.cpu(), minlength=num_classes).tolist()
    # round() strips float noise such as 300 * 0.01 = 3.0000000000000004 before the ceiling.
    return [max(MIN_RATIO_IPC, math.ceil(round(n * ratio, 9))) if o else 0
            for n, o in zip(counts, owned, strict=True)]


# The relational contrastive term's form: `paper` (Eq. 13-16: the top-k other classes are the
# hard negatives, Eq. 15's ratio over them alone, a constant weight) or `code` (the public
# code: the top-k set includes the class itself, a SupCon softmax over the batch's classes,
# and the weight drops 10x at half the epochs).
CONTRASTIVE_FORMS = ("paper", "code")


def related_classes(logit_protos: torch.Tensor, topk: int, form: str = "paper"
                    ) -> torch.Tensor:
    """Per class, its related classes from the largest logit-prototype entries.

    `paper`: the `topk` largest among the other classes (Eq. 13's HN(c), the class excluded).
    `code` (the reference): the `topk` largest, itself included; when a class is not among its
    own top-k it replaces the last one.
    """
    if form not in CONTRASTIVE_FORMS:
        raise ValueError(f"unknown contrastive form '{form}'; allowed: "
                         f"{', '.join(CONTRASTIVE_FORMS)}")
    n = logit_protos.shape[0]
    own = torch.arange(n, device=logit_protos.device)
    if form == "paper":
        others = logit_protos.float().clone()
        others[own, own] = float("-inf")
        return torch.topk(others, min(topk, logit_protos.shape[1] - 1), dim=1).indices
    k = min(topk, logit_protos.shape[1])
    top = torch.topk(logit_protos, k, dim=1).indices
    missing = ~(top == own[:, None]).any(1)
    top[missing, -1] = own[missing]
    return top


def contrastive_weight(beta: float, epoch: int, epochs: int, form: str = "paper") -> float:
    """The relational term's weight in `epoch` of a round of `epochs`: `beta` throughout
    (paper), or beta / 10 from half the epochs on (code; restored each round, see Fixes)."""
    if form == "code" and epoch >= max(epochs // 2, 1):
        return beta * 0.1
    return beta


def relational_supcon(h: torch.Tensor, y: torch.Tensor, protos: torch.Tensor,
                      related: torch.Tensor, temperature: float) -> torch.Tensor:
    """-mean_i log(sum_{j: y_j = y_i} s_ij / sum_{j: y_j in R(y_i) + {y_i}} s_ij), s_ij =
    exp(<h_i, p_{y_j}>/T): a prototype softmax over the class and its related classes,
    weighted by batch counts (the class joins its denominator whether or not R holds it)."""
    k = protos.shape[0]
    counts = torch.bincount(y, minlength=k).to(h.dtype)
    logits = F.normalize(h, dim=1) @ protos.T / temperature + counts.clamp_min(1e-30).log()
    allowed = torch.eye(k, dtype=torch.bool, device=h.device)
    allowed.scatter_(1, related, True)
    allowed &= (counts > 0)[None, :]
    logits = logits.masked_fill(~allowed[y], float("-inf"))
    return -(logits.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(logits, 1)).mean()


# How Eq. 15 compares a projected feature with a prototype: `cosine`, both L2-normalised (the
# text's "inspired by SimSiam", whose projector and similarity are cosine ones; the ratio is then
# bounded) or `dot`, the plain dot product as the equation is printed (unbounded below, since its
# denominator leaves the positive out: measured to collapse, docs/fedvck.md).
SIMILARITIES = ("cosine", "dot")


def hard_negative_contrastive(h: torch.Tensor, y: torch.Tensor, protos: torch.Tensor,
                              hard_neg: torch.Tensor, temperature: float,
                              similarity: str = "cosine") -> torch.Tensor:
    """Eq. 15 over the batch, divided by its size: sum_i -log(exp(s(h_i, f_{y_i})/T) /
    sum_{c in HN(y_i)} exp(s(h_i, f_c)/T)), s cosine or dot (`SIMILARITIES`); classes with no
    prototype (a zero row) are left out."""
    if similarity not in SIMILARITIES:
        raise ValueError(f"unknown similarity '{similarity}'; allowed: {', '.join(SIMILARITIES)}")
    if similarity == "cosine":   # a zero prototype row stays zero, so "present" still reads it
        h, protos = F.normalize(h, dim=1), F.normalize(protos, dim=1)
    # The denominator holds the hard negatives only, as Eq. 15 writes it.
    z = h @ protos.T / temperature
    present = protos.abs().sum(1) > 0
    neg = hard_neg[y]
    neg_ok = present[neg]
    # A sample whose class or every hard negative has no prototype yet has no Eq. 15 term.
    valid = present[y] & neg_ok.any(1)
    # Masked entries are filled with finite values so no -inf reaches logsumexp's backward.
    neg_z = z.gather(1, neg).masked_fill(~neg_ok, float("-inf")).masked_fill(~valid[:, None], 0.0)
    per = torch.logsumexp(neg_z, 1) - z.gather(1, y[:, None]).squeeze(1)
    # Eq. 15 sums over the samples and Eq. 16 adds it to L_ce with weight 1: dividing by the
    # batch size puts it on the scale of the batch-mean CE, keeping that 1:1 ratio.
    return torch.where(valid, per, torch.zeros_like(per)).sum() / len(y)


def make_projector(dim: int, generator: torch.Generator) -> nn.Sequential:
    """Linear(d,128)-BatchNorm1d-ReLU-Linear(128,d), initialised from `generator`."""
    with torch.device(generator.device):   # made where its init is drawn; callers move it
        proj = nn.Sequential(nn.Linear(dim, PROJECTOR_HIDDEN), nn.BatchNorm1d(PROJECTOR_HIDDEN),
                             nn.ReLU(), nn.Linear(PROJECTOR_HIDDEN, dim))
    with torch.no_grad():
        for layer in (proj[0], proj[3]):
            bound = 1.0 / math.sqrt(layer.in_features)
            for p in (layer.weight, layer.bias):
                p.copy_(torch.rand(p.shape, generator=generator,
                                   device=generator.device) * 2 * bound - bound)
    return proj


@register_algorithm("fedvck")
class FedVCK(Algorithm):
    """Clients upload importance-weighted condensed sets; the server trains on their history."""

    accepts_addons = False
    trains_client_models = False  # clients condense; only the server trains
    payload_kinds = {"down": frozenset({"weights"}),
                     "up": frozenset({"synthetic_images", "synthetic_labels", "prototypes"})}
    # Its real images per class, which weight its prototypes on the server.
    count_tensors = frozenset({"prototypes/counts"})
    # The reference runs use ConvNetBN, and the latent constraint only acts on BatchNorm.
    model_defaults = {"norm": "batch"}
    smoke_args = {"steps": 20, "server_epochs": 5}
    # The public code's config (Youth-49/FedVCK_2024: dc_iterations 1000, dc_batch_size 256,
    # model_epochs 1000, ipc 10, 10 communication rounds); its run scripts go to 5000-10000
    # condensation steps on CIFAR-10 and MedMNIST.
    paper_args = {"ipc": 10, "steps": 1000, "batch_real": 256, "server_epochs": 1000}
    paper_run = {"rounds": 10}
    # The union of the clients' uploads the server received in the last round.
    shared_synthetic = "synthetic_last_round"

    @dataclass
    class Params:
        # Client. Defaults are sized for a 2-core CPU; reference values in the comments.
        ipc: int = option(10, "condensed images per owned class (reference 10)", ge=1,
                         tune=IntRange(1, 10))
        ratio: float = option(0.0, "if > 0, condense max(5, ceil(n_c * ratio)) images per "
                              "owned class instead of ipc (reference runs 0.01-0.05)", ge=0, le=1)
        steps: int = option(100, "condensation steps per round (reference 1000-10000)", ge=0)
        batch_real: int = option(64, "real images per class per step (reference 256)", ge=1)
        replacement: bool = option(True, "draw real batches with replacement (reference); "
                                   "off: distinct images within a batch")
        importance_weights: str = option(
            "linear", "draw probabilities of a class's real images from their importance "
            "weights: linear, p = w / sum(w) (the paper's Eq. 8), softmax, p = softmax(w) "
            "(the public code), or uniform (importance sampling off)", choices=WEIGHTINGS)
        kernel: str = option("linear", "MMD kernel (reference default linear)", choices=KERNELS)
        latent_stats: str = option(
            "batch", "BatchNorm statistics the latent constraint normalises the synthetic batch "
            "with: batch, the current real batch's (the paper's Eq. 4), or running, the running "
            "statistics the real batch just updated (the public code)", choices=LATENT_STATS)
        # The paper starts from N(0, 1) so that no private image is uploaded; the public
        # code's default copies real images (its run scripts use noise too).
        init: str = option("noise", "N(0,1) noise (the paper) or real images (the public "
                           "code's default), fresh every round", choices=("noise", "real"))
        lr_img: float = option(1.0, "image learning rate (reference 1.0; runs 0.2)", gt=0)
        img_momentum: float = option(0.5, "image SGD momentum (reference 0.5)", ge=0, lt=1)
        clip_norm: float = option(30.0, "image-gradient norm clip (reference 30; 0: off)", ge=0)
        lam: float = option(0.5, "weight of the previous model in the ensemble (reference 0.5)",
                            ge=0, le=1)
        gamma: float = option(1.0, "sigmoid slope of the importance weights (reference 1)", gt=0)
        bias: float = option(0.7, "sigmoid offset of the importance weights (reference 0.7)")
        dsa: bool = option(True, "siamese augmentation in condensation (reference on)")
        min_class_count: int = option(MIN_CLASS_COUNT, "a client condenses only classes with at "
                                      "least this many images (reference 10)", ge=1)
        # Server.
        server_epochs: int = option(20, "epochs on the synthetic history per round "
                                    "(reference 1000)", ge=1)
        server_lr: float = option(0.01, "server SGD learning rate (reference 0.01; runs 0.001)",
                                  gt=0, tune=LogUniform(1e-3, 1e-1))
        server_momentum: float = option(0.9, "server SGD momentum (reference 0.9)", ge=0, lt=1)
        server_wd: float = option(0.0, "server weight decay (reference 0; runs 1e-6)", ge=0)
        server_batch: int = option(256, "server batch size (reference 256)", ge=1)
        server_dsa: bool = option(True, "DSA on the server's CE pass over the synthetic history "
                                  "(reference on; off: the sets as uploaded, as FedDM's server)")
        # Eq. 16 adds L_rc to L_ce with weight 1 (the paper's); the public code's runs use 0.1
        # (CIFAR10, OrganSMNIST), which `contrastive=code` runs want passed as beta=0.1.
        beta: float = option(1.0, "weight of the relational contrastive term (paper Eq. 16: 1; "
                             "reference 0; runs 0.05-0.1)", ge=0, tune=Uniform(0.0, 1.0))
        contrastive: str = option(
            "paper", "relational contrastive form: paper (Eq. 13-16: top-k other classes as "
            "hard negatives, Eq. 15's ratio over them alone (`similarity`), constant "
            "beta) or code (the public code: the top-k include the class itself, a SupCon "
            "softmax over the batch's classes on normalised features, beta cut 10x at half the "
            "server epochs)", choices=CONTRASTIVE_FORMS)
        similarity: str = option(
            "cosine", "contrastive=paper: Eq. 15's similarity, cosine (L2-normalised, as the "
            "SimSiam the paper follows; bounded) or dot (the printed formula; unbounded below)",
            choices=SIMILARITIES)
        temperature: float = option(0.1, "SupCon temperature (reference 1.0; runs 0.1)", gt=0)
        topk: int = option(5, "related classes per class: hard negatives (paper), or itself "
                           "included (contrastive=code) (reference 3; runs 5)", ge=1)
        head_lr: float = option(0.01, "projector Adam learning rate (reference 0.01)", gt=0)
        history: int = option(0, "rounds of synthetic sets the server keeps, newest first (0: "
                              "all; the reference keeps max(10, rounds // 2))", ge=0)

    def upload_exemption(self) -> str | None:
        """Why this setting's upload may copy private images (init=real), or None."""
        if self.p.init != "real":
            return None
        return ("FedVCK init=real starts each round's condensed set from real images and "
                "uploads it after `steps` matching steps")

    # -- server ------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        return {"model": clone_state(self.new_model().state_dict()), "projector": None,
                "history_x": [], "history_y": [], "protos": None, "related": None,
                "feature_protos": None, "log": []}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        msg = Message({"weights": state["model"]}, {"round": ctx.round})
        return {c: msg for c in clients}

    def global_model(self, state: ServerState) -> FedModel:
        return self.load_model(state["model"], self.env.device)

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if not state["history_x"]:
            return {}
        return {self.shared_synthetic: (state["history_x"][-1], state["history_y"][-1])}

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        """The round's condensed set (float32 images, class indices) and the per-class
        prototypes of the server's model: what `aggregate` sums over clients."""
        spec = super().reply_spec(sent, cid)
        img, k = tuple(self.env.image_shape), self.env.num_classes
        f32 = torch.float32
        spec.exact["synthetic_images"] = {"round": TensorSpec((None, *img), f32)}
        spec.exact["synthetic_labels"] = {"round": TensorSpec((None,), torch.int64)}
        spec.exact["prototypes"] = {"features": TensorSpec((k, self.feature_width(cid)), f32),
                                    "logits": TensorSpec((k, k), f32),
                                    "counts": TensorSpec((k,), f32)}
        spec.required |= {"prototypes"}
        if self.p.ratio <= 0:
            spec.max_rows["synthetic_images"] = self.p.ipc * k
        return spec

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        # A client whose upload guard withheld its set sits this round out.
        replies = {c: r for c, r in replies.items() if "synthetic_images" in r.arrays}
        if not replies:
            return state
        k = self.env.num_classes
        feat, logit = None, torch.zeros(k, k, device="cpu")
        count = torch.zeros(k, device="cpu")
        xs, ys = [], []
        for r in replies.values():
            pr = r.arrays["prototypes"]
            n = pr["counts"].float().cpu()
            f = pr["features"].float().cpu() * n[:, None]
            feat = f if feat is None else feat + f
            logit = logit + pr["logits"].float().cpu() * n[:, None]
            count = count + n
            xs.append(r.arrays["synthetic_images"]["round"])
            ys.append(r.arrays["synthetic_labels"]["round"])
        logit = logit / count.clamp_min(1)[:, None]
        assert feat is not None
        # Aggregated as the reference does, though its loss uses only the logit prototypes.
        feat = F.normalize(feat / count.clamp_min(1)[:, None], dim=1)
        related = related_classes(logit, self.p.topk, self.p.contrastive)
        hx = [*state["history_x"], torch.cat(xs).to(ctx.device)]
        hy = [*state["history_y"], torch.cat(ys).to(ctx.device)]
        if self.p.history:
            hx, hy = hx[-self.p.history:], hy[-self.p.history:]
        # The whole history, concatenated once for training and for the prototypes.
        x_all, y_all = torch.cat(hx), torch.cat(hy)
        model, proj = self._train(state, ctx, x_all, y_all, related)
        protos = self._history_prototypes(model, x_all, y_all)
        lat = sorted({bool(r.meta.get("latent_constraint")) for r in replies.values()})
        log = [*state["log"], {"round": ctx.round, "history": int(sum(len(y) for y in hy)),
                               "latent_constraint": lat[-1] if lat else False}]
        return {**state, "model": clone_state(model.state_dict()),
                "projector": clone_state(proj.state_dict()), "history_x": hx, "history_y": hy,
                "protos": protos, "related": related, "feature_protos": feat, "log": log}

    def _train(self, state: ServerState, ctx: ServerContext, x: torch.Tensor, y: torch.Tensor,
               related: torch.Tensor) -> tuple[FedModel, nn.Module]:
        p = self.p
        model = self.load_model(state["model"], ctx.device)
        with torch.no_grad():
            dim = int(model.embed(x[:2]).shape[1])
        proj = make_projector(dim, torch.Generator().manual_seed(ctx.run_seed(PROJECTOR_STREAM)))
        if state["projector"] is not None:
            proj.load_state_dict(state["projector"])
        proj = proj.to(ctx.device)
        # Optimisers and schedules are re-created each round, as the reference does.
        opt = torch.optim.SGD(model.parameters(), lr=p.server_lr, momentum=p.server_momentum,
                              weight_decay=p.server_wd)
        opt_head = torch.optim.Adam(proj.parameters(), lr=p.head_lr)
        half = max(p.server_epochs // 2, 1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=half, gamma=0.1)
        sched_head = torch.optim.lr_scheduler.StepLR(opt_head, step_size=half, gamma=0.1)
        protos = state["protos"]
        use_con = p.beta > 0 and protos is not None
        if use_con:
            protos, related = protos.to(ctx.device), related.to(ctx.device)
            if p.contrastive == "code":
                # The code's SupCon compares L2-normalised features and prototypes.
                protos = F.normalize(protos, dim=1)
        g = ctx.stream(SERVER_TRAIN_STREAM)
        dsa = DSAConfig() if p.server_dsa else None
        model.train()
        proj.train()
        for epoch in range(p.server_epochs):
            beta = contrastive_weight(p.beta, epoch, p.server_epochs, p.contrastive)
            order = torch.randperm(len(y), generator=g, device=g.device).to(x.device)
            for i in range(0, len(y), p.server_batch):
                idx = order[i : i + p.server_batch]
                xb, yb = x[idx], y[idx]
                opt.zero_grad(set_to_none=True)
                opt_head.zero_grad(set_to_none=True)
                xa = augment_batch(xb, g, dsa) if dsa is not None else xb
                loss = F.cross_entropy(model(xa), yb)
                if use_con and len(yb) > 1:
                    # Features of the un-augmented batch, logits of the augmented one.
                    h = proj(model.embed(xb))
                    loss = loss + beta * (
                        hard_negative_contrastive(h, yb, protos, related, p.temperature,
                                                  p.similarity)
                        if p.contrastive == "paper"
                        else relational_supcon(h, yb, protos, related, p.temperature))
                loss.backward()
                opt.step()
                if use_con and len(yb) > 1:
                    opt_head.step()
            sched.step()
            if use_con:
                sched_head.step()
        return model, proj

    @torch.no_grad()
    def _history_prototypes(self, model: FedModel, x: torch.Tensor, y: torch.Tensor
                            ) -> torch.Tensor:
        """Mean embedding (eval mode) of every class in the synthetic history (Eq. 14); a zero
        row for a class it lacks."""
        model.eval()
        z = torch.cat([model.embed(x[i : i + 500]) for i in range(0, len(x), 500)])
        sums = torch.zeros(self.env.num_classes, z.shape[1], device=z.device).index_add_(0, y, z)
        counts = torch.bincount(y, minlength=self.env.num_classes).clamp_min(1)
        return sums / counts[:, None].to(sums.dtype)

    # -- client ------------------------------------------------------------------------------
    def client_update(self, msg: Message, client: ClientContext) -> Message:
        p, k = self.p, client.num_classes
        model = self.load_model(msg.get("weights"), client.device)
        prev = model
        if "weights" in client.state.arrays:
            prev = self.load_model(client.state.arrays["weights"], client.device)
        xr, yr = real_data(client)
        budget = class_budget(yr, k, p.ipc, p.ratio, p.min_class_count)
        keep = torch.tensor(budget, device=yr.device)[yr] > 0
        xo, yo = xr[keep], yr[keep]
        # One eval pass of the received model serves the weights and the prototypes.
        z, lg = eval_logits(model, xo)
        lg_prev = lg if prev is model else eval_logits(prev, xo)[1]
        w = weights_from_logits([lg, lg_prev], yo, mix=[1 - p.lam, p.lam], gamma=p.gamma,
                                bias=p.bias)
        sampler = ImportanceClassSampler(xo, yo, k, p.batch_real, w, p.replacement,
                                         multiset=True, weighting=p.importance_weights)
        if p.init == "real":
            syn = SyntheticSet.from_real(budget, xo, yo, k, client.generator)
        else:
            syn = SyntheticSet.noise(budget, k, tuple(xr.shape[1:]), client.generator)
        syn = syn.to(client.device)
        objective = DistributionMatching(real=sampler, extractor=FixedModelSampler(model),
                                         num_classes=k, matching="kernel", kernel=p.kernel,
                                         dsa=DSAConfig() if p.dsa else None,
                                         latent_constraint=True, latent_stats=p.latent_stats)
        res = synthesize(syn, objective, p.steps, client.generator, lr_img=p.lr_img,
                         momentum=p.img_momentum, clip_norm=p.clip_norm or None)
        feats, logits, counts = self._prototypes(z, lg, yo, k)
        client.state.arrays["weights"] = clone_state(model.state_dict())
        x, y = syn.tensors()
        meta: dict[str, Any] = {"num_examples": int(len(yr)), "synthetic": int(len(y)),
                                # Train/eval statistics differ only with BatchNorm layers.
                                "latent_constraint": has_batch_stats(model),
                                "condense_loss": res.loss_curve[-1] if res.loss_curve else 0.0}
        return Message({"synthetic_images": {"round": x.detach()},
                        "synthetic_labels": {"round": y},
                        "prototypes": {"features": feats, "logits": logits, "counts": counts}},
                       meta)

    @torch.no_grad()
    def _prototypes(self, z: torch.Tensor, lg: torch.Tensor, y: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-class mean embedding and mean logits of the real images (eval mode), counts."""
        counts = torch.bincount(y, minlength=k).float()
        n = counts.clamp_min(1)[:, None]
        feats = torch.zeros(k, z.shape[1], device=z.device).index_add_(0, y, z) / n
        logits = torch.zeros(k, lg.shape[1], device=z.device).index_add_(0, y, lg) / n
        return feats, logits, counts

"""FedDM (Xiong et al., CVPR 2023): clients distil, the server trains on the distilled sets.

Round t:
  server:  send the global weights w_t.
  client:  a fresh synthetic set of the classes it owns (`owned_ipc`: >= `min_class_count`
           images): `ipc` real images per class (`init=real`, re-drawn every round) or N(0, 1)
           noise (`init=noise`); `steps` image-SGD steps (lr `lr_img`, momentum 0.5), each on a
           model drawn around w_t in the rho-ball (`RhoBallSampler`, a fresh direction per step;
           on the sphere of radius rho by default, as the public re-implementation's
           `random_pertube`), matching per class the mean embedding and the mean logits of
           `batch_real` real images against the synthetic ones (no augmentation); upload the
           images and their labels.
  server:  train the persistent global model for `server_epochs` epochs of SGD on the union of
           this round's synthetic sets only (no history).
DP variant (`dp_noise` > 0; the paper's Sec. 3.3, no public code has one): DP-SGD on the
synthetic-image update: each matching step reads Poisson-sampled real images, clips every
image's gradient w.r.t. the synthetic images to `dp_clip` and adds N(0, (sigma C)^2) to every
pixel of the sum (`DPDistributionMatching(logits=True)`, `dp_space=image`); `dp_space=feature`
clips and noises the gradient w.r.t. the class-mean embedding and logits instead (the same
guarantee by post-processing, cheaper, a different noise geometry). Each client reports its
epsilon over all its DP steps so far, which reaches `summary.json` under `privacy` (`report`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedvl.algorithms.base import (
    ClientContext,
    Env,
    ServerContext,
    ServerState,
    TrainsOnUnion,
)
from fedvl.core.dp import (
    EPSILON_DELTA,
    add_dp_steps,
    delta_for,
    merge_privacy,
    privacy_meta,
    privacy_report,
)
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplySpec
from fedvl.core.stacked import stackable
from fedvl.distill.client_sets import init_set, owned_ipc
from fedvl.distill.dp_matching import SPACES, DPDistributionMatching, check_dp_setup
from fedvl.distill.samplers import RhoBallSampler, UniformClassSampler
from fedvl.distill.stacked_synthesis import stacked_synthesize
from fedvl.distill.synthesize import DistributionMatching, Objective, synthesize
from fedvl.distill.synthetic import SyntheticSet
from fedvl.distill.union import (
    SERVER_TRAIN_STREAM,
    ServerTraining,
    received_sets,
    synthetic_set_spec,
    train_on_union,
)
from fedvl.models.base import FedModel
from fedvl.options import IntRange, LogUniform, option
from fedvl.registry import register_algorithm

# Image-SGD momentum of the public re-implementation (not an option there either).
IMAGE_MOMENTUM = 0.5


def client_share_weights(sizes: list[tuple[int, int]]) -> torch.Tensor:
    """Per-image weights of the union of the clients' synthetic sets, in reply order, so that
    its mean CE is sum_k (n_k / n) * mean CE over client k's set (paper Eq. 9); `sizes` holds
    (n_k real images, m_k synthetic images) per client. The weights average 1."""
    sizes = [(nk, mk) for nk, mk in sizes if mk > 0]   # a client with no set has no say
    n = sum(nk for nk, _ in sizes)
    m = sum(mk for _, mk in sizes)
    return torch.cat([torch.full((mk,), (nk / n) * (m / mk), device="cpu") for nk, mk in sizes])


@torch.no_grad()
def project_to_ball(params: list[torch.Tensor], center: list[torch.Tensor], rho: float) -> None:
    """Move `params` in place to the nearest point of the L2 ball of radius rho around
    `center` (all tensors as one vector); inside the ball they stay as they are."""
    dist = torch.sqrt(sum(((p - c).double() ** 2).sum() for p, c in zip(params, center)))
    if float(dist) > rho:
        scale = rho / float(dist)
        for p, c in zip(params, center):
            p.copy_(c + (p - c) * scale)


@register_algorithm("feddm")
class FedDM(TrainsOnUnion):
    """Federated distribution matching: synthetic sets up, a server-trained model down."""

    trains_client_models = False  # clients distil; only the server trains

    payload_kinds = {"down": frozenset({"weights"}),
                     "up": frozenset({"synthetic_images", "synthetic_labels"})}

    smoke_args = {"steps": 20, "server_epochs": 5}
    # The public re-implementation's config (m13891290332/fedDM: dc_iterations 1000,
    # dc_batch_size 256, model_epochs 500, ipc 10, 20 communication rounds).
    paper_args = {"ipc": 10, "steps": 1000, "batch_real": 256, "server_epochs": 500}
    paper_run = {"rounds": 20}
    # The union of the clients' uploads the server received in the last round.
    shared_synthetic = "feddm_received"

    # Defaults are sized for the 20-round default run on a 2-core CPU; the public
    # re-implementation's values (m13891290332/fedDM, config.py) are in the comments.
    @dataclass
    class Params:
        ipc: int = option(10, "synthetic images per owned class (public code: 10)", ge=1,
                         tune=IntRange(1, 10))
        init: str = option("real", "real: ipc real images per class, re-drawn every round "
                           "(public code); noise: N(0, 1) pixels", choices=("real", "noise"))
        steps: int = option(100, "matching steps per round (public code: 1000)", ge=0)
        rho: float = option(5.0, "radius of the ball models are drawn from around w_t "
                            "(public code: 5)", ge=0, tune=LogUniform(1.0, 10.0))
        rho_draw: str = option("sphere", "sphere: perturbation of norm exactly rho (public "
                               "code); ball: uniform inside the ball",
                               choices=("sphere", "ball"))
        batch_real: int = option(32, "real images per class per matching step (public code: "
                                 "256)", ge=1)
        lr_img: float = option(1.0, "image learning rate (public code: 1)", gt=0)
        min_class_count: int = option(10, "a client distils only classes with at least this "
                                      "many images", ge=1)
        server_epochs: int = option(20, "server training epochs per round (public code: 500)",
                                    ge=0)
        server_lr: float = option(0.01, "server SGD learning rate (public code: 0.01)", gt=0,
                                  tune=LogUniform(1e-3, 1e-1))
        server_momentum: float = option(0.9, "server SGD momentum (public code: 0.9)", ge=0,
                                        lt=1)
        server_weight_decay: float = option(5e-4, "server weight decay (public code: 5e-4)",
                                            ge=0)
        server_batch_size: int = option(256, "server batch size (public code: 256)", ge=1)
        server_weighting: str = option("clients", "clients: client k's set weighted by "
                                       "n_k / n, its share of the real data (paper Eq. 9); "
                                       "uniform: every synthetic image counts alike (public "
                                       "code)", choices=("clients", "uniform"))
        server_projection: bool = option(True, "project the server model back into the "
                                         "rho-ball around w_t after every step (paper Sec. "
                                         "4.5); false: no projection (public code)")
        dp_noise: float = option(0.0, "DP noise multiplier sigma; 0 turns DP off (DP is "
                                 "fedvl's reading, no public code)", ge=0)
        dp_clip: float = option(1.0, "DP per-sample clipping norm", gt=0)
        dp_delta: float = option(0.0, "DP delta; 0: 1/(10 n) for n owned real images", ge=0,
                                 lt=1)
        dp_space: str = option("image", "where DP clips and noises: image, each real image's "
                               "gradient w.r.t. the synthetic images (DP-SGD on the image "
                               "update, the paper); feature, its gradient w.r.t. the class-mean "
                               "embedding and logits (cheaper, mapped to the images after the "
                               "noise)", choices=SPACES)

    def __init__(self, env: Env, params: Any | None = None) -> None:
        super().__init__(env, params)
        if self.dp:
            # Refuses init 'real' and BatchNorm models: the reported epsilon would not hold.
            check_dp_setup(self.p.init, env.model_fn())

    def upload_exemption(self) -> str | None:
        """Why this setting's upload may copy private images (init=real), or None."""
        if self.p.init != "real":
            return None
        return ("FedDM init=real starts each round's synthetic set from ipc real images per "
                "class and uploads it after `steps` matching steps (docs/feddm.md)")

    @property
    def dp(self) -> bool:
        """Whether the DP variant runs."""
        return self.p.dp_noise > 0

    # -- server ------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        return {"model": clone_state(self.new_model().state_dict()), "last_x": None,
                "last_y": None, "epsilon": {}, "delta": {}}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        msg = Message({"weights": state["model"]})
        return {c: msg for c in clients}

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        """One set `x` of float32 images with class indices `y`, at most `ipc` per class: the
        server trains on the union, so every reply must take one dtype and one label form."""
        spec = synthetic_set_spec(super().reply_spec(sent, cid), tuple(self.env.image_shape),
                                  self.p.ipc * self.env.num_classes)
        if self.p.server_weighting == "clients":
            # The server weighs each set by the client's data share (bounded by the driver).
            spec.required_meta |= {"num_examples"}
        return spec

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        # A client whose upload guard withheld its set sends none: it sits this round out.
        replies, x, y = received_sets(replies)
        if x is None or y is None:
            return state
        x, y = x.to(ctx.device), y.to(ctx.device)
        model = self.load_model(state["model"], ctx.device)
        weight = None
        if self.p.server_weighting == "clients":
            weight = client_share_weights(
                [(int(r.meta["num_examples"]), len(r.arrays["synthetic_labels"]["y"]))
                 for r in replies.values()]).to(ctx.device)
        self.server_train(model, x, y, ctx, weight)
        return {**state, "model": clone_state(model.state_dict()), "last_x": x.cpu(),
                "last_y": y.cpu(),
                **merge_privacy(state, replies, self.env.client_name, EPSILON_DELTA)}

    def server_train(self, model: FedModel, x: torch.Tensor, y: torch.Tensor,
                     ctx: ServerContext, weight: torch.Tensor | None = None) -> None:
        """Train the global model in place on the received synthetic images (CE, plain SGD;
        rows weighted by `weight`; projected into the rho-ball around its start if asked)."""
        p = self.p
        project = None
        if p.server_projection:
            start = [q.detach().clone() for q in model.parameters()]

            def project(m: FedModel, _lr: float) -> None:
                project_to_ball(list(m.parameters()), start, p.rho)
        train_on_union(model, x, y, ServerTraining.of(p), ctx.stream(SERVER_TRAIN_STREAM),
                       after_step=project, sample_weight=weight)

    def report(self, state: ServerState) -> dict[str, Any]:
        if not self.dp:
            return {}
        return {"privacy": privacy_report(
            f"feddm-dp ({self.p.dp_space} space): per-sample clipped, noised embedding+logit "
            "matching gradient, Opacus RDP accountant", self.p.dp_noise, self.p.dp_clip, state,
            EPSILON_DELTA)}

    # -- client ------------------------------------------------------------------------------
    def client_update(self, msg: Message, client: ClientContext) -> Message:
        syn, objective = self.client_setup(msg, client)
        synthesize(syn, objective, self.p.steps, client.generator, lr_img=self.p.lr_img,
                   momentum=IMAGE_MOMENTUM)
        return self.client_reply(syn, objective, client)

    def stack_ready(self) -> bool:
        """Whether a round's clients may distil stacked (`--stack-clients`): the non-DP
        matching (DP keeps its per-client path) on a model without BatchNorm."""
        return (type(self).client_update is FedDM.client_update and not self.dp
                and stackable(self.new_model()))

    def client_update_stacked(self, items: list[tuple[Message, ClientContext]]
                              ) -> list[Message]:
        """`client_update` of every (message, client) pair, their synthesis steps in lockstep
        as one vectorised computation (`fedvl.distill.stacked_synthesis`)."""
        setups = [self.client_setup(m, c) for m, c in items]
        stacked_synthesize([s for s, _ in setups], [o for _, o in setups], self.p.steps,
                           [c.generator for _, c in items], lr_img=self.p.lr_img,
                           momentum=IMAGE_MOMENTUM)
        return [self.client_reply(s, o, c) for (s, o), (_, c) in zip(setups, items, strict=True)]

    def client_setup(self, msg: Message, client: ClientContext
                     ) -> tuple[SyntheticSet, Objective]:
        """A client's fresh synthetic set and its matching objective for this round."""
        p, k = self.p, client.num_classes
        model = self.load_model(msg.get("weights"), client.device)
        xr, yr = client.x, client.y
        if client.x_real is not None and client.y_real is not None:
            xr, yr = client.x_real, client.y_real
        per_class = owned_ipc(yr, k, p.ipc, p.min_class_count)
        # Only owned classes are matched (and, under DP, only their images are ever read).
        keep = torch.tensor(per_class, device=yr.device)[yr] > 0
        xr, yr = xr[keep], yr[keep]
        # Drawn on the CPU generator: the same start on every device.
        syn = init_set(p.init, per_class, xr.cpu(), yr.cpu(), k, client.generator)
        syn = syn.to(client.device)
        extractor = RhoBallSampler(model, p.rho, sphere=p.rho_draw == "sphere")
        if self.dp:
            return syn, DPDistributionMatching(
                xr, yr, extractor, k, batch_per_class=p.batch_real, clip=p.dp_clip,
                noise_multiplier=p.dp_noise, delta=delta_for(p.dp_delta, len(yr)),
                space=p.dp_space, logits=True)
        return syn, DistributionMatching(
            real=UniformClassSampler(xr, yr, k, p.batch_real), extractor=extractor,
            num_classes=k, matching="embed_logit", dsa=None)

    def client_reply(self, syn: SyntheticSet, objective: Objective, client: ClientContext
                     ) -> Message:
        """A client's upload: its distilled set (and, under DP, the privacy it has spent)."""
        x, y = syn.tensors()
        meta: dict[str, Any] = {"num_examples": client.num_train, "synthetic": len(y)}
        if self.dp:
            assert isinstance(objective, DPDistributionMatching)
            # Every round releases a new set from the same private images: the accountant
            # composes all of this client's DP steps so far, not only this round's.
            add_dp_steps(client.state, self.p.steps)
            meta.update(privacy_meta(client.state, objective.privacy_spent))
        return Message({"synthetic_images": {"x": x}, "synthetic_labels": {"y": y}}, meta)

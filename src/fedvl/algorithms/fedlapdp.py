"""FedLAP-DP (Wang et al., PoPETs 2024): clients share synthetic loss approximations.

Round m (hui-po-wang/FedLAP-DP: `main.py`, `utils/fl_utils.py`):
  server:  send the global weights w_m.
  client:  a synthetic set of `ipc` images for every class it holds (`init`: real images
           without DP, N(0, 1) noise with DP; `carry_images`: new every round without DP,
           continued from its last round with DP), labels fixed; image SGD (lr `lr_img`,
           momentum 0.5) over the whole update. `iterations` times: w <- w_m; then
           `outer_loop` times, while ||w - w_m|| < `radius` (10 without DP, 1.5 with DP):
             `steps` times: a Poisson batch of real images (rate `batch_real` / n_k) and up to
               `syn_batch` synthetic ones, both under one DSA draw; the real target g_D = the
               batch's CE gradient at w (with DP: per-sample clipped to `dp_clip`, summed,
               plus N(0, sigma^2 C^2), over the expected batch); then `image_steps` image
               updates on L = D_cos(g_S, g_D) + `mse_weight` * ||g_S - g_D||^2 (0.1 without
               DP, 0 with DP), g_S the synthetic CE gradient at w
               (`fedvl.distill.dp_gradient_matching`);
             `inner_epochs` epochs of SGD of w on the synthetic set (lr `lr_net`).
           Without DP, its radius r_k: a copy of w_m trained on the set for `radius_epochs`
           epochs; r_k = ||w_e - w_m|| at the epoch e of least CE on its real data, capped at
           `radius`. Upload the images, labels (and r_k).
  server:  r = the vote (`radius_vote`: min without DP) of the r_k, or `radius` (with DP);
           a fresh SGD (lr `lr_net`: 0.1 without DP, 0.002 with DP, cosine-decayed over
           `cosine_rounds`) trains w_m on the union of the round's sets for up to
           `server_epochs` epochs, stopping after the first epoch that ends at
           ||w - w_m|| >= r (`server_trust=stop`; `project`: kept in the ball after every
           step).
DP (`dp_noise` > 0): every real target is one sampled Gaussian mechanism; a client reports
epsilon at its delta over all the targets it has drawn so far (Opacus RDP accountant), which
reaches `summary.json` under `privacy`. Its synthetic set starts from noise and the radius is
the constant `radius`: nothing else it sends reads its records. Options left at auto take the
official config of the run's kind (`CODE_RULES`).
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedvl.algorithms.base import (
    ClientContext,
    Env,
    ServerContext,
    ServerState,
    TrainsOnUnion,
)
from fedvl.algorithms.feddm import IMAGE_MOMENTUM, project_to_ball
from fedvl.core.dp import (
    EPSILON_DELTA,
    add_dp_steps,
    check_dp_model,
    delta_for,
    merge_privacy,
    privacy_meta,
    privacy_report,
)
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplySpec
from fedvl.core.training import TrainConfig, local_train
from fedvl.distill.augment import DSAConfig, apply_dsa, augment_batch, sample_dsa_params
from fedvl.distill.client_sets import init_set, owned_ipc
from fedvl.distill.dp_gradient_matching import RealGradients, match_loss
from fedvl.distill.synthesize import class_gradient
from fedvl.distill.synthetic import SyntheticSet
from fedvl.distill.union import SERVER_TRAIN_STREAM, received_sets, synthetic_set_spec
from fedvl.models.base import FedModel
from fedvl.options import ConfigError, option
from fedvl.registry import register_algorithm
from fedvl.timing import SYNTHESIS, timed

# How the server combines the clients' radii (`utils/fl_utils.py` update_model_global_optim).
VOTES: dict[str, Callable[[Sequence[float]], float]] = {
    "min": min, "max": max, "avg": statistics.fmean, "median": statistics.median}
RADIUS_VOTES = ("auto", *VOTES, "constant")
SERVER_TRUST = ("stop", "project", "none")
# The smallest learning rate of the cosine schedule (`main.py`: max(..., 1e-6)).
MIN_LR = 1e-6
# Rows of one forward when a client measures its real loss (a cache-sized block on a CPU).
LOSS_ROWS = 256
KEPT = "kept"
# The settings where the official configs differ between the non-private and the DP run
# (settings-fed/fedlap/cifar10-fedlap.yaml, cifar10-fedlap-dp1.yaml: init real / random,
# reinit_image True / False, reg_type mse (weight 0.1) / None, eps_ball 10 / 1.5,
# truncate_voting min / constant, lr_net 0.1 / 0.002); an option left at auto (None) takes the
# value of its run's kind.
CODE_RULES: dict[bool, dict[str, Any]] = {
    False: {"init": "real", "carry_images": False, "mse_weight": 0.1, "radius": 10.0,
            "radius_vote": "min", "lr_net": 0.1},
    True: {"init": "noise", "carry_images": True, "mse_weight": 0.0, "radius": 1.5,
           "radius_vote": "constant", "lr_net": 0.002},
}


def cosine_lr(lr: float, rnd: int, rounds: int) -> float:
    """The learning rate of round `rnd` (0-based): lr * (1 + cos(pi rnd / (rounds - 1))) / 2,
    at least 1e-6, held at its last value past the schedule; `rounds` 0: constant lr."""
    if rounds <= 0:
        return lr
    m = min(rnd, rounds - 1)
    return max(lr * (1 + math.cos(math.pi * m / (rounds - 1))) / 2, MIN_LR)


def parameter_distance(params: Sequence[torch.Tensor], center: Sequence[torch.Tensor]
                       ) -> torch.Tensor:
    """||params - center||_2, all tensors as one vector (a 0-d tensor on their device)."""
    return torch.sqrt(sum(((p.detach() - c) ** 2).sum()
                          for p, c in zip(params, center, strict=True)))


def vote_radius(radii: Sequence[float], vote: str, cap: float) -> float:
    """The server's radius: `vote` (min, max, avg, median) over the clients' radii, each
    clipped to [0, cap]; `cap` itself for `constant` or when no radius came."""
    if vote == "constant" or not radii:
        return cap
    return VOTES[vote]([min(max(float(r), 0.0), cap) for r in radii])


@torch.no_grad()
def mean_loss(model: FedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `model` (eval mode) over (x, y), a 0-d tensor on the device."""
    was = model.training
    model.eval()
    total = x.new_zeros((), dtype=torch.float64)
    for i in range(0, len(y), LOSS_ROWS):
        total = total + F.cross_entropy(model(x[i : i + LOSS_ROWS]), y[i : i + LOSS_ROWS],
                                        reduction="sum").double()
    model.train(was)
    return total / max(len(y), 1)


def batch_dsa(size: int) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """A training augmentation with one DSA draw for the whole batch (the reference's seeded
    `DiffAugment`, which switches to batch mode)."""
    def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return apply_dsa(x, sample_dsa_params(1, generator, DSAConfig(), size))
    return augment


@register_algorithm("fedlapdp")
class FedLAPDP(TrainsOnUnion):
    """Synthetic loss approximations up, a server trained inside the trust region down."""

    trains_client_models = False  # the clients' and the server's SGD use `lr_net`

    payload_kinds = {"down": frozenset({"weights"}),
                     "up": frozenset({"synthetic_images", "synthetic_labels"})}

    smoke_args = {"steps": 2, "radius_epochs": 2, "server_epochs": 5}
    # The official non-private CIFAR-10 budgets (settings-fed/fedlap/cifar10-fedlap.yaml:
    # ipc 50, iteration 1, outer_loop 5, batch_loop 40, boost_loop 5, inner_loop 0, batch_size
    # 256, dsc_server_iter 100, lr_net cosine-decayed over epochs 200); its rules (eps_ball 10,
    # lr_net 0.1, ...) are what the auto options take without DP.
    paper_args = {"ipc": 50, "iterations": 1, "outer_loop": 5, "steps": 40, "image_steps": 5,
                  "inner_epochs": 0, "batch_real": 256, "radius_epochs": 100,
                  "server_epochs": 100, "cosine_rounds": 200}
    # `main.py` runs epochs 1 .. epochs - 1: 199 rounds for epochs 200.
    paper_run = {"rounds": 199}
    shared_synthetic = "fedlapdp_received"

    # Defaults: the official configs' losses and rules (an auto option takes the non-DP or the
    # DP config's value, as the run is), their budgets cut for a 2-core CPU; the help texts
    # give the code's values ("code: non-DP / DP config").
    @dataclass
    class Params:
        ipc: int = option(10, "synthetic images per class held (code: 50 / 10)", ge=1)
        init: str = option("auto", "auto: real without DP, noise with DP (the code's two "
                           "configs); real: ipc real images per class; noise: N(0, 1)",
                           choices=("auto", "real", "noise"))
        carry_images: bool | None = option(None, "continue from the set of the client's last "
                                           "round; empty: false without DP, true with DP "
                                           "(code: reinit_image true / false)")
        min_class_count: int = option(1, "a client synthesises classes with at least this "
                                      "many images (code: every class it holds)", ge=1)
        iterations: int = option(1, "restarts from w_m per round (code: 1 / 4, iteration)",
                                 ge=1)
        outer_loop: int = option(2, "segments per restart (code: 5)", ge=1)
        steps: int = option(5, "real targets per segment (code: 40 / 10, batch_loop)", ge=0)
        image_steps: int = option(2, "image updates per real target (code: 5, boost_loop)",
                                  ge=1)
        inner_epochs: int = option(0, "epochs w trains on the set between segments (code: "
                                   "0 / 2, inner_loop)", ge=0)
        batch_real: int = option(64, "expected real batch, Poisson rate batch_real / n_k "
                                 "(code: 256, batch_size)", ge=1)
        syn_batch: int = option(512, "synthetic images per matching step and per batch of "
                                "the client's training (code: 512, server_batch_size)", ge=1)
        lr_img: float = option(100.0, "image learning rate (code: 100)", gt=0)
        mse_weight: float | None = option(None, "weight of ||g_S - g_D||^2 beside the "
                                          "layer-wise cosine distance; empty: 0.1 without DP, "
                                          "0 with DP (code: reg_type mse, 0.1 / none)", ge=0)
        dsa: bool = option(True, "differentiable siamese augmentation (code: true, "
                           "color_crop_cutout_flip_scale_rotate)")
        radius: float | None = option(None, "trust-region radius: the clients' bound and "
                                      "cap, the server's under `constant`; empty: 10 without "
                                      "DP, 1.5 with DP (code: eps_ball)", gt=0)
        radius_vote: str = option("auto", "server radius from the clients' r_k: auto (min "
                                  "without DP, constant with DP: the code's configs), min, "
                                  "max, avg, median, constant (`radius`)",
                                  choices=RADIUS_VOTES)
        radius_epochs: int = option(10, "epochs a client trains a copy of w_m to find r_k "
                                    "(code: 100, dsc_server_iter)", ge=0)
        server_epochs: int = option(20, "most server epochs per round (code: 100, "
                                    "dsc_server_iter)", ge=0)
        server_trust: str = option("stop", "stop: after the first epoch ending outside the "
                                   "radius (code); project: projected into the ball after "
                                   "every step; none: no trust region (code: truncate false)",
                                   choices=SERVER_TRUST)
        server_batch_size: int = option(512, "server batch (code: 512)", ge=1)
        lr_net: float | None = option(None, "SGD learning rate of the server, the inner "
                                      "epochs and the radius search; empty: 0.1 without DP, "
                                      "0.002 with DP (code: lr_net; momentum and weight decay "
                                      "0)", gt=0)
        cosine_rounds: int = option(0, "cosine decay of lr_net over this many rounds; 0: "
                                    "constant (code: epochs, 200 / 30)", ge=0,
                                    check=lambda v: v == 0 or v >= 2,
                                    allowed="must be 0 (constant) or >= 2")
        dp_noise: float = option(0.0, "DP noise multiplier sigma of the real targets; 0 turns "
                                 "DP off (code: 1 in its DP config)", ge=0)
        dp_clip: float = option(1.0, "DP per-sample clipping norm C (code: 1.0, max_norm)",
                                gt=0)
        dp_delta: float = option(0.0, "DP delta; 0: 1/(10 n_k) (code: 1e-5)", ge=0, lt=1)

        def check(self) -> None:
            """Refuse DP settings whose reported epsilon would not cover what is sent."""
            if self.dp_noise <= 0:
                return
            if self.init == "real":
                raise ConfigError("fedlapdp option 'init' = 'real' is invalid with dp_noise > "
                                  "0: the released images would start as private ones; "
                                  "allowed: auto, noise")
            if self.radius_vote not in ("auto", "constant"):
                raise ConfigError(f"fedlapdp option 'radius_vote' = '{self.radius_vote}' is "
                                  "invalid with dp_noise > 0: a client's radius reads its "
                                  "records without noise; allowed: auto, constant")

    def __init__(self, env: Env, params: Any | None = None) -> None:
        super().__init__(env, params)
        if self.dp:
            check_dp_model(env.model_fn())

    @property
    def dp(self) -> bool:
        """Whether the DP variant runs."""
        return self.p.dp_noise > 0

    def rule(self, name: str) -> Any:
        """Option `name` as this run uses it: its value, or where it is auto (None, "auto")
        the official config's for a run with or without DP (`CODE_RULES`)."""
        value = getattr(self.p, name)
        return CODE_RULES[self.dp][name] if value is None or value == "auto" else value

    @property
    def start(self) -> str:
        """The initialisation this run uses (real or noise)."""
        return str(self.rule("init"))

    @property
    def vote(self) -> str:
        """The server's radius rule this run uses."""
        return str(self.rule("radius_vote"))

    @property
    def radius(self) -> float:
        """The trust-region radius this run uses (the cap of the clients' radii)."""
        return float(self.rule("radius"))

    @property
    def lr_net(self) -> float:
        """The model learning rate this run starts from."""
        return float(self.rule("lr_net"))

    def upload_exemption(self) -> str | None:
        """Why this setting's upload may copy private images (init real), or None."""
        if self.start != "real":
            return None
        return ("FedLAP-DP's non-private set starts each round from ipc real images per class "
                "and uploads it after the matching steps (docs/fedlapdp.md)")

    # -- server ------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        return {"model": clone_state(self.new_model().state_dict()), "last_x": None,
                "last_y": None, "radius": [], "server_epochs": [], "epsilon": {}, "delta": {}}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        msg = Message({"weights": state["model"]})
        return {c: msg for c in clients}

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        """One set `x` of float32 images with class indices `y`, at most `ipc` per class, and
        the client's radius when the server votes on them."""
        spec = synthetic_set_spec(super().reply_spec(sent, cid), tuple(self.env.image_shape),
                                  self.p.ipc * self.env.num_classes)
        if self.vote != "constant":
            spec.required_meta |= {"radius"}
        return spec

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        replies, x, y = received_sets(replies)
        if x is None or y is None:
            return state
        radius = vote_radius([r.meta["radius"] for r in replies.values()
                              if "radius" in r.meta], self.vote, self.radius)
        model = self.load_model(state["model"], ctx.device)
        epochs = self.server_train(model, x.to(ctx.device), y.to(ctx.device), radius,
                                   cosine_lr(self.lr_net, ctx.round, self.p.cosine_rounds),
                                   ctx.stream(SERVER_TRAIN_STREAM))
        return {**state, "model": clone_state(model.state_dict()), "last_x": x.cpu(),
                "last_y": y.cpu(), "radius": [*state.get("radius", []), radius],
                "server_epochs": [*state.get("server_epochs", []), epochs],
                **merge_privacy(state, replies, self.env.client_name, EPSILON_DELTA)}

    def server_train(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, radius: float,
                     lr: float, generator: torch.Generator) -> int:
        """Train `model` in place on the union (CE, plain SGD at `lr`, one DSA draw per batch)
        inside the trust region of `radius` around its start; returns the epochs run."""
        p = self.p
        start = [q.detach().clone() for q in model.parameters()]
        project = None
        if p.server_trust == "project":
            def project(m: FedModel, _lr: float) -> None:
                project_to_ball(list(m.parameters()), start, radius)
        cfg = TrainConfig(lr=lr, local_epochs=1, batch_size=p.server_batch_size)
        augment = batch_dsa(x.shape[-1]) if p.dsa else None
        # One epoch per call: the reference checks the distance after every epoch. Momentum
        # and weight decay are 0, as there, so a new optimiser per epoch changes nothing.
        for epoch in range(p.server_epochs):
            local_train(model, x, y, cfg, generator, after_step=project, augment=augment)
            if (p.server_trust == "stop"
                    and float(parameter_distance(list(model.parameters()), start)) >= radius):
                return epoch + 1
        return p.server_epochs

    def report(self, state: ServerState) -> dict[str, Any]:
        out: dict[str, Any] = {"fedlapdp": {"radius": list(state.get("radius", [])),
                                            "server_epochs": list(state.get("server_epochs",
                                                                            []))}}
        if self.dp:
            out["privacy"] = privacy_report(
                "fedlap-dp: per-sample clipped, noised real CE gradients as gradient-matching "
                "targets, Opacus RDP accountant", self.p.dp_noise, self.p.dp_clip, state,
                EPSILON_DELTA)
        return out

    # -- client ------------------------------------------------------------------------------
    def client_update(self, msg: Message, client: ClientContext) -> Message:
        p, k, g = self.p, client.num_classes, client.generator
        model = self.load_model(msg.get("weights"), client.device)
        lr = cosine_lr(self.lr_net, client.round, p.cosine_rounds)
        xr, yr = client.x, client.y
        if client.x_real is not None and client.y_real is not None:
            xr, yr = client.x_real, client.y_real
        per_class = owned_ipc(yr, k, p.ipc, p.min_class_count)
        # Only the classes it synthesises are read (under DP, only their records).
        keep = torch.tensor(per_class, device=yr.device)[yr] > 0
        xr, yr = xr[keep], yr[keep]
        syn = self.client_set(client, per_class, xr, yr)
        images = syn.images   # a leaf with grad
        real = RealGradients(xr, yr, p.batch_real,
                             noise_multiplier=p.dp_noise if self.dp else None, clip=p.dp_clip,
                             delta=delta_for(p.dp_delta, len(yr)))
        try:
            with timed(SYNTHESIS):
                targets = self.synthesise(model, images, syn.labels, real, lr, g)
        finally:
            real.close()
        x, y = images.detach(), syn.labels
        meta: dict[str, Any] = {"num_examples": client.num_train, "synthetic": len(y)}
        if self.vote != "constant":
            meta["radius"] = self.client_radius(model, x, y, xr, yr, lr, g)
        if self.rule("carry_images"):
            client.state.arrays["synthetic_images"] = {KEPT: x.cpu()}
            client.state.arrays["synthetic_labels"] = {KEPT: y.cpu()}
        if self.dp:
            # Every round draws new targets from the same records: epsilon composes all of
            # this client's targets so far.
            add_dp_steps(client.state, targets)
            meta.update(privacy_meta(client.state, real.privacy_spent))
        return Message({"synthetic_images": {"x": x}, "synthetic_labels": {"y": y}}, meta)

    def client_set(self, client: ClientContext, per_class: list[int], x: torch.Tensor,
                   y: torch.Tensor) -> SyntheticSet:
        """The set carried from the client's last round (`carry_images`), or a new one."""
        k = client.num_classes
        kept = client.state.arrays.get("synthetic_images", {}).get(KEPT)
        labels = client.state.arrays.get("synthetic_labels", {}).get(KEPT)
        if self.rule("carry_images") and kept is not None and labels is not None:
            counts = torch.bincount(labels, minlength=k).tolist()
            if counts == per_class:
                return SyntheticSet(kept.to(client.device), labels.to(client.device), k)
        # Drawn on the CPU generator: the same start on every device.
        syn = init_set(self.start, per_class, x.cpu(), y.cpu(), k, client.generator)
        return syn.to(client.device)

    def synthesise(self, model: FedModel, images: torch.Tensor, labels: torch.Tensor,
                   real: RealGradients, lr: float, generator: torch.Generator) -> int:
        """Optimise `images` in place on the trust-region trajectories from `model`; returns
        how many real targets it drew (each one DP step)."""
        p = self.p
        opt = torch.optim.SGD([images], lr=p.lr_img, momentum=IMAGE_MOMENTUM)
        center = [q.detach().clone() for q in model.parameters()]
        size = images.shape[-1]
        train_cfg = TrainConfig(lr=lr, local_epochs=p.inner_epochs, batch_size=p.syn_batch)
        mse_weight = float(self.rule("mse_weight"))
        radius = self.radius
        drawn = 0
        for _ in range(p.iterations):
            net = copy.deepcopy(model)
            params = [q for q in net.parameters() if q.requires_grad]
            for segment in range(p.outer_loop):
                # The reference checks before every segment; w moves only in the inner epochs.
                if (segment > 0 and p.inner_epochs > 0 and float(parameter_distance(
                        list(net.parameters()), center)) >= radius):
                    break
                for _ in range(p.steps):
                    dsa = sample_dsa_params(1, generator, DSAConfig(), size) if p.dsa else None
                    net.train()
                    target = real(net, generator, None if dsa is None
                                  else lambda xb, d=dsa: apply_dsa(xb, d))
                    drawn += 1
                    rows = None
                    if len(labels) > p.syn_batch:
                        rows = torch.randperm(len(labels), generator=generator,
                                              device=generator.device)[: p.syn_batch]
                        rows = rows.to(images.device)
                    ys = labels if rows is None else labels[rows]
                    net.eval()
                    for _ in range(p.image_steps):
                        xs = images if rows is None else images[rows]
                        if dsa is not None:
                            xs = apply_dsa(xs, dsa)
                        loss = match_loss(class_gradient(net, xs, ys, params), target,
                                          mse_weight)
                        (grad,) = torch.autograd.grad(loss, images)
                        images.grad = grad
                        opt.step()
                        images.grad = None
                if segment == p.outer_loop - 1 or p.inner_epochs == 0:
                    continue
                local_train(net, images.detach(), labels, train_cfg, generator,
                            augment=augment_batch if p.dsa else None)
        return drawn

    def client_radius(self, model: FedModel, x: torch.Tensor, y: torch.Tensor,
                      xr: torch.Tensor, yr: torch.Tensor, lr: float,
                      generator: torch.Generator) -> float:
        """r_k: ||w_e - w_m|| of a copy of `model` trained on the set (x, y), at the epoch e
        whose CE on the real data (xr, yr) is least, capped at `radius`."""
        p = self.p
        if p.radius_epochs == 0:
            return self.radius
        net = copy.deepcopy(model)
        center = [q.detach().clone() for q in model.parameters()]
        cfg = TrainConfig(lr=lr, local_epochs=1, batch_size=p.syn_batch)
        augment = batch_dsa(x.shape[-1]) if p.dsa else None
        dists, losses = [], []
        for _ in range(p.radius_epochs):
            local_train(net, x, y, cfg, generator, augment=augment)
            dists.append(parameter_distance(list(net.parameters()), center))
            losses.append(mean_loss(net, xr, yr))
        best = int(torch.stack(losses).argmin())   # one read, after the epochs
        return min(float(dists[best]), self.radius)

"""DFRD (Luo, Wang, Fu, Li, Lan & Gao, "DFRD: Data-Free Robustness Distillation for
Heterogeneous Federated Learning", NeurIPS 2023, arXiv 2309.13546): FedAvg whose server, after
averaging, trains a conditional generator against the ensemble of the received client models
(fidelity, transferability, diversity), keeps an exponential-moving-average (EMA) copy of it
against forgetting across rounds, weights the clients per class and draws labels from the
clients' label counts, and distils the ensemble into the global model on samples of the
generator and of its EMA copy. The homogeneous form: every client runs the global model (the
paper's sub-models of the global model are not built; docs/dfrd.md). Losses and budgets follow
the public code of the same group's follow-up DFDG (lkyddd/DFDG, `DFDG/manager.py`, whose
transferability strategy "1" is DFRD's); the DFRD code itself was not reachable.

Round t (f: the global model; f_k: client k's upload; c_k: its label counts):
  server -> clients: w_t.
  client k: FedAvg's local SGD from w_t (the run's optimiser); uploads w_k, n_k and c_k
            (`statistics`).
  server: w = sum_k p_k w_k (FedAvg). With this round's counts:
            tau[y, k] = c_k[y] / sum_j c_j[y]                    (dynamic weighting)
            p(y) proportional to sum_k c_k[y]                     (label sampling)
            E(x, y) = sum_k tau[y, k] f_k(x)                      (f_k in eval mode)
          For i = 1..server_iters:
            z ~ N(0, I), y ~ p(y) (`batch` each).
            G: a fresh Adam(lr_g, betas (0.5, 0.999)); gen_steps steps (G in train mode, f in
               eval mode, frozen) on, for x = G(z, y) and h = z * e(y) (e: G's label embedding),
                 CE(E(x, y), y)                                                  (fidelity)
               - tran_weight mean_{i in M} KL(softmax(f(x_i)/T) || softmax(E(x_i, y_i)/T))
                 M = {i: argmax E(x_i, y_i) = y_i, argmax f(x_i) != y_i}, f's side detached
                                                                          (transferability)
               + div_weight exp(-mean_ij mean_d (h_i - h_j)^2 mean_d (x_i - x_j)^2)
                                                                                (diversity)
            f: a fresh SGD(kd_lr, momentum 0.9, weight decay 1e-4); kd_steps steps (f in
               train mode) on KL(softmax(E(x, y)/T) || softmax(f(x)/T))
                                  + ema_weight KL(softmax(E(x~, y)/T) || softmax(f(x~)/T)),
               x = G(z, y), x~ = G~(z, y) (both in eval mode; the second term from round 1 on).
          G~ <- G after round 0, G~ <- ema_decay G~ + (1 - ema_decay) G after each later round.

Choices the sources leave open or fedvl makes (docs/dfrd.md): the generator is DENSE's
(`ImageGenerator`, pixels in [0, 1] mapped to the models' input by the benchmark's
normalisation) fed z times a learned label embedding (the DFDG code's `mul`); the EMA decay and
the EMA term's weight are not stated in what was read; the counts are this round's clients'
(the code reads every client's from the data split); an empty M gives 0 (the code's mean over no
rows is NaN).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.algorithms.base import Env, ServerContext, ServerState
from fedvl.algorithms.dense import (
    GENERATOR_BETAS,
    Ensemble,
    ImageGenerator,
    check_generated_shape,
    reset_generator,
    to_pixels8,
)
from fedvl.algorithms.fedgan import Normalise
from fedvl.algorithms.fedgen import (
    UploadsLabelCounts,
    diversity_loss,
    draw_labels,
    draw_noise,
    label_weights,
)
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.distill.losses import distillation_kl
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm
from fedvl.seeding import run_seed, seeded

# Server stream of a round's draws (noise, labels); run stream of the generator's init.
SERVER_STREAM = 173
INIT_STREAM = 179
# The global model's SGD in distillation: the DFDG code's SGD(momentum=0.9, weight_decay=1e-4).
KD_MOMENTUM = 0.9
KD_WEIGHT_DECAY = 1e-4
# Per-class client weights: by label counts (DFRD's dynamic weighting) or uniform 1/m; labels
# drawn in proportion to the counts (DFRD's label sampling) or uniformly over the held labels.
WEIGHTINGS = ("counts", "uniform")
LABEL_DRAWS = {"counts": "prior", "uniform": "uniform"}


class LabelledGenerator(nn.Module):
    """G(z, y): DENSE's image generator fed h = z * e(y), e a learned label embedding (the
    DFDG code's `mul` combination); returns the images (pixels in [0, 1]) and h."""

    def __init__(self, num_classes: int, noise_dim: int, ngf: int,
                 image_shape: Sequence[int]) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, noise_dim)
        self.body = ImageGenerator(noise_dim, ngf, image_shape)

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(images n x C x H x W, their generator input h = z * e(y))."""
        h = z * self.embedding(y)
        return self.body(h), h


def transferability_loss(ensemble: torch.Tensor, global_logits: torch.Tensor,
                         y: torch.Tensor, temperature: float) -> torch.Tensor:
    """-mean_{i in M} KL(softmax(g_i/T) || softmax(e_i/T)) over M = {i: argmax e_i = y_i and
    argmax g_i != y_i} (0 when M is empty); the global model's side g is detached."""
    mask = ((ensemble.argmax(1) == y) & (global_logits.argmax(1) != y)).to(ensemble.dtype)
    kl = distillation_kl(ensemble, global_logits.detach(), temperature, reduction="none")
    return -(kl * mask).sum() / mask.sum().clamp(min=1)


@dataclass
class GeneratorLoss:
    """The generator's loss at one step and its three parts."""

    total: torch.Tensor
    fidelity: torch.Tensor
    transfer: torch.Tensor
    diversity: torch.Tensor


def generator_loss(ensemble: torch.Tensor, global_logits: torch.Tensor | None,
                   y: torch.Tensor, h: torch.Tensor, x: torch.Tensor, temperature: float,
                   tran_weight: float, div_weight: float) -> GeneratorLoss:
    """CE(ensemble, y) + tran_weight L_tran + div_weight L_div (global_logits None: no
    L_tran; div_weight 0: no L_div); L_div on h and the flattened images x."""
    fid = F.cross_entropy(ensemble, y)
    zero = ensemble.new_zeros(())
    tran = (transferability_loss(ensemble, global_logits, y, temperature)
            if global_logits is not None else zero)
    div = diversity_loss(h, x.flatten(1), "l2") if div_weight > 0 else zero
    return GeneratorLoss(fid + tran_weight * tran + div_weight * div, fid, tran, div)


def ema_update(ema: Mapping[str, torch.Tensor] | None, current: Mapping[str, torch.Tensor],
               decay: float) -> dict[str, torch.Tensor]:
    """decay * ema + (1 - decay) * current for every floating entry; other entries (BatchNorm
    step counters) are current's; no ema yet: a copy of current."""
    if ema is None:
        return clone_state(current)
    return {n: (decay * ema[n] + (1 - decay) * t if t.is_floating_point() else t).clone()
            for n, t in current.items()}


def class_weights(counts: torch.Tensor, kind: str) -> torch.Tensor:
    """tau[y, k] (classes x clients) from counts (clients x classes): each client's share of
    the class (`counts`, DFRD's dynamic weighting), or 1/m (`uniform`)."""
    if kind == "uniform":
        return torch.full((counts.shape[1], counts.shape[0]), 1.0 / counts.shape[0],
                          device=counts.device)
    return label_weights(counts)


@register_algorithm("dfrd")
class Dfrd(UploadsLabelCounts):
    """FedAvg plus data-free distillation of the clients' weighted ensemble into the global
    model through a conditional generator and its EMA copy."""

    accepts_addons = False
    smoke_args = {"server_iters": 2, "gen_steps": 5, "batch": 32, "ngf": 16}

    # The DFDG code's defaults (param_config.py) unless said; `server_iters` and `ngf` cut for
    # a CPU (docs/dfrd.md).
    @dataclass
    class Params:
        server_iters: int = option(5, "server iterations per round (generator, then global "
                                   "model); the DFDG code's default 1, its one-shot run 800",
                                   ge=0)
        gen_steps: int = option(20, "generator Adam steps per iteration (code 20)", ge=1)
        kd_steps: int = option(2, "global-model SGD steps per iteration (code 2)", ge=1)
        batch: int = option(64, "noise vectors and labels per iteration (code 64)", ge=2)
        lr_g: float = option(2e-4, "generator Adam learning rate, betas (0.5, 0.999) (code "
                             "2e-4)", gt=0)
        kd_lr: float = option(0.01, "global-model SGD learning rate, momentum 0.9, weight decay "
                              "1e-4 (code 0.01)", gt=0)
        temperature: float = option(10.0, "distillation and transferability temperature T "
                                    "(code 10)", gt=0)
        noise_dim: int = option(100, "noise and label-embedding size (code 100)", ge=1,
                                le=65536)
        ngf: int = option(32, "generator width (DENSE's generator; its code 64)", ge=1,
                          le=4096)
        tran_weight: float = option(1.0, "weight of the transferability term (code 1)", ge=0)
        div_weight: float = option(1.0, "weight of the diversity term (code 1)", ge=0)
        ema_decay: float = option(0.5, "EMA decay of the generator's copy, once per round "
                                  "(not stated)", ge=0, le=1)
        ema_weight: float = option(1.0, "weight of the distillation term on the EMA copy's "
                                   "samples; 0: off (not stated)", ge=0)
        weighting: str = option("counts", "per-class client weights in the ensemble: counts "
                                "(dynamic weighting) or uniform", choices=WEIGHTINGS)
        label_sampling: str = option("counts", "labels of the generator's batches: counts "
                                     "(label sampling) or uniform over the held labels",
                                     choices=WEIGHTINGS)

    def __init__(self, env: Env, params: Any | None = None) -> None:
        super().__init__(env, params)
        check_generated_shape("dfrd", env.image_shape)

    # -- the generator ---------------------------------------------------------------------------
    def new_generator(self, device: torch.device | None = None) -> LabelledGenerator:
        """A generator initialised as DENSE's code does (conv/linear N(0, 0.02), BN gamma
        N(1, 0.02); the embedding N(0, 1)) from the run seed."""
        with seeded(run_seed(self.env.seed, INIT_STREAM)):
            gen = LabelledGenerator(self.env.num_classes, self.p.noise_dim, self.p.ngf,
                                    self.env.image_shape)
            reset_generator(gen)
        return gen.to(device if device is not None else self.env.device)

    def load_generator(self, weights: Mapping[str, torch.Tensor],
                       device: torch.device) -> LabelledGenerator:
        """A generator carrying `weights`."""
        gen = self.new_generator(device)
        gen.load_state_dict(weights)
        return gen

    # -- server ----------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        return {**super().server_init(),
                "generator": clone_state(self.new_generator().state_dict()),
                "ema": None, "samples": None, "labels": None, "log": None}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        state = super().aggregate(state, ctx, replies)
        counts = self.received_counts(replies)
        p, device = self.p, ctx.device
        if p.server_iters == 0 or not bool((counts.sum(0) > 0).any()):
            return {**state, "log": None}   # no label to distil: FedAvg's round
        teacher = Ensemble([self.load_model(r.get("weights"), device).eval()
                            .requires_grad_(False) for r in replies.values()]).eval()
        tau = class_weights(counts, p.weighting).to(device)
        held = counts.sum(0)
        gen = self.load_generator(state["generator"], device)
        ema = self.load_generator(state["ema"], device) if state["ema"] is not None else None
        student = self.load_model(state["model"], device)
        to_input = Normalise(self.env.image_mean, self.env.image_std, device)
        rng = ctx.stream(SERVER_STREAM)
        parts = torch.zeros(4, device=device)
        kd = torch.zeros((), device=device)
        x = y = None
        for _ in range(p.server_iters):
            z = draw_noise(p.batch, p.noise_dim, "normal", rng, device)
            y = draw_labels(held, p.batch, LABEL_DRAWS[p.label_sampling], rng, device)
            w = tau[y].t()
            parts += self.train_generator(gen, teacher, student, to_input, z, y, w)
            sources = [(gen, 1.0)] + ([(ema, p.ema_weight)] if ema is not None
                                      and p.ema_weight > 0 else [])
            x, step_kd = self.distil(student, teacher, sources, to_input, z, y, w)
            kd += step_kd
        assert x is not None and y is not None
        gen_state = clone_state(gen.state_dict())
        parts, kd = parts.cpu() / p.server_iters, float(kd) / p.server_iters
        return {**state, "model": clone_state(student.state_dict()), "generator": gen_state,
                "ema": ema_update(state["ema"], gen_state, p.ema_decay),
                "samples": to_pixels8(x).cpu(), "labels": y.cpu(),
                "log": {"generator_loss": float(parts[0]), "fidelity": float(parts[1]),
                        "transferability": float(parts[2]), "diversity": float(parts[3]),
                        "kd_loss": kd, "ema_samples": ema is not None and p.ema_weight > 0,
                        "teachers": len(replies)}}

    def train_generator(self, gen: LabelledGenerator, teacher: Ensemble, student: FedModel,
                        to_input: nn.Module, z: torch.Tensor, y: torch.Tensor,
                        w: torch.Tensor) -> torch.Tensor:
        """`gen_steps` Adam steps on the generator; the mean (total, fidelity,
        transferability, diversity) of its steps, on the device."""
        p = self.p
        opt = torch.optim.Adam(gen.parameters(), lr=p.lr_g, betas=GENERATOR_BETAS)
        gen.train()
        student.eval().requires_grad_(False)
        total = torch.zeros(4, device=z.device)
        for _ in range(p.gen_steps):
            x, h = gen(z, y)
            view = to_input(x)
            s_out = student(view) if p.tran_weight > 0 else None
            loss = generator_loss(teacher(view, w), s_out, y, h, x, p.temperature,
                                  p.tran_weight, p.div_weight)
            opt.zero_grad(set_to_none=True)
            loss.total.backward()
            opt.step()
            total += torch.stack([loss.total, loss.fidelity, loss.transfer,
                                  loss.diversity]).detach()
        student.requires_grad_(True)
        return total / p.gen_steps

    def distil(self, student: FedModel, teacher: Ensemble,
               sources: Sequence[tuple[LabelledGenerator, float]], to_input: nn.Module,
               z: torch.Tensor, y: torch.Tensor, w: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`kd_steps` SGD steps of the global model on the weighted KL to the ensemble on each
        source's images G(z, y); (the first source's images, the mean loss) on the device."""
        p = self.p
        batches = []
        with torch.no_grad():
            for gen, weight in sources:
                gen.eval()
                x = gen(z, y)[0]
                view = to_input(x)
                batches.append((x, view, teacher(view, w), weight))
        opt = torch.optim.SGD(student.parameters(), lr=p.kd_lr, momentum=KD_MOMENTUM,
                              weight_decay=KD_WEIGHT_DECAY)
        student.train()
        total = torch.zeros((), device=z.device)
        for _ in range(p.kd_steps):
            loss = sum(weight * distillation_kl(student(view), t_out, p.temperature)
                       for _, view, t_out, weight in batches)
            assert isinstance(loss, torch.Tensor)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach()
        return batches[0][0], total / p.kd_steps

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if state.get("samples") is None:
            return {}
        to_input = Normalise(self.env.image_mean, self.env.image_std, torch.device("cpu"))
        return {"dfrd_generated": (to_input(state["samples"].float() / 255), state["labels"])}

    def report(self, state: ServerState) -> dict[str, Any]:
        return {"dfrd": state.get("log")}

"""Co-Boosting (Dai, Zhang, Li, Liu, Yang & Han, "Enhancing One-Shot Federated Learning Through
Data and Ensemble Co-Boosting", ICLR 2024, arXiv 2402.15070): clients upload their locally
trained models once; the server alternates between synthesising hard samples from the weighted
ensemble of those models and re-weighting the ensemble on them, and distils the weighted
ensemble into the global model on the synthesised, perturbed samples. Losses, weights and
budgets follow the official code (rong-dai/Co-Boosting: `datafree/synthesis/coboost.py`,
`datafree_kd.py`, `utils_fl.py`, `co_boosting.sh`); the client side and the generator are
DENSE's (`fedvl.algorithms.dense`), whose code Co-Boosting's builds on.

One round (the paper runs exactly one):
  client k: trains its own model f_k (its architecture, `--client-models`) with CE on its data
            (the run's optimiser and local epochs); uploads its weights. Nothing comes down.
  server:   ensemble weights w_k = 1/m; D_w(x) = sum_k w_k f_k(x) / sum_k w_k (f_k in eval
            mode); student f_S = the global model; SGD(student_lr, momentum 0.9, weight decay
            student_weight_decay) with a cosine schedule over the round's epochs.
            For e = 0..server_epochs-1:
              hard samples: a freshly initialised generator G, z ~ N(0, I) and labels
                y ~ U{0..C-1} (syn_batch of each); g_steps Adam(lr_g, betas (0.5, 0.999)) steps
                on G and z, G's gradient clipped to norm 10, minimising for x = G(z)
                  bn_weight (1/m) sum_l (||var_l(x) - rvar_l||_2 + ||mean_l(x) - rmean_l||_2)
                + oh_weight mean_i (1 - p_i)^hard_power CE(D_w(x_i), y_i)
                - adv_weight T_a^2 mean_i KL(softmax(D_w(x_i)/T_a) || softmax(f_S(x_i)/T_a))
                (p_i = softmax(D_w(x_i))[y_i], no gradient; f_S in eval mode; T_a =
                adv_temperature); the G(z) of the lowest loss and its y join the pool (8-bit).
              ensemble re-weighting (e >= 1, on the pool before this batch joins it):
                weight_passes shuffled passes of kd_batch images (augmented as in
                distillation); each batch one signed-gradient step
                  w <- w - weight_lr weight_lr_decay^e sign(grad_w CE(D_w(x), y)),
                  w <- clip(w0 + clip(w - w0, -1, 1), 0, 1)      (w0: w before the passes).
              distillation: one shuffled pass over the pool (kd_batch; crop + flip); each
                batch x perturbed once, x <- x + ods_eps sign(grad_x sum_ij r_ij
                softmax(D_w(x)/4)_ij), r ~ U(-1, 1) per sample and class (output-diversified
                sampling, in the models' input space); a step on
                T^2 KL(softmax(D_w(x)/T) || softmax(f_S(x)/T)), gradient clipped to norm 10.
              the student's learning rate follows the cosine schedule to the next epoch.

Choices the code leaves open or fedvl makes (docs/coboosting.md): the generator draws pixels
in [0, 1] and the benchmark's normalisation maps them to the models' input (the code
normalises with mean = std = 0.5 for every data set); the perturbation's size is in that
input space, as in the code; the last student is the global model (the code keeps the epoch
of best test accuracy); with rounds > 1 every round is another one-shot round (DENSE's):
fresh weights 1/m, a new pool and a new schedule, distilled into the current global model.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fedvl.algorithms.base import ServerContext, ServerState
from fedvl.algorithms.dense import (
    GENERATOR_BETAS,
    KD_AUGMENTS,
    STUDENT_MOMENTUM,
    BatchNormPrior,
    Dense,
    Ensemble,
    GeneratorLoss,
    ImageGenerator,
    kd_loss,
    keep_lowest,
    to_pixels8,
)
from fedvl.algorithms.fedgen import draw_noise
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.distill.losses import distillation_kl
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm
from fedvl.seeding import derive_seed

# Server stream of a round's draws (noise, labels, pool order, augmentations, perturbation
# directions); stream of each epoch's generator (with run seed, round and epoch).
SERVER_STREAM = 191
GENERATOR_STREAM = 193
# The code clips the generator's and the student's gradients to this norm
# (`coboost.py` l.123, `datafree_kd.py` l.334).
MAX_GRAD_NORM = 10.0
# The temperature of the perturbation's objective, a literal 4 in the code
# (`datafree_kd.py` l.314).
ODS_TEMPERATURE = 4.0
# How far a re-weighting may move a weight from where it started (the code's clamp of eta,
# `coboost.py` l.152); with weights in [0, 1] it never binds.
WEIGHT_RADIUS = 1.0


def hard_sample_ce(logits: torch.Tensor, y: torch.Tensor, power: float) -> torch.Tensor:
    """mean_i (1 - p_i)^power CE(logits_i, y_i), p_i the softmax probability of label y_i
    (no gradient through the factor): the code's `loss_oh`, which weighs up the samples the
    ensemble is least sure of."""
    ce = F.cross_entropy(logits, y, reduction="none")
    p = F.softmax(logits.detach(), dim=1).gather(1, y.unsqueeze(1)).squeeze(1)
    return ((1 - p).pow(power) * ce).mean()


def adversarial_loss(student: torch.Tensor, teacher: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """-T^2 mean_i KL(softmax(t_i/T) || softmax(s_i/T)) over every sample (the code's term
    has no agreement mask, unlike DENSE's)."""
    kl = distillation_kl(student, teacher, temperature, reduction="none")
    return -(temperature ** 2) * kl.mean()


def generator_loss(teacher: torch.Tensor, student: torch.Tensor | None, y: torch.Tensor,
                   bn: torch.Tensor, bn_weight: float, oh_weight: float, adv_weight: float,
                   hard_power: float, adv_temperature: float) -> GeneratorLoss:
    """bn_weight L_BN + oh_weight L_hard + adv_weight L_adv (student None: no L_adv); `bn`
    is already divided by the number of client models."""
    oh = hard_sample_ce(teacher, y, hard_power)
    adv = (adversarial_loss(student, teacher, adv_temperature) if student is not None
           else teacher.new_zeros(()))
    bn = bn.to(teacher.device)
    return GeneratorLoss(bn_weight * bn + oh_weight * oh + adv_weight * adv, bn, oh, adv)


def mixing_weights(w: torch.Tensor, n: int) -> torch.Tensor:
    """w / sum(w) for each of n samples (members x n), as `Ensemble` takes them: the code's
    `WEnsemble`, sum_k w_k f_k(x) / sum_k w_k."""
    return (w / w.sum()).unsqueeze(1).expand(-1, n)


def weight_step(teacher: Ensemble, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                start: torch.Tensor, step: float) -> torch.Tensor:
    """One step of the ensemble weights on a labelled batch: w - step sign(grad_w
    CE(D_w(x), y)), kept within WEIGHT_RADIUS of `start` and in [0, 1] (the code's update)."""
    w = w.detach().requires_grad_(True)
    loss = F.cross_entropy(teacher(x, mixing_weights(w, len(x))), y)
    (grad,) = torch.autograd.grad(loss, w)
    moved = w.detach() - step * grad.sign()
    return (start + (moved - start).clamp(-WEIGHT_RADIUS, WEIGHT_RADIUS)).clamp(0, 1)


def ods_perturb(teacher: Ensemble, weights: torch.Tensor, x: torch.Tensor, eps: float,
                r: torch.Tensor) -> torch.Tensor:
    """x + eps sign(grad_x sum_ij r_ij softmax(D(x)/ODS_TEMPERATURE)_ij): one output-
    diversified step along random output weights `r` (samples x classes)."""
    x = x.detach().requires_grad_(True)
    out = F.softmax(teacher(x, weights) / ODS_TEMPERATURE, dim=1)
    (grad,) = torch.autograd.grad((r * out).sum(), x)
    return (x + eps * grad.sign()).detach()


@register_algorithm("coboosting")
class Coboosting(Dense):
    """One-shot upload of local models; hard samples, ensemble re-weighting and distillation
    of the weighted ensemble on the server."""

    # The code's client models (`cnn`) have no BatchNorm and its BN term is off (`--bn 0`).
    model_defaults: ClassVar[dict[str, Any]] = {}
    smoke_args = {"server_epochs": 2, "g_steps": 5, "syn_batch": 64, "kd_batch": 64,
                  "noise_dim": 64, "ngf": 16}
    smoke_run = {"rounds": 1}
    # `co_boosting.sh` (--epochs 200, the rest as the defaults below) after local training of
    # 100 epochs in batches of 128 (`fl_pretrain.sh`, `fl_pretrain.py` --local_bs); one round.
    paper_args = {"server_epochs": 200}
    paper_run = {"rounds": 1, "local_epochs": 100, "batch_size": 128}

    # `co_boosting.sh` and the code's defaults (`datafree_kd.py`), except `server_epochs`: 10
    # instead of 200, for a CPU (`--preset paper` runs 200).
    @dataclass
    class Params:
        server_epochs: int = option(10, "synthesis + re-weighting + distillation epochs per "
                                    "round (code 200)", ge=1)
        g_steps: int = option(30, "generator Adam steps per epoch (code 30)", ge=1)
        syn_batch: int = option(128, "images synthesised per epoch (code 128)", ge=2)
        kd_batch: int = option(128, "pool images per re-weighting and distillation step "
                               "(code 128)", ge=1)
        lr_g: float = option(1e-3, "Adam learning rate of the generator and its noise "
                             "(code 1e-3)", gt=0)
        noise_dim: int = option(256, "generator noise size (code 256)", ge=1, le=65536)
        ngf: int = option(64, "generator width (code 64)", ge=1, le=4096)
        bn_weight: float = option(0.0, "weight of the teachers' BatchNorm-statistics loss "
                                  "(code 0: off)", ge=0)
        oh_weight: float = option(1.0, "weight of the hard-sample CE toward the sampled "
                                  "labels (code 1)", ge=0)
        adv_weight: float = option(1.0, "weight of the adversarial student-ensemble "
                                   "divergence (code 1)", ge=0)
        hard_power: float = option(1.0, "exponent of the hard-sample factor (1 - p)^power; "
                                   "0: plain CE (code 1)", ge=0)
        adv_temperature: float = option(3.0, "temperature of the adversarial term (code 3)",
                                        gt=0)
        temperature: float = option(4.0, "distillation temperature T (code 4)", gt=0)
        student_lr: float = option(0.01, "student SGD learning rate, momentum 0.9, cosine "
                                   "schedule (code 0.01)", gt=0)
        student_weight_decay: float = option(1e-4, "student SGD weight decay (code 1e-4)",
                                             ge=0)
        weight_lr: float = option(0.01, "step of the ensemble weights' signed-gradient "
                                  "update; 0: the plain mean (code 0.01)", ge=0)
        weight_lr_decay: float = option(0.99, "the step's decay per epoch (code 0.99)", gt=0,
                                        le=1)
        weight_passes: int = option(1, "passes over the pool per re-weighting (code 1)",
                                    ge=1)
        ods_eps: float = option(8 / 255, "size of the perturbation of the distillation "
                                "images in the models' input space; 0: off (code 8/255)",
                                ge=0)
        kd_augment: str = option("crop-flip", "pool augmentation in re-weighting and "
                                 "distillation: crop-flip (the code on CIFAR), flip or none "
                                 "(the code on MNIST, SVHN)", choices=KD_AUGMENTS)

    # -- server ----------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        return {"model": clone_state(self.new_model().state_dict()), "samples": None,
                "labels": None, "log": None}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        p, device = self.p, ctx.device
        members, prior = self.load_teachers(replies, device)
        teacher = Ensemble(members).eval()
        w = torch.full((len(members),), 1.0 / len(members), device=device)
        student = self.load_model(state["model"], device)
        opt = torch.optim.SGD(student.parameters(), lr=p.student_lr, momentum=STUDENT_MOMENTUM,
                              weight_decay=p.student_weight_decay)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=p.server_epochs)
        rng = ctx.stream(SERVER_STREAM)
        pool: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        best = kd = torch.zeros((), device=device)
        for epoch in range(p.server_epochs):
            gen = self.new_generator(derive_seed(ctx.seed, ctx.round, GENERATOR_STREAM, epoch),
                                     device)
            x8, y, best = self.synthesize_hard(gen, teacher, w, student, prior, rng, device)
            if epoch > 0 and p.weight_lr > 0:
                w = self.reweight(teacher, w, torch.cat(pool), torch.cat(labels),
                                  p.weight_lr * p.weight_lr_decay ** epoch, rng)
            pool.append(x8)
            labels.append(y)
            kd = self.distil_perturbed(student, teacher, w, torch.cat(pool), opt, rng)
            schedule.step()
        return {"model": clone_state(student.state_dict()), "samples": pool[-1].cpu(),
                "labels": labels[-1].cpu(),
                "log": {"generator_loss": float(best), "kd_loss": float(kd),
                        "pool_images": sum(len(b) for b in pool), "teachers": len(members),
                        "ensemble_weights": {str(c): float(v)
                                             for c, v in zip(replies, w.cpu(), strict=True)},
                        "bn_layers": len(prior.layers)}}

    def synthesize_hard(self, gen: ImageGenerator, teacher: Ensemble, w: torch.Tensor,
                        student: FedModel, prior: BatchNormPrior, rng: torch.Generator,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`g_steps` Adam steps on the generator and its noise against the weighted ensemble;
        the batch of the lowest loss (8-bit pixels), its labels and that loss (on the device,
        no host sync)."""
        p = self.p
        z = draw_noise(p.syn_batch, p.noise_dim, "normal", rng, device).requires_grad_(True)
        y = torch.randint(self.env.num_classes, (p.syn_batch,), generator=rng,
                          device=rng.device).to(device)
        opt = torch.optim.Adam([{"params": gen.parameters()}, {"params": [z]}], lr=p.lr_g,
                               betas=GENERATOR_BETAS)
        weights = mixing_weights(w, p.syn_batch)
        use_bn = p.bn_weight > 0 and bool(prior.layers)
        zero = torch.zeros((), device=device)
        gen.train()
        # The code synthesises with the student in eval mode; only the images get gradients.
        student.eval().requires_grad_(False)
        best = torch.full((), math.inf, device=device)
        best_x: torch.Tensor | None = None
        with prior.hooked() if use_bn else nullcontext():
            for _ in range(p.g_steps):
                x = gen(z)
                view = self.to_input(x)
                prior.terms.clear()
                t_out = teacher(view, weights)
                s_out = student(view) if p.adv_weight > 0 else None
                bn = prior.loss() / len(teacher.members) if use_bn else zero
                loss = generator_loss(t_out, s_out, y, bn, p.bn_weight, p.oh_weight,
                                      p.adv_weight, p.hard_power, p.adv_temperature).total
                best, best_x = keep_lowest(best, best_x, loss.detach(), x.detach())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(gen.parameters(), MAX_GRAD_NORM)
                opt.step()
        student.train().requires_grad_(True)
        assert best_x is not None
        return to_pixels8(best_x), y, best

    def reweight(self, teacher: Ensemble, w: torch.Tensor, pool: torch.Tensor,
                 labels: torch.Tensor, step: float, rng: torch.Generator) -> torch.Tensor:
        """`weight_passes` shuffled passes over the labelled pool, one `weight_step` a batch;
        the new ensemble weights."""
        start = w.detach().clone()
        for _ in range(self.p.weight_passes):
            for idx, x in self.pool_batches(pool, self.p.kd_batch, rng):
                w = weight_step(teacher, x, labels[idx.to(labels.device)], w, start, step)
        return w

    def distil_perturbed(self, student: FedModel, teacher: Ensemble, w: torch.Tensor,
                         pool: torch.Tensor, opt: torch.optim.Optimizer,
                         rng: torch.Generator) -> torch.Tensor:
        """One shuffled pass of T^2 KL distillation from the weighted ensemble over the pool,
        each batch perturbed first (`ods_eps`); the mean loss, on the device."""
        p = self.p
        student.train()
        total = torch.zeros((), device=w.device)
        steps = 0
        for _, x in self.pool_batches(pool, p.kd_batch, rng):
            weights = mixing_weights(w, len(x))
            if p.ods_eps > 0:
                r = torch.rand(len(x), self.env.num_classes, generator=rng, device=rng.device)
                x = ods_perturb(teacher, weights, x, p.ods_eps, (2 * r - 1).to(x.device))
            with torch.no_grad():
                t_out = teacher(x, weights)
            loss = kd_loss(student(x), t_out, p.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), MAX_GRAD_NORM)
            opt.step()
            total += loss.detach()
            steps += 1
        return total / max(steps, 1)

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if state.get("samples") is None:
            return {}
        return {"coboosting_generated": (self.to_input(state["samples"].float() / 255),
                                         state["labels"])}

    def report(self, state: ServerState) -> dict[str, Any]:
        return {"coboosting": state.get("log")}

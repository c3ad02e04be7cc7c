"""DENSE (Zhang et al., "DENSE: Data-Free One-Shot Federated Learning", NeurIPS 2022): clients
upload their locally trained models once; the server distils the ensemble of those models into
the global model on images of a data-free generator. Losses follow the official code
(zj-jayzhang/DENSE: `loop_df_fl.py`, `helpers/synthesizers.py`, `helpers/utils.py`,
`models/generator.py`); the weights and budgets are those of its README's distillation command.

One round (the paper runs exactly one):
  client k: trains its own model f_k (its architecture, `--client-models`) with CE on its data
            (the run's optimiser and local epochs); uploads its weights. Nothing comes down.
  server:   teacher D(x) = (1/m) sum_k f_k(x) (eval mode); student f_S = the global model.
            For e = 1..server_epochs:
              synthesis: a freshly initialised generator G (conv/linear N(0, 0.02), BN gamma
                N(1, 0.02)), z ~ N(0, I) and labels y ~ U{0..C-1} (syn_batch of each); g_steps
                Adam(lr_g, betas (0.5, 0.999)) steps on G and z minimising, for x = crop(pad 4)
                + flip of G(z),
                  bn_weight sum_l (||var_l(x) - rvar_l||_2 + ||mean_l(x) - rmean_l||_2)
                + oh_weight CE(D(x), y)
                - adv_weight mean_i 1[argmax f_S(x_i) != argmax D(x_i)] KL(D(x_i) || f_S(x_i))
                (l: every BatchNorm layer of every client model, statistics of the layer's input
                against its running ones; KL of the softmaxes); the G(z) of the lowest loss joins
                the pool, as 8-bit pixels.
              distillation: one shuffled pass over the pool (kd_batch; flip), SGD(student_lr,
                momentum 0.9) on T^2 KL(softmax(D/T) || softmax(f_S/T)).

Choices the paper leaves open or fedvl makes (docs/dense.md): the generator draws pixels in
[0, 1] and the benchmark's normalisation maps them to the models' input (the code trains on
[0, 1] images); with no BatchNorm layer in any client model (instance norm, AlexNet) the
BN-statistics term is 0, as in the code, and the server says so once; the last student is the
global model (the code keeps the epoch of best test accuracy); with rounds > 1 every round is
another one-shot round: clients go on training their own models and upload them again, and the
server distils again from the current global model with a new pool.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.algorithms.base import Algorithm, ClientContext, Env, ServerContext, ServerState
from fedvl.algorithms.fedgen import draw_noise
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.core.training import batch_indices, local_train
from fedvl.distill.augment import DSAConfig, augment_batch
from fedvl.distill.losses import distillation_kl
from fedvl.distill.multiset import batch_stats
from fedvl.models.base import FedModel
from fedvl.options import ConfigError, option
from fedvl.registry import register_algorithm
from fedvl.seeding import derive_seed, run_seed, seeded

log = logging.getLogger(__name__)

# Server stream of the round's draws (noise, labels, augmentations, pool order); run stream of a
# generator kept across epochs (`reset_generator=false`).
SERVER_STREAM = 131
GENERATOR_STREAM = 132
# The code pads by 4 pixels before its random crop (kornia RandomCrop(padding=4)).
CROP_PAD = 4
# Pool augmentation in distillation: the code flips MNIST/SVHN pool images and crops (pad 4) and
# flips CIFAR ones.
KD_AUGMENTS = ("flip", "crop-flip", "none")
# Student optimiser momentum (the code's SGD(momentum=0.9)).
STUDENT_MOMENTUM = 0.9
# Generator Adam betas (the code's).
GENERATOR_BETAS = (0.5, 0.999)


class ImageGenerator(nn.Module):
    """DENSE's (DAFL's) generator: z -> Linear -> BN -> x2 -> conv-BN-LeakyReLU -> x2 ->
    conv-BN-LeakyReLU -> conv -> sigmoid, images of `image_shape` with pixels in [0, 1]."""

    def __init__(self, noise_dim: int, ngf: int, image_shape: Sequence[int]) -> None:
        super().__init__()
        c, h, w = (int(v) for v in image_shape)
        self.init_size = (h // 4, w // 4)
        self.l1 = nn.Linear(noise_dim, ngf * 2 * self.init_size[0] * self.init_size[1])
        self.conv_blocks = nn.Sequential(
            nn.BatchNorm2d(ngf * 2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(ngf * 2, ngf * 2, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(ngf * 2, ngf, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ngf, c, 3, stride=1, padding=1),
            nn.Sigmoid(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Images (n x C x H x W, in [0, 1]) for noise `z` (n x noise_dim)."""
        out = self.l1(z).view(z.shape[0], -1, *self.init_size)
        return self.conv_blocks(out)


def check_generated_shape(method: str, image_shape: Sequence[int]) -> None:
    """Refuse images `ImageGenerator` cannot make: its two x2 upsamplings need a height and a
    width that are multiples of 4."""
    _, h, w = image_shape
    if h % 4 or w % 4:
        raise ConfigError(f"method '{method}' generates images with two x2 upsamplings, so "
                          f"their height and width must be multiples of 4; the benchmark's "
                          f"images are {h}x{w}")


def reset_generator(gen: nn.Module) -> None:
    """The code's `reset_model`: conv/linear weights N(0, 0.02), biases 0, BN gamma N(1, 0.02),
    beta 0 (draws from torch's global RNG: call it under `seeded`)."""
    for m in gen.modules():
        if isinstance(m, nn.ConvTranspose2d | nn.Linear | nn.Conv2d):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        if isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.constant_(m.bias, 0)


class Ensemble(nn.Module):
    """The teacher D(x): the plain mean of the client models' logits, or a weighted sum with
    one weight per member and sample (DFRD's per-class weights of the clients)."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(models)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Mean logits of the members on `x`; with `weights` (members x samples),
        sum_k weights[k, i] f_k(x_i)."""
        logits = torch.stack([m(x) for m in self.members])
        if weights is None:
            return logits.mean(0)
        return (weights.to(logits.dtype).unsqueeze(2) * logits).sum(0)


def bn_statistics_loss(bn: nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
    """One layer's term of the code's `DeepInversionHook`: ||running_var - var(x)||_2 +
    ||running_mean - mean(x)||_2, per-channel batch statistics of the layer's input `x` (biased
    variance over batch and pixels)."""
    assert bn.running_mean is not None and bn.running_var is not None
    mean, var, _ = batch_stats(x)
    return torch.norm(bn.running_var - var, 2) + torch.norm(bn.running_mean - mean, 2)


class BatchNormPrior:
    """Forward hooks on every BatchNorm2d (with running statistics) of `models`: after a forward
    pass, `loss()` is the sum of each layer's `bn_statistics_loss` on what it was given."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.layers = [m for model in models for m in model.modules()
                       if isinstance(m, nn.BatchNorm2d) and m.running_mean is not None
                       and m.running_var is not None]
        self.terms: dict[int, torch.Tensor] = {}

    @contextmanager
    def hooked(self) -> Iterator[BatchNormPrior]:
        """Hooks installed for the block, removed after it."""
        def hook(i: int) -> Any:
            def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], _: Any) -> None:
                self.terms[i] = bn_statistics_loss(module, inputs[0])  # type: ignore[arg-type]
            return record

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.layers)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def loss(self) -> torch.Tensor:
        """Sum over layers of the last forward pass's terms (0 without BatchNorm layers)."""
        if not self.terms:
            return torch.zeros((), device="cpu")
        out = sum(self.terms.values())
        assert isinstance(out, torch.Tensor)
        return out


def adversarial_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """-(1/B) sum_i 1[argmax s_i != argmax t_i] KL(softmax t_i || softmax s_i): negative where
    student and ensemble disagree (the code's decision-adversarial term; T = 1)."""
    mask = (student.argmax(1) != teacher.argmax(1)).to(student.dtype)
    return -(distillation_kl(student, teacher, reduction="none") * mask).mean()


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """The code's `KLDiv`: T^2 KL(softmax(teacher / T) || softmax(student / T)), batch mean."""
    return temperature ** 2 * distillation_kl(student, teacher, temperature)


@dataclass
class GeneratorLoss:
    """The generator's loss at one step and its three parts."""

    total: torch.Tensor
    bn: torch.Tensor
    oh: torch.Tensor
    adv: torch.Tensor


def generator_loss(teacher: torch.Tensor, student: torch.Tensor | None, y: torch.Tensor,
                   bn: torch.Tensor, bn_weight: float, oh_weight: float,
                   adv_weight: float) -> GeneratorLoss:
    """bn_weight L_BN + oh_weight CE(teacher, y) + adv_weight L_adv (student None: no L_adv)."""
    oh = F.cross_entropy(teacher, y)
    adv = adversarial_loss(student, teacher) if student is not None else teacher.new_zeros(())
    bn = bn.to(teacher.device)
    return GeneratorLoss(bn_weight * bn + oh_weight * oh + adv_weight * adv, bn, oh, adv)


def keep_lowest(best: torch.Tensor, best_x: torch.Tensor | None, value: torch.Tensor,
                x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower of (best, best_x) and (value, x), chosen on the device (no host read); the
    earlier one on a tie."""
    better = value < best
    return torch.where(better, value, best), x if best_x is None else torch.where(better, x,
                                                                                  best_x)


def to_pixels8(x: torch.Tensor) -> torch.Tensor:
    """Images in [0, 1] as the code's pool keeps them: PNG bytes, floor(255 x)."""
    return (x.detach().clamp(0, 1) * 255).to(torch.uint8)


@register_algorithm("dense")
class Dense(Algorithm):
    """One-shot upload of local models; data-free ensemble distillation on the server."""

    mixed_models = True
    accepts_addons = False
    payload_kinds = {"up": frozenset({"weights"})}
    # The teachers' BatchNorm statistics are the generator's image prior.
    model_defaults = {"norm": "batch"}
    smoke_args = {"server_epochs": 2, "g_steps": 5, "syn_batch": 64, "kd_batch": 64,
                  "noise_dim": 64, "ngf": 16}
    # One-shot: the smoke try runs its one round.
    smoke_run = {"rounds": 1}
    # The README's distillation command (--epochs 200 --g_steps 30 --synthesis_batch_size 256
    # --batch_size 256) after local training of 400 epochs; one round.
    paper_args = {"server_epochs": 200, "g_steps": 30, "syn_batch": 256, "kd_batch": 256}
    paper_run = {"rounds": 1, "local_epochs": 400, "batch_size": 128}

    # Defaults are the README's distillation command except `server_epochs`: the code's default
    # 10 instead of the README's 200, for a CPU (`--preset paper` runs 200).
    @dataclass
    class Params:
        server_epochs: int = option(10, "synthesis + distillation epochs per round (README "
                                    "200, code default 10)", ge=1)
        g_steps: int = option(30, "generator Adam steps per epoch (README 30, code default 20)",
                              ge=1)
        syn_batch: int = option(256, "images synthesised per epoch (reference 256)", ge=2)
        kd_batch: int = option(256, "pool images per distillation step (reference 256)", ge=1)
        lr_g: float = option(1e-3, "Adam learning rate of the generator and its noise "
                             "(reference 1e-3)", gt=0)
        noise_dim: int = option(256, "generator noise size (reference 256)", ge=1, le=65536)
        ngf: int = option(64, "generator width (reference 64)", ge=1, le=4096)
        bn_weight: float = option(1.0, "weight of the teachers' BatchNorm-statistics loss "
                                  "(README 1, code default 0)", ge=0)
        oh_weight: float = option(1.0, "weight of the ensemble's CE toward the sampled labels "
                                  "(README 1, code default 0)", ge=0)
        adv_weight: float = option(1.0, "weight of the adversarial student-ensemble "
                                   "disagreement (README 1, code default 0)", ge=0)
        student_lr: float = option(0.005, "student SGD learning rate, momentum 0.9 (README "
                                   "0.005, code default 0.01)", gt=0)
        temperature: float = option(20.0, "distillation temperature T (README 20, code "
                                    "default 1)", gt=0)
        reset_generator: bool = option(True, "a fresh generator every epoch (the code); false: "
                                       "one generator trained on through the run")
        kd_augment: str = option("flip", "pool augmentation in distillation: flip (the code on "
                                 "MNIST/SVHN), crop-flip (the code on CIFAR) or none",
                                 choices=KD_AUGMENTS)

    def __init__(self, env: Env, params: Any | None = None) -> None:
        super().__init__(env, params)
        check_generated_shape(self.name, env.image_shape)

    # -- client ----------------------------------------------------------------------------------
    def client_update(self, msg: Message, client: ClientContext) -> Message:
        model = self.own_model(client)
        stats = local_train(model, client.x, client.y, self.client_train(client),
                            client.generator)
        # Kept for a later round, which goes on training this model (rounds > 1).
        client.state.arrays["weights"] = clone_state(model.state_dict())
        return Message({"weights": clone_state(model.state_dict())},
                       {"num_examples": client.num_train, "steps": stats.steps,
                        "train_loss": stats.mean_loss})

    def upload_spec(self, cid: int) -> dict[str, TensorSpec]:
        """The tensors client `cid` uploads: its architecture's state dict, exactly."""
        cache = self.__dict__.setdefault("_upload_spec", {})
        arch = self.env.client_models[cid] if cid < len(self.env.client_models) else ""
        if arch not in cache:
            state = self.client_new_model(cid).state_dict()
            cache[arch] = {n: TensorSpec.like(t) for n, t in state.items()}
        return cache[arch]

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        spec.exact["weights"] = self.upload_spec(cid)
        spec.required |= {"weights"}
        return spec

    # -- server ----------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        state: ServerState = {"model": clone_state(self.new_model().state_dict()),
                              "generator": None, "samples": None, "labels": None, "log": None}
        if not self.p.reset_generator:
            state["generator"] = clone_state(
                self.new_generator(run_seed(self.env.seed, GENERATOR_STREAM)).state_dict())
        return state

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        return {c: Message() for c in clients}

    def load_teachers(self, replies: dict[int, Message], device: torch.device
                      ) -> tuple[list[FedModel], BatchNormPrior]:
        """The uploaded client models on `device` (eval mode, frozen), each of its sender's
        architecture, and the prior on their BatchNorm layers (one warning per run when the
        BN term, `bn_weight` > 0, has no layer to read)."""
        members = []
        for cid, reply in replies.items():
            model = self.client_new_model(cid).to(device)
            model.load_state_dict(reply.get("weights"))
            members.append(model.eval().requires_grad_(False))
        prior = BatchNormPrior(members)
        if not prior.layers and self.p.bn_weight > 0 and not self.__dict__.get("_warned_bn"):
            self.__dict__["_warned_bn"] = True
            log.warning("%s: no client model has BatchNorm layers (run with --norm batch); "
                        "the BN-statistics term of the generator loss (bn_weight) is 0",
                        self.name)
        return members, prior

    def new_generator(self, seed: int, device: torch.device | None = None) -> ImageGenerator:
        """A generator initialised as the code's `reset_model` does, from `seed`."""
        with seeded(seed):
            gen = ImageGenerator(self.p.noise_dim, self.p.ngf, self.env.image_shape)
            reset_generator(gen)
        return gen.to(device if device is not None else self.env.device)

    def to_input(self, x: torch.Tensor) -> torch.Tensor:
        """Pixels in [0, 1] as the models take them: the benchmark's normalisation."""
        if not self.env.image_mean:
            return x
        mean = torch.tensor(self.env.image_mean, dtype=x.dtype, device=x.device)
        std = torch.tensor(self.env.image_std, dtype=x.dtype, device=x.device)
        return (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        p, device = self.p, ctx.device
        members, prior = self.load_teachers(replies, device)
        teacher = Ensemble(members).eval()
        student = self.load_model(state["model"], device)
        opt = torch.optim.SGD(student.parameters(), lr=p.student_lr, momentum=STUDENT_MOMENTUM)
        rng = ctx.stream(SERVER_STREAM)
        gen = None
        if state["generator"] is not None:
            gen = self.new_generator(0, device)
            gen.load_state_dict(state["generator"])
        pool: list[torch.Tensor] = []
        x8 = y = None
        best = kd = math.nan
        for epoch in range(p.server_epochs):
            if p.reset_generator:
                gen = self.new_generator(derive_seed(ctx.seed, ctx.round, GENERATOR_STREAM,
                                                     epoch), device)
            assert gen is not None
            x8, y, best = self.synthesize(gen, teacher, student, prior, rng, device)
            pool.append(x8)
            kd = self.distil(student, teacher, torch.cat(pool), opt, rng)
        assert x8 is not None and y is not None
        return {"model": clone_state(student.state_dict()),
                "generator": None if p.reset_generator else clone_state(gen.state_dict()),
                "samples": x8.cpu(), "labels": y.cpu(),
                "log": {"generator_loss": float(best), "kd_loss": float(kd),
                        "pool_images": sum(len(b) for b in pool), "teachers": len(members),
                        "bn_layers": len(prior.layers)}}

    def synthesize(self, gen: ImageGenerator, teacher: Ensemble, student: FedModel,
                   prior: BatchNormPrior, rng: torch.Generator, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`g_steps` Adam steps on the generator and its noise; the batch of the lowest loss
        (8-bit pixels), its labels and that loss (on the device: no step waits on it)."""
        p = self.p
        z = draw_noise(p.syn_batch, p.noise_dim, "normal", rng, device).requires_grad_(True)
        y = torch.randint(self.env.num_classes, (p.syn_batch,), generator=rng,
                          device=rng.device).sort()[0]
        y = y.to(device)
        opt = torch.optim.Adam([{"params": gen.parameters()}, {"params": [z]}], lr=p.lr_g,
                               betas=GENERATOR_BETAS)
        crop_flip = DSAConfig(strategy="crop_flip", mode="M",
                              ratio_crop_pad=CROP_PAD / self.env.image_shape[-1])
        use_bn = p.bn_weight > 0 and bool(prior.layers)
        gen.train()
        # The code leaves the student in train mode; only the images get gradients here.
        student.train().requires_grad_(False)
        best = torch.full((), math.inf, device=device)
        best_x: torch.Tensor | None = None
        with prior.hooked() if use_bn else nullcontext():
            for _ in range(p.g_steps):
                x = gen(z)
                view = self.to_input(augment_batch(x, rng, crop_flip))
                prior.terms.clear()
                t_out = teacher(view)
                s_out = student(view) if p.adv_weight > 0 else None
                loss = generator_loss(t_out, s_out, y, prior.loss(), p.bn_weight,
                                      p.oh_weight, p.adv_weight).total
                best, best_x = keep_lowest(best, best_x, loss.detach(), x.detach())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        student.requires_grad_(True)
        assert best_x is not None
        return to_pixels8(best_x), y, best

    def distil(self, student: FedModel, teacher: Ensemble, pool: torch.Tensor,
               opt: torch.optim.Optimizer, rng: torch.Generator) -> torch.Tensor:
        """One shuffled pass of T^2 KL distillation over the pool; the mean loss (on the
        device, summed in float64 as on the host)."""
        p = self.p
        student.train()
        total, steps = torch.zeros((), dtype=torch.float64, device=pool.device), 0
        for _, x in self.pool_batches(pool, p.kd_batch, rng):
            with torch.no_grad():
                t_out = teacher(x)
            loss = kd_loss(student(x), t_out, p.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach().double()
            steps += 1
        return total / max(steps, 1)

    def pool_batches(self, pool: torch.Tensor, batch: int, rng: torch.Generator
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass over the 8-bit `pool`: each batch's indices (on the pool's device)
        and its images, augmented as `kd_augment` says and normalised for the models."""
        kind = self.p.kd_augment
        view = None if kind == "none" else DSAConfig(
            strategy="flip" if kind == "flip" else "crop_flip", mode="M",
            ratio_crop_pad=CROP_PAD / self.env.image_shape[-1])
        for idx in batch_indices(len(pool), batch, 1, None, rng):
            idx = idx.to(pool.device)
            x = pool[idx].float() / 255
            if view is not None:
                x = augment_batch(x, rng, view)
            yield idx, self.to_input(x)

    def global_model(self, state: ServerState) -> FedModel:
        return self.load_model(state["model"], self.env.device)

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if state.get("samples") is None:
            return {}
        return {"dense_generated": (self.to_input(state["samples"].float() / 255),
                                    state["labels"])}

    def report(self, state: ServerState) -> dict[str, Any]:
        return {"dense": state.get("log")}

"""FedGAN as FedVCK's data-centric classifier baseline: FedAvg whose clients also train a shared
conditional GAN, and whose classifier steps add samples of the shared generator to real batches.

FedGAN proper (Rasouli, Sun & Rajagopal, arXiv 2006.07228) trains a GAN only: local generators
and discriminators, periodically averaged by an intermediary (its abstract). FedVCK (Yan et
al., AAAI 2025) runs "FedGAN" as a classifier baseline that uploads "Model, G, D" each round,
with "GAN at clients" synthesising "original sample"s; it says nothing more (docs/fedgan.md
lists what is not stated and what fedvl chose).

Round t (G(z, y) a conditional image generator, D(x, y) a conditional discriminator):
  server -> clients: w_t, G_t, D_t (`weights`, `generator`, `discriminator`), every round.
  client k: from w_t, FedAvg's local SGD on CE(f(x), y) for real batches (x, y) of size B plus,
            from round `syn_start` on, (S / B) CE(f(x'), y') for S = `syn_batch` samples
            x' = G_t(z, y') of labels y' ~ U{0..C-1} (G_t frozen, in train mode; one forward of
            [x; x'], so each synthetic sample weighs as a real one).
            Then, from (G_t, D_t), `gan_steps` steps on its own data, each on a random batch
            (x_r, y_r) of `gan_batch` and fakes G(z, y_r):
              D: Adam on softplus(-D(x_r, y_r)) + softplus(D(G(z, y_r), y_r))   (real 1, fake 0)
              G: Adam on softplus(-D(G(z, y_r), y_r))                (non-saturating G loss)
            Uploads w_k, G_k, D_k and n_k.
  server:   w, G and D each averaged with FedAvg's weights n_k / sum n (or the run's robust rule).

G is DENSE's generator (`ImageGenerator`: two x2 upsamplings, pixels in [0, 1]) fed [z; one-hot
y] (a conditional GAN, Mirza & Osindero 2014), mapped to the models' input by the benchmark's
normalisation; D is DCGAN-style (two stride-2 4x4 convolutions, LeakyReLU 0.2, BatchNorm on the
second) with a projection label term (Miyato & Koyama 2018). Both start from DCGAN's
N(0, 0.02) initialisation drawn from the run seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.algorithms.base import ClientContext, Env, ServerContext, ServerState
from fedvl.algorithms.dense import ImageGenerator, check_generated_shape, reset_generator
from fedvl.algorithms.fedavg import ROBUST_RULES, FedAvg
from fedvl.core.bounds import BOUNDED_KINDS, Measure
from fedvl.core.message import Message
from fedvl.core.params import clone_state, robust_average, weighted_average
from fedvl.core.replies import ReplySpec
from fedvl.core.training import ExtraBatch, LossTerm
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm
from fedvl.seeding import derive_seed, run_seed, seeded

# Run stream of G's and D's initialisation; purposes of a client's draws (derived from its
# round generator without drawing from it, so the real batches come in FedAvg's order); run
# stream of the samples saved as images at the end.
INIT_STREAM = 151
SYNTHETIC_STREAM = 157
GAN_STREAM = 163
SAMPLES_STREAM = 167
# DCGAN's Adam betas (Radford, Metz & Chintala 2016).
GAN_BETAS = (0.5, 0.999)
# The GAN's two model kinds, sized for the round's bound as changes from what the server sent.
GAN_KINDS = ("generator", "discriminator")
# Samples per class in the image grid of the final generator.
SAMPLES_PER_CLASS = 8


class ConditionalGenerator(nn.Module):
    """G(z, y): DENSE's image generator fed noise z and the one-hot label y; pixels in [0, 1]."""

    def __init__(self, num_classes: int, noise_dim: int, ngf: int,
                 image_shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise_dim
        self.body = ImageGenerator(noise_dim + num_classes, ngf, image_shape)

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Images (n x C x H x W) for noise `z` (n x noise_dim) and labels `y` (n)."""
        return self.body(torch.cat([z, F.one_hot(y, self.num_classes).to(z.dtype)], dim=1))


class ConditionalDiscriminator(nn.Module):
    """D(x, y): a DCGAN-style convolutional critic with a projection term for the label."""

    def __init__(self, num_classes: int, ndf: int, image_shape: tuple[int, int, int]) -> None:
        super().__init__()
        c, h, w = image_shape
        self.body = nn.Sequential(
            nn.Conv2d(c, ndf, 4, stride=2, padding=1), nn.LeakyReLU(0.2),
            nn.Conv2d(ndf, 2 * ndf, 4, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * ndf), nn.LeakyReLU(0.2), nn.Flatten())
        width = 2 * ndf * (h // 4) * (w // 4)
        self.out = nn.Linear(width, 1)
        self.label_code = nn.Embedding(num_classes, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One logit per image: real (high) or generated (low), given its label."""
        f = self.body(x)
        return self.out(f).squeeze(1) + (self.label_code(y) * f).sum(1)


class Normalise(nn.Module):
    """Pixels in [0, 1] to the models' input: the benchmark's per-channel (x - mean) / std."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...],
                 device: torch.device) -> None:
        super().__init__()
        # Unknown statistics (a Flower server whose nodes did not say): the identity.
        self.register_buffer("mean", torch.tensor(mean or (0.0,), device=device).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std or (1.0,), device=device).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` normalised."""
        return (x - self.mean) / self.std


def device_generator(client: ClientContext, purpose: int) -> torch.Generator:
    """A generator on the client's device, seeded from its round generator and `purpose`
    without drawing from it: draws stay on the device (no host copy inside a step)."""
    seed = derive_seed(client.generator.initial_seed(), purpose)
    return torch.Generator(device=client.device).manual_seed(seed)


def gan_losses(g: ConditionalGenerator, d: ConditionalDiscriminator, to_input: nn.Module,
               x: torch.Tensor, y: torch.Tensor, z: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(D's loss, fakes) of one batch: softplus(-D(real)) + softplus(D(fake)), fakes G(z, y)."""
    fake = to_input(g(z, y))
    d_loss = F.softplus(-d(x, y)).mean() + F.softplus(d(fake.detach(), y)).mean()
    return d_loss, fake


def train_gan(g: ConditionalGenerator, d: ConditionalDiscriminator, to_input: nn.Module,
              x: torch.Tensor, y: torch.Tensor, steps: int, batch: int, lr_g: float, lr_d: float,
              rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` alternating D and G Adam steps on random batches of (x, y); the summed D and G
    losses, as tensors (read them after training: no host sync inside a step)."""
    opt_g = torch.optim.Adam(g.parameters(), lr=lr_g, betas=GAN_BETAS)
    opt_d = torch.optim.Adam(d.parameters(), lr=lr_d, betas=GAN_BETAS)
    g.train()
    d.train()
    d_sum = g_sum = x.new_zeros(())
    for _ in range(steps):
        idx = torch.randint(len(y), (batch,), generator=rng, device=rng.device)
        xr, yr = x[idx], y[idx]
        z = torch.randn(batch, g.noise_dim, generator=rng, device=rng.device)
        d_loss, fake = gan_losses(g, d, to_input, xr, yr, z)
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        opt_d.step()
        # G's step backpropagates through D without filling D's gradients.
        d.requires_grad_(False)
        g_loss = F.softplus(-d(fake, yr)).mean()
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()
        d.requires_grad_(True)
        d_sum = d_sum + d_loss.detach()
        g_sum = g_sum + g_loss.detach()
    return d_sum, g_sum


class SyntheticTerm:
    """(S / B) CE(f(x'), y') on S samples x' = G(z, y') of uniform labels y', forwarded with
    the real batch (each synthetic sample counts as much as a real one)."""

    def __init__(self, g: ConditionalGenerator, to_input: nn.Module, count: int,
                 rng: torch.Generator) -> None:
        # Train mode: G normalises with batch statistics, as when it was trained.
        self.g, self.to_input, self.count, self.rng = g.train(), to_input, count, rng

    @torch.no_grad()
    def extra_batch(self, model: FedModel, x: torch.Tensor, y: torch.Tensor) -> ExtraBatch:
        """This step's synthetic samples and their labels."""
        ys = torch.randint(self.g.num_classes, (self.count,), generator=self.rng,
                           device=self.rng.device)
        z = torch.randn(self.count, self.g.noise_dim, generator=self.rng, device=self.rng.device)
        return ExtraBatch(self.to_input(self.g(z, ys)), ys)

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        extra = self.extra_batch(model, x, y)
        return self.loss_with_extra(model, x, y, z, logits, extra, *model.features_and_logits(
            extra.x))

    def loss_with_extra(self, model: FedModel, x: torch.Tensor, y: torch.Tensor,
                        z: torch.Tensor, logits: torch.Tensor, extra: ExtraBatch,
                        z_extra: torch.Tensor, logits_extra: torch.Tensor) -> torch.Tensor:
        """CE on the synthetic rows, scaled so that a synthetic row weighs as a real one."""
        return F.cross_entropy(logits_extra, extra.y) * (len(extra.y) / len(y))


@register_algorithm("fedgan")
class FedGAN(FedAvg):
    """FedAvg plus a federated conditional GAN whose samples join the clients' batches."""

    payload_kinds = {"down": frozenset(GAN_KINDS), "up": frozenset(GAN_KINDS)}
    # G and D come back with the names, shapes and dtypes the server sent.
    mirrored_kinds = (*FedAvg.mirrored_kinds, *GAN_KINDS)
    # G's and D's updates are bounded as the weights are: their change from what was sent.
    bounded_kinds = {**BOUNDED_KINDS, **{k: Measure(against=k) for k in GAN_KINDS}}
    # Its local step adds synthetic samples; a GAN baseline, not a base for add-ons.
    accepts_addons = False
    smoke_args = {"gan_steps": 20}

    @dataclass
    class Params:
        gan_steps: int = option(50, "D and G step pairs per client per round (FedGAN's "
                                "interval between syncs); 0: the GAN does not train", ge=0)
        gan_batch: int = option(32, "real images (and as many fakes) per GAN step", ge=2)
        noise_dim: int = option(100, "generator noise size (DCGAN's)", ge=1, le=65536)
        ngf: int = option(32, "generator width", ge=1, le=4096)
        ndf: int = option(32, "discriminator width", ge=1, le=4096)
        lr_g: float = option(2e-4, "generator Adam learning rate, betas (0.5, 0.999) "
                             "(DCGAN's)", gt=0)
        lr_d: float = option(2e-4, "discriminator Adam learning rate (DCGAN's; FedGAN "
                             "allows two time scales)", gt=0)
        syn_batch: int = option(32, "synthetic samples per classifier step, each weighted as a "
                                "real one; 0: none", ge=0)
        syn_start: int = option(1, "first round whose classifier steps use synthetic samples "
                                "(round 0's generator is untrained)", ge=0)

    def __init__(self, env: Env, params: Any | None = None) -> None:
        super().__init__(env, params)
        check_generated_shape("fedgan", env.image_shape)

    # -- the GAN ---------------------------------------------------------------------------------
    def new_gan(self, device: torch.device) -> tuple[ConditionalGenerator,
                                                     ConditionalDiscriminator]:
        """G and D initialised from the run seed (DCGAN's N(0, 0.02) weights)."""
        c, shape = self.env.num_classes, tuple(self.env.image_shape)
        with seeded(run_seed(self.env.seed, INIT_STREAM)):
            g = ConditionalGenerator(c, self.p.noise_dim, self.p.ngf, shape)  # type: ignore[arg-type]
            d = ConditionalDiscriminator(c, self.p.ndf, shape)  # type: ignore[arg-type]
            reset_generator(g)
            reset_generator(d)
            nn.init.normal_(d.label_code.weight, 0.0, 0.02)
        return g.to(device), d.to(device)

    def load_gan(self, msg: Message, device: torch.device) -> tuple[ConditionalGenerator,
                                                                    ConditionalDiscriminator]:
        """G and D carrying the states in `msg`."""
        g, d = self.new_gan(device)
        g.load_state_dict(msg.get("generator"))
        d.load_state_dict(msg.get("discriminator"))
        return g, d

    def normaliser(self, device: torch.device) -> Normalise:
        """The map from G's pixels to the models' input."""
        return Normalise(self.env.image_mean, self.env.image_std, device)

    # -- server ----------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        g, d = self.new_gan(self.env.device)
        return {**super().server_init(), "generator": clone_state(g.state_dict()),
                "discriminator": clone_state(d.state_dict())}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        msg = Message({"weights": state["model"], "generator": state["generator"],
                       "discriminator": state["discriminator"]})
        return {c: msg for c in clients}

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        spec.required |= frozenset(k for k in GAN_KINDS if k in sent.arrays)
        return spec

    def average_kind(self, replies: dict[int, Message], kind: str) -> dict:
        """The clients' states of `kind` combined by the run's rule, as the models are."""
        states = [r.get(kind) for r in replies.values()]
        if self.env.aggregation in ROBUST_RULES:
            return robust_average(states, self.env.aggregation, self.env.trim)
        return weighted_average(states, self.client_weights(replies))

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        state = super().aggregate(state, ctx, replies)
        return {**state, **{k: self.average_kind(replies, k) for k in GAN_KINDS}}

    # -- client ----------------------------------------------------------------------------------
    def loss_terms(self, model: FedModel, msg: Message,
                   client: ClientContext) -> Sequence[LossTerm]:
        if self.p.syn_batch == 0 or client.round < self.p.syn_start:
            return ()
        g, _ = self.load_gan(msg, client.device)
        return (SyntheticTerm(g.requires_grad_(False), self.normaliser(client.device),
                              self.p.syn_batch, device_generator(client, SYNTHETIC_STREAM)),)

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        out = super().client_update(msg, client)
        g, d = self.load_gan(msg, client.device)
        train_gan(g, d, self.normaliser(client.device), client.x, client.y, self.p.gan_steps,
                  self.p.gan_batch, self.p.lr_g, self.p.lr_d,
                  device_generator(client, GAN_STREAM))
        out.arrays["generator"] = clone_state(g.state_dict())
        out.arrays["discriminator"] = clone_state(d.state_dict())
        return out

    # -- results ---------------------------------------------------------------------------------
    @torch.no_grad()
    def samples(self, state: ServerState, per_class: int = SAMPLES_PER_CLASS
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`per_class` images of every class from the server's G (normalised), with labels."""
        device = self.env.device
        g, _ = self.new_gan(device)
        g.load_state_dict(state["generator"])
        y = torch.arange(self.env.num_classes, device=device).repeat_interleave(per_class)
        rng = torch.Generator(device=device).manual_seed(
            run_seed(self.env.seed, SAMPLES_STREAM))
        z = torch.randn(len(y), self.p.noise_dim, generator=rng, device=device)
        return self.normaliser(device)(g.train()(z, y)), y

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.samples(state)
        return {"fedgan_generated": (x.cpu(), y.cpu())}

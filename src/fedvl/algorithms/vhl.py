"""VHL, Virtual Homogeneity Learning (Tang et al., ICML 2022), as a local-objective add-on.

The server generates one labelled *virtual* dataset from the run seed (an untrained style
generator by default, no client data involved) and sends it to each client once. Per local
step the client adds to cross-entropy on its real batch (x, y):

    alpha * CE(head(embed(v)), y_v + C)                      virtual classes C..C+V-1
  + w_cal * SupCon([embed(x); embed(v).detach()], [y; y_v])  calibration: real class k is pulled
                                                             toward virtual class k
  + w_sup * SupCon(embed(v), y_v)                            virtual-only, not detached

with a classifier of C + V outputs (evaluation takes the argmax over all of them, so a virtual
prediction counts as wrong). With BatchNorm the real and virtual batches share one forward pass
([x; v], as in the VHL code); without batch statistics the virtual batch gets its own pass.
The add-on mixes into any FedAvg-style base: `vhl` = `fedavg+vhl`, `fedprox+vhl`,
`scaffold+vhl`, `fednova+vhl` (see `algorithms.compose`). Variants:
`naive-vhl` (only the alpha * CE virtual term) and `vfa` (no virtual images: calibration toward
features sampled from fixed per-class Gaussians in feature space).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedvl.algorithms.base import Algorithm, ClientContext, Env, ServerContext, ServerState
from fedvl.algorithms.compose import compose
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.contrastive import supcon_loss
from fedvl.core.message import Message
from fedvl.core.training import ExtraBatch, LossTerm
from fedvl.models.base import FedModel, has_batch_stats
from fedvl.options import LogUniform, copy_option, option
from fedvl.registry import VIRTUAL_GENERATORS, register_addon, register_algorithm
from fedvl.seeding import run_seed
from fedvl.virtual import (
    VIRTUAL_MEAN,
    VIRTUAL_STD,
    VirtualDataset,
    make_virtual_dataset,
    normalise,
)
from fedvl.virtual.pixels import PIXEL_MAPPINGS

IMAGES, LABELS, MEANS = "virtual_images", "virtual_labels", "virtual_feature_means"
# Run-level random streams (`fedvl.seeding.run_seed`): the virtual data are generated once per run
# from the run seed alone, so the server and every client agree on them without communicating.
VIRTUAL_DATA_STREAM = 4242
VFA_MEANS_STREAM = 4243
# Client-side stream for virtual batches, derived from the client's round generator.
VIRTUAL_BATCH_STREAM = 4244


@dataclass
class VHLParams:
    """Options of the VHL add-on (merged with the base method's options)."""

    alpha: float = option(1.0, "weight of CE on the virtual batch", ge=0,
                           tune=LogUniform(0.1, 10.0))
    calibration: bool = option(True, "SupCon pulling real features toward virtual ones")
    calibration_weight: float = option(1.0, "weight of the calibration term", ge=0)
    virtual_supcon_weight: float = option(0.1, "weight of SupCon among virtual features only",
                                          ge=0)
    temperature: float = option(0.07, "SupCon temperature", gt=0)
    base_temperature: float = option(0.07, "SupCon base temperature", gt=0)
    detach_virtual: bool = option(True, "the virtual side of the calibration gets no gradient")
    virtual_generator: str = option("style_gan", "generator of the virtual dataset",
                                    choices=VIRTUAL_GENERATORS.names)
    pixel_mapping: str = option("affine", "affine: generator range onto [0, 1]; clamp: the raw "
                                "output clipped, as VHL's files", choices=PIXEL_MAPPINGS)
    virtual_classes: int = option(0, "virtual classes V (0: as many as real ones)", ge=0)
    virtual_per_class: int = option(200, "images per virtual class", ge=1)
    virtual_batch_size: int = option(0, "virtual images per step (0: the real batch size)",
                                     ge=0)
    label_style: str = option("extra", "extra: labels C+k, a classifier of C+V outputs; "
                              "shared: labels k", choices=("extra", "shared"))
    virtual_augment: bool = option(False, "random crop (pad H/8) + flip of virtual batches")
    mode: str = option("images", "images (VHL) or vfa (Gaussian virtual features)",
                       choices=("images", "vfa"))
    vfa_mean_std: float = option(1.0, "VFA class means ~ N(0, s^2 I) in feature space", ge=0)
    vfa_std: float = option(0.3, "VFA samples ~ N(mean_k, s^2 I)", ge=0)


def vhl_calibration(z_real: torch.Tensor, y_real: torch.Tensor, z_virtual: torch.Tensor,
                    y_virtual: torch.Tensor, detach: bool = True, temperature: float = 0.07,
                    base_temperature: float = 0.07) -> torch.Tensor:
    """SupCon over [real; virtual] features with class-matched labels (virtual k ~ real k);
    with `detach` only the real features receive gradient."""
    zv = z_virtual.detach() if detach else z_virtual
    return supcon_loss(torch.cat([z_real, zv]), torch.cat([y_real, y_virtual]),
                       temperature, base_temperature)


def derived_generator(client: ClientContext, purpose: int) -> torch.Generator:
    """A generator seeded from the client's round generator without drawing from it, so the
    real-batch order is the same as the base method's."""
    seed = np.random.SeedSequence([client.generator.initial_seed(), purpose])
    return torch.Generator().manual_seed(int(seed.generate_state(1, np.uint64)[0] >> 1))


class CyclingSampler:
    """Batches of indices from successive shuffles of range(n) (a shuffled loader)."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator) -> None:
        self.n, self.bs, self.g = n, batch_size, generator
        self.perm = torch.randperm(n, generator=generator, device=generator.device)
        self.pos = 0

    def next(self) -> torch.Tensor:
        out = []
        need = self.bs
        while need > 0:
            if self.pos >= self.n:
                self.perm, self.pos = torch.randperm(self.n, generator=self.g,
                                                     device=self.g.device), 0
            take = self.perm[self.pos:self.pos + need]
            self.pos += len(take)
            need -= len(take)
            out.append(take)
        return torch.cat(out)


def crop_flip(v: torch.Tensor, generator: torch.Generator, pad: int, fill: float
              ) -> torch.Tensor:
    """Random crop after constant padding, and random horizontal flip, per image."""
    b, _, h, w = v.shape
    flip = torch.rand(b, generator=generator, device=generator.device) < 0.5
    v = torch.where(flip.to(v.device)[:, None, None, None], v.flip(3), v)
    if pad <= 0:
        return v
    padded = F.pad(v, (pad, pad, pad, pad), value=fill)
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator,
                       device=generator.device).to(v.device)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator,
                       device=generator.device).to(v.device)
    # One gather for the whole batch: window rows/cols per image.
    rows = (dy[:, None] + torch.arange(h, device=v.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=v.device))[:, None, None, :]
    n = torch.arange(b, device=v.device)[:, None, None, None]
    ch = torch.arange(v.shape[1], device=v.device)[None, :, None, None]
    return padded[n, ch, rows, cols]


class VirtualImageTerm:
    """The VHL loss on one virtual batch per step (see the module docstring).

    With `shared_forward` (models with BatchNorm) the virtual batch joins the real batch in one
    forward pass, so BN normalises [x; v] as in the VHL code; otherwise it gets its own pass,
    which is the same computation for models without batch statistics.
    """

    def __init__(self, p: VHLParams, images: torch.Tensor, labels: torch.Tensor, shift: int,
                 batch_size: int, generator: torch.Generator,
                 shared_forward: bool = False) -> None:
        self.p, self.images, self.labels, self.shift = p, images, labels, shift
        self.g = generator
        self.sampler = CyclingSampler(len(labels), batch_size, generator)
        self.shared_forward = shared_forward

    def virtual_batch(self) -> ExtraBatch:
        """The next virtual batch (augmented if enabled) and its virtual class ids."""
        idx = self.sampler.next().to(self.images.device)
        v, yv = self.images[idx], self.labels[idx]
        if self.p.virtual_augment:
            v = crop_flip(v, self.g, v.shape[2] // 8, (0.0 - VIRTUAL_MEAN) / VIRTUAL_STD)
        return ExtraBatch(v, yv)

    def extra_batch(self, model: FedModel, x: torch.Tensor, y: torch.Tensor
                    ) -> ExtraBatch | None:
        """The virtual batch to forward with the real one, if the forward is shared."""
        return self.virtual_batch() if self.shared_forward else None

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        batch = self.virtual_batch()
        zv, lv = model.features_and_logits(batch.x)
        return self.loss_with_extra(model, x, y, z, logits, batch, zv, lv)

    def loss_with_extra(self, model: FedModel, x: torch.Tensor, y: torch.Tensor,
                        z: torch.Tensor, logits: torch.Tensor, extra: ExtraBatch,
                        z_extra: torch.Tensor, logits_extra: torch.Tensor) -> torch.Tensor:
        """The VHL terms given the features and logits of the real and virtual batches."""
        p, zv, lv, yv = self.p, z_extra, logits_extra, extra.y
        loss = z.new_zeros(())
        if p.alpha > 0:
            loss = loss + p.alpha * F.cross_entropy(lv, yv + self.shift)
        if p.calibration and p.calibration_weight > 0:
            loss = loss + p.calibration_weight * vhl_calibration(
                z, y, zv, yv, p.detach_virtual, p.temperature, p.base_temperature)
        if p.virtual_supcon_weight > 0:
            loss = loss + p.virtual_supcon_weight * supcon_loss(zv, yv, p.temperature,
                                                                p.base_temperature)
        return loss


class VirtualFeatureTerm:
    """VFA: calibration toward features drawn from fixed per-class Gaussians."""

    def __init__(self, p: VHLParams, means: torch.Tensor, batch_size: int,
                 generator: torch.Generator) -> None:
        self.p, self.means, self.bs, self.g = p, means, batch_size, generator

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        p = self.p
        k = torch.randint(0, len(self.means), (self.bs,), generator=self.g, device=self.g.device)
        eps = torch.randn(self.bs, self.means.shape[1], generator=self.g, device=self.g.device)
        # Drawn on the generator's device (the CPU: the same draws on every device), used on
        # the features' device.
        k, eps = k.to(z.device), eps.to(z.device)
        fv = self.means.to(z.device)[k] + p.vfa_std * eps
        return p.calibration_weight * vhl_calibration(z, y, fv, k.to(y.device), True,
                                                      p.temperature, p.base_temperature)


def run_virtual_dataset(env: Env, generator: str, num_classes: int, per_class: int,
                        pixel_mapping: str) -> VirtualDataset:
    """The virtual dataset of a run of seed `env.seed` (VHL's, and what VFTL pre-trains on)."""
    # The seed stream is the run's alone: every method that asks for the same generator, sizes
    # and mapping in a run of one seed gets the very same images.
    return make_virtual_dataset(generator, num_classes, per_class, tuple(env.image_shape),
                                run_seed(env.seed, VIRTUAL_DATA_STREAM), device=env.device,
                                pixel_mapping=pixel_mapping)


class ExtraClassesModel:
    """The plain `model_fn` model whose classifier has `extra_classes` outputs beyond the real
    classes (VHL's virtual classes C..C+V-1); the trunk's initialisation is unchanged."""

    # Set by Algorithm.__init__ of the class it is mixed into; declared for type checkers.
    env: Env

    @property
    def extra_classes(self) -> int:
        """Outputs the classifier gets beyond the real classes (none unless a subclass says)."""
        return 0

    def new_model(self) -> FedModel:
        """A fresh model with C + `extra_classes` outputs on the run's device."""
        return self.env.model_fn(num_classes=self.env.num_classes + self.extra_classes
                                 ).to(self.env.device)

    def load_model(self, weights: Mapping[str, torch.Tensor], device: torch.device) -> FedModel:
        """A model with C + `extra_classes` outputs carrying `weights`."""
        model = self.env.model_fn(num_classes=self.env.num_classes + self.extra_classes).to(device)
        model.load_state_dict(weights)
        return model


class VHLAddon(ExtraClassesModel):
    """Virtual Homogeneity Learning: shared virtual data with extra classes and calibration."""

    addon_name: ClassVar[str] = "vhl"
    smoke_args: ClassVar[dict[str, Any]] = {"virtual_per_class": 20}
    Params: ClassVar[type] = VHLParams
    # Down, once per client: the virtual images and labels, or VFA's class means.
    payload_kinds: ClassVar[dict[str, frozenset[str]]] = {
        "down": frozenset({"synthetic_images", "synthetic_labels", "prototypes"})}
    # Set by Algorithm.__init__ of the composed class; declared for type checkers.
    p: Any

    @classmethod
    def compatible(cls, base: type) -> bool:
        """Bases whose local step is FedAvg's and whose model is the plain `model_fn` model."""
        return (isinstance(base, type) and issubclass(base, FedAvg) and not base.personalized
                and base.new_model is Algorithm.new_model
                and base.load_model is Algorithm.load_model
                and base.addon_name is None and base.accepts_addons)

    # -- sizes and models ----------------------------------------------------------------------
    @property
    def num_virtual(self) -> int:
        """V, the number of virtual classes."""
        return self.p.virtual_classes or self.env.num_classes

    @property
    def extra_classes(self) -> int:
        """Outputs the classifier gets beyond the real classes."""
        return self.num_virtual if (self.p.mode == "images"
                                    and self.p.label_style == "extra") else 0

    def _check_sizes(self) -> None:
        if self.p.label_style == "shared" and self.num_virtual > self.env.num_classes:
            raise ValueError(f"vhl label_style 'shared' needs virtual_classes <= "
                             f"{self.env.num_classes}, got {self.num_virtual}")

    # -- the shared virtual data (server side) ------------------------------------------------
    def virtual_dataset(self) -> VirtualDataset:
        """The run's virtual dataset, generated once from the run seed."""
        cache = self.__dict__.setdefault("_vhl_cache", {})
        if "data" not in cache:
            self._check_sizes()
            cache["data"] = run_virtual_dataset(self.env, self.p.virtual_generator,
                                                self.num_virtual, self.p.virtual_per_class,
                                                self.p.pixel_mapping)
        return cache["data"]

    def virtual_feature_means(self) -> torch.Tensor:
        """VFA's per-class feature means, fixed by the run seed."""
        cache = self.__dict__.setdefault("_vhl_cache", {})
        if "means" not in cache:
            dim = self.env.model_fn().feature_dim
            seed = run_seed(self.env.seed, VFA_MEANS_STREAM)
            g = torch.Generator().manual_seed(seed)
            cache["means"] = self.p.vfa_mean_std * torch.randn(self.num_virtual, dim,
                                                               generator=g, device="cpu")
        return cache["means"]

    def virtual_payload(self) -> dict[str, dict[str, torch.Tensor]]:
        """What a client receives once: 8-bit images + labels, or VFA's class means."""
        if self.p.mode == "vfa":
            return {"prototypes": {MEANS: self.virtual_feature_means()}}
        data = self.virtual_dataset()
        return {"synthetic_images": {IMAGES: data.images},
                "synthetic_labels": {LABELS: data.labels}}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        out = super().configure(state, ctx, clients)  # type: ignore[misc]
        have = set(state.get("virtual_sent", []))
        payload = None
        for c in clients:
            if c not in have:
                payload = payload or self.virtual_payload()
                m = out[c]
                out[c] = Message({**m.arrays, **payload}, dict(m.meta))
        return out

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        new = super().aggregate(state, ctx, replies)  # type: ignore[misc]
        # Clients that replied hold the virtual data in their state from now on.
        new["virtual_sent"] = sorted(set(state.get("virtual_sent", [])) | set(replies))
        return new

    # -- client side -------------------------------------------------------------------------------
    def _client_virtual(self, msg: Message, client: ClientContext) -> dict[str, torch.Tensor]:
        kinds = ("prototypes",) if self.p.mode == "vfa" else ("synthetic_images",
                                                              "synthetic_labels")
        if kinds[0] in msg.arrays:
            for k in kinds:
                client.state.arrays[k] = dict(msg.arrays[k])
        if kinds[0] not in client.state.arrays:
            raise RuntimeError(f"client '{client.name}' has no virtual data: the server did not "
                               f"send it this round and the client's state holds none")
        out: dict[str, torch.Tensor] = {}
        for k in kinds:
            out.update(client.state.arrays[k])
        return out

    def loss_terms(self, model: FedModel, msg: Message,
                   client: ClientContext) -> Sequence[LossTerm]:
        terms = list(super().loss_terms(model, msg, client))  # type: ignore[misc]
        data = self._client_virtual(msg, client)
        p = self.p
        bs = p.virtual_batch_size or self.env.train.batch_size
        g = derived_generator(client, VIRTUAL_BATCH_STREAM)
        if p.mode == "vfa":
            if p.calibration and p.calibration_weight > 0:
                terms.append(VirtualFeatureTerm(p, data[MEANS].to(client.device), bs, g))
            return terms
        active = p.alpha > 0 or (p.calibration and p.calibration_weight > 0) \
            or p.virtual_supcon_weight > 0
        if active:
            shift = self.env.num_classes if p.label_style == "extra" else 0
            images = normalise(data[IMAGES]).to(client.device)
            terms.append(VirtualImageTerm(p, images, data[LABELS].to(client.device), shift, bs,
                                          g, shared_forward=has_batch_stats(model)))
        return terms


class NaiveVHLAddon(VHLAddon):
    """Naive VHL: only the alpha-weighted CE on virtual data (no feature calibration)."""

    addon_name: ClassVar[str] = "naive-vhl"

    @dataclass
    class Params(VHLParams):
        calibration: bool = copy_option(VHLParams, "calibration", default=False)
        virtual_supcon_weight: float = copy_option(VHLParams, "virtual_supcon_weight",
                                                   default=0.0)


class VFAAddon(VHLAddon):
    """VFA: calibration toward per-class Gaussian virtual features (no virtual images)."""

    addon_name: ClassVar[str] = "vfa"

    @dataclass
    class Params(VHLParams):
        mode: str = copy_option(VHLParams, "mode", default="vfa")


for _addon in (VHLAddon, NaiveVHLAddon, VFAAddon):
    register_addon(_addon.addon_name)(_addon)
    # The plain add-on name means FedAvg + add-on (`vhl` = `fedavg+vhl`).
    register_algorithm(_addon.addon_name)(compose(FedAvg, _addon, _addon.addon_name))

"""Differentially private distribution matching (DESA DP-DM, done with per-sample clipping).

Mechanism per step: every real image of class c is included independently with probability
q_c = min(1, batch/n_c) (Poisson sampling); each included image i contributes the gradient of its
own loss ||e(x_i) - mean e(syn_c)||^2 w.r.t. the synthetic images of its class (the average of these
is exactly the DM gradient); every contribution is clipped to L2 norm <= C, summed, Gaussian noise
N(0, (sigma*C)^2) is added to every synthetic pixel, and the sum is divided by the expected batch
size. Privacy is accounted by Opacus' RDP (or PRV) accountant for `steps` compositions of the
sampled Gaussian mechanism with rate max_c q_c (add/remove adjacency; `fedvl.core.dp`).

The guarantee covers the released images only when nothing else in them depends on private
data: the synthetic set must start from noise (`check_dp_setup` refuses real-image and
class-statistics initialisations), and the feature extractor must not normalise with batch
statistics (BatchNorm in train mode mixes every sample of a batch into every output, so clipping
one sample's gradient does not bound its influence). The default delta is 1/(10 N)
(`fedvl.core.dp.default_delta`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedvl.core.dp import ACCOUNTANTS, check_dp_model, clip_rows, compute_epsilon, default_delta
from fedvl.devices import to_device
from fedvl.distill.samplers import host_copy
from fedvl.distill.synthesize import ExtractorSampler
from fedvl.models.base import has_batch_stats

SPACES = ("image", "feature")
# Initialisations whose first pixels do not depend on private data.
DP_INITS = ("noise",)


def check_dp_setup(init: str, model: torch.nn.Module) -> None:
    """Refuse DP settings whose reported epsilon would not hold, with one clear error."""
    if init not in DP_INITS:
        raise ValueError(f"differential privacy needs init 'noise'; init '{init}' starts the "
                         "released images from private data (real images or class "
                         "statistics), which the privacy accounting does not cover")
    check_dp_model(model)


def embedding_and_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[embed(x), logits(x)] per row: matching its mean matches both means (FedDM's loss)."""
    return torch.cat(model.features_and_logits(x), dim=1)


# Rows of one batched backward are capped so its largest activation stays under this size:
# larger blocks bypass the heap (glibc's mmap threshold is at most 32 MiB, see
# `fedvl.engine.allocator`) and every pass then faults its pages in afresh, which at width 32
# made a 32-row pass 2.6 times slower than two 16-row passes.
PASS_BYTES = 16 << 20


def _largest_activation(model: torch.nn.Module,
                        forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run `forward` and return its output with the largest tensor any submodule produced."""
    largest = [0]

    def hook(_m: torch.nn.Module, _i: object, out: object) -> None:
        if isinstance(out, torch.Tensor):
            largest[0] = max(largest[0], out.numel() * out.element_size())

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        out = forward()
    finally:
        for h in handles:
            h.remove()
    return out, largest[0]


def per_sample_image_grads(model: torch.nn.Module, block: torch.Tensor, v: torch.Tensor,
                           features: Callable[[torch.Tensor], torch.Tensor] | None = None
                           ) -> torch.Tensor:
    """G[i] = d<mean features(block), v_i>/d block for every row v_i, by batched backwards.

    `features` defaults to `model.embed`. Every G[i] is a vector-Jacobian product of the same
    forward pass, so the block goes forward once and the backward is vectorised over the rows
    (exact for per-sample normalisation; BN must be in eval mode), on a CPU in passes of as many
    rows as fit PASS_BYTES. Each row's values do not depend on how the rows are split.
    """
    f = features if features is not None else model.embed
    leaf = block.detach().requires_grad_(True)
    z, largest = _largest_activation(model, lambda: f(leaf).mean(0))
    # The cap is for glibc's heap; a GPU's caching allocator keeps its blocks, so one pass.
    rows = max(1, PASS_BYTES // max(largest, 1)) if leaf.device.type == "cpu" else len(v)
    parts = []
    for i in range(0, len(v), rows):
        last = i + rows >= len(v)
        (g,) = torch.autograd.grad(z, leaf, grad_outputs=v[i : i + rows], retain_graph=not last,
                                   is_grads_batched=True)
        parts.append(g)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class DPDistributionMatching:
    """DP mean-embedding matching on a sampled extractor; returns a privatised image gradient.

    `space='image'` clips each real sample's gradient w.r.t. the synthetic images (exact
    per-sample clipping). `space='feature'` clips each sample's loss gradient w.r.t. the synthetic
    class-mean embedding and adds the noise there; the image gradient is then the Jacobian
    transpose applied to that noisy vector, i.e. post-processing, so the guarantee is the same and
    it is much cheaper. With `logits` the matched feature of an image is [embed(x), logits(x)]
    (FedDM's embedding + logit matching: the squared distance of the concatenated means is the
    sum of both squared distances), so one clip bounds a sample's influence on both terms.
    """

    x: torch.Tensor
    y: torch.Tensor
    extractor: ExtractorSampler
    num_classes: int
    batch_per_class: int = 256
    clip: float = 2.0
    noise_multiplier: float = 0.6
    delta: float | None = None
    space: str = "image"
    accountant: str = "rdp"
    chunk: int = 64
    logits: bool = False

    def __post_init__(self) -> None:
        if self.space not in SPACES:
            raise ValueError(f"unknown DP space '{self.space}'; allowed: {', '.join(SPACES)}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"unknown accountant '{self.accountant}'; "
                             f"allowed: {', '.join(ACCOUNTANTS)}")
        if self.clip <= 0 or self.noise_multiplier < 0 or self.batch_per_class < 1:
            raise ValueError("DP needs clip > 0, noise multiplier >= 0 and batch_per_class >= 1")
        # Sampling and the per-class bookkeeping run on host copies: a step reads nothing back
        # from the device.
        self.y_host = host_copy(self.y)
        counts = torch.bincount(self.y_host, minlength=self.num_classes)
        self.counts = counts
        self._labels: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.rates = (self.batch_per_class / counts.clamp_min(1).double()).clamp(max=1.0)
        self.rates[counts == 0] = 0.0
        # Amplification by sampling is monotone in q, so the largest class rate bounds them all.
        self.sample_rate = float(self.rates.max())
        if self.delta is None:
            self.delta = default_delta(len(self.y))
        if not 0 < self.delta < 1:
            raise ValueError(f"DP delta must be in (0, 1), got {self.delta}")
        self.last_norms: torch.Tensor | None = None

    def _class_slots(self, labels: torch.Tensor) -> list[torch.Tensor]:
        """Each class's rows of the synthetic set (host indices), read from the device once:
        the labels do not change while the images are optimised."""
        if self._labels is None or self._labels[0] is not labels:
            y = host_copy(labels)
            self._labels = (labels, [(y == c).nonzero().flatten()
                                     for c in range(self.num_classes)])
        return self._labels[1]

    def privacy_spent(self, steps: int) -> tuple[float, float]:
        """(epsilon, delta) after `steps` steps, from the accountant."""
        assert self.delta is not None
        return compute_epsilon(self.noise_multiplier, self.sample_rate, steps, self.delta,
                               self.accountant), self.delta

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.extractor(generator)
        if has_batch_stats(model):
            check_dp_setup("noise", model)  # raises: per-sample clipping does not hold with BN
        def features(x: torch.Tensor) -> torch.Tensor:
            return embedding_and_logits(model, x) if self.logits else model.embed(x)

        u = torch.rand(len(self.y), generator=generator, device=generator.device,
                       dtype=torch.float64)
        take = (u < self.rates[self.y_host]).nonzero().flatten()   # on the host
        yr = self.y_host[take]
        xr = self.x[to_device(take, self.x.device)]
        with torch.no_grad():
            zr = features(xr) if len(yr) else images.new_zeros((0, 1))
        grad = torch.zeros_like(images)
        loss = images.new_zeros(())
        norms_all = []
        for c, slots in enumerate(self._class_slots(labels)):
            if len(slots) == 0 or int(self.counts[c]) == 0:
                continue
            expected = float(self.rates[c]) * int(self.counts[c])
            slots = to_device(slots, images.device)
            block = images[slots].detach()
            zc = zr[to_device((yr == c).nonzero().flatten(), zr.device)]
            with torch.no_grad():
                mu_s = features(block).mean(0)
            # Per-sample loss gradient w.r.t. mu_s: d||e_i - mu_s||^2 / d mu_s = -2 (e_i - mu_s).
            v = -2.0 * (zc - mu_s)
            if len(zc):
                loss = loss + ((zc.mean(0) - mu_s) ** 2).sum()
            if self.space == "image":
                total = torch.zeros_like(block)
                for i in range(0, len(v), self.chunk):
                    g = per_sample_image_grads(model, block, v[i : i + self.chunk], features)
                    g, norms = clip_rows(g, self.clip)
                    total += g.sum(0)
                    norms_all.append(norms)
                noise = torch.randn(block.shape, generator=generator, device=generator.device) * (
                    self.noise_multiplier * self.clip)
                # Drawn on the CPU generator (the same noise on every device), added on the
                # device.
                grad[slots] = (total + to_device(noise, total.device)) / expected
            else:
                vc, norms = clip_rows(v, self.clip)
                norms_all.append(norms)
                noise = torch.randn(v.shape[1], generator=generator, device=generator.device) * (
                    self.noise_multiplier * self.clip)
                u = (vc.sum(0) + to_device(noise, vc.device)) / expected
                leaf = block.clone().requires_grad_(True)
                (g,) = torch.autograd.grad(features(leaf).mean(0), leaf, grad_outputs=u)
                grad[slots] = g
        self.last_norms = torch.cat(norms_all) if norms_all else images.new_zeros(0)
        return loss, grad

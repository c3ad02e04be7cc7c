"""Differentially private distribution matching (DESA DP-DM, done with per-sample clipping).

Mechanism per step: every real image of class c is included independently with probability
q_c = min(1, batch/n_c) (Poisson sampling); each included image i contributes the gradient of its
own loss ||e(x_i) - mean e(syn_c)||^2 w.r.t. the synthetic images of its class (the average of these
is exactly the DM gradient); every contribution is clipped to L2 norm <= C, summed, Gaussian noise
N(0, (sigma*C)^2) is added to every synthetic pixel, and the sum is divided by the expected batch
size. Privacy is accounted by Opacus' RDP (or PRV) accountant for `steps` compositions of the
sampled Gaussian mechanism with rate max_c q_c (add/remove adjacency).

The guarantee covers the released images only when nothing else in them depends on private
data: the synthetic set must start from noise (`check_dp_setup` refuses real-image and
class-statistics initialisations), and the feature extractor must not normalise with batch
statistics (BatchNorm in train mode mixes every sample of a batch into every output, so clipping
one sample's gradient does not bound its influence). The default delta is 1/(10 N), below 1/N:
a mechanism that publishes each record with probability 1/N is (0, 1/N)-DP and still expects
to leak one record in the clear.

DP-SGD (Abadi et al. 2016) of a model's local training, the same mechanism on model weights
(`dp_sgd_train`): every step includes each of the n records independently with probability
q = min(1, batch/n), takes every included record's cross-entropy gradient (Opacus'
`GradSampleModule`), clips it to joint L2 norm <= C over all parameters, sums, adds
N(0, (sigma C)^2) per coordinate and divides by the expected batch size q n (`privatise`).
Terms that read no data (a proximal pull, weight decay, control-variate corrections) are added
after privatisation: they are post-processing. `noise_multiplier_for` inverts the accountant.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedvl.core.training import LossTerm, TrainConfig, TrainStats, check_round_config, num_batches
from fedvl.distill.synthesize import ExtractorSampler, has_batch_stats

ACCOUNTANTS = ("rdp", "prv")
SPACES = ("image", "feature")
# Initialisations whose first pixels do not depend on private data.
DP_INITS = ("noise",)


def default_delta(n: int) -> float:
    """The default DP delta for a dataset of `n` records: 1 / (10 n)."""
    return 1.0 / (10 * max(n, 1))


def check_dp_setup(init: str, model: torch.nn.Module) -> None:
    """Refuse DP settings whose reported epsilon would not hold, with one clear error."""
    if init not in DP_INITS:
        raise ValueError(f"differential privacy needs init 'noise'; init '{init}' starts the "
                         "released images from private data (real images or class "
                         "statistics), which the privacy accounting does not cover")
    check_dp_model(model)


def check_dp_model(model: torch.nn.Module) -> None:
    """Refuse a network whose per-sample gradients do not bound one sample's influence."""
    if has_batch_stats(model):
        raise ValueError("differential privacy cannot use a network with BatchNorm: batch "
                         "statistics mix every sample into every output, so per-sample clipping "
                         "does not bound one sample's influence; use norm 'instance', 'group', "
                         "'layer' or 'none'")


def compute_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                    accountant: str = "rdp") -> float:
    """Epsilon spent by `steps` sampled-Gaussian steps, from an Opacus accountant."""
    if accountant == "rdp":
        from opacus.accountants import RDPAccountant

        acc = RDPAccountant()
    elif accountant == "prv":
        from opacus.accountants import PRVAccountant

        acc = PRVAccountant()
    else:
        raise ValueError(f"unknown accountant '{accountant}'; allowed: {', '.join(ACCOUNTANTS)}")
    if steps == 0:
        return 0.0
    acc.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    return float(acc.get_epsilon(delta=delta))


def noise_multiplier_for(epsilon: float, delta: float, sample_rate: float, steps: int,
                         accountant: str = "rdp", tolerance: float = 0.01) -> float:
    """The smallest noise multiplier (to `tolerance` in epsilon) whose `steps` sampled-Gaussian
    steps at `sample_rate` spend at most `epsilon` at `delta` (Opacus' bisection)."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant '{accountant}'; allowed: {', '.join(ACCOUNTANTS)}")
    if not epsilon > 0 or not 0 < delta < 1 or not 0 < sample_rate <= 1 or steps < 1:
        raise ValueError(f"a noise multiplier needs epsilon > 0, delta in (0, 1), sample rate "
                         f"in (0, 1] and steps >= 1; got epsilon {epsilon}, delta {delta}, "
                         f"sample rate {sample_rate}, steps {steps}")
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta,
                                      sample_rate=sample_rate, steps=steps,
                                      accountant=accountant, epsilon_tolerance=tolerance))


def clip_rows(g: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale every row (sample) of g [N, ...] to L2 norm <= clip; returns (clipped, norms)."""
    # An explicit row size: a batch of zero rows (an empty Poisson draw) has norms of shape [0].
    norms = g.reshape(len(g), math.prod(g.shape[1:])).norm(dim=1)
    scale = (clip / (norms + 1e-12)).clamp(max=1.0)
    return g * scale.view(-1, *([1] * (g.dim() - 1))), norms


def embedding_and_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[embed(x), logits(x)] per row: matching its mean matches both means (FedDM's loss)."""
    return torch.cat(model.features_and_logits(x), dim=1)


def per_sample_image_grads(model: torch.nn.Module, block: torch.Tensor, v: torch.Tensor,
                           features: Callable[[torch.Tensor], torch.Tensor] | None = None
                           ) -> torch.Tensor:
    """G[i] = d<mean features(block), v_i>/d block for every row v_i, by one batched backward.

    `features` defaults to `model.embed`. The block is replicated once per row so an ordinary
    forward/backward of len(v) copies yields all per-sample gradients (exact for per-sample
    normalisation; BN must be in eval mode).
    """
    f = features if features is not None else model.embed
    n, m = len(v), len(block)
    copies = block.detach().unsqueeze(0).repeat(n, 1, 1, 1, 1).requires_grad_(True)
    z = f(copies.reshape(n * m, *block.shape[1:])).reshape(n, m, -1).mean(1)
    (g,) = torch.autograd.grad((z * v).sum(), copies)
    return g


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
        counts = torch.bincount(self.y, minlength=self.num_classes)
        self.counts = counts
        self.rates = (self.batch_per_class / counts.clamp_min(1).double()).clamp(max=1.0)
        self.rates[counts == 0] = 0.0
        # Amplification by sampling is monotone in q, so the largest class rate bounds them all.
        self.sample_rate = float(self.rates.max())
        if self.delta is None:
            self.delta = default_delta(len(self.y))
        if not 0 < self.delta < 1:
            raise ValueError(f"DP delta must be in (0, 1), got {self.delta}")
        self.last_norms: torch.Tensor | None = None

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

        u = torch.rand(len(self.y), generator=generator, dtype=torch.float64)
        take = u < self.rates[self.y]
        xr, yr = self.x[take], self.y[take]
        with torch.no_grad():
            zr = features(xr) if len(yr) else torch.zeros(0, 1)
        grad = torch.zeros_like(images)
        loss = images.new_zeros(())
        norms_all = []
        for c in range(self.num_classes):
            slots = (labels == c).nonzero().flatten()
            if len(slots) == 0 or int(self.counts[c]) == 0:
                continue
            expected = float(self.rates[c]) * int(self.counts[c])
            block = images[slots].detach()
            zc = zr[yr == c]
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
                noise = torch.randn(block.shape, generator=generator) * (
                    self.noise_multiplier * self.clip)
                grad[slots] = (total + noise) / expected
            else:
                vc, norms = clip_rows(v, self.clip)
                norms_all.append(norms)
                noise = torch.randn(v.shape[1], generator=generator) * (
                    self.noise_multiplier * self.clip)
                u = (vc.sum(0) + noise) / expected
                leaf = block.clone().requires_grad_(True)
                (g,) = torch.autograd.grad(features(leaf).mean(0), leaf, grad_outputs=u)
                grad[slots] = g
        self.last_norms = torch.cat(norms_all) if norms_all else torch.zeros(0)
        return loss, grad


# -- DP-SGD of local training ------------------------------------------------------------------
def poisson_batch(n: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of the records one Poisson-sampled step includes (each with probability rate)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device)
    return (u < rate).nonzero().flatten()


def privatise(per_sample: Sequence[torch.Tensor], clip: float, noise_multiplier: float,
              expected_batch: float, generator: torch.Generator
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The DP-SGD gradient from per-sample gradients (one [B, *shape] tensor per parameter).

    Each sample's gradient, all parameters together, is clipped to L2 norm <= clip; the clipped
    gradients are summed, one N(0, (noise_multiplier * clip)^2) vector over all coordinates (in
    parameter order, drawn from `generator` on its device) is added, and the sum is divided by
    `expected_batch`. Returns the gradient per parameter and the per-sample norms before
    clipping.
    """
    b = per_sample[0].shape[0]
    sizes = [math.prod(g.shape[1:]) for g in per_sample]
    flat = torch.cat([g.reshape(b, size) for g, size in zip(per_sample, sizes, strict=True)],
                     dim=1)
    clipped, norms = clip_rows(flat, clip)
    noise = torch.randn(flat.shape[1], generator=generator, dtype=flat.dtype,
                        device=generator.device) * (noise_multiplier * clip)
    total = (clipped.sum(0) + noise.to(flat.device)) / expected_batch
    return [t.view(g.shape[1:]) for t, g in zip(total.split(sizes), per_sample, strict=True)
            ], norms


class PerSampleGradients:
    """Per-sample cross-entropy gradients of a model's trainable parameters (Opacus hooks).

    Opacus' `GradSampleModule` computes them from each layer's activations and backprops in one
    ordinary backward pass (exact for linear, convolution and per-sample normalisation layers;
    Opacus falls back to `torch.func` for others). Its full backward hooks cannot see through
    in-place activations, so those modules compute out of place while wrapped: the same
    numbers. `close` restores the model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from opacus import GradSampleModule

        check_dp_model(model)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._inplace = [m for m in model.modules() if getattr(m, "inplace", False) is True]
        for m in self._inplace:
            m.inplace = False  # type: ignore[assignment]
        # The inputs need no gradient, so torch notes that the first layer's hook sees only
        # output gradients, which is all Opacus reads: the note says nothing about the result.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients "
                                "are computed with respect to module outputs")
        self.wrapped = GradSampleModule(model, batch_first=True, loss_reduction="sum")

    def __call__(self, x: torch.Tensor, y: torch.Tensor
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(per-parameter [B, *shape] gradients of each sample's own loss, per-sample losses)."""
        for p in self.params:
            p.grad_sample = None  # type: ignore[attr-defined]
            p.grad = None
        if len(y) == 0:
            return [p.new_zeros((0, *p.shape)) for p in self.params], x.new_zeros(0)
        losses = F.cross_entropy(self.wrapped(x), y, reduction="none")
        losses.sum().backward()
        grads = [p.grad_sample.detach() for p in self.params]  # type: ignore[attr-defined]
        for p in self.params:
            p.grad_sample = None  # type: ignore[attr-defined]
            p.grad = None
        return grads, losses.detach()

    def close(self) -> None:
        """Remove the hooks and restore in-place activations."""
        self.wrapped._close()
        for m in self._inplace:
            m.inplace = True  # type: ignore[assignment]


def dp_sgd_train(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    generator: torch.Generator,
    noise_multiplier: float,
    clip: float,
    terms: Sequence[LossTerm] = (),
    after_step: Callable[[torch.nn.Module, float], None] | None = None,
) -> TrainStats:
    """Train `model` in place with DP-SGD on (x, y); returns the step counts.

    As many steps as `local_train` takes (`num_batches`), each on a Poisson sample at rate
    q = min(1, batch_size / n) with the gradient from `privatise` (expected batch q n). `terms`
    are data-independent objectives (they are called with zero data rows) whose gradient is
    added after privatisation; SGD's momentum and weight decay and `after_step` act on the
    privatised gradient only. Every draw (samples, then noise, per step) comes from `generator`.
    """
    check_round_config(cfg)
    if clip <= 0 or noise_multiplier < 0:
        raise ValueError(f"DP-SGD needs clip > 0 and noise multiplier >= 0; got clip {clip}, "
                         f"noise multiplier {noise_multiplier}")
    check_dp_model(model)
    n = len(y)
    if n == 0:
        return TrainStats(0, 0, 0.0)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    rate = min(1.0, cfg.batch_size / n)
    per_sample = PerSampleGradients(model)
    steps = samples = 0
    loss_sum = 0.0
    try:
        for _ in range(num_batches(n, cfg.batch_size, cfg.local_epochs, cfg.local_steps)):
            idx = poisson_batch(n, rate, generator).to(x.device)
            grads, losses = per_sample(x[idx], y[idx])
            private, _ = privatise(grads, clip, noise_multiplier, rate * n, generator)
            extra = _term_gradients(model, per_sample.params, terms, x, y)
            for p, g, e in zip(per_sample.params, private, extra, strict=True):
                p.grad = g if e is None else g + e
            opt.step()
            if after_step is not None:
                after_step(model, cfg.lr)
            steps += 1
            samples += len(idx)
            loss_sum += float(losses.mean()) if len(losses) else 0.0
    finally:
        per_sample.close()
    return TrainStats(steps, samples, loss_sum / max(steps, 1))


def _term_gradients(model: torch.nn.Module, params: list[torch.Tensor],
                    terms: Sequence[LossTerm], x: torch.Tensor, y: torch.Tensor
                    ) -> list[torch.Tensor | None]:
    """Gradients of the data-independent terms; each term sees zero rows of data."""
    if not terms:
        return [None] * len(params)
    none = x.new_zeros(0)
    loss = sum(term(model, x[:0], y[:0], none, none) for term in terms)  # type: ignore[arg-type]
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return [None] * len(params)
    return list(torch.autograd.grad(loss, params, allow_unused=True))

"""FedGen (Zhu, Hong & Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated
Learning", ICML 2021): FedAvg whose clients are regularised by a server-learned generator of
features. Losses and defaults follow the reference code (zhuangdizhu/FedGen, MNIST settings).

Round t (h = the model's classifier head, G_w(z, y) a feature of h's input size):
  server -> clients: w_t; from round 1 on also G_w (`generator`) and the label counts it was
                     trained for (`statistics`).
  client k: SGD from w_t on  CE(f(x), y)
              + beta_t KL(softmax(h(G(z, y))) || softmax(f(x)))                 (same labels)
              + (gen_batch / B) alpha_t CE(h(G(z', y')), y'),  y' over the federation's labels
            with alpha_t = max(1e-4, alpha decay^t) (beta_t alike); G is frozen, its features
            go through h only. Uploads w_k, n_k and its label counts c_k (`statistics`).
  server: w_{t+1} = sum_k p_k w_k (FedAvg); then `server_steps` Adam steps on G minimising
            sum_k mean_i a_{y_i,k} CE(h_k(G(z_i, y_i)), y_i) + eta L_div(z, G(z, y)),
            a_{y,k} = c_k[y] / sum_j c_j[y], h_k the head inside client k's uploaded weights,
            L_div = exp(-mean_ij ||z_i - z_j||^2 ||G_i - G_j||_1) (dimension-averaged norms).

Deviations from the reference code: z ~ N(0, I) as in the paper (the code draws U[0, 1);
`noise=uniform`); a client uploads the label counts of its training set (the code counts the
labels of the batches it drew, each count starting at 1), so a head never teaches a label its
client lacks; clients draw y' among the labels the last round's clients hold (the code: all
labels of the dataset); a weight set to 0 switches its term off (the code floors it at 1e-4);
the code's adversarial student term (ensemble_beta, 0 by default) and its 20-epoch cut-off of
the regulariser are not implemented; clients train with the run's optimiser. The generator loss
is the code's label-weighted CE of each head; the paper writes CE of the heads' averaged logits
(`teacher=mean-logits`, with the same label weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.algorithms.base import ClientContext, ServerContext, ServerState
from fedvl.algorithms.fedavg import FedAvg
from fedvl.algorithms.vhl import derived_generator
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.core.training import LossTerm, TrainStats
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm
from fedvl.seeding import run_seed, seeded

# Server stream of the generator's training draws (labels and noise), run stream of its init,
# and the purpose of a client's generated batches: a generator derived from the client's, so the
# real batches come in FedAvg's order.
GENERATOR_STREAM = 107
# The reference floors the decayed client weights at this value.
MIN_WEIGHT = 1e-4
LABEL_DRAWS = ("uniform", "prior")
NOISE_DRAWS = ("normal", "uniform")
TEACHERS = ("per-head", "mean-logits")


class FeatureGenerator(nn.Module):
    """G_w(z, y): noise and a label code through Linear-BatchNorm-ReLU-Linear to a feature."""

    def __init__(self, num_classes: int, feature_dim: int, noise_dim: int = 32,
                 hidden_dim: int = 256, embedding: bool = False) -> None:
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise_dim
        self.label_code = nn.Embedding(num_classes, noise_dim) if embedding else None
        width = noise_dim + (noise_dim if embedding else num_classes)
        self.body = nn.Sequential(nn.Linear(width, hidden_dim), nn.BatchNorm1d(hidden_dim),
                                  nn.ReLU(), nn.Linear(hidden_dim, feature_dim))

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Features for noise `z` (n x noise_dim) and labels `y` (n)."""
        if self.label_code is not None:
            code = self.label_code(y)
        else:
            code = F.one_hot(y, self.num_classes).to(z.dtype)
        return self.body(torch.cat([z, code], dim=1))


def draw_noise(n: int, dim: int, kind: str, gen: torch.Generator,
               device: torch.device) -> torch.Tensor:
    """n noise vectors from N(0, I) (`normal`) or U[0, 1) (`uniform`), drawn from `gen`."""
    z = torch.randn(n, dim, generator=gen, device=gen.device) if kind == "normal" else torch.rand(
        n, dim, generator=gen, device=gen.device)
    return z.to(device)


def draw_labels(counts: torch.Tensor, n: int, kind: str, gen: torch.Generator,
                device: torch.device) -> torch.Tensor:
    """n labels: uniform over the labels with a positive count, or in proportion to counts."""
    held = counts.float().cpu().clamp(min=0)
    probs = (held > 0).float() if kind == "uniform" else held
    return torch.multinomial(probs, n, replacement=True, generator=gen).to(device)


DIVERSITY_METRICS = ("l1", "l2")


def diversity_loss(z: torch.Tensor, g: torch.Tensor, metric: str = "l1") -> torch.Tensor:
    """exp(-mean_ij d2(z_i, z_j) d(g_i, g_j)): small when distant noises give distant outputs;
    d the dimension-averaged absolute (`l1`, FedGen's) or squared (`l2`) difference of rows."""
    if metric not in DIVERSITY_METRICS:
        raise ValueError(f"unknown diversity metric '{metric}'; allowed: "
                         f"{', '.join(DIVERSITY_METRICS)}")
    noise_dist = (z[:, None, :] - z[None, :, :]).pow(2).mean(2)
    if metric == "l1":
        out_dist = (g[:, None, :] - g[None, :, :]).abs().mean(2)
    else:
        # ||g_i||^2 + ||g_j||^2 - 2 g_i.g_j: one matrix product instead of an n x n x d tensor
        # (images have thousands of dimensions); rounding can leave the diagonal a hair below 0.
        sq = g.pow(2).sum(1)
        out_dist = ((sq[:, None] + sq[None, :] - 2 * g @ g.t()) / g.shape[1]).clamp(min=0)
    return torch.exp(-(noise_dist * out_dist).mean())


def label_weights(counts: torch.Tensor) -> torch.Tensor:
    """a[y, k] = c_k[y] / sum_j c_j[y] from counts (clients x classes); 0 where no one has y."""
    c = counts.float().clamp(min=0).t()
    return c / c.sum(1, keepdim=True).clamp(min=1e-12)


def teacher_loss(heads: Sequence[FedModel], weights: torch.Tensor, g: torch.Tensor,
                 y: torch.Tensor, teacher: str = "per-head") -> torch.Tensor:
    """How badly the label-weighted heads classify features `g` as `y`.

    `per-head` (reference): sum_k mean_i a[y_i, k] CE(h_k(g_i), y_i); `mean-logits` (the paper's
    ensemble): mean_i CE(sum_k a[y_i, k] h_k(g_i), y_i).
    """
    a = weights[y].t()                                  # clients x n
    logits = torch.stack([h.head(g) for h in heads])   # clients x n x outputs
    if teacher == "mean-logits":
        return F.cross_entropy((a.unsqueeze(2) * logits).sum(0), y)
    # One cross-entropy over every head's rows: few small kernels per step.
    ce = F.cross_entropy(logits.flatten(0, 1), y.repeat(len(heads)), reduction="none")
    return (a.flatten() * ce).sum() / len(y)


class GenerativeTerm:
    """FedGen's client regulariser: the head must classify generated features of the
    federation's labels, and predictions on real x follow the head's view of G(z, y)."""

    def __init__(self, generator: FeatureGenerator, counts: torch.Tensor, alpha: float,
                 beta: float, gen_batch: int, ratio: float, labels: str, noise: str,
                 rng: torch.Generator) -> None:
        self.g, self.counts, self.alpha, self.beta = generator.eval(), counts, alpha, beta
        self.gen_batch, self.ratio, self.labels, self.noise, self.rng = (gen_batch, ratio,
                                                                         labels, noise, rng)

    @torch.no_grad()
    def features(self, y: torch.Tensor) -> torch.Tensor:
        """G(z, y) for fresh noise; no gradient reaches the generator."""
        return self.g(draw_noise(len(y), self.g.noise_dim, self.noise, self.rng, y.device), y)

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        loss = logits.new_zeros(())
        if self.beta > 0:
            with torch.no_grad():
                target = F.softmax(model.head(self.features(y)), dim=1)
            loss = loss + self.beta * F.kl_div(F.log_softmax(logits, dim=1), target,
                                               reduction="batchmean")
        if self.alpha > 0:
            ys = draw_labels(self.counts, self.gen_batch, self.labels, self.rng, y.device)
            loss = loss + self.ratio * self.alpha * F.cross_entropy(
                model.head(self.features(ys)), ys)
        return loss


class UploadsLabelCounts(FedAvg):
    """FedAvg whose clients also upload the label counts of their training set (`statistics`):
    the server's data-free generators (FedGen, DFRD) weight each client per class by them."""

    payload_kinds = {"up": frozenset({"statistics"})}
    # Its label counts: bincount of its training labels.
    count_tensors = frozenset({"statistics/label_counts"})

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        spec.exact["statistics"] = {"label_counts": TensorSpec((self.env.num_classes,),
                                                                torch.float32)}
        spec.required |= {"statistics"}
        return spec

    def reply(self, model: FedModel, stats: TrainStats, msg: Message,
              client: ClientContext) -> Message:
        out = super().reply(model, stats, msg, client)
        counts = torch.bincount(client.y.cpu(), minlength=self.env.num_classes).float()
        out.arrays["statistics"] = {"label_counts": counts}
        return out

    @staticmethod
    def received_counts(replies: dict[int, Message]) -> torch.Tensor:
        """The replies' label counts (clients x classes, on the CPU, negatives as 0)."""
        return torch.stack([r.get("statistics")["label_counts"].float().cpu().clamp(min=0)
                            for r in replies.values()])


@register_algorithm("fedgen")
class FedGen(UploadsLabelCounts):
    """FedAvg plus a server-trained feature generator that regularises the clients' heads."""

    payload_kinds = {"down": frozenset({"generator", "statistics"})}

    @dataclass
    class Params:
        gen_alpha: float = option(10.0, "client weight of CE(head(G(z, y)), y) on generated "
                                  "features (reference 10)", ge=0)
        gen_beta: float = option(10.0, "client weight of KL(softmax(head(G(z, y))) || "
                                 "softmax(f(x))) for real (x, y) (reference 10)", ge=0)
        gen_decay: float = option(0.98, "per-round factor of gen_alpha and gen_beta "
                                  "(reference 0.98)", gt=0, le=1)
        gen_batch: int = option(32, "generated features per client step (reference 32)", ge=1)
        labels: str = option("uniform", "labels of generated features: uniform over the labels "
                             "the clients hold (reference) or prior (in proportion to their "
                             "counts, the paper's p(y))", choices=LABEL_DRAWS)
        noise: str = option("normal", "generator noise: normal N(0, I) (paper) or uniform "
                            "U[0, 1) (reference code)", choices=NOISE_DRAWS)
        noise_dim: int = option(32, "generator noise size (reference 32)", ge=1, le=65536)
        hidden_dim: int = option(256, "generator hidden width (reference 256)", ge=1,
                                 le=65536)
        embedding: bool = option(False, "learned label embedding instead of one-hot "
                                 "(reference: one-hot)")
        server_steps: int = option(50, "generator Adam steps per round (reference 50)", ge=0)
        server_batch: int = option(32, "labels per generator step (reference 32)", ge=2)
        server_lr: float = option(3e-4, "generator Adam learning rate (reference 3e-4)", gt=0)
        server_weight_decay: float = option(1e-2, "generator weight decay (reference 1e-2)",
                                            ge=0)
        server_decay: float = option(0.98, "per-round factor of server_lr (reference 0.98)",
                                     gt=0, le=1)
        eta: float = option(1.0, "weight of the generator's diversity loss (reference 1)",
                            ge=0)
        teacher: str = option("per-head", "generator loss: per-head (reference: label-weighted "
                              "CE of each head) or mean-logits (CE of the label-weighted "
                              "logits, the paper's ensemble)", choices=TEACHERS)

    # -- the generator ---------------------------------------------------------------------------
    def new_generator(self, device: torch.device | None = None) -> FeatureGenerator:
        """A generator for the run's model, initialised from the run seed."""
        cache = self.__dict__.setdefault("_feature_dim", {})
        if "dim" not in cache:
            cache["dim"] = self.new_model().feature_dim
        with seeded(run_seed(self.env.seed, GENERATOR_STREAM)):
            gen = FeatureGenerator(self.env.num_classes, cache["dim"],
                                   self.p.noise_dim, self.p.hidden_dim, self.p.embedding)
        return gen.to(device if device is not None else self.env.device)

    def load_generator(self, weights: dict[str, torch.Tensor],
                       device: torch.device) -> FeatureGenerator:
        """A generator carrying `weights`."""
        gen = self.new_generator(device)
        gen.load_state_dict(weights)
        return gen

    # -- server ----------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        return {**super().server_init(),
                "generator": clone_state(self.new_generator().state_dict()),
                "generator_optimizer": None, "label_counts": None, "generator_loss": None}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        arrays: dict[str, Any] = {"weights": state["model"]}
        if state["label_counts"] is not None:   # G has been trained at least once
            arrays["generator"] = state["generator"]
            arrays["statistics"] = {"label_counts": state["label_counts"]}
        msg = Message(arrays)
        return {c: msg for c in clients}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        state = super().aggregate(state, ctx, replies)
        counts = self.received_counts(replies)
        if not bool((counts.sum(0) > 0).any()):   # no label to teach: keep the last generator
            return state
        device = ctx.device
        heads = [self.load_model(r.get("weights"), device).eval().requires_grad_(False)
                 for r in replies.values()]
        gen = self.load_generator(state["generator"], device)
        opt = torch.optim.Adam(gen.parameters(), lr=self.p.server_lr,
                               weight_decay=self.p.server_weight_decay)
        if state["generator_optimizer"] is not None:
            opt.load_state_dict(state["generator_optimizer"])
        for group in opt.param_groups:   # the reference's ExponentialLR, stepped once a round
            group["lr"] = self.p.server_lr * self.p.server_decay ** ctx.round
        losses = self.train_generator(gen, opt, heads, counts, ctx.stream(GENERATOR_STREAM))
        return {**state, "generator": clone_state(gen.state_dict()),
                "generator_optimizer": opt.state_dict(), "label_counts": counts.sum(0),
                "generator_loss": losses[-1] if losses else None}

    def train_generator(self, gen: FeatureGenerator, opt: torch.optim.Optimizer,
                        heads: Sequence[FedModel], counts: torch.Tensor,
                        rng: torch.Generator) -> list[float]:
        """`server_steps` steps of ensemble distillation into `gen`; the loss of each step
        (kept on the device and read once, after the last step)."""
        p = self.p
        device = next(gen.parameters()).device
        weights = label_weights(counts).to(device)
        total = counts.sum(0)
        gen.train()
        losses: list[torch.Tensor] = []
        for _ in range(p.server_steps):
            y = draw_labels(total, p.server_batch, p.labels, rng, device)
            z = draw_noise(p.server_batch, p.noise_dim, p.noise, rng, device)
            g = gen(z, y)
            loss = teacher_loss(heads, weights, g, y, p.teacher)
            if p.eta > 0:
                loss = loss + p.eta * diversity_loss(z, g)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses).tolist() if losses else []

    def report(self, state: ServerState) -> dict[str, Any]:
        return {"generator_loss": state.get("generator_loss")}

    # -- client ----------------------------------------------------------------------------------
    def loss_terms(self, model: FedModel, msg: Message,
                   client: ClientContext) -> Sequence[LossTerm]:
        p = self.p
        if "generator" not in msg.arrays:
            return ()
        decay = p.gen_decay ** client.round
        alpha = max(MIN_WEIGHT, p.gen_alpha * decay) if p.gen_alpha > 0 else 0.0
        beta = max(MIN_WEIGHT, p.gen_beta * decay) if p.gen_beta > 0 else 0.0
        if alpha == 0 and beta == 0:
            return ()
        gen = self.load_generator(msg.get("generator"), client.device)
        ratio = p.gen_batch / self.client_train(client).batch_size
        return (GenerativeTerm(gen, msg.get("statistics")["label_counts"], alpha, beta,
                               p.gen_batch, ratio, p.labels, p.noise,
                               derived_generator(client, GENERATOR_STREAM)),)

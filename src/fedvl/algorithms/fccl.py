"""FCCL (Huang, Ye & Du, CVPR 2022): federated cross-correlation and non-forgetting distillation
on an unlabelled public set; each client keeps its own model (any architecture).

Client k keeps its model f_k and two frozen teachers (softmax outputs p = softmax(f(x))):
  intra-domain teacher f_k^intra: f_k trained on its own data alone before its first round
      (`pretrain_epochs` epochs of Adam(`pretrain_lr`) on CE, learning rate on a cosine from
      `pretrain_lr` to 1e-6); f_k starts from it; fixed for the run.
  inter-domain teacher f_k^inter: f_k as it ended its previous round, i.e. before this round's
      collaborative updating (in the first round: the pretrained model).
Round r:
  server -> client: Zbar, the mean of the clients' logits on the public set (`--public`) as they
      uploaded them last round (nothing in the first round).
  client k (from f_k as it ended its previous round, pretrained at its first round):
    (1) collaborative updating (when Zbar came): `public_epochs` shuffled passes over the public
        set in batches of B = `public_batch`; per batch, with Z = f_k(x) (train mode) and
        T = Zbar[batch], each standardised per logit dimension with the batch's mean and
        (unbiased) standard deviation:
          C = Zhat^T That / B;  L_col = sum_i (C_ii - 1)^2 + w sum_{i != j} (C_ij + 1)^2
        (w = `off_diag_weight`); one step of a fresh Adam(`public_lr`) per batch.
    (2) local updating, Federated Non-Forgetting Distillation: the run's local training on its
        data with CE(f_k(x), y) + KL(p_intra || p_k) + KL(p_inter || p_k) (temperature 1,
        batch-mean KL, teachers in eval mode).
    uploads f_k's logits (eval mode) on the public set; keeps f_k (next round's inter teacher).
  server: Zbar = the plain mean of this round's uploaded logits (FedDF's server half).
The reference computes, in one process, the mean over every client's current model on each
public batch; here every batch's target comes from the models as they ended the previous round
(what a client can know without one message per public batch), so the first round, which has no
target yet, skips the collaborative step that the reference takes with the pretrained models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedvl.algorithms.base import ClientContext
from fedvl.algorithms.feddf import FedDF, public_logits
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.training import batch_indices, local_train
from fedvl.distill.losses import distillation_kl
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm

# The cosine schedule's floor of the pretraining (the reference's `lr_min`).
PRETRAIN_LR_MIN = 1e-6
# Where the intra-domain teacher lives in the client's state: the `weights` kind, its entries
# under this prefix beside the model's own ("/" cannot occur in a module's parameter names).
INTRA = "intra/"
# A logit dimension constant over a batch has standard deviation 0: it standardises to 0
# instead of 0/0 (a NaN would poison the model for good); any real spread is far above this.
STD_FLOOR = 1e-12


def standardise(z: torch.Tensor) -> torch.Tensor:
    """Each column of z [B, C] minus its batch mean, over its (unbiased) batch std."""
    return (z - z.mean(0)) / z.std(0).clamp_min(STD_FLOOR)


def cross_correlation_loss(own: torch.Tensor, target: torch.Tensor,
                           off_diag_weight: float) -> torch.Tensor:
    """FCCL's collaborative loss from logits [B, C]: C = std(own)^T std(target) / B;
    sum_i (C_ii - 1)^2 + off_diag_weight * sum_{i != j} (C_ij + 1)^2."""
    c = standardise(own).T @ standardise(target) / own.shape[0]
    eye = torch.eye(c.shape[0], dtype=torch.bool, device=c.device)
    on_diag = (c.diagonal() - 1).pow(2).sum()
    off_diag = (c[~eye] + 1).pow(2).sum()
    return on_diag + off_diag_weight * off_diag


class NonForgettingTerm:
    """KL(p_intra || p) + KL(p_inter || p) at temperature 1 (batch mean), frozen teachers."""

    def __init__(self, intra: FedModel, inter: FedModel) -> None:
        self.intra, self.inter = intra.eval(), inter.eval()
        for teacher in (self.intra, self.inter):
            teacher.requires_grad_(False)

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t_intra, t_inter = self.intra(x), self.inter(x)
        return distillation_kl(logits, t_intra) + distillation_kl(logits, t_inter)


def cosine_lr(lr: float, epoch: int, epochs: int) -> float:
    """The pretraining's learning rate in epoch `epoch` (0-based) of `epochs`: a cosine from
    `lr` to PRETRAIN_LR_MIN, one epoch late (the reference steps its scheduler with the index
    of the epoch just finished, so epochs 0 and 1 both train at `lr`)."""
    t = max(epoch - 1, 0)
    return PRETRAIN_LR_MIN + 0.5 * (lr - PRETRAIN_LR_MIN) * (1 + math.cos(math.pi * t / epochs))


def pretrain(model: FedModel, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int,
             lr: float, gen: torch.Generator) -> None:
    """`epochs` shuffled passes of Adam on CE over (x, y), the rate on `cosine_lr`."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(epochs):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(lr, epoch, epochs)
        for idx in batch_indices(len(y), batch_size, 1, None, gen):
            idx = idx.to(x.device)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def split_state(weights: dict[str, torch.Tensor] | None
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A client's stored `weights` as (its model's state, its intra-domain teacher's state)."""
    own: dict[str, torch.Tensor] = {}
    intra: dict[str, torch.Tensor] = {}
    for k, v in (weights or {}).items():
        if k.startswith(INTRA):
            intra[k[len(INTRA):]] = v
        else:
            own[k] = v
    return own, intra


@register_algorithm("fccl")
class FCCL(FedDF):
    """Cross-correlation toward the clients' mean public logits, then local training that
    distils from the client's pretrained and previous-round models; each keeps its own model."""

    @dataclass
    class Params:
        public_epochs: int = option(1, "collaborative passes over the public set per round "
                                    "(reference 1)", ge=0)
        public_batch: int = option(256, "public batch size (reference 256)", ge=2)
        public_lr: float = option(0.001, "Adam learning rate of the collaborative step "
                                  "(reference 1e-3)", gt=0)
        off_diag_weight: float = option(0.0051, "weight w of the off-diagonal terms "
                                        "(C_ij + 1)^2 (reference 0.0051)", ge=0)
        pretrain_epochs: int = option(50, "epochs of local pretraining of the intra-domain "
                                      "teacher before a client's first round (reference 50)",
                                      ge=0)
        pretrain_lr: float = option(0.001, "Adam learning rate of the pretraining, on a "
                                    "cosine to 1e-6 (reference 1e-3)", gt=0)

    smoke_args = {"pretrain_epochs": 1}
    paper_run = {"rounds": 40, "local_epochs": 20, "batch_size": 128}

    def own_model(self, client: ClientContext) -> FedModel:
        model = self.client_new_model(client.cid).to(client.device)
        own, _ = split_state(client.state.arrays.get("weights"))
        if own:
            model.load_state_dict(own)
        return model

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        assert self.env.public_fn is not None
        p = self.p
        public = self.env.public_fn().to(client.device)
        model = self.own_model(client)
        own, intra_state = split_state(client.state.arrays.get("weights"))
        if not own:   # first round of this client: its intra-domain teacher, which f_k starts from
            pretrain(model, client.x, client.y, p.pretrain_epochs,
                     self.client_train(client).batch_size, p.pretrain_lr, client.generator)
            intra_state = clone_state(model.state_dict())
        intra = self._teacher(client, intra_state)
        inter = self._teacher(client, model.state_dict())
        if "logits" in msg.arrays and p.public_epochs > 0:
            self._collaborate(model, public, msg.arrays["logits"]["public"].to(client.device),
                              client.generator)
        stats = local_train(model, client.x, client.y, self.client_train(client),
                            client.generator, terms=(NonForgettingTerm(intra, inter),))
        client.state.arrays["weights"] = {**clone_state(model.state_dict()),
                                          **{INTRA + k: v for k, v in intra_state.items()}}
        return Message({"logits": {"public": public_logits(model, public)}},
                       {"num_examples": client.num_train, "steps": stats.steps,
                        "train_loss": stats.mean_loss})

    def _teacher(self, client: ClientContext, state: dict[str, torch.Tensor]) -> FedModel:
        """A model of the client's architecture carrying `state` (the term freezes it)."""
        teacher = self.client_new_model(client.cid).to(client.device)
        teacher.load_state_dict(state)
        return teacher

    def _collaborate(self, model: FedModel, x: torch.Tensor, target: torch.Tensor,
                     gen: torch.Generator) -> None:
        p = self.p
        model.train()
        for idx in batch_indices(len(x), p.public_batch, p.public_epochs, None, gen):
            if len(idx) < 2:   # a batch's standard deviation needs two rows
                continue
            idx = idx.to(x.device)
            loss = cross_correlation_loss(model(x[idx]), target[idx], p.off_diag_weight)
            # A fresh Adam every batch, as the reference makes one: each step is Adam's first.
            opt = torch.optim.Adam(model.parameters(), lr=p.public_lr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

"""DynaFed (Pi et al., "DynaFed: Tackling Client Data Heterogeneity with Global Dynamics",
CVPR 2023): FedAvg whose server, once, distils the global model's early trajectory into a small
pseudo set and from then on fine-tunes every new aggregate on it. Clients run plain FedAvg and
never see the pseudo set. Follows the public code (pipilurj/DynaFed: `run_end2end.py`,
`image_synthesizer.py`, `server.py`).

  every round t:  w <- average of the clients' models (FedAvg)
  until synthesis: keep the trajectory tau = (theta_0, theta_1, ...), the global parameters
                   after every round (theta_0 the initial model)
  round L (1-based; tau holds theta_0 .. theta_{L-1}), before fine-tuning, once:
      pseudo images X ~ N(0, 1) (C * ipc), label logits Y = label_init * one-hot, inner lr eta;
      `iterations` times:
        s ~ U{min_start .. min(max_start, L - 1 - M)}
        theta* = mean of k checkpoints drawn with replacement from theta_{s+1} .. theta_{s+M},
                 k ~ U{average_min .. min(average_max, M)}  (or theta_{s+M}: weight_averaging off)
        theta_hat = N SGD steps (lr eta) from theta_s on soft-label CE(f(A(X_B)), Y_B)
        loss = ||theta_hat - theta*||^2 / ||theta_s - theta*||^2
        one Adam step each on X (lr_img), Y (lr_label) and eta (lr_lr), through the unroll
  every round from L on: after averaging, `finetune_epochs` epochs of Adam (finetune_lr,
      batch finetune_batch, DSA) on soft-label CE over (X, Y); models with BatchNorm first
      refresh their running statistics with 3 forward passes in train mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedvl.algorithms.base import ServerContext, ServerState
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.training import batch_indices
from fedvl.distill.augment import DSAConfig, augment_batch
from fedvl.distill.trajectory import (
    inner_batches,
    soft_cross_entropy,
    trajectory_matching_loss,
    unroll_sgd,
)
from fedvl.models.base import FedModel, has_batch_stats
from fedvl.options import ConfigError, option
from fedvl.progress import emit, scope
from fedvl.registry import register_algorithm
from fedvl.timing import SYNTHESIS, timed

# Server random streams (ServerContext.stream ids): the synthesis (initial pixels, starts,
# targets, inner batches, augmentation) and each round's fine-tuning (batch order, DSA).
SYNTHESIS_STREAM = 307
FINETUNE_STREAM = 311
# The code's forward passes over the pseudo set in train mode before fine-tuning, which only
# BatchNorm's running statistics notice.
BN_REFRESH_PASSES = 3

Checkpoint = dict[str, torch.Tensor]


@dataclass
class PseudoSet:
    """The server's learnable pseudo data: images, label logits (softmax = soft labels) and
    the inner learning rate of the unrolled SGD, as leaf tensors with gradients."""

    images: torch.Tensor
    label_logits: torch.Tensor
    lr: torch.Tensor

    @classmethod
    def init(cls, ipc: int, num_classes: int, outputs: int, shape: tuple[int, ...],
             label_init: float, lr: float, generator: torch.Generator,
             device: torch.device) -> PseudoSet:
        """N(0, 1) images, `label_init` * one-hot logits (ipc per class), lr as given.

        The logits span the model's `outputs`, which an add-on may widen beyond the
        `num_classes` real classes (VHL's virtual classes); the one-hots are real classes.
        """
        y = torch.arange(num_classes, device="cpu").repeat_interleave(ipc)
        x = torch.randn(len(y), *shape, generator=generator, device=generator.device)
        logits = label_init * torch.nn.functional.one_hot(y, outputs).float()
        return cls(x.to(device).requires_grad_(True), logits.to(device).requires_grad_(True),
                   torch.tensor(float(lr), device=device).requires_grad_(True))


def pick_start(length: int, expert: int, min_start: int, max_start: int,
               gen: torch.Generator) -> int:
    """A start index s uniform in [min_start, min(max_start, length - 1 - expert)] (0 when that
    bound is 0, as the code does)."""
    hi = min(max_start, length - 1 - expert)
    if hi == 0:
        return 0
    return int(torch.randint(min_start, hi + 1, (1,), generator=gen, device=gen.device))


def pick_target(trajectory: list[Checkpoint], s: int, expert: int, averaging: bool,
                average_min: int, average_max: int, gen: torch.Generator) -> Checkpoint:
    """theta*: theta_{s+M}, or with averaging the uniform mean of k checkpoints drawn with
    replacement from theta_{s+1} .. theta_{s+M}, k uniform in [average_min, min(average_max, M)]."""
    if not averaging:
        return trajectory[s + expert]
    k = int(torch.randint(average_min, min(average_max, expert) + 1, (1,), generator=gen,
                          device=gen.device))
    picks = torch.randint(s + 1, s + expert + 1, (k,), generator=gen, device=gen.device).tolist()
    return {n: torch.stack([trajectory[i][n] for i in picks]).mean(0) for n in trajectory[s]}


@register_algorithm("dynafed")
class DynaFed(FedAvg):
    """FedAvg plus server-side fine-tuning on a pseudo set distilled from the global trajectory."""

    # Clients receive and send exactly FedAvg's weights: the pseudo set stays on the server.
    payload_kinds = {"down": frozenset({"weights"}), "up": frozenset({"weights"})}

    # Two checkpoints (theta_0, theta_1): the smoke preset's 2 rounds synthesise in round 2
    # and fine-tune its aggregate.
    smoke_args = {"trajectory_length": 2, "expert_rounds": 1, "average_min": 1, "syn_steps": 5,
                  "iterations": 10, "ipc": 2}
    # The public code's CIFAR-10 scripts (experiments/cifar10/*.sh): L = 25 checkpoints,
    # M = 3, N = 20, IPC 15, 3000 iterations, 20 fine-tuning epochs, 200 rounds.
    paper_args = {"trajectory_length": 25, "expert_rounds": 3, "syn_steps": 20, "ipc": 15,
                  "iterations": 3000, "finetune_epochs": 20}
    paper_run = {"rounds": 200}

    # Defaults are sized for the 20-round default run on a 2-core CPU; the public code's values
    # are in the help texts (`--preset paper` passes them).
    @dataclass
    class Params:
        trajectory_length: int = option(5, "global models theta_0 .. theta_{L-1} kept before "
                                        "the synthesis, which runs in round L (1-based) "
                                        "(public code: 25)", ge=2)
        expert_rounds: int = option(2, "rounds M between a start theta_s and its target "
                                    "(public code: 3)", ge=1)
        min_start: int = option(0, "earliest start checkpoint (public code: 0)", ge=0)
        max_start: int = option(50, "latest start checkpoint, capped at L - 1 - M (public "
                                "code: 50)", ge=0)
        weight_averaging: bool = option(True, "the target is the mean of k checkpoints drawn "
                                        "from theta_{s+1} .. theta_{s+M} (public scripts: on); "
                                        "off: theta_{s+M}")
        average_min: int = option(2, "least k averaged checkpoints (public code: 2)", ge=1)
        average_max: int = option(10, "most k averaged checkpoints, capped at M (public "
                                  "code: 10)", ge=1)
        syn_steps: int = option(10, "unrolled SGD steps N on the pseudo set (public code: 20)",
                                ge=1)
        ipc: int = option(10, "pseudo images per class (public code: 15)", ge=1)
        syn_batch: int = option(0, "pseudo images per inner step; 0: all (public code: all)",
                                ge=0)
        iterations: int = option(50, "trajectory-matching iterations (public code: 3000)",
                                 ge=0)
        lr_img: float = option(0.05, "Adam learning rate of the pseudo images (public code: "
                               "0.05)", gt=0)
        lr_label: float = option(0.01, "Adam learning rate of the label logits; 0 keeps them "
                                 "(public code: 0.01)", ge=0)
        lr_lr: float = option(1e-5, "Adam learning rate of the inner learning rate; 0 keeps "
                              "it (public code: 1e-5)", ge=0)
        lr_init: float = option(1.0, "initial inner learning rate eta (public scripts: "
                                "0.04)", gt=0)
        label_init: float = option(10.0, "initial label logits: label_init * one-hot; 0 starts "
                                   "every label uniform (public scripts: 0; its argparse "
                                   "default: 10)", ge=0)
        dsa: bool = option(True, "differentiable siamese augmentation of the pseudo images in "
                           "the unroll and the fine-tuning (public code: on)")
        finetune_epochs: int = option(20, "server fine-tuning epochs on the pseudo set per "
                                      "round (public code: 20 on CIFAR-10, 8 on CIFAR-100)",
                                      ge=0)
        finetune_lr: float = option(1e-4, "Adam learning rate of the fine-tuning (public "
                                    "code: 1e-4)", gt=0)
        finetune_batch: int = option(256, "fine-tuning batch size (public code: 256)", ge=1)

        def check(self) -> None:
            """Rules across options: a start and its target must fit in the trajectory."""
            last = self.trajectory_length - 1 - self.expert_rounds
            if last < 0:
                raise ConfigError(
                    f"dynafed option 'expert_rounds' = {self.expert_rounds} is invalid; must "
                    f"be <= trajectory_length - 1 = {self.trajectory_length - 1}")
            if last > 0 and self.min_start > min(self.max_start, last):
                raise ConfigError(
                    f"dynafed option 'min_start' = {self.min_start} is invalid; must be <= "
                    f"min(max_start, trajectory_length - 1 - expert_rounds) = "
                    f"{min(self.max_start, last)}")
            if self.weight_averaging and self.average_min > min(self.average_max,
                                                                self.expert_rounds):
                raise ConfigError(
                    f"dynafed option 'average_min' = {self.average_min} is invalid; must be <= "
                    f"min(average_max, expert_rounds) = "
                    f"{min(self.average_max, self.expert_rounds)} (or weight_averaging off)")

    # -- server ------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        state = super().server_init()
        # theta_0: the initial global parameters (the trajectory holds parameters, no buffers).
        state.update(trajectory=[self.checkpoint(state["model"])], pseudo_x=None,
                     pseudo_y=None, syn_lr=None, synthesis_round=None, matching_loss=None,
                     finetune_loss=None)
        return state

    def checkpoint(self, weights: Mapping[str, torch.Tensor]) -> Checkpoint:
        """The parameters of a global state dict, on the CPU: one point of the trajectory."""
        keys = self.parameter_keys()
        return {k: v.detach().cpu().clone() for k, v in weights.items() if k in keys}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        state = super().aggregate(state, ctx, replies)
        if state["pseudo_x"] is None and len(state["trajectory"]) >= self.p.trajectory_length:
            state = self.synthesize(state, ctx)
        if state["pseudo_x"] is None:
            return {**state, "trajectory": [*state["trajectory"],
                                            self.checkpoint(state["model"])]}
        model = self.load_model(state["model"], ctx.device)
        loss = self.finetune(model, state["pseudo_x"].to(ctx.device),
                             state["pseudo_y"].to(ctx.device), ctx.stream(FINETUNE_STREAM))
        return {**state, "model": clone_state(model.state_dict()), "finetune_loss": loss}

    def synthesize(self, state: ServerState, ctx: ServerContext) -> ServerState:
        """Trajectory matching on the stored global models; the trajectory is then dropped
        (nothing reads it again), the pseudo set and its inner lr kept."""
        p, device = self.p, ctx.device
        gen = ctx.stream(SYNTHESIS_STREAM)
        traj = [{n: t.to(device) for n, t in c.items()} for c in state["trajectory"]]
        # The unroll's template; the code's student net trains in train mode.
        model = self.new_model().to(device).train()
        pseudo = PseudoSet.init(p.ipc, self.env.num_classes, model.num_classes,
                                tuple(self.env.image_shape), p.label_init, p.lr_init, gen,
                                device)
        opt_img = torch.optim.Adam([pseudo.images], lr=p.lr_img)
        opt_label = torch.optim.Adam([pseudo.label_logits], lr=p.lr_label)
        opt_lr = torch.optim.Adam([pseudo.lr], lr=p.lr_lr)
        dsa = DSAConfig() if p.dsa else None
        n = len(pseudo.images)
        batch = p.syn_batch or n
        losses: list[float] = []
        with scope(phase="synthesis"), timed(SYNTHESIS):
            for it in range(p.iterations):
                s = pick_start(len(traj), p.expert_rounds, p.min_start, p.max_start, gen)
                target = pick_target(traj, s, p.expert_rounds, p.weight_averaging,
                                     p.average_min, p.average_max, gen)
                batches = inner_batches(n, batch, p.syn_steps, gen)
                augment = (lambda x: augment_batch(x, gen, dsa)) if dsa is not None else None
                end = unroll_sgd(model, traj[s], pseudo.images, pseudo.label_logits,
                                 pseudo.lr, batches, augment)
                loss = trajectory_matching_loss(end, traj[s], target)
                leaves = [pseudo.images, pseudo.label_logits, pseudo.lr]
                grads = torch.autograd.grad(loss, leaves)
                if not (torch.isfinite(loss) and all(bool(torch.isfinite(g).all())
                                                     for g in grads)):
                    # theta_s = theta* (a round that moved nothing) or an exploding unroll:
                    # this draw teaches nothing, so it leaves the pseudo set as it is.
                    emit(step=it + 1, total=p.iterations)
                    continue
                for leaf, g, opt in zip(leaves, grads, (opt_img, opt_label, opt_lr),
                                        strict=True):
                    leaf.grad = g
                    opt.step()
                    leaf.grad = None
                losses.append(float(loss.detach()))
                emit(step=it + 1, total=p.iterations)
        return {**state, "trajectory": [], "pseudo_x": pseudo.images.detach().cpu(),
                "pseudo_y": pseudo.label_logits.detach().cpu(),
                "syn_lr": float(pseudo.lr.detach()), "synthesis_round": ctx.round,
                "matching_loss": [losses[0], losses[-1]] if losses else None}

    def finetune(self, model: FedModel, x: torch.Tensor, label_logits: torch.Tensor,
                 gen: torch.Generator) -> float | None:
        """Fine-tune `model` in place on the pseudo set: soft-label CE, Adam, DSA; its mean
        loss (None without a step)."""
        p = self.p
        model.train()
        if has_batch_stats(model):
            with torch.no_grad():
                for idx in batch_indices(len(x), p.finetune_batch, BN_REFRESH_PASSES, None,
                                         gen):
                    model(x[idx.to(x.device)])
        opt = torch.optim.Adam(model.parameters(), lr=p.finetune_lr)
        dsa = DSAConfig() if p.dsa else None
        # Summed on the device in float64, as on the host: no step waits on the device.
        total, steps = torch.zeros((), dtype=torch.float64, device=x.device), 0
        for idx in batch_indices(len(x), p.finetune_batch, p.finetune_epochs, None, gen):
            idx = idx.to(x.device)
            xb = augment_batch(x[idx], gen, dsa) if dsa is not None else x[idx]
            loss = soft_cross_entropy(model(xb), label_logits[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach().double()
            steps += 1
        return float(total) / steps if steps else None

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The pseudo set, each image under its most likely label."""
        if state.get("pseudo_x") is None:
            return {}
        return {"dynafed_pseudo": (state["pseudo_x"], state["pseudo_y"].argmax(1))}

    def report(self, state: ServerState) -> dict[str, Any]:
        return {**super().report(state), "dynafed": {
            "synthesis_round": state.get("synthesis_round"),
            "matching_loss": state.get("matching_loss"),
            "syn_lr": state.get("syn_lr"), "finetune_loss": state.get("finetune_loss")}}

"""VFTL, virtual federated transfer learning (Tang et al., ICML 2022, Sec. 5.3): VHL's control.

The server pre-trains the initial global model on the run's virtual dataset, the one a VHL run
of the same seed generates (`vhl.run_virtual_dataset`: the same generator, images per class,
pixel mapping and seed stream), then runs FedAvg unchanged. It asks whether VHL's gain is more
than transfer from the virtual data.

The classifier has C + V outputs and virtual class k is label C + k, as VHL's default
`label_style=extra`, so VFTL and VHL train the same model; FedAvg trains the real classes' rows
afterwards, and evaluation takes the argmax over all C + V outputs, as VHL's does. With
`pretrain_epochs=0` there is nothing to pre-train: the model keeps C outputs and the run is
FedAvg's, number for number. The virtual data never leave the server: the messages are FedAvg's
(the model's weights).

The pre-training is SGD on the run's device with the run's momentum, weight decay and autocast,
and the run's learning rate and batch unless `pretrain_lr` / `pretrain_batch_size` say
otherwise; the batch order comes from a run-level stream. Nothing in a step waits on the host:
the index batches go over unwaited (`fedvl.devices.to_device`) and the loss and accuracy stay
on the device until the last step (one read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fedvl.algorithms.base import ServerState
from fedvl.algorithms.fedavg import FedAvg
from fedvl.algorithms.vhl import ExtraClassesModel, VHLParams, run_virtual_dataset
from fedvl.core.params import clone_state
from fedvl.core.training import TrainConfig, autocast_context, batch_indices
from fedvl.devices import to_device
from fedvl.models.base import FedModel
from fedvl.options import copy_option, option
from fedvl.registry import register_algorithm
from fedvl.seeding import generator
from fedvl.virtual import VirtualDataset

# Run-level stream (`fedvl.seeding.generator(seed, stream)`) of the pre-training's batch order;
# next to VHL's 4242-4244.
PRETRAIN_STREAM = 4245


def pretrain(model: FedModel, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig,
             gen: torch.Generator) -> dict[str, list[float]]:
    """SGD on (x, y) for `cfg.local_epochs` epochs, in place; each epoch's mean loss and
    training accuracy, read from the device once, after the last step."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(y) / cfg.batch_size)
    # Row sums of the loss and of the correct predictions per epoch, kept on the device: a
    # read per step would make the host wait for the device's queue every step.
    sums = torch.zeros(cfg.local_epochs, 2, device=x.device)
    for step, idx in enumerate(batch_indices(len(y), cfg.batch_size, cfg.local_epochs, None,
                                             gen)):
        idx = to_device(idx, x.device)
        xb, yb = x[idx], y[idx]
        with autocast_context(cfg.autocast, x.device):
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        epoch = sums[step // per_epoch]
        epoch[0] += loss.detach().float() * len(yb)
        epoch[1] += (logits.detach().argmax(1) == yb).sum()
    means = (sums / max(len(y), 1)).tolist()
    return {"loss": [m[0] for m in means], "accuracy": [m[1] for m in means]}


@register_algorithm("vftl")
class VFTL(ExtraClassesModel, FedAvg):
    """FedAvg from a global model pre-trained on VHL's virtual dataset."""

    name = "vftl"
    smoke_args: ClassVar[dict[str, Any]] = {"virtual_per_class": 20}

    @dataclass
    class Params(FedAvg.Params):
        pretrain_epochs: int = option(5, "server epochs on the virtual data before round 1 "
                                      "(0: FedAvg)", ge=0)
        pretrain_lr: float = option(0.0, "learning rate of the pre-training (0: the run's "
                                    "--lr)", ge=0)
        pretrain_batch_size: int = option(0, "batch size of the pre-training (0: the run's "
                                          "--batch-size)", ge=0)
        virtual_generator: str = copy_option(VHLParams, "virtual_generator")
        pixel_mapping: str = copy_option(VHLParams, "pixel_mapping")
        virtual_classes: int = copy_option(VHLParams, "virtual_classes")
        virtual_per_class: int = copy_option(VHLParams, "virtual_per_class")

    @property
    def num_virtual(self) -> int:
        """V, the number of virtual classes (as VHL's: C unless `virtual_classes` says)."""
        return self.p.virtual_classes or self.env.num_classes

    @property
    def extra_classes(self) -> int:
        """V outputs for the virtual classes when the model is pre-trained, else none."""
        return self.num_virtual if self.p.pretrain_epochs > 0 else 0

    def virtual_dataset(self) -> VirtualDataset:
        """The virtual dataset a VHL run of this seed and these options uses."""
        return run_virtual_dataset(self.env, self.p.virtual_generator, self.num_virtual,
                                   self.p.virtual_per_class, self.p.pixel_mapping)

    def pretrain_config(self) -> TrainConfig:
        """The pre-training's optimiser: the run's, with `pretrain_lr` and
        `pretrain_batch_size` where set, for `pretrain_epochs` epochs."""
        run = self.env.train
        return replace(run, lr=self.p.pretrain_lr or run.lr,
                       batch_size=self.p.pretrain_batch_size or run.batch_size,
                       local_epochs=self.p.pretrain_epochs, local_steps=None, lr_decay=1.0)

    def server_init(self) -> ServerState:
        state = super().server_init()
        if self.p.pretrain_epochs == 0:
            return state
        device = self.env.device
        data = self.virtual_dataset()
        model = self.load_model(state["model"], device)
        curve = pretrain(model, to_device(data.normalised(), device),
                         to_device(data.labels + self.env.num_classes, device),
                         self.pretrain_config(), generator(self.env.seed, PRETRAIN_STREAM))
        return {**state, "model": clone_state(model.state_dict()), "pretrain": curve}

    def report(self, state: ServerState) -> dict[str, Any]:
        curve = state.get("pretrain") or {"loss": [], "accuracy": []}
        return {**super().report(state), "vftl": {
            "pretrain_epochs": self.p.pretrain_epochs,
            "virtual_images": self.num_virtual * self.p.virtual_per_class
            if self.p.pretrain_epochs else 0,
            "pretrain_loss": curve["loss"], "pretrain_train_accuracy": curve["accuracy"]}}

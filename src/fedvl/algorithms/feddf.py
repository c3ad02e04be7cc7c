"""FedDF (Lin et al. 2020), model-heterogeneous form: ensemble distillation on public data.

Round r:
  client: distils its own model toward the served ensemble logits t on the unlabelled public
          set (`--public`): `public_epochs` passes of batch-mean KL(softmax(t/T) || softmax(f/T))
          with SGD(`public_lr`, weight decay 1e-5); then trains on its own data (CE); uploads
          its logits (eval mode) on the public set.
  server: t = the plain mean of this round's uploaded logits.
The reference distils all models batch by batch in one process, each batch's target from the
models as they are then; here every target comes from the models at the end of the previous
round (what a client can know without one message per public batch). The weight averaging of
FedDF's homogeneous form is not part of this method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedvl.algorithms.base import Algorithm, ClientContext, ServerContext, ServerState
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.core.training import batch_indices, local_train
from fedvl.distill.losses import distillation_kl
from fedvl.models.base import FedModel
from fedvl.options import ConfigError, option
from fedvl.registry import BENCHMARKS, register_algorithm

# Chunk size of the public-set forward passes (memory only; results do not depend on it).
CHUNK = 500


@register_algorithm("feddf")
class FedDF(Algorithm):
    """Clients distil toward the ensemble's logits on a public set; each keeps its own model."""

    personalized = True
    mixed_models = True
    payload_kinds = {"down": frozenset({"logits"}), "up": frozenset({"logits"})}

    @dataclass
    class Params:
        public_epochs: int = option(1, "distillation passes over the public set per round "
                                    "(reference 1)", ge=0)
        public_batch: int = option(256, "public batch size (reference 256)", ge=1)
        public_lr: float = option(0.001, "distillation SGD learning rate (reference 1e-3)", gt=0)
        temperature: float = option(1.0, "distillation temperature (reference 1)", gt=0)

    def __init__(self, env: Any, params: Any | None = None) -> None:
        super().__init__(env, params)
        if env.public_fn is None:
            raise ConfigError(f"method '{self.name}' needs an unlabelled public set: --public "
                              f"NAME, one of the benchmarks {', '.join(BENCHMARKS.names())} (its "
                              "training images, labels dropped; --public-size caps it)")

    def server_init(self) -> ServerState:
        return {"teacher": None}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        if state["teacher"] is None:
            return {c: Message() for c in clients}
        msg = Message({"logits": {"public": state["teacher"]}})
        return {c: msg for c in clients}

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        assert self.env.public_fn is not None
        public = self.env.public_fn().to(client.device)
        model = self.own_model(client)
        if "logits" in msg.arrays and self.p.public_epochs > 0:
            self._distil(model, public, msg.arrays["logits"]["public"].to(client.device),
                         client.generator)
        stats = local_train(model, client.x, client.y, self.client_train(client),
                            client.generator)
        client.state.arrays["weights"] = clone_state(model.state_dict())
        return Message({"logits": {"public": public_logits(model, public)}},
                       {"num_examples": client.num_train, "steps": stats.steps,
                        "train_loss": stats.mean_loss})

    def _distil(self, model: FedModel, x: torch.Tensor, teacher: torch.Tensor,
                gen: torch.Generator) -> None:
        p = self.p
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=p.public_lr, weight_decay=1e-5)
        for idx in batch_indices(len(x), p.public_batch, p.public_epochs, None, gen):
            idx = idx.to(x.device)
            t = p.temperature
            loss = distillation_kl(model(x[idx]), teacher[idx], t)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        assert self.env.public_fn is not None
        n = int(self.env.public_fn().shape[0])   # every client's logits on the same public set
        spec.exact["logits"] = {"public": TensorSpec((n, self.env.num_classes))}
        spec.required |= {"logits"}
        return spec

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        logits = [r.arrays["logits"]["public"].float().cpu() for r in replies.values()]
        return {"teacher": torch.stack(logits).mean(0)}



@torch.no_grad()
def public_logits(model: FedModel, x: torch.Tensor) -> torch.Tensor:
    """The model's logits (eval mode) on the public set."""
    model.eval()
    out = torch.cat([model(x[i : i + CHUNK]) for i in range(0, len(x), CHUNK)])
    model.train()
    return out

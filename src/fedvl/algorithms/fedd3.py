"""FedD3 (Song et al., IJCNN 2023): one-shot federated learning by decentralised distillation.

One communication round (the official code, rruisong/FedD3):
  server:  sends no model; it asks each client for its set.
  client:  distils its local data once into `ipc` images per owned class (`owned_ipc`: classes
           with >= `min_class_count` images) and uploads them with hard labels:
             distiller=dm       distribution matching with a freshly initialised network every
                                step (`distill_client`, the DM of Zhao & Bilen: no model comes
                                down); `init` stats / noise / real, `steps` image-SGD steps;
             distiller=herding  a coreset: per class, herding's greedy choice of real images
                                whose running mean tracks the class mean (`herding_coreset`),
                                in pixel space or in the embedding of the run's seeded initial
                                network (`herding_space`). These are private images, unchanged.
  server:  trains one model from scratch on the union of the sets (SGD or Adam,
           `server_epochs`).
The official code's distillers are KIP (an infinite-width NTK, JAX) and GMM / DBSCAN coresets;
fedvl offers DM and herding instead (docs/fedd3.md).

More rounds than one (the paper has none): a client uploads once, the first round it is
sampled; every round that brings new sets retrains from scratch on the union of every set
received so far, and a round that brings none leaves the model as it is. With `--rounds 1
--client-ratio 1` (`fedvl bench --protocol one-shot`) this is the paper's single round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedvl.algorithms.base import (
    Algorithm,
    ClientContext,
    ServerContext,
    ServerState,
    real_data,
)
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplySpec
from fedvl.distill.client_sets import MIN_CLASS_COUNT, distill_client, owned_ipc
from fedvl.distill.herding import herding_coreset
from fedvl.distill.union import ServerTraining, received_sets, synthetic_set_spec, train_on_union
from fedvl.models.base import FedModel
from fedvl.options import option
from fedvl.registry import register_algorithm

# Server random stream (ServerContext.stream id) of the server training's batch order.
SERVER_TRAIN_STREAM = 109
# Rows embedded at a time when herding in a network's feature space.
EMBED_ROWS = 256


@register_algorithm("fedd3")
class FedD3(Algorithm):
    """One-shot: each client uploads a distilled set (or a coreset) once; the server trains
    one model from scratch on their union."""

    payload_kinds = {"up": frozenset({"synthetic_images", "synthetic_labels"})}
    accepts_addons = False   # clients train no model: there is no local step to add to
    trains_client_models = False
    smoke_args = {"steps": 20, "server_epochs": 30}
    # The official code's README runs: one image per local class, the server trains 500
    # epochs with batch 50; its KIP budget (3,000 steps) has no DM counterpart here.
    paper_args = {"ipc": 1, "server_epochs": 500, "server_batch_size": 50}
    paper_run = {"rounds": 1}
    # Each client's upload, as the server holds it.
    shared_synthetic = "fedd3_{client}"

    # Defaults sized for a 2-core CPU; the official code's values in the help texts.
    @dataclass
    class Params:
        distiller: str = option("dm", "dm: distribution matching with random networks (a "
                                "synthetic set); herding: a coreset of real images (uploads "
                                "private images; the official code's are KIP and GMM/DBSCAN "
                                "coresets)", choices=("dm", "herding"))
        ipc: int = option(10, "images per owned class each client uploads (official code: 1 "
                          "per local class)", ge=1)
        min_class_count: int = option(MIN_CLASS_COUNT, "a client distils only classes with at "
                                      "least this many images", ge=1)
        init: str = option("stats", "dm: start from per-class pixel statistics, N(0, 1) noise "
                           "or real images (official KIP: real)",
                           choices=("stats", "noise", "real"))
        steps: int = option(100, "dm: matching steps (official KIP: up to 3,000)", ge=0)
        batch_real: int = option(32, "dm: real images per class per step", ge=1)
        lr_img: float = option(1.0, "dm: image learning rate (momentum 0.5)", gt=0)
        dsa: bool = option(True, "dm: siamese differentiable augmentation")
        herding_space: str = option("pixels", "herding: features the running mean is matched "
                                    "in: pixels (the normalised images) or embed (the run's "
                                    "model at its seeded initialisation)",
                                    choices=("pixels", "embed"))
        server_epochs: int = option(300, "server training epochs (official code: 500)", ge=0)
        server_lr: float = option(0.01, "server SGD learning rate (official code: Adam 0.001)",
                                  gt=0)
        server_momentum: float = option(0.9, "server SGD momentum", ge=0, lt=1)
        server_weight_decay: float = option(5e-4, "server weight decay (official code: 1e-4)",
                                            ge=0)
        server_batch_size: int = option(50, "server batch size (official code: 50)", ge=1)
        server_optimizer: str = option("sgd", "server optimiser: sgd (momentum "
                                       "`server_momentum`) or adam (official code: Adam)",
                                       choices=("sgd", "adam"))

    def upload_exemption(self) -> str | None:
        """Why this setting's upload may copy private images (herding, dm with init=real)."""
        if self.p.distiller == "herding":
            return ("FedD3 distiller=herding uploads a coreset: ipc real private images per "
                    "owned class, unchanged (docs/fedd3.md)")
        if self.p.init == "real":
            return ("FedD3 init=real starts the distilled set from ipc real images per class "
                    "and uploads it after `steps` matching steps (docs/fedd3.md)")
        return None

    # -- server ------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        # Sets keyed by client id (as a str): the union is concatenated in id order, so it does
        # not depend on the round a client was first sampled in.
        return {"model": clone_state(self.new_model().state_dict()), "sets_x": {},
                "sets_y": {}}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        # No model comes down: only a client whose set the server lacks is asked for it.
        return {c: Message(meta={"upload": str(c) not in state["sets_x"]}) for c in clients}

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        """Asked: one set of float32 images with class indices, at most `ipc` per class (a
        coreset: at most the client's own images, `row_bounds`). Not asked: no tensors."""
        spec = super().reply_spec(sent, cid)
        if not sent.meta.get("upload"):
            spec.kinds = frozenset()
            return spec
        return synthetic_set_spec(spec, tuple(self.env.image_shape),
                                  self.p.ipc * self.env.num_classes)

    def row_bounds(self, cid: int, announced: int) -> dict[str, int]:
        """A coreset holds at most the client's own training images."""
        return {"synthetic_images": announced} if self.p.distiller == "herding" else {}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        new, _, _ = received_sets(replies)
        if not new:
            return state
        sets_x, sets_y = dict(state["sets_x"]), dict(state["sets_y"])
        for cid, r in new.items():
            sets_x[str(cid)] = r.arrays["synthetic_images"]["x"].cpu()
            sets_y[str(cid)] = r.arrays["synthetic_labels"]["y"].cpu()
        keys = sorted(sets_x, key=int)
        x = torch.cat([sets_x[k] for k in keys]).to(ctx.device)
        y = torch.cat([sets_y[k] for k in keys]).to(ctx.device)
        # From scratch (the run's seeded initial model), as the paper's server does.
        model = self.env.model_fn().to(ctx.device)
        train_on_union(model, x, y, ServerTraining.of(self.p), ctx.stream(SERVER_TRAIN_STREAM))
        return {"model": clone_state(model.state_dict()), "sets_x": sets_x, "sets_y": sets_y}

    def global_model(self, state: ServerState) -> FedModel:
        return self.load_model(state["model"], self.env.device)

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {self.shared_synthetic.format(client=self.env.client_name(int(c))):
                (state["sets_x"][c], state["sets_y"][c]) for c in sorted(state["sets_x"], key=int)}

    def report(self, state: ServerState) -> dict[str, Any]:
        return {"distiller": self.p.distiller,
                "clients_uploaded": len(state["sets_y"]),
                "server_train_images": int(sum(len(y) for y in state["sets_y"].values()))}

    # -- client ------------------------------------------------------------------------------
    def client_update(self, msg: Message, client: ClientContext) -> Message:
        meta: dict[str, Any] = {"num_examples": client.num_train} if client.num_train else {}
        if not msg.meta.get("upload"):
            return Message(meta=meta)
        p, k = self.p, client.num_classes
        x, y = real_data(client)
        if p.distiller == "herding":
            per_class = owned_ipc(y, k, p.ipc, p.min_class_count)
            xs, ys = herding_coreset(x, y, per_class, self._herding_features(client.device))
        else:
            syn = distill_client(x, y, k, self._random_model, p.ipc, p.steps, client.generator,
                                 p.init, p.batch_real, p.lr_img, p.dsa,
                                 min_count=p.min_class_count)
            xs, ys = syn.tensors()
        return Message({"synthetic_images": {"x": xs.float()}, "synthetic_labels": {"y": ys}},
                       {**meta, "synthetic": len(ys)})

    def _random_model(self, seed: int) -> FedModel:
        # `distill_client` moves it to the data's device.
        return self.env.model_fn(seed=seed)

    def _herding_features(self, device: torch.device) -> Any:
        """The feature map herding matches means in (`herding_space`)."""
        if self.p.herding_space == "pixels":
            return lambda x: x.reshape(len(x), -1)
        net = self.env.model_fn().to(device).eval()

        @torch.no_grad()
        def embed(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([net.embed(x[i:i + EMBED_ROWS])
                              for i in range(0, len(x), EMBED_ROWS)])
        return embed

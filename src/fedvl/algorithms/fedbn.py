"""FedBN (Li et al., ICLR 2021): federated averaging whose BatchNorm layers stay on each client.

Round t, the base method's round with one change (`fedbn` = FedAvg + this add-on):
  server: send w_t without its BatchNorm entries (gamma, beta, running mean and variance,
          step counter), in every model-shaped tensor kind it sends (weights, SCAFFOLD's c);
  client k: put its own BatchNorm entries back (the initial model's before its first round),
          train as the base method does, keep the trained BatchNorm entries, upload the rest;
  server: aggregate the shared entries exactly as the base method does.
Evaluation: client k runs the global model with its own BatchNorm layers, on its own test set
(and on every other client's: `cross_accuracy`, `inter_accuracy`). BatchNorm layers are chosen
by layer type (`torch.nn.modules.batchnorm._BatchNorm`), not by the reference code's `'bn' in
key`. The server's copy of the BatchNorm entries is the initial model's and never changes: it is
what a client that has not trained yet starts from.

The add-on composes with the bases that exchange only model states (`fedprox+fedbn`,
`scaffold+fedbn`, `fednova+fedbn`, `feddyn+fedbn`, ...): their server halves never see a
BatchNorm entry move, and SCAFFOLD's control variates then cover the shared parameters only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedvl.algorithms.base import (
    Algorithm,
    ClientContext,
    Env,
    ServerContext,
    ServerState,
)
from fedvl.algorithms.compose import compose
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.message import Message
from fedvl.core.params import batch_norm_keys, clone_state
from fedvl.models.base import FedModel
from fedvl.options import ConfigError
from fedvl.registry import register_addon, register_algorithm

# The tensor kinds whose names are a model's state-dict keys: the ones FedBN filters. A base
# that sends any other kind is not composable (its server might build a model from a state
# missing the BatchNorm entries).
MODEL_KINDS = frozenset({"weights", "control_variates"})
# Where a client keeps its BatchNorm entries between rounds (its persistent state).
LOCAL = "weights"


@dataclass
class FedBNParams:
    """Options of the FedBN add-on: none (it only chooses which layers stay local)."""


def without(arrays: Mapping[str, Mapping[str, torch.Tensor]], keys: frozenset[str]
            ) -> dict[str, dict[str, torch.Tensor]]:
    """`arrays` with every tensor named in `keys` removed from the model-shaped kinds."""
    return {kind: ({n: t for n, t in tensors.items() if n not in keys}
                   if kind in MODEL_KINDS else dict(tensors))
            for kind, tensors in arrays.items()}


class FedBNAddon:
    """FedBN: every client keeps its BatchNorm layers; the rest is federated as by the base."""

    addon_name: ClassVar[str] = "fedbn"
    Params: ClassVar[type] = FedBNParams
    local_layers: ClassVar[bool] = True
    # Set by Algorithm.__init__ of the composed class; declared for type checkers.
    env: Env
    p: Any
    name: ClassVar[str]

    @classmethod
    def compatible(cls, base: type) -> bool:
        """FedAvg-style bases that send and receive model states only, on the plain model."""
        if not (isinstance(base, type) and issubclass(base, FedAvg)):
            return False
        kinds = base.declared_kinds()
        return (not base.personalized and base.addon_name is None and base.accepts_addons
                and base.new_model is Algorithm.new_model
                and base.load_model is Algorithm.load_model
                and kinds["down"] | kinds["up"] <= MODEL_KINDS and not kinds["peer"])

    def __init__(self, env: Env, params: Any | None = None) -> None:
        if float(getattr(params, "dp_noise", 0) or 0) > 0:
            raise ConfigError(f"method '{self.name}' keeps BatchNorm layers, and DP-SGD cannot "
                              "train a network with BatchNorm (batch statistics mix every "
                              "sample into every output); run it without dp_noise")
        super().__init__(env, params)  # type: ignore[call-arg]
        if not self.local_keys():
            raise ConfigError(f"method '{self.name}' keeps each client's BatchNorm layers "
                              "local, but the run's model has no BatchNorm layer; run it with "
                              "--norm batch (the ConvNet with BatchNorm)")

    def local_keys(self) -> frozenset[str]:
        """State-dict keys of the model's BatchNorm layers: what never leaves a client."""
        cache = self.__dict__.setdefault("_fedbn_keys", {})
        if "keys" not in cache:
            model = self.new_model()  # type: ignore[attr-defined]
            cache["keys"] = batch_norm_keys(model)
            # A client's BatchNorm entries before its first round: the initial model's.
            cache["init"] = {k: v for k, v in clone_state(model.state_dict()).items()
                             if k in cache["keys"]}
        return cache["keys"]

    def initial_local(self) -> dict[str, torch.Tensor]:
        """The initial model's BatchNorm entries (the same on the server and every client)."""
        self.local_keys()
        return self.__dict__["_fedbn_keys"]["init"]

    def own_layers(self, client: ClientContext) -> dict[str, torch.Tensor]:
        """Client's BatchNorm entries: its own after its first round, else the initial ones."""
        kept = client.state.arrays.get(LOCAL)
        return dict(kept) if kept is not None else dict(self.initial_local())

    # -- server ---------------------------------------------------------------------------------
    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        out = super().configure(state, ctx, clients)  # type: ignore[misc]
        keys = self.local_keys()
        # One filtered message per distinct message (most bases send all clients the same).
        filtered: dict[int, Message] = {}
        for m in out.values():
            if id(m) not in filtered:
                filtered[id(m)] = Message(without(m.arrays, keys), dict(m.meta))
        return {c: filtered[id(m)] for c, m in out.items()}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        # The base aggregates full model states: the BatchNorm entries a reply lacks are the
        # server's own, so they cannot move, and are put back exactly as they were afterwards.
        keys, server = self.local_keys(), state["model"]
        full = {}
        for c, r in replies.items():
            arrays = {kind: dict(t) for kind, t in r.arrays.items()}
            shared = arrays["weights"]
            arrays["weights"] = {k: server[k] if k in keys else shared[k] for k in server}
            full[c] = Message(arrays, dict(r.meta))
        new = super().aggregate(state, ctx, full)  # type: ignore[misc]
        return {**new, "model": {k: server[k] if k in keys else t
                                 for k, t in new["model"].items()}}

    # -- client ---------------------------------------------------------------------------------
    def client_update(self, msg: Message, client: ClientContext) -> Message:
        arrays = {kind: dict(t) for kind, t in msg.arrays.items()}
        arrays["weights"] = {**arrays["weights"], **self.own_layers(client)}
        reply = super().client_update(Message(arrays, dict(msg.meta)), client)  # type: ignore[misc]
        keys = self.local_keys()
        client.state.arrays[LOCAL] = {k: t.detach().clone()
                                      for k, t in reply.arrays["weights"].items() if k in keys}
        return Message(without(reply.arrays, keys), dict(reply.meta))

    # -- evaluation -----------------------------------------------------------------------------
    def personalise(self, model: FedModel, client: ClientContext) -> FedModel:
        """The global model with `client`'s own BatchNorm layers (a new model)."""
        weights = {**model.state_dict(), **self.own_layers(client)}
        return self.load_model(weights, client.device)  # type: ignore[attr-defined]


register_addon(FedBNAddon.addon_name)(FedBNAddon)
# The plain add-on name means FedAvg + add-on (`fedbn` = `fedavg+fedbn`).
register_algorithm(FedBNAddon.addon_name)(compose(FedAvg, FedBNAddon, FedBNAddon.addon_name))

"""FedAvg (McMahan et al. 2017): local SGD, then a sample-weighted average of the models.

Server: send w_t to the sampled clients.   Client k: w_k <- SGD on its data from w_t.
Server: w_{t+1} = sum_k p_k w_k with p_k proportional to n_k (or uniform).
Subclasses change one step each: extra loss terms (FedProx, MOON), a post-step correction
(SCAFFOLD), the aggregation rule (FedNova) or a server optimiser (FedAvgM, FedAdam).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fedvl.algorithms.base import Algorithm, ClientContext, ServerContext, ServerState
from fedvl.core.message import Message
from fedvl.core.params import clone_state, parameter_keys, robust_average, weighted_average
from fedvl.core.replies import ReplySpec
from fedvl.core.stacked import stackable, stacked_local_train
from fedvl.core.training import LossTerm, TrainStats, local_train
from fedvl.models.base import FedModel
from fedvl.registry import register_algorithm

# Aggregation rules that ignore sample counts and resist a few extreme clients.
ROBUST_RULES = ("median", "trimmed-mean")


@register_algorithm("fedavg")
class FedAvg(Algorithm):
    """Federated averaging."""

    payload_kinds = {"down": frozenset({"weights"}), "up": frozenset({"weights"})}
    robust_aggregation = True

    def server_init(self) -> ServerState:
        return {"model": clone_state(self.new_model().state_dict())}

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        msg = Message({"weights": state["model"]})
        return {c: msg for c in clients}

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        model = self.load_model(msg.get("weights"), client.device)
        stats = self.train(model, msg, client)
        return self.reply(model, stats, msg, client)

    def train(self, model: FedModel, msg: Message, client: ClientContext) -> TrainStats:
        """Local training with this method's loss terms and step hook."""
        return local_train(model, client.x, client.y, self.client_train(client),
                           client.generator,
                           terms=self.loss_terms(model, msg, client),
                           after_step=self.after_step(model, msg, client))

    def loss_terms(self, model: FedModel, msg: Message,
                   client: ClientContext) -> Sequence[LossTerm]:
        """Objectives added to cross-entropy (none for FedAvg)."""
        return ()

    def after_step(self, model: FedModel, msg: Message,
                   client: ClientContext) -> Callable[[FedModel, float], None] | None:
        """Correction applied after each optimiser step (none for FedAvg)."""
        return None

    def reply(self, model: FedModel, stats: TrainStats, msg: Message,
              client: ClientContext) -> Message:
        """The client's upload: its trained weights and how much it trained."""
        return Message({"weights": clone_state(model.state_dict())},
                       meta={"num_examples": client.num_train, "steps": stats.steps,
                             "train_loss": stats.mean_loss})

    def stack_ready(self) -> bool:
        """Whether the clients may train stacked (`--stack-clients`): this class trains with
        FedAvg's plain local SGD (no extra terms or corrections) on a model without BatchNorm."""
        cls = type(self)
        plain = all(getattr(cls, name) is getattr(FedAvg, name)
                    for name in ("client_update", "train", "loss_terms", "after_step"))
        # DP-SGD (a `dp_noise` option) replaces the plain step.
        private = float(getattr(self.p, "dp_noise", 0) or 0) > 0
        return plain and not private and stackable(self.new_model())

    def client_update_stacked(self, items: list[tuple[Message, ClientContext]]
                              ) -> list[Message]:
        """`client_update` of every (message, client) pair, trained as one vectorised model."""
        device = items[0][1].device
        # One round's clients: one learning rate.
        results = stacked_local_train(self.new_model().to(device),
                                      [m.get("weights") for m, _ in items],
                                      [(c.x, c.y) for _, c in items],
                                      self.client_train(items[0][1]),
                                      [c.generator for _, c in items])
        return [self.reply(self.load_model(state, c.device), stats, m, c)
                for (m, c), (state, stats) in zip(items, results, strict=True)]

    def parameter_keys(self) -> frozenset[str]:
        """State-dict keys of the model's parameters: what server optimisers may move. Buffers
        (BN running statistics) are averaged plainly, since extrapolating them can make a
        variance negative."""
        cache = self.__dict__.setdefault("_param_keys", {})
        if "keys" not in cache:
            cache["keys"] = parameter_keys(self.new_model())
        return cache["keys"]

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        spec.required_meta |= {"num_examples"}   # the weight of a sample-weighted average
        return spec

    def average(self, replies: dict[int, Message]) -> dict:
        """The clients' models combined by the run's rule: weighted mean or a robust one."""
        states = [r.get("weights") for r in replies.values()]
        if self.env.aggregation in ROBUST_RULES:
            return robust_average(states, self.env.aggregation, self.env.trim)
        return weighted_average(states, self.client_weights(replies))

    def client_weights(self, replies: dict[int, Message]) -> list[float]:
        """Aggregation weights p_k: by sample count or uniform."""
        if self.env.aggregation == "uniform":
            return [1.0] * len(replies)
        return [float(r.meta["num_examples"]) for r in replies.values()]

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        avg = self.average(replies)
        return self.server_update(state, avg, replies)

    def server_update(self, state: ServerState, avg: dict, replies: dict[int, Message]
                      ) -> ServerState:
        """Turn the averaged client models into the next global state (plain replacement).

        `avg` is the weighted average of the client models, buffers included; overrides that
        move the parameters differently keep `avg` for every key not in `parameter_keys()`.
        """
        return {**state, "model": avg}

    def global_model(self, state: ServerState) -> FedModel:
        return self.load_model(state["model"], self.env.device)

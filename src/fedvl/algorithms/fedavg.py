"""FedAvg (McMahan et al. 2017): local SGD, then a sample-weighted average of the models.

Server: send w_t to the sampled clients.   Client k: w_k <- SGD on its data from w_t.
Server: w_{t+1} = sum_k p_k w_k with p_k proportional to n_k (or uniform).
Subclasses change one step each: extra loss terms (FedProx, MOON), a post-step correction
(SCAFFOLD), the aggregation rule (FedNova) or a server optimiser (FedAvgM, FedAdam).

DP-FedAvg (`dp_noise` > 0): the local SGD becomes example-level DP-SGD (Abadi et al. 2016;
`fedvl.core.dp.dp_sgd_train`): Poisson sampling at rate q = batch_size / n_k,
per-sample clipping to `dp_clip`, Gaussian noise of std `dp_noise * dp_clip` on the sum, divided
by the expected batch size. Per-sample gradients come from Opacus' `GradSampleModule` (hooks,
one backward pass; several times faster on a CPU than `torch.vmap` of `torch.func.grad` and
equal to it to float rounding), while the Poisson draws and the noise come from the client's
own generator, so a run gives the same numbers on any number of workers. A subclass's extra
terms and post-step corrections run on the privatised step only where they read no data
(FedProx's proximal term, SCAFFOLD's control-variate correction); classes that declare so set
`dp_sgd = True`, and methods with any other local-training hook refuse `dp_noise`. Each client
reports epsilon over all the DP steps it has taken in the run (Opacus RDP accountant, delta
`dp_delta` or 1/(10 n_k)); the server keeps the latest per client for `summary.json`
(`report`). The train loss, an unprivatised statistic, is not uploaded under DP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

from fedvl.algorithms.base import Algorithm, ClientContext, Env, ServerContext, ServerState
from fedvl.core.dp import (
    PRIVACY_KEYS,
    add_dp_steps,
    check_dp_model,
    compute_epsilon,
    delta_for,
    dp_sgd_train,
    merge_privacy,
    privacy_meta,
    privacy_report,
)
from fedvl.core.message import Message
from fedvl.core.params import clone_state, parameter_keys, robust_average, weighted_average
from fedvl.core.replies import ReplySpec
from fedvl.core.stacked import stackable, stacked_local_train
from fedvl.core.training import LossTerm, TrainStats, local_train
from fedvl.models.base import FedModel
from fedvl.options import ConfigError, option
from fedvl.registry import ALGORITHMS, register_algorithm

# Aggregation rules that ignore sample counts and resist a few extreme clients.
ROBUST_RULES = ("median", "trimmed-mean")
# The hooks that shape a client's local training; under DP-SGD each must come from a class
# that declares `dp_sgd = True` (its terms and corrections read no private data).
LOCAL_TRAINING_HOOKS = ("client_update", "train", "loss_terms", "after_step")


def dp_blockers(cls: type) -> list[str]:
    """The local-training hooks of `cls` that DP-SGD does not cover ("Moon.loss_terms")."""
    out = []
    for hook in LOCAL_TRAINING_HOOKS:
        owner = next(k for k in cls.__mro__ if hook in vars(k))
        # The class that defines the hook must say so itself: a subclass that redefines a hook
        # does not inherit its base's `dp_sgd = True`.
        if not vars(owner).get("dp_sgd", False):
            out.append(f"{owner.__name__}.{hook}")
    return out


def dp_methods() -> list[str]:
    """Registered methods that accept `dp_noise` > 0 for their local training."""
    out = []
    for name in ALGORITHMS.names():
        cls = ALGORITHMS.get(name)
        if (issubclass(cls, FedAvg) and "dp_noise" in {f.name for f in fields(cls.Params)}
                and not dp_blockers(cls)):
            out.append(name)
    return sorted(out)


@register_algorithm("fedavg")
class FedAvg(Algorithm):
    """Federated averaging."""

    payload_kinds = {"down": frozenset({"weights"}), "up": frozenset({"weights"})}
    robust_aggregation = True
    # Its local-training hooks stay valid under DP-SGD (see `dp_blockers`).
    dp_sgd = True

    @dataclass
    class Params:
        dp_noise: float = option(0.0, "DP-SGD noise multiplier sigma of the local training; 0 "
                                 "turns DP off", ge=0)
        # Per-sample CE gradients of the default ConvNet have norm ~14 at the start (median on
        # digits-offline): C = 1 shrank every step ~14x and the clip-only control stopped
        # learning (14.6 vs FedAvg's 53.2 %); C = 10 keeps it within 10 points, learns best at
        # sigma 0.5 and within 2 points of the best clip at sigma 1-2 (docs/dp.md).
        dp_clip: float = option(10.0, "DP-SGD per-sample clipping norm C", gt=0)
        dp_delta: float = option(0.0, "DP delta; 0: 1/(10 n_k) for a client's n_k training "
                                 "records", ge=0, lt=1)

    def __init__(self, env: Env, params: Any | None = None) -> None:
        super().__init__(env, params)
        if self.dp:
            blockers = dp_blockers(type(self))
            if blockers:
                raise ConfigError(
                    f"method '{self.name or type(self).__name__}' cannot run DP-SGD "
                    f"(dp_noise > 0): {', '.join(blockers)} changes local training in a way "
                    f"the privacy accounting does not cover; methods that can: "
                    f"{', '.join(dp_methods())}")
            # Refuses BatchNorm: per-sample clipping would not bound one record's influence.
            check_dp_model(env.model_fn())

    @property
    def dp(self) -> bool:
        """Whether local training runs DP-SGD (`dp_noise` > 0)."""
        return float(getattr(self.p, "dp_noise", 0) or 0) > 0

    def server_init(self) -> ServerState:
        state: ServerState = {"model": clone_state(self.new_model().state_dict())}
        if self.dp:
            state.update({k: {} for k in PRIVACY_KEYS})
        return state

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        msg = Message({"weights": state["model"]})
        return {c: msg for c in clients}

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        model = self.load_model(msg.get("weights"), client.device)
        stats = self.train(model, msg, client)
        return self.reply(model, stats, msg, client)

    def train(self, model: FedModel, msg: Message, client: ClientContext) -> TrainStats:
        """Local training with this method's loss terms and step hook (DP-SGD under `dp`)."""
        if self.dp:
            return self.dp_train(model, msg, client)
        return local_train(model, client.x, client.y, self.client_train(client),
                           client.generator,
                           terms=self.loss_terms(model, msg, client),
                           after_step=self.after_step(model, msg, client))

    def dp_train(self, model: FedModel, msg: Message, client: ClientContext) -> TrainStats:
        """DP-SGD local training; adds its steps to the client's running total (`dp_steps`)."""
        if client.x_real is not None:
            raise ConfigError("DP-SGD (dp_noise > 0) protects the records a client trains on, "
                              "but with --local-data virtual those are a set distilled from "
                              "its raw data without DP; use --local-data real")
        stats = dp_sgd_train(model, client.x, client.y, self.client_train(client),
                             client.generator, noise_multiplier=self.p.dp_noise,
                             clip=self.p.dp_clip, terms=self.loss_terms(model, msg, client),
                             after_step=self.after_step(model, msg, client))
        # Every round samples from the same records: epsilon composes all of the run's steps.
        add_dp_steps(client.state, stats.steps)
        return stats

    def privacy_spent(self, client: ClientContext, steps: int) -> tuple[float, float]:
        """(epsilon, delta) of `steps` DP-SGD steps on `client`'s records."""
        n = client.num_train
        delta = delta_for(self.p.dp_delta, n)
        rate = min(1.0, self.client_train(client).batch_size / max(n, 1))
        return compute_epsilon(self.p.dp_noise, rate, steps, delta), delta

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
        """The client's upload: its trained weights and how much it trained (and, under DP,
        the privacy it has spent instead of its train loss)."""
        meta: dict[str, Any] = {"num_examples": client.num_train, "steps": stats.steps}
        if self.dp:
            meta.update(privacy_meta(client.state, partial(self.privacy_spent, client)))
        else:
            meta["train_loss"] = stats.mean_loss
        return Message({"weights": clone_state(model.state_dict())}, meta=meta)

    def stack_ready(self) -> bool:
        """Whether the clients may train stacked (`--stack-clients`): this class trains with
        FedAvg's plain local SGD (no extra terms or corrections) on a model without BatchNorm."""
        cls = type(self)
        plain = all(getattr(cls, name) is getattr(FedAvg, name)
                    for name in ("client_update", "train", "loss_terms", "after_step"))
        # DP-SGD (the `dp_noise` option) replaces the plain step.
        return plain and not self.dp and stackable(self.new_model())

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
        return self.record_privacy(self.server_update(state, avg, replies), replies)

    def record_privacy(self, state: ServerState, replies: dict[int, Message]) -> ServerState:
        """`state` with each replying client's latest epsilon, delta and DP steps (under DP)."""
        if not self.dp:
            return state
        return {**state, **merge_privacy(state, replies, self.env.client_name)}

    def report(self, state: ServerState) -> dict[str, Any]:
        if not self.dp:
            return {}
        return {"privacy": privacy_report(
            "dp-sgd: example-level DP of each client's records; Poisson-sampled local SGD, "
            "per-sample clipping, Gaussian noise, Opacus RDP accountant over all of a client's "
            "local steps", self.p.dp_noise, self.p.dp_clip, state)}

    def server_update(self, state: ServerState, avg: dict, replies: dict[int, Message]
                      ) -> ServerState:
        """Turn the averaged client models into the next global state (plain replacement).

        `avg` is the weighted average of the client models, buffers included; overrides that
        move the parameters differently keep `avg` for every key not in `parameter_keys()`.
        """
        return {**state, "model": avg}

    def global_model(self, state: ServerState) -> FedModel:
        return self.load_model(state["model"], self.env.device)

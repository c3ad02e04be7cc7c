"""The algorithm contract: a server half and a client half that exchange Messages."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fedvl.core.bounds import BOUNDED_KINDS, Measure
from fedvl.core.message import Message
from fedvl.core.replies import MAX_COUNT, ReplySpec, TensorSpec
from fedvl.core.training import TrainConfig
from fedvl.models.base import FedModel
from fedvl.options import ConfigError, Naming, check_options, from_mapping
from fedvl.registry import ALGORITHMS
from fedvl.seeding import generator, run_seed

ServerState = dict[str, Any]


def client_name(names: Sequence[str], cid: int) -> str:
    """Client `cid`'s name in reports: its entry in `names`, or its id where `names` has none."""
    return names[cid] if cid < len(names) else str(cid)


@dataclass
class Env:
    """What every algorithm may know about the federation (no client data)."""

    # model_fn(num_classes=None, seed=None) -> a fresh model, seeded (the run seed by default)
    model_fn: Callable[..., FedModel]
    num_classes: int
    num_clients: int
    train: TrainConfig
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    client_names: list[str] = field(default_factory=list)
    image_shape: tuple[int, int, int] = (3, 28, 28)
    aggregation: str = "samples"
    trim: float = 0.2   # fraction cut from each end by aggregation "trimmed-mean"
    # The architecture of every client (`--client-models`) and a factory for client k's model,
    # client_model_fn(k, num_classes=None, seed=None); empty / None: every client runs model_fn.
    client_models: list[str] = field(default_factory=list)
    client_model_fn: Callable[..., FedModel] | None = None
    # The unlabelled public set (`--public`), loaded on first call; None: the run has none.
    public_fn: Callable[[], torch.Tensor] | None = None
    # The benchmark's per-channel normalisation (model input = (pixel in [0, 1] - mean) / std),
    # public constants of the data set; empty when unknown (a Flower server whose nodes did not
    # say). Methods that generate images in pixel space map them to the models' input with it.
    image_mean: tuple[float, ...] = ()
    image_std: tuple[float, ...] = ()

    @property
    def mixed_models(self) -> bool:
        """Whether clients run different architectures."""
        return len(set(self.client_models)) > 1

    def client_name(self, cid: int) -> str:
        """Client `cid`'s name in reports and summary.json (`client_names`, else its id)."""
        return client_name(self.client_names, cid)


@dataclass
class ClientContext:
    """A client's private world: its data, persistent state and this round's RNG."""

    cid: int
    name: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    state: Message
    generator: torch.Generator
    round: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Raw private data when x/y hold the client's distilled set (`--local-data virtual`).
    x_real: torch.Tensor | None = None
    y_real: torch.Tensor | None = None
    # Peer topology: the messages other clients addressed to this one this round, by sender.
    inbox: dict[int, Message] = field(default_factory=dict)

    @property
    def num_train(self) -> int:
        """Number of private training samples."""
        return int(self.y.shape[0])


@dataclass(frozen=True)
class ServerContext:
    """What the server half knows of the current round: its index, the run seed and device.

    Randomness comes from streams derived from (run seed, round, stream id), so a server half
    never touches global RNG state and a resumed run draws exactly what it would have drawn.
    """

    round: int
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def generator(self) -> torch.Generator:
        """The round's default server generator (stream 0)."""
        return self.stream(0)

    def stream(self, stream: int) -> torch.Generator:
        """An independent generator for one purpose in this round."""
        return generator(self.seed, self.round, stream)

    def run_seed(self, stream: int) -> int:
        """A seed shared by every round of the run (for data generated once per run)."""
        return run_seed(self.seed, stream)


# "full" is another name for "all" (the DESA paper's word).
NEIGHBOURHOODS = ("all", "full", "ring", "random")
# Stream id of the generator that draws random neighbourhoods (with round and client).
PEER_STREAM = 61


def neighbourhood(kind: str, cid: int, sampled: list[int], k: int = 2, seed: int = 0,
                  rnd: int = 0) -> list[int]:
    """The peers client `cid` addresses this round, among the sampled clients.

    `all`: every other sampled client; `ring`: its predecessor and successor in sampled order;
    `random`: `k` other sampled clients drawn from (seed, round, client).
    """
    others = [c for c in sampled if c != cid]
    if kind in ("all", "full") or len(others) <= 1:
        return others
    if kind == "ring":
        i = sampled.index(cid)
        return sorted({sampled[(i - 1) % len(sampled)], sampled[(i + 1) % len(sampled)]} - {cid})
    if kind == "random":
        g = generator(seed, rnd, PEER_STREAM, cid)
        pick = torch.randperm(len(others), generator=g, device=g.device)[: max(0, min(k,
                                                                                      len(others)))]
        return sorted(others[int(i)] for i in pick)
    raise ValueError(f"neighbourhood '{kind}' is unknown; allowed: {', '.join(NEIGHBOURHOODS)}")


def real_data(client: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The client's raw private data (differs from `client.x` when training on virtual data)."""
    if client.x_real is not None and client.y_real is not None:
        return client.x_real, client.y_real
    return client.x, client.y


@dataclass
class NoParams:
    """An algorithm without hyperparameters of its own."""


class Algorithm(abc.ABC):
    """Base class: subclasses define the four contract methods and their `Params`."""

    name: ClassVar[str] = ""
    personalized: ClassVar[bool] = False
    Params: ClassVar[type] = NoParams
    # "star": clients talk only to the server; "peer": before its update, each sampled client
    # may also send messages to its neighbours (`neighbours`, `share`), which the engine
    # delivers unchanged (on Flower through the ServerApp) into their `ClientContext.inbox`.
    topology: ClassVar[str] = "star"
    # Whether the method works when clients run different architectures (`--client-models`);
    # methods that average or share one model's weights need one architecture for everyone.
    mixed_models: ClassVar[bool] = False
    # Payload kinds a class adds to what its bases send, by direction ("down": server to
    # clients, "up": clients to server, "peer": client to client); `declared_kinds` unions
    # them over the hierarchy.
    payload_kinds: ClassVar[dict[str, frozenset[str]]] = {}
    # Whether `--aggregation median|trimmed-mean` applies (methods that average client models).
    robust_aggregation: ClassVar[bool] = False
    # Model options this method runs with when the run does not set them (e.g. FedVCK's
    # BatchNorm ConvNet); `fedvl.config.resolve_model_args` applies them, explicit options win.
    model_defaults: ClassVar[dict[str, Any]] = {}
    # Method options of `--preset smoke` (a 2-round try in well under a minute on 2 CPU cores):
    # the costly budgets cut, every option still exercised (`fedvl.config.PRESETS`).
    smoke_args: ClassVar[dict[str, Any]] = {}
    # Method options of `--preset quickstart` (what a bare `fedvl run` runs).
    quickstart_args: ClassVar[dict[str, Any]] = {}
    # `--preset paper`: the method's published budgets (`paper_args`) and the run settings of
    # its paper or public code (`paper_run`, e.g. its rounds); both under the config and flags.
    paper_args: ClassVar[dict[str, Any]] = {}
    paper_run: ClassVar[dict[str, Any]] = {}
    # Whether a local-objective add-on (`+vhl`) may mix into this method's local step.
    accepts_addons: ClassVar[bool] = True
    # Whether the clients train a model with the run's local optimiser (`--lr`, `--batch-size`
    # ...): methods whose clients only distil data leave those options unused, so a
    # hyperparameter search does not spend trials on them.
    trains_client_models: ClassVar[bool] = True
    # The add-on a composed class carries (`fedprox+vhl`: "vhl"); None for a plain method.
    addon_name: ClassVar[str | None] = None
    # Whether the local-training hooks this very class defines stay valid under DP-SGD; read
    # per class, never inherited (`fedavg.dp_blockers`).
    dp_sgd: ClassVar[bool] = False
    # The `virtual_sets` entry holding images distilled from a client's data that the run
    # shared (`{client}`: the client's name), which the nearest-synthetic membership attack
    # compares with; None when no message carries such images.
    shared_synthetic: ClassVar[str | None] = None
    # Whether each client keeps some layers of the global model to itself (FedBN's BatchNorm
    # layers): every client is then evaluated with its own version of it (`personalise`).
    local_layers: ClassVar[bool] = False

    def __init__(self, env: Env, params: Any | None = None) -> None:
        self.env = env
        self.p = params if params is not None else self.Params()

    # -- contract ----------------------------------------------------------------------------
    @abc.abstractmethod
    def server_init(self) -> ServerState:
        """Initial server state (must be `torch.save`-able)."""

    @abc.abstractmethod
    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        """Messages the server sends to this round's sampled clients."""

    @abc.abstractmethod
    def client_update(self, msg: Message, client: ClientContext) -> Message:
        """Run on a client: consume the server's message, return the reply."""

    @abc.abstractmethod
    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        """Fold the clients' replies into the next server state."""

    @classmethod
    def declared_kinds(cls) -> dict[str, frozenset[str]]:
        """Payload kinds this method may send per direction, over its whole class hierarchy."""
        out: dict[str, set[str]] = {"down": set(), "up": set(), "peer": set()}
        for klass in cls.__mro__:
            for direction, kinds in vars(klass).get("payload_kinds", {}).items():
                out[direction] |= set(kinds)
        return {d: frozenset(k) for d, k in out.items()}

    # -- optional capabilities ---------------------------------------------------------------
    def stack_ready(self) -> bool:
        """Whether this run's clients may train as one vectorised model (`--stack-clients`,
        through `client_update_stacked`); no, unless a method says so."""
        return False

    def client_update_stacked(self, items: list[tuple[Message, ClientContext]]
                              ) -> list[Message]:
        """`client_update` of every (message, client) pair: one after the other here, as one
        vectorised model in a method whose `stack_ready` can say yes."""
        return [self.client_update(m, c) for m, c in items]

    def upload_exemption(self) -> str | None:
        """Why this method's uploads may copy private images by design (the upload guard
        then only warns), or None: its uploads are guarded."""
        return None

    # -- what replies may hold ------------------------------------------------------------------
    # Kinds a reply carries with exactly the names, shapes and dtypes of what the server sent.
    mirrored_kinds: ClassVar[tuple[str, ...]] = ("weights", "control_variates", "logits",
                                                 "prototypes")
    # How the driver sizes each kind of a reply (or peer message) for the round's bound on what
    # one client can move (`fedvl.core.bounds`): weights as their change from the global
    # weights sent, control variates, logits, prototypes, statistics and gradients as sent.
    bounded_kinds: ClassVar[Mapping[str, Measure]] = BOUNDED_KINDS
    # Reply tensors ("kind/name") of per-class sample counts: non-negative, summing to at most
    # `count_bounds` (they weight what comes with them; the size bound leaves them out).
    count_tensors: ClassVar[frozenset[str]] = frozenset()

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        """What client `cid`'s reply to `sent` may hold; the engine drops a reply that breaks it.

        Default: the kinds the method declares upward; a kind the server also sent (weights,
        control variates, logits, prototypes) must come back with the same tensors' shapes and
        dtypes. Methods add what else they know (required metadata, shapes of first uploads).
        """
        up = self.declared_kinds()["up"]
        exact = {k: {n: TensorSpec.like(t) for n, t in sent.arrays[k].items()}
                 for k in self.mirrored_kinds if k in up and k in sent.arrays}
        # A model state the server sent must come back: aggregation reads every one.
        required = frozenset(k for k in ("weights", "control_variates") if k in exact)
        return ReplySpec(up, exact, num_classes=self.env.num_classes,
                         image_shape=tuple(self.env.image_shape), required=required,
                         counts=dict.fromkeys(self.count_tensors, MAX_COUNT))

    def meta_bounds(self, cid: int, announced: int) -> dict[str, tuple[int, int]]:
        """Inclusive ranges of client `cid`'s integer metadata, given the training-set size it
        announced when it joined: `num_examples` counts at most the samples it has."""
        return {"num_examples": (1, announced)}

    def count_bounds(self, cid: int, announced: int) -> dict[str, int]:
        """The most each of client `cid`'s count tensors may sum to, given its announced
        training-set size: a count of its samples counts each at most once by default."""
        return dict.fromkeys(self.count_tensors, announced)

    def row_bounds(self, cid: int, announced: int) -> dict[str, int]:
        """The most rows (images) of each kind client `cid` may upload, given its announced
        training-set size (none by default; methods that upload data-sized sets bound them)."""
        return {}

    def feature_width(self, cid: int) -> int:
        """The width of client `cid`'s embedding (its model's `embed` output), computed once."""
        cache = self.__dict__.setdefault("_feature_width", {})
        if cid not in cache:
            model = self.client_new_model(cid).eval()
            with torch.no_grad():
                x = torch.zeros(1, *self.env.image_shape, device=self.env.device)
                cache[cid] = int(model.embed(x).shape[-1])
        return cache[cid]

    def peer_spec(self, sender: int) -> ReplySpec:
        """What a peer message of client `sender` may hold (the kinds declared as `peer`)."""
        return ReplySpec(self.declared_kinds()["peer"], num_classes=self.env.num_classes,
                         image_shape=tuple(self.env.image_shape))

    # -- peer topology -------------------------------------------------------------------------
    def neighbours(self, cid: int, sampled: list[int], ctx: ServerContext) -> list[int]:
        """The peers client `cid` may address this round (default: every other sampled client)."""
        return neighbourhood("all", cid, sampled, seed=ctx.seed, rnd=ctx.round)

    def share(self, client: ClientContext, peers: list[int]) -> dict[int, Message]:
        """Peer topology: what `client` sends to each of `peers` before its update this round.

        Runs on the client, with its persistent state (which it may update), before any
        sampled client's `client_update` of the round.
        """
        return {}

    # -- evaluation ----------------------------------------------------------------------------
    def global_model(self, state: ServerState) -> FedModel | None:
        """The model evaluated on every client's test set (None for personalised methods)."""
        return None

    def client_model(self, client: ClientContext) -> FedModel | None:
        """A client's own model: `own_model` for personalised/decentralised methods, else None."""
        return self.own_model(client) if self.personalized else None

    def personalise(self, model: FedModel, client: ClientContext) -> FedModel:
        """The global `model` as `client` runs it, with the layers it keeps local (methods with
        `local_layers`); a new model, since `model` may be shared by concurrent evaluations."""
        return model

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Synthetic/virtual image sets worth saving as PNG grids (name -> (images, labels))."""
        return {}

    def report(self, state: ServerState) -> dict[str, Any]:
        """Extra JSON-able entries for `summary.json` (e.g. a DP variant's epsilon per client)."""
        return {}

    # -- helpers ---------------------------------------------------------------------------------
    def client_train(self, client: ClientContext) -> TrainConfig:
        """The optimiser settings of `client`'s local training this round: the run's, with the
        round's learning rate (`--lr-decay`: lr * decay^round)."""
        return self.env.train.at_round(client.round)

    def new_model(self) -> FedModel:
        """A freshly initialised model on the run's device (same init for the same seed)."""
        return self.env.model_fn().to(self.env.device)

    def client_new_model(self, cid: int) -> FedModel:
        """A fresh model of client `cid`'s own architecture (`--client-models`)."""
        if self.env.client_model_fn is None:
            return self.env.model_fn().to(self.env.device)
        return self.env.client_model_fn(cid).to(self.env.device)

    def own_model(self, client: ClientContext) -> FedModel:
        """A client's own model: the weights kept in its state (`weights`), or a fresh model of
        its architecture before its first update (personalised and decentralised methods)."""
        model = self.client_new_model(client.cid).to(client.device)
        weights = client.state.arrays.get("weights")
        if weights is not None:
            model.load_state_dict(weights)
        return model

    def load_model(self, weights: Mapping[str, torch.Tensor], device: torch.device) -> FedModel:
        """A model carrying `weights`."""
        model = self.env.model_fn().to(device)
        model.load_state_dict(weights)
        return model


class TrainsOnUnion(Algorithm):
    """A method whose server trains one global model on the clients' synthetic sets and keeps
    the last union it trained on (`model`, `last_x`, `last_y` in its state): FedDM, FedAF."""

    def global_model(self, state: ServerState) -> FedModel:
        return self.load_model(state["model"], self.env.device)

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if state.get("last_x") is None:
            return {}
        return {self.shared_synthetic: (state["last_x"], state["last_y"])}


def params_naming(cls: type[Algorithm]) -> Naming:
    """How errors name the options of method `cls` ("fedprox option 'mu'")."""
    return Naming(label=f"{cls.name or cls.__name__} option '{{name}}'",
                  unknown=f"method '{cls.name}' has no option(s) {{names}}; allowed: {{allowed}}")


def parse_params(cls: type[Algorithm], args: Mapping[str, Any]) -> Any:
    """Validate `args` against the algorithm's Params dataclass, naming bad keys and types.

    Types, limits and choices come from the Params fields (see `fedvl.options`); a Params
    `check()` method, where defined, runs last for rules that span several options.
    """
    naming = params_naming(cls)
    params = check_options(from_mapping(cls.Params, args, naming=naming), naming)
    check = getattr(params, "check", None)
    if callable(check):
        check()
    return params


def make_algorithm(name: str, env: Env, args: Mapping[str, Any] | None = None) -> Algorithm:
    """Instantiate a registered algorithm with validated options."""
    cls = ALGORITHMS.get(name)
    if env.mixed_models and not cls.mixed_models:
        mixed = sorted(n for n in ALGORITHMS.names() if ALGORITHMS.get(n).mixed_models)
        raise ValueError(
            f"method '{name}' needs one architecture for every client, but --client-models "
            f"gives {', '.join(sorted(set(env.client_models)))}; methods that accept mixed "
            f"architectures: {', '.join(mixed) or '(none)'}")
    if env.aggregation in ("median", "trimmed-mean") and not cls.robust_aggregation:
        robust = sorted(n for n in ALGORITHMS.names() if ALGORITHMS.get(n).robust_aggregation)
        raise ConfigError(
            f"aggregation '{env.aggregation}' combines client models coordinate-wise, but "
            f"method '{name}' does not average client models; methods it applies to: "
            f"{', '.join(robust)}")
    return cls(env, parse_params(cls, args or {}))


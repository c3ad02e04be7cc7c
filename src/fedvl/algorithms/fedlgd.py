"""FedLGD (Huang et al., TMLR 2024): federated learning with local and global virtual data.

Round r (refresh rounds every `refresh_period` rounds, `refresh_count` times):
  client, first time:  local virtual data of the classes it owns (>= `min_class_count` images)
                       <- DM with random networks (warm-up) from random real images (`init=real`,
                       default) or N(mu_c, sigma_c) noise (`init=stats`, the paper); class
                       statistics uploaded once to seed the global set
  client, refresh r>0: iterative DM of the local virtual data with the current global model
  client, every round: SGD on local + global virtual data; outside refresh rounds the loss is
                       CE + lambda * SupCon(batch features, global virtual features)
  server, every round: average the client models (uniform or by size)
  server, refresh r:   federated gradient matching: the global virtual data is optimised so that
                       its CE gradient on the round's starting model w_old matches a target:
                       `model_diff` (default): g = (w_old - w_new) / lr, the pseudo-gradient of
                       the averaged update (the public code; the paper's "averaged client
                       gradient"; costs no extra upload), or `class_grad`: per-class gradients of
                       w_old on the clients' local virtual data, averaged per class and matched
                       class by class (an earlier public version; sent as `gradients`).
Clients never send raw data or their virtual data; the global virtual set travels down once per
version to each client, and its bytes show in the ledger as `synthetic_images`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedvl.algorithms.base import ClientContext, ServerContext, ServerState, real_data
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.contrastive import supcon_loss
from fedvl.core.message import Message, MetaValue
from fedvl.core.replies import ReplySpec, TensorSpec
from fedvl.core.training import LossTerm, local_train
from fedvl.data.federated import class_channel_stats
from fedvl.distill.augment import DSAConfig
from fedvl.distill.client_sets import VirtualSetSpec, client_virtual_set
from fedvl.distill.losses import gradient_distance
from fedvl.distill.samplers import FixedModelSampler, UniformClassSampler
from fedvl.distill.synthesize import (
    DistributionMatching,
    TargetGradientMatching,
    class_gradient,
    synthesize,
)
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models.base import FedModel
from fedvl.options import IntRange, LogUniform, option
from fedvl.progress import scope
from fedvl.registry import register_algorithm

# Server random streams (ids of ServerContext.stream): the global set's initial pixels and the
# gradient-matching steps draw from independent generators.
GLOBAL_INIT_STREAM = 53
GLOBAL_GM_STREAM = 59


class GlobalSupConTerm:
    """lambda * SupCon([z_batch; embed(global virtual)], [y_batch; y_global])."""

    def __init__(self, xg: torch.Tensor, yg: torch.Tensor, weight: float, temperature: float,
                 detach: bool) -> None:
        self.xg, self.yg, self.w, self.t, self.detach = xg, yg, weight, temperature, detach

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        # Recomputed every step as in the reference: the anchors move with the model.
        if self.detach:
            with torch.no_grad():
                zg = model.embed(self.xg)
        else:
            zg = model.embed(self.xg)
        feats = torch.cat([z, zg])
        return self.w * supcon_loss(feats, torch.cat([y, self.yg]), temperature=self.t)


class ClassGradientMatching:
    """Match per-class CE gradients of the global virtual set to per-class target gradients."""

    def __init__(self, model: FedModel, targets: dict[int, dict[str, torch.Tensor]],
                 metric: str = "ours") -> None:
        named = dict(model.named_parameters())
        self.model, self.metric = model, metric
        self.names = [n for n in named if any(n in t for t in targets.values())]
        self.params = [named[n] for n in self.names]
        self.targets = targets

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, gen: torch.Generator
                 ) -> tuple[torch.Tensor, None]:
        # One forward per class: each class's gradient back-propagates through its images only.
        total = images.new_zeros(())
        for c, rows in self._class_rows(labels).items():
            gs = class_gradient(self.model, images[rows], labels[rows], self.params)
            total = total + gradient_distance(gs, [self.targets[c][n] for n in self.names],
                                              self.metric)
        return total, None

    def _class_rows(self, labels: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each targeted class's rows of the set, read from the device once: the labels do not
        change while the images are optimised, so a step never waits on the device."""
        cached = self.__dict__.get("_rows")
        if cached is None or cached[0] is not labels:
            y = labels.detach().to("cpu", copy=True)
            rows = {c: (y == c).nonzero().flatten() for c in self.targets}
            rows = {c: r.to(labels.device) for c, r in rows.items() if len(r)}
            self.__dict__["_rows"] = cached = (labels, rows)
        return cached[1]


Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ClientSets:
    """A FedLGD client's persistent state: its local virtual set and the global one it holds.

    In the client's state Message (what checkpoints and Flower nodes keep) each set is an
    (images, labels) pair under the kinds `synthetic_images` / `synthetic_labels`, named
    "local" and "global"; `load` and `save` convert.
    """

    local: Pair | None = None
    global_set: Pair | None = None

    @classmethod
    def load(cls, state: Message) -> ClientSets:
        """The sets kept in `state`."""
        imgs = state.arrays.get("synthetic_images", {})
        labs = state.arrays.get("synthetic_labels", {})
        return cls(*((imgs[n], labs[n]) if n in imgs else None for n in ("local", "global")))

    def save(self, state: Message) -> None:
        """Write the sets held into `state`."""
        for name, pair in (("local", self.local), ("global", self.global_set)):
            if pair is not None:
                state.arrays.setdefault("synthetic_images", {})[name] = pair[0]
                state.arrays.setdefault("synthetic_labels", {})[name] = pair[1]

    def receive(self, msg: Message) -> None:
        """Keep the global set `msg` carries: the server sends each version once."""
        if "synthetic_images" in msg.arrays:
            self.global_set = (msg.arrays["synthetic_images"]["global"],
                               msg.arrays["synthetic_labels"]["global"])

    def receipt(self, msg: Message) -> dict[str, MetaValue]:
        """What a reply tells the server's bookkeeping: the global-set version of the round
        and whether this client holds a global set (so the server sends it no copy again)."""
        return {"version": int(msg.meta["version"]), "has_global": self.global_set is not None}

    def training_set(self) -> Pair:
        """The local set, with the global set after it where the client holds one."""
        assert self.local is not None, "the local set is distilled before training"
        if self.global_set is None:
            return self.local
        return (torch.cat([self.local[0], self.global_set[0]]),
                torch.cat([self.local[1], self.global_set[1]]))


@register_algorithm("fedlgd")
class FedLGD(FedAvg):
    """Local-global distillation."""

    name = "fedlgd"
    # Its local step trains on its own virtual sets, so a local-objective add-on would not apply.
    accepts_addons = False
    # Down: the global virtual set; up: class statistics once, per-class gradients (class_grad).
    payload_kinds = {"down": frozenset({"synthetic_images", "synthetic_labels"}),
                     "up": frozenset({"statistics", "gradients"})}
    # Its real images per class, which weight its class statistics (`global_stats=count`).
    count_tensors = frozenset({"statistics/count"})

    smoke_args = {"warmup_steps": 20, "local_dm_steps": 5, "server_gm_steps": 10}
    # The warm-up is the preset's `--virtual-steps` (the same sets as FedAvg's comparison); one
    # local and two global refreshes; 5 global images per class halve the SupCon cost of every
    # local step (quickstart-choice-cpu.json measures each cut).
    quickstart_args = {"warmup_steps": 20, "local_dm_steps": 5, "server_gm_steps": 15,
                       "server_ipc": 5, "refresh_count": 1}
    # The public code's DIGITS run (ubc-tea/FedLGD: --iters 100, --ipc 50, warm-up 10 000 DM
    # iterations, --ci_iter 100, --si_iter 500, 10 refreshes, 256 real images per class).
    paper_args = {"ipc": 50, "server_ipc": 10, "warmup_steps": 10000, "local_dm_steps": 100,
                  "server_gm_steps": 500, "refresh_count": 10, "batch_real": 256}
    paper_run = {"rounds": 100}

    # Defaults are sized for the 20-round default run on a 2-core CPU; the public code's
    # values are in the help texts (benchmarks pass them explicitly, `--preset paper` too).
    @dataclass
    class Params:
        ipc: int = option(10, "local virtual images per owned class (public code: 50)", ge=1,
                         tune=IntRange(1, 10))
        server_ipc: int = option(10, "global virtual images per class (public code: 10; 0: no "
                                 "global set)", ge=0)
        init: str = option("real", "local init: real images (the public code's --init real; "
                           "the local set never leaves the client), stats (the paper: "
                           "N(mu_c, sigma_c), needs thousands of DM steps to leave the noise) "
                           "or noise", choices=("stats", "noise", "real"))
        global_init: str = option("stats", "global init: stats (the public code: the pooled "
                                  "client class statistics) or noise (the paper's privacy "
                                  "argument: no client statistic is uploaded)",
                                  choices=("stats", "noise"))
        global_stats: str = option("count", "how client statistics are pooled: count (the "
                                   "pooled mean and std of all images of a class) or uniform "
                                   "(1/K over the clients holding the class, the public code)",
                                   choices=("count", "uniform"))
        min_class_count: int = option(10, "a client distils only classes with at least this "
                                      "many images", ge=1)
        warmup_steps: int = option(100, "initial DM steps of the local set (public code: "
                                   "10000)", ge=0)
        local_dm_steps: int = option(20, "iterative DM steps per local refresh (public code: "
                                     "100)", ge=0)
        server_gm_steps: int = option(50, "gradient-matching steps per global refresh (public "
                                      "code: 500)", ge=0)
        refresh_period: int = option(5, "rounds between refreshes (public code: 5)", ge=1)
        refresh_count: int = option(2, "refreshes, in the first half of 20 rounds (public "
                                    "code: 10 of 100 rounds; 0: none)", ge=0)
        batch_real: int = option(32, "real images per class per DM step (public code: 256)",
                                 ge=1)
        lr_img: float = option(1.0, "learning rate of the virtual images", gt=0)
        # 10 is the paper's DIGITS value (App. Table 12); it uses 1 on CIFAR-10-C (Table 13)
        # and 0.1 on RETINA (Table 14), so other benchmarks should pass `lambda_reg`.
        lambda_reg: float = option(10.0, "weight of the SupCon pull toward the global set",
                                   ge=0, tune=LogUniform(0.1, 10.0))
        temperature: float = option(0.07, "SupCon temperature", gt=0)
        detach_global: bool = option(False, "no gradient into the global virtual features "
                                     "(public code: not detached)")
        gm_target: str = option("model_diff", "gradient-matching target: model_diff (the "
                                "pseudo-gradient of the averaged update, the public code) or "
                                "class_grad (per-class client gradients, an earlier version)",
                                choices=("model_diff", "class_grad"))
        dsa: bool = option(True, "siamese augmentation in the local distillation")

    # -- schedule ----------------------------------------------------------------------------
    def local_refresh(self, rnd: int) -> bool:
        """Rounds r > 0 with r % period == 0, for the first `refresh_count` periods."""
        p = self.p
        return rnd > 0 and rnd % p.refresh_period == 0 and rnd // p.refresh_period <= \
            p.refresh_count

    def global_refresh(self, rnd: int) -> bool:
        """Rounds r % period == 0 up to `refresh_count` periods, round 0 included."""
        p = self.p
        return (p.refresh_count > 0 and p.server_ipc > 0 and rnd % p.refresh_period == 0
                and rnd // p.refresh_period <= p.refresh_count)

    # -- server ------------------------------------------------------------------------------
    def server_init(self) -> ServerState:
        state = super().server_init()
        state.update(global_x=None, global_y=None, version=0, sent={}, log=[])
        return state

    def configure(self, state: ServerState, ctx: ServerContext, clients: list[int]
                  ) -> dict[int, Message]:
        need_stats = (state["global_x"] is None and self.p.server_ipc > 0
                      and self.p.global_init == "stats")
        rnd = ctx.round
        meta = {"round": rnd, "local_refresh": self.local_refresh(rnd),
                "regularize": not self.local_refresh(rnd) and not self.global_refresh(rnd),
                "need_stats": need_stats, "class_grad": self.p.gm_target == "class_grad"
                and self.global_refresh(rnd), "version": state["version"]}
        out = {}
        for c in clients:
            arrays = {"weights": state["model"]}
            if state["global_x"] is not None and state["sent"].get(c) != state["version"]:
                arrays["synthetic_images"] = {"global": state["global_x"]}
                arrays["synthetic_labels"] = {"global": state["global_y"]}
            out[c] = Message(arrays, dict(meta))
        return out

    def reply_spec(self, sent: Message, cid: int) -> ReplySpec:
        spec = super().reply_spec(sent, cid)
        c, ch = self.env.num_classes, self.env.image_shape[0]
        spec.exact["statistics"] = {"mean": TensorSpec((c, ch)), "std": TensorSpec((c, ch)),
                                    "count": TensorSpec((c,))}
        # Per-class gradients "k/<parameter>", each shaped like that parameter, every parameter
        # in each class's block (the server stacks them over clients).
        params = self.parameter_keys()
        spec.keyed["gradients"] = {n: TensorSpec.like(t) for n, t in sent.get("weights").items()
                                   if n in params}
        return spec

    def meta_bounds(self, cid: int, announced: int) -> dict[str, tuple[int, int]]:
        """`num_examples` counts the virtual images a client trains on: its local set (one it
        distils, `ipc` per class, or the one `--local-data virtual` provides, within the
        announced size) and the global one, which together may outnumber its real images."""
        k = self.env.num_classes
        return {"num_examples": (1, max(announced, self.p.ipc * k) + self.p.server_ipc * k)}

    def aggregate(self, state: ServerState, ctx: ServerContext, replies: dict[int, Message]
                  ) -> ServerState:
        w_old = state["model"]
        new = super().aggregate(state, ctx, replies)
        sent = dict(state["sent"])
        for c, r in replies.items():
            if r.meta.get("has_global"):
                sent[c] = int(r.meta["version"])
        new["sent"] = sent
        log = list(state["log"])
        if new["global_x"] is None and self.p.server_ipc > 0:
            new["global_x"], new["global_y"] = self._init_global(replies, ctx)
            new["version"] = state["version"] + 1
        if self.global_refresh(ctx.round) and new["global_x"] is not None:
            new["global_x"] = self._gradient_matching(w_old, new["model"], new["global_x"],
                                                      new["global_y"], replies, ctx)
            new["version"] = new["version"] + 1
            log.append({"round": ctx.round, "global_refresh": True})
        if self.local_refresh(ctx.round):
            log.append({"round": ctx.round, "local_refresh": sorted(replies)})
        new["log"] = log
        return new

    def _init_global(self, replies: dict[int, Message], ctx: ServerContext
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        g = ctx.stream(GLOBAL_INIT_STREAM)
        stats = [r.arrays["statistics"] for r in replies.values() if "statistics" in r.arrays]
        shape = self.env.image_shape
        if self.p.global_init == "stats" and stats:
            mean, std, total = pool_class_stats(stats, self.p.global_stats)
            # A class no client holds gets no global images (instead of blank ones).
            ipc = [self.p.server_ipc if int(n) > 0 else 0 for n in total]
            syn = SyntheticSet.from_stats(ipc, mean, std, shape, g)
        else:
            syn = SyntheticSet.noise(self.p.server_ipc, self.env.num_classes, shape, g)
        x, y = syn.tensors()
        return x.to(ctx.device), y.to(ctx.device)

    def _gradient_matching(self, w_old: dict, w_new: dict, gx: torch.Tensor, gy: torch.Tensor,
                           replies: dict[int, Message], ctx: ServerContext) -> torch.Tensor:
        model = self.load_model(w_old, ctx.device)
        model.train()
        syn = SyntheticSet(gx, gy, self.env.num_classes)
        if self.p.gm_target == "class_grad":
            grads = [r.arrays["gradients"] for r in replies.values() if "gradients" in r.arrays]
            targets: dict[int, dict[str, torch.Tensor]] = {}
            for c in range(self.env.num_classes):
                keyed = [g for g in grads if any(k.startswith(f"{c}/") for k in g)]
                if not keyed:
                    continue
                names = {k.split("/", 1)[1] for k in keyed[0] if k.startswith(f"{c}/")}
                targets[c] = {n: torch.stack([g[f"{c}/{n}"] for g in keyed]).mean(0)
                              for n in names}
            objective = ClassGradientMatching(model, targets)
        else:
            # The clients trained this round at its decayed learning rate (`--lr-decay`).
            lr = self.env.train.lr_at(ctx.round)
            names = {n for n, _ in model.named_parameters()}
            target = {n: (w_old[n] - w_new[n]) / lr for n in names}
            objective = TargetGradientMatching(model, target)
        with scope(phase="server_matching"):   # its steps show in a progress display
            synthesize(syn, objective, self.p.server_gm_steps, ctx.stream(GLOBAL_GM_STREAM),
                       lr_img=self.p.lr_img)
        return syn.images.detach()

    def virtual_sets(self, state: ServerState, client_states: dict[int, Message]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        if state.get("global_x") is not None:
            out["global_virtual"] = (state["global_x"], state["global_y"])
        for cid, st in client_states.items():
            local = ClientSets.load(st).local
            if local is not None:
                out[f"local_virtual_{self.env.client_name(cid)}"] = local
        return out

    # -- client ------------------------------------------------------------------------------
    def warmup_spec(self) -> VirtualSetSpec:
        """How a client's local virtual set is first distilled (`--local-data virtual` with the
        same settings distils the same set)."""
        p = self.p
        return VirtualSetSpec(ipc=p.ipc, steps=p.warmup_steps, init=p.init,
                              batch_real=p.batch_real, lr_img=p.lr_img, dsa=p.dsa,
                              min_count=p.min_class_count)

    def _random_model(self, seed: int) -> FedModel:
        # `distill_client` moves it to the data's device.
        return self.env.model_fn(seed=seed)

    def _local_set(self, client: ClientContext, sets: ClientSets) -> SyntheticSet:
        """The client's local virtual set: the one it keeps, or (first participation) its
        distilled warm-up set."""
        if sets.local is not None:
            return SyntheticSet(*sets.local, client.num_classes)
        if client.x_real is not None:
            # --local-data virtual: the client's training data already is its distilled set.
            return SyntheticSet(client.x, client.y, client.num_classes, {"init": "provided"})
        spec = self.warmup_spec()
        # The same owner (and cache) as --local-data virtual: equal settings, equal sets.
        with scope(phase="distill"):   # the warm-up's steps show in a progress display
            syn = client_virtual_set(client.x, client.y, client.num_classes,
                                     self._random_model, spec, self.env.seed, client.cid)
        return syn.to(client.device)

    def _refresh(self, local: SyntheticSet, model: FedModel, xr: torch.Tensor,
                 yr: torch.Tensor, client: ClientContext) -> None:
        """Iterative DM of the local set, with the received global model as the extractor."""
        objective = DistributionMatching(
            real=UniformClassSampler(xr, yr, client.num_classes, self.p.batch_real),
            extractor=FixedModelSampler(model),
            num_classes=client.num_classes,
            dsa=DSAConfig() if self.p.dsa else None,
        )
        with scope(phase="refresh"):
            synthesize(local, objective, self.p.local_dm_steps, client.generator,
                       lr_img=self.p.lr_img)

    def _supcon(self, sets: ClientSets) -> Sequence[LossTerm]:
        """The pull toward the global set (none before the client holds one)."""
        if sets.global_set is None or self.p.lambda_reg <= 0:
            return ()
        return (GlobalSupConTerm(*sets.global_set, self.p.lambda_reg, self.p.temperature,
                                 self.p.detach_global),)

    def client_update(self, msg: Message, client: ClientContext) -> Message:
        model = self.load_model(msg.get("weights"), client.device)
        sets = ClientSets.load(client.state)
        sets.receive(msg)                          # a new global set, if one came
        local = self._local_set(client, sets)      # warm-up DM on first participation
        xr, yr = real_data(client)
        if msg.meta.get("local_refresh"):
            self._refresh(local, model, xr, yr, client)
        sets.local = local.tensors()
        sets.save(client.state)
        # Class gradients of the received model, before local training moves it.
        grads = self._class_gradients(model, *sets.local) if msg.meta.get("class_grad") else None
        # SGD on local + global virtual data; CE + lambda * SupCon outside refresh rounds.
        terms = self._supcon(sets) if msg.meta.get("regularize") else ()
        x, y = sets.training_set()
        stats = local_train(model, x, y, self.client_train(client), client.generator,
                            terms=terms)
        reply = self.reply(model, stats, msg, client)
        reply.meta.update(num_examples=len(y), **sets.receipt(msg))
        if msg.meta.get("need_stats"):
            mean, std, counts = class_channel_stats(xr, yr, client.num_classes)
            reply.arrays["statistics"] = {"mean": mean, "std": std, "count": counts.float()}
        if grads is not None:
            reply.arrays["gradients"] = grads
        return reply

    def _class_gradients(self, model: FedModel, x: torch.Tensor, y: torch.Tensor
                         ) -> dict[str, torch.Tensor]:
        """Per-class CE gradients of the received global model on the local virtual data."""
        model.train()
        named = [(n, p) for n, p in model.named_parameters()]
        out: dict[str, torch.Tensor] = {}
        for c in y.unique().tolist():
            mask = y == c
            loss = F.cross_entropy(model(x[mask]), y[mask])
            grads = torch.autograd.grad(loss, [p for _, p in named])
            out.update({f"{c}/{n}": g.detach() for (n, _), g in zip(named, grads, strict=True)})
        return out


def pool_class_stats(stats: list[dict[str, torch.Tensor]], rule: str = "count"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool uploaded per-client class statistics into (mean [K, C], std [K, C], counts [K]).

    `count`: the exact pooled mean and std of all clients' images of each class, from each
    client's mean, std and count. `uniform`: the plain mean of the clients' means and of their
    stds over the clients holding the class (the public code's 1/K rule, which with every class
    at every client is exactly its average). Clients without a class never contribute to it.
    """
    mean = torch.stack([s["mean"] for s in stats])      # [K clients, classes, C]
    std = torch.stack([s["std"] for s in stats])
    count = torch.stack([s["count"] for s in stats])    # [K clients, classes]
    if rule == "uniform":
        held = (count > 0).to(mean.dtype).unsqueeze(-1)
        k = held.sum(0).clamp_min(1)
        return (held * mean).sum(0) / k, (held * std).sum(0) / k, count.sum(0)
    w = count.double().unsqueeze(-1)
    total_w = w.sum(0).clamp_min(1e-12)
    pooled_mean = (w * mean.double()).sum(0) / total_w
    second = (w * (std.double() ** 2 + mean.double() ** 2)).sum(0) / total_w
    pooled_std = (second - pooled_mean**2).clamp_min(0).sqrt()
    return pooled_mean.float(), pooled_std.float(), count.sum(0)

"""A tampered client cannot crash or capture the server.

One client (c1) of a tiny in-process federation hands the server a different altered reply in
every round: no message at all, numpy or list or sparse or meta-device tensors, wrong dtypes and
shapes, NaN and Inf, extra and missing kinds, soft labels where a method takes class indices,
labels out of range, impossible metadata (`num_examples = 10**400`, more examples than the
client announced when it joined, FedNova steps it could not have taken). The tampering happens
where the reply reaches the server (after the transport's exchange), so it stands for anything
a hostile node can put on the wire. Every run must complete, and every tampered reply must be
rejected (listed under the round's `rejected`, in `rejected_replies`) while the two honest
clients' replies are aggregated. Weights that are merely extreme (finite, 1e30) pass this
per-reply check by design: the round's bound on each update refuses them
(tests/test_bounded_updates.py), and the tests below show robust aggregation resisting them
on its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.engine.driver import Exchange, RoundDriver
from fedvl.engine.inprocess import InProcessTransport
from fedvl.run.experiment import run_experiment
from tests.conftest import RUN_EXTRA, make_toy_federation, small_args, small_model_args

TARGET = 1           # the tampered client, "c1"
# Each client's training-set size, announced when it joins: 12 images per class, so the
# distilling methods own every class (their `min_class_count` is 10).
N_TRAIN = 48
CLASSES = 4
Tamper = Callable[[Message], Any]


def raw(arrays: Any, meta: Any) -> Message:
    """A Message built without the constructor's check (as a hostile client may)."""
    msg = Message.__new__(Message)
    msg.arrays, msg.meta = arrays, meta
    return msg


def _copy(m: Message) -> tuple[dict, dict]:
    return {k: dict(d) for k, d in m.arrays.items()}, dict(m.meta)


def _first(m: Message, floating: bool = True, kind: str | None = None) -> tuple[str, str]:
    """The (kind, name) of the reply's first (floating) tensor, in sorted order."""
    for k in sorted(m.arrays) if kind is None else [kind]:
        for n in sorted(m.arrays[k]):
            if not floating or m.arrays[k][n].is_floating_point():
                return k, n
    raise LookupError("no tensor to tamper with")


def on_tensor(change: Callable[[torch.Tensor], Any], floating: bool = True,
              kind: str | None = None) -> Tamper:
    """Replace the reply's first (floating) tensor by `change(tensor)`."""
    def tamper(m: Message) -> Message:
        arrays, meta = _copy(m)
        k, n = _first(m, floating, kind)
        arrays[k][n] = change(arrays[k][n])
        return raw(arrays, meta)
    return tamper


def on_meta(**values: Any) -> Tamper:
    """Set metadata entries."""
    def tamper(m: Message) -> Message:
        arrays, meta = _copy(m)
        meta.update(values)
        return raw(arrays, meta)
    return tamper


def on_arrays(change: Callable[[dict], None]) -> Tamper:
    """Apply `change` to a copy of the reply's arrays."""
    def tamper(m: Message) -> Message:
        arrays, meta = _copy(m)
        change(arrays)
        return raw(arrays, meta)
    return tamper


def _drop_first_kind(a: dict) -> None:
    del a[sorted(a)[0]]


def _extra_name(a: dict) -> None:
    k = sorted(a)[0]
    a[k]["smuggled"] = torch.zeros(3)


def _rename(a: dict) -> None:
    k = sorted(a)[0]
    n = sorted(a[k])[0]
    a[k]["renamed"] = a[k].pop(n)


class Shady(torch.Tensor):
    """A tensor subclass: it could override any operation the server runs on it."""


# -- tampers for every reply that carries tensors ---------------------------------------------
STRUCTURE: dict[str, Tamper] = {
    "reply None": lambda m: None,
    "reply a dict": lambda m: {"weights": {}},
    "reply a string": lambda m: "weights",
    "arrays a list": lambda m: raw([1, 2], dict(m.meta)),
    "meta None": lambda m: raw(_copy(m)[0], None),
    "meta holds a dict": on_meta(num_examples={"n": 5}),
    "unknown kind": on_arrays(lambda a: a.__setitem__("bogus", {"x": torch.zeros(1)})),
    "undeclared kind": on_arrays(lambda a: a.__setitem__("raw_images",
                                                         {"x": torch.zeros(1, 3, 8, 8)})),
    "missing kind": on_arrays(_drop_first_kind),
    "extra tensor": on_arrays(_extra_name),
    "renamed tensor": on_arrays(_rename),
    "tensor name not str": on_arrays(lambda a: a[sorted(a)[0]].__setitem__(
        7, torch.zeros(1))),
    "numpy": on_tensor(lambda t: t.numpy(), floating=False),
    "list": on_tensor(lambda t: t.tolist(), floating=False),
    "None tensor": on_tensor(lambda t: None, floating=False),
    "python float": on_tensor(lambda t: 1.5, floating=False),
    "sparse": on_tensor(lambda t: t.reshape(-1).to_sparse()),
    "meta device": on_tensor(lambda t: torch.empty(t.shape, device="meta")),
    "subclass": on_tensor(lambda t: t.as_subclass(Shady)),
    "float64": on_tensor(lambda t: t.double()),
    "float16": on_tensor(lambda t: t.half()),
    "int64": on_tensor(lambda t: t.long()),
    "bool": on_tensor(lambda t: t > 0),
    "complex": on_tensor(lambda t: t.to(torch.complex64)),
    "extra axis": on_tensor(lambda t: t[None]),
    "scalar": on_tensor(lambda t: t.reshape(-1)[0]),
    "NaN": on_tensor(lambda t: torch.full_like(t, float("nan"))),
    "Inf": on_tensor(lambda t: torch.full_like(t, float("inf"))),
}
# -- metadata every weighted method reads ------------------------------------------------------
META: dict[str, Tamper] = {
    "num_examples 10**400": on_meta(num_examples=10**400),
    "num_examples 10**12": on_meta(num_examples=10**12),
    "num_examples announced + 1": on_meta(num_examples=N_TRAIN + 1),
    "num_examples 0": on_meta(num_examples=0),
    "num_examples negative": on_meta(num_examples=-5),
    "num_examples bool": on_meta(num_examples=True),
    "num_examples float": on_meta(num_examples=2.5),
    "num_examples NaN": on_meta(num_examples=float("nan")),
    "num_examples str": on_meta(num_examples="24"),
    "train_loss NaN": on_meta(train_loss=float("nan")),
    "train_loss str": on_meta(train_loss="low"),
}


def _times_minus_ten(m: Message) -> Message:
    arrays, meta = _copy(m)
    arrays["weights"] = {n: t * -10 if t.is_floating_point() else t
                         for n, t in arrays["weights"].items()}
    meta["num_examples"] = 10**12
    return raw(arrays, meta)


WEIGHTS = {**STRUCTURE, **META, "weights x -10, num_examples 10**12": _times_minus_ten}
FEDNOVA = {"steps 0": on_meta(steps=0), "steps 10**30": on_meta(steps=10**30),
           "steps negative": on_meta(steps=-1), "steps float": on_meta(steps=3.0),
           "steps beyond the client's most": on_meta(steps=4 * N_TRAIN),
           "steps missing": lambda m: raw(_copy(m)[0], {k: v for k, v in m.meta.items()
                                                          if k != "steps"})}


def labelled(prefix: str, name: str, label: str, soft: bool = False) -> dict[str, Tamper]:
    """Tampers of a `<prefix>_images` / `<prefix>_labels` pair (tensors `name`, `label`)."""
    xi, yi = f"{prefix}_images", f"{prefix}_labels"

    def labels(change: Callable[[torch.Tensor], Any]) -> Tamper:
        return on_tensor(change, floating=False, kind=yi)

    def hard(y: torch.Tensor) -> torch.Tensor:
        return y.argmax(1) if y.is_floating_point() else y

    def one_hot(y: torch.Tensor) -> torch.Tensor:
        return y if y.is_floating_point() else torch.nn.functional.one_hot(y, CLASSES).float()

    def more_rows(a: dict) -> None:
        a[xi][name] = torch.cat([a[xi][name]] * 20)
        a[yi][label] = torch.cat([a[yi][label]] * 20)

    out: dict[str, Tamper] = {
        f"{prefix} images float64": on_tensor(lambda t: t.double(), kind=xi),
        f"{prefix} images wrong channels": on_tensor(lambda t: t[:, :1], kind=xi),
        f"{prefix} images flat": on_tensor(lambda t: t.reshape(len(t), -1), kind=xi),
        f"{prefix} images without labels": on_arrays(lambda a: a.pop(yi)),
        f"{prefix} labels without images": on_arrays(lambda a: a.pop(xi)),
        f"{prefix} one label fewer": labels(lambda y: y[:-1]),
    }
    if soft:
        out.update({
            f"{prefix} hard labels where soft": labels(hard),
            f"{prefix} soft labels not probabilities": labels(lambda y: y * 50),
            f"{prefix} soft labels float64": labels(lambda y: y.double()),
        })
    else:
        out.update({
            f"{prefix} soft labels where hard": labels(one_hot),
            f"{prefix} label = classes": labels(lambda y: torch.full_like(y, CLASSES)),
            f"{prefix} label negative": labels(lambda y: torch.full_like(y, -1)),
            f"{prefix} label 10**7": labels(lambda y: torch.full_like(y, 10**7)),
            f"{prefix} labels int32": labels(lambda y: y.int()),
            f"{prefix} labels as a column": labels(lambda y: y[:, None]),
            f"{prefix} 20x the rows": on_arrays(more_rows),
        })
    return out


def _pick(tampers: dict[str, Tamper], *names: str) -> dict[str, Tamper]:
    return {n: tampers[n] for n in names}


SOME = ("reply None", "arrays a list", "numpy", "sparse", "meta device", "float64", "NaN",
        "undeclared kind", "missing kind", "extra tensor")
CASES: dict[str, dict[str, Tamper]] = {
    "fedavg": WEIGHTS,
    "fednova": {**_pick(WEIGHTS, "numpy", "float64", "num_examples 10**400",
                        "num_examples 10**12"), **FEDNOVA},
    "scaffold": _pick(WEIGHTS, *SOME, "num_examples 10**12"),
    "fedprox": _pick(WEIGHTS, "reply None", "list", "Inf", "num_examples 10**400"),
    "moon": _pick(WEIGHTS, "None tensor", "int64", "num_examples announced + 1"),
    "feddyn": _pick(WEIGHTS, "reply None", "float64", "NaN", "extra tensor", "missing kind",
                    "num_examples 10**12"),
    "feddm": {**_pick(STRUCTURE, *SOME), **labelled("synthetic", "x", "y")},
    # Without DP each client sends its trust-region radius, which the server votes on.
    "fedlapdp": {**_pick(STRUCTURE, "reply None", "NaN", "missing kind"),
                 **_pick(labelled("synthetic", "x", "y"), "synthetic 20x the rows"),
                 "radius NaN": on_meta(radius=float("nan")),
                 "radius negative": on_meta(radius=-1.0),
                 "radius str": on_meta(radius="far"),
                 "radius missing": lambda m: raw(_copy(m)[0], {k: v for k, v in m.meta.items()
                                                               if k != "radius"})},
    "fedd3": {**_pick(STRUCTURE, "reply None", "numpy", "NaN", "undeclared kind"),
              **_pick(labelled("synthetic", "x", "y"), "synthetic images wrong channels",
                      "synthetic soft labels where hard", "synthetic label = classes",
                      "synthetic 20x the rows")},
    "fedvck": {**_pick(STRUCTURE, "reply None", "numpy", "float64", "missing kind"),
               **labelled("synthetic", "round", "round"),
               "prototype width": on_arrays(lambda a: a["prototypes"].__setitem__(
                   "features", a["prototypes"]["features"][:, :3]))},
    "fedaf": {**_pick(STRUCTURE, "reply None", "numpy", "float64", "NaN", "missing kind",
                      "extra tensor"),
              **_pick(labelled("synthetic", "x", "y"), "synthetic images wrong channels",
                      "synthetic label = classes", "synthetic one label fewer",
                      "synthetic 20x the rows"),
              "soft labels not summing to 1": on_arrays(lambda a: a["logits"].__setitem__(
                  "soft_labels", a["logits"]["soft_labels"] * 0.5)),
              "soft labels of 3 classes": on_arrays(lambda a: a["logits"].__setitem__(
                  "soft_labels", a["logits"]["soft_labels"][:, :3])),
              "soft labels negative, summing to 1": on_arrays(lambda a: a["logits"].__setitem__(
                  "soft_labels", torch.tensor([[1.5, -0.5, 0.0, 0.0]] * CLASSES))),
              "soft labels of 5 classes' rows": on_arrays(lambda a: a["logits"].__setitem__(
                  "soft_labels", torch.full((CLASSES + 1, CLASSES), 1 / CLASSES))),
              "knowledge of 3 classes": on_arrays(lambda a: a["prototypes"].__setitem__(
                  "logits", a["prototypes"]["logits"][:, :3])),
              "knowledge Inf": on_arrays(lambda a: a["prototypes"].__setitem__(
                  "logits", torch.full_like(a["prototypes"]["logits"], float("inf")))),
              "counts missing": on_arrays(lambda a: a["prototypes"].pop("counts")),
              "num_examples missing": lambda m: raw(_copy(m)[0], {k: v for k, v in m.meta.items()
                                                                 if k != "num_examples"})},
    "fedmix": {**_pick(STRUCTURE, "reply None", "meta device"), **labelled("mean", "x", "y", True),
               "more means than the client has groups": on_arrays(lambda a: (
                   a["mean_images"].__setitem__("x", torch.cat([a["mean_images"]["x"]] * 60)),
                   a["mean_labels"].__setitem__("y", torch.cat([a["mean_labels"]["y"]] * 60))))},
    "centralised": {**_pick(STRUCTURE, "reply None", "sparse"),
                    **_pick(labelled("raw", "x", "y"), "raw soft labels where hard",
                            "raw label 10**7", "raw one label fewer", "raw 20x the rows")},
    "fedproto": _pick(STRUCTURE, *SOME, "python float"),
    "fedhe": _pick(STRUCTURE, "reply None", "float64", "extra axis", "missing kind"),
    # Logits on the public set: one row per public image, one column per class.
    "fccl": {**_pick(STRUCTURE, "reply None", "missing kind", "extra tensor", "float64", "NaN",
                     "Inf"),
             "logits of one class fewer": on_tensor(lambda t: t[:, :-1]),
             "logits of one public image fewer": on_tensor(lambda t: t[:-1])},
    "fedgen": _pick(STRUCTURE, "reply None", "missing kind", "numpy", "float64"),
    # Sorted kinds: discriminator, generator, weights (the first is the discriminator).
    "fedgan": {**_pick(STRUCTURE, "reply None", "missing kind", "float64", "extra axis", "NaN"),
               "generator missing": on_arrays(lambda a: a.pop("generator")),
               "generator of a wider layer": on_tensor(lambda t: torch.cat([t, t]),
                                                       kind="generator")},
    # Nothing comes down: the upload is checked against the client's own architecture.
    "dense": {**_pick(STRUCTURE, "reply None", "missing kind", "extra tensor", "renamed tensor",
                      "float64", "extra axis", "NaN"),
              "weights of a wider layer": on_tensor(lambda t: torch.cat([t, t]))},
    # DENSE's client and upload check.
    "coboosting": {**_pick(STRUCTURE, "reply None", "renamed tensor", "NaN"),
                   "weights of a wider layer": on_tensor(lambda t: torch.cat([t, t]))},
    # Sorted kinds: statistics (the label counts), weights.
    "dfrd": {**_pick(WEIGHTS, "reply None", "missing kind", "float64", "NaN",
                     "num_examples 10**12"),
             "label counts beyond the client's size": on_arrays(lambda a: a.__setitem__(
                 "statistics", {"label_counts": a["statistics"]["label_counts"] * 100})),
             "label counts of 3 classes": on_arrays(lambda a: a.__setitem__(
                 "statistics", {"label_counts": a["statistics"]["label_counts"][:3]})),
             "weights of a wider layer": on_tensor(lambda t: torch.cat([t, t]),
                                                   kind="weights")},
    "fedlgd": {**_pick(WEIGHTS, "reply None", "float64", "num_examples 10**12"),
               "gradients of a class that is not one": on_arrays(lambda a: a.__setitem__(
                   "gradients", {f"{CLASSES}/{k}": v for k, v in a["weights"].items()
                                 if v.is_floating_point()})),
               "gradients of half the parameters": on_arrays(lambda a: a.__setitem__(
                   "gradients", {f"0/{k}": v for k, v in list(a["weights"].items())[:1]}))},
    "local": _pick(META, "num_examples 10**400", "num_examples str"),
    # BatchNorm entries stay on the client: one sent up anyway is an unexpected tensor.
    "fedbn": {**_pick(WEIGHTS, "reply None", "float64", "extra tensor", "num_examples 10**12"),
              "a BatchNorm statistic sent up": on_arrays(lambda a: a["weights"].__setitem__(
                  "features.1.running_mean", torch.zeros(8)))},
    # Round 1's would enter the trajectory the synthesis of round 2 matches.
    "dynafed": _pick(WEIGHTS, "reply None", "NaN", "num_examples 10**12"),
}
PEER: dict[str, Tamper] = {**_pick(STRUCTURE, "reply None", "numpy", "float64", "NaN",
                                   "sparse", "meta device", "undeclared kind"),
                           "addressed to a client that is not its peer": lambda m: m}
_ROUNDS = {name: len(t) for name, t in CASES.items()}
# Peer: the sender's message to both receivers, but one message to a client it may not address.
TOTAL = sum(_ROUNDS.values()) + 2 * len(PEER) - 1


def _cfg(name: str, rounds: int, **extra: Any) -> RunConfig:
    return RunConfig(method=name, method_args=small_args(name), rounds=rounds, batch_size=8,
                     lr=0.05, momentum=0.0, eval_every=rounds,
                     model_args=small_model_args(name),
                     **{**RUN_EXTRA.get(name, {}), **extra})


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=N_TRAIN, n_test=8, num_classes=CLASSES)


def _tamper_exchange(monkeypatch, tampers: list[Tamper]) -> None:
    """Client TARGET's reply in round r reaches the server as `tampers[r](reply)`."""
    original = InProcessTransport.exchange

    def exchange(self, rnd, outgoing, inboxes=None) -> Exchange:
        ex = original(self, rnd, outgoing, inboxes)
        if TARGET in ex.replies:
            ex.replies[TARGET] = tampers[rnd](ex.replies[TARGET])
        return ex

    monkeypatch.setattr(InProcessTransport, "exchange", exchange)


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").open()]


def test_a_hundred_tampered_replies_are_counted():
    assert TOTAL >= 100, TOTAL


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_tampered_reply_is_rejected_and_the_run_completes(name, fed, tmp_path,
                                                                monkeypatch):
    tampers = CASES[name]
    _tamper_exchange(monkeypatch, list(tampers.values()))
    s = run_experiment(_cfg(name, len(tampers)), out=tmp_path / "r", fed=fed)
    rows = _rows(tmp_path / "r")
    assert len(rows) == len(tampers)
    for row, case in zip(rows, tampers, strict=True):
        why = row.get("rejected", {}).get("c1")
        assert why, (name, case, "not rejected")
        assert len(why) <= 300, (case, why)
        assert set(row["participants"]) == {0, 2}, (case, row["participants"])
    assert len([r for r in s["rejected_replies"] if r["client"] == "c1"]) == len(tampers)
    assert s["skipped_rounds"] == []
    assert all(math.isfinite(a) for a in s["per_client_accuracy"].values())


def test_tampered_peer_messages_are_rejected(fed, tmp_path, monkeypatch):
    tampers = list(PEER.values())
    original = InProcessTransport.share

    def share(self, rnd, peers):
        out = original(self, rnd, peers)
        sent = out.get(TARGET, {})
        if rnd == len(tampers) - 1:   # the last round: a message to a client it may not address
            out[TARGET] = {7: next(iter(sent.values()))} if sent else {}
        else:
            out[TARGET] = {r: tampers[rnd](m) for r, m in sent.items()}
        return out

    monkeypatch.setattr(InProcessTransport, "share", share)
    s = run_experiment(_cfg("desa", len(tampers)), out=tmp_path / "r", fed=fed)
    rows = _rows(tmp_path / "r")
    for rnd, row in enumerate(rows):
        got = row.get("rejected_peer", {})
        want = {"c1->7"} if rnd == len(tampers) - 1 else {"c1->c0", "c1->c2"}
        assert set(got) == want, (list(PEER)[rnd], got)
        assert all(len(w) <= 300 for w in got.values())
    assert len([r for r in s["rejected_replies"] if r.get("peer")]) == 2 * len(tampers) - 1
    assert all(math.isfinite(a) for a in s["per_client_accuracy"].values())


def test_announced_size_is_learnt_once_and_checkpointed(fed, tmp_path, monkeypatch):
    """A client cannot raise its announced size after joining, and a resumed run keeps it."""
    calls = []
    original = InProcessTransport.train_size

    def train_size(self, cid):
        calls.append(cid)
        return original(self, cid) if len(calls) <= 3 else 10**12

    monkeypatch.setattr(InProcessTransport, "train_size", train_size)
    _tamper_exchange(monkeypatch, [lambda m: m, on_meta(num_examples=10**12)])
    drivers = []
    original_run = RoundDriver.run

    def run(self, *a, **k):
        drivers.append(self)
        return original_run(self, *a, **k)

    monkeypatch.setattr(RoundDriver, "run", run)
    s = run_experiment(_cfg("fedavg", 2), out=tmp_path / "r", fed=fed)
    assert sorted(calls) == [0, 1, 2]   # asked once per client, never again
    assert drivers[0].announced == {0: N_TRAIN, 1: N_TRAIN, 2: N_TRAIN}
    assert [r["round"] for r in s["rejected_replies"]] == [1]
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    assert ck["announced"] == {0: N_TRAIN, 1: N_TRAIN, 2: N_TRAIN}


def _scale(factor: float) -> Tamper:
    def tamper(m: Message) -> Message:
        arrays, meta = _copy(m)
        arrays["weights"] = {n: t * factor if t.is_floating_point() else t
                             for n, t in arrays["weights"].items()}
        return raw(arrays, meta)
    return tamper


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_fednova_robust_rule_resists_one_scaled_client(rule, fed, tmp_path, monkeypatch):
    """FedNova takes --aggregation median|trimmed-mean: one client's 1e6-scaled weights pass
    the check (finite, in bounds) and move no coordinate of the server's model far. The round's
    update bound, which would refuse them first, is switched off: the rule resists alone."""
    cfg = _cfg("fednova", 2, aggregation=rule, trim=0.34)
    clean = run_experiment(cfg, out=tmp_path / "clean", fed=fed)
    monkeypatch.setattr("fedvl.engine.driver.bound_round", lambda *a, **k: {})
    _tamper_exchange(monkeypatch, [_scale(1e6)] * 2)
    hit = run_experiment(cfg, out=tmp_path / "hit", fed=fed)
    assert hit["rejected_replies"] == []
    state = torch.load(tmp_path / "hit" / "checkpoint.pt", weights_only=True)["server_state"]
    biggest = max(float(v.abs().max()) for v in state["model"].values() if v.is_floating_point())
    assert biggest < 10.0
    assert abs(clean["mean_accuracy"] - hit["mean_accuracy"]) < 0.25


def test_fednova_robust_step_equals_median_of_normalised_updates():
    """With three clients, the robust step is w - median(a_k) * median_k((w - w_k) / a_k)."""
    from fedvl.algorithms.base import Env, ServerContext, make_algorithm
    from fedvl.core.training import TrainConfig

    env = Env(model_fn=lambda **k: torch.nn.Linear(2, 1), num_classes=2, num_clients=3,
              train=TrainConfig(), aggregation="median")
    alg = make_algorithm("fednova", env)
    w = {"weight": torch.zeros(1, 2), "bias": torch.zeros(1)}
    ups = [(1.0, 2), (4.0, 4), (-90.0, 1)]   # (value of every weight, steps)
    replies = {i: Message({"weights": {k: torch.full_like(v, x) for k, v in w.items()}},
                          {"num_examples": 5, "steps": s}) for i, (x, s) in enumerate(ups)}
    new = alg.aggregate({"model": w}, ServerContext(0), replies)["model"]
    d = np.median([(0 - x) / s for x, s in ups])
    want = 0 - np.median([s for _, s in ups]) * d
    assert torch.allclose(new["weight"], torch.full((1, 2), float(want)))


def test_huge_finite_images_are_rejected_and_the_run_completes(fed, tmp_path, monkeypatch):
    """FedDM images of 1e30 are finite and of the right shape, but no normalised image holds
    such values: the check rejects them, and the run completes on the honest clients with a
    finite model (before the bound, training on them turned the global model into Inf)."""
    _tamper_exchange(monkeypatch, [lambda m: m, on_tensor(lambda t: torch.full_like(t, 1e30),
                                                          kind="synthetic_images")])
    cfg = dataclasses.replace(_cfg("feddm", 2), method_args={**small_args("feddm"),
                                                               "init": "noise"})
    s = run_experiment(cfg, out=tmp_path / "r", fed=fed)
    assert [(r["round"], "normalised images" in r["reason"]) for r in s["rejected_replies"]] \
        == [(1, True)]
    assert all(math.isfinite(a) for a in s["per_client_accuracy"].values())
    state = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)["server_state"]
    assert all(bool(torch.isfinite(v).all()) for v in state["model"].values()
               if v.is_floating_point())


def test_tampered_client_update_through_the_python_api(fed, tmp_path, monkeypatch):
    """The same tampers made inside `client_update` (before the in-process transport and the
    client's upload guard handle the reply) reach the server's check, which rejects them."""
    from fedvl.algorithms.fedavg import FedAvg

    tampers = list(_pick(STRUCTURE, "reply None", "reply a dict", "arrays a list", "meta None",
                         "numpy", "sparse").values())
    original = FedAvg.client_update

    def update(self, msg, ctx):
        reply = original(self, msg, ctx)
        return tampers[ctx.round](reply) if ctx.cid == TARGET else reply

    monkeypatch.setattr(FedAvg, "client_update", update)
    s = run_experiment(_cfg("fedavg", len(tampers)), out=tmp_path / "r", fed=fed)
    assert [r["round"] for r in s["rejected_replies"]] == list(range(len(tampers)))
    assert {r["client"] for r in s["rejected_replies"]} == {"c1"}


class _Hostile(dict):
    """Reply metadata whose reading raises."""

    def get(self, *args: Any) -> Any:
        raise RuntimeError("no")


GARBLED_SECONDS: dict[str, Tamper] = {
    **{f"update_seconds {k}": on_meta(update_seconds=v, synthesis_seconds=0.0) for k, v in (
        ("NaN", math.nan), ("Inf", math.inf), ("negative", -1.0), ("10**400", 10**400),
        ("1e300", 1e300), ("str", "fast"), ("bool", True), ("list", [1.0, 2.0]))},
    "synthesis beyond the update": on_meta(update_seconds=1.0, synthesis_seconds=2.0),
    "synthesis missing": lambda m: raw(_copy(m)[0], {k: v for k, v in m.meta.items()
                                                     if k != "synthesis_seconds"}),
}


def test_garbled_client_seconds_are_ignored_and_the_run_completes(fed, tmp_path, monkeypatch):
    """A client's seconds are only shown, never computed with: a garbled value is left out of
    the round's timing, the reply is used as usual, and nothing is raised."""
    from fedvl.timing import client_sums

    tampers = list(GARBLED_SECONDS.values())
    _tamper_exchange(monkeypatch, tampers)
    s = run_experiment(_cfg("fedavg", len(tampers)), out=tmp_path / "r", fed=fed)
    rows = _rows(tmp_path / "r")
    assert len(rows) == len(tampers) and not s["rejected_replies"]
    for row, case in zip(rows, GARBLED_SECONDS, strict=True):
        assert set(row["participants"]) == {0, 1, 2}, case
        t = row["time_by_phase"]
        assert all(math.isfinite(v) and v >= 0 for v in t.values()), (case, t)
        assert sum(t.values()) == pytest.approx(row["seconds"], abs=1e-4), case
        assert 0 < row["client_seconds_summed"]["total"] < 1e3, case
    honest = Message({}, {"update_seconds": 2.0, "synthesis_seconds": 0.5})
    assert client_sums([None, {"update_seconds": 1.0}, raw({}, None), raw({}, _Hostile(a=1)),
                        honest]) == (2.0, 0.5)

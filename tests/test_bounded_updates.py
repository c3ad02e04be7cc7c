"""No single client can stop or wreck a run: the round's bound on what one reply can move.

A reply whose values are finite but huge (1e38 everywhere, 1e30-scaled, an update sign-flipped
and scaled x 1e6) passes every per-reply check; before the bound, the plain mean followed it,
every reply of the next round held NaN and the run stopped as diverged. `fedvl.core.bounds`
sizes each reply's update against the round's second-largest size (absolutely, with fewer
than three replies) in the driver both transports share, and refuses what lies beyond.
Tampering happens where a reply reaches the server (after the in-process transport's exchange,
or Flower's), as a hostile node's would.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
import torch

from fedvl.config import RunConfig
from fedvl.core import bounds
from fedvl.core.bounds import Measure, bound_round, root_mean_square, sizes
from fedvl.core.message import Message
from fedvl.core.replies import ReplyRejected, ReplySpec, TensorSpec, check_reply
from fedvl.engine.driver import Exchange
from fedvl.engine.inprocess import InProcessTransport
from fedvl.registry import ALGORITHMS
from fedvl.run.experiment import run_experiment
from tests.conftest import COMPOSED, METHODS, make_toy_federation, small_cfg

TARGET = 1
ATTACKS = ("1e38", "-1e38", "x1e30", "sign-flipped x1e6")
# The training-set size a lying client announces when it joins, and claims in every reply.
LIE = 10**9


def _bounded(name: str) -> bool:
    cls = ALGORITHMS.get(name)
    kinds = cls.declared_kinds()
    return bool((kinds["up"] | kinds["peer"]) & set(cls.bounded_kinds))


BOUNDED = [n for n in METHODS if _bounded(n)]
BOUNDED_COMPOSED = [n for n in COMPOSED if _bounded(n)]


def tamper(attack: str, reply: Message, sent: Message | None, name: str,
           lie: bool = False, counts: bool = False) -> Message:
    """`reply` with `attack` on every floating tensor of its bounded kinds (count tensors too
    with `counts`), `num_examples` LIE with `lie`."""
    cls = ALGORITHMS.get(name)
    arrays = {k: dict(v) for k, v in reply.arrays.items()}
    for kind, tensors in arrays.items():
        m = cls.bounded_kinds.get(kind)
        if m is None:
            continue
        ref = {} if sent is None or m.against is None else sent.arrays.get(m.against, {})
        for n, t in tensors.items():
            if not t.is_floating_point() or (f"{kind}/{n}" in cls.count_tensors and not counts):
                continue
            if attack in ("1e38", "-1e38"):
                tensors[n] = torch.full_like(t, float(attack))
            elif attack == "x1e30":
                tensors[n] = t * 1e30
            else:
                r = ref.get(n)
                tensors[n] = -1e6 * t if r is None else r - 1e6 * (t - r)
    meta = dict(reply.meta)
    if lie and "num_examples" in meta:
        meta["num_examples"] = LIE
    return Message(arrays, meta)


def _attack(monkeypatch: pytest.MonkeyPatch, name: str, attack: str, rounds: set[int],
            lie: bool = False, counts: bool = False) -> None:
    """Client TARGET's replies (and peer messages) of `rounds` reach the server tampered."""
    exchange, share, size = (InProcessTransport.exchange, InProcessTransport.share,
                             InProcessTransport.train_size)

    def tampered_exchange(self, rnd, outgoing, inboxes=None) -> Exchange:
        ex = exchange(self, rnd, outgoing, inboxes)
        if rnd in rounds and TARGET in ex.replies:
            ex.replies[TARGET] = tamper(attack, ex.replies[TARGET], outgoing[TARGET], name,
                                        lie, counts)
        return ex

    def tampered_share(self, rnd, peers):
        out = share(self, rnd, peers)
        if rnd in rounds and TARGET in out:
            out[TARGET] = {r: tamper(attack, m, None, name, lie, counts)
                           for r, m in out[TARGET].items()}
        return out

    monkeypatch.setattr(InProcessTransport, "exchange", tampered_exchange)
    monkeypatch.setattr(InProcessTransport, "share", tampered_share)
    if lie:   # it announced LIE images when it joined: `num_examples` LIE passes the check
        monkeypatch.setattr(InProcessTransport, "train_size",
                            lambda self, cid: LIE if cid == TARGET else size(self, cid))


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").open()]


def _finite_state(path) -> bool:
    state = torch.load(path / "checkpoint.pt", weights_only=True)["server_state"]

    def finite(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return not v.is_floating_point() or bool(torch.isfinite(v).all())
        if isinstance(v, dict):
            return all(finite(x) for x in v.values())
        if isinstance(v, list | tuple):
            return all(finite(x) for x in v)
        return True

    return finite(state)


# -- the bound itself ----------------------------------------------------------------------------
def _reply(value: float, shape: tuple[int, ...] = (4, 3), **meta: Any) -> Message:
    return Message({"weights": {"w": torch.full(shape, value), "n": torch.tensor(3)}},
                   {"num_examples": 5, **meta})


SENT = Message({"weights": {"w": torch.zeros(4, 3), "n": torch.tensor(3)}})
WEIGHTS = {"weights": Measure(against="weights")}


def test_sizes_are_float64_and_huge_values_stay_finite():
    assert root_mean_square([torch.full((1000,), 1e38)]) == pytest.approx(1e38)
    # 3e38 minus -3e38 is Inf in float32; in float64 it is a number.
    big = Message({"weights": {"w": torch.full((4, 3), 3e38), "n": torch.tensor(3)}})
    far = Message({"weights": {"w": torch.full((4, 3), -3e38), "n": torch.tensor(3)}})
    assert sizes(big, far, WEIGHTS) == {"weights": pytest.approx(6e38)}
    # The integer counter is no update; the change is measured against what was sent.
    assert sizes(_reply(2.0), Message({"weights": {"w": torch.ones(4, 3),
                                                   "n": torch.tensor(0)}}), WEIGHTS) == {
        "weights": pytest.approx(1.0)}
    per = {"logits": Measure(per_tensor=True)}
    msg = Message({"logits": {"a": torch.full((2, 2), 2.0), "counts": torch.full((2,), 9.0)}})
    assert sizes(msg, None, per, skip={"logits/counts"}) == {"logits/a": pytest.approx(2.0)}


def test_one_reply_beyond_the_bound_is_refused_the_rest_pass():
    replies = {c: _reply(v) for c, v in enumerate([1.0, 1.2, 0.9, 1.1, 300.0])}
    out = bound_round(replies, dict.fromkeys(replies, SENT), WEIGHTS)
    assert list(out) == [4] and not out[4].nonfinite
    assert "is 300, 250x the next largest 1.2 of the round's 5 replies (at most 100x)" in str(
        out[4])
    # Within the multiple: nothing refused.
    replies[4] = _reply(bounds.RELATIVE_BOUND * 1.19)
    assert bound_round(replies, dict.fromkeys(replies, SENT), WEIGHTS) == {}


def test_huge_reply_is_beyond_the_absolute_bound_with_any_number_of_replies():
    for n in (1, 2, 5):
        replies = {c: _reply(1.0) for c in range(n - 1)}
        replies[n - 1] = _reply(1e38)
        out = bound_round(replies, dict.fromkeys(replies, SENT), WEIGHTS)
        assert list(out) == [n - 1] and out[n - 1].nonfinite
        assert "beyond the absolute bound" in str(out[n - 1])


def test_two_replies_cannot_outvote_each_other_only_the_absolute_bound_applies():
    """Of two, either may be the liar: a reply 100x the other's passes (a median would refuse
    the honest one when the liar sends nothing at all)."""
    replies = {0: _reply(0.01), 1: _reply(1.0)}
    assert bound_round(replies, dict.fromkeys(replies, SENT), WEIGHTS) == {}
    # Nor with a zero median (most replies unchanged): no multiple of 0 is a bound.
    replies = {0: _reply(0.0), 1: _reply(0.0), 2: _reply(0.5)}
    assert bound_round(replies, dict.fromkeys(replies, SENT), WEIGHTS) == {}


def test_skewed_honest_clients_that_learn_far_more_than_the_median_pass():
    """Dir(0.05) on PneumoniaMNIST: eight clients of one class barely move, two move 100-2,000x
    more (sizes of an honest FedAvg round; a median bound refused both)."""
    sizes_ = [1.4e-5, 1.5e-5, 1.3e-5, 1.45e-5, 1.42e-5, 1.6e-5, 1.2e-5, 1.44e-5, 1.44e-3, 2.81e-2]
    replies = {c: _reply(v) for c, v in enumerate(sizes_)}
    assert bound_round(replies, dict.fromkeys(replies, SENT), WEIGHTS) == {}
    # One liar among them is still measured against the largest honest reply.
    replies[3] = _reply(2.81e-2 * 1e3)
    assert list(bound_round(replies, dict.fromkeys(replies, SENT), WEIGHTS)) == [3]


def test_a_liar_sending_nothing_cannot_refuse_the_honest():
    """A zero update cannot lower the reference below the second-largest honest size."""
    replies = {0: _reply(0.0), 1: _reply(1.0), 2: _reply(3.0), 3: _reply(2.0)}
    assert bound_round(replies, dict.fromkeys(replies, SENT), WEIGHTS) == {}


def test_counts_are_bounded_by_counting():
    spec = ReplySpec(frozenset({"logits"}), {"logits": {"counts": TensorSpec((3,))}},
                     counts={"logits/counts": 40})
    ok = Message({"logits": {"counts": torch.tensor([10.0, 30.0, 0.0])}})
    check_reply(ok, spec)
    for bad, why in ((torch.tensor([10.0, 31.0, 0.0]), "more than the 40"),
                     (torch.tensor([1e38, 0.0, 0.0]), "more than the 40"),
                     (torch.tensor([-1.0, 0.0, 0.0]), "negative count")):
        with pytest.raises(ReplyRejected, match=why):
            check_reply(Message({"logits": {"counts": bad}}), spec)


# -- every method: a 1e38 reply is refused, the run completes -------------------------------------
# Cuts of the slowest methods' servers (DENSE and Co-Boosting distil a generator and a model
# every round).
CHEAPER = {"dense": {"server_epochs": 1, "g_steps": 1},
           "coboosting": {"server_epochs": 1, "g_steps": 1}}


def _cheap(name: str, rounds: int = 2) -> RunConfig:
    """The tiny run of `name` with every client every round (3 replies: the median applies)."""
    cfg = small_cfg(name, rounds)
    return dataclasses.replace(cfg, client_ratio=1.0, eval_every=rounds, local_steps=2,
                               method_args={**cfg.method_args, **CHEAPER.get(name, {})})


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=48, n_test=8)


@pytest.mark.parametrize("name", BOUNDED)
def test_a_huge_reply_is_refused_and_the_run_completes(name, fed, tmp_path, monkeypatch):
    """Every method whose replies (or peer messages) carry model updates, logits, prototypes,
    statistics or gradients: client c1's of round 1 are 1e38 everywhere, counts included; the
    honest round 0 refuses nothing, round 1 refuses c1 and the run completes, finite."""
    _attack(monkeypatch, name, "1e38", {1}, counts=True)
    s = run_experiment(_cheap(name), out=tmp_path / "r", fed=fed)
    rejected = [(r["round"], r["client"].partition("->")[0]) for r in s["rejected_replies"]]
    assert rejected and set(rejected) == {(1, "c1")}, s["rejected_replies"]
    # Sized by the bound; counted (counts), or not rows of probabilities (FedAF's soft labels).
    assert all(any(w in r["reason"] for w in ("bound", "count", "probabilities"))
               for r in s["rejected_replies"])
    assert s["skipped_rounds"] == [] and _finite_state(tmp_path / "r")
    assert all(math.isfinite(a) for a in s["per_client_accuracy"].values())


@pytest.mark.parametrize("name", BOUNDED_COMPOSED)
def test_compositions_refuse_a_huge_reply(name, fed, tmp_path, monkeypatch):
    """The same for every BASE+ADDON composition (`X+vhl`, `X+fedbn`, ...), in one round."""
    _attack(monkeypatch, name, "1e38", {0})
    s = run_experiment(_cheap(name, rounds=1), out=tmp_path / "r", fed=fed)
    assert [(r["round"], r["client"]) for r in s["rejected_replies"]] == [(0, "c1")]
    assert _finite_state(tmp_path / "r")


# -- the attack matrix: accuracy kept --------------------------------------------------------------
# Five clients of 40 toy images of 8 classes, all every round, 6 rounds of 2 local steps: the
# honest runs reach 60-67 % (not the toy's easy 100 %), so 5 points can be lost; c1 tampers in
# rounds 1 and 2.
MATRIX_ROUNDS = 6
MATRIX_METHODS = ("fedavg", "scaffold", "fedhe")


@pytest.fixture(scope="module")
def five():
    return make_toy_federation(num_clients=5, n_train=40, n_test=40, num_classes=8, seed=3)


def _matrix_cfg(name: str) -> RunConfig:
    return dataclasses.replace(small_cfg(name, MATRIX_ROUNDS), client_ratio=1.0,
                               eval_every=MATRIX_ROUNDS, local_steps=2)


@pytest.fixture(scope="module")
def honest(five, tmp_path_factory) -> dict[str, dict]:
    """Each matrix method's honest run."""
    out = tmp_path_factory.mktemp("honest")
    return {m: run_experiment(_matrix_cfg(m), out=out / m, fed=five) for m in MATRIX_METHODS}


@pytest.mark.parametrize("lie", [False, True], ids=["alone", "with-num_examples-lie"])
@pytest.mark.parametrize("attack", ATTACKS)
def test_one_attacker_never_stops_the_run_and_accuracy_is_kept(attack, lie, five, honest,
                                                               tmp_path, monkeypatch):
    """One of five clients sends 1e38, -1e38, its weights x 1e30 or its update sign-flipped
    x 1e6 (SCAFFOLD: its control variates too; FedHe: its class-mean logits), alone or with
    `num_examples` 10^9 it announced when it joined: both its replies are refused, the run
    completes, and the mean accuracy stays within 5 points of the honest run's."""
    for name in MATRIX_METHODS:
        _attack(monkeypatch, name, attack, {1, 2}, lie=lie)
        s = run_experiment(_matrix_cfg(name), out=tmp_path / name, fed=five)
        rejected = [(r["round"], r["client"]) for r in s["rejected_replies"]]
        assert rejected == [(1, "c1"), (2, "c1")], (name, s["rejected_replies"])
        assert s["skipped_rounds"] == [] and _finite_state(tmp_path / name)
        drop = honest[name]["mean_accuracy"] - s["mean_accuracy"]
        assert abs(drop) <= 0.05, (name, honest[name]["mean_accuracy"], s["mean_accuracy"])
        monkeypatch.undo()


def test_honest_runs_refuse_nothing_and_learn(honest):
    assert all(s["rejected_replies"] == [] for s in honest.values())
    assert all(0.4 < s["mean_accuracy"] < 0.9 for s in honest.values())


def test_one_client_per_round_falls_back_to_the_absolute_bound(fed, tmp_path, monkeypatch):
    """With one reply per round there is no median: 1e38 is still refused (the round is
    skipped, the state kept) and the run completes on the other rounds."""
    _attack(monkeypatch, "fedavg", "1e38", set(range(4)))
    cfg = dataclasses.replace(_cheap("fedavg", rounds=4), client_ratio=0.34)
    s = run_experiment(cfg, out=tmp_path / "r", fed=fed)
    rows = _rows(tmp_path / "r")
    hit = [r["round"] for r in rows if r["sampled"] == [TARGET]]
    assert hit and all("absolute bound" in rows[i]["rejected"]["c1"] for i in hit)
    assert s["skipped_rounds"] == hit and _finite_state(tmp_path / "r")


# -- Flower: the same driver, the same bound -------------------------------------------------------
def test_flower_server_applies_the_same_bound(tmp_path, monkeypatch):
    """The ServerApp's round loop is the same `RoundDriver`: a node's 1e38 reply, as decoded
    from its records, is refused the same way."""
    pytest.importorskip("flwr")
    from fedvl.flower.transport import FlowerTransport
    from tests.conftest import FakeGrid, run_on_grid

    original = FlowerTransport.exchange

    def exchange(self, rnd, outgoing, inboxes=None):
        ex = original(self, rnd, outgoing, inboxes)
        if rnd == 1 and TARGET in ex.replies:
            ex.replies[TARGET] = tamper("1e38", ex.replies[TARGET], outgoing[TARGET], "fedavg")
        return ex

    monkeypatch.setattr(FlowerTransport, "exchange", exchange)
    cfg = RunConfig(method="fedavg", benchmark="digits-offline", train_cap=40, test_cap=20,
                    rounds=2, batch_size=16, local_steps=2, threads=1,
                    model_args={"width": 8, "depth": 2, "norm": "instance"})
    s = run_on_grid(FakeGrid(5), cfg, tmp_path)
    assert [r["round"] for r in s["rejected_replies"]] == [1]
    assert "absolute bound" in s["rejected_replies"][0]["reason"]
    assert all(math.isfinite(a) for a in s["per_client_accuracy"].values())

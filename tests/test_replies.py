"""Replies are checked before they are used: bad ones are dropped, recorded, and a round left
with too few is skipped; robust aggregation resists one client's huge weights."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from scipy import stats

from fedvl.algorithms.base import Env, make_algorithm
from fedvl.algorithms.fedavg import FedAvg
from fedvl.core.message import Message
from fedvl.core.params import robust_average
from fedvl.core.replies import ReplyRejected, ReplySpec, TensorSpec, check_reply
from fedvl.core.training import TrainConfig
from fedvl.options import ConfigError
from fedvl.run.experiment import run_experiment

W = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "n": torch.zeros((), dtype=torch.long)}
SPEC = ReplySpec(frozenset({"weights", "synthetic_images", "synthetic_labels", "logits"}),
                 {"weights": {k: TensorSpec.like(v) for k, v in W.items()}},
                 required_meta=frozenset({"num_examples"}), num_classes=4,
                 image_shape=(1, 2, 2))


def _reply(arrays=None, **meta) -> Message:
    return Message(arrays if arrays is not None else {"weights": dict(W)},
                   {"num_examples": 5, **meta})


BAD = {
    "nan": (_reply({"weights": {**W, "w": torch.full((2, 3), float("nan"))}}),
            "weights/w", "NaN or Inf"),
    "inf": (_reply({"weights": {**W, "b": torch.tensor([0.0, float("inf"), 0.0])}}),
            "weights/b", "NaN or Inf"),
    "shape": (_reply({"weights": {**W, "w": torch.zeros(3, 2)}}), "weights/w", "shape"),
    "dtype": (_reply({"weights": {**W, "w": torch.zeros(2, 3, dtype=torch.float64)}}),
              "weights/w", "dtype"),
    "missing tensor": (_reply({"weights": {"w": W["w"], "n": W["n"]}}), "weights", "missing"),
    "extra tensor": (_reply({"weights": {**W, "x": torch.zeros(1)}}), "weights", "unexpected"),
    "kind": (_reply({**{"weights": dict(W)}, "control_variates": {"w": torch.zeros(2, 3)}}),
             "control_variates", "never sends"),
    "num_examples 0": (_reply(num_examples=0), "meta/num_examples", "positive int"),
    "num_examples bool": (_reply(num_examples=True), "meta/num_examples", "positive int"),
    "num_examples float": (_reply(num_examples=2.5), "meta/num_examples", "positive int"),
    "num_examples missing": (Message({"weights": dict(W)}), "meta/num_examples", "missing"),
    "steps negative": (_reply(steps=-1), "meta/steps", "non-negative"),
    "loss nan": (_reply(train_loss=float("nan")), "meta/train_loss", "finite"),
    "image shape": (_reply({"synthetic_images": {"x": torch.zeros(2, 3, 2, 2)},
                            "synthetic_labels": {"y": torch.zeros(2, dtype=torch.long)}}),
                    "synthetic_images/x", "shape"),
    "label range": (_reply({"synthetic_images": {"x": torch.zeros(2, 1, 2, 2)},
                            "synthetic_labels": {"y": torch.tensor([0, 4])}}),
                    "synthetic_labels/y", "[0, 4)"),
    "label count": (_reply({"synthetic_images": {"x": torch.zeros(2, 1, 2, 2)},
                            "synthetic_labels": {"y": torch.tensor([0, 1, 2])}}),
                    "synthetic_labels", "3 labels for 2 images"),
    "logit classes": (_reply({"logits": {"z": torch.zeros(5, 3)}}), "logits/z", "4 classes"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_reply_rejected_naming_field_and_reason(case):
    msg, field, reason = BAD[case]
    with pytest.raises(ReplyRejected) as e:
        check_reply(msg, SPEC)
    assert e.value.field == field and reason in e.value.reason, str(e.value)


def test_good_reply_passes():
    check_reply(_reply(steps=3, train_loss=0.5), SPEC)
    check_reply(_reply({"synthetic_images": {"x": torch.zeros(2, 1, 2, 2)},
                        "synthetic_labels": {"y": torch.tensor([0, 3])},
                        "logits": {"z": torch.zeros(5, 4)}}), SPEC)


def _poison(monkeypatch, cls, rounds, client, how):
    """Client `client`'s reply in `rounds` is altered by `how` (a hostile or broken node)."""
    original = cls.client_update

    def update(self, msg, ctx):
        reply = original(self, msg, ctx)
        return how(reply) if ctx.cid == client and ctx.round in rounds else reply

    monkeypatch.setattr(cls, "client_update", update)


def _nan(reply: Message) -> Message:
    w = reply.arrays["weights"]
    name = next(k for k, v in w.items() if v.is_floating_point())
    w[name] = torch.full_like(w[name], float("nan"))
    return reply


def _rows(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").open()]


def _finite(state) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


def test_nan_reply_dropped_round_goes_on(tiny_cfg, toy_fed, tmp_path, monkeypatch):
    _poison(monkeypatch, FedAvg, {1}, 1, _nan)
    s = run_experiment(tiny_cfg, out=tmp_path / "r", fed=toy_fed)
    rows = _rows(tmp_path / "r")
    assert [r["participants"] for r in rows] == [[0, 1, 2], [0, 2], [0, 1, 2]]
    assert set(rows[1]["rejected"]) == {"c1"}
    assert "holds NaN or Inf" in rows[1]["rejected"]["c1"]
    assert s["rejected_replies"] == [{"round": 1, "client": "c1",
                                      "reason": rows[1]["rejected"]["c1"]}]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["rejected_replies"] == s["rejected_replies"]
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    assert _finite(ck["server_state"]["model"])
    assert all(np.isfinite(a) for a in s["per_client_accuracy"].values())


def test_round_below_min_replies_is_skipped_state_unchanged(tiny_cfg, toy_fed, tmp_path,
                                                           monkeypatch):
    cfg = dataclasses.replace(tiny_cfg, rounds=2, min_replies=3)
    _poison(monkeypatch, FedAvg, {1}, 2, _nan)
    run_experiment(dataclasses.replace(cfg, rounds=1), out=tmp_path / "one", fed=toy_fed)
    run_experiment(cfg, out=tmp_path / "two", fed=toy_fed)
    rows = _rows(tmp_path / "two")
    assert "skipped" in rows[1] and "min-replies 3" in rows[1]["skipped"]
    assert rows[1]["participants"] == [0, 1]
    one = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)["server_state"]
    two = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)["server_state"]
    assert all(torch.equal(one["model"][k], two["model"][k]) for k in one["model"])
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["skipped_rounds"] == [1]


def test_wrong_shape_reply_dropped(tiny_cfg, toy_fed, tmp_path, monkeypatch):
    def grow(reply: Message) -> Message:
        w = reply.arrays["weights"]
        name = next(iter(w))
        w[name] = torch.zeros(*w[name].shape, 2)
        return reply

    _poison(monkeypatch, FedAvg, {0}, 0, grow)
    run_experiment(dataclasses.replace(tiny_cfg, rounds=1), out=tmp_path / "r", fed=toy_fed)
    row = _rows(tmp_path / "r")[0]
    assert row["participants"] == [1, 2] and "shape" in row["rejected"]["c0"]


def test_bad_peer_message_dropped(toy_fed, tmp_path, monkeypatch):
    from fedvl.algorithms.desa import DESA
    from fedvl.config import RunConfig

    original = DESA.share

    def share(self, client, peers):
        out = original(self, client, peers)
        if client.cid == 0:
            for m in out.values():
                x = m.arrays["synthetic_images"]
                for k in x:
                    x[k] = torch.full_like(x[k], float("inf"))
        return out

    monkeypatch.setattr(DESA, "share", share)
    cfg = RunConfig(method="desa", rounds=1, batch_size=8, lr=0.05, momentum=0.0,
                    method_args={"ipc": 2, "anchor_steps": 1, "batch_real": 4, "dsa": False},
                    model_args={"width": 8, "depth": 2, "norm": "instance"})
    s = run_experiment(cfg, out=tmp_path / "r", fed=toy_fed)
    row = _rows(tmp_path / "r")[0]
    assert set(row["rejected_peer"]) == {"c0->c1", "c0->c2"}
    assert all("NaN or Inf" in why for why in row["rejected_peer"].values())
    assert {r["client"] for r in s["rejected_replies"] if r.get("peer")} == {"c0->c1", "c0->c2"}


# -- robust aggregation ---------------------------------------------------------------------------
def test_robust_average_matches_scipy():
    g = torch.Generator().manual_seed(0)
    states = [{"a": torch.randn(4, 5, generator=g), "n": torch.tensor(3)} for _ in range(7)]
    stacked = np.stack([s["a"].numpy() for s in states])
    med = robust_average(states, "median")
    assert np.allclose(med["a"].numpy(), np.median(stacked, axis=0), atol=1e-6)
    tm = robust_average(states, "trimmed-mean", trim=0.2)
    assert np.allclose(tm["a"].numpy(), stats.trim_mean(stacked, 0.2, axis=0), atol=1e-6)
    assert torch.equal(med["n"], torch.tensor(3))
    even = robust_average(states[:4], "median")   # mean of the two middle values
    assert np.allclose(even["a"].numpy(), np.median(stacked[:4], axis=0), atol=1e-6)


def _scaled(reply: Message) -> Message:
    w = reply.arrays["weights"]
    for k, v in w.items():
        if v.is_floating_point():
            w[k] = v * 1e6
    return reply


@pytest.mark.parametrize("rule", ["samples", "median", "trimmed-mean"])
def test_one_diverging_client_moves_no_rule_far(rule, tiny_cfg, toy_fed, tmp_path, monkeypatch):
    """Weights x 1e6 are finite: the round's bound refuses them under every rule (the plain
    mean followed them to 1e5-sized weights before it), and the robust rules would resist
    them anyway."""
    clean = run_experiment(dataclasses.replace(tiny_cfg, aggregation=rule, trim=0.34),
                           out=tmp_path / "clean", fed=toy_fed)
    _poison(monkeypatch, FedAvg, {0, 1, 2}, 2, _scaled)
    cfg = dataclasses.replace(tiny_cfg, aggregation=rule, trim=0.34)
    hit = run_experiment(cfg, out=tmp_path / "hit", fed=toy_fed)
    state = torch.load(tmp_path / "hit" / "checkpoint.pt", weights_only=True)["server_state"]
    biggest = max(float(v.abs().max()) for v in state["model"].values() if v.is_floating_point())
    assert biggest < 10.0
    assert [(r["round"], r["client"]) for r in hit["rejected_replies"]] == [
        (0, "c2"), (1, "c2"), (2, "c2")]
    assert all("bound" in r["reason"] or "median" in r["reason"]
               for r in hit["rejected_replies"])
    drop = clean["mean_accuracy"] - hit["mean_accuracy"]
    assert drop < 0.25, (clean["mean_accuracy"], hit["mean_accuracy"])


def test_robust_rule_refused_for_methods_that_do_not_average_models():
    env = Env(model_fn=lambda **k: None, num_classes=4, num_clients=3, train=TrainConfig(),
              aggregation="median")
    with pytest.raises(ConfigError, match="does not average client models"):
        make_algorithm("feddm", env)
    with pytest.raises(ConfigError, match="fedavg"):
        make_algorithm("desa", env)


def test_flower_record_that_holds_no_numeric_array_is_one_message_error():
    """A node's reply whose bytes are no .npy array, or whose JSON metadata cannot be read,
    is a MessageError (the transport records it as unreadable), never another exception."""
    pytest.importorskip("flwr")
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from fedvl.core.message import MessageError
    from fedvl.flower.records import from_recorddict

    garbage = Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"\x93NUMPY junk")
    text = Array(np.array(["a", "b"]))
    for arr in (garbage, text):
        rd = RecordDict({"msg.arrays.weights": ArrayRecord({"w": arr})})
        with pytest.raises(MessageError, match="not a numeric array"):
            from_recorddict(rd)
    for bad in ("{not json", "[" * 100_000):
        rd = RecordDict({"msg.meta": ConfigRecord({"__json__.x": bad})})
        with pytest.raises(MessageError, match="not valid JSON") as e:
            from_recorddict(rd)
        assert len(str(e.value)) < 300

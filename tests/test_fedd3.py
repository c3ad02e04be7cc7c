"""FedD3: herding by hand, one upload of ipc images per owned class per client with its bytes,
nothing down, coresets of real images declared as such, malformed uploads refused."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fedvl.algorithms.base import Env, make_algorithm
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.core.replies import ReplyRejected, check_reply
from fedvl.core.training import TrainConfig
from fedvl.distill.herding import herding, herding_coreset
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation, small_args

CLASSES, SIZE = 4, 8
TINY = {"width": 8, "depth": 2, "norm": "instance"}


def test_herding_follows_the_greedy_rule_worked_by_hand():
    # 1-D features 0, 1, 2, 3, 10: class mean 3.2. Pick k minimises |3.2 - (sum so far + f)/k|:
    # k=1: 3 (|3.2 - 3| = 0.2); k=2: 2 ((3+2)/2 = 2.5, off 0.7; 10 gives 6.5, off 3.3);
    # k=3: 1 ((5+1)/3 = 2.0, off 1.2; 10 gives 5.0, off 1.8; 0 gives 1.67, off 1.53);
    # k=4: 10 ((6+10)/4 = 4.0, off 0.8; 0 gives 1.5, off 1.7). Nearest-to-the-mean order would
    # take 0 before 10: herding corrects the running mean instead.
    f = torch.tensor([[0.0], [1.0], [2.0], [3.0], [10.0]])
    assert herding(f, 4).tolist() == [3, 2, 1, 4]
    assert herding(f, 5).tolist() == [3, 2, 1, 4, 0]   # every row once, never twice
    with pytest.raises(ValueError, match="picks 0..5"):
        herding(f, 6)
    # Per class, in class order; a class with fewer images than asked gives all it has; the
    # pixels are the features (one pixel each here).
    x = torch.tensor([7.0, 0.0, 5.0, 1.0, 2.0, 3.0, 10.0]).view(-1, 1, 1, 1)
    y = torch.tensor([1, 0, 1, 0, 0, 0, 0])
    xs, ys = herding_coreset(x, y, [2, 3], lambda t: t.reshape(len(t), -1))
    assert xs.flatten().tolist() == [3.0, 2.0, 7.0, 5.0] and ys.tolist() == [0, 0, 1, 1]


@pytest.fixture(scope="module")
def fed():
    # 12 images per class: every client owns every class (min_class_count 10).
    return make_toy_federation(num_clients=3, n_train=12 * CLASSES, n_test=8,
                               num_classes=CLASSES, size=SIZE)


def _cfg(rounds: int, **method_args) -> RunConfig:
    return RunConfig(method="fedd3", method_args={**small_args("fedd3"), **method_args},
                     rounds=rounds, batch_size=8, client_ratio=1.0, model_args=TINY)


def test_each_client_uploads_ipc_per_class_once_and_nothing_comes_down(fed, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    s = run_experiment(_cfg(2), out=tmp_path / "r", fed=fed)
    ipc = small_args("fedd3")["ipc"]
    images = 3 * ipc * CLASSES                              # 3 clients x ipc x 4 classes
    assert s["bytes_by_kind"] == {
        "synthetic_images": {"up": images * 3 * SIZE * SIZE * 4, "down": 0},   # float32
        "synthetic_labels": {"up": images * 8, "down": 0}}                     # int64
    assert s["bytes_down"] == 0
    assert s["server_train_images"] == images and s["clients_uploaded"] == 3
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").open()]
    # Round 1 brings no new set: nothing travels and the model (its accuracy) stays.
    assert [r["round_bytes_up"] for r in rows] == [s["bytes_up"], 0]
    assert rows[1]["per_client_accuracy"] == rows[0]["per_client_accuracy"]
    # The default (dm from class statistics) declares no copy of private images.
    assert s["upload_audit"] and not any(a["withheld"] for a in s["upload_audit"])


def test_herding_uploads_real_images_and_says_so(fed, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    s = run_experiment(_cfg(1, distiller="herding"), out=tmp_path / "r", fed=fed)
    state = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)["server_state"]
    for cid, c in enumerate(fed.clients):
        up = state["sets_x"][str(cid)]
        assert len(up) == 2 * CLASSES
        flat = c.x_train.reshape(len(c.x_train), -1)
        # Every uploaded image is one of the client's private images, unchanged.
        assert all(bool((flat == row).all(1).any()) for row in up.reshape(len(up), -1))
    # The audit sees the copies and, the upload being this setting's design, only records them.
    assert all(a["max_corr"] > 0.9999 and not a["withheld"] for a in s["upload_audit"])

    def exemption(**args) -> str | None:
        return make_algorithm("fedd3", _env(), args).upload_exemption()
    assert exemption() is None
    assert "coreset" in exemption(distiller="herding")
    assert "init=real" in exemption(init="real")


def _env() -> Env:
    from fedvl.models.base import build_model

    return Env(model_fn=lambda num_classes=None, seed=None: build_model(
        "convnet", 3, num_classes or CLASSES, SIZE, seed=seed or 0, **TINY),
        num_classes=CLASSES, num_clients=3, train=TrainConfig(), image_shape=(3, SIZE, SIZE))


def test_server_refuses_malformed_uploads():
    alg = make_algorithm("fedd3", _env(), {"ipc": 2})
    asked, not_asked = Message(meta={"upload": True}), Message(meta={"upload": False})

    def upload(n: int, labels: torch.Tensor | None = None) -> Message:
        y = torch.arange(n) % CLASSES if labels is None else labels
        return Message({"synthetic_images": {"x": torch.zeros(n, 3, SIZE, SIZE)},
                        "synthetic_labels": {"y": y}}, {"num_examples": 48})

    check_reply(upload(8), alg.reply_spec(asked, 0))                 # ipc x classes: fine
    check_reply(Message(meta={"num_examples": 48}), alg.reply_spec(not_asked, 0))
    bad = {
        "a set nobody asked for": (upload(8), not_asked, "never sends here"),
        "more than ipc x classes": (upload(9), asked, "at most 8"),
        "soft labels": (upload(8, torch.full((8, CLASSES), 0.25)), asked, "shape"),
        "a label past the classes": (upload(8, torch.full((8,), CLASSES)), asked, "class"),
    }
    for case, (reply, sent, why) in bad.items():
        with pytest.raises(ReplyRejected, match=why):
            check_reply(reply, alg.reply_spec(sent, 0))
            pytest.fail(case)
    # A coreset holds at most the client's own images (the engine applies the bound).
    assert make_algorithm("fedd3", _env(), {"distiller": "herding"}).row_bounds(0, 5) == \
        {"synthetic_images": 5}
    assert alg.row_bounds(0, 5) == {}


def test_rounds_after_the_first_retrain_only_when_a_new_set_arrives(fed, tmp_path, monkeypatch):
    """With clients sampled in later rounds the union grows: the server trains once per round
    that brings new sets, on every set received so far, and not in the other rounds."""
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    from fedvl.distill import union

    calls: list[int] = []
    real = union.local_train

    def spy(model, x, y, cfg, generator, **kw):
        calls.append(len(y))
        return real(model, x, y, cfg, generator, **kw)

    monkeypatch.setattr(union, "local_train", spy)
    s = run_experiment(replace(_cfg(3), client_ratio=0.67), out=tmp_path / "r", fed=fed)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").open()]
    first = [len(set(r["participants"]) - {c for q in rows[:i] for c in q["participants"]})
             for i, r in enumerate(rows)]
    per_client = 2 * CLASSES
    # One training per round with new clients, on every set received so far.
    assert len(calls) == sum(1 for n in first if n)
    assert calls == [per_client * sum(first[: i + 1]) for i, n in enumerate(first) if n]
    assert s["clients_uploaded"] == sum(first)


def test_server_trains_with_sgd_or_the_official_codes_adam():
    from fedvl.algorithms.fedd3 import FedD3
    from fedvl.core.training import make_optimizer
    from fedvl.distill.union import ServerTraining

    net = torch.nn.Linear(2, 2)
    sgd = make_optimizer(net, ServerTraining.of(FedD3.Params()).config())
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    p = FedD3.Params(server_optimizer="adam", server_lr=1e-3, server_weight_decay=1e-4)
    adam = make_optimizer(net, ServerTraining.of(p).config())
    assert isinstance(adam, torch.optim.Adam)
    assert (adam.defaults["lr"], adam.defaults["weight_decay"]) == (1e-3, 1e-4)
    with pytest.raises(ValueError, match="DP-SGD trains with SGD"):
        from fedvl.core.dp import dp_sgd_train
        dp_sgd_train(net, torch.zeros(4, 2), torch.zeros(4, dtype=torch.long),
                     TrainConfig(optimizer="adam"), torch.Generator(), 1.0, 1.0)

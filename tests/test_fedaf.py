"""FedAF pins: the sliced Wasserstein and LGKM terms by hand, the knowledge pooling, the
re-sampled model, what a client uploads and keeps, what the server trains on."""

from __future__ import annotations

import math
import re

import pytest
import torch

import fedvl.algorithms.fedaf as fedaf
import fedvl.distill.union as union
from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.distill.client_sets import init_set
from fedvl.distill.losses import sliced_wasserstein
from fedvl.distill.samplers import BlendedModelSampler
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from tests.conftest import make_toy_federation

SMALL = {"ipc": 2, "steps": 2, "batch_real": 4, "server_epochs": 1, "server_batch_size": 8,
         "projections": 8, "dsa": False}
MODEL = {"width": 8, "depth": 2, "norm": "instance"}


def _alg(fed, **args):
    cfg = RunConfig(method="fedaf", batch_size=8, model_args=MODEL)
    env = build_env(cfg, fed, torch.device("cpu"))
    return make_algorithm("fedaf", env, {**SMALL, **args})


def _client(fed, cid: int, state: Message | None = None, rnd: int = 0) -> ClientContext:
    c = fed.clients[cid]
    return ClientContext(cid=cid, name=c.name, x=c.x_train, y=c.y_train,
                         num_classes=fed.num_classes, state=state or Message(),
                         generator=torch.Generator().manual_seed(10 * rnd + cid), round=rnd)


def _sym_kl(r: list[float], t: list[float]) -> float:
    return 0.5 * sum(a * math.log(a / b) + b * math.log(b / a) for a, b in zip(r, t))


# -- the two knowledge terms, by hand ---------------------------------------------------------
def test_sliced_wasserstein_is_the_mean_squared_sorted_difference():
    # One direction in 1-D: sorted [1, 2, 3] against [0, 5, 10] differ by 1, 3, 7.
    a, b = torch.tensor([[3.0], [1.0], [2.0]]), torch.tensor([[0.0], [10.0], [5.0]])
    assert float(sliced_wasserstein(a, b, torch.ones(1, 1))) == pytest.approx(59 / 3)
    # Two directions in 2-D: along e1 [0, 1] vs [0, 3] (mean of 0 and 4), along e2
    # [0, 0.5] vs [0, 1] (mean of 0 and 0.25); the distance averages the two.
    a, b = torch.tensor([[0.0, 0.0], [1.0, 0.5]]), torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    assert float(sliced_wasserstein(a, b, torch.eye(2))) == pytest.approx(1.0625)
    # A distance between sets: the order of the points does not matter, class pairing does not.
    assert float(sliced_wasserstein(a, b.flip(0), torch.eye(2))) == pytest.approx(1.0625)
    # L_CDC scales it by points x dimensions (the DM loss's sum over classes).
    assert float(fedaf.knowledge_distance(a, b, torch.eye(2))) == pytest.approx(1.0625 * 4)
    a.requires_grad_(True)
    (g,) = torch.autograd.grad(sliced_wasserstein(a, b, torch.eye(2)), a)
    # (1/4) sum of squared sorted differences: only a_1 moves it, by 2 * (1 - 3) / 4 along e1
    # and 2 * (0.5 - 1) / 4 along e2.
    assert torch.allclose(g, torch.tensor([[0.0, 0.0], [-1.0, -0.25]]))


def test_lgkm_is_the_symmetric_kl_of_class_mean_soft_predictions_by_hand():
    soft = torch.tensor([[0.5, 0.5], [0.2, 0.8]])
    # Class 0: one row softmax([2 ln 3, 0] / 2) = [0.75, 0.25]; class 1: rows [0, 0] and
    # [2 ln 2, 0] at T = 2 give [0.5, 0.5] and [2/3, 1/3], mean [7/12, 5/12].
    logits = torch.tensor([[2 * math.log(3), 0.0], [0.0, 0.0], [2 * math.log(2), 0.0]])
    y = torch.tensor([0, 1, 1])
    both = torch.tensor([True, True])
    got = fedaf.lgkm_loss(logits, y, soft, both, temperature=2.0)
    want = 0.5 * (_sym_kl([0.5, 0.5], [0.75, 0.25]) + _sym_kl([0.2, 0.8], [7 / 12, 5 / 12]))
    assert float(got) == pytest.approx(want, rel=1e-5)
    # A class without a soft label is left out; a batch of such classes gives no term.
    only0 = torch.tensor([True, False])
    got = fedaf.lgkm_loss(logits, y, soft, only0, temperature=2.0)
    assert float(got) == pytest.approx(_sym_kl([0.5, 0.5], [0.75, 0.25]), rel=1e-5)
    assert float(fedaf.lgkm_loss(logits[1:], y[1:], soft, only0, 2.0)) == 0.0


def test_knowledge_is_pooled_by_class_counts_cut_to_the_clients_size():
    v = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [9.0, 9.0]],
                      [[3.0, 2.0], [4.0, 4.0], [9.0, 9.0]]])
    counts = torch.tensor([[1.0, 0.0, 0.0], [3.0, 50.0, -2.0]])
    pooled, present = fedaf.pool_knowledge(v, counts, torch.tensor([10, 20]))
    # Class 0: (1 * [1, 0] + 3 * [3, 2]) / 4; class 1: client 2 alone (its 50 cut to 20);
    # class 2: nobody holds it (a negative count is none).
    assert torch.allclose(pooled, torch.tensor([[2.5, 1.5], [4.0, 4.0], [0.0, 0.0]]))
    assert present.tolist() == [True, True, False]
    uniform, _ = fedaf.pool_knowledge(v, counts, torch.tensor([10, 20]), "uniform")
    assert torch.allclose(uniform[0], torch.tensor([2.0, 1.0]))


def test_resampled_model_blends_the_given_weights_with_a_fresh_network():
    fed = make_toy_federation()
    alg = _alg(fed)
    base = alg.new_model()
    seeds: list[int] = []

    def factory(seed: int):
        seeds.append(seed)
        return alg.env.model_fn(seed=seed)

    g = torch.Generator().manual_seed(0)
    per_step = BlendedModelSampler(base, factory, 0.9)
    first = [p.detach().clone() for p in per_step(g).parameters()]
    fresh = alg.env.model_fn(seed=seeds[0])
    for p, b, r in zip(first, base.parameters(), fresh.parameters(), strict=True):
        assert torch.allclose(p, 0.9 * b + 0.1 * r)
    second = list(per_step(g).parameters())
    assert len(seeds) == 2 and not torch.equal(first[0], second[0])
    once = BlendedModelSampler(base, factory, 0.9, per_step=False)
    a = [p.detach().clone() for p in once(g).parameters()]
    assert all(torch.equal(x, y) for x, y in zip(a, once(g).parameters(), strict=True))
    assert len(seeds) == 3


# -- client ----------------------------------------------------------------------------------
def test_client_uploads_its_set_and_the_knowledge_of_its_real_images():
    fed = make_toy_federation()
    alg = _alg(fed, temperature=3.0)
    state = alg.server_init()
    msg = alg.configure(state, ServerContext(0), [0])[0]
    assert set(msg.arrays) == {"weights"}   # no global knowledge before round 1
    client = _client(fed, 0)
    reply = alg.client_update(msg, client)
    assert set(reply.arrays) == {"synthetic_images", "synthetic_labels", "prototypes", "logits"}
    assert reply.arrays["synthetic_labels"]["y"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    model = alg.load_model(state["model"], torch.device("cpu")).eval()
    with torch.no_grad():
        lg = model(client.x)
    for c in range(4):
        rows = lg[client.y == c]
        assert torch.allclose(reply.arrays["prototypes"]["logits"][c], rows.mean(0), atol=1e-5)
        assert torch.allclose(reply.arrays["logits"]["soft_labels"][c],
                              torch.softmax(rows / 3.0, 1).mean(0), atol=1e-5)
    assert reply.arrays["prototypes"]["counts"].tolist() == [12.0] * 4
    assert reply.meta == {"num_examples": 48, "synthetic": 8}


def test_condensed_set_persists_across_rounds_unless_told():
    fed = make_toy_federation()
    for persist in (True, False):
        alg = _alg(fed, steps=0, persist=persist)
        state, client = alg.server_init(), _client(fed, 1)
        first = alg.client_update(alg.configure(state, ServerContext(0), [1])[1], client)
        client.generator = torch.Generator().manual_seed(99)
        again = alg.client_update(alg.configure(state, ServerContext(1), [1])[1], client)
        same = torch.equal(first.arrays["synthetic_images"]["x"],
                           again.arrays["synthetic_images"]["x"])
        assert same == persist
        assert ("synthetic_images" in client.state.arrays) == persist


def test_mean_init_averages_random_real_images_of_each_class():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 3, 4, 4, generator=g), torch.tensor([0, 0, 0, 1, 1, 1, 1])
    syn = init_set("mean", [2, 1], x, y, 2, g, group=3)
    assert syn.labels.tolist() == [0, 0, 1]
    # Class 0 has 3 images: a group of 3 takes them all; class 1's mean is of 3 of its 4.
    assert torch.allclose(syn.images[0], x[:3].mean(0), atol=1e-6)
    assert torch.allclose(syn.images[1], x[:3].mean(0), atol=1e-6)
    means = [x[3:][[i for i in range(4) if i != j]].mean(0) for j in range(4)]
    assert any(torch.allclose(syn.images[2], m, atol=1e-6) for m in means)


def test_sliced_wasserstein_pull_starts_once_the_server_has_knowledge(monkeypatch):
    fed = make_toy_federation()
    alg = _alg(fed)
    made: list[fedaf.CollaborativeCondensation] = []

    class Spy(fedaf.CollaborativeCondensation):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(fedaf, "CollaborativeCondensation", Spy)
    state = alg.server_init()
    replies = {c: alg.client_update(m, _client(fed, c))
               for c, m in alg.configure(state, ServerContext(0), [0, 1]).items()}
    assert made == []   # round 0: nothing to match yet
    state = alg.aggregate(state, ServerContext(0), replies)
    msg = alg.configure(state, ServerContext(1), [2])[2]
    assert torch.equal(msg.arrays["prototypes"]["logits"], state["knowledge"])
    alg.client_update(msg, _client(fed, 2, rnd=1))
    (obj,) = made
    assert obj.classes.tolist() == [0, 1, 2, 3] and obj.weight == alg.p.lambda_loc
    assert torch.equal(obj.target, state["knowledge"])
    assert obj.dm.matching == "dm" and obj.dm.dsa is None


# -- server ----------------------------------------------------------------------------------
def test_server_trains_on_the_union_with_ce_and_lgkm_and_averages_no_weights(monkeypatch):
    fed = make_toy_federation()
    alg = _alg(fed, lambda_glob=0.5, temperature=2.0)
    state = alg.server_init()
    g = torch.Generator().manual_seed(3)
    replies = {}
    for cid, n in ((2, 1.0), (0, 3.0)):
        soft = torch.full((4, 4), 0.25)
        soft[0] = torch.tensor([0.7, 0.1, 0.1, 0.1]) if cid == 2 else torch.tensor(
            [0.1, 0.7, 0.1, 0.1])
        replies[cid] = Message({"synthetic_images": {"x": torch.randn(4, 3, 8, 8, generator=g)},
                                "synthetic_labels": {"y": torch.tensor([0, 1, 2, 3])},
                                "prototypes": {"logits": torch.full((4, 4), n),
                                               "counts": torch.tensor([n, n, 0.0, n])},
                                "logits": {"soft_labels": soft}},
                               {"num_examples": 10, "synthetic": 4})
    calls = []
    real_train = union.local_train

    def spy(model, x, y, cfg, generator, **kw):
        calls.append((x.clone(), y.clone(), cfg, kw["terms"]))
        return real_train(model, x, y, cfg, generator, **kw)

    monkeypatch.setattr(union, "local_train", spy)
    new = alg.aggregate(state, ServerContext(0), replies)
    (x, y, cfg, terms) = calls[0]
    assert torch.equal(x, torch.cat([replies[2].arrays["synthetic_images"]["x"],
                                     replies[0].arrays["synthetic_images"]["x"]]))
    assert y.tolist() == [0, 1, 2, 3] * 2
    assert (cfg.lr, cfg.momentum, cfg.local_epochs, cfg.batch_size) == (0.01, 0.9, 1, 8)
    (term,) = terms
    # Count-weighted: class 0's soft label is (1 * r_2 + 3 * r_0) / 4; class 2 no one holds.
    assert torch.allclose(term.soft[0], torch.tensor([0.25, 0.55, 0.1, 0.1]))
    assert term.present.tolist() == [True, True, False, True]
    assert (term.weight, term.t) == (0.5, 2.0)
    assert torch.allclose(new["knowledge"][0], torch.full((4,), 2.5))
    assert new["present"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert set(alg.virtual_sets(new, {})) == {"fedaf_received"}
    # The server model moves only by its training: no client weights exist to average.
    monkeypatch.setattr(union, "local_train", lambda *a, **kw: None)
    still = alg.aggregate(state, ServerContext(0), replies)
    assert all(torch.equal(still["model"][k], v) for k, v in state["model"].items())


@pytest.mark.parametrize("args, words", [
    ({"gamma": 1.5}, "fedaf option 'gamma' = 1.5 is invalid; must be in [0, 1]"),
    ({"init": "stats"}, "fedaf option 'init'"),
    ({"resample": "epoch"}, "fedaf option 'resample'"),
    ({"projections": 0}, "fedaf option 'projections' = 0 is invalid; must be >= 1"),
    ({"init_group": 1}, "fedaf option 'init_group'"),
    ({"temperature": 0}, "fedaf option 'temperature'"),
])
def test_options_are_validated_with_clear_errors(args, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        _alg(make_toy_federation(), **args)

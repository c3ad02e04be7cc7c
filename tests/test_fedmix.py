"""FedMix pins: the loss is the paper's three terms (checked by hand on a linear model), the
uploaded means are the group averages, the server pools them and sends each client the ones it
lacks once, λ = 0 is FedAvg's update, options are checked, and a short run learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.algorithms.fedmix import (
    MEAN_IMAGES,
    MEAN_LABELS,
    SEND_MEANS,
    FedMixTerm,
    fedmix_loss,
    group_means,
    scaled_input,
)
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.core.replies import check_reply
from fedvl.core.training import local_train
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation, short_default_run

TINY = {"width": 8, "depth": 2, "norm": "instance"}


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=24, n_test=12)


def _alg(fed, name: str = "fedmix", batch_size: int = 8, local_steps: int | None = None,
         **args):
    cfg = RunConfig(method=name, batch_size=batch_size, lr=0.05, momentum=0.0, model_args=TINY,
                    local_steps=local_steps)
    return make_algorithm(name, build_env(cfg, fed, torch.device("cpu")), args)


def _client(fed, k: int, rnd: int = 0, state: Message | None = None) -> ClientContext:
    c = fed.clients[k]
    return ClientContext(k, c.name, c.x_train, c.y_train, fed.num_classes,
                         state if state is not None else Message(),
                         torch.Generator().manual_seed(100 + k), rnd)


# -- the loss ------------------------------------------------------------------------------------
def test_loss_is_the_three_terms_computed_by_hand():
    g = torch.Generator().manual_seed(0)
    lam, n, d, c = 0.3, 5, 6, 4
    w, b = torch.randn(c, d, generator=g), torch.randn(c, generator=g)
    x, xbar = torch.randn(n, d, generator=g), torch.rand(n, d, generator=g)
    y = torch.tensor([0, 3, 1, 1, 2])
    ybar = torch.softmax(torch.randn(n, c, generator=g), 1)
    u = ((1 - lam) * x).requires_grad_(True)
    got = fedmix_loss(u @ w.t() + b, u, y, xbar, ybar, lam)

    # By hand for f(u) = W u + b: CE = logsumexp(z) - z_y, and dCE/du = W^T (softmax(z) - e_y).
    with torch.no_grad():
        z = (1 - lam) * x @ w.t() + b
        lse = z.exp().sum(1).log()
        ce_y = lse - z[torch.arange(n), y]
        ce_bar = lse - (ybar * z).sum(1)
        p = z.exp() / z.exp().sum(1, keepdim=True)
        dl_du = (p - F.one_hot(y, c).float()) @ w
        inner = ((1 - lam) * dl_du * xbar).sum(1)
        want = ((1 - lam) * ce_y + lam * ce_bar + lam * inner).mean()
    assert torch.isclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
    # Each term matters: dropping any of them moves the value.
    for part in ((1 - lam) * ce_y, lam * ce_bar, lam * inner):
        assert abs(float(want - part.mean())) > 1e-3
    # Its gradient reaches the weights through the input-gradient term (double backward).
    w2 = w.clone().requires_grad_(True)
    u2 = ((1 - lam) * x).requires_grad_(True)
    fedmix_loss(u2 @ w2.t() + b, u2, y, xbar, ybar, lam).backward()
    assert w2.grad is not None and float(w2.grad.abs().sum()) > 0


def test_local_step_minimises_the_fedmix_loss_of_its_batch(fed):
    # One step on the whole data with a pool of one mean: the step's loss is fedmix_loss of
    # that batch (the shuffle only reorders rows), and the update is its gradient step.
    alg = _alg(fed, batch_size=24, local_steps=1, lam=0.2)
    client = _client(fed, 0)
    model = alg.new_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    stats = alg.train(model, Message({"weights": start}), client)
    xbar, ybar = client.state.arrays[MEAN_IMAGES]["0"], client.state.arrays[MEAN_LABELS]["0"]
    assert xbar.shape == (1, 3, 8, 8)

    ref = alg.new_model()
    ref.load_state_dict(start)
    ref.train()
    u = (0.8 * client.x).requires_grad_(True)
    n = len(client.y)
    loss = fedmix_loss(ref(u), u, client.y, xbar.expand(n, -1, -1, -1), ybar.expand(n, -1), 0.2)
    assert abs(stats.mean_loss - loss.item()) < 1e-5, (stats.mean_loss, loss.item())
    loss.backward()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            assert torch.allclose(model.state_dict()[name], p - 0.05 * p.grad, atol=1e-5), name


# -- the means -----------------------------------------------------------------------------------
def test_means_are_the_group_averages():
    x = torch.arange(7 * 2 * 2 * 2, dtype=torch.float32).reshape(7, 2, 2, 2)
    y = torch.tensor([0, 1, 2, 0, 1, 1, 2])
    mx, my = group_means(x, y, 3, 3)
    assert mx.shape == (2, 2, 2, 2) and my.shape == (2, 3)   # the 7th sample is dropped
    assert torch.equal(mx[0], x[:3].mean(0)) and torch.equal(mx[1], x[3:6].mean(0))
    assert torch.allclose(my, torch.tensor([[1, 1, 1], [1, 2, 0]]) / 3.0)
    ax, ay = group_means(x, y, 3, 0)
    assert torch.allclose(ax, x.mean(0, keepdim=True)) and torch.allclose(
        ay, torch.tensor([[2.0, 3.0, 2.0]]) / 7)
    # Shuffled groups: every mean is the average of `mean_batch` distinct samples.
    x = torch.randn(7, 2, 2, 2, generator=torch.Generator().manual_seed(1))
    sx, sy = group_means(x, y, 3, 2, torch.Generator().manual_seed(0))
    assert sx.shape == (3, 2, 2, 2)
    flat = x.flatten(1)
    for m, lab in zip(sx.flatten(1), sy, strict=True):
        pairs = [(i, j) for i in range(7) for j in range(i + 1, 7)
                 if torch.allclose((flat[i] + flat[j]) / 2, m, atol=1e-6)]
        assert len(pairs) == 1
        i, j = pairs[0]
        assert torch.equal(lab, (F.one_hot(y[i], 3) + F.one_hot(y[j], 3)).float() / 2)
    assert group_means(x[:1], y[:1], 3, 0)[0].shape == (0, 2, 2, 2)   # no mean of one image


def test_duplicates_count_once_and_groups_of_one_distinct_image_are_refused():
    g = torch.Generator().manual_seed(3)
    a, b, c, d = torch.randn(4, 2, 2, 2, generator=g)
    x = torch.stack([a, a, b, c, d, d, d, b])
    y = torch.tensor([0, 1, 1, 2, 0, 0, 1, 2])
    # Groups of 2 in order: {a, a} refused, {b, c} kept, {d, d} refused, {d, b} kept.
    mx, my = group_means(x, y, 3, 2)
    assert torch.equal(mx, torch.stack([(b + c) / 2, (d + b) / 2]))
    assert torch.equal(my, torch.tensor([[0, 0.5, 0.5], [0, 0.5, 0.5]]))
    # One group of all 8: a, b, c, d once each, with their first copy's label.
    mx, my = group_means(x, y, 3, 0)
    assert torch.allclose(mx[0], (a + b + c + d) / 4)
    assert torch.equal(my[0], torch.tensor([0.5, 0.25, 0.25]))
    # Groups of 4: {a, a, b, c} averages three images, {d, d, d, b} two.
    mx, _ = group_means(x, y, 3, 4)
    assert torch.allclose(mx, torch.stack([(a + b + c) / 3, (d + b) / 2]))
    # Only copies of one image: nothing to send.
    assert group_means(a.repeat(5, 1, 1, 1), y[:5], 3, 0)[0].shape == (0, 2, 2, 2)


def test_refused_groups_reach_the_summary(fed, tmp_path, monkeypatch):
    from fedvl.data.federated import ClientData, FederatedDataset

    c = fed.clients[0]
    x = c.x_train[:8].clone()
    x[1] = x[0]   # the first group of 2 (unshuffled below) holds one image twice
    one = FederatedDataset("dup", [ClientData("c0", x, c.y_train[:8], c.x_test, c.y_test)],
                           fed.num_classes, fed.mean, fed.std)
    monkeypatch.setattr("fedvl.algorithms.fedmix.derived_generator", lambda client, s: None)
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = RunConfig(method="fedmix", method_args={"mean_batch": 2}, rounds=1, batch_size=8,
                    lr=0.05, model_args=TINY)
    out = run_experiment(cfg, out=tmp_path / "r", fed=one)
    assert out["fedmix_refused_groups"] == {"c0": 1} and out["fedmix_pool_means"] == 3


def test_server_pools_the_means_and_sends_each_client_the_missing_ones_once(fed):
    alg = _alg(fed, mean_batch=4)
    state = alg.server_init()
    sent = alg.configure(state, ServerContext(0), [0, 1])
    assert all(m.meta.get(SEND_MEANS) and MEAN_IMAGES not in m.arrays for m in sent.values())
    states = {k: Message() for k in range(3)}
    replies = {k: alg.client_update(sent[k].copy(), _client(fed, k, 0, states[k]))
               for k in (0, 1)}
    for k, r in replies.items():
        check_reply(r, alg.reply_spec(sent[k], k))
        mx = r.get(MEAN_IMAGES)["x"]
        assert mx.shape == (6, 3, 8, 8) and r.get(MEAN_LABELS)["y"].shape == (6, 4)
        # Each mean averages 4 of the client's images; together they cover its data once.
        assert torch.allclose(mx.mean(0), fed.clients[k].x_train.mean(0), atol=1e-5)
    state = alg.aggregate(state, ServerContext(0), replies)
    assert sorted(state["means"]) == [0, 1] and state["asked"] == [0, 1]

    # Round 1: client 2 (new) gets the pool of 0 and 1 and is asked for its means; client 0
    # gets 1's means only (its own stay home), and is not asked again.
    sent = alg.configure(state, ServerContext(1), [0, 2])
    assert sorted(sent[2].get(MEAN_IMAGES)) == ["0", "1"] and sent[2].meta[SEND_MEANS]
    assert sorted(sent[0].get(MEAN_IMAGES)) == ["1"] and SEND_MEANS not in sent[0].meta
    assert torch.equal(sent[2].get(MEAN_IMAGES)["1"], replies[1].get(MEAN_IMAGES)["x"])
    assert torch.equal(sent[2].get(MEAN_LABELS)["0"], replies[0].get(MEAN_LABELS)["y"])
    replies = {k: alg.client_update(sent[k].copy(), _client(fed, k, 1, states[k]))
               for k in (0, 2)}
    assert MEAN_IMAGES not in replies[0].arrays and MEAN_IMAGES in replies[2].arrays
    assert sorted(states[2].arrays[MEAN_IMAGES]) == ["0", "1", "2"]
    assert sorted(states[0].arrays[MEAN_IMAGES]) == ["0", "1"]
    state = alg.aggregate(state, ServerContext(1), replies)

    # Round 2: 0 lacks only 2's means, 1 (last sampled when the pool was empty) lacks 0's and
    # 2's; nothing is sent twice.
    sent = alg.configure(state, ServerContext(2), [0, 1, 2])
    assert sorted(sent[0].get(MEAN_IMAGES)) == ["2"]
    assert sorted(sent[1].get(MEAN_IMAGES)) == ["0", "2"]
    assert MEAN_IMAGES not in sent[2].arrays
    # An unrequested upload of means is rejected.
    bad = Message({**replies[2].arrays}, dict(replies[2].meta))
    with pytest.raises(ValueError, match="mean_images"):
        check_reply(bad, alg.reply_spec(sent[2], 2))


def test_means_bytes_are_counted_once_per_client_pair(fed, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = RunConfig(method="fedmix", method_args={"mean_batch": 4}, rounds=3, batch_size=8,
                    lr=0.05, client_ratio=1.0, model_args=TINY)
    out = run_experiment(cfg, out=tmp_path / "r", fed=fed)
    per = 6 * 3 * 8 * 8 * 4   # 6 float32 means of 3x8x8 per client
    kinds = out["bytes_by_kind"]
    assert kinds[MEAN_IMAGES]["up"] == 3 * per          # each client uploads once
    assert kinds[MEAN_IMAGES]["down"] == 3 * 2 * per    # each gets the 2 others once
    assert kinds[MEAN_LABELS]["up"] == 3 * 6 * 4 * 4


# -- reductions and options ----------------------------------------------------------------------
def test_lambda_zero_is_fedavg_and_lambda_positive_is_not(fed):
    fedavg = _alg(fed, "fedavg")
    msg = fedavg.configure(fedavg.server_init(), ServerContext(0), [0])[0]
    want = fedavg.client_update(msg.copy(), _client(fed, 0)).get("weights")

    def update(lam: float) -> dict:
        alg = _alg(fed, lam=lam, mean_batch=4)
        m = alg.configure(alg.server_init(), ServerContext(0), [0])[0]
        return alg.client_update(m.copy(), _client(fed, 0)).get("weights")

    off = update(0.0)
    assert all(torch.equal(off[k], want[k]) for k in want)
    on = update(0.2)
    assert max(float((on[k] - want[k]).abs().max()) for k in want) > 1e-4

    # The FedMix term itself at λ = 0 (scaled input, mean draws, double backward): FedAvg's
    # loss exactly, its weights up to the rounding of the zero-weighted extra gradient paths.
    alg = _alg(fed, mean_batch=4)
    client = _client(fed, 0)
    px, py = alg.pool(msg, client)
    model = alg.load_model(msg.get("weights"), client.device)
    stats = local_train(model, client.x, client.y, alg.client_train(client), client.generator,
                        terms=(FedMixTerm(0.0, px, py, torch.Generator().manual_seed(5)),),
                        augment=scaled_input(0.0))
    ref = fedavg.load_model(msg.get("weights"), client.device)
    ref_stats = fedavg.train(ref, msg, _client(fed, 0))
    assert stats.mean_loss == ref_stats.mean_loss and stats.steps == ref_stats.steps == 3
    got = model.state_dict()
    assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)


def test_bad_options_are_one_clear_error(fed):
    with pytest.raises(ConfigError, match="mean_batch' = 1 .*0 .*>= 2"):
        _alg(fed, mean_batch=1)
    with pytest.raises(ConfigError, match="lam' = 1.0"):
        _alg(fed, lam=1.0)
    with pytest.raises(ValueError, match="no option"):
        _alg(fed, mixup=0.1)


def test_short_run_on_the_embedded_default_learns(tmp_path):
    out = short_default_run("fedmix", tmp_path / "r")
    assert out["mean_accuracy"] > 0.3, out["per_client_accuracy"]   # chance: 0.1
    assert out["bytes_by_kind"][MEAN_IMAGES]["up"] > 0
    assert out["bytes_by_kind"][MEAN_IMAGES]["down"] > 0

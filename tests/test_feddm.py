"""FedDM pins: the rho-ball draw, what a client uploads, what the server trains on, DP epsilon."""

from __future__ import annotations

import pytest
import torch

import fedvl.algorithms.feddm as feddm
import fedvl.distill.union as union
from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.config import RunConfig
from fedvl.core.dp import compute_epsilon
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.core.replies import ReplyRejected, check_reply
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.distill.dp_matching import DPDistributionMatching
from fedvl.distill.samplers import FixedModelSampler, RhoBallSampler, UniformClassSampler
from fedvl.distill.synthesize import DistributionMatching
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation

SMALL = {"ipc": 2, "steps": 2, "batch_real": 4, "server_epochs": 1, "server_batch_size": 8}
MODEL = {"width": 8, "depth": 2, "norm": "instance"}


def _alg(fed: FederatedDataset, args: dict | None = None, norm: str = "instance"):
    cfg = RunConfig(method="feddm", batch_size=8, lr=0.05, momentum=0.0,
                    model_args={**MODEL, "norm": norm})
    env = build_env(cfg, fed, torch.device("cpu"))
    return make_algorithm("feddm", env, {**SMALL, **(args or {})})


def _client(fed: FederatedDataset, cid: int, state: Message | None = None) -> ClientContext:
    c = fed.clients[cid]
    return ClientContext(cid=cid, name=c.name, x=c.x_train, y=c.y_train,
                         num_classes=fed.num_classes, state=state or Message(),
                         generator=torch.Generator().manual_seed(cid), round=0)


def _skewed() -> FederatedDataset:
    """Client 0 owns classes 0 and 1 (>= 10 images) and holds 3 images of class 2."""
    base = make_toy_federation(num_clients=1, n_train=48)
    c = base.clients[0]
    y = torch.tensor([0] * 12 + [1] * 15 + [2] * 3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(y), 3, 8, 8, generator=g) + y.view(-1, 1, 1, 1)
    return FederatedDataset("skew", [ClientData("s0", x, y, c.x_test, c.y_test)],
                            base.num_classes, base.mean, base.std)


def _delta_norm(model, base) -> float:
    sq = sum(((p - q) ** 2).sum() for p, q in zip(model.parameters(), base.parameters(),
                                                   strict=True))
    return float(torch.sqrt(sq.detach()))


def test_rho_ball_draw_is_on_the_sphere_by_default_and_fresh_every_step(monkeypatch):
    fed = make_toy_federation()
    alg = _alg(fed, {"rho": 0.7, "steps": 3})
    made: list[RhoBallSampler] = []
    norms: list[float] = []
    deltas: list[torch.Tensor] = []

    class Spy(RhoBallSampler):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            made.append(self)

        def __call__(self, generator):
            model = super().__call__(generator)
            norms.append(_delta_norm(model, self.base))
            deltas.append(torch.cat([d.flatten() for d in self.last_delta]))
            return model

    monkeypatch.setattr(feddm, "RhoBallSampler", Spy)
    state = alg.server_init()
    alg.client_update(alg.configure(state, ServerContext(0), [0])[0], _client(fed, 0))
    assert len(made) == 1 and len(norms) == 3 and made[0].sphere
    # The public code's random_pertube: norm exactly rho (the sphere), not inside the ball.
    for n in norms:
        assert n == pytest.approx(0.7, rel=1e-4)
    # The sampler perturbs the received global weights, in eval mode.
    for k, v in made[0].base.state_dict().items():
        assert torch.equal(v, state["model"][k]), k
    assert not deltas[0].allclose(deltas[1]) and not deltas[1].allclose(deltas[2])


def test_rho_ball_draw_inside_the_ball_when_asked():
    fed = make_toy_federation()
    model = _alg(fed).new_model()
    sampler = RhoBallSampler(model, 0.7, sphere=False)
    g = torch.Generator().manual_seed(0)
    norms = [_delta_norm(sampler(g), model) for _ in range(5)]
    assert all(n <= 0.7 + 1e-6 for n in norms)
    assert all(n > 0 for n in norms)


def test_rho0_steps0_real_init_sends_exactly_sampled_real_images():
    fed = make_toy_federation(n_train=48)
    alg = _alg(fed, {"rho": 0.0, "steps": 0, "ipc": 3, "init": "real"})
    state = alg.server_init()
    client = _client(fed, 1)
    reply = alg.client_update(alg.configure(state, ServerContext(0), [1])[1], client)
    assert set(reply.arrays) == {"synthetic_images", "synthetic_labels"}
    assert set(reply.arrays["synthetic_images"]) == {"x"}
    assert set(reply.arrays["synthetic_labels"]) == {"y"}
    x, y = reply.arrays["synthetic_images"]["x"], reply.arrays["synthetic_labels"]["y"]
    assert torch.bincount(y, minlength=fed.num_classes).tolist() == [3] * fed.num_classes
    used = set()
    for row, label in zip(x, y, strict=True):
        hits = [i for i in range(len(client.y)) if torch.equal(client.x[i], row)]
        assert len(hits) == 1 and int(client.y[hits[0]]) == int(label)
        used.add(hits[0])
    assert len(used) == len(y)  # distinct real images, drawn without replacement
    assert set(reply.meta) == {"num_examples", "synthetic"}
    # Re-drawn every round: another generator picks other images.
    client2 = _client(fed, 1)
    client2.generator = torch.Generator().manual_seed(99)
    again = alg.client_update(alg.configure(state, ServerContext(1), [1])[1], client2)
    assert not torch.equal(again.arrays["synthetic_images"]["x"], x)


def test_client_matches_embeddings_and_logits_without_augmentation(monkeypatch):
    fed = make_toy_federation()
    alg = _alg(fed)
    seen = []

    class Spy(DistributionMatching):
        def __post_init__(self) -> None:
            seen.append((self.matching, self.dsa, self.real.n))
            super().__post_init__()

    monkeypatch.setattr(feddm, "DistributionMatching", Spy)
    alg.client_update(alg.configure(alg.server_init(), ServerContext(0), [0])[0],
                      _client(fed, 0))
    assert seen == [("embed_logit", None, SMALL["batch_real"])]


def test_only_owned_classes_are_sent_under_label_skew():
    fed = _skewed()
    alg = _alg(fed, {"ipc": 2, "init": "real"})
    reply = alg.client_update(alg.configure(alg.server_init(), ServerContext(0), [0])[0],
                              _client(fed, 0))
    y = reply.arrays["synthetic_labels"]["y"]
    assert torch.bincount(y, minlength=fed.num_classes).tolist() == [2, 2, 0, 0]


def test_server_trains_only_on_the_received_sets(monkeypatch):
    fed = make_toy_federation()
    alg = _alg(fed)
    state = alg.server_init()
    g = torch.Generator().manual_seed(3)
    replies = {}
    for cid in (2, 0):
        x = torch.randn(4, 3, 8, 8, generator=g)
        replies[cid] = Message({"synthetic_images": {"x": x},
                                "synthetic_labels": {"y": torch.tensor([0, 1, 2, 3])}},
                               {"num_examples": 10, "synthetic": 4})
    calls = []
    real_train = union.local_train

    def spy(model, x, y, cfg, generator, **kw):
        calls.append((x.clone(), y.clone(), cfg))
        return real_train(model, x, y, cfg, generator, **kw)

    monkeypatch.setattr(union, "local_train", spy)
    new = alg.aggregate(state, ServerContext(0), replies)
    assert len(calls) == 1
    x, y, cfg = calls[0]
    # The union of this round's replies in sampled order, and nothing else.
    assert torch.equal(x, torch.cat([replies[2].arrays["synthetic_images"]["x"],
                                     replies[0].arrays["synthetic_images"]["x"]]))
    assert torch.equal(y, torch.tensor([0, 1, 2, 3] * 2))
    assert (cfg.lr, cfg.momentum, cfg.weight_decay, cfg.local_epochs, cfg.batch_size) == (
        0.01, 0.9, 5e-4, SMALL["server_epochs"], SMALL["server_batch_size"])
    assert any(not torch.equal(new["model"][k], state["model"][k]) for k in state["model"])
    assert torch.equal(new["last_x"], x) and torch.equal(new["last_y"], y)
    assert set(alg.virtual_sets(new, {})) == {"feddm_received"}
    # Without that training call the global model does not move.
    monkeypatch.setattr(union, "local_train", lambda *a, **kw: None)
    still = alg.aggregate(state, ServerContext(0), replies)
    for k, v in state["model"].items():
        assert torch.equal(still["model"][k], v), k
    # The next round's message carries the trained weights.
    down = alg.configure(new, ServerContext(1), [0])[0]
    assert set(down.arrays) == {"weights"}
    for k, v in new["model"].items():
        assert torch.equal(down.get("weights")[k], v), k


def test_dp_epsilon_is_the_opacus_epsilon_of_all_steps_so_far():
    from opacus.accountants import RDPAccountant

    fed = make_toy_federation(n_train=48)  # 12 images of each of 4 classes
    args = {"init": "noise", "dp_noise": 1.2, "dp_clip": 0.5, "dp_delta": 1e-4, "steps": 3,
            "batch_real": 4}
    alg = _alg(fed, args)
    state = alg.server_init()
    client = _client(fed, 0)
    q = 4 / 12
    for rnd, steps in ((0, 3), (1, 6)):
        reply = alg.client_update(alg.configure(state, ServerContext(rnd), [0])[0], client)
        acc = RDPAccountant()
        for _ in range(steps):
            acc.step(noise_multiplier=1.2, sample_rate=q)
        assert reply.meta["epsilon"] == pytest.approx(acc.get_epsilon(delta=1e-4), rel=1e-9)
        assert reply.meta["epsilon"] == compute_epsilon(1.2, q, steps, 1e-4)
        assert reply.meta["delta"] == 1e-4 and reply.meta["dp_steps"] == steps
        state = alg.aggregate(state, ServerContext(rnd), {0: reply})
    assert state["epsilon"] == {"c0": compute_epsilon(1.2, q, 6, 1e-4)}


def test_dp_epsilon_reaches_the_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    fed = make_toy_federation(num_clients=2, n_train=48, n_test=8)
    cfg = RunConfig(method="feddm", rounds=2, batch_size=8, lr=0.05, momentum=0.0,
                    model_args=MODEL, method_args={**SMALL, "init": "noise", "dp_noise": 1.0,
                                                   "steps": 1})
    summary = run_experiment(cfg, out=tmp_path / "run", fed=fed)
    eps = compute_epsilon(1.0, 4 / 12, 2, 1 / (10 * 48))
    assert summary["privacy"]["epsilon"] == {"c0": eps, "c1": eps}
    assert summary["privacy"]["noise_multiplier"] == 1.0
    plain = run_experiment(RunConfig(**{**cfg.__dict__, "method_args": SMALL}),
                           out=tmp_path / "plain", fed=fed)
    assert "privacy" not in plain


def test_dp_logit_matching_without_noise_is_the_embed_logit_gradient():
    fed = make_toy_federation(n_train=48)
    alg = _alg(fed)
    model = alg.new_model()
    c = fed.clients[0]
    syn = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1),
                      requires_grad=True)
    ys = torch.arange(8) % 4
    # Rate 1 (batch >= class size), no noise, a clip no sample reaches: exact gradient.
    dp = DPDistributionMatching(c.x_train, c.y_train, FixedModelSampler(model, False), 4,
                                batch_per_class=100, clip=1e6, noise_multiplier=0.0,
                                space="feature", logits=True)
    plain = DistributionMatching(UniformClassSampler(c.x_train, c.y_train, 4, 100),
                                 FixedModelSampler(model, False), 4, matching="embed_logit",
                                 dsa=None)
    g = torch.Generator().manual_seed(0)
    loss_dp, grad_dp = dp(syn, ys, g)
    loss, _ = plain(syn, ys, g)
    (grad,) = torch.autograd.grad(loss, syn)
    torch.testing.assert_close(loss_dp, loss.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_dp, grad, rtol=1e-3, atol=1e-6)


def test_dp_refuses_real_init_and_batchnorm():
    fed = make_toy_federation()
    with pytest.raises(ValueError, match="needs init 'noise'"):
        _alg(fed, {"dp_noise": 1.0, "init": "real"})
    with pytest.raises(ValueError, match="BatchNorm"):
        _alg(fed, {"dp_noise": 1.0, "init": "noise"}, norm="batch")
    _alg(fed, {"init": "real"}, norm="batch")  # without DP both are fine


@pytest.mark.parametrize("args, message", [
    ({"rho": -1.0}, "feddm option 'rho' = -1.0 is invalid; must be >= 0"),
    ({"init": "stats"}, "feddm option 'init'"),
    ({"rho_draw": "cube"}, "feddm option 'rho_draw'"),
    ({"server_momentum": 1.0}, "feddm option 'server_momentum'"),
    ({"server_batch_size": 0}, "feddm option 'server_batch_size'"),
    ({"dp_delta": 1.0}, "feddm option 'dp_delta'"),
    ({"dp_clip": 0.0}, "feddm option 'dp_clip'"),
    ({"steps": -1}, "feddm option 'steps'"),
    ({"sigma": 1.0}, "method 'feddm' has no option"),
])
def test_options_are_validated(args, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        _alg(make_toy_federation(), args)


def test_state_is_plain_data():
    fed = make_toy_federation()
    alg = _alg(fed)
    state = alg.server_init()
    assert state["last_x"] is None and alg.virtual_sets(state, {}) == {}
    assert set(state["model"]) == set(clone_state(alg.new_model().state_dict()))


def test_the_server_terms_default_to_the_papers_equations():
    # Eq. 9 (n_k / n per client set) and Sec. 4.5 (the rho-ball projection); the public code's
    # forms are the option values `uniform` and `false`.
    alg = _alg(make_toy_federation())
    assert (alg.p.server_weighting, alg.p.server_projection) == ("clients", True)
    assert "num_examples" in alg.reply_spec(alg.configure(alg.server_init(), ServerContext(0),
                                                          [0])[0], 0).required_meta


def test_server_weighting_by_client_share_and_projection_into_the_rho_ball():
    # Paper Eq. 9: client k's set counts n_k / n; a client that sent no set has no say.
    w = feddm.client_share_weights([(30, 4), (10, 4), (99, 0)])
    assert w.tolist() == [1.5] * 4 + [0.5] * 4 and float(w.mean()) == 1.0
    logits, y = torch.randn(8, 3), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ce = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    assert float((ce * w).mean()) == pytest.approx(0.75 * float(ce[:4].mean())
                                                   + 0.25 * float(ce[4:].mean()))
    # Paper Sec. 4.5: the server model stays within rho of w_t (here a radius it would leave).
    fed = make_toy_federation()
    for projection in (False, True):
        alg = _alg(fed, {"rho": 0.05, "server_epochs": 3, "server_projection": projection,
                         "server_weighting": "clients"})
        state = alg.server_init()
        msgs = alg.configure(state, ServerContext(0), [0, 1])
        replies = {c: alg.client_update(m, _client(fed, c)) for c, m in msgs.items()}
        new = alg.aggregate(state, ServerContext(0), replies)
        # The share weighting needs every reply's n_k: a reply without it is refused, not a crash.
        bare = Message(replies[0].arrays, {})
        with pytest.raises(ReplyRejected, match="num_examples"):
            check_reply(bare, alg.reply_spec(msgs[0], 0))
        dist = float(torch.sqrt(sum(((new["model"][k] - state["model"][k]).double() ** 2).sum()
                                    for k, _ in alg.new_model().named_parameters())))
        assert (dist <= 0.05 + 1e-6) == projection, dist

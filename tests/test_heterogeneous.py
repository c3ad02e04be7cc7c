"""FedHe and FedProto pins: what clients upload, how the server pools it, and that with a zero
weight both reduce to local-only training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedvl.algorithms.base import ClientContext, make_algorithm
from fedvl.algorithms.fedproto import ProjectedModel
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.core.prototypes import ClassMeanTerm, pool_class_means
from fedvl.run.assemble import build_env, build_federation
from fedvl.run.experiment import run_experiment

TINY = {"width": 8, "depth": 2, "norm": "instance"}


@pytest.fixture(scope="module")
def fed():
    return build_federation(RunConfig(benchmark="digits-offline", train_cap=40, test_cap=20))


def _cfg(method: str, **kw) -> RunConfig:
    base = {"method": method, "benchmark": "digits-offline", "train_cap": 40, "test_cap": 20,
            "rounds": 2, "batch_size": 16, "model_args": TINY, "local_steps": 3,
            "client_models": ["alternate"]}
    return RunConfig(**{**base, **kw})


def _ctx(fed, cid: int, state: Message | None = None) -> ClientContext:
    c = fed.clients[cid]
    return ClientContext(cid=cid, name=c.name, x=c.x_train, y=c.y_train, num_classes=10,
                         state=state or Message(), generator=torch.Generator().manual_seed(cid),
                         round=0)


@pytest.mark.parametrize("method, args", [("fedhe", {"alpha": 0.0}), ("fedproto", {"ld": 0.0})])
def test_zero_weight_is_local_training(fed, tmp_path, method, args):
    # Homogeneous models: FedProto then keeps the plain architecture (no projection layer).
    kw = {"client_models": None}
    got = run_experiment(_cfg(method, method_args=args, **kw), out=tmp_path / "m", fed=fed)
    loc = run_experiment(_cfg("local", **kw), out=tmp_path / "l", fed=fed)
    assert got["cross_accuracy"] == loc["cross_accuracy"]
    assert got["per_client_loss"] == loc["per_client_loss"]


def test_class_mean_term_pulls_only_classes_with_a_target_and_collects_means():
    target = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    has = torch.tensor([True, False, True])
    term = ClassMeanTerm(target, has, 0.5, 3, use_logits=True)
    y = torch.tensor([0, 1, 2, 0])
    out = torch.tensor([[2.0, 0.0], [5.0, 5.0], [0.0, 0.0], [0.0, 0.0]])
    loss = term(None, None, y, torch.zeros(4, 1), out)
    # Residuals: [1,0], (class 1: none), [0,-2], [-1,0] -> squares sum 6 over 4 x 2 entries.
    assert float(loss) == pytest.approx(0.5 * 6 / 8)
    mean, counts = term.means()
    assert counts.tolist() == [2, 1, 1]
    assert mean.tolist() == [[1.0, 0.0], [5.0, 5.0], [0.0, 0.0]]


def test_pooling_is_plain_over_holders_or_count_weighted():
    a = (torch.tensor([[1.0], [4.0]]), torch.tensor([1.0, 3.0]))
    b = (torch.tensor([[3.0], [0.0]]), torch.tensor([3.0, 0.0]))
    plain, n = pool_class_means([a, b], weighted=False)
    assert plain.flatten().tolist() == [2.0, 4.0] and n.tolist() == [4.0, 3.0]
    weighted, _ = pool_class_means([a, b], weighted=True)
    assert weighted.flatten().tolist() == [2.5, 4.0]


def test_fedhe_uploads_the_mean_training_logits_and_the_server_keeps_a_running_mean(fed):
    env = build_env(_cfg("fedhe", batch_size=1000, local_steps=1), fed, torch.device("cpu"))
    alg = make_algorithm("fedhe", env, {})
    ctx = _ctx(fed, 0)
    model = alg.own_model(ctx)
    with torch.no_grad():
        logits = model(ctx.x)      # one full batch: the logits of the model before its step
    reply = alg.client_update(Message(), ctx)
    y = ctx.y
    want = torch.stack([logits[y == c].mean(0) for c in range(10)])
    assert torch.allclose(reply.arrays["logits"]["class_mean"], want, atol=1e-5)
    st = alg.aggregate(alg.server_init(), None, {0: reply})
    st = alg.aggregate(st, None, {1: reply})
    served = alg.configure(st, None, [0])[0].arrays["logits"]
    assert torch.allclose(served["class_mean"], want, atol=1e-5)   # two equal uploads
    assert served["counts"].tolist() == (2 * torch.bincount(y, minlength=10)).float().tolist()
    alg_r = make_algorithm("fedhe", env, {"memory": "round"})
    st = alg_r.aggregate(alg_r.server_init(), None, {0: reply})
    st = alg_r.aggregate(st, None, {1: reply})
    assert st["counts"].tolist() == torch.bincount(y, minlength=10).float().tolist()


def test_fedhe_client_pulls_logits_toward_the_served_means(fed, monkeypatch):
    env = build_env(_cfg("fedhe", batch_size=1000, local_steps=1), fed, torch.device("cpu"))
    alg = make_algorithm("fedhe", env, {"alpha": 0.5})
    served = torch.randn(10, 10, generator=torch.Generator().manual_seed(3))
    counts = torch.ones(10)
    counts[4] = 0                               # no mean for class 4: no pull on its samples
    losses = []
    real = F.cross_entropy

    def spy(logits, y, *a, **kw):
        out = real(logits, y, *a, **kw)
        keep = (y != 4)[:, None]
        diff = torch.where(keep, logits - served[y], torch.zeros_like(logits))
        losses.append(float(out.detach()) + 0.5 * float((diff.detach() ** 2).mean()))
        return out

    monkeypatch.setattr("fedvl.core.training.F.cross_entropy", spy)
    reply = alg.client_update(Message({"logits": {"class_mean": served, "counts": counts}}),
                              _ctx(fed, 0))
    assert reply.meta["train_loss"] == pytest.approx(losses[0], rel=1e-5)


def test_fedproto_projects_mixed_embeddings_to_one_size_and_pools_plain_means(fed):
    env = build_env(_cfg("fedproto"), fed, torch.device("cpu"))
    alg = make_algorithm("fedproto", env, {})
    dims = {int(m.feature_dim) for m in (alg.client_new_model(k) for k in range(5))}
    assert len(dims) == 1 and dims == {alg.dim}
    assert all(isinstance(alg.client_new_model(k), ProjectedModel) for k in range(5))
    # Same init for the same client on every call (engines build it independently).
    a, b = alg.client_new_model(1), alg.client_new_model(1)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))
    replies = {k: alg.client_update(Message(), _ctx(fed, k)) for k in (0, 1)}
    st = alg.aggregate(alg.server_init(), None, replies)
    p0, p1 = (replies[k].arrays["prototypes"]["class_mean"] for k in (0, 1))
    assert torch.allclose(st["protos"], (p0 + p1) / 2)
    assert alg.report(st)["prototypes"] == {"dim": alg.dim, "projection": True}


def test_feddf_needs_a_public_set_and_builds_it_from_a_named_benchmark(fed):
    from fedvl.options import ConfigError
    from fedvl.run.assemble import build_public

    with pytest.raises(ConfigError, match="feddf.*--public NAME.*digits-offline"):
        make_algorithm("feddf", build_env(_cfg("feddf"), fed, torch.device("cpu")), {})
    cfg = _cfg("feddf", public="digits-offline", public_size=50)
    x = build_public(cfg, (3, 20, 20))
    assert x.shape == (50, 3, 20, 20)
    assert torch.equal(x, build_public(cfg, (3, 20, 20)))             # seeded
    env = build_env(cfg, fed, torch.device("cpu"))
    assert env.public_fn is not None and env.public_fn().shape == (50, *fed.image_shape)


def test_feddf_uploads_public_logits_and_serves_their_mean(fed):
    from fedvl.algorithms.feddf import public_logits

    cfg = _cfg("feddf", public="digits-offline", public_size=40)
    env = build_env(cfg, fed, torch.device("cpu"))
    alg = make_algorithm("feddf", env, {})
    ctxs = {k: _ctx(fed, k) for k in (0, 1)}
    replies = {k: alg.client_update(Message(), c) for k, c in ctxs.items()}
    for k, c in ctxs.items():
        want = public_logits(alg.own_model(c), env.public_fn())
        assert torch.equal(replies[k].arrays["logits"]["public"], want)
    st = alg.aggregate(alg.server_init(), None, replies)
    assert torch.allclose(st["teacher"], (replies[0].arrays["logits"]["public"]
                                          + replies[1].arrays["logits"]["public"]) / 2)
    down = alg.configure(st, None, [0, 1])
    assert torch.equal(down[1].arrays["logits"]["public"], st["teacher"])


def test_feddf_distillation_moves_the_model_toward_the_teacher(fed):
    cfg = _cfg("feddf", public="digits-offline", public_size=64, lr=1e-9)
    env = build_env(cfg, fed, torch.device("cpu"))
    alg = make_algorithm("feddf", env, {"public_lr": 0.5, "public_epochs": 3})
    ctx = _ctx(fed, 0)
    x = env.public_fn()
    teacher = torch.zeros(64, 10)
    teacher[:, 3] = 10.0                         # every public image: class 3
    before = F.softmax(alg.own_model(ctx)(x), 1)[:, 3].mean()
    alg.client_update(Message({"logits": {"public": teacher}}), ctx)
    after = F.softmax(alg.own_model(ctx)(x), 1)[:, 3].mean()
    assert after > before + 0.2


def test_feddf_without_distillation_is_local_training(fed, tmp_path):
    kw = {"client_models": None, "public": "digits-offline", "public_size": 30}
    got = run_experiment(_cfg("feddf", method_args={"public_epochs": 0}, **kw),
                         out=tmp_path / "m", fed=fed)
    loc = run_experiment(_cfg("local", **kw), out=tmp_path / "l", fed=fed)
    assert got["cross_accuracy"] == loc["cross_accuracy"]

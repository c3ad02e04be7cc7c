"""FedVCK pins: importance weights, related classes, synthetic history, sizing, model defaults."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fedvl.algorithms.fedvck as fedvck
from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.cli.common import config_from_args
from fedvl.config import RunConfig, resolve_model_args
from fedvl.core.message import Message
from fedvl.distill.samplers import ImportanceClassSampler, importance_weights
from fedvl.models.base import has_batch_stats
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from tests.conftest import make_toy_federation

SMALL = {"ipc": 2, "steps": 1, "batch_real": 4, "server_epochs": 1, "server_batch": 16,
         "topk": 2, "dsa": False, "server_dsa": False}
TINY = {"width": 8, "depth": 2}


def _setup(norm: str = "instance", **args):
    fed = make_toy_federation()
    cfg = RunConfig(method="fedvck", batch_size=8, model_args={**TINY, "norm": norm})
    env = build_env(cfg, fed, torch.device("cpu"))
    return fed, make_algorithm("fedvck", env, {**SMALL, **args})


def _client(fed, cid: int, state: Message | None = None, rnd: int = 0) -> ClientContext:
    c = fed.clients[cid]
    return ClientContext(cid=cid, name=c.name, x=c.x_train, y=c.y_train,
                         num_classes=fed.num_classes, state=state or Message(),
                         generator=torch.Generator().manual_seed(cid), round=rnd)


class Fixed(nn.Module):
    """A 'model' whose logits are given."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits[: len(x)]


def test_importance_weights_match_a_hand_computed_example():
    cur = Fixed(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
    prev = Fixed(torch.tensor([[0.0, 2.0], [1.0, 1.0]]))
    y = torch.tensor([0, 1])
    lam, gamma, bias = 0.25, 2.0, 0.5
    w = importance_weights([cur, prev], torch.zeros(2, 1), y, mix=[1 - lam, lam],
                           gamma=gamma, bias=bias)
    # Ensemble logits: 0.75 * cur + 0.25 * prev = [1.5, 0.5] and [0.25, 1.0].
    ce0 = -1.5 + math.log(math.exp(1.5) + math.exp(0.5))
    ce1 = -1.0 + math.log(math.exp(0.25) + math.exp(1.0))
    want = [1 / (1 + math.exp(-gamma * (ce - bias))) for ce in (ce0, ce1)]
    assert w.tolist() == pytest.approx(want, abs=1e-6)


def test_client_ensembles_the_received_model_with_the_one_it_kept(monkeypatch):
    fed, alg = _setup(lam=0.3)
    models, mixes = [], []
    real_logits, real_weights = fedvck.eval_logits, fedvck.weights_from_logits

    def spy_logits(model, x, *a, **kw):
        models.append(model.state_dict()["classifier.weight"].clone())
        return real_logits(model, x, *a, **kw)

    def spy_weights(logits, y, mix=None, **kw):
        mixes.append((len(logits), mix))
        return real_weights(logits, y, mix=mix, **kw)

    monkeypatch.setattr(fedvck, "eval_logits", spy_logits)
    monkeypatch.setattr(fedvck, "weights_from_logits", spy_weights)
    st = alg.server_init()
    first = st["model"]
    client = _client(fed, 0)
    alg.client_update(Message({"weights": first}), client)
    # First round: the received model alone, run once for the weights and the prototypes.
    assert len(models) == 1 and torch.equal(models[0], first["classifier.weight"])
    second = {k: v + 0.1 if k == "classifier.weight" else v for k, v in first.items()}
    alg.client_update(Message({"weights": second}), client)
    assert len(models) == 3
    assert torch.equal(models[1], second["classifier.weight"])   # received
    assert torch.equal(models[2], first["classifier.weight"])    # kept from last round
    assert [n for n, _ in mixes] == [2, 2]
    assert mixes[0][1] == mixes[1][1] == pytest.approx([0.7, 0.3])


def test_sampler_without_replacement_draws_distinct_images():
    y = torch.tensor([0] * 6 + [1] * 3)
    s = ImportanceClassSampler(torch.zeros(9, 1), y, 2, 4, torch.rand(9), replacement=False)
    idx = s.indices(torch.Generator().manual_seed(0))
    assert len(set(idx.tolist())) == len(idx) == 4 + 3


LOGIT_PROTOS = torch.tensor([[0.0, 5.0, 4.0, 1.0],
                             [1.0, 9.0, 2.0, 0.0],
                             [3.0, 2.0, 1.0, 0.5],
                             [0.0, 0.0, 0.0, 7.0]])


def test_related_classes_of_the_code_form_include_the_class_itself():
    rel = fedvck.related_classes(LOGIT_PROTOS, 2, "code")
    for c in range(4):
        assert c in rel[c].tolist()
    assert rel[0].tolist() == [1, 0]   # top-2 is {1, 2}: the last one gives way to the class
    assert rel[2].tolist() == [0, 2]


def test_related_classes_default_to_the_papers_hard_negatives():
    """Eq. 15-16: the top-k classes other than the class itself, even where it scores highest."""
    logits = LOGIT_PROTOS.clone()
    logits[3, :3] = torch.tensor([1.0, 0.5, 2.0])   # no ties
    rel = fedvck.related_classes(logits, 2)
    assert rel.tolist() == [[1, 2], [2, 0], [0, 1], [2, 0]]
    # k is capped at the other classes.
    assert fedvck.related_classes(logits, 9).shape == (4, 3)


def test_relational_supcon_counts_the_class_itself_with_its_hard_negatives():
    """With R(c) excluding c (the paper's set) the positive still sits in the denominator:
    -mean log(sum_{y_j = y_i} s_ij / sum_{y_j in R(y_i) + {y_i}} s_ij)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 6, generator=g)
    y = torch.tensor([0, 1, 1, 2, 3])
    protos = torch.nn.functional.normalize(torch.randn(4, 6, generator=g), dim=1)
    related = torch.tensor([[1, 2], [2, 0], [0, 1], [2, 0]])
    got = fedvck.relational_supcon(h, y, protos, related, 0.5)
    s = torch.exp(torch.nn.functional.normalize(h, dim=1) @ protos[y].T / 0.5)   # s_ij
    want = []
    for i in range(5):
        keep = {int(y[i]), *related[y[i]].tolist()}
        den = sum(s[i, j] for j in range(5) if int(y[j]) in keep)
        want.append(-torch.log(sum(s[i, j] for j in range(5) if y[j] == y[i]) / den))
    assert torch.isfinite(got) and float(got) == pytest.approx(float(torch.stack(want).mean()),
                                                               rel=1e-5)
    # The code's set (the class included) gives the same value when it names the same classes.
    with_self = torch.tensor([[0, 1, 2], [1, 2, 0], [2, 0, 1], [3, 2, 0]])
    assert float(fedvck.relational_supcon(h, y, protos, with_self, 0.5)) == pytest.approx(
        float(got), rel=1e-6)


def test_hard_negatives_are_eq13_top_k_other_classes_by_hand():
    """Eq. 13: HN(c) = the K largest entries of p_c among j != c, even when p_c[c] is largest."""
    g = torch.Generator().manual_seed(3)
    protos = torch.randn(6, 6, generator=g, dtype=torch.float64)
    protos[0, 0] = protos[2, 2] = 10.0               # the class itself scores highest
    for k in (1, 3, 5):
        got = fedvck.related_classes(protos, k)
        for c in range(6):
            others = [j for j in range(6) if j != c]
            others.sort(key=lambda j: -float(protos[c, j]))
            assert set(got[c].tolist()) == set(others[:k]), (k, c)


def test_paper_contrastive_matches_eq15_computed_by_hand():
    """Eq. 15 with plain dot products, the denominator over HN(c_i) only, summed over the
    samples and divided by the batch size (the scale of the batch-mean CE of Eq. 16)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 4, generator=g, dtype=torch.float64)
    f = torch.randn(5, 4, generator=g, dtype=torch.float64)      # unnormalised prototypes
    y = torch.tensor([0, 1, 1, 2, 4, 3])
    hn = torch.tensor([[1, 2], [2, 4], [0, 1], [4, 0], [3, 2]])
    tau = 0.5
    total = 0.0
    for i in range(6):
        def s(c: int, i: int = i) -> float:
            return math.exp(sum(float(h[i, d]) * float(f[c, d]) for d in range(4)) / tau)
        total += -math.log(s(int(y[i])) / sum(s(int(c)) for c in hn[int(y[i])]))
    got = fedvck.hard_negative_contrastive(h, y, f, hn, tau, "dot")
    assert float(got) == pytest.approx(total / 6, abs=1e-6)
    # The cosine reading: the same ratio over L2-normalised features and prototypes.
    total_cos = 0.0
    for i in range(6):
        def sc(c: int, i: int = i) -> float:
            hi, fc = [float(v) for v in h[i]], [float(v) for v in f[c]]
            dot = sum(a * b for a, b in zip(hi, fc, strict=True))
            norm = math.sqrt(sum(a * a for a in hi)) * math.sqrt(sum(b * b for b in fc))
            return math.exp(dot / norm / tau)
        total_cos += -math.log(sc(int(y[i])) / sum(sc(int(c)) for c in hn[int(y[i])]))
    got = fedvck.hard_negative_contrastive(h, y, f, hn, tau)
    assert float(got) == pytest.approx(total_cos / 6, abs=1e-6)
    # A class with no prototype yet (a zero row) leaves its sample out and drops out of the
    # other classes' hard negatives; the gradient stays finite.
    f2 = f.clone()
    f2[4] = 0.0
    total = 0.0
    for i in range(6):
        if int(y[i]) == 4:
            continue
        def s2(c: int, i: int = i) -> float:
            return math.exp(sum(float(h[i, d]) * float(f2[c, d]) for d in range(4)) / tau)
        negs = [int(c) for c in hn[int(y[i])] if int(c) != 4]
        total += -math.log(s2(int(y[i])) / sum(s2(c) for c in negs))
    hg = h.clone().requires_grad_(True)
    got = fedvck.hard_negative_contrastive(hg, y, f2, hn, tau, "dot")
    assert float(got.detach()) == pytest.approx(total / 6, abs=1e-6)
    got.backward()
    assert torch.isfinite(hg.grad).all() and not hg.grad[4].any()


def test_server_keeps_the_related_sets_of_the_chosen_form():
    for args, has_self in (({}, False), ({"contrastive": "code"}, True)):
        fed, alg = _setup(**args)
        state = _rounds(alg, fed, 2)
        own = torch.arange(fed.num_classes)[:, None]
        assert (state["related"] == own).any(1).tolist() == [has_self] * fed.num_classes


def test_ratio_sizing_gives_the_reference_budget_for_owned_classes_only():
    y = torch.tensor([0] * 300 + [1] * 12 + [2] * 9 + [3] * 50)
    assert fedvck.class_budget(y, 5, 10, 0.01) == [5, 5, 0, 5, 0]
    assert fedvck.class_budget(y, 5, 10, 0.2) == [60, 5, 0, 10, 0]
    assert fedvck.class_budget(y, 5, 3, 0.0) == [3, 3, 0, 3, 0]


def test_client_condenses_its_ratio_budget():
    fed, alg = _setup(ratio=0.5)
    client = _client(fed, 1)
    reply = alg.client_update(Message({"weights": alg.server_init()["model"]}), client)
    counts = torch.bincount(client.y, minlength=fed.num_classes).tolist()
    want = [max(5, math.ceil(n * 0.5)) if n >= 10 else 0 for n in counts]
    got = torch.bincount(reply.arrays["synthetic_labels"]["round"],
                         minlength=fed.num_classes).tolist()
    assert got == want
    assert reply.arrays["prototypes"]["counts"].tolist() == [float(n) if n >= 10 else 0.0
                                                            for n in counts]


@pytest.mark.parametrize("norm, active", [("instance", False), ("batch", True)])
def test_latent_constraint_is_reported_inactive_without_batchnorm(norm, active):
    fed, alg = _setup(norm)
    reply = alg.client_update(Message({"weights": alg.server_init()["model"]}), _client(fed, 0))
    assert reply.meta["latent_constraint"] is active
    state = alg.aggregate(alg.server_init(), ServerContext(round=0), {0: reply})
    assert state["log"][-1]["latent_constraint"] is active


def test_synthetic_history_grows_and_is_what_the_server_trains_on(monkeypatch):
    fed, alg = _setup(beta=0.1)
    trained = []
    real = fedvck.FedVCK._train

    def spy(self, state, ctx, x, y, related):
        trained.append((x.clone(), y.clone(), state["protos"] is not None))
        return real(self, state, ctx, x, y, related)

    monkeypatch.setattr(fedvck.FedVCK, "_train", spy)
    state = alg.server_init()
    sizes = []
    for rnd in range(3):
        msgs = alg.configure(state, ServerContext(round=rnd), [0, 1])
        replies = {c: alg.client_update(m, _client(fed, c, rnd=rnd)) for c, m in msgs.items()}
        state = alg.aggregate(state, ServerContext(round=rnd), replies)
        sizes.append(sum(len(r.arrays["synthetic_labels"]["round"]) for r in replies.values()))
        assert len(state["history_x"]) == rnd + 1
        x, y, had_protos = trained[-1]
        assert torch.equal(x, torch.cat(state["history_x"]))
        assert torch.equal(y, torch.cat(state["history_y"]))
        assert had_protos == (rnd > 0)     # SupCon positives exist from the second round on
    assert [len(t[1]) for t in trained] == [sum(sizes[: i + 1]) for i in range(3)]
    assert state["log"][-1]["history"] == sum(sizes)


def _rounds(alg, fed, n: int):
    """Run `n` server rounds with clients 0 and 1; the final state."""
    state = alg.server_init()
    for rnd in range(n):
        msgs = alg.configure(state, ServerContext(round=rnd), [0, 1])
        replies = {c: alg.client_update(m, _client(fed, c, rnd=rnd)) for c, m in msgs.items()}
        state = alg.aggregate(state, ServerContext(round=rnd), replies)
    return state


def test_history_window_keeps_the_last_rounds_only(monkeypatch):
    fed, alg = _setup(history=2)
    trained = []
    real = fedvck.FedVCK._train

    def spy(self, state, ctx, x, y, related):
        trained.append(len(y))
        return real(self, state, ctx, x, y, related)

    monkeypatch.setattr(fedvck.FedVCK, "_train", spy)
    state = _rounds(alg, fed, 4)
    assert len(state["history_x"]) == 2
    per_round = trained[0]                # toy clients send the same budget every round
    assert trained == [per_round, 2 * per_round, 2 * per_round, 2 * per_round]


def _server_epoch_spies(monkeypatch):
    """Record the SupCon weight each batch's loss used, and whether the projector's gradients
    were empty before that batch's backward pass."""
    betas: list[float] = []
    fresh: list[bool] = []
    projectors: list[nn.Module] = []
    make = fedvck.make_projector

    def spy_make(dim, generator):
        projectors.append(make(dim, generator))
        return projectors[-1]

    def spy_supcon(h, y, protos, related, temperature, similarity=None):
        fresh.append(all(p.grad is None for p in projectors[-1].parameters()))
        # d(loss)/d(term) is the weight the server multiplied the term by.
        term = h.sum() * 0 + 1.0
        term.register_hook(lambda g: betas.append(float(g)))
        return term

    monkeypatch.setattr(fedvck, "make_projector", spy_make)
    monkeypatch.setattr(fedvck, "relational_supcon", spy_supcon)
    monkeypatch.setattr(fedvck, "hard_negative_contrastive", spy_supcon)
    return betas, fresh


def test_beta_stays_constant_in_the_papers_form(monkeypatch):
    betas, _ = _server_epoch_spies(monkeypatch)
    fed, alg = _setup(beta=0.5, server_epochs=4, server_batch=1000)   # one batch per epoch
    _rounds(alg, fed, 3)
    # No SupCon in round 0 (no prototypes yet); rounds 1 and 2: every epoch at beta.
    assert betas == pytest.approx([0.5] * 8)


def test_beta_drops_for_the_second_half_of_each_round_and_does_not_compound(monkeypatch):
    betas, _ = _server_epoch_spies(monkeypatch)
    fed, alg = _setup(beta=0.5, server_epochs=4, server_batch=1000, contrastive="code")
    _rounds(alg, fed, 3)
    # No SupCon in round 0 (no prototypes yet); rounds 1 and 2 each: 2 epochs at beta, 2 at beta/10.
    assert betas == pytest.approx([0.5, 0.5, 0.05, 0.05] * 2)


def test_projector_gradients_are_zeroed_before_every_batch(monkeypatch):
    betas, fresh = _server_epoch_spies(monkeypatch)
    fed, alg = _setup(beta=0.5, server_epochs=2, server_batch=4)      # several batches per epoch
    _rounds(alg, fed, 2)
    assert len(fresh) > 2 and all(fresh)


def test_batchnorm_default_applies_to_fedvck_only_and_an_explicit_norm_wins():
    fed = make_toy_federation()
    assert resolve_model_args(RunConfig(method="fedvck")).model_args["norm"] == "batch"
    assert resolve_model_args(RunConfig(method="fedavg")).model_args["norm"] == "instance"
    explicit = RunConfig(method="fedvck", model_args={**TINY, "norm": "instance"})
    assert resolve_model_args(explicit).model_args["norm"] == "instance"
    for method, norm, bn in (("fedvck", None, True), ("fedavg", None, False),
                             ("fedvck", "instance", False)):
        args = {**TINY, **({"norm": norm} if norm else {})}
        env = build_env(RunConfig(method=method, model_args=args), fed, torch.device("cpu"))
        assert has_batch_stats(env.model_fn()) is bn, (method, norm)


def test_cli_norm_flag_overrides_the_method_preference():
    import argparse

    from fedvl.cli.run import register_cli

    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="cmd"))
    for argv, want in ((["run", "--method", "fedvck"], "batch"),
                       (["run", "--method", "fedvck", "--norm", "instance"], "instance")):
        cfg = resolve_model_args(config_from_args(parser.parse_args(argv)))
        assert cfg.model_args["norm"] == want


@pytest.mark.parametrize("args, words", [
    ({"kernel": "laplace"}, ["kernel", "laplace", "linear"]),
    ({"topk": 0}, ["topk", ">= 1"]),
    ({"lam": 1.5}, ["lam", "1.5", "[0, 1]"]),
    ({"ratio": -0.1}, ["ratio", "-0.1", "[0, 1]"]),
    ({"init": "stats"}, ["init", "real"]),
    ({"gamma": 0}, ["gamma", "> 0"]),
    ({"importance_weights": "power"}, ["importance_weights", "linear", "softmax"]),
    ({"latent_stats": "mean"}, ["latent_stats", "batch", "running"]),
    ({"contrastive": "both"}, ["contrastive", "paper", "code"]),
])
def test_options_are_validated_with_clear_errors(args, words):
    fed = make_toy_federation()
    env = build_env(RunConfig(method="fedvck", model_args=TINY), fed, torch.device("cpu"))
    with pytest.raises(ConfigError) as e:
        make_algorithm("fedvck", env, args)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "fedvck" in str(e.value)


# -- the paper's forms and the reference code's (issue #31) ------------------------------------

def test_first_padding_3_gives_the_reference_4x4_map_on_28px_rgb():
    from fedvl.models.base import build_model

    # Padding 1 (default on 3-channel images): 28 -> 14 -> 7 -> 3; padding 3: 28+4 -> 16 -> 8 -> 4.
    for pad, side in ((None, 3), (1, 3), (3, 4)):
        args = {} if pad is None else {"first_padding": pad}
        m = build_model("convnet", 3, 10, 28, seed=0, width=8, depth=3, **args)
        assert m.features[0].padding == (1 if pad is None else pad, 1 if pad is None else pad)
        assert m.feature_dim == 8 * side * side
        assert m.embed(torch.zeros(2, 3, 28, 28)).shape == (2, m.feature_dim)
        assert m(torch.zeros(2, 3, 28, 28)).shape == (2, 10)
    # 1-channel 28 px keeps the DC ConvNet's padding 3 unless told otherwise.
    assert build_model("convnet", 1, 10, 28, width=8).features[0].padding == (3, 3)
    assert build_model("convnet", 1, 10, 28, width=8, first_padding=1).features[0].padding == (1, 1)


@pytest.mark.parametrize("bad", [-1, 9, 1.5, "3", True])
def test_first_padding_is_validated_with_one_clear_error(bad):
    from fedvl.config import validate
    from fedvl.models.base import build_model

    with pytest.raises(ValueError, match=r"first_padding must be an integer in \[0, 8\]"):
        build_model("convnet", 3, 10, 28, width=8, first_padding=bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        with pytest.raises(ConfigError, match=r"first_padding.*\[0, 8\]"):
            validate(RunConfig(model_args={"first_padding": bad}))


def _captured_sampler(monkeypatch, **args):
    """The real-batch sampler and the importance weights one client update builds."""
    fed, alg = _setup(**args)
    seen: dict = {}
    real_weights, real_sampler = fedvck.weights_from_logits, fedvck.ImportanceClassSampler

    def spy_weights(*a, **kw):
        seen["w"] = real_weights(*a, **kw)
        return seen["w"]

    def spy_sampler(x, y, *a, **kw):
        seen["y"] = y
        seen["sampler"] = real_sampler(x, y, *a, **kw)
        return seen["sampler"]

    monkeypatch.setattr(fedvck, "weights_from_logits", spy_weights)
    monkeypatch.setattr(fedvck, "ImportanceClassSampler", spy_sampler)
    alg.client_update(Message({"weights": alg.server_init()["model"]}), _client(fed, 0))
    return seen


def test_importance_sampling_defaults_to_the_papers_linear_weights(monkeypatch):
    """Eq. 8: p_i = w_i / sum of the class's w; softmax(w) (the public code) is an option."""
    for form in ("linear", "softmax"):
        seen = _captured_sampler(monkeypatch, **({} if form == "linear" else
                                                 {"importance_weights": form}))
        s, w, y = seen["sampler"], seen["w"].double(), seen["y"]
        for row, c in zip(s.probs, s.classes.tolist(), strict=True):
            wc = w[y == c]
            want = wc / wc.sum() if form == "linear" else torch.softmax(wc, 0)
            assert torch.allclose(row[y == c], want, atol=1e-12), form
            assert float(row[y != c].abs().sum()) == 0.0


def test_linear_weighting_draws_in_proportion_and_survives_zero_weights():
    y = torch.tensor([0, 0, 0, 1, 1])
    w = torch.tensor([1.0, 3.0, 0.0, 0.0, 0.0])
    s = ImportanceClassSampler(torch.zeros(5, 1), y, 2, 4, w, weighting="linear")
    assert s.probs.tolist() == [[0.25, 0.75, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5, 0.5]]
    # Without replacement a class gives at most its drawable images.
    s = ImportanceClassSampler(torch.zeros(5, 1), y, 2, 4, w, replacement=False,
                               weighting="linear")
    assert sorted(s.indices(torch.Generator().manual_seed(0)).tolist()) == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="weighting"):
        ImportanceClassSampler(torch.zeros(5, 1), y, 2, 4, w, weighting="power")
    # Importance sampling off: every image of a class equally likely, whatever its weight.
    s = ImportanceClassSampler(torch.zeros(5, 1), y, 2, 4, w, weighting="uniform")
    third = 1 / 3
    assert s.probs.tolist() == [[third, third, third, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5, 0.5]]


@pytest.mark.parametrize("server_dsa", [True, False])
def test_server_augments_its_batches_only_when_told(monkeypatch, server_dsa):
    fed, alg = _setup(server_dsa=server_dsa)
    calls = []
    monkeypatch.setattr(fedvck, "augment_batch", lambda x, g, cfg: calls.append(1) or x)
    _rounds(alg, fed, 1)
    # Condensation runs with dsa=False here, so every call is the server's.
    assert bool(calls) == server_dsa


def _bn_model():
    from fedvl.models.base import build_model

    return build_model("convnet", 3, 4, 8, seed=0, width=8, depth=2, norm="batch")


def test_latent_constraint_defaults_to_the_real_batch_statistics():
    """Eq. 4: the synthetic batch is normalised with the current real batch's BN statistics,
    so a synthetic batch equal to the real one embeds exactly as the real one does; the public
    code's running statistics (latent_stats=running) do not."""
    from fedvl.distill.synthesize import embed_real_and_syn

    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 + 1
    m = _bn_model()
    zr, zs, _, _ = embed_real_and_syn(m, x, x, latent_constraint=True)
    assert torch.allclose(zs, zr, atol=1e-5)
    zr, zs, _, _ = embed_real_and_syn(_bn_model(), x, x, latent_constraint=True,
                                      latent_stats="running")
    assert not torch.allclose(zs, zr, atol=1e-2)
    # One synthetic image embeds as inside its batch: fixed statistics, not its own.
    z1 = embed_real_and_syn(m, x, x[:1], latent_constraint=True)[1]
    assert torch.allclose(z1, embed_real_and_syn(m, x, x[:4], latent_constraint=True)[1][:1],
                          atol=1e-5)
    with pytest.raises(ValueError, match="latent_stats"):
        embed_real_and_syn(m, x, x, latent_constraint=True, latent_stats="mean")


def test_latent_batch_statistics_of_a_multiset_are_those_of_the_repeated_batch():
    from fedvl.distill.synthesize import embed_real_and_syn

    g = torch.Generator().manual_seed(1)
    x, syn = torch.randn(5, 3, 8, 8, generator=g), torch.randn(3, 3, 8, 8, generator=g)
    counts = torch.tensor([1, 4, 2, 1, 3])
    a = embed_real_and_syn(_bn_model(), x, syn, latent_constraint=True, real_counts=counts)[1]
    b = embed_real_and_syn(_bn_model(), x.repeat_interleave(counts, 0), syn,
                           latent_constraint=True)[1]
    assert torch.allclose(a, b, atol=1e-5)


def test_client_condenses_with_the_papers_latent_statistics_unless_told(monkeypatch):
    made = []
    real = fedvck.DistributionMatching

    def spy(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(fedvck, "DistributionMatching", spy)
    for args, want in (({}, "batch"), ({"latent_stats": "running"}, "running")):
        fed, alg = _setup("batch", **args)
        alg.client_update(Message({"weights": alg.server_init()["model"]}), _client(fed, 0))
        assert made[-1].latent_constraint and made[-1].latent_stats == want


def test_condensed_set_starts_from_noise_by_default_and_real_images_on_request():
    """The paper starts from N(0, 1) so that no private image goes up; init=real (the public
    code's default) starts from copies of them and says so to the upload guard."""
    for args, copies in (({}, False), ({"init": "real"}, True)):
        fed, alg = _setup(steps=0, **args)
        client = _client(fed, 0)
        x = alg.client_update(Message({"weights": alg.server_init()["model"]}),
                              client).arrays["synthetic_images"]["round"]
        dist = torch.cdist(x.flatten(1), client.x.flatten(1),
                           compute_mode="donot_use_mm_for_euclid_dist").min(1).values
        assert bool((dist < 1e-6).all()) is copies and bool((dist > 1.0).all()) is not copies
        assert (alg.upload_exemption() is not None) is copies

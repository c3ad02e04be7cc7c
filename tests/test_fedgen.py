"""FedGen pins: the generator makes features of the model's size, the server sends the
generator it trained, that training lowers the heads' ensemble loss, the client regulariser
moves the update (and is FedAvg's update at weight 0), and a short run learns."""

from __future__ import annotations

import pytest
import torch

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.algorithms.fedgen import diversity_loss, label_weights, teacher_loss
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from tests.conftest import make_toy_federation, short_default_run

TINY = {"width": 8, "depth": 2, "norm": "instance"}
SMALL = {"server_steps": 5, "server_batch": 16, "hidden_dim": 32, "noise_dim": 8,
         "gen_batch": 8}


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=24, n_test=12)


def _alg(fed, name: str = "fedgen", **args):
    cfg = RunConfig(method=name, batch_size=8, lr=0.05, momentum=0.0, model_args=TINY)
    return make_algorithm(name, build_env(cfg, fed, torch.device("cpu")), args)


def _client(fed, k: int, rnd: int = 1) -> ClientContext:
    c = fed.clients[k]
    return ClientContext(k, c.name, c.x_train, c.y_train, fed.num_classes, Message(),
                         torch.Generator().manual_seed(100 + k), rnd)


def _one_round(alg, fed) -> tuple[dict, dict[int, Message]]:
    """Server state after round 0 (every client trained and replied) and the round-0 replies."""
    state = alg.server_init()
    sent = alg.configure(state, ServerContext(0), [0, 1, 2])
    replies = {k: alg.client_update(sent[k].copy(), _client(fed, k, 0)) for k in range(3)}
    return alg.aggregate(state, ServerContext(0), replies), replies


def test_generator_makes_features_of_the_models_feature_size(fed):
    for embedding in (False, True):
        alg = _alg(fed, **SMALL, embedding=embedding)
        model = alg.new_model()
        y = torch.tensor([0, 3, 1, 1, 2])
        z = torch.randn(5, SMALL["noise_dim"])
        g = alg.new_generator()(z, y)
        assert g.shape == (5, model.feature_dim)
        assert model.head(g).shape == (5, fed.num_classes)


def test_server_sends_the_generator_it_trained(fed):
    alg = _alg(fed, **SMALL)
    first = alg.configure(alg.server_init(), ServerContext(0), [0, 1])
    assert set(first[0].arrays) == {"weights"}          # nothing trained yet: no generator
    init = alg.server_init()["generator"]
    state, replies = _one_round(alg, fed)
    msg = alg.configure(state, ServerContext(1), [0, 2])[2]
    sent = msg.get("generator")
    assert sent.keys() == state["generator"].keys()
    assert all(torch.equal(sent[k], state["generator"][k]) for k in sent)
    assert any(not torch.equal(sent[k], init[k]) for k in sent if sent[k].is_floating_point())
    counts = sum(torch.bincount(fed.clients[k].y_train, minlength=4).float() for k in range(3))
    assert torch.equal(msg.get("statistics")["label_counts"], counts)
    assert torch.equal(replies[1].get("statistics")["label_counts"],
                       torch.bincount(fed.clients[1].y_train, minlength=4).float())


def test_generator_training_lowers_the_ensemble_loss_on_fixed_heads(fed):
    alg = _alg(fed, **{**SMALL, "server_steps": 40})
    g0 = torch.Generator().manual_seed(0)
    heads = []
    for _ in range(3):
        m = alg.new_model()
        m.classifier.weight.data = torch.randn(m.classifier.weight.shape, generator=g0)
        heads.append(m.eval().requires_grad_(False))
    counts = torch.tensor([[5.0, 0, 3, 1], [0, 4, 3, 1], [2, 2, 0, 6]])
    a = label_weights(counts)
    gen = alg.new_generator()
    y, z = torch.arange(4).repeat(8), torch.randn(32, SMALL["noise_dim"], generator=g0)

    def loss() -> float:
        with torch.no_grad():
            return float(teacher_loss(heads, a, gen(z, y), y))

    before = loss()
    opt = torch.optim.Adam(gen.parameters(), lr=3e-3)
    steps = alg.train_generator(gen, opt, heads, counts, torch.Generator().manual_seed(1))
    assert len(steps) == 40 and steps[-1] < steps[0]
    assert loss() < 0.5 * before, (before, loss())


def test_label_weights_and_teacher_and_diversity_by_hand():
    a = label_weights(torch.tensor([[2.0, 0.0, 0.0], [1.0, 3.0, 0.0]]))
    assert torch.allclose(a, torch.tensor([[2 / 3, 1 / 3], [0.0, 1.0], [0.0, 0.0]]))

    class Head(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = w

        def head(self, g):
            return g @ self.w

    h1, h2 = Head(torch.eye(2)), Head(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    g, y = torch.tensor([[2.0, 0.0]]), torch.tensor([0])
    a = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    ce = torch.nn.functional.cross_entropy
    want = 0.25 * ce(g, y) + 0.75 * ce(g.flip(1), y)
    assert torch.isclose(teacher_loss([h1, h2], a, g, y), want)
    mixed = 0.25 * g + 0.75 * g.flip(1)
    assert torch.isclose(teacher_loss([h1, h2], a, g, y, "mean-logits"), ce(mixed, y))
    # Two points: noise distance mean((1-0)^2, (0-2)^2) = 2.5, feature distance 3; the mean
    # over the 2x2 pairs (diagonal 0) halves the product.
    z, f = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[0.0], [3.0]])
    assert torch.isclose(diversity_loss(z, f), torch.exp(torch.tensor(-2.5 * 3 / 2)))


def _update(alg, msg: Message, fed) -> dict:
    return alg.client_update(msg.copy(), _client(fed, 0)).get("weights")


def test_regulariser_off_is_fedavg_and_on_changes_the_update(fed):
    trained, _ = _one_round(_alg(fed, **SMALL), fed)
    msg = _alg(fed, **SMALL).configure(trained, ServerContext(1), [0])[0]
    fedavg = _update(_alg(fed, "fedavg"), msg, fed)
    off = _update(_alg(fed, **SMALL, gen_alpha=0.0, gen_beta=0.0), msg, fed)
    assert all(torch.equal(off[k], fedavg[k]) for k in fedavg)
    for weights in ({"gen_alpha": 1.0, "gen_beta": 0.0}, {"gen_alpha": 0.0, "gen_beta": 1.0}):
        on = _update(_alg(fed, **SMALL, **weights), msg, fed)
        assert max(float((on[k] - fedavg[k]).abs().max()) for k in fedavg) > 1e-4, weights
    # Round 0 has no trained generator: every client runs FedAvg's step.
    first = _alg(fed, **SMALL).configure(_alg(fed, **SMALL).server_init(), ServerContext(0), [0])
    a = _update(_alg(fed, **SMALL), first[0], fed)
    assert all(torch.equal(a[k], _update(_alg(fed, "fedavg"), first[0], fed)[k]) for k in a)


def test_bad_option_is_one_clear_error(fed):
    with pytest.raises(ConfigError, match="labels.*uniform, prior"):
        _alg(fed, labels="zipf")
    with pytest.raises(ConfigError, match="server_batch"):
        _alg(fed, server_batch=1)


def test_short_run_on_the_embedded_default_learns(tmp_path):
    # Seeds 0, 1, 2 give 0.60, 0.53, 0.63 here.
    out = short_default_run("fedgen", tmp_path / "r")
    assert out["mean_accuracy"] > 0.3, out["per_client_accuracy"]   # chance: 0.1
    assert out["bytes_by_kind"]["generator"]["down"] > 0

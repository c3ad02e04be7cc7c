"""FedGAN pins: G and D fit the run's images, the server averages G and D as it averages the
model (checked by hand), a client's classifier update is FedAvg's until synthetic samples
start, the GAN learns the classes of the toy data, a run learns and repeats itself, every
round moves model + G + D both ways, and a huge G or D update is refused by the round's bound."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.algorithms.fedgan import Normalise, train_gan
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.engine.driver import Exchange
from fedvl.engine.inprocess import InProcessTransport
from fedvl.options import ConfigError
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation

TINY = {"width": 8, "depth": 2, "norm": "instance"}
SMALL = {"gan_steps": 3, "gan_batch": 8, "noise_dim": 8, "ngf": 4, "ndf": 4, "syn_batch": 8}
GAN_KINDS = ("generator", "discriminator")


@pytest.fixture(scope="module")
def fed():
    return make_toy_federation(num_clients=3, n_train=48, n_test=24)


def _cfg(rounds: int = 3, **args) -> RunConfig:
    return RunConfig(method="fedgan", method_args={**SMALL, **args}, rounds=rounds,
                     batch_size=8, lr=0.05, momentum=0.0, client_ratio=1.0, model_args=TINY)


def _alg(fed, name: str = "fedgan", **args):
    cfg = RunConfig(method=name, batch_size=8, lr=0.05, momentum=0.0, model_args=TINY)
    return make_algorithm(name, build_env(cfg, fed, torch.device("cpu")),
                          {**SMALL, **args} if name == "fedgan" else args)


def _client(fed, k: int, rnd: int, n: int | None = None) -> ClientContext:
    c = fed.clients[k]
    return ClientContext(k, c.name, c.x_train[:n], c.y_train[:n], fed.num_classes, Message(),
                         torch.Generator().manual_seed(100 + k), rnd)


def test_gan_fits_the_run_images_and_other_sizes_are_one_clear_error(fed):
    g, d = _alg(fed).new_gan(torch.device("cpu"))
    y = torch.tensor([0, 3, 1, 2, 2])
    x = g(torch.randn(5, SMALL["noise_dim"]), y).detach()
    assert x.shape == (5, 3, 8, 8) and 0 <= float(x.min()) and float(x.max()) <= 1
    assert d(x, y).shape == (5,)
    with pytest.raises(ConfigError, match="multiples of 4.*10x10"):
        _alg(make_toy_federation(size=10))
    with pytest.raises(ConfigError, match="syn_batch"):
        _alg(fed, syn_batch=-1)


def test_server_averages_generator_and_discriminator_by_hand(fed):
    """Two clients of 48 and 20 images: G, D and the model become (48 s_0 + 20 s_1) / 68."""
    alg = _alg(fed)
    state = alg.server_init()
    sent = alg.configure(state, ServerContext(0), [0, 1])
    sizes = {0: 48, 1: 20}
    replies = {k: alg.client_update(sent[k].copy(), _client(fed, k, 0, n))
               for k, n in sizes.items()}
    new = alg.aggregate(state, ServerContext(0), replies)
    for kind, key in (("generator", "generator"), ("discriminator", "discriminator"),
                      ("weights", "model")):
        s0, s1 = replies[0].get(kind), replies[1].get(kind)
        # Both clients trained it, to different values.
        assert any(not torch.equal(s0[n], sent[0].get(kind)[n]) for n in s0), kind
        assert any(not torch.equal(s0[n], s1[n]) for n in s0 if s0[n].is_floating_point())
        for n, t in new[key].items():
            if t.is_floating_point():
                torch.testing.assert_close(t, (48 * s0[n] + 20 * s1[n]) / 68, rtol=1e-6,
                                           atol=1e-7)
            else:   # BatchNorm's step counter: the first client's
                assert torch.equal(t, s0[n])


def test_classifier_update_is_fedavgs_until_synthetic_samples_start(fed):
    """Before `syn_start` (or with `syn_batch=0`) the classifier's real batches, steps and
    weights are FedAvg's bit for bit; from then on the synthetic samples move the update."""
    fedavg, fedgan = _alg(fed, "fedavg"), _alg(fed, syn_start=1)
    sent = fedgan.configure(fedgan.server_init(), ServerContext(0), [0])[0]

    def update(alg, rnd: int) -> dict:
        return alg.client_update(sent.copy(), _client(fed, 0, rnd)).get("weights")

    base = {r: update(fedavg, r) for r in (0, 1)}
    assert all(torch.equal(update(fedgan, 0)[n], t) for n, t in base[0].items())
    off = _alg(fed, syn_batch=0)
    assert all(torch.equal(update(off, 1)[n], t) for n, t in base[1].items())
    assert any(not torch.equal(update(fedgan, 1)[n], t) for n, t in base[1].items())


def test_gan_learns_the_class_of_what_it_generates():
    """On toy blobs (one prototype per class), after 150 steps the mean of the images G makes
    for class c lies clearly nearer c's real mean than any other class's, for every class."""
    fed = make_toy_federation(num_clients=1, n_train=96)
    # In G's range: pixels in [0, 1], normalised by (0.5, 0.5) to [-1, 1] (the raw blobs reach
    # +-3, which D would tell from any image G can make).
    x, y = fed.clients[0].x_train.clamp(-1, 1), fed.clients[0].y_train
    alg = _alg(fed, noise_dim=16, ngf=16, ndf=16)
    g, d = alg.new_gan(torch.device("cpu"))
    norm = Normalise(fed.mean, fed.std, torch.device("cpu"))
    train_gan(g, d, norm, x, y, 150, 32, 2e-3, 2e-3, torch.Generator().manual_seed(1))
    means = torch.stack([x[y == c].mean(0) for c in range(4)]).flatten(1)
    labels = torch.arange(4).repeat_interleave(32)
    with torch.no_grad():
        fake = norm(g(torch.randn(len(labels), 16, generator=torch.Generator().manual_seed(2)),
                      labels))
    fake_means = torch.stack([fake[labels == c].mean(0) for c in range(4)]).flatten(1)
    dist = torch.cdist(fake_means, means)
    assert dist.argmin(1).tolist() == [0, 1, 2, 3]
    # Toy seeds 0-7 (GAN draws seed + 1): nearest / second nearest at most 0.72, at seed 0.
    nearest, second = dist.sort(1).values[:, :2].unbind(1)
    assert bool((nearest < 0.85 * second).all()), dist


def test_run_learns_repeats_itself_and_counts_model_generator_and_discriminator(fed, tmp_path):
    a = run_experiment(_cfg(), out=tmp_path / "a", fed=fed)
    b = run_experiment(_cfg(), out=tmp_path / "b", fed=fed)
    assert a["mean_accuracy"] > 0.6, a["per_client_accuracy"]   # chance: 0.25
    assert a["rejected_replies"] == [] and a["skipped_rounds"] == []
    # The same seed: the same numbers and the same server G and D.
    assert a["per_client_accuracy"] == b["per_client_accuracy"]
    assert a["per_client_loss"] == b["per_client_loss"]
    sa, sb = (torch.load(p / "checkpoint.pt", weights_only=True)["server_state"]
              for p in (tmp_path / "a", tmp_path / "b"))
    for kind in GAN_KINDS:
        assert all(torch.equal(t, sb[kind][n]) for n, t in sa[kind].items())
    # Every round, every client: the model, G and D down and up, nothing else.
    alg = _alg(fed)
    g, d = alg.new_gan(torch.device("cpu"))
    size = {kind: sum(t.numel() * t.element_size() for t in m.state_dict().values())
            for kind, m in (("weights", alg.new_model()), ("generator", g),
                            ("discriminator", d))}
    per_run = 3 * len(fed.clients)
    assert a["bytes_by_kind"] == {k: {"down": per_run * s, "up": per_run * s}
                                  for k, s in size.items()}
    assert a["bytes_up"] == per_run * sum(size.values()) == a["bytes_down"]
    # The final generator's samples are saved as an image grid.
    assert (tmp_path / "a" / "fedgan_generated.png").is_file()


@pytest.mark.parametrize("kind", GAN_KINDS)
@pytest.mark.parametrize("attack", ["1e38", "update x1e6"])
def test_a_huge_generator_or_discriminator_update_is_refused(kind, attack, fed, tmp_path,
                                                             monkeypatch):
    """Client c1's reply of round 1 with only its G (or D) tampered: 1e38 everywhere (beyond
    the absolute bound) or its change from the sent state x 1e6 (beyond 100x the next largest of
    the three replies); refused, the run completes with a finite state."""
    original = InProcessTransport.exchange

    def exchange(self, rnd, outgoing, inboxes=None) -> Exchange:
        ex = original(self, rnd, outgoing, inboxes)
        if rnd == 1:
            reply, sent = ex.replies[1], outgoing[1].get(kind)
            states = dict(reply.arrays[kind])
            for n, t in states.items():
                if t.is_floating_point():
                    states[n] = (torch.full_like(t, 1e38) if attack == "1e38"
                                 else sent[n] + 1e6 * (t - sent[n]))
            ex.replies[1] = Message({**reply.arrays, kind: states}, dict(reply.meta))
        return ex

    monkeypatch.setattr(InProcessTransport, "exchange", exchange)
    s = run_experiment(_cfg(rounds=2), out=tmp_path / "r", fed=fed)
    assert [(r["round"], r["client"]) for r in s["rejected_replies"]] == [(1, "c1")]
    reason = s["rejected_replies"][0]["reason"]
    assert reason.startswith(kind) and ("bound" in reason or "median" in reason), reason
    state = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)["server_state"]
    assert all(bool(torch.isfinite(t).all()) for k in GAN_KINDS for t in state[k].values()
               if t.is_floating_point())
    assert all(math.isfinite(v) for v in s["per_client_accuracy"].values())


def test_uneven_clients_run_and_every_reply_passes(tmp_path):
    """Clients of 48, 20 and 9 images (a GAN batch larger than a client's data draws with
    replacement) with robust aggregation: G and D take the median like the model."""
    toy = make_toy_federation(num_clients=3, n_train=48, n_test=12)
    clients = [ClientData(c.name, c.x_train[:n], c.y_train[:n], c.x_test, c.y_test)
               for c, n in zip(toy.clients, (48, 20, 9), strict=True)]
    uneven = FederatedDataset("toy", clients, toy.num_classes, toy.mean, toy.std)
    cfg = dataclasses.replace(_cfg(rounds=2, gan_batch=16), aggregation="median")
    s = run_experiment(cfg, out=tmp_path / "r", fed=uneven)
    assert s["rejected_replies"] == [] and s["rounds"] == 2

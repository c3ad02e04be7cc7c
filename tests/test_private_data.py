"""Private images never leave a client: every message of every method, intercepted.

Each registered method (and every BASE+ADDON composition) runs two rounds on a tiny federation
whose private training images carry a bright stamp. Every message the engine delivers (server to
client, client to server, client to client) is searched for a tensor that equals one of those
images, or holds one as a row, within 1e-3 per pixel.

Methods that by design upload synthetic images *initialised from real ones* are listed in
`REAL_INIT` with the option that does it: they are checked again with noise initialisation, and
a positive control (no matching steps, so the upload is the real images themselves) shows that
the search finds such a leak.

References that are not federated methods and upload the raw data by design are listed in
`RAW_UPLOAD`: for them the test asserts the opposite, that every client's upload *is* found
(and only as the declared `raw_images` kind), so the search keeps its teeth on them too.

Methods that by design upload *averages* of private images (FedMix's means) are listed in
`MEAN_UPLOAD` with the option that sets the group size: the means must travel and still hold no
single image, a group size of one is refused, and a positive control (groups of one image) shows
that the search finds each client's upload.
"""

from __future__ import annotations

import pytest
import torch

from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.engine.driver import Exchange
from fedvl.engine.inprocess import InProcessTransport
from fedvl.experiment import run_experiment
from fedvl.registry import ALGORITHMS
from tests.conftest import make_toy_federation
from tests.test_conformance import RUN_EXTRA, _args

# Methods whose uploads start as real private images (option -> reason); docs/reliability.md
# and the README's "What fedvl guarantees" say the same.
REAL_INIT = {
    "feddm": ("init", "uploads its synthetic set; init=real (default, the paper's) starts it "
                      "from ipc real images per class, then matches for `steps` steps"),
    "fedvck": ("init", "uploads its condensed set; init=real (default, the reference code's) "
                       "starts it from real images, then matches for `steps` steps"),
}
# Not federated methods: references that pool the raw private data by design (reason).
RAW_UPLOAD = {
    "centralised": "the centralised upper reference uploads every client's training data to "
                   "the server once and trains on the union (docs/protocol.md)",
}
# Methods that upload data derived from private images by design, but never one image: averages
# over groups of >= 2 images (option refusing a group of one -> reason). The search must find
# nothing in their messages; a positive control makes the groups single images and must find them.
MEAN_UPLOAD = {
    "fedmix": ("mean_batch", "uploads once the averages of groups of `mean_batch` >= 2 private "
                             "images with their averaged labels (`mean_images`/`mean_labels`), "
                             "which the server pools and sends to the other clients "
                             "(docs/fedmix.md)"),
}
TOL = 1e-3


@pytest.fixture(scope="module")
def fed():
    f = make_toy_federation(num_clients=3, n_train=24, n_test=12)
    for c in f.clients:
        c.x_train[:, :, :2, :2] = 4.0   # a stamp no noise image or statistic looks like
    return f


def _cfg(name: str, **method_args) -> RunConfig:
    return RunConfig(method=name, method_args={**_args(name), **method_args}, rounds=2,
                     batch_size=8, lr=0.05, momentum=0.0, client_ratio=1.0,
                     model_args={"width": 8, "depth": 2, "norm": "instance"},
                     **RUN_EXTRA.get(name, {}))


def _leaks(msg: Message, private: torch.Tensor) -> list[str]:
    """Names of the tensors in `msg` equal to, or holding as a row, one of `private`."""
    d = private[0].numel()
    flat = private.reshape(len(private), d).double()
    out = []
    for kind, tensors in msg.arrays.items():
        for name, t in tensors.items():
            if not t.is_floating_point() or t.numel() < d or t.numel() % d:
                continue
            rows = t.detach().reshape(-1, d).double().cpu()
            if float(torch.cdist(rows, flat, p=float("inf")).min()) <= TOL:
                out.append(f"{kind}/{name}")
    return out


def _intercepted(cfg: RunConfig, fed, tmp_path, monkeypatch) -> list[str]:
    """Run `cfg`; every leak found: 'direction sender->receiver kind/name'."""
    private = {i: c.x_train for i, c in enumerate(fed.clients)}
    everyone = torch.cat(list(private.values()))
    found: list[str] = []
    exchange, share = InProcessTransport.exchange, InProcessTransport.share

    def spy_exchange(self, rnd, outgoing, inboxes=None) -> Exchange:
        for cid, msg in outgoing.items():   # the server holds no private data to leak ...
            found.extend(f"down server->{cid} {n}" for n in _leaks(msg, everyone))
        ex = exchange(self, rnd, outgoing, inboxes)
        for cid, reply in ex.replies.items():
            found.extend(f"up {cid}->server {n}" for n in _leaks(reply, private[cid]))
        return ex

    def spy_share(self, rnd, peers):
        out = share(self, rnd, peers)
        for sender, msgs in out.items():
            for receiver, msg in msgs.items():
                found.extend(f"peer {sender}->{receiver} {n}"
                             for n in _leaks(msg, private[sender]))
        return out

    monkeypatch.setattr(InProcessTransport, "exchange", spy_exchange)
    monkeypatch.setattr(InProcessTransport, "share", spy_share)
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    run_experiment(cfg, out=tmp_path / "run", fed=fed)
    return found


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_no_message_carries_a_private_image(name, fed, tmp_path, monkeypatch):
    args = {}
    if name in REAL_INIT:
        args = {REAL_INIT[name][0]: "noise"}
    found = _intercepted(_cfg(name, **args), fed, tmp_path, monkeypatch)
    if name in RAW_UPLOAD:
        # By design: each client's raw images go up once, as `raw_images`, nothing else leaks.
        assert sorted(found) == [f"up {c}->server raw_images/x"
                                 for c in range(len(fed.clients))], (name, found)
        return
    assert found == [], name


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fednova", "scaffold"])
def test_no_message_carries_a_private_image_under_dp_sgd(name, fed, tmp_path, monkeypatch):
    found = _intercepted(_cfg(name, dp_noise=0.5), fed, tmp_path, monkeypatch)
    assert found == [], name


@pytest.mark.parametrize("name", sorted(REAL_INIT))
def test_real_init_leak_is_found(name, fed, tmp_path, monkeypatch):
    """Positive control: with no matching step the upload *is* the real images."""
    steps = {"feddm": "steps", "fedvck": "steps"}[name]
    found = _intercepted(_cfg(name, **{REAL_INIT[name][0]: "real", steps: 0}), fed, tmp_path,
                         monkeypatch)
    assert found and all(f.startswith("up ") and "synthetic_images/" in f for f in found), found


@pytest.mark.parametrize("name", sorted(MEAN_UPLOAD))
def test_mean_upload_holds_no_private_image(name, fed, tmp_path, monkeypatch):
    """The means travel (up from every client, down to the others), yet none is an image; with
    groups of one image (what the refused option value would do) the search finds them."""
    from fedvl.algorithms import fedmix
    from fedvl.options import ConfigError

    kinds: set[tuple[str, str]] = set()
    exchange = InProcessTransport.exchange

    def record(self, rnd, outgoing, inboxes=None) -> Exchange:
        ex = exchange(self, rnd, outgoing, inboxes)
        kinds.update(("down", k) for m in outgoing.values() for k in m.arrays)
        kinds.update(("up", k) for m in ex.replies.values() for k in m.arrays)
        return ex

    monkeypatch.setattr(InProcessTransport, "exchange", record)
    found = _intercepted(_cfg(name), fed, tmp_path / "means", monkeypatch)
    assert found == [] and {("up", "mean_images"), ("down", "mean_images")} <= kinds, found
    with pytest.raises(ConfigError, match=MEAN_UPLOAD[name][0]):
        _intercepted(_cfg(name, **{MEAN_UPLOAD[name][0]: 1}), fed, tmp_path / "one",
                     monkeypatch)

    def one_per_group(x, y, num_classes, mean_batch, generator=None):
        return x.clone(), torch.nn.functional.one_hot(y, num_classes).to(x.dtype)

    monkeypatch.setattr(fedmix, "group_means", one_per_group)
    leaked = _intercepted(_cfg(name), fed, tmp_path / "control", monkeypatch)
    ups = {f.split()[1] for f in leaked if f.startswith("up ")}
    assert ups == {f"{c}->server" for c in range(len(fed.clients))}, leaked
    assert any(f.startswith("down ") and "mean_images/" in f for f in leaked), leaked


def test_detector_sees_rows_inside_a_batch(fed):
    x = fed.clients[0].x_train
    batch = torch.cat([torch.randn(3, *x.shape[1:]), x[5:6] + 1e-4])
    assert _leaks(Message({"synthetic_images": {"x": batch}}), x) == ["synthetic_images/x"]
    assert _leaks(Message({"synthetic_images": {"x": batch[:3]}}), x) == []

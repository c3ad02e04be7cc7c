"""Private images never leave a client: every message of every method, intercepted and audited.

Each registered method (each add-on on FedAvg, and one other composition) runs two rounds on
a tiny federation whose private training images are distinct from one another (strong
per-image noise: a class mean correlates with no single image). Every message the engine
delivers (server to client, client to server, client to client) is audited as the clients'
upload guard does it
(`fedvl.core.audit`): each image-shaped tensor is compared by |Pearson r| with the sender's
private images (a message from the server, with everyone's). Nothing may go above the guard's
threshold, and the audit each client recorded in `summary.json` must be what left it.

Methods that by design upload synthetic images *initialised from real ones* are listed in
`REAL_INIT` with the option that does it: they are checked again with noise initialisation, and
with real initialisation the audit must flag them (recorded, warned once per client, not
withheld).

References that are not federated methods and upload the raw data by design are listed in
`RAW_UPLOAD`: for them the test asserts the opposite, that every client's upload *is* its data
(|r| = 1, only as the declared `raw_images` kind), so the audit keeps its teeth on them too.

Methods that by design upload *averages* of private images (FedMix's means) are listed in
`MEAN_UPLOAD` with the option that sets the group size: the means must travel and still match
no single image, a group size of one is refused, and groups of one image are withheld by the
guard. The cases where a mean *is* an image (a group holding a duplicate, a group of one image
and a blank one) and FedDM's noise start matched onto one image per class are pinned below.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fedvl.config import RunConfig
from fedvl.core.audit import DEFAULT_GUARD, audit_message
from fedvl.core.message import Message
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.engine.driver import Exchange
from fedvl.engine.inprocess import InProcessTransport
from fedvl.run.experiment import run_experiment
from tests.conftest import (
    COMPOSED,
    METHODS,
    RUN_EXTRA,
    make_toy_federation,
    small_args,
    small_model_args,
)

# Methods whose uploads start as real private images (option -> reason); docs/reliability.md
# and the README's "What fedvl guarantees" say the same.
REAL_INIT = {
    "feddm": ("init", "uploads its synthetic set; init=real (default, the paper's) starts it "
                      "from ipc real images per class, then matches for `steps` steps"),
    "fedvck": ("init", "uploads its condensed set; init=real (the reference code's default; "
                       "fedvl's is the paper's noise) starts it from real images, then matches "
                       "for `steps` steps"),
    "fedlapdp": ("init", "uploads its synthetic set; without DP its init (auto: real, the "
                         "official code's) starts it from ipc real images per class, then "
                         "matches gradients for `steps` steps a segment"),
    "fedaf": ("init", "uploads its condensed set; init=real (the third-party code's; fedvl's "
                      "default is noise) starts it from real images, then condenses it for "
                      "`steps` steps a round"),
}
# Not federated methods: references that pool the raw private data by design (reason).
RAW_UPLOAD = {
    "centralised": "the centralised upper reference uploads every client's training data to "
                   "the server once and trains on the union (docs/protocol.md)",
}
# Methods that upload data derived from private images by design, but never one image: averages
# over groups of >= 2 distinct images (option refusing a group of one -> reason).
MEAN_UPLOAD = {
    "fedmix": ("mean_batch", "uploads once the averages of groups of `mean_batch` >= 2 private "
                             "images with their averaged labels (`mean_images`/`mean_labels`), "
                             "which the server pools and sends to the other clients "
                             "(docs/fedmix.md)"),
}
GUARD = DEFAULT_GUARD


@pytest.fixture(scope="module")
def fed():
    f = make_toy_federation(num_clients=3, n_train=24, n_test=12)
    g = torch.Generator().manual_seed(7)
    for c in f.clients:
        # Per-image noise well above the class signal: a class mean, or any image learnt from
        # many, correlates |r| ~0.5 with each private image, a copy of one exactly 1.
        c.x_train += 1.5 * torch.randn(c.x_train.shape, generator=g)
    return f


def _cfg(name: str, **method_args) -> RunConfig:
    return RunConfig(method=name, method_args={**small_args(name), **method_args}, rounds=2,
                     batch_size=8, lr=0.05, momentum=0.0, client_ratio=1.0,
                     model_args=small_model_args(name),
                     **RUN_EXTRA.get(name, {}))


def _intercepted(cfg: RunConfig, fed: FederatedDataset, tmp_path, monkeypatch
                 ) -> tuple[dict[str, float], dict]:
    """Run `cfg`: the audit of every image-shaped tensor that crossed ('round direction
    sender->receiver kind/name' -> |r|) and the run's summary."""
    private = {i: c.x_train for i, c in enumerate(fed.clients)}
    everyone = torch.cat(list(private.values()))
    shape = tuple(fed.clients[0].x_train.shape[1:])
    found: dict[str, float] = {}
    exchange, share = InProcessTransport.exchange, InProcessTransport.share

    def seen(prefix: str, msg: Message, against: torch.Tensor) -> None:
        found.update({f"{prefix} {k}": v for k, v in audit_message(msg, against, shape).items()})

    def spy_exchange(self, rnd, outgoing, inboxes=None) -> Exchange:
        for cid, msg in outgoing.items():   # the server holds no private data to leak ...
            seen(f"{rnd} down server->{cid}", msg, everyone)
        ex = exchange(self, rnd, outgoing, inboxes)
        for cid, reply in ex.replies.items():
            seen(f"{rnd} up {cid}->server", reply, private[cid])
        return ex

    def spy_share(self, rnd, peers):
        out = share(self, rnd, peers)
        for sender, msgs in out.items():
            for receiver, msg in msgs.items():
                seen(f"{rnd} peer {sender}->{receiver}", msg, private[sender])
        return out

    monkeypatch.setattr(InProcessTransport, "exchange", spy_exchange)
    monkeypatch.setattr(InProcessTransport, "share", spy_share)
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    summary = run_experiment(cfg, out=tmp_path / "run", fed=fed)
    return found, summary


def _recorded(summary: dict) -> dict[tuple[int, str], float]:
    return {(a["round"], a["client"]): a["max_corr"] for a in summary["upload_audit"]}


def _sent_per_client(found: dict[str, float], fed) -> dict[tuple[int, str], float]:
    """The largest audit value of each client's uploads (reply and peer messages) per round."""
    out: dict[tuple[int, str], float] = {}
    for key, v in found.items():
        rnd, direction, pair = key.split()[:3]
        if direction in ("up", "peer"):
            who = (int(rnd), fed.clients[int(pair.split("->")[0])].name)
            out[who] = max(out.get(who, 0.0), v)
    return out


# One BASE+ADDON composition besides: the audit also sees a composed class's messages.
@pytest.mark.parametrize("name", [*METHODS, *COMPOSED[:1]])
@pytest.mark.usefixtures("tmp_cache")  # the one _intercepted points the run at
def test_no_message_carries_a_private_image(name, fed, tmp_path, monkeypatch):
    args = {}
    if name in REAL_INIT:
        args = {REAL_INIT[name][0]: "noise"}
    found, summary = _intercepted(_cfg(name, **args), fed, tmp_path, monkeypatch)
    if name in RAW_UPLOAD:
        # By design: each client's raw images go up once, as `raw_images`; nothing else leaks.
        above = sorted(k for k, v in found.items() if v > GUARD)
        assert above == [f"0 up {c}->server raw_images/x" for c in range(len(fed.clients))]
        assert not any(a["withheld"] for a in summary["upload_audit"])
        return
    assert max(found.values(), default=0.0) <= GUARD, (name, found)
    # Nothing was withheld: the method itself sends no copy, and the audit recorded in the
    # summary is the largest value of what each client sent.
    assert not any(a["withheld"] for a in summary["upload_audit"]), summary["upload_audit"]
    sent = _sent_per_client(found, fed)
    recorded = _recorded(summary)
    assert recorded.keys() == sent.keys(), (recorded, sent)
    assert all(abs(recorded[k] - sent[k]) < 1e-5 for k in sent), (recorded, sent)


def test_no_message_carries_a_private_image_under_dp_sgd(fed, tmp_path, monkeypatch):
    found, summary = _intercepted(_cfg("fedavg", dp_noise=0.5), fed, tmp_path, monkeypatch)
    assert found == {} and summary["upload_audit"] == []   # weights only: nothing image-shaped


@pytest.mark.parametrize("name", sorted(REAL_INIT))
def test_real_init_upload_is_flagged_not_withheld(name, fed, tmp_path, monkeypatch, caplog):
    """With no matching step the upload *is* the real images: the audit records |r| = 1 for
    every client in every round and warns once per client; the documented upload still goes."""
    with caplog.at_level(logging.WARNING, logger="fedvl"):
        found, summary = _intercepted(_cfg(name, **{REAL_INIT[name][0]: "real", "steps": 0}),
                                      fed, tmp_path, monkeypatch)
    ups = {k: v for k, v in found.items() if " up " in f" {k} "}
    assert ups and all(v > 0.9999 and "synthetic_images/" in k for k, v in ups.items()), ups
    audit = summary["upload_audit"]
    assert len(audit) == 2 * len(fed.clients)
    assert all(a["max_corr"] > 0.9999 and not a["withheld"] for a in audit), audit
    warned = [r.getMessage() for r in caplog.records if "not withheld" in r.getMessage()]
    assert len(warned) == len(fed.clients), warned   # once per client, not once per round


def test_guard_withholds_a_copy_and_the_run_goes_on(fed, tmp_path, monkeypatch):
    """Positive control of the guard: FedDM's noise start replaced by the real images (what
    `init=noise` promises never to send) is withheld from every reply; each round is skipped
    (no set reached the server) and the run completes."""
    from fedvl.algorithms import feddm
    from fedvl.distill.client_sets import init_set

    def real_start(init, per_class, x, y, k, generator):
        return init_set("real", per_class, x, y, k, generator)

    monkeypatch.setattr(feddm, "init_set", real_start)
    found, summary = _intercepted(_cfg("feddm", init="noise", steps=0), fed, tmp_path,
                                  monkeypatch)
    assert not any(" up " in f" {k} " for k in found), found   # no image went up
    assert all(a["withheld"] and a["max_corr"] > 0.9999 for a in summary["upload_audit"])
    assert len(summary["upload_audit"]) == 2 * len(fed.clients)
    assert summary["skipped_rounds"] == [0, 1] and summary["rejected_replies"] == []


@pytest.mark.parametrize("name", sorted(MEAN_UPLOAD))
def test_mean_upload_matches_no_private_image(name, fed, tmp_path, monkeypatch):
    """The means travel (up from every client, down to the others), yet none is an image; with
    groups of one image (what the refused option value would do) the guard withholds them."""
    from fedvl.algorithms import fedmix
    from fedvl.options import ConfigError

    found, summary = _intercepted(_cfg(name, mean_batch=4), fed, tmp_path / "means",
                                  monkeypatch)
    kinds = {(k.split()[1], k.split()[3].split("/")[0]) for k in found}
    assert {("up", "mean_images"), ("down", "mean_images")} <= kinds, found
    assert max(found.values()) <= GUARD and summary["upload_audit"], found
    with pytest.raises(ConfigError, match=MEAN_UPLOAD[name][0]):
        _intercepted(_cfg(name, **{MEAN_UPLOAD[name][0]: 1}), fed, tmp_path / "one",
                     monkeypatch)

    def one_per_group(x, y, num_classes, mean_batch, generator=None):
        return x.clone(), torch.nn.functional.one_hot(y, num_classes).to(x.dtype)

    monkeypatch.setattr(fedmix, "group_means", one_per_group)
    found, summary = _intercepted(_cfg(name), fed, tmp_path / "control", monkeypatch)
    assert found == {}, found   # neither up nor, so, down
    first = [a for a in summary["upload_audit"] if a["round"] == 0]
    assert len(first) == len(fed.clients) and all(a["withheld"] for a in first), first
    # The weights still went: every client took part in both rounds.
    assert summary["per_client_accuracy"] and summary["skipped_rounds"] == []


# -- the cases --------------------------------------------------------------------------
def _one_client(x: torch.Tensor, y: torch.Tensor) -> FederatedDataset:
    return FederatedDataset("one", [ClientData("c0", x, y, x.clone(), y.clone())],
                            int(y.max()) + 1, (0.5,) * 3, (0.5,) * 3)


def test_fedmix_group_with_a_duplicate_sends_no_mean(tmp_path, monkeypatch):
    """mean_batch=2 and a group holding the same image twice: its "mean" would be that image.
    The duplicate counts once, the group is refused, nothing is uploaded and it is recorded."""
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0)).repeat(2, 1, 1, 1)
    found, summary = _intercepted(_cfg("fedmix", mean_batch=2), _one_client(
        x, torch.tensor([0, 1])), tmp_path, monkeypatch)
    assert found == {} and summary["upload_audit"] == []
    assert summary["fedmix_refused_groups"] == {"c0": 1} and summary["fedmix_pool_means"] == 0


def test_fedmix_mean_with_a_blank_image_is_withheld(tmp_path, monkeypatch):
    """Default grouping (one mean of all images) on a client holding one image and a blank one:
    the mean is a scaled copy of the image (|r| = 1); the guard withholds it, the weights go."""
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0
    found, summary = _intercepted(_cfg("fedmix"), _one_client(x, torch.tensor([0, 1])),
                                  tmp_path, monkeypatch)
    assert found == {}, found
    (first,) = [a for a in summary["upload_audit"] if a["round"] == 0]
    assert first["withheld"] and first["max_corr"] > 0.9999 and first["tensor"] == "mean_images/x"
    assert summary["fedmix_pool_means"] == 0 and summary["skipped_rounds"] == []


def test_feddm_noise_start_on_one_image_per_class_is_audited(tmp_path, monkeypatch):
    """FedDM init=noise, ipc=1, on a client with one image per class: matching one image's
    embedding pulls the noise toward that image. The audit records how close it got; where it
    passes the guard the set is withheld (docs/reliability.md has the figures at 100, 400 and
    1,500 steps on digits-offline)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, 8, generator=g)
    args = {"init": "noise", "ipc": 1, "min_class_count": 1, "batch_real": 1,
            "server_epochs": 1}
    fed = _one_client(x, torch.arange(4))
    found, summary = _intercepted(_cfg("feddm", steps=100, **args), fed, tmp_path / "a",
                                  monkeypatch)
    (a0, a1) = summary["upload_audit"]
    assert 0 < a0["max_corr"] <= 1 and a0["tensor"] == "synthetic_images/x"
    assert all(v <= GUARD for v in found.values())
    assert all(a["withheld"] == (a["max_corr"] > GUARD) for a in (a0, a1))
    # A guard below what the set reached withholds it.
    low = round(min(a0["max_corr"], a1["max_corr"]) / 2, 3)
    cfg = _cfg("feddm", steps=100, **args)
    cfg.upload_guard = low
    found, summary = _intercepted(cfg, fed, tmp_path / "b", monkeypatch)
    assert found == {} and all(a["withheld"] for a in summary["upload_audit"])

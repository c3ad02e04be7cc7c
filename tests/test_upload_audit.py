"""The upload audit and guard (`fedvl.core.audit`): what counts as an image, the correlation, what
the guard withholds, what reaches summary.json and `fedvl report`, and that the Flower client
and the in-process peer step screen the same way."""

from __future__ import annotations

import logging

import pytest
import torch

from fedvl.config import ConfigError, RunConfig, from_dict, validate
from fedvl.core import audit as audit_mod
from fedvl.core.audit import (
    CORR,
    TENSOR,
    WITHHELD,
    Audit,
    UploadGuard,
    audit_message,
    image_rows,
    max_correlation,
    round_audit,
    summary_audit,
    withheld_everything,
)
from fedvl.core.message import Message
from fedvl.data.federated import ClientData
from fedvl.run.experiment import run_experiment
from tests.conftest import make_toy_federation

SHAPE = (3, 4, 4)


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


# -- what is an image, and how close -------------------------------------------------------------
def test_image_shaped_means_trailing_image_axes_or_rows_of_its_size():
    x = _images(5)
    assert image_rows(x, SHAPE).shape == (5, 48)
    assert image_rows(x[0], SHAPE).shape == (1, 48)                 # one image
    assert image_rows(x.reshape(5, 48), SHAPE).shape == (5, 48)     # flattened rows
    assert image_rows(x.reshape(1, 5, 48), SHAPE).shape == (5, 48)
    assert image_rows(torch.randn(5, 47), SHAPE) is None            # another size
    assert image_rows(torch.ones(5, 48, dtype=torch.int64), SHAPE) is None   # labels, counts
    assert image_rows(x.reshape(5, 48).to_sparse(), SHAPE) is None
    assert image_rows(torch.empty(0, *SHAPE), SHAPE) is None


def test_correlation_sees_copies_however_transformed_and_nothing_in_blanks():
    x = _images(6)
    flat = x.reshape(6, -1)
    copies = torch.stack([flat[2], -flat[3], 3 * flat[4] + 2, flat[1] / 2])
    assert torch.allclose(max_correlation(copies, x), torch.ones(4), atol=1e-6)
    assert float(max_correlation(torch.zeros(1, 48), x)) == 0.0     # a blank image: nothing
    assert float(max_correlation(torch.full((1, 48), 7.0), x)) == 0.0
    other = _images(20, seed=1).reshape(20, -1)
    assert float(max_correlation(other, x).max()) < 0.7              # unrelated noise
    # NaN in an upload scores as the rest of it does, never NaN.
    bad = flat[:1].clone()
    bad[0, 0] = float("nan")
    assert 0.9 < float(max_correlation(bad, x)) <= 1.0


def test_chunked_correlation_equals_one_block(monkeypatch):
    x, rows = _images(11), _images(7, seed=2).reshape(7, -1)
    whole = max_correlation(rows, x)
    monkeypatch.setattr(audit_mod, "ROW_CHUNK", 2)
    monkeypatch.setattr(audit_mod, "PRIVATE_CHUNK", 3)
    assert torch.allclose(max_correlation(rows, x), whole, atol=1e-6)


def test_parameters_are_not_audited_and_raw_images_score_one():
    x = _images(4)
    msg = Message({"weights": {"w": x[0].clone()}, "raw_images": {"x": _images(2, seed=3)},
                   "logits": {"z": torch.randn(4, 10)}})
    assert audit_message(msg, x, SHAPE) == {"raw_images/x": 1.0}


# -- the guard -----------------------------------------------------------------------------------
def test_guard_withholds_the_kind_and_its_labels_and_keeps_the_rest(caplog):
    x = _images(4)
    msg = Message({"synthetic_images": {"x": torch.cat([_images(2, seed=5), x[1:2]])},
                   "synthetic_labels": {"y": torch.tensor([0, 1, 2])},
                   "weights": {"w": torch.zeros(3)}}, {"num_examples": 4})
    with caplog.at_level(logging.WARNING, logger="fedvl"):
        sent, a = UploadGuard(SHAPE).screen(msg, x, "c0")
    assert sorted(sent.arrays) == ["weights"] and sent.meta == {"num_examples": 4}
    assert a.max_corr > 0.9999 and a.tensor == "synthetic_images/x"
    assert a.withheld == ["synthetic_images", "synthetic_labels"]
    assert "c0" in caplog.text and "withheld" in caplog.text
    assert sorted(msg.arrays) == ["synthetic_images", "synthetic_labels", "weights"]  # untouched
    # Threshold 1 audits only; below the threshold nothing is withheld either.
    assert sorted(UploadGuard(SHAPE, 1.0).screen(msg, x, "c0")[0].arrays) == sorted(msg.arrays)
    low = Message({"mean_images": {"x": x.mean(0, keepdim=True)}})
    sent, a = UploadGuard(SHAPE).screen(low, x, "c0")
    assert sent is low and a.withheld == [] and 0 < a.max_corr < 0.9
    # Nothing image-shaped: no audit at all.
    assert UploadGuard(SHAPE).screen(Message({"weights": {"w": x[0]}}), x, "c0")[1] is None


def test_exempt_uploads_are_sent_and_warned_about_once_per_client(caplog):
    x = _images(4)
    msg = Message({"synthetic_images": {"x": x[:2].clone()}})
    guard = UploadGuard(SHAPE, exemption="init=real by design")
    with caplog.at_level(logging.WARNING, logger="fedvl"):
        for _ in range(3):
            for client in ("c0", "c1"):
                sent, a = guard.screen(msg, x, client)
                assert sent is msg and a.withheld == [] and a.max_corr > 0.9999
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("init=real by design" in w for w in warned), warned


def test_round_and_summary_records_take_only_well_formed_audits():
    good = Message({}, Audit(0.5, "mean_images/x", ["mean_images"]).meta())
    replies = {0: good, 1: Message({}, {CORR: 1.5}), 2: Message({}, {CORR: True}),
               3: None, 4: Message({}, {"num_examples": 3}), 5: Message({}, {CORR: 0.25})}
    got = round_audit(replies, lambda c: f"c{c}")
    assert got == {"c0": {"max_corr": 0.5, "tensor": "mean_images/x", "withheld": True},
                   "c5": {"max_corr": 0.25, "tensor": "", "withheld": False}}
    history = [{"round": 0, "upload_audit": got}, {"round": 1}]
    assert [(a["round"], a["client"]) for a in summary_audit(history)] == [(0, "c0"), (0, "c5")]
    assert withheld_everything(Message({}, {WITHHELD: True, TENSOR: "x"}))
    assert not withheld_everything(Message({"weights": {"w": torch.zeros(1)}}, {WITHHELD: True}))
    assert not withheld_everything(None)


def test_merge_keeps_the_largest_value_and_every_withheld_kind():
    a = Audit(0.3, "synthetic_images/anchors", ["synthetic_images"]).merge(
        Audit(0.8, "mean_images/x", []))
    assert (a.max_corr, a.tensor, a.withheld) == (0.8, "mean_images/x", ["synthetic_images"])
    assert Audit(0.1, "t").merge(None).max_corr == 0.1


@pytest.mark.parametrize("value", [0, -0.5, 1.5, float("nan"), "off"])
def test_guard_option_outside_its_range_is_one_clear_error(value):
    with pytest.raises(ConfigError) as e:
        validate(from_dict({"upload_guard": value}))
    text = str(e.value)
    assert "upload_guard" in text and "\n" not in text and len(text) < 300, text
    assert validate(from_dict({"upload_guard": 1})).upload_guard == 1


# -- through the engines -------------------------------------------------------------------------
def test_peer_anchors_are_screened_before_they_leave(tmp_path, monkeypatch):
    """DESA's anchors made real images (what its noise start promises never to send): the peer
    messages go without them, the audit reaches each client's reply and the summary."""
    from fedvl.algorithms import desa
    from fedvl.distill.synthetic import SyntheticSet
    from fedvl.engine.inprocess import InProcessTransport

    def real_anchors(x, y, num_classes, random_model, spec, seed, cid):
        return SyntheticSet(x[:4].clone(), y[:4].clone(), num_classes)

    monkeypatch.setattr(desa, "client_virtual_set", real_anchors)
    peer_kinds: set[str] = set()
    share = InProcessTransport.share

    def spy(self, rnd, peers):
        out = share(self, rnd, peers)
        peer_kinds.update(k for msgs in out.values() for m in msgs.values() for k in m.arrays)
        return out

    monkeypatch.setattr(InProcessTransport, "share", spy)
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    fed = make_toy_federation(num_clients=2, n_train=12, n_test=8)
    cfg = RunConfig(method="desa", rounds=2, batch_size=8, lr=0.05, momentum=0.0,
                    method_args={"ipc": 1, "anchor_steps": 0, "dsa": False, "batch_real": 4},
                    model_args={"width": 8, "depth": 2, "norm": "instance"})
    out = run_experiment(cfg, out=tmp_path / "run", fed=fed)
    assert "synthetic_images" not in peer_kinds
    first = [a for a in out["upload_audit"] if a["round"] == 0]
    assert len(first) == 2 and all(a["withheld"] and a["max_corr"] > 0.9999 for a in first)
    assert all(a["tensor"] == "synthetic_images/anchors" for a in first)


def test_flower_client_screens_with_the_same_guard(tmp_path):
    """The Flower ClientApp's `screened` (its train and share handlers call it) withholds as the
    in-process engine does, warns once per exempt client, and a share step's audit reaches the
    round's reply through the node's state."""
    pytest.importorskip("flwr")
    from flwr.app import RecordDict

    from fedvl.flower import client_app
    from fedvl.flower.node import NodeRun

    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    data = ClientData("c0", x, torch.arange(6) % 3, x[:2].clone(), torch.arange(2))
    cfg = RunConfig(method="feddm", method_args={"init": "noise"},
                    model_args={"width": 8, "depth": 1, "norm": "instance"})
    node = NodeRun(cfg, 0, data, 3, {}, 1, torch.device("cpu"))
    alg = node.ensure_algorithm(["c0"])
    msg = Message({"synthetic_images": {"x": x[:3].clone()},
                   "synthetic_labels": {"y": torch.arange(3)}}, {"num_examples": 6})
    sent, a = client_app.screened(node, alg, "key-noise", msg)
    assert sent.arrays == {} and a.withheld == ["synthetic_images", "synthetic_labels"]
    assert withheld_everything(client_app.with_audit(sent, a))

    class Ctx:   # the part of flwr's Context the handlers use
        state = RecordDict()

    ctx = Ctx()
    from flwr.app import ConfigRecord

    ctx.state[f"{client_app._SHARED_AUDIT}.k"] = ConfigRecord(
        {"round": 3, **Audit(0.95, "synthetic_images/anchors", ["synthetic_images"]).meta(),
         "kinds": ["synthetic_images"]})
    assert client_app._shared_audit(ctx, "k", 2) is None   # another round's: dropped
    assert client_app._shared_audit(ctx, "k", 3) is None   # consumed once
    ctx.state[f"{client_app._SHARED_AUDIT}.k"] = ConfigRecord(
        {"round": 3, **Audit(0.95, "synthetic_images/anchors", ["synthetic_images"]).meta(),
         "kinds": ["synthetic_images"]})
    got = client_app._shared_audit(ctx, "k", 3)
    assert got is not None and (got.max_corr, got.withheld) == (0.95, ["synthetic_images"])


def test_report_shows_the_upload_audit(tmp_path, monkeypatch):
    """`fedvl report` of a run whose FedMix mean was withheld (one image and a blank one) has
    the audit table, with the tensor and the withheld round, and its figure."""
    from fedvl.data.federated import FederatedDataset
    from fedvl.eval.html_report import write_report

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0
    y = torch.tensor([0, 1])
    fed = FederatedDataset("one", [ClientData("c0", x, y, x.clone(), y.clone())], 2,
                           (0.5,) * 3, (0.5,) * 3)
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = RunConfig(method="fedmix", rounds=1, batch_size=2, lr=0.05, momentum=0.0,
                    model_args={"width": 8, "depth": 1, "norm": "instance"})
    run_experiment(cfg, out=tmp_path / "run", fed=fed)
    html = write_report(tmp_path / "run").read_text()
    assert 'id="upload-audit"' in html and "mean_images/x" in html
    assert "upload guard 0.9" in html and 'id="fig-upload_audit"' in html

"""FedLGD pins: the gradient-matching target, the iterative-DM extractor, SupCon's schedule."""

from __future__ import annotations

import pytest
import torch

import fedvl.algorithms.fedlgd as fedlgd
from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.core.params import clone_state
from fedvl.data.federated import class_channel_stats
from fedvl.run.assemble import build_env
from tests.conftest import make_toy_federation

SMALL = {"ipc": 2, "server_ipc": 2, "warmup_steps": 1, "local_dm_steps": 1,
         "server_gm_steps": 1, "refresh_period": 2, "refresh_count": 2, "batch_real": 4,
         "dsa": False}
LR = 0.05


@pytest.fixture
def setup():
    fed = make_toy_federation()
    cfg = RunConfig(method="fedlgd", batch_size=8, lr=LR, momentum=0.0,
                    model_args={"width": 8, "depth": 2, "norm": "instance"})
    env = build_env(cfg, fed, torch.device("cpu"))
    return fed, make_algorithm("fedlgd", env, SMALL)


def _client(fed, alg, cid: int, state: Message | None = None) -> ClientContext:
    c = fed.clients[cid]
    return ClientContext(cid=cid, name=c.name, x=c.x_train, y=c.y_train,
                         num_classes=fed.num_classes, state=state or Message(),
                         generator=torch.Generator().manual_seed(cid), round=0)


def test_gradient_matching_target_is_pseudo_gradient_on_the_pre_aggregation_model(
        setup, monkeypatch):
    fed, alg = setup
    seen = {}

    class Spy(fedlgd.TargetGradientMatching):
        def __post_init__(self) -> None:
            seen["weights"] = clone_state(self.model.state_dict())
            seen["targets"] = {k: v.clone() for k, v in self.targets.items()}
            super().__post_init__()

    monkeypatch.setattr(fedlgd, "TargetGradientMatching", Spy)
    state = alg.server_init()
    w_old = clone_state(state["model"])
    replies = {}
    for cid, shift in ((0, 0.1), (1, 0.3)):
        c = fed.clients[cid]
        mean, std, n = class_channel_stats(c.x_train, c.y_train, fed.num_classes)
        w = {k: (v + shift) if v.is_floating_point() else v.clone() for k, v in w_old.items()}
        replies[cid] = Message({"weights": w, "statistics": {"mean": mean, "std": std,
                                                             "count": n.float()}},
                               {"num_examples": 10})
    assert alg.global_refresh(0)
    alg.aggregate(state, ServerContext(0), replies)
    # Matched on the model clients started from (w_old), not on the freshly averaged one.
    for k, v in seen["weights"].items():
        assert torch.equal(v, w_old[k]), k
    # The target is (w_old - w_new) / lr: clients moved +0.2 on average, so the target
    # gradient is -0.2 / lr (the direction SGD would have stepped against).
    names = {n for n, _ in alg.new_model().named_parameters()}
    assert set(seen["targets"]) == names
    for t in seen["targets"].values():
        torch.testing.assert_close(t, torch.full_like(t, -0.2 / LR), rtol=1e-4, atol=1e-4)


def test_iterative_dm_uses_the_received_global_model(setup, monkeypatch):
    fed, alg = setup
    seen = []

    class Spy(fedlgd.FixedModelSampler):
        def __init__(self, model, *a, **kw) -> None:
            seen.append(clone_state(model.state_dict()))
            super().__init__(model, *a, **kw)

    monkeypatch.setattr(fedlgd, "FixedModelSampler", Spy)
    glob = alg.new_model()
    with torch.no_grad():
        for p in glob.parameters():
            p.add_(0.5)  # a global model unlike any fresh initialisation
    w = clone_state(glob.state_dict())
    msg = Message({"weights": w}, {"round": 2, "local_refresh": True, "regularize": False,
                                   "need_stats": False, "class_grad": False, "version": 0})
    alg.client_update(msg, _client(fed, alg, 0))
    assert len(seen) == 1
    for k, v in seen[0].items():
        assert torch.equal(v, w[k]), k
    # Outside local-refresh rounds the local set is not re-distilled.
    alg.client_update(Message({"weights": w}, {**msg.meta, "local_refresh": False}),
                      _client(fed, alg, 0))
    assert len(seen) == 1


def test_no_supcon_in_refresh_rounds(setup, monkeypatch):
    fed, alg = setup
    made = []

    class Spy(fedlgd.GlobalSupConTerm):
        def __init__(self, *a, **kw) -> None:
            made.append(1)
            super().__init__(*a, **kw)

    monkeypatch.setattr(fedlgd, "GlobalSupConTerm", Spy)
    state = alg.server_init()
    for rnd in range(8):
        meta = alg.configure(state, ServerContext(rnd), [0])[0].meta
        refresh = alg.local_refresh(rnd) or alg.global_refresh(rnd)
        assert meta["regularize"] is (not refresh), rnd
    # A client holding the global set trains with SupCon only when told to regularise.
    gx, gy = torch.randn(8, 3, 8, 8), torch.arange(8) % 4
    st = Message({"synthetic_images": {"global": gx}, "synthetic_labels": {"global": gy}})
    w = state["model"]
    base = {"round": 1, "local_refresh": False, "need_stats": False, "class_grad": False,
            "version": 1}
    alg.client_update(Message({"weights": w}, {**base, "regularize": False}),
                      _client(fed, alg, 1, st))
    assert made == []
    alg.client_update(Message({"weights": w}, {**base, "regularize": True}),
                      _client(fed, alg, 1, st))
    assert made == [1]

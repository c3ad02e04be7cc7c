"""Stacked (vmapped) synthesis of several clients matches `synthesize` client by client.

Tolerance: after 3 image-SGD steps with momentum and weight decay, every image within 2e-6
absolute and every loss within 1e-5 relative of the per-client loop in float32; in float64
within 1e-12 absolute and 1e-12 relative (what is left is the rounding of regrouped sums: vmap
runs the clients' convolutions as one grouped convolution, the class sums are matrix products).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.algorithms.feddm import FedDM
from fedvl.core.message import Message
from fedvl.distill.augment import DSAConfig
from fedvl.distill.samplers import RandomModelSampler, RhoBallSampler, UniformClassSampler
from fedvl.distill.stacked_synthesis import stacked_synthesize
from fedvl.distill.synthesize import DistributionMatching, synthesize
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models import build_model
from fedvl.perf.synthesis import FlopCount
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from tests.conftest import cpu_as_device, make_toy_federation, small_cfg

K = 4
# (real images, classes present, synthetic images per class): sizes and budgets all differ.
CLIENTS = [(20, [0, 1, 2, 3], [2, 1, 1, 3]), (9, [0, 1], [1, 2, 0, 0]),
           (30, [1, 2, 3], [0, 3, 2, 1])]
TOL = {torch.float32: (2e-6, 1e-5), torch.float64: (1e-12, 1e-12)}


def _client(c: int, dtype: torch.dtype, matching: str, sampler: str, **dm: object
            ) -> tuple[SyntheticSet, DistributionMatching, torch.Generator]:
    n, classes, ipc = CLIENTS[c]
    g = torch.Generator().manual_seed(c)
    y = torch.tensor(classes, device="cpu")[torch.arange(n, device="cpu") % len(classes)]
    x = torch.randn(n, 3, 8, 8, generator=g, dtype=dtype, device="cpu") + y.view(-1, 1, 1, 1)
    syn = SyntheticSet.noise(ipc, K, (3, 8, 8), g)
    syn.images = syn.images.detach().to(dtype).requires_grad_()

    def net(seed: int) -> torch.nn.Module:
        return build_model("convnet", 3, K, 8, width=4, depth=2, seed=seed).to(dtype)
    # Each client its own centre of the rho-ball, so a mix-up of clients would show.
    extractor = (RhoBallSampler(net(c), 2.0, sphere=True) if sampler == "rho"
                 else RandomModelSampler(net))
    objective = DistributionMatching(UniformClassSampler(x, y, K, 3), extractor, K,
                                     matching=matching, **{"dsa": None, **dm})
    return syn, objective, torch.Generator().manual_seed(100 + c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("matching,sampler", [("embed_logit", "rho"), ("dm", "rho"),
                                              ("dm", "random")])
def test_stacked_synthesis_equals_synthesize_per_client(dtype, matching, sampler):
    opts = {"lr_img": 0.5, "momentum": 0.5, "weight_decay": 1e-3}
    ref = []
    for c in range(3):
        syn, objective, g = _client(c, dtype, matching, sampler)
        ref.append(synthesize(syn, objective, 3, g, **opts))
    made = [_client(c, dtype, matching, sampler) for c in range(3)]
    # float64 also runs the forwards in ragged chunks of 5 images per client.
    got = stacked_synthesize(*[list(t) for t in zip(*made, strict=True)][:2], 3,
                             [m[2] for m in made], **opts,
                             chunk=5 if dtype is torch.float64 else None)
    atol, rtol = TOL[dtype]
    for c, (r, s) in enumerate(zip(ref, got, strict=True)):
        assert s.syn is made[c][0] and s.steps == 3
        assert s.syn.images.shape == r.syn.images.shape
        assert torch.allclose(s.syn.images, r.syn.images, atol=atol, rtol=0), c
        assert s.loss_curve == pytest.approx(r.loss_curve, rel=rtol)
        # The generators advanced exactly as in the per-client loop.
        assert torch.equal(made[c][2].get_state(), _advanced(c, dtype, matching, sampler))
        assert not torch.equal(s.syn.images, _client(c, dtype, matching, sampler)[0].images)


def _advanced(c: int, dtype: torch.dtype, matching: str, sampler: str) -> torch.Tensor:
    syn, obj, g = _client(c, dtype, matching, sampler)
    synthesize(syn, obj, 3, g)
    return g.get_state()


def test_a_stacked_step_is_on_device_and_never_waits():
    made = [_client(c, torch.float32, "embed_logit", "rho") for c in range(3)]
    args = [list(t) for t in zip(*made, strict=True)]
    with cpu_as_device():   # a tensor made without its device fails here
        stacked_synthesize(args[0], args[1], 1, args[2])
    tracked = [t for s, o, _ in made for t in (s.images, s.labels, o.real.x, o.real.y,
                                                *o.extractor.base.parameters())]
    counts = []
    for steps in (1, 3):
        with FlopCount(tracked) as count:
            stacked_synthesize(args[0], args[1], steps, args[2])
        counts.append(count.syncs)
    # The losses are read once, at the end: no step adds a read of the device.
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("change,why", [({"dsa": DSAConfig()}, "DSA"),
                                        ({"matching": "kernel"}, "matching 'kernel'"),
                                        ({"latent_constraint": True}, "latent constraint")])
def test_refused_objectives_name_what_is_allowed(change, why):
    made = [_client(c, torch.float32, "dm", "rho") for c in range(2)]
    bad = dataclasses.replace(made[1][1], **change)
    with pytest.raises(ValueError, match=f"{why}.*allowed: DistributionMatching with matching "
                                         "'dm' or 'embed_logit', dsa=None"):
        stacked_synthesize([m[0] for m in made], [made[0][1], bad], 1, [m[2] for m in made])
    norm = build_model("convnet", 3, K, 8, width=4, depth=1, norm="batch")
    bn = dataclasses.replace(made[1][1], extractor=RhoBallSampler(norm, 1.0))
    with pytest.raises(ValueError, match="BatchNorm.*allowed"):
        stacked_synthesize([m[0] for m in made], [made[0][1], bn], 1, [m[2] for m in made])
    with pytest.raises(ValueError, match="generator of its own"):
        stacked_synthesize([m[0] for m in made], [m[1] for m in made], 1, [made[0][2]] * 2)


def test_a_feddm_run_with_stacked_clients_matches_the_plain_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    fed = make_toy_federation(num_clients=3, n_train=32, n_test=12)
    cfg = dataclasses.replace(small_cfg("feddm", rounds=2), client_ratio=1.0, workers=1)
    sets: dict[str, list[torch.Tensor]] = {"plain": [], "stacked": []}
    calls: list[int] = []
    aggregate, update = FedDM.aggregate, FedDM.client_update_stacked

    def recorded(run: str):
        def wrapped(self, state, ctx, replies):
            sets[run].append(torch.cat([r.get("synthetic_images")["x"]
                                        for r in replies.values()]))
            return aggregate(self, state, ctx, replies)
        return wrapped

    def counted(self, items):
        calls.append(len(items))
        return update(self, items)
    monkeypatch.setattr(FedDM, "aggregate", recorded("plain"))
    plain = run_experiment(cfg, out=tmp_path / "plain", fed=fed)
    monkeypatch.setattr(FedDM, "aggregate", recorded("stacked"))
    monkeypatch.setattr(FedDM, "client_update_stacked", counted)
    stacked = run_experiment(dataclasses.replace(cfg, stack_clients=True),
                             out=tmp_path / "stacked", fed=fed)
    assert calls == [3, 3]
    for a, b in zip(sets["plain"], sets["stacked"], strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert stacked["per_client_accuracy"] == plain["per_client_accuracy"]
    for name, loss in plain["per_client_loss"].items():
        assert stacked["per_client_loss"][name] == pytest.approx(loss, rel=1e-3, abs=1e-4)
    assert stacked["bytes_up"] == plain["bytes_up"]


def test_dp_and_batchnorm_keep_the_per_client_path(tmp_path, monkeypatch):
    fed = make_toy_federation(num_clients=2, n_train=32, n_test=8)
    cfg = small_cfg("feddm")
    env = build_env(cfg, fed, torch.device("cpu"))
    assert make_algorithm("feddm", env).stack_ready()
    dp = {"dp_noise": 1.0, "init": "noise", "steps": 1}
    assert not make_algorithm("feddm", env, dp).stack_ready()
    bn = dataclasses.replace(cfg, model_args={**cfg.model_args, "norm": "batch"})
    assert not make_algorithm("feddm", build_env(bn, fed, torch.device("cpu"))).stack_ready()
    # A DP run asked to stack runs client by client; the DP objective itself is refused.
    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(FedDM, "client_update_stacked", None)
    run = dataclasses.replace(cfg, rounds=1, client_ratio=1.0, workers=1, stack_clients=True,
                              method_args={**cfg.method_args, **dp})
    assert run_experiment(run, out=tmp_path / "dp", fed=fed)["rounds"] == 1
    alg = make_algorithm("feddm", env, dp)
    sent = alg.configure(alg.server_init(), ServerContext(0), [0, 1])
    items = [(sent[c], _context(fed, c)) for c in (0, 1)]
    setups = [alg.client_setup(m, c) for m, c in items]
    with pytest.raises(ValueError, match="DPDistributionMatching is not plain distribution "
                                         "matching; allowed: DistributionMatching"):
        stacked_synthesize([s for s, _ in setups], [o for _, o in setups], 1,
                           [c.generator for _, c in items])


def _context(fed, cid: int) -> ClientContext:
    c = fed.clients[cid]
    return ClientContext(cid=cid, name=c.name, x=c.x_train, y=c.y_train,
                         num_classes=fed.num_classes, state=Message(),
                         generator=torch.Generator().manual_seed(cid), round=0)

"""VHL: virtual data generators, the add-on composition, gradients and communication."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.algorithms.fedprox import ProximalTerm
from fedvl.algorithms.vhl import (
    CyclingSampler,
    VirtualImageTerm,
    derived_generator,
    vhl_calibration,
)
from fedvl.config import ConfigError, RunConfig, validate
from fedvl.core.contrastive import supcon_loss
from fedvl.core.message import Message
from fedvl.core.training import batch_indices
from fedvl.engine.simulation import Simulation, SimulationConfig, client_generator
from fedvl.registry import ALGORITHMS
from fedvl.run.assemble import build_env
from fedvl.run.experiment import run_experiment
from fedvl.virtual import make_virtual_dataset, normalise, save_grid
from tests.conftest import make_toy_federation

SMALL = {"virtual_per_class": 16}  # keeps generation and sampling tiny
OFF = {"alpha": 0.0, "calibration": False, "virtual_supcon_weight": 0.0}


def _final_weights(cfg, fed, tmp_path, name):
    run_experiment(cfg, out=tmp_path / name, fed=fed)
    ck = torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    return ck["server_state"]["model"]


def _same(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0), k


def _ctx(fed, env, cid=0, rnd=0):
    c = fed.clients[cid]
    return ClientContext(cid=cid, name=c.name, x=c.x_train, y=c.y_train,
                         num_classes=fed.num_classes, state=Message(),
                         generator=client_generator(env.seed, rnd, cid), round=rnd)


# -- generators ---------------------------------------------------------------------------------
GENS = {"style_gan": {}, "upsampled_noise": {}, "random_cnn": {"steps": 2, "batch": 8}}


@pytest.mark.parametrize("name", list(GENS))
def test_generator_deterministic_shape_and_class_structure(name):
    k, n, shape = 4, 24, (3, 16, 16)
    a = make_virtual_dataset(name, k, n, shape, seed=5, **GENS[name])
    b = make_virtual_dataset(name, k, n, shape, seed=5, **GENS[name])
    c = make_virtual_dataset(name, k, n, shape, seed=6, **GENS[name])
    assert a.images.shape == (k * n, *shape) and a.images.dtype == torch.uint8
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    assert torch.equal(a.labels, torch.arange(k).repeat_interleave(n))
    # Classes differ: class centroids are far apart relative to the within-class spread, so a
    # nearest-centroid rule recovers the virtual class of almost every image.
    x = a.normalised().flatten(1).view(k, n, -1)
    cent = x.mean(1)
    within = (x - cent[:, None]).pow(2).sum(-1).mean().sqrt()
    between = torch.cdist(cent, cent)[~torch.eye(k, dtype=torch.bool)]
    assert between.mean() > 0.3 * within
    pred = torch.cdist(x.reshape(k * n, -1), cent).argmin(1)
    assert (pred == a.labels).float().mean() >= 0.85


def test_generators_handle_grayscale_non_power_of_two():
    for name in GENS:
        d = make_virtual_dataset(name, 2, 3, (1, 28, 28), seed=0, **GENS[name])
        assert d.images.shape == (6, 1, 28, 28)


def test_generator_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    make_virtual_dataset("style_gan", 2, 4, (3, 8, 8), seed=0)
    assert torch.equal(before, torch.random.get_rng_state())


def test_save_grid(tmp_path):
    from PIL import Image

    d = make_virtual_dataset("upsampled_noise", 3, 4, (3, 8, 8), seed=0)
    path = save_grid(d.images, tmp_path / "grid.png", nrow=4)
    img = Image.open(path)
    assert img.size == (4 * 9 + 1, 3 * 9 + 1) and img.mode == "RGB"


# -- names and options --------------------------------------------------------------------------
def test_composed_names_validate_and_unknown_addon_is_clear():
    for m in ("vhl", "naive-vhl", "vfa", "fedavg+vhl", "fedprox+vhl", "scaffold+vhl",
              "fednova+vhl"):
        validate(RunConfig(method=m))
        assert m in ALGORITHMS.names()
    with pytest.raises(ConfigError, match=r"unknown add-on 'vhx'.*bases: .*fedprox.*add-ons: "
                                          r".*vhl"):
        validate(RunConfig(method="fedprox+vhx"))
    with pytest.raises(ConfigError, match=r"unknown base method 'fedfoo'.*add-ons: .*vhl"):
        validate(RunConfig(method="fedfoo+vhl"))
    with pytest.raises(ConfigError, match=r"cannot be combined with 'moon'; compatible bases"):
        validate(RunConfig(method="moon+vhl"))
    assert ALGORITHMS.get("fedprox+vhl") is ALGORITHMS.get("fedprox+vhl")


def test_options_of_base_and_addon_are_both_accepted(tiny_cfg, toy_fed):
    env = build_env(tiny_cfg, toy_fed, torch.device("cpu"))
    alg = make_algorithm("fedprox+vhl", env, {"mu": 0.5, "alpha": 0.25, "temperature": 0.1})
    assert (alg.p.mu, alg.p.alpha, alg.p.temperature) == (0.5, 0.25, 0.1)
    assert alg.p.calibration and alg.p.virtual_supcon_weight == 0.1
    assert not make_algorithm("naive-vhl", env).p.calibration
    with pytest.raises(ValueError, match=r"has no option\(s\) \['muu'\].*alpha.*mu"):
        make_algorithm("fedprox+vhl", env, {"muu": 1.0})
    with pytest.raises(ValueError, match="must be >= 0"):
        make_algorithm("fedprox+vhl", env, {"mu": -1.0})
    with pytest.raises(ValueError, match="label_style"):
        make_algorithm("vhl", env, {"label_style": "other"})


# -- gradients ---------------------------------------------------------------------------------
def test_calibration_detach_stops_gradient_into_virtual_features():
    g = torch.Generator().manual_seed(0)
    zr = torch.randn(6, 4, generator=g, requires_grad=True)
    zv = torch.randn(6, 4, generator=g, requires_grad=True)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    vhl_calibration(zr, y, zv, y, detach=True).backward()
    assert zv.grad is None and zr.grad.abs().sum() > 0
    vhl_calibration(zr, y, zv, y, detach=False).backward()
    assert zv.grad is not None and zv.grad.abs().sum() > 0


def test_calibration_term_sends_no_gradient_to_virtual_images(tiny_cfg, toy_fed):
    env = build_env(tiny_cfg, toy_fed, torch.device("cpu"))
    model = env.model_fn(num_classes=8)
    x, y = toy_fed.clients[0].x_train[:8], toy_fed.clients[0].y_train[:8]
    vy = torch.arange(4).repeat_interleave(2)
    for detach in (True, False):
        alg = make_algorithm("vhl", env, {"alpha": 0.0, "virtual_supcon_weight": 0.0,
                                          "detach_virtual": detach})
        images = torch.randn(8, 3, 8, 8, requires_grad=True)
        term = VirtualImageTerm(alg.p, images, vy, 4, 8, torch.Generator().manual_seed(0))
        z, logits = model.features_and_logits(x)
        term(model, x, y, z, logits).backward()
        moved = images.grad is not None and bool(images.grad.abs().sum() > 0)
        assert moved is (not detach)
        # The real features always receive the calibration gradient.
        assert model.classifier.weight.grad is None  # only embed() is involved
        assert next(model.features.parameters()).grad.abs().sum() > 0
        model.zero_grad(set_to_none=True)


# -- composition -----------------------------------------------------------------------------------
@pytest.mark.parametrize("base,args", [("fedavg", {}), ("fedprox", {"mu": 0.1}),
                                       ("scaffold", {}), ("fednova", {})])
def test_vhl_switched_off_equals_base_exactly(base, args, tiny_cfg, toy_fed, tmp_path):
    # label_style 'shared' keeps the classifier at C outputs, so the two runs optimise the same
    # model and the equality is exact (with 'extra' the C+V-way softmax changes the real CE).
    cfg = dataclasses.replace(tiny_cfg, method=base, method_args=args, momentum=0.5)
    a = _final_weights(cfg, toy_fed, tmp_path, "base")
    vcfg = dataclasses.replace(cfg, method=f"{base}+vhl",
                               method_args={**args, **OFF, **SMALL, "label_style": "shared"})
    b = _final_weights(vcfg, toy_fed, tmp_path, "vhl")
    _same(a, b)


def test_vhl_on_changes_training_and_widens_classifier(tiny_cfg, toy_fed, tmp_path):
    a = _final_weights(tiny_cfg, toy_fed, tmp_path, "avg")
    b = _final_weights(dataclasses.replace(tiny_cfg, method="vhl", method_args=SMALL),
                       toy_fed, tmp_path, "vhl")
    assert a["classifier.weight"].shape[0] == 4 and b["classifier.weight"].shape[0] == 8
    trunk = [k for k in a if not k.startswith("classifier")]
    assert any(not torch.allclose(a[k], b[k]) for k in trunk)


def test_fedprox_vhl_applies_both_terms(tiny_cfg, toy_fed, tmp_path):
    env = build_env(tiny_cfg, toy_fed, torch.device("cpu"))
    alg = make_algorithm("fedprox+vhl", env, {"mu": 0.5, **SMALL})
    state = alg.server_init()
    msg = alg.configure(state, ServerContext(0), [0])[0]
    model = alg.load_model(msg.get("weights"), torch.device("cpu"))
    terms = alg.loss_terms(model, msg, _ctx(toy_fed, env))
    assert {type(t) for t in terms} == {ProximalTerm, VirtualImageTerm}
    # Numerically: a strong proximal term keeps fedprox+vhl closer to the start than vhl alone.
    w0 = state["model"]
    one = dataclasses.replace(tiny_cfg, rounds=1)
    v = _final_weights(dataclasses.replace(one, method="vhl", method_args=SMALL), toy_fed,
                       tmp_path, "v")
    pv = _final_weights(dataclasses.replace(one, method="fedprox+vhl",
                                            method_args={"mu": 10.0, **SMALL}),
                        toy_fed, tmp_path, "pv")
    dist = lambda w: sum(float((w[k] - w0[k]).norm()) for k in w0)  # noqa: E731
    assert dist(pv) < dist(v)


@pytest.mark.parametrize("method", ["scaffold+vhl", "fednova+vhl", "naive-vhl", "vfa",
                                    "fedprox+naive-vhl"])
def test_variants_run(method, tiny_cfg, toy_fed, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, method=method, rounds=2, method_args=SMALL)
    s = run_experiment(cfg, out=tmp_path / "r", fed=toy_fed)
    assert 0.0 <= s["mean_accuracy"] <= 1.0
    kinds = s["bytes_by_kind"]
    if method == "vfa":
        assert "prototypes" in kinds and "synthetic_images" not in kinds
    else:
        assert kinds["synthetic_images"]["down"] > 0 and kinds["synthetic_images"]["up"] == 0


# -- communication -------------------------------------------------------------------------------
def test_virtual_data_bytes_counted_once_per_client(tiny_cfg, tmp_path):
    fed = make_toy_federation(num_clients=4)
    cfg = dataclasses.replace(tiny_cfg, method="vhl", rounds=5, method_args=SMALL)
    env = build_env(cfg, fed, torch.device("cpu"))
    alg = make_algorithm("vhl", env, SMALL)
    sim = Simulation(alg, fed, SimulationConfig(rounds=5, client_ratio=0.5, seed=0))
    sim.run()
    first_seen: dict[int, int] = {}
    for rec in sim.history:
        for c in rec["sampled"]:
            first_seen.setdefault(c, rec["round"])
    per_client = 4 * 16 * 3 * 8 * 8  # uint8 images
    totals = sim.ledger.totals()["bytes_by_kind"]
    assert totals["synthetic_images"]["down"] == len(first_seen) * per_client
    assert totals["synthetic_labels"]["down"] == len(first_seen) * 4 * 16 * 8
    for rnd, slot in sim.ledger.rounds.items():
        new = sum(1 for c, r in first_seen.items() if r == rnd)
        assert slot["down"].get("synthetic_images", 0) == new * per_client
    assert any(rec["round"] > first_seen[c] for rec in sim.history for c in rec["sampled"])
    for c in first_seen:
        assert sim.client_states[c].arrays["synthetic_images"]["virtual_images"].shape == (
            64, 3, 8, 8)
    assert sim.state["virtual_sent"] == sorted(first_seen)


def test_vhl_resume_matches_uninterrupted_run(tiny_cfg, toy_fed, tmp_path):
    def sim(rounds, run_dir):
        env = build_env(tiny_cfg, toy_fed, torch.device("cpu"))
        alg = make_algorithm("vhl", env, SMALL)
        return Simulation(alg, toy_fed, SimulationConfig(rounds=rounds, client_ratio=0.67),
                          run_dir=run_dir)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    full = sim(3, tmp_path / "a")
    full.run()
    sim(2, tmp_path / "b").run()
    resumed = sim(3, tmp_path / "b")
    resumed.run(resume=True)
    _same(full.state["model"], resumed.state["model"])
    assert full.ledger.totals() == resumed.ledger.totals()


def test_crop_flip_is_a_padded_crop_of_each_image():
    """The batched crop equals cropping every (flipped) padded image at its drawn offset."""
    from fedvl.algorithms.vhl import crop_flip

    v = torch.randn(6, 3, 9, 7)
    pad, fill = 2, -2.0
    out = crop_flip(v, torch.Generator().manual_seed(3), pad, fill)
    g = torch.Generator().manual_seed(3)
    flip = torch.rand(6, generator=g) < 0.5
    dy = torch.randint(0, 2 * pad + 1, (6,), generator=g)
    dx = torch.randint(0, 2 * pad + 1, (6,), generator=g)
    for i in range(6):
        img = v[i].flip(2) if flip[i] else v[i]
        padded = torch.nn.functional.pad(img, (pad, pad, pad, pad), value=fill)
        assert torch.equal(out[i], padded[:, dy[i]:dy[i] + 9, dx[i]:dx[i] + 7])


# -- virtual labels ------------------------------------------------------------------------------
@pytest.mark.parametrize("label_style,shift", [("extra", 4), ("shared", 0)])
def test_virtual_ce_uses_labels_shifted_by_num_classes(label_style, shift, tiny_cfg, toy_fed):
    """Virtual class k is trained as output C + k of a classifier with C + V outputs."""
    env = build_env(tiny_cfg, toy_fed, torch.device("cpu"))
    alg = make_algorithm("vhl", env, {**SMALL, "calibration": False,
                                      "virtual_supcon_weight": 0.0, "label_style": label_style})
    outputs = 4 + (4 if label_style == "extra" else 0)
    assert alg.new_model().classifier.out_features == outputs
    state = alg.server_init()
    assert state["model"]["classifier.weight"].shape[0] == outputs
    msg = alg.configure(state, ServerContext(0), [0])[0]
    model = alg.load_model(msg.get("weights"), torch.device("cpu"))
    ctx = _ctx(toy_fed, env)
    (term,) = alg.loss_terms(model, msg, ctx)
    assert term.shift == shift
    # The virtual batch the term draws, and its CE computed by hand.
    images = normalise(msg.arrays["synthetic_images"]["virtual_images"])
    labels = msg.arrays["synthetic_labels"]["virtual_labels"]
    vidx = CyclingSampler(len(labels), 16, derived_generator(ctx, 4244)).next()
    lv, yv = model(images[vidx]), labels[vidx]
    assert int(yv.max()) < 4
    x = ctx.x[:16]
    z, logits = model.features_and_logits(x)
    got = term(model, x, ctx.y[:16], z, logits)
    assert torch.equal(got, F.cross_entropy(lv, yv + shift))
    if shift:
        assert not torch.allclose(got, F.cross_entropy(lv, yv))


# -- BatchNorm: one forward on [x; v] ------------------------------------------------------------
def _one_step(tiny_cfg, fed, norm):
    cfg = dataclasses.replace(tiny_cfg, method="vhl", local_steps=1,
                              model_args={"width": 8, "depth": 2, "norm": norm})
    env = build_env(cfg, fed, torch.device("cpu"))
    alg = make_algorithm("vhl", env, SMALL)
    msg = alg.configure(alg.server_init(), ServerContext(0), [0])[0]
    return env, alg, msg


def _hand_step(env, alg, msg, fed, shared):
    """One VHL step written out on the real and virtual batch the method draws."""
    ctx = _ctx(fed, env)
    model = alg.load_model(msg.get("weights"), torch.device("cpu"))
    images = normalise(msg.arrays["synthetic_images"]["virtual_images"])
    labels = msg.arrays["synthetic_labels"]["virtual_labels"]
    bs = env.train.batch_size
    idx = next(batch_indices(len(ctx.y), bs, 1, 1, client_generator(env.seed, 0, 0)))
    vidx = CyclingSampler(len(labels), bs, derived_generator(ctx, 4244)).next()
    x, y, v, yv = ctx.x[idx], ctx.y[idx], images[vidx], labels[vidx]
    if shared:
        z_all, l_all = model.features_and_logits(torch.cat([x, v]))
        z, zv, lx, lv = z_all[:bs], z_all[bs:], l_all[:bs], l_all[bs:]
    else:
        z, lx = model.features_and_logits(x)
        zv, lv = model.features_and_logits(v)
    loss = (F.cross_entropy(lx, y) + F.cross_entropy(lv, yv + env.num_classes)
            + vhl_calibration(z, y, zv, yv) + 0.1 * supcon_loss(zv, yv))
    opt = torch.optim.SGD(model.parameters(), lr=env.train.lr)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return model.state_dict()


@pytest.mark.parametrize("norm,layer,sizes", [("batch", torch.nn.BatchNorm2d, [32]),
                                              ("instance", torch.nn.GroupNorm, [16, 16])])
def test_vhl_forwards_real_and_virtual_batch_together_only_with_batchnorm(
        norm, layer, sizes, tiny_cfg, toy_fed):
    env, alg, msg = _one_step(tiny_cfg, toy_fed, norm)
    model = alg.load_model(msg.get("weights"), torch.device("cpu"))
    seen: list[int] = []
    first = next(m for m in model.modules() if isinstance(m, layer))
    first.register_forward_hook(lambda m, inp, out: seen.append(len(inp[0])))
    stats = alg.train(model, msg, _ctx(toy_fed, env))
    assert stats.steps == 1 and env.train.batch_size == 16
    # BN: one pass over [x; v] (16 real + 16 virtual); no batch statistics: two passes.
    assert seen == sizes
    want = _hand_step(env, alg, msg, toy_fed, shared=norm == "batch")
    _same(model.state_dict(), want, atol=1e-6)
    if norm == "batch":
        # The running statistics are those of the mixed batch, exactly.
        for k in want:
            if "running" in k:
                assert torch.equal(model.state_dict()[k], want[k]), k


# -- pixel mapping -------------------------------------------------------------------------------
def test_pixel_mapping_option_is_validated_and_reaches_the_generator(tiny_cfg, toy_fed):
    env = build_env(tiny_cfg, toy_fed, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"pixel_mapping.*'bogus'.*allowed: affine, clamp"):
        make_algorithm("vhl", env, {"pixel_mapping": "bogus"})
    assert make_algorithm("vhl", env).p.pixel_mapping == "affine"
    a = make_algorithm("vhl", env, SMALL).virtual_dataset()
    c = make_algorithm("vhl", env, {**SMALL, "pixel_mapping": "clamp"}).virtual_dataset()
    assert a.images.shape == c.images.shape and not torch.equal(a.images, c.images)
    # clamp keeps the raw output x, (x + 1) / 2 -> x: everything below the old mid-grey is black.
    assert float((c.images == 0).float().mean()) > float((a.images == 0).float().mean())

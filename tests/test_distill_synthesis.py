"""Synthetic sets, samplers, the synthesis loop and DP synthesis on tiny problems."""

import copy

import pytest
import torch

from fedvl.core.dp import clip_rows, compute_epsilon
from fedvl.data.federated import class_channel_stats
from fedvl.distill import dp_matching
from fedvl.distill.dp_matching import DPDistributionMatching, per_sample_image_grads
from fedvl.distill.losses import gradient_distance
from fedvl.distill.samplers import (
    FixedModelSampler,
    ImportanceClassSampler,
    RandomModelSampler,
    RhoBallSampler,
    UniformClassSampler,
    importance_weights,
    perturbation,
)
from fedvl.distill.synthesize import (
    DistributionMatching,
    GradientMatching,
    TargetGradientMatching,
    embed_real_and_syn,
    synthesize,
)
from fedvl.distill.synthetic import SyntheticSet
from fedvl.models.base import FedModel, build_model

K, SIZE = 4, 8




def _gen(s=0):
    return torch.Generator().manual_seed(s)


def _toy(n=64, seed=0):
    g = _gen(seed)
    protos = torch.randn(K, 3, SIZE, SIZE, generator=g)
    y = torch.arange(n) % K
    return protos[y] + 0.3 * torch.randn(n, 3, SIZE, SIZE, generator=g), y


def _model(seed=0, norm="instance"):
    return build_model("convnet", 3, K, SIZE, seed=seed, width=8, depth=2, norm=norm)


def _frozen(seed):
    m = _model(seed)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


# -- SyntheticSet ----------------------------------------------------------------------------

def test_class_stats_init_uses_per_class_counts():
    # Class 0: one image of all 1s; class 1: two images, 2s and 4s. Hand-checked stats.
    x = torch.cat([torch.full((1, 1, 2, 2), 1.0), torch.full((1, 1, 2, 2), 2.0),
                   torch.full((1, 1, 2, 2), 4.0)])
    y = torch.tensor([0, 1, 1])
    mean, std, counts = class_channel_stats(x, y, 2)
    assert torch.allclose(mean.flatten(), torch.tensor([1.0, 3.0]))
    assert torch.allclose(std.flatten(), torch.tensor([0.0, 1.0]))
    s = SyntheticSet.from_client_stats(2000, x, y, 2, _gen())
    cls1 = s.images.detach()[s.labels == 1]
    assert abs(float(cls1.mean()) - 3.0) < 0.05 and abs(float(cls1.std()) - 1.0) < 0.05
    assert torch.allclose(s.images[s.labels == 0], torch.ones(1))
    # The FedLGD-faithful variant scales the class mean by n_c / N.
    f = SyntheticSet.from_client_stats(2000, x, y, 2, _gen(), fedlgd_scaled=True)
    assert abs(float(f.images.detach()[f.labels == 1].mean()) - 2.0) < 0.05


def test_blocked_labels_and_per_class_ipc():
    s = SyntheticSet.noise([1, 0, 3, 2], K, (3, SIZE, SIZE), _gen())
    assert s.labels.tolist() == [0, 2, 2, 2, 3, 3]
    assert s.ipc == [1, 0, 3, 2]
    with pytest.raises(ValueError):
        SyntheticSet.noise([1, 2], K, (3, SIZE, SIZE), _gen())


def test_real_init_draws_from_the_right_class():
    x, y = _toy()
    s = SyntheticSet.from_real(3, x, y, K, _gen())
    for img, lab in zip(s.images.detach(), s.labels):
        match = (x == img).flatten(1).all(1)
        assert match.any() and (y[match] == lab).all()


def test_average_is_elementwise_mean():
    a = SyntheticSet.noise(2, K, (3, SIZE, SIZE), _gen(1))
    b = SyntheticSet.noise(2, K, (3, SIZE, SIZE), _gen(2))
    m = SyntheticSet.average([a, b])
    assert torch.allclose(m.images, (a.images + b.images) / 2)
    with pytest.raises(ValueError):
        SyntheticSet.average([a, SyntheticSet.noise(1, K, (3, SIZE, SIZE), _gen())])


def test_save_load_roundtrip_png_and_malformed(tmp_path):
    s = SyntheticSet.noise(3, K, (3, SIZE, SIZE), _gen())
    s.meta["note"] = "x"
    s.save(tmp_path / "s.pt")
    t = SyntheticSet.load(tmp_path / "s.pt")
    assert torch.equal(t.images, s.images) and torch.equal(t.labels, s.labels)
    assert t.meta["note"] == "x" and t.num_classes == K
    s.save_png(tmp_path / "s.png", (0.5,) * 3, (0.5,) * 3)
    from PIL import Image

    w, h = Image.open(tmp_path / "s.png").size
    assert h == K * (SIZE + 2) + 2 and w == 3 * (SIZE + 2) + 2
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="bad.pt"):
        SyntheticSet.load(tmp_path / "bad.pt")
    torch.save({"images": 1}, tmp_path / "bad2.pt")
    with pytest.raises(ValueError, match="malformed"):
        SyntheticSet.load(tmp_path / "bad2.pt")


# -- samplers --------------------------------------------------------------------------------

def test_rho_ball_inside_and_sphere_on():
    shapes = [torch.Size([3, 4]), torch.Size([2])]
    for seed in range(20):
        d = perturbation(shapes, 0.5, _gen(seed))
        assert float(torch.sqrt(sum((t**2).sum() for t in d))) <= 0.5 + 1e-6
        s = perturbation(shapes, 0.5, _gen(seed), sphere=True)
        assert abs(float(torch.sqrt(sum((t**2).sum() for t in s))) - 0.5) < 1e-5
    # In 14 dimensions the uniform ball puts mass well inside: radius^14 ~ U.
    radii = [float(torch.sqrt(sum((t**2).sum() for t in perturbation(shapes, 1.0, _gen(s)))))
             for s in range(200)]
    assert min(radii) < 0.9
    base = _model()
    sampler = RhoBallSampler(base, 0.1)
    m = sampler(_gen(3))
    dist = torch.sqrt(sum(((p - q) ** 2).sum() for p, q in zip(m.parameters(),
                                                               base.parameters())))
    assert 0 < float(dist.detach()) <= 0.1 + 1e-6


def test_uniform_sampler_per_class_without_replacement():
    x, y = _toy(40)
    idx = UniformClassSampler(x, y, K, 6).indices(_gen())
    assert torch.bincount(y[idx], minlength=K).tolist() == [6] * K
    assert len(set(idx.tolist())) == len(idx)
    idx = UniformClassSampler(x, y, K, 100).indices(_gen())
    assert sorted(idx.tolist()) == list(range(40))


def test_importance_sampling_prefers_high_loss_samples():
    x, y = _toy(80)
    model = _model()
    w = importance_weights([model, _model(1)], x, y, mix=[0.5, 0.5], gamma=5.0)
    assert ((w > 0) & (w < 1)).all()
    weights = torch.zeros(80)
    hot = torch.arange(80)[(torch.arange(80) // K) % 5 == 0]  # 4 of the 20 images per class
    assert torch.bincount(y[hot], minlength=K).tolist() == [4] * K
    weights[hot] = 5.0
    idx = ImportanceClassSampler(x, y, K, 500, weights).indices(_gen())
    frac_hot = torch.isin(idx, hot).float().mean()
    assert frac_hot > 0.9  # uniform would give 0.2
    assert torch.bincount(y[idx], minlength=K).tolist() == [500] * K


# -- synthesis -------------------------------------------------------------------------------

@pytest.mark.parametrize("matching", ["dm", "kernel", "embed_logit"])
def test_synthesis_reduces_loss_on_fixed_model(matching):
    x, y = _toy(64)
    syn = SyntheticSet.noise(2, K, (3, SIZE, SIZE), _gen())
    obj = DistributionMatching(UniformClassSampler(x, y, K, 16), FixedModelSampler(_model()), K,
                               matching=matching, kernel="gaussian", dsa=None)
    res = synthesize(syn, obj, 40, _gen(), lr_img=0.5 if matching != "kernel" else 5.0)
    assert len(res.loss_curve) == 40
    assert sum(res.loss_curve[-5:]) < 0.5 * sum(res.loss_curve[:5])


def test_dm_with_random_models_and_dsa_learns_class_signal():
    x, y = _toy(64)
    syn = SyntheticSet.noise(1, K, (3, SIZE, SIZE), _gen())
    judges = [_frozen(100 + i) for i in range(4)]

    def held_out_loss() -> float:
        # DM loss on all real data under fixed models never used for synthesis.
        return sum(float(DistributionMatching(lambda g: (x, y), lambda g, m=m: m, K, dsa=None)(
            syn.images.detach(), syn.labels, _gen())[0]) for m in judges)

    before = held_out_loss()
    obj = DistributionMatching(UniformClassSampler(x, y, K, 16), RandomModelSampler(_frozen), K)
    synthesize(syn, obj, 80, _gen(), lr_img=0.3)
    assert held_out_loss() < 0.85 * before


def test_clip_norm_bounds_the_step():
    x, y = _toy(32)
    syn = SyntheticSet.noise(1, K, (3, SIZE, SIZE), _gen())
    before = syn.images.detach().clone()
    obj = DistributionMatching(UniformClassSampler(x, y, K, 8), FixedModelSampler(_model()), K,
                               dsa=None)
    synthesize(syn, obj, 1, _gen(), lr_img=1.0, clip_norm=0.01)
    assert float((syn.images.detach() - before).norm()) <= 0.01 + 1e-6


def test_fixed_sampler_does_not_touch_caller_model_and_latent_constraint():
    model = _model(norm="batch")
    state = copy.deepcopy(model.state_dict())
    sampler = FixedModelSampler(model)
    x, y = _toy(32)
    m = sampler(_gen())
    zr, zs, _, _ = embed_real_and_syn(m, x, x[:4], latent_constraint=True)
    # Train mode on real data moved the copy's running statistics, not the caller's.
    assert not torch.allclose(m.features[1].running_mean, state["features.1.running_mean"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])
    # The public code's form: synthetic images normalised with running statistics (eval
    # mode), so a single image embeds the same as inside a batch.
    _, zs1, _, _ = embed_real_and_syn(m, x, x[:1], latent_constraint=True,
                                      latent_stats="running")
    m.eval()
    assert torch.allclose(m.embed(x[:1]), m.embed(x[:4])[:1], atol=1e-5)
    # Instance norm has no running statistics: the constraint changes nothing.
    inst = _model()
    a = embed_real_and_syn(inst, x, x[:4], latent_constraint=True)[1]
    b = embed_real_and_syn(inst, x, x[:4], latent_constraint=False)[1]
    assert torch.allclose(a, b)


def test_gradient_matching_objectives_reduce_loss():
    x, y = _toy(32)
    syn = SyntheticSet.noise(2, K, (3, SIZE, SIZE), _gen())
    obj = GradientMatching(UniformClassSampler(x, y, K, 8), FixedModelSampler(_model()), K,
                           dsa=None)
    res = synthesize(syn, obj, 15, _gen(), lr_img=0.1)
    assert res.loss_curve[-1] < res.loss_curve[0]
    # FedLGD server side: targets = real-data gradient of a model.
    model = _model(2)
    ce = torch.nn.functional.cross_entropy(model(x), y)
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(ce, list(model.parameters()))
    targets = dict(zip(names, grads))
    syn2 = SyntheticSet.noise(2, K, (3, SIZE, SIZE), _gen(1))
    res2 = synthesize(syn2, TargetGradientMatching(model, targets), 20, _gen(), lr_img=0.1)
    assert res2.loss_curve[-1] < res2.loss_curve[0]
    with pytest.raises(ValueError, match="unknown parameters"):
        TargetGradientMatching(model, {"nope": grads[0]})


# -- differential privacy ----------------------------------------------------------------------

def test_clip_rows_bounds_each_row():
    g = torch.randn(10, 3, 4, generator=_gen()) * 10
    c, norms = clip_rows(g, 2.0)
    assert (c.flatten(1).norm(dim=1) <= 2.0 + 1e-5).all()
    small = torch.full((1, 3, 4), 0.01)
    assert torch.equal(clip_rows(small, 2.0)[0], small)


def test_per_sample_grads_match_single_sample_autograd():
    m = _frozen(0)
    block = torch.randn(2, 3, SIZE, SIZE, generator=_gen(1))
    v = torch.randn(3, m.feature_dim, generator=_gen(2))
    g = per_sample_image_grads(m, block, v)
    leaf = block.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(m.embed(leaf).mean(0), leaf, grad_outputs=v[1])
    assert torch.allclose(g[1], ref, atol=1e-5)


def test_per_sample_grads_do_not_depend_on_the_pass_size(monkeypatch):
    m = _frozen(0)
    block = torch.randn(2, 3, SIZE, SIZE, generator=_gen(1))
    v = torch.randn(5, m.feature_dim, generator=_gen(2))
    whole = per_sample_image_grads(m, block, v)
    monkeypatch.setattr(dp_matching, "PASS_BYTES", 1)  # one row per backward pass
    assert torch.equal(per_sample_image_grads(m, block, v), whole)


@pytest.mark.parametrize("space", ["image", "feature"])
def test_dp_bounds_each_real_sample_contribution(space):
    x, y = _toy(48)
    syn = SyntheticSet.noise(1, K, (3, SIZE, SIZE), _gen())
    clip = 0.05
    obj = DPDistributionMatching(x * 50, y, RandomModelSampler(_frozen), K, batch_per_class=6,
                                 clip=clip, noise_multiplier=0.0, space=space)
    # With zero noise the step gradient is sum of clipped contributions / expected batch, so its
    # norm per class is at most (#included * clip) / expected.
    _, grad = obj(syn.images, syn.labels, _gen(3))
    assert obj.last_norms is not None and (obj.last_norms > clip).any()  # clipping was active
    for c in range(K):
        included = 12  # every class has 12 images; bound with all of them included
        assert float(grad[syn.labels == c].norm()) <= included * clip / 6 + 1e-6
    res = synthesize(syn, DPDistributionMatching(x, y, RandomModelSampler(_frozen), K,
                                                 batch_per_class=6, clip=1.0,
                                                 noise_multiplier=0.6, space=space),
                     3, _gen())
    assert res.epsilon is not None and res.delta == pytest.approx(1 / (10 * 48))


class _Flat(FedModel):
    """embed(x) = x flattened: a parameter-free extractor with a known Jacobian."""

    def __init__(self) -> None:
        super().__init__()
        self.feature_dim = 3 * SIZE * SIZE

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


@pytest.mark.parametrize("space", ["image", "feature"])
def test_dp_noise_has_scale_sigma_times_clip(space):
    """With a huge noise multiplier the step gradient is the Gaussian noise: std sigma * C."""
    x, y = _toy(48)
    ipc, sigma, clip = 6, 1000.0, 0.01
    syn = SyntheticSet.noise(ipc, K, (3, SIZE, SIZE), _gen())
    extractor = RandomModelSampler(lambda s: _Flat()) if space == "feature" else \
        RandomModelSampler(_frozen)
    obj = DPDistributionMatching(x, y, extractor, K, batch_per_class=6, clip=clip,
                                 noise_multiplier=sigma, space=space)
    _, grad = obj(syn.images, syn.labels, _gen(5))
    expected = 6.0  # rate 6/12 x 12 images per class
    # Image space: grad = (sum of clipped + N(0, (sigma C)^2)) / expected per pixel. Feature
    # space with embed = flatten: the image gradient is u / ipc with u = (sum + noise) / expected.
    scale = expected * (ipc if space == "feature" else 1)
    noise = grad * scale
    assert abs(float(noise.mean())) < 0.05 * sigma * clip
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.05)


def test_dp_refuses_batchnorm_and_private_inits():
    from fedvl.distill.dp_matching import check_dp_setup

    bn = build_model("convnet", 3, K, SIZE, seed=0, width=4, depth=1, norm="batch")
    with pytest.raises(ValueError, match="BatchNorm"):
        check_dp_setup("noise", bn)
    for init in ("real", "stats"):
        with pytest.raises(ValueError, match="needs init 'noise'"):
            check_dp_setup(init, _frozen(0))
    check_dp_setup("noise", _frozen(0))
    x, y = _toy(24)
    obj = DPDistributionMatching(x, y, RandomModelSampler(lambda s: bn), K, batch_per_class=3,
                                 clip=1.0, noise_multiplier=1.0)
    syn = SyntheticSet.noise(1, K, (3, SIZE, SIZE), _gen())
    with pytest.raises(ValueError, match="BatchNorm"):
        obj(syn.images, syn.labels, _gen(1))


def test_epsilon_matches_the_opacus_accountant():
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(50):
        acc.step(noise_multiplier=0.6, sample_rate=0.05)
    assert compute_epsilon(0.6, 0.05, 50, 1e-5) == pytest.approx(acc.get_epsilon(1e-5))
    assert compute_epsilon(0.6, 0.05, 100, 1e-5) > compute_epsilon(0.6, 0.05, 50, 1e-5)


def test_class_sampler_draws_do_not_depend_on_data_device():
    """Batches come from the CPU generator, so a seed picks the same images wherever x lives."""
    from fedvl.distill.samplers import UniformClassSampler

    x = torch.arange(40.0).view(40, 1, 1, 1)
    y = torch.arange(40) % 4
    s = UniformClassSampler(x, y, 4, 3)
    idx = s.indices(torch.Generator().manual_seed(0))
    assert idx.device.type == "cpu" and len(idx) == 12
    xb, yb = s(torch.Generator().manual_seed(0))
    assert torch.equal(xb.flatten(), x[idx].flatten()) and torch.equal(yb, y[idx])
    assert torch.equal(torch.bincount(yb, minlength=4), torch.full((4,), 3))


@pytest.mark.parametrize("matching,kernel", [("dm", "linear"), ("kernel", "gaussian")])
def test_multiset_batch_matches_the_repeated_batch(matching, kernel):
    # FedVCK draws real images with replacement; computing each distinct image once (BN in train
    # mode normalising with the repeated batch's statistics) must give the same loss, image
    # gradient and BN running statistics up to float rounding.
    x, y = _toy(24)
    w = torch.rand(24, generator=_gen(5))
    syn = SyntheticSet.from_real([3] * K, x, y, K, _gen(1))
    out = []
    for multiset in (False, True):
        sampler = ImportanceClassSampler(x, y, K, 16, w, replacement=True, multiset=multiset)
        extractor = FixedModelSampler(_model(norm="batch"))
        objective = DistributionMatching(sampler, extractor, K, matching=matching,
                                         kernel=kernel, latent_constraint=True)
        images = syn.images.detach().clone().requires_grad_(True)
        loss, _ = objective(images, syn.labels, _gen(2))
        (grad,) = torch.autograd.grad(loss, images)
        bn = next(m for m in extractor.model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        out.append((loss.detach(), grad, bn.running_mean.clone(), bn.running_var.clone(),
                    len(sampler(_gen(3))[0])))
    (l0, g0, m0, v0, n0), (l1, g1, m1, v1, n1) = out
    assert n1 < n0 == 16 * K                       # fewer images computed
    assert torch.allclose(l1, l0, rtol=1e-5, atol=1e-7)
    assert float((g1 - g0).norm() / g0.norm()) < 1e-5
    assert torch.allclose(m1, m0, atol=1e-6) and torch.allclose(v1, v0, rtol=1e-5)


def test_rho_ball_sampler_reuses_one_copy_with_the_values_of_a_fresh_one():
    base = _model(norm="batch")
    sampler = RhoBallSampler(base, 0.3, train_mode=True)
    first = sampler(_gen(4))
    with torch.no_grad():
        first(torch.randn(6, 3, SIZE, SIZE))       # a train-mode step moves BN statistics
    g = _gen(9)
    again = sampler(g)
    delta = perturbation([p.shape for p in base.parameters()], 0.3, _gen(9))
    assert again is first
    for p, b, d in zip(again.parameters(), base.parameters(), delta):
        assert torch.equal(p.detach(), b.detach() + d)
    for w, b in zip(again.buffers(), base.buffers()):
        assert torch.equal(w, b)


def test_gradient_matching_per_class_forward_equals_the_shared_forward():
    # A forward shared by all classes gives the same per-class gradients (per-sample norm), at
    # K times the backward work; the per-class forward must match it up to float rounding.
    x, y = _toy(32)
    syn = SyntheticSet.noise(2, K, (3, SIZE, SIZE), _gen(1))
    model = _model(3)
    obj = GradientMatching(UniformClassSampler(x, y, K, 8), FixedModelSampler(model), K, dsa=None)
    images = syn.images.detach().clone().requires_grad_(True)
    loss, _ = obj(images, syn.labels, _gen(2))
    (grad,) = torch.autograd.grad(loss, images)

    xr, yr = UniformClassSampler(x, y, K, 8)(_gen(2))
    ref_images = syn.images.detach().clone().requires_grad_(True)
    net = obj.extractor.model
    params = list(net.parameters())
    lr_all = torch.nn.functional.cross_entropy(net(xr), yr, reduction="none")
    ls_all = torch.nn.functional.cross_entropy(net(ref_images), syn.labels, reduction="none")
    ref = ref_images.new_zeros(())
    for c in range(K):
        gr = torch.autograd.grad(lr_all[yr == c].mean(), params, retain_graph=True)
        gs = torch.autograd.grad(ls_all[syn.labels == c].mean(), params, retain_graph=True,
                                 create_graph=True)
        ref = ref + gradient_distance(gs, [g.detach() for g in gr], "ours")
    (ref_grad,) = torch.autograd.grad(ref, ref_images)
    assert torch.allclose(loss.detach(), ref.detach(), rtol=1e-5)
    assert float((grad - ref_grad).norm() / ref_grad.norm()) < 1e-4


@pytest.mark.parametrize("norm,pooling,metric,grouped_twice", [
    ("instance", "avg", "ours", True), ("instance", "avg", "ours", False),
    ("group", "max", "mse", True), ("batch", "avg", "cos", True), ("layer", "avg", "ours", True)])
def test_gradient_matching_all_classes_at_once_equals_one_class_at_a_time(
        norm, pooling, metric, grouped_twice, monkeypatch):
    """The grouped ConvNet (instance and group norm, avg and max pooling; its double backward
    or vmap's, with GroupNorm in plain ops) and the vmap it falls back to (BatchNorm in eval
    mode) give the per-class loop's loss and image gradient in float64, with a class absent
    from the real batch; "ours" leaves out the 1-D parameters. LayerNorm, which vmap
    differentiates twice wrongly, keeps the loop."""
    from fedvl.distill import class_gradients
    from fedvl.distill.class_gradients import groupable, vmap_exact

    if not grouped_twice:
        monkeypatch.setattr(class_gradients, "GROUPED_TWICE_MAX_CLASSES", 0)

    x, y = _toy(32)
    x, keep = x.double(), y != 3                      # class 3 has no real images
    syn = SyntheticSet.noise(2, K, (3, SIZE, SIZE), _gen(1))
    model = build_model("convnet", 3, K, SIZE, seed=3, width=8, depth=2, norm=norm,
                        pooling=pooling).double().eval()
    assert groupable(model) == (norm in ("instance", "group"))
    assert vmap_exact(model) == (norm != "layer")
    out = {}
    for batched in (False, True):
        obj = GradientMatching(UniformClassSampler(x[keep], y[keep], K, 8),
                               FixedModelSampler(model), K, metric=metric, dsa=None,
                               batched=batched)
        images = syn.images.detach().double().requires_grad_(True)
        loss, _ = obj(images, syn.labels, _gen(2))
        out[batched] = (loss.detach(), torch.autograd.grad(loss, images)[0])
    assert out[False][0] > 0
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("extractor", ["random", "fixed", "rho"])
def test_a_captured_step_computes_what_the_eager_loop_does(extractor):
    """The split a captured step replays (host draws into fixed inputs, then the device's
    computation), run eagerly on the CPU, gives the eager loop's images and losses bit for bit,
    over two calls (the second restarts the momentum as a fresh optimiser does)."""
    from fedvl.distill.augment import DSAConfig
    from fedvl.distill.graphed import CapturedStep, not_graphable

    k = 3
    g0 = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 1, 8, 8, generator=g0, device="cpu"), torch.arange(24) % k

    def model(seed: int) -> FedModel:
        return build_model("convnet", 1, k, 8, seed=seed, width=4, depth=1)

    def objective() -> DistributionMatching:
        sampler = {"random": RandomModelSampler(model),
                   "fixed": FixedModelSampler(model(1)),
                   "rho": RhoBallSampler(model(1), rho=0.5)}[extractor]
        matching = "embed_logit" if extractor == "rho" else "dm"
        return DistributionMatching(UniformClassSampler(x, y, k, 5), sampler, k,
                                    matching=matching, dsa=DSAConfig())

    def run(graph: bool) -> tuple[torch.Tensor, list[float]]:
        syn = SyntheticSet.noise(2, k, (1, 8, 8), torch.Generator().manual_seed(1))
        obj, g = objective(), torch.Generator().manual_seed(2)
        curve = []
        for _ in range(2):
            res = synthesize(syn, obj, 4, g, lr_img=0.5, momentum=0.9, weight_decay=1e-3,
                             graph=graph)
            curve += res.loss_curve
        return syn.images.detach(), curve

    (a, la), (b, lb) = run(False), run(True)
    assert torch.equal(a, b) and la == lb
    assert not_graphable(objective()) is None
    latent = DistributionMatching(UniformClassSampler(x, y, k, 5), FixedModelSampler(model(1)),
                                  k, latent_constraint=True)
    with pytest.raises(ValueError, match="latent constraint"):
        CapturedStep(latent, SyntheticSet.noise(2, k, (1, 8, 8), g0), 0.5, 0.9)

"""Differentiable siamese augmentation: explicit draws, identical siamese transforms, gradients."""

import pytest
import torch

from fedvl.distill.augment import (
    GROUPS,
    DSAConfig,
    apply_dsa,
    augment_batch,
    sample_dsa_params,
    siamese_dsa,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("group", GROUPS)
def test_each_group_changes_images_and_keeps_shape(group):
    x = torch.randn(6, 3, 16, 16, generator=_gen(1))
    # Flip with probability 1 so the flip group is guaranteed to act.
    cfg = DSAConfig(strategy=group, prob_flip=1.0)
    y = apply_dsa(x, sample_dsa_params(6, _gen(2), cfg, 16))
    assert y.shape == x.shape
    assert (y - x).abs().max() > 1e-3


def test_siamese_applies_identical_transform_and_is_differentiable():
    real = torch.randn(4, 3, 16, 16, generator=_gen(3))
    syn = real.clone().requires_grad_(True)
    for mode in ("S", "M"):
        for seed in range(6):
            ar, as_ = siamese_dsa(real, syn, _gen(seed), DSAConfig(mode=mode))
            # Same inputs + same draw -> same outputs, image by image.
            assert torch.allclose(ar, as_, atol=1e-6)
    _, as_ = siamese_dsa(real, syn, _gen(0), DSAConfig(mode="M"))
    (g,) = torch.autograd.grad(as_.square().sum(), syn)
    assert g.shape == syn.shape and g.abs().sum() > 0


def test_per_class_rows_shared_between_real_and_synthetic():
    real = torch.randn(6, 3, 16, 16, generator=_gen(4))
    yr = torch.tensor([0, 0, 1, 1, 2, 2])
    syn = real[[0, 2, 4]].clone()
    ys = torch.tensor([0, 1, 2])
    ar, as_ = siamese_dsa(real, syn, _gen(5), DSAConfig(mode="M"), yr, ys, 3)
    assert torch.allclose(ar[[0, 2, 4]], as_, atol=1e-6)
    # Different classes got different parameters: class 0's draw applied to class-1 images
    # differs from what class 1 got.
    p = sample_dsa_params(3, _gen(5), DSAConfig(mode="M"), 16)
    assert not torch.allclose(apply_dsa(real[2:3], p.select(torch.tensor([0]))), ar[2:3])


def test_generator_draw_does_not_touch_global_rng_and_is_reproducible():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    x = torch.randn(3, 3, 8, 8, generator=_gen(0))
    a = augment_batch(x, _gen(9))
    b = augment_batch(x, _gen(9))
    assert torch.equal(a, b)
    assert torch.equal(before, torch.random.get_rng_state())


def test_per_sample_params_differ_between_images():
    x = torch.randn(1, 3, 16, 16, generator=_gen(0)).repeat(8, 1, 1, 1)
    y = augment_batch(x, _gen(1), DSAConfig(strategy="rotate"))
    assert (y[0] - y[1]).abs().max() > 1e-3


def test_bad_strategy_and_mode_raise():
    with pytest.raises(ValueError, match="allowed"):
        sample_dsa_params(1, _gen(0), DSAConfig(strategy="color_blur"))
    with pytest.raises(ValueError, match="allowed: S, M"):
        sample_dsa_params(1, _gen(0), DSAConfig(mode="X"))

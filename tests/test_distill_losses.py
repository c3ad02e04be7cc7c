"""Matching losses: zero on identical inputs, positive otherwise, batched == per-class loop."""

import pytest
import torch

from fedvl.distill.losses import (
    class_means,
    distance_wb,
    embed_logit_loss,
    gradient_distance,
    mean_embedding_loss,
    mmd_loss,
)

K = 4




def _data(seed=0, n_real=40, n_syn=12, d=6):
    g = torch.Generator().manual_seed(seed)
    zr = torch.randn(n_real, d, generator=g)
    yr = torch.randint(0, K, (n_real,), generator=g)
    zs = torch.randn(n_syn, d, generator=g)
    ys = torch.arange(K).repeat_interleave(n_syn // K)
    return zr, yr, zs, ys


def _ref_kernel(a, b, kernel):
    if kernel == "linear":
        return a @ b.T
    if kernel == "polynomial":
        return (a @ b.T + 1) ** 2
    raise AssertionError


def _ref_mmd(zr, yr, zs, ys, kernel):
    total = 0.0
    for c in range(K):
        a, b = zr[yr == c], zs[ys == c]
        if len(a) == 0 or len(b) == 0:
            continue
        if kernel == "gaussian":
            z = torch.cat([a, b])
            d2 = torch.cdist(z, z) ** 2
            n = len(z)
            bw = d2.sum() / (n * n - n)
            kz = sum(torch.exp(-d2 / (bw * 2.0 ** (i - 2))) for i in range(5))
            kaa, kab, kbb = kz[: len(a), : len(a)], kz[: len(a), len(a):], kz[len(a):, len(a):]
        else:
            kaa, kab, kbb = (_ref_kernel(a, a, kernel), _ref_kernel(a, b, kernel),
                             _ref_kernel(b, b, kernel))
        total += kaa.mean() - 2 * kab.mean() + kbb.mean()
    return total


def test_class_means_hand_checked():
    z = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 5.0]])
    y = torch.tensor([0, 0, 2])
    m, c = class_means(z, y, 3)
    assert torch.equal(c, torch.tensor([2, 0, 1]))
    assert torch.allclose(m, torch.tensor([[2.0, 1.0], [0.0, 0.0], [5.0, 5.0]]))


def test_mean_embedding_batched_equals_loop_and_zero_on_identical():
    zr, yr, zs, ys = _data()
    ref = sum(((zr[yr == c].mean(0) - zs[ys == c].mean(0)) ** 2).sum() for c in range(K)
              if (yr == c).any())
    got = mean_embedding_loss(zr, yr, zs, ys, K)
    assert torch.allclose(got, ref, rtol=1e-5)
    assert got > 0
    assert mean_embedding_loss(zs, ys, zs.clone(), ys, K) == 0


@pytest.mark.parametrize("kernel", ["linear", "gaussian", "polynomial"])
def test_mmd_batched_equals_per_class_reference(kernel):
    zr, yr, zs, ys = _data(1)
    got = mmd_loss(zr, yr, zs, ys, K, kernel=kernel)
    ref = _ref_mmd(zr, yr, zs, ys, kernel)
    assert torch.allclose(got, torch.as_tensor(ref, dtype=got.dtype), rtol=1e-4, atol=1e-5)
    assert got > 0
    same = mmd_loss(zs, ys, zs.clone(), ys, K, kernel=kernel)
    assert abs(float(same)) < 1e-4


def test_linear_mmd_equals_mean_embedding_loss():
    zr, yr, zs, ys = _data(2)
    assert torch.allclose(mmd_loss(zr, yr, zs, ys, K), mean_embedding_loss(zr, yr, zs, ys, K),
                          rtol=1e-4)


def test_empty_class_is_skipped():
    zr, yr, zs, ys = _data(3)
    keep = yr != 1
    per = mean_embedding_loss(zr[keep], yr[keep], zs, ys, K, per_class=True)
    assert per[1] == 0 and per[0] > 0


def test_embed_logit_loss_adds_logit_term():
    zr, yr, zs, ys = _data(4)
    lr, ls = zr[:, :3] * 2, zs[:, :3] * 2
    both = embed_logit_loss(zr, lr, yr, zs, ls, ys, K)
    assert torch.allclose(both, mean_embedding_loss(zr, yr, zs, ys, K)
                          + mean_embedding_loss(lr, yr, ls, ys, K))
    assert embed_logit_loss(zs, ls, ys, zs, ls, ys, K) == 0


def test_distance_wb_rows_and_ignores_1d():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(4, 3, 3, 3, generator=g)
    b = torch.randn(4, 3, 3, 3, generator=g)
    ref = sum(1 - torch.dot(a[i].flatten(), b[i].flatten())
              / (a[i].norm() * b[i].norm() + 1e-6) for i in range(4))
    assert torch.allclose(distance_wb(a, b), ref, atol=1e-5)
    assert distance_wb(a, a) < 1e-4
    assert distance_wb(torch.randn(5), torch.randn(5)) == 0
    # A positive rescaling of a row leaves the layer-wise cosine distance unchanged.
    assert distance_wb(a, 3 * a) < 1e-4


@pytest.mark.parametrize("metric", ["ours", "mse", "cos"])
def test_gradient_distance_batched_equals_loop(metric):
    g = torch.Generator().manual_seed(6)
    gs = [torch.randn(K, 5, 2, 3, 3, generator=g), torch.randn(K, 5, generator=g),
          torch.randn(K, 3, 8, generator=g)]
    gr = [torch.randn_like(t) for t in gs]
    batched = gradient_distance(gs, gr, metric, batched=True)
    loop = torch.stack([gradient_distance([t[c] for t in gs], [t[c] for t in gr], metric)
                        for c in range(K)])
    assert torch.allclose(batched, loop, atol=1e-5)
    assert (batched > 0).all()
    assert gradient_distance([t[0] for t in gs], [t[0] for t in gs], metric).abs() < 1e-4


def test_unknown_kernel_and_metric():
    zr, yr, zs, ys = _data()
    with pytest.raises(ValueError, match="allowed"):
        mmd_loss(zr, yr, zs, ys, K, kernel="laplace")
    with pytest.raises(ValueError, match="allowed"):
        gradient_distance([zr], [zr], "l1")

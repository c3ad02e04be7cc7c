"""The ConvNet's 2x2 average pool computes exactly what torch's kernel computes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedvl.models.convnet import ConvNet
from fedvl.models.pooling import STRIDED_MAX_NUMEL, AvgPool2x2, _strided_pays, avg_pool_2x2


@pytest.mark.parametrize("shape", [(4, 3, 8, 8), (2, 5, 28, 28), (3, 2, 10, 6), (2, 2, 7, 7),
                                   (1, 1, 32, 32)])
def test_forward_and_backward_are_bitwise_the_kernels(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    # Odd sides take the kernel itself; the others the strided sum.
    assert _strided_pays(x) == (shape[2] % 2 == 0 and shape[3] % 2 == 0)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = F.avg_pool2d(a, 2, 2), avg_pool_2x2(b)
    assert torch.equal(ya, yb)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(1))
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(a.grad, b.grad)


def test_second_derivatives_match_the_kernels():
    # Gradient matching differentiates through a gradient, so the backward must be differentiable.
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    out = []
    for pool in (lambda t: F.avg_pool2d(t, 2, 2), avg_pool_2x2):
        xi = x.clone().requires_grad_()
        w = torch.ones(2, 3, 3, 3, requires_grad=True)
        (gx,) = torch.autograd.grad((pool(xi.pow(3)) * w).sum(), xi, create_graph=True)
        (gw,) = torch.autograd.grad(gx.pow(2).sum(), w)
        out.append(gw)
    assert torch.allclose(out[0], out[1], rtol=1e-6, atol=1e-6)
    assert out[1].abs().sum() > 0


def test_large_activations_use_the_kernel_with_equal_results():
    x = torch.zeros(STRIDED_MAX_NUMEL // 16 + 1, 1, 4, 4)  # past the limit
    assert not _strided_pays(x)
    assert torch.equal(avg_pool_2x2(x), F.avg_pool2d(x, 2, 2))
    # Rows of 32 floats take the kernel from a smaller size on; 28-float rows do not.
    assert not _strided_pays(torch.zeros(128, 32, 32, 32))
    assert _strided_pays(torch.zeros(420, 32, 28, 28))


def test_a_convnet_trains_to_identical_weights_with_either_pool():
    torch.manual_seed(0)
    fast = ConvNet(3, 10, 28, width=8, depth=3)
    slow = copy.deepcopy(fast)
    for i, layer in enumerate(slow.features):
        if isinstance(layer, AvgPool2x2):
            slow.features[i] = nn.AvgPool2d(2, 2)
    assert any(isinstance(m, AvgPool2x2) for m in fast.modules())
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 3, 28, 28, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    for model in (fast, slow):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    for p, q in zip(fast.parameters(), slow.parameters(), strict=True):
        assert torch.equal(p, q)

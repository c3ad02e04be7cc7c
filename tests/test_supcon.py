"""The shared SupCon loss against a hand-computed example."""

from __future__ import annotations

import math

import pytest
import torch

from fedvl.core.contrastive import supcon_loss


def _reference(feats: list[list[float]], labels: list[int], t: float, tb: float,
               normalize: bool = True) -> float:
    """Explicit loops over anchors, positives and the denominator (no vectorisation)."""
    z = []
    for f in feats:
        n = math.sqrt(sum(v * v for v in f)) if normalize else 1.0
        z.append([v / n for v in f])
    total = 0.0
    for i in range(len(z)):
        denom = sum(math.exp(sum(a * b for a, b in zip(z[i], z[j], strict=True)) / t)
                    for j in range(len(z)) if j != i)
        pos = [j for j in range(len(z)) if j != i and labels[j] == labels[i]]
        if not pos:
            continue  # an anchor without positives contributes 0 but still counts in the mean
        s = 0.0
        for p in pos:
            sim = sum(a * b for a, b in zip(z[i], z[p], strict=True)) / t
            s += sim - math.log(denom)
        total += -(t / tb) * s / len(pos)
    return total / len(z)


def test_supcon_matches_hand_computed_example():
    feats = [[1.0, 0.0], [0.8, 0.6], [0.0, 2.0], [-1.0, 1.0], [3.0, -1.0]]
    labels = [0, 0, 1, 1, 2]  # label 2 has no positive
    for t, tb in ((0.07, 0.07), (0.5, 0.07), (1.0, 1.0)):
        got = supcon_loss(torch.tensor(feats), torch.tensor(labels), t, tb)
        assert float(got) == pytest.approx(_reference(feats, labels, t, tb), rel=1e-5)
    # DESA's Eq. 5 as printed: raw products psi(x_j) . psi(x_p) / tau, no normalisation.
    got = supcon_loss(torch.tensor(feats), torch.tensor(labels), 0.5, 0.5, normalize=False)
    assert float(got) == pytest.approx(_reference(feats, labels, 0.5, 0.5, False), rel=1e-5)


def test_supcon_tiny_closed_form():
    # Two identical unit vectors of one class + one orthogonal of another, T = 1:
    # anchors 0 and 1: -(1 - log(e^1 + e^0)); anchor 2 has no positive -> 0; mean over 3.
    f = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 0, 1])
    expected = 2 * -(1.0 - math.log(math.e + 1.0)) / 3
    assert float(supcon_loss(f, y, 1.0, 1.0)) == pytest.approx(expected, rel=1e-6)


def test_supcon_is_scale_invariant_and_differentiable():
    g = torch.Generator().manual_seed(0)
    f = torch.randn(12, 5, generator=g, requires_grad=True)
    y = torch.randint(0, 3, (12,), generator=g)
    a = supcon_loss(f, y)
    b = supcon_loss(3.0 * f, y)
    assert torch.allclose(a, b, atol=1e-5)
    a.backward()
    assert f.grad is not None and torch.isfinite(f.grad).all()
    # Raw products of large features: every other product may be far below a sample's own.
    raw = (30.0 * f.detach()).requires_grad_(True)
    loss = supcon_loss(raw, y, normalize=False)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(raw.grad).all()
    with pytest.raises(ValueError, match="labels must have shape"):
        supcon_loss(f, y[:3])

"""MOON's model-contrastive term on small hand-made tensors."""

from __future__ import annotations

import math

import torch
from torch import nn

from fedvl.algorithms.moon import ModelContrastiveTerm


class FixedEmbedding(nn.Module):
    """A stand-in model whose embedding of any batch is a given tensor."""

    def __init__(self, z: torch.Tensor) -> None:
        super().__init__()
        self.z = z

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.z


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(p * q for p, q in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(p * p for p in a)) * math.sqrt(sum(q * q for q in b)))


def test_moon_term_equals_hand_computed_contrastive_ce():
    g = torch.Generator().manual_seed(0)
    z, zg, zp = (torch.randn(5, 4, generator=g) for _ in range(3))
    mu, t = 0.7, 0.5
    term = ModelContrastiveTerm(FixedEmbedding(zg), FixedEmbedding(zp), mu, t)
    x = torch.zeros(5, 1)
    got = float(term(None, x, torch.zeros(5, dtype=torch.long), z, torch.zeros(5, 2)))
    # mu * mean_i -log( e^{cos(z,zg)/T} / (e^{cos(z,zg)/T} + e^{cos(z,zp)/T}) )
    want = 0.0
    for i in range(5):
        pos = _cos(z[i].tolist(), zg[i].tolist()) / t
        neg = _cos(z[i].tolist(), zp[i].tolist()) / t
        want += -(pos - math.log(math.exp(pos) + math.exp(neg)))
    assert math.isclose(got, mu * want / 5, rel_tol=1e-5)


def test_moon_term_pulls_toward_global_and_pushes_from_previous():
    g = torch.Generator().manual_seed(1)
    zg, zp = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    term = ModelContrastiveTerm(FixedEmbedding(zg), FixedEmbedding(zp), 1.0, 0.5)
    x, y, lg = torch.zeros(6, 1), torch.zeros(6, dtype=torch.long), torch.zeros(6, 2)
    at_global = float(term(None, x, y, zg.clone(), lg))
    at_prev = float(term(None, x, y, zp.clone(), lg))
    assert at_global < math.log(2) < at_prev
    # A gradient step on z moves it toward z_g (cosine up) and away from z_p (cosine down).
    z = torch.randn(6, 8, generator=g, requires_grad=True)
    term(None, x, y, z, lg).backward()
    z2 = (z - 0.1 * z.grad).detach()
    cos = torch.nn.functional.cosine_similarity
    assert (cos(z2, zg) - cos(z.detach(), zg)).mean() > 0
    assert (cos(z2, zp) - cos(z.detach(), zp)).mean() < 0

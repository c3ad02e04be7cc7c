"""Supervised contrastive loss (Khosla et al. 2020), single view, as FedLGD/DESA/VHL use it.

For L2-normalised features z_i and temperature T, with s_ij = z_i . z_j / T:
    l_i = -(T / T_base) * 1/|P(i)| * sum_{p in P(i)} [ s_ip - log sum_{a != i} exp(s_ia) ]
where P(i) = {j != i : y_j = y_i}. Anchors with no positive contribute 0, and the loss is the
mean of l_i over *all* anchors (those zeros included). Every method that needs SupCon calls this
one function; which side is detached is the caller's choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supcon_loss(features: torch.Tensor, labels: torch.Tensor, temperature: float = 0.07,
                base_temperature: float = 0.07, normalize: bool = True) -> torch.Tensor:
    """Batched SupCon of `features` (N, D) with integer `labels` (N,); returns a scalar.

    `normalize=False` scores raw dot products (DESA's Eq. 5 as printed) instead of cosines.
    """
    if features.dim() != 2:
        raise ValueError(f"supcon_loss expects (N, D) features, got shape {tuple(features.shape)}")
    if labels.shape != (features.shape[0],):
        raise ValueError(f"supcon_loss labels must have shape ({features.shape[0]},), "
                         f"got {tuple(labels.shape)}")
    n = features.shape[0]
    if n < 2:
        return features.sum() * 0.0
    z = F.normalize(features, dim=1) if normalize else features
    sim = z @ z.T / temperature
    self_mask = torch.eye(n, dtype=torch.bool, device=features.device)
    # Subtracting the (detached) row maximum does not change the value; it avoids overflow.
    # Raw products take it over the other samples: a sample's product with itself can exceed
    # every other by so much that all of them would underflow to 0.
    shift = sim if normalize else sim.masked_fill(self_mask, float("-inf"))
    sim = sim - shift.max(dim=1, keepdim=True).values.detach()
    exp = torch.exp(sim.masked_fill(self_mask, float("-inf")))
    log_prob = sim - torch.log(exp.sum(dim=1, keepdim=True))
    pos = (labels[:, None] == labels[None, :]) & ~self_mask
    pos_f = pos.to(log_prob.dtype)
    mean_pos = log_prob.masked_fill(~pos, 0.0).sum(dim=1) / pos_f.sum(dim=1).clamp(min=1.0)
    return -(temperature / base_temperature) * mean_pos.mean()

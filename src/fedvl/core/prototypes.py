"""Per-class means of a model's outputs: the loss term that pulls toward served class means
while collecting the client's own, and their pooling on the server (FedHe, FedProto)."""

from __future__ import annotations

import torch

from fedvl.models.base import FedModel


class ClassMeanTerm:
    """weight * MSE(out[y], target[y]) on the samples whose class has a target; it also sums
    `out` per class (detached) over every step, for the per-class means a client uploads.

    `use_logits` picks the model output it acts on: logits (FedHe) or the embedding (FedProto).
    """

    def __init__(self, target: torch.Tensor | None, has: torch.Tensor | None, weight: float,
                 num_classes: int, use_logits: bool) -> None:
        self.target, self.has, self.w, self.k = target, has, weight, num_classes
        self.use_logits = use_logits
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def __call__(self, model: FedModel, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        out = logits if self.use_logits else z
        with torch.no_grad():
            if self.sums is None or self.counts is None:
                self.sums = torch.zeros(self.k, out.shape[1], device=out.device)
                self.counts = torch.zeros(self.k, device=out.device)
            # On the outputs' device: no host round trip per step.
            self.sums.index_add_(0, y, out.detach())
            self.counts.index_add_(0, y, torch.ones_like(y, dtype=self.counts.dtype))
        if self.target is None or self.has is None or self.w == 0:
            return out.new_zeros(())
        keep = self.has[y]
        # Samples without a target contribute a zero residual, as the reference (which
        # substitutes the sample's own output there) does; the mean runs over the whole batch.
        diff = torch.where(keep[:, None], out - self.target[y], torch.zeros_like(out))
        return self.w * (diff ** 2).mean()

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-class means of the outputs seen in training (zeros for absent classes), counts."""
        assert self.sums is not None and self.counts is not None
        return self.sums / self.counts.clamp_min(1)[:, None], self.counts.clone()


def pool_class_means(replies: list[tuple[torch.Tensor, torch.Tensor]], weighted: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class: the count-weighted (or plain, over holders) mean of the clients' class means,
    and the total count (0: no client holds the class)."""
    sums, counts, holders = None, None, None
    for m, n in replies:
        m, n = m.float().cpu(), n.float().cpu()
        w = n if weighted else (n > 0).float()
        part = m * w[:, None]
        sums = part if sums is None else sums + part
        counts = n if counts is None else counts + n
        holders = w if holders is None else holders + w
    assert sums is not None and counts is not None and holders is not None
    return sums / holders.clamp_min(1e-12)[:, None], counts

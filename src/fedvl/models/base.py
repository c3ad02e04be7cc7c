"""Common model interface: features via `embed`, logits via `head`."""

from __future__ import annotations

import abc
import inspect

import torch
from torch import nn

from fedvl.defaults import ALTERNATE
from fedvl.registry import MODELS
from fedvl.seeding import on_cpu, seeded


class FedModel(nn.Module, abc.ABC):
    """A classifier whose forward is `head(embed(x))`; subclasses define both halves."""

    feature_dim: int
    num_classes: int

    @abc.abstractmethod
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Flattened features before the classifier."""

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Logits from features."""
        return self.classifier(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both the embedding and the logits from one forward pass."""
        z = self.embed(x)
        return z, self.head(z)


def has_batch_stats(model: nn.Module) -> bool:
    """Whether any layer normalises with batch statistics (BatchNorm)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def norm_layer(kind: str, channels: int, spatial: tuple[int, int] | None = None) -> nn.Module:
    """Normalisation layer by name (instance/group/batch/layer/none)."""
    if kind == "instance":
        # The dataset-condensation ConvNet's "instancenorm" is GroupNorm with one group per channel.
        return nn.GroupNorm(channels, channels, affine=True)
    if kind == "group":
        return nn.GroupNorm(min(4, channels), channels, affine=True)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "layer":
        if spatial is None:
            raise ValueError("layer norm needs the spatial size")
        return nn.LayerNorm([channels, *spatial])
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm '{kind}'; allowed: instance, group, batch, layer, none")


def build_model(
    name: str,
    in_channels: int,
    num_classes: int,
    image_size: int,
    seed: int | None = None,
    **kwargs: object,
) -> FedModel:
    """Build a registered model; `seed` makes its initialisation reproducible."""
    factory = MODELS.get(name)
    fixed = {"in_channels", "num_classes", "image_size"}
    allowed = set(inspect.signature(factory).parameters) - fixed
    bad = sorted(set(kwargs) - allowed)
    if bad:
        raise ValueError(
            f"model '{name}' does not take option(s) {bad}; allowed: {sorted(allowed)}"
        )
    for key in ("width", "depth"):
        v = kwargs.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"model option '{key}' must be an integer >= 1, got {v!r}")
    # Built on the CPU whatever the run's device (callers move it): the seeded init draws from
    # the CPU generator, so a seed gives the same network on every device.
    with on_cpu():
        if seed is None:
            return factory(in_channels=in_channels, num_classes=num_classes,
                           image_size=image_size, **kwargs)
        # The caller's global RNG stays untouched and the init depends only on `seed`.
        with seeded(seed):
            return factory(in_channels=in_channels, num_classes=num_classes,
                           image_size=image_size, **kwargs)


# `--client-models alternate` (ALTERNATE): DESA's assignment, ConvNet and AlexNet on
# alternating clients.
ALTERNATE_MODELS = ("convnet", "alexnet")


def client_architectures(default: str, spec: list[str] | None, num_clients: int) -> list[str]:
    """The model name of every client: `spec` cycled over the clients, or `default` for all."""
    names = list(ALTERNATE_MODELS) if spec == [ALTERNATE] else (spec or [default])
    return [names[i % len(names)] for i in range(num_clients)]


def model_options(name: str, options: dict[str, object]) -> dict[str, object]:
    """The subset of `options` that model `name` accepts (e.g. `width` for every model, `depth`
    and `norm` for the ConvNet), so one set of run options serves mixed architectures."""
    accepted = set(inspect.signature(MODELS.get(name)).parameters)
    return {k: v for k, v in options.items() if k in accepted}


def infer_feature_dim(trunk: nn.Module, in_channels: int, image_size: int) -> int:
    """Feature size of a conv trunk from one dummy forward pass."""
    with torch.no_grad():
        out = trunk(torch.zeros(2, in_channels, image_size, image_size, device="cpu"))
    return int(out.flatten(1).shape[1])

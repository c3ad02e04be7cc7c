"""Models split into `embed` (features) and `head` (classifier), built by name."""

from fedvl.models import alexnet, convnet, resnet  # noqa: F401  (registers models)
from fedvl.models.base import FedModel, build_model

__all__ = ["FedModel", "build_model"]

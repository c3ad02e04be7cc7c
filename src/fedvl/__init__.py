"""fedvl: federated virtual learning on one message-based core.

Importing the package makes every built-in method, add-on, benchmark, model and virtual-data
generator available: the first read of a `fedvl.registry` table imports the subpackages, whose
decorators fill the tables (the registry itself imports nothing of fedvl). Importing them only
then keeps torch out of commands that look nothing up (`fedvl --help` starts in a fraction of
the time).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from fedvl import registry as _registry

__version__ = "0.1.0"

_BUILTINS = ("algorithms", "data", "models", "virtual")


def _register_builtins() -> None:
    from fedvl import algorithms, data, models, virtual  # noqa: F401  (their imports register)


_registry.on_first_use(_register_builtins)


def __getattr__(name: str) -> ModuleType:
    """`fedvl.algorithms` and the other built-in subpackages, imported on first access."""
    if name in _BUILTINS:
        return importlib.import_module(f"fedvl.{name}")
    raise AttributeError(f"module 'fedvl' has no attribute '{name}'")

"""Name -> factory registries so configs and the CLI name things instead of importing them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Registry:
    """A named table of factories with clear errors for unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that records `obj` under `name`."""

        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> Any:
        """Return the factory for `name` or raise naming the allowed values."""
        _load_builtins()
        if name not in self._items:
            allowed = ", ".join(sorted(self._items))
            raise KeyError(f"unknown {self.kind} '{name}'; allowed: {allowed}")
        return self._items[name]

    def names(self) -> list[str]:
        """Sorted registered names."""
        _load_builtins()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        _load_builtins()
        return name in self._items


ALGORITHMS = Registry("method")
MODELS = Registry("model")
BENCHMARKS = Registry("benchmark")

register_algorithm = ALGORITHMS.register
register_model = MODELS.register
register_benchmark = BENCHMARKS.register

_loaded = False


def _load_builtins() -> None:
    # Importing the packages runs their @register decorators; done lazily to avoid import cycles.
    global _loaded
    if _loaded:
        return
    _loaded = True
    import fedvl.algorithms  # noqa: F401
    import fedvl.data  # noqa: F401
    import fedvl.models  # noqa: F401

"""Name -> factory registries so configs and the CLI name things instead of importing them.

A leaf: it imports nothing of fedvl. The packages register their built-ins when imported;
`import fedvl` installs a loader (`on_first_use`) that imports them all the first time any table
is read, so a command that never looks a name up (`fedvl --help`) never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Run once, before any table is first read: the package's "import every built-in" hook.
_loaders: list[Callable[[], None]] = []


def on_first_use(loader: Callable[[], None]) -> None:
    """Run `loader` (which registers built-ins) before any registry is first read."""
    _loaders.append(loader)


def _load() -> None:
    # Popped before running: a table read while the loader imports (a registration) must not
    # start it again.
    while _loaders:
        _loaders.pop(0)()


class Registry:
    """A named table of factories with clear errors for unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._table: dict[str, Any] = {}

    @property
    def _items(self) -> dict[str, Any]:
        _load()
        return self._table

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that records `obj` under `name`."""

        def deco(obj: T) -> T:
            # The table itself, not `_items`: registering is what the loader does.
            if name in self._table and self._table[name] is not obj:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._table[name] = obj
            return obj

        return deco

    def get(self, name: str) -> Any:
        """Return the factory for `name` or raise naming the allowed values."""
        if name not in self._items:
            allowed = ", ".join(sorted(self._items))
            raise KeyError(f"unknown {self.kind} '{name}'; allowed: {allowed}")
        return self._items[name]

    def get_or_none(self, name: str) -> Any:
        """The factory for `name`, or None."""
        return self._items.get(name)

    def names(self) -> list[str]:
        """Sorted registered names."""
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


class MethodRegistry(Registry):
    """Methods, plus composed names `base+addon` (an add-on mixed into a base method).

    This class only resolves and checks the names; building the `fedprox+vhl` class is the
    `composer` that `fedvl.algorithms.compose` installs (the same name always gives the same
    class object). Registering a method sets its `name` to the registered name.
    """

    def __init__(self, kind: str, addons: Registry) -> None:
        super().__init__(kind)
        self.addons = addons
        self.composer: Callable[[type, type, str], type] | None = None

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that records a method class under `name` and sets its `name`."""
        record = super().register(name)

        def deco(cls: T) -> T:
            record(cls)
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def get(self, name: str) -> Any:
        """The class of a plain or a composed method name, or a KeyError naming what exists."""
        if "+" not in name:
            if name not in self._items:
                raise KeyError(f"unknown {self.kind} '{name}'; allowed: "
                               f"{', '.join(sorted(self._items))}; or BASE+ADDON ({self._help()})")
            return self._items[name]
        base_name, _, addon_name = name.partition("+")
        if "+" in addon_name:
            raise KeyError(f"method '{name}' combines more than one add-on; use BASE+ADDON "
                           f"with one add-on ({self._help()})")
        bases = self.base_names()
        if base_name not in bases:
            raise KeyError(f"unknown base method '{base_name}' in '{name}'; {self._help()}")
        addon = self.addons.get_or_none(addon_name)
        if addon is None:
            raise KeyError(f"unknown add-on '{addon_name}' in '{name}'; {self._help()}")
        base = super().get(base_name)
        if not addon.compatible(base):
            ok = [b for b in bases if addon.compatible(self._items[b])]
            raise KeyError(f"add-on '{addon_name}' cannot be combined with '{base_name}'; "
                           f"compatible bases: {', '.join(ok)}")
        if self.composer is None:
            raise KeyError(f"method '{name}' needs fedvl.algorithms.compose, which is not loaded")
        return self.composer(base, addon, name)

    def __contains__(self, name: str) -> bool:
        try:
            self.get(name)
        except KeyError:
            return False
        return True

    def base_names(self) -> list[str]:
        """Registered methods that are not themselves composed (may take an add-on)."""
        return sorted(n for n, c in self._items.items() if not getattr(c, "addon_name", None))

    def names(self) -> list[str]:
        """Registered names, then every valid `base+addon` combination."""
        out = sorted(self._items)
        for a in self.addons.names():
            cls = self.addons.get(a)
            out += [f"{b}+{a}" for b in self.base_names() if cls.compatible(self._items[b])]
        return out

    def _help(self) -> str:
        return (f"bases: {', '.join(self.base_names())}; "
                f"add-ons: {', '.join(self.addons.names()) or '(none)'}")


ADDONS = Registry("add-on")
ALGORITHMS = MethodRegistry("method", ADDONS)
MODELS = Registry("model")
BENCHMARKS = Registry("benchmark")
VIRTUAL_GENERATORS = Registry("virtual-data generator")

register_algorithm = ALGORITHMS.register
register_addon = ADDONS.register
register_virtual_generator = VIRTUAL_GENERATORS.register
register_model = MODELS.register
register_benchmark = BENCHMARKS.register

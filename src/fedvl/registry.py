"""Name -> factory registries so configs and the CLI name things instead of importing them."""

from __future__ import annotations

import dataclasses
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

    def get_or_none(self, name: str) -> Any:
        """The factory for `name`, or None."""
        _load_builtins()
        return self._items.get(name)

    def names(self) -> list[str]:
        """Sorted registered names."""
        _load_builtins()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        _load_builtins()
        return name in self._items


class MethodRegistry(Registry):
    """Methods, plus composed names `base+addon` (an add-on mixed into a base method).

    `fedprox+vhl` is built on first use as `type("fedprox+vhl", (VHLAddon, FedProx), ...)`
    with the two Params dataclasses merged (see `compose`); the same name always gives the
    same class object.
    """

    def __init__(self, kind: str, addons: Registry) -> None:
        super().__init__(kind)
        self.addons = addons

    def get(self, name: str) -> Any:
        if "+" not in name:
            _load_builtins()
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
        return compose(base, addon, name)

    def __contains__(self, name: str) -> bool:
        try:
            self.get(name)
        except KeyError:
            return False
        return True

    def base_names(self) -> list[str]:
        """Registered methods that are not themselves composed (may take an add-on)."""
        _load_builtins()
        return sorted(n for n, c in self._items.items() if not getattr(c, "addon_name", None))

    def names(self) -> list[str]:
        """Registered names, then every valid `base+addon` combination."""
        _load_builtins()
        out = sorted(self._items)
        for a in self.addons.names():
            cls = self.addons.get(a)
            out += [f"{b}+{a}" for b in self.base_names() if cls.compatible(self._items[b])]
        return out

    def _help(self) -> str:
        _load_builtins()
        return (f"bases: {', '.join(self.base_names())}; "
                f"add-ons: {', '.join(self.addons.names()) or '(none)'}")


def _merge_params(base: type, addon: type) -> type:
    """One dataclass with the fields of both Params classes; `check` runs both checks."""
    fields = []
    seen: dict[str, type] = {}
    for owner in (base.Params, addon.Params):
        for f in dataclasses.fields(owner):
            if f.name in seen:
                raise ValueError(f"option '{f.name}' is defined by both {seen[f.name].__name__} "
                                 f"and {owner.__name__}")
            seen[f.name] = owner
            default = (dataclasses.field(default=f.default)
                       if f.default is not dataclasses.MISSING
                       else dataclasses.field(default_factory=f.default_factory))
            fields.append((f.name, f.type, default))
    checks = [c for c in (getattr(base.Params, "check", None), getattr(addon.Params, "check", None))
              if callable(c)]

    def check(self: Any) -> None:
        for c in checks:
            c(self)

    return dataclasses.make_dataclass(f"{base.__name__}{addon.__name__}Params", fields,
                                      namespace={"check": check})


_COMPOSED: dict[tuple[type, type, str], type] = {}


def compose(base: type, addon: type, name: str) -> type:
    """The class `name` = `addon` mixed in front of `base` (cached)."""
    key = (base, addon, name)
    if key not in _COMPOSED:
        _COMPOSED[key] = type(f"{base.__name__}+{addon.__name__}", (addon, base), {
            "name": name, "Params": _merge_params(base, addon),
            "base_name": getattr(base, "name", base.__name__),
            "addon_name": getattr(addon, "addon_name", addon.__name__),
            "__doc__": f"{addon.__doc__ or addon.__name__} Composed with {base.__name__}.",
        })
    return _COMPOSED[key]


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
    import fedvl.virtual  # noqa: F401

"""Add-ons composed with base methods: `fedprox+vhl` = the VHL mixin in front of FedProx.

The method registry resolves and checks `BASE+ADDON` names; this module builds the class
(once per name) with the two Params dataclasses merged, and installs itself as the
registry's composer when imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedvl.algorithms.base import Algorithm
from fedvl.registry import ALGORITHMS


def merge_params(base: type, addon: type) -> type:
    """One dataclass with the fields of both Params classes; `check` runs both checks."""
    fields = []
    seen: dict[str, type] = {}
    for owner in (base.Params, addon.Params):
        for f in dataclasses.fields(owner):
            if f.name in seen:
                raise ValueError(f"option '{f.name}' is defined by both {seen[f.name].__name__} "
                                 f"and {owner.__name__}")
            seen[f.name] = owner
            # Metadata carries each option's help and limits into the merged class.
            default = (dataclasses.field(default=f.default, metadata=f.metadata)
                       if f.default is not dataclasses.MISSING
                       else dataclasses.field(default_factory=f.default_factory,
                                              metadata=f.metadata))
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
    # The registry only composes registered methods.
    assert issubclass(base, Algorithm), base
    key = (base, addon, name)
    if key not in _COMPOSED:
        _COMPOSED[key] = type(f"{base.__name__}+{addon.__name__}", (addon, base), {
            "name": name, "Params": merge_params(base, addon),
            **{f"{p}_args": {**getattr(base, f"{p}_args"), **getattr(addon, f"{p}_args", {})}
               for p in ("smoke", "quickstart", "paper")},
            # The base's rounds: an add-on's paper runs another method.
            "paper_run": dict(base.paper_run),
            "addon_name": getattr(addon, "addon_name", addon.__name__),
            "__doc__": f"{addon.__doc__ or addon.__name__} Composed with {base.__name__}.",
        })
    return _COMPOSED[key]


ALGORITHMS.composer = compose

"""Options declared once: dataclass fields carry their help and limits in `metadata`.

    @dataclass
    class Params:
        mu: float = option(0.01, "weight of the proximal term", ge=0)

From that one declaration come the type checks and conversions of YAML / run-config values
(`from_mapping`), the limit checks (`check_options`), the command-line flags (`add_flags`,
`values_from_args`) and the plain dict written back to YAML (`to_dict`). Every error names the
option, what was given and what is allowed. Fields declared without `option` (plain dataclass
fields) get the type checks only.

An option may also declare where a hyperparameter search looks for it (`tune=LogUniform(1e-3,
1e-1)`, `IntRange(1, 5)`, `Choice(0.0, 0.9)`); `search_space` collects those of a class and
`fedvl tune` searches them. The spaces are plain values: nothing here imports a search library.

A class may group its options in sections (`section`: a field holding another dataclass of
options). Flags, mappings and errors still name each option by its own flat name
(`option_fields`), so such a class takes its options by flat name in its constructor.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any

# The largest float32 (torch.finfo(torch.float32).max): numbers options carry into training.
FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1
# The smallest normal float32 (torch.finfo(torch.float32).tiny).
FLOAT32_TINY = 1.1754943508222875e-38


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and what is allowed."""


# -- search spaces ---------------------------------------------------------------------------
# Each space draws through a trial object with Optuna's `suggest_*` methods (duck-typed, so the
# options stay free of the search library).
@dataclass(frozen=True)
class LogUniform:
    """A float drawn log-uniformly from [low, high] (learning rates, loss weights)."""

    low: float
    high: float

    def suggest(self, trial: Any, name: str) -> float:
        """Draw the value of option `name` for `trial`."""
        return float(trial.suggest_float(name, self.low, self.high, log=True))

    def values(self) -> tuple[Any, ...]:
        """The values at the ends of the space (what its option must accept)."""
        return (self.low, self.high)

    def describe(self) -> str:
        """The space as the docs' table shows it."""
        return f"log-uniform [{self.low:g}, {self.high:g}]"


@dataclass(frozen=True)
class Uniform:
    """A float drawn uniformly from [low, high]."""

    low: float
    high: float

    def suggest(self, trial: Any, name: str) -> float:
        """Draw the value of option `name` for `trial`."""
        return float(trial.suggest_float(name, self.low, self.high))

    def values(self) -> tuple[Any, ...]:
        """The values at the ends of the space (what its option must accept)."""
        return (self.low, self.high)

    def describe(self) -> str:
        """The space as the docs' table shows it."""
        return f"uniform [{self.low:g}, {self.high:g}]"


@dataclass(frozen=True)
class IntRange:
    """An integer drawn from low, low + 1, ..., high (log-uniformly with `log`)."""

    low: int
    high: int
    log: bool = False

    def suggest(self, trial: Any, name: str) -> int:
        """Draw the value of option `name` for `trial`."""
        return int(trial.suggest_int(name, self.low, self.high, log=self.log))

    def values(self) -> tuple[Any, ...]:
        """The values at the ends of the space (what its option must accept)."""
        return (self.low, self.high)

    def describe(self) -> str:
        """The space as the docs' table shows it."""
        return f"integer {self.low} to {self.high}" + (", log-uniform" if self.log else "")


class Choice:
    """One of a few values (numbers, strings, true/false)."""

    def __init__(self, *options: Any) -> None:
        """The values to choose from, in order."""
        if not options:
            raise ValueError("Choice needs at least one value")
        self.options = tuple(options)

    def suggest(self, trial: Any, name: str) -> Any:
        """Draw the value of option `name` for `trial`."""
        return trial.suggest_categorical(name, self.options)

    def values(self) -> tuple[Any, ...]:
        """Every value of the space (what its option must accept)."""
        return self.options

    def describe(self) -> str:
        """The space as the docs' table shows it."""
        return "one of " + ", ".join(f"{v:g}" if isinstance(v, float) else str(v)
                                     for v in self.options)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Choice) and self.options == other.options

    def __hash__(self) -> int:
        return hash(self.options)

    def __repr__(self) -> str:
        return f"Choice{self.options!r}"


Space = LogUniform | Uniform | IntRange | Choice


@dataclass(frozen=True)
class Spec:
    """What one option declares beyond its type and default."""

    help: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    # A sequence, or a callable giving one (registered names are known only at run time).
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None
    # A rule the limits above cannot say, and the text that explains it.
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    cli: bool = True
    flag: str | None = None
    # An upper bound that larger values are clipped to, not refused for (per-client caps:
    # "at most N images" with N past any dataset means "all of them").
    clip: int | None = None
    # Where `fedvl tune` searches this option (None: it is never searched).
    tune: Space | None = None


_KEY = "fedvl.option"


def option(default: Any = MISSING, help: str = "", *,
           factory: Callable[[], Any] | None = None, ge: float | None = None,
           gt: float | None = None, le: float | None = None, lt: float | None = None,
           choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
           check: Callable[[Any], bool] | None = None, allowed: str = "", cli: bool = True,
           flag: str | None = None, clip: int | None = None, tune: Space | None = None) -> Any:
    """A dataclass field whose help, limits, choices and search space travel in its metadata."""
    spec = Spec(help=help, ge=ge, gt=gt, le=le, lt=lt, choices=choices, check=check,
                allowed=allowed, cli=cli, flag=flag, clip=clip, tune=tune)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={_KEY: spec})
    return dataclasses.field(default=default, metadata={_KEY: spec})


def spec_of(f: dataclasses.Field) -> Spec:
    """The field's declared Spec (an empty one for plain fields)."""
    return f.metadata.get(_KEY) or Spec()


_SECTION = "fedvl.section"


def section(cls: type) -> Any:
    """A dataclass field holding a group of options, an instance of the dataclass `cls`."""
    return dataclasses.field(default_factory=cls, metadata={_SECTION: cls})


def section_class(f: dataclasses.Field) -> type | None:
    """The options class of a `section` field (None for an option)."""
    return f.metadata.get(_SECTION)


def option_fields(cls: Any) -> list[dataclasses.Field]:
    """Every option of a dataclass (or instance), a section's options in place of the section."""
    out: list[dataclasses.Field] = []
    for f in dataclasses.fields(cls):
        inner = section_class(f)
        out.extend(option_fields(inner) if inner is not None else [f])
    return out


def search_space(cls: Any) -> dict[str, Space]:
    """Option name -> declared search space, for every option of `cls` that declares one."""
    return {f.name: spec.tune for f in option_fields(cls)
            if (spec := spec_of(f)).tune is not None}


def copy_option(cls: type, name: str, **changes: Any) -> Any:
    """Declare a field exactly like `cls.name` (type checks, limits, help), with `changes`."""
    f = {g.name: g for g in option_fields(cls)}[name]
    spec = dataclasses.replace(spec_of(f), **{k: v for k, v in changes.items() if k != "default"})
    default = changes.get("default", f.default)
    if default is MISSING and f.default_factory is not MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata={_KEY: spec})
    return dataclasses.field(default=default, metadata={_KEY: spec})


# -- naming ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Naming:
    """How errors call the options of one class: `label` is formatted with name and flag."""

    label: str = "option '{name}'"
    # Between the label and the given value: "config field 'x' = 0", "--ipc 0".
    equals: str = " = "
    unknown: str = "unknown option(s) {names}; allowed: {allowed}"

    def name(self, field_name: str) -> str:
        """The label of one option."""
        return self.label.format(name=field_name, flag=field_name.replace("_", "-"))


PLAIN = Naming()
FLAGS = Naming(label="--{flag}", equals=" ")


# -- types -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """A field's declared type, reduced to what values may take: base type and emptiness."""

    base: str          # bool | int | float | str | list | dict | any
    optional: bool

    def describe(self) -> str:
        """The type as a user reads it."""
        words = {"bool": "true/false", "int": "an integer", "float": "a number",
                 "str": "a string", "list": "a list of strings",
                 "dict": "a mapping of names to values", "any": "any value"}
        return words[self.base] + (" or empty" if self.optional else "")


def kind_of(f: dataclasses.Field) -> Kind:
    """Read the annotation (a string under `from __future__ import annotations`)."""
    text = f.type if isinstance(f.type, str) else str(f.type)
    text = text.replace("typing.", "").replace("Optional[", "None | ").replace(" ", "")
    parts = [p for p in text.split("|") if p]
    optional = "None" in parts
    head = next((p for p in parts if p != "None"), "Any")
    for base in ("bool", "int", "float", "str", "list", "dict"):
        if head == base or head.startswith(base + "["):
            return Kind(base, optional)
    # An annotation we cannot read (a class, a Union): trust the default's type if any.
    d = f.default
    for base, t in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if isinstance(d, t):
            return Kind(base, optional)
    return Kind("any", optional)


def printable(text: str) -> str:
    """`text` with unprintable characters escaped (`\\n`, `\\x1b`): an error stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# The longest error line the command line prints: long enough for a path and the allowed values,
# short enough that a hostile value (a 100,000-character --domains) cannot flood a terminal.
ERROR_LINE_LIMIT = 300


def elided(text: str, limit: int = ERROR_LINE_LIMIT) -> str:
    """`text` on one printable line of at most `limit` characters, its middle cut to `…`.

    The head (what failed) and the tail (what is allowed) are kept; a long value in between is
    what gets cut.
    """
    text = printable(" ".join(text.split("\n")))
    if len(text) <= limit:
        return text
    tail = min(100, limit // 3)
    return text[: limit - tail - 1] + "…" + text[-tail:]


def shown(value: Any, limit: int = 80) -> str:
    """`repr(value)` for an error message, shortened: a hostile value must not flood the line."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def coerce(f: dataclasses.Field, value: Any, naming: Naming = PLAIN) -> Any:
    """Check one value against the field's type; ints become floats where floats are declared."""
    kind = kind_of(f)
    label = naming.name(f.name)
    if value is None:
        if kind.optional or kind.base == "any":
            return None
        raise ConfigError(f"{label} may not be empty; expected {kind.describe()}")
    if kind.base == "bool" and not isinstance(value, bool):
        raise ConfigError(f"{label} must be true/false, got {shown(value)}")
    if kind.base == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{label} must be an integer, got {shown(value)}")
        clip = spec_of(f).clip
        if clip is not None and value > clip:
            value = clip
        if abs(value) > INT64_MAX:
            # Counts reach torch and numpy as int64: 2^63 local epochs is no count there (and
            # a 1-round run with it never ends), so it is refused with the number types.
            raise ConfigError(f"{label} must be an integer within int64's range "
                              f"(|x| <= 2^63 - 1), got {shown(value)}")
    elif kind.base == "float":
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads `1e-5` without a dot as a string; a user means the number.
            try:
                value = float(value.strip())
            except ValueError:
                raise ConfigError(f"{label} must be a number, got {shown(value)}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{label} must be a number, got {shown(value)}")
        # NaN passes every `<`/`>` limit and inf every upper-unbounded one: refuse both here.
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise ConfigError(f"{label} must be a finite number, got {shown(value)}")
        if abs(value) > FLOAT32_MAX:
            # Training runs in float32: such a value is infinite there (an lr of 1e308 makes
            # the first SGD step an overflow), so it is refused here, with the number types.
            raise ConfigError(f"{label} must be a finite number within float32's range "
                              f"(|x| <= {FLOAT32_MAX:.4g}), got {shown(value)}")
        if value != 0 and abs(value) < FLOAT32_TINY:
            # Zero in float32, and its square is zero in float64 too: a DP noise of 1e-320
            # divided by zero in the privacy accountant.
            raise ConfigError(f"{label} must be 0 or at least float32's smallest normal number "
                              f"(|x| >= {FLOAT32_TINY:.4g}), got {shown(value)}")
    elif kind.base == "str" and not isinstance(value, str):
        raise ConfigError(f"{label} must be a string, got {shown(value)}")
    elif kind.base == "list":
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{label} must be a list of strings, got {shown(value)}")
    elif kind.base == "dict":
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{label} must be a mapping of names to values")
    return value


# -- limits ----------------------------------------------------------------------------------
def _choices(spec: Spec) -> list[str] | None:
    if spec.choices is None:
        return None
    return list(spec.choices() if callable(spec.choices) else spec.choices)


def allowed_text(f: dataclasses.Field) -> str:
    """What the field accepts, in the words its errors use ("must be >= 1", "allowed: a, b")."""
    spec = spec_of(f)
    if spec.allowed:
        return spec.allowed
    choices = _choices(spec)
    if choices is not None:
        return "allowed: " + ", ".join(choices)
    low = (f"[{spec.ge:g}" if spec.ge is not None else f"({spec.gt:g}" if spec.gt is not None
           else None)
    high = (f"{spec.le:g}]" if spec.le is not None else f"{spec.lt:g})" if spec.lt is not None
            else None)
    if low and high:
        text = f"must be in {low}, {high}"
    elif low:
        text = f"must be {'>=' if spec.ge is not None else '>'} {low[1:]}"
    elif high:
        text = f"must be {'<=' if spec.le is not None else '<'} {high[:-1]}"
    else:
        return ""
    return text + (" or empty" if kind_of(f).optional else "")


def _ok(spec: Spec, value: Any) -> bool:
    choices = _choices(spec)
    if choices is not None and value not in choices:
        return False
    if isinstance(value, int | float) and not isinstance(value, bool):
        if ((spec.ge is not None and value < spec.ge) or (spec.gt is not None and value <= spec.gt)
                or (spec.le is not None and value > spec.le)
                or (spec.lt is not None and value >= spec.lt)):
            return False
    return spec.check is None or bool(spec.check(value))


def check_value(f: dataclasses.Field, value: Any, naming: Naming = PLAIN) -> None:
    """Raise ConfigError naming the option, the value and what is allowed, if out of limits."""
    if value is None or _ok(spec_of(f), value):
        return
    raise ConfigError(f"{naming.name(f.name)}{naming.equals}{shown(value)} is invalid; "
                      f"{allowed_text(f)}")


def check_options(obj: Any, naming: Naming = PLAIN, skip: Sequence[str] = ()) -> Any:
    """Check every declared limit of a dataclass instance (first bad field raises)."""
    for f in option_fields(obj):
        if f.name not in skip:
            check_value(f, getattr(obj, f.name), naming)
    return obj


# -- mappings (YAML, run configs, method options) --------------------------------------------
def from_mapping(cls: type, data: Mapping[str, Any], base: Any = None,
                 naming: Naming = PLAIN, ignore_unknown: bool = False,
                 hyphens: bool = False) -> Any:
    """Overlay `data` on `base` (or the defaults), rejecting unknown keys and wrong types.

    With `hyphens`, a key `round-timeout` names the field `round_timeout` (Flower run configs).
    """
    fields = {f.name: f for f in option_fields(cls)}
    # YAML keys need not be strings (`1: x`, `null: x`): compare and sort them as text.
    named = {(k.replace("-", "_") if hyphens and isinstance(k, str) else k): v
             for k, v in data.items()}
    unknown = sorted((k for k in named if k not in fields), key=shown)
    if unknown and not ignore_unknown:
        names = ", ".join(map(shown, unknown[:10])) + (", ..." if len(unknown) > 10 else "")
        raise ConfigError(naming.unknown.format(names=f"[{names}]",
                                                allowed=", ".join(sorted(fields)) or "(none)"))
    clean = {k: coerce(fields[k], v, naming) for k, v in named.items() if k in fields}
    return dataclasses.replace(base, **clean) if base is not None else cls(**clean)


def to_dict(obj: Any) -> dict[str, Any]:
    """The plain field -> value dict written to YAML."""
    return dataclasses.asdict(obj)


# -- command line ----------------------------------------------------------------------------
def _flag(f: dataclasses.Field) -> str:
    spec = spec_of(f)
    if spec.flag:
        return spec.flag
    name = f.name.replace("_", "-")
    return f"no-{name}" if kind_of(f).base == "bool" and f.default is True else name


def add_flags(parser: argparse.ArgumentParser | Any, cls: type,
              skip: Sequence[str] = ()) -> None:
    """One `--flag` per declared option of `cls`; an unset flag reads None (the field's default).

    A bool defaulting to True gets `--no-NAME`, one defaulting to False `--NAME`.
    """
    for f in option_fields(cls):
        spec = spec_of(f)
        if not spec.cli or f.name in skip:
            continue
        kind = kind_of(f)
        text = spec.help
        if f.default is not MISSING and f.default is not None and kind.base != "bool":
            text = f"{text} (default: {f.default})" if text else f"default: {f.default}"
        flag = "--" + _flag(f)
        if kind.base == "bool":
            parser.add_argument(flag, dest=f.name, action="store_const",
                                const=not f.default, default=None, help=text)
            continue
        typ = {"int": int, "float": float}.get(kind.base, str)
        choices = spec.choices if isinstance(spec.choices, Sequence) else None
        metavar = "{" + ",".join(choices) + "}" if choices else None
        parser.add_argument(flag, dest=f.name, type=typ, default=None, metavar=metavar,
                            help=text)


def values_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options of `cls` given on the command line (flags left unset are omitted)."""
    out = {}
    for f in option_fields(cls):
        v = getattr(args, f.name, None)
        if spec_of(f).cli and v is not None:
            out[f.name] = v
    return out


def from_args(args: argparse.Namespace, cls: type, naming: Naming = FLAGS) -> Any:
    """An instance of `cls` from parsed flags, type- and limit-checked, errors naming flags."""
    return check_options(from_mapping(cls, values_from_args(args, cls), naming=naming), naming)

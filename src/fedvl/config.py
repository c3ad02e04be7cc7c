"""Run configuration: one flat, validated dataclass loaded from YAML and/or CLI flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and what is allowed."""


@dataclass
class RunConfig:
    """Everything that defines a run; the same config and seed give the same numbers."""

    method: str = "fedlgd"
    method_args: dict[str, Any] = field(default_factory=dict)
    benchmark: str = "digits-offline"
    data_dir: str | None = None
    domains: list[str] | None = None
    train_cap: int | None = None
    test_cap: int | None = None
    num_clients: int = 10
    alpha: float = 0.5
    image_size: int | None = None
    local_data: str = "real"
    ipc: int = 10
    # --local-data virtual: the same DM warm-up as FedLGD's defaults (warmup_steps, batch_real).
    virtual_steps: int = 100
    virtual_init: str = "real"
    virtual_batch_real: int = 32
    model: str = "convnet"
    model_args: dict[str, Any] = field(
        default_factory=lambda: {"width": 32, "depth": 3, "norm": "instance"})
    rounds: int = 20
    client_ratio: float = 1.0
    local_epochs: int = 1
    local_steps: int | None = None
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    aggregation: str = "samples"
    eval_every: int = 1
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for YAML and summaries)."""
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


def _type_name(name: str) -> str:
    return str(_FIELDS[name].type).replace("typing.", "")


def _coerce(name: str, value: Any) -> Any:
    """Check one field's value against its declared type, with a clear error."""
    t = _type_name(name)
    if value is None:
        if "None" in t:
            return None
        raise ConfigError(f"config field '{name}' may not be empty; expected {t}")
    if t.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config field '{name}' must be an integer, got {value!r}")
    elif t.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config field '{name}' must be a number, got {value!r}")
        value = float(value)
    elif t.startswith("str"):
        if not isinstance(value, str):
            raise ConfigError(f"config field '{name}' must be a string, got {value!r}")
    elif t.startswith("dict"):
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"config field '{name}' must be a mapping of names to values")
    elif t.startswith("list"):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"config field '{name}' must be a list of strings, got {value!r}")
    return value


def validate(cfg: RunConfig) -> RunConfig:
    """Check ranges and names; raise ConfigError naming the first bad field."""
    from fedvl.registry import ALGORITHMS, BENCHMARKS, MODELS

    def need(cond: bool, fieldname: str, allowed: str) -> None:
        if not cond:
            raise ConfigError(
                f"config field '{fieldname}' = {getattr(cfg, fieldname)!r} is invalid; {allowed}")

    try:
        # Plain names and composed BASE+ADDON names; the registry's message names both lists.
        ALGORITHMS.get(cfg.method)
    except KeyError as e:
        raise ConfigError(f"config field 'method' = {cfg.method!r} is invalid; {e.args[0]}") from e
    for reg, fieldname in ((BENCHMARKS, "benchmark"), (MODELS, "model")):
        base = getattr(cfg, fieldname)
        need(base in reg, fieldname, "allowed: " + ", ".join(reg.names()))
    need(cfg.rounds >= 1, "rounds", "must be >= 1")
    need(0 < cfg.client_ratio <= 1, "client_ratio", "must be in (0, 1]")
    need(cfg.local_epochs >= 1, "local_epochs", "must be >= 1")
    need(cfg.local_steps is None or cfg.local_steps >= 1, "local_steps", "must be >= 1 or empty")
    need(cfg.batch_size >= 1, "batch_size", "must be >= 1")
    need(cfg.lr > 0, "lr", "must be > 0")
    need(0 <= cfg.momentum < 1, "momentum", "must be in [0, 1)")
    need(cfg.weight_decay >= 0, "weight_decay", "must be >= 0")
    need(cfg.aggregation in ("samples", "uniform"), "aggregation", "allowed: samples, uniform")
    need(cfg.local_data in ("real", "virtual"), "local_data", "allowed: real, virtual")
    need(cfg.ipc >= 1, "ipc", "must be >= 1")
    need(cfg.virtual_steps >= 0, "virtual_steps", "must be >= 0")
    need(cfg.virtual_init in ("stats", "noise", "real"), "virtual_init",
         "allowed: stats, noise, real")
    need(cfg.virtual_batch_real >= 1, "virtual_batch_real", "must be >= 1")
    need(cfg.eval_every >= 1, "eval_every", "must be >= 1")
    need(cfg.num_clients >= 1, "num_clients", "must be >= 1")
    need(cfg.alpha > 0, "alpha", "must be > 0")
    need(cfg.train_cap is None or cfg.train_cap >= 1, "train_cap", "must be >= 1 or empty")
    need(cfg.test_cap is None or cfg.test_cap >= 1, "test_cap", "must be >= 1 or empty")
    need(cfg.device in ("cpu", "cuda", "auto") or cfg.device.startswith("cuda:"), "device",
         "allowed: cpu, cuda, cuda:N, auto")
    need(cfg.threads is None or cfg.threads >= 1, "threads", "must be >= 1 or empty")
    return cfg


def from_dict(data: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
    """Overlay `data` on `base` (or defaults), rejecting unknown keys and wrong types."""
    cfg = dataclasses.replace(base) if base is not None else RunConfig()
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}; allowed: {', '.join(sorted(_FIELDS))}")
    for k, v in data.items():
        if k == "model_args" and isinstance(v, dict):
            v = {**cfg.model_args, **v}
        setattr(cfg, k, _coerce(k, v))
    return cfg


def load_yaml(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """Read a YAML config file over `base`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{p}' is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of settings, got {type(data)}")
    return from_dict(data, base)


def dump_yaml(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

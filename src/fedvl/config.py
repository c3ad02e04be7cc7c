"""Run configuration: one validated dataclass in sections, loaded from YAML and/or CLI flags.

Each option is declared once with `option` (help, limits, choices), in the section it belongs to
(`DataSection`, `TrainingSection`, ...); validation, the `fedvl run` flags and YAML loading all
derive from that declaration (see `fedvl.options`). Flags and YAML keys stay flat (`--lr`,
`lr: 0.1`): each option name is unique across the sections.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedvl.defaults import (
    ALTERNATE,
    CORRUPTIONS,
    DEFAULT_DOMINANT_SHARE,
    DEFAULT_GUARD,
    DEFAULT_PARTITION,
    DEFAULT_SEVERITY,
    DEFAULT_SHARDS_PER_CLIENT,
    LOG_KINDS,
    MAX_CAP,
    MAX_FIRST_PADDING,
    PARTITIONS,
)
from fedvl.options import (
    Choice,
    ConfigError,
    IntRange,
    LogUniform,
    Naming,
    check_value,
    coerce,
    from_mapping,
    option,
    option_fields,
    printable,
    section,
    section_class,
    shown,
)
from fedvl.registry import ALGORITHMS, BENCHMARKS, MODELS

__all__ = ["ConfigError", "RunConfig", "DataSection", "VirtualSection", "ModelSection",
           "TrainingSection", "RoundsSection", "PrivacySection", "EngineSection", "NAMING",
           "validate", "from_dict", "load_yaml", "dump_yaml", "BASE_MODEL_ARGS",
           "resolve_model_args", "yaml_problem"]

# Weighted means, then the robust rules (which ignore sample counts).
AGGREGATIONS = ("samples", "uniform", "median", "trimmed-mean")

NAMING = Naming(label="config field '{name}'",
                unknown="unknown config key(s) {names}; allowed: {allowed}")


def _device_ok(name: str) -> bool:
    # `cuda:N` with N a plain non-negative index (torch raises on `cuda:-1` or `cuda:x`).
    return name in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", name, re.ASCII) is not None


def _corruptions_ok(value: list[str] | None) -> bool:
    return value is None or all(v in CORRUPTIONS for v in value)


def _log_ok(value: list[str] | None) -> bool:
    return value is None or all(v in LOG_KINDS for v in value)


def _client_models_ok(value: list[str] | None) -> bool:
    if value is None:
        return True
    if value == [ALTERNATE]:
        return True
    return bool(value) and all(v in MODELS.names() for v in value)


@dataclass(frozen=True)
class DataSection:
    """Which benchmark, how it is split over clients, and the public set."""

    benchmark: str = option("digits-offline", "registered benchmark name",
                            choices=BENCHMARKS.names)
    data_dir: str | None = option(None, "directory holding the datasets (layouts: "
                                  "docs/datasets.md)")
    domains: list[str] | None = option(
        None, "comma-separated subset of domains (digits: mnist, svhn, usps, synthdigits, "
        "mnistm; office-caltech10: amazon, caltech, dslr, webcam; digits-offline: styles; "
        "npz-domains / imagefolder: file or folder names)")
    dataset: str = option("pneumoniamnist",
                          "sub-dataset of benchmarks that have several: the MedMNIST file "
                          "stem under DIR/medmnist/ (medmnist)")
    # Clipped, not refused: a cap past any dataset means "every image" (the loaders then clip
    # to the data size before anything is built).
    train_cap: int | None = option(
        None, "max training samples per client (class-stratified)", ge=1, clip=MAX_CAP)
    test_cap: int | None = option(None, "max test samples per client", ge=1, clip=MAX_CAP)
    num_clients: int = option(10, "clients of partitioned benchmarks", ge=1)
    # Unset (None): each benchmark's own default, 0.5, or 2 for cifar10c.
    alpha: float | None = option(
        None, "Dirichlet concentration of label-skew benchmarks (default: 0.5; cifar10c: 2)",
        gt=0)
    partition: str = option(
        DEFAULT_PARTITION, "how label-skew benchmarks split the training labels over clients: "
        "dirichlet (per-class Dirichlet(--alpha) shares), shards (McMahan et al.: "
        "--shards-per-client classes per client) or dominant (VHL: --dominant-share of each "
        "client's samples from one class); see docs/protocol.md", choices=PARTITIONS)
    shards_per_client: int = option(DEFAULT_SHARDS_PER_CLIENT,
                                    "label-sorted shards, so classes, per client (--partition "
                                    "shards)", ge=1)
    dominant_share: float = option(
        DEFAULT_DOMINANT_SHARE, "fraction of each client's samples from its dominant class, "
        "client index mod classes; the rest spread evenly over the other classes (--partition "
        "dominant)", gt=0, le=1)
    # Bounded: a side of 10^6 is no image size, just an allocation that kills the process.
    image_size: int | None = option(None, "resize images to this side", ge=1, le=1024)
    severity: int = option(DEFAULT_SEVERITY, "corruption strength of cifar10c, 1 (mild) to 5",
                           ge=1, le=5)
    corruptions: list[str] | None = option(
        None, "comma-separated subset of the 19 corruptions (cifar10c; default: all)",
        check=_corruptions_ok, allowed="allowed: " + ", ".join(CORRUPTIONS))
    # Unset (None): each benchmark's own default, 3 for cifar10c, 1 for digits-offline.
    partitions: int | None = option(
        None, "Dirichlet(--alpha) clients each domain is split into (cifar10c: default 3, one "
        "domain per corruption; digits-offline, npz-domains, imagefolder, office-caltech10: "
        "default 1, one client per domain)", ge=1)
    public: str | None = option(
        None, "benchmark whose training images, labels dropped, are the unlabelled public set "
        "of methods that learn on one (feddf, fccl)", choices=BENCHMARKS.names)
    public_size: int = option(5000, "images in the public set (a seeded random subset)", ge=1,
                              clip=MAX_CAP)
    holdout_clients: int = option(
        0, "clients kept out of training (the same ones for every seed), on which each evaluation "
        "reports the global model (personalised methods: a new client's fine-tuned model); "
        "in-process engine only", ge=0)


@dataclass(frozen=True)
class VirtualSection:
    """Whether clients train on local virtual (distilled) sets, and how those are distilled."""

    local_data: str = option("real", "real, or virtual: clients train on distilled sets",
                             choices=("real", "virtual"))
    ipc: int = option(10, "images per class of the local virtual sets", ge=1)
    # --local-data virtual: the same DM warm-up as FedLGD's defaults (warmup_steps, batch_real).
    virtual_steps: int = option(100, "DM steps distilling each local virtual set", ge=0)
    virtual_init: str = option("real", "stats, noise or real initialisation",
                               choices=("stats", "noise", "real"))
    virtual_batch_real: int = option(32, "real images per class per DM step", ge=1)


@dataclass(frozen=True)
class ModelSection:
    """The run's model and, in mixed federations, each client's architecture."""

    model: str = option("convnet", "registered model name", choices=MODELS.names)
    # Keys left out fall back to the method's preference, then to BASE_MODEL_ARGS
    # (`resolve_model_args`): FedVCK runs a BatchNorm ConvNet unless `norm` is given.
    model_args: dict[str, Any] = option(factory=lambda: {"width": 32, "depth": 3}, cli=False)
    client_models: list[str] | None = option(
        None, "architecture per client: comma-separated names cycled over the clients, "
        "'alternate' (convnet/alexnet), or one name (default: --model for every client)",
        check=_client_models_ok,
        allowed="allowed: registered model names (comma-separated) or 'alternate'")


@dataclass(frozen=True)
class TrainingSection:
    """The clients' local optimiser; its fields are those of `fedvl.core.training.TrainConfig`."""

    local_epochs: int = option(1, "local epochs per round", ge=1, tune=IntRange(1, 5))
    local_steps: int | None = option(None, "local steps per round (overrides epochs)", ge=1)
    batch_size: int = option(32, "local batch size", ge=1, tune=Choice(16, 32, 64))
    lr: float = option(0.01, "client learning rate", gt=0, tune=LogUniform(1e-3, 1e-1))
    # VHL decays by 0.992 per round; 1.0 (no decay) keeps every earlier run's numbers.
    lr_decay: float = option(1.0, "per-round factor of the client learning rate: round t "
                             "(from 0) trains at lr * lr_decay^t (VHL: 0.992)", gt=0, le=1)
    momentum: float = option(0.9, "client SGD momentum", ge=0, lt=1, tune=Choice(0.0, 0.5, 0.9))
    weight_decay: float = option(0.0, "client weight decay", ge=0,
                                 tune=Choice(0.0, 1e-4, 5e-4, 1e-3))
    autocast: str = option(
        "none", "mixed precision of local training's forward passes: none (float32) or bf16 "
        "(bfloat16 autocast on the run's device); it changes the numbers, so it is off by "
        "default", choices=("none", "bf16"))


@dataclass(frozen=True)
class RoundsSection:
    """The round loop: how many rounds, who takes part, how replies combine, when to evaluate."""

    rounds: int = option(20, "communication rounds", ge=1)
    client_ratio: float = option(1.0, "fraction of clients sampled per round", gt=0, le=1)
    aggregation: str = option(
        "samples", "how weight-averaging methods combine client models: samples or uniform "
        "(weighted mean), or the robust coordinate-wise median or trimmed-mean",
        choices=AGGREGATIONS)
    trim: float = option(0.2, "fraction of clients cut from each end, per coordinate, by "
                         "--aggregation trimmed-mean", ge=0, lt=0.5)
    min_replies: int = option(1, "valid replies a round needs; with fewer the round is skipped "
                              "and the server state stays as it was", ge=1)
    eval_every: int = option(1, "evaluate every N rounds", ge=1)


@dataclass(frozen=True)
class PrivacySection:
    """What the server may receive from a client."""

    # 1 never withholds (|r| is at most 1); the audit is recorded whatever the threshold.
    upload_guard: float = option(
        DEFAULT_GUARD, "withhold from a client's upload every image-shaped tensor whose "
        "|Pearson r| with one of its private images is above this (1: audit only, never "
        "withhold); see docs/reliability.md", gt=0, le=1)


@dataclass(frozen=True)
class EngineSection:
    """Where and how the work runs; none of it changes a number of the run."""

    device: str = option("cpu", "cpu, cuda, cuda:N or auto", check=_device_ok,
                         allowed="allowed: cpu, cuda, cuda:N, auto")
    threads: int | None = option(None, "torch CPU threads of the server's work (clients use one "
                                 "each)", ge=1, le=1024)
    workers: int | None = option(None, "clients run concurrently in a round, one torch thread "
                                 "each (default: one per CPU core; 1 on a GPU)", ge=1, le=1024)
    stack_clients: bool = option(
        False, "in-process engine: train a round's clients together as one vectorised model "
        "(torch.vmap) where the method allows it (FedAvg-style local SGD, FedDM's synthesis; "
        "no BatchNorm, no DP); meant for GPUs, equal to client-by-client work to float "
        "rounding")
    # Written to config.yaml only when set (`_APPLIES`), like `log`: a run without it writes
    # the file it always wrote.
    deterministic: bool = option(
        False, "deterministic torch kernels (torch.use_deterministic_algorithms, cuDNN "
        "deterministic without benchmarking, CUBLAS_WORKSPACE_CONFIG=:4096:8 if unset): "
        "repeatable GPU numbers; a CUDA op with no deterministic kernel then raises an error. "
        "CPU kernels are deterministic already (docs/gpu.md)")
    # Written to config.yaml only when set (`_APPLIES`): a run without logs writes the file it
    # always wrote.
    log: list[str] | None = option(
        None, "experiment logs beside metrics.jsonl, comma-separated: tensorboard (event files "
        "in RUN/tensorboard, needs `pip install 'fedvl[logs]'`), wandb (Weights & Biases "
        "offline run in RUN/wandb, needs `pip install wandb`)", check=_log_ok,
        allowed="allowed: " + ", ".join(LOG_KINDS) + " (comma-separated)")


@dataclass(init=False)
class RunConfig:
    """Everything that defines a run; the same config and seed give the same numbers.

    The options live in sections (`cfg.training.lr`, the canonical path); flags and YAML keys
    name them flat (`--lr`, `lr:`), and `cfg.lr` reads (and sets) the same value.
    """

    # Methods are checked by `validate` (composed BASE+ADDON names have their own errors).
    method: str = option("fedlgd", "registered method name (see `fedvl list`)")
    method_args: dict[str, Any] = option(factory=dict, cli=False)
    seed: int = option(0, "run seed", ge=0)  # numpy seed sequences take no negative seeds
    data: DataSection = section(DataSection)
    virtual: VirtualSection = section(VirtualSection)
    models: ModelSection = section(ModelSection)
    training: TrainingSection = section(TrainingSection)
    loop: RoundsSection = section(RoundsSection)
    privacy: PrivacySection = section(PrivacySection)
    engine: EngineSection = section(EngineSection)

    def __init__(self, **values: Any) -> None:
        """A config from whole sections and/or options by flat name (`RunConfig(lr=0.1)`)."""
        for f in dataclasses.fields(self):
            if f.name in values:
                value = values.pop(f.name)
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                value = f.default_factory()
            object.__setattr__(self, f.name, value)
        changes: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            if name not in _SECTION_OF:
                raise TypeError(f"RunConfig() got an unexpected keyword argument '{name}'")
            changes.setdefault(_SECTION_OF[name], {})[name] = value
        for sec, given in changes.items():
            object.__setattr__(self, sec, dataclasses.replace(getattr(self, sec), **given))

    def __getattr__(self, name: str) -> Any:
        """Flat read access: `cfg.lr` is `cfg.training.lr`."""
        sec = _SECTION_OF.get(name)
        if sec is None:
            raise AttributeError(f"'RunConfig' object has no attribute '{name}'")
        return getattr(object.__getattribute__(self, sec), name)

    def __setattr__(self, name: str, value: Any) -> None:
        """`cfg.lr = x` replaces the option in its (frozen) section."""
        sec = _SECTION_OF.get(name)
        if sec is None:
            object.__setattr__(self, name, value)
        else:
            object.__setattr__(self, sec, dataclasses.replace(getattr(self, sec),
                                                              **{name: value}))

    def to_dict(self) -> dict[str, Any]:
        """Plain flat dict, option name -> value (for YAML and summaries)."""
        values = {f.name: copy.deepcopy(getattr(self, f.name)) for f in option_fields(self)}
        return dict(sorted(values.items(), key=lambda kv: _KEY_RANK.get(kv[0], len(_KEY_RANK))))


def _sections_of(cls: type) -> dict[str, str]:
    """Option name -> the section field holding it; a name used twice is refused."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        inner = section_class(f)
        for o in dataclasses.fields(inner) if inner is not None else ():
            # A flag, a YAML key and `cfg.NAME` must each find one option.
            if o.name in out or o.name in cls.__dataclass_fields__:
                raise TypeError(f"option name '{o.name}' is declared twice in {cls.__name__}")
            out[o.name] = f.name
    return out


_SECTION_OF = _sections_of(RunConfig)

# The key order config.yaml has always had, so that one config gives one text: a Flower run
# keys its checkpoint by that text. Options added later follow in declaration order.
_KEY_RANK = {name: rank for rank, name in enumerate((
    "method", "method_args", "benchmark", "data_dir", "domains", "dataset", "train_cap",
    "test_cap", "num_clients", "alpha", "partition", "shards_per_client", "dominant_share",
    "image_size", "severity", "corruptions", "partitions", "public", "public_size", "local_data",
    "ipc", "virtual_steps", "virtual_init", "virtual_batch_real", "model", "model_args",
    "client_models", "rounds", "client_ratio", "local_epochs", "local_steps", "batch_size", "lr",
    "lr_decay", "momentum", "weight_decay", "aggregation", "trim", "min_replies", "eval_every",
    "seed", "device", "threads", "workers", "autocast", "upload_guard", "stack_clients"))}


# Model sizes a run may ask for. Beyond them a model is no experiment, only a hang or an
# out-of-memory kill: a ConvNet builds its layers one by one (depth 2^63 never finishes) and a
# width of 20,000 asks for 14 GB per convolution before anything is checked. A ConvNet's
# `first_padding` grows every feature map with its square.
MODEL_SIZE_LIMITS = {"width": (1, 4096), "depth": (1, 64),
                     "first_padding": (0, MAX_FIRST_PADDING)}

# Model options every run falls back to for keys that neither it nor its method sets.
BASE_MODEL_ARGS: dict[str, Any] = {"norm": "instance"}

# `--preset NAME`: run settings under the config file and the flags; each method adds its own
# option cuts (`Algorithm.<NAME>_args`, e.g. `smoke_args`), also under what the user sets.
PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {"rounds": 2, "train_cap": 100, "test_cap": 100},
    # What a bare `fedvl run` runs: FedLGD in under half a minute on 2 CPU cores, its local
    # virtual sets distilled as `--local-data virtual --virtual-steps 20` distils them, so that
    # the FedAvg comparison it prints trains on the very same sets (quickstart-choice-cpu.json).
    "quickstart": {"method": "fedlgd", "virtual_steps": 20},
    # The seed papers' model (ConvNet width 128, depth 3); each method adds its published
    # budgets and rounds (`paper_args`, `paper_run`). Meant for a GPU.
    "paper": {"model_args": {"width": 128, "depth": 3}},
}
# The preset `fedvl run` uses when it is given no method, config file or preset.
DEFAULT_PRESET = "quickstart"


def _preset_part(preset: str, method: str, part: str) -> dict[str, Any]:
    """`method`'s `<preset>_<part>` class attribute (none for an unknown method, which the
    config check then names)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset '{preset}'; allowed: {', '.join(sorted(PRESETS))}")
    try:
        factory = ALGORITHMS.get(method)   # composed names (fedprox+vhl) too
    except (KeyError, TypeError):
        return {}
    return dict(getattr(factory, f"{preset}_{part}", {}))


def preset_method_args(preset: str, method: str) -> dict[str, Any]:
    """The method options preset `preset` gives `method`."""
    return _preset_part(preset, method, "args")


def preset_run_args(preset: str, method: str) -> dict[str, Any]:
    """The run settings preset `preset` gives `method` beyond its own (e.g. the paper's rounds)."""
    return _preset_part(preset, method, "run")


def _fill_model_args(cfg: RunConfig, prefer: dict[str, Any]) -> RunConfig:
    """`cfg` with the model options it leaves open taken from `prefer`, else BASE_MODEL_ARGS
    (only options the run's model takes: `norm` is a ConvNet option)."""
    from fedvl.models.base import model_options  # torch: not for `fedvl run --help`

    try:
        fallback = model_options(cfg.model, {**BASE_MODEL_ARGS, **prefer})
    except KeyError:
        return cfg
    missing = {k: v for k, v in fallback.items() if k not in cfg.model_args}
    if not missing:
        return cfg
    return dataclasses.replace(cfg, model_args={**cfg.model_args, **missing})


def shared_model_args(cfg: RunConfig) -> RunConfig:
    """`cfg` with every model option the run leaves open filled from BASE_MODEL_ARGS, none from
    its method: the one model a comparison gives every method (FedVCK's BatchNorm ConvNet only
    when the comparison asks for it, `--norm batch`, for all)."""
    return _fill_model_args(cfg, {})


def resolve_model_args(cfg: RunConfig) -> RunConfig:
    """`cfg` with every model option filled: its own, else the method's, else the base's.

    Fallbacks go only to options the run's model takes (`norm` is a ConvNet option).
    """
    try:
        prefer = dict(getattr(ALGORITHMS.get(cfg.method), "model_defaults", {}))
    except KeyError:
        prefer = {}
    return _fill_model_args(cfg, prefer)


def validate(cfg: RunConfig) -> RunConfig:
    """Check types, ranges and names; raise ConfigError naming the first bad field."""
    try:
        # Plain names and composed BASE+ADDON names; the registry's message names both lists.
        ALGORITHMS.get(cfg.method)
    except KeyError as e:
        raise ConfigError(f"config field 'method' = {shown(cfg.method)} is invalid; "
                          f"{printable(str(e.args[0]))}") from e
    for f in option_fields(cfg):
        value = getattr(cfg, f.name)
        coerce(f, value, NAMING)
        check_value(f, value, NAMING)
    for key, (low, high) in MODEL_SIZE_LIMITS.items():
        v = cfg.model_args.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and not low <= v <= high:
            raise ConfigError(f"model option '{key}' = {shown(v)} is invalid; must be in "
                              f"[{low}, {high}]")
    return cfg


def from_dict(data: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
    """Overlay `data` on `base` (or defaults), rejecting unknown keys and wrong types."""
    base = base if base is not None else RunConfig()
    if isinstance(data.get("model_args"), dict):
        # Model options overlay the base's, so `--width 8` keeps the default depth and norm.
        data = {**data, "model_args": {**base.model_args, **data["model_args"]}}
    return from_mapping(RunConfig, data, base, NAMING)


def yaml_problem(e: Exception) -> str:
    """A YAML parse error in one line: what is wrong and where (PyYAML's text spans lines)."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if problem:
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"{problem}{where}"
    return " ".join(str(e).splitlines()[0].split()) if str(e) else type(e).__name__


def load_yaml(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """Read a YAML config file over `base`; every error names the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist or is not a file")
    try:
        text = p.read_bytes().decode("utf-8")
        data = yaml.safe_load(text)
    except OSError as e:
        raise ConfigError(f"config file '{p}' cannot be read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{p}' is not UTF-8 text (byte {e.start}: "
                          f"{e.reason})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{p}' is not valid YAML: {yaml_problem(e)}") from e
    except ValueError as e:  # a YAML integer past Python's digit limit for int()
        raise ConfigError(f"config file '{p}' holds a value that cannot be read: {e}") from e
    except RecursionError as e:
        raise ConfigError(f"config file '{p}' is nested too deeply to be a config") from e
    # Only an empty file means "no settings"; `0`, `false` or `[]` are not a mapping.
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of settings (key: value "
                          f"lines), got a value of type {type(data).__name__}")
    try:
        return from_dict(data, base)
    except ConfigError as e:
        raise ConfigError(f"config file '{p}': {e}") from e


# Options whose reading a benchmark declares in `BenchmarkSpec.reads`.
_SPEC_FIELDS = frozenset({"domains", "dataset", "num_clients", "severity", "corruptions"})
# Options of the public set's benchmark that `--public` reads (the ones it is built with).
_PUBLIC_READS = frozenset({"dataset", "num_clients"})
_LABEL_OPTIONS = ("alpha", "partition", "shards_per_client", "dominant_share")
# Fields only some runs read -> whether `cfg` reads it, given the run benchmark's spec.
_APPLIES: dict[str, Any] = {
    "data_dir": lambda c, s: s.needs_data_dir or c.public is not None,
    "partitions": lambda c, s: s.partitions is not None,
    "public_size": lambda c, s: c.public is not None,
    "trim": lambda c, s: c.aggregation == "trimmed-mean",
    # Written only when set: config.yaml of a run without held-out clients keeps its old text.
    "holdout_clients": lambda c, s: False,
    "log": lambda c, s: bool(c.log),
    "deterministic": lambda c, s: bool(c.deterministic),
    **{k: lambda c, s: c.local_data == "virtual"
       for k in ("ipc", "virtual_steps", "virtual_init", "virtual_batch_real")},
    **{k: lambda c, s: s.label_split == "always" or (
        s.label_split == "split-domains" and (c.partitions or s.partitions or 1) > 1)
       for k in _LABEL_OPTIONS},
}


def _reads(cfg: RunConfig, spec: Any, field: str) -> bool:
    """Whether a run of `cfg` (its benchmark declared `spec`) reads option `field`."""
    if field in _APPLIES:
        return bool(_APPLIES[field](cfg, spec))
    if field in spec.reads:
        return True
    if cfg.public is not None and field in _PUBLIC_READS:
        from fedvl.data.spec import spec_of
        return field in spec_of(cfg.public).reads
    return False


def written_fields(cfg: RunConfig) -> dict[str, Any]:
    """The fields config.yaml records: each one the run reads or sets away from its default.

    A field left out is at its default, so reading the file back gives `cfg` again; a
    digits-offline run does not list `dataset: pneumoniamnist`, a MedMNIST option it never reads.
    Which options a benchmark reads comes from its `BenchmarkSpec`; a benchmark registered
    without one has every field written.
    """
    # Imported here: the specs live with the benchmarks, registered above this module.
    from fedvl.data.spec import declared_spec

    out = cfg.to_dict()
    spec = declared_spec(cfg.benchmark)
    if spec is None:
        return out
    optional = set(_APPLIES) | _SPEC_FIELDS
    default = RunConfig().to_dict()
    return {k: v for k, v in out.items()
            if k not in optional or v != default[k] or _reads(cfg, spec, k)}


def dump_yaml(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config (the fields `written_fields` keeps)."""
    Path(path).write_text(yaml.safe_dump(written_fields(cfg), sort_keys=False))

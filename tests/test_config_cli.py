"""Config validation and the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from fedvl.cli import main
from fedvl.config import ConfigError, RunConfig, dump_yaml, from_dict, load_yaml, validate


def test_unknown_key_named():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['roundz'\]; allowed:"):
        from_dict({"roundz": 3})


def test_bad_type_and_range_named():
    with pytest.raises(ConfigError, match="'rounds' must be an integer"):
        from_dict({"rounds": "many"})
    with pytest.raises(ConfigError, match="'client_ratio'.*\\(0, 1\\]"):
        validate(from_dict({"client_ratio": 1.5}))
    with pytest.raises(ConfigError, match="'method' = 'fedfoo'.*allowed: .*fedavg"):
        validate(from_dict({"method": "fedfoo"}))


def test_yaml_loading(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("method: fedprox\nmethod_args: {mu: 0.1}\nrounds: 2\nmodel_args: {width: 8}\n")
    cfg = load_yaml(p)
    assert cfg.method == "fedprox" and cfg.method_args == {"mu": 0.1} and cfg.rounds == 2
    assert cfg.model_args["width"] == 8 and cfg.model_args["depth"] == 3
    p.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_yaml(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "nope.yaml")


def test_exponent_without_a_dot_is_a_number(tmp_path):
    # PyYAML (YAML 1.1) reads `1e-3` as a string; a float field takes it as the number.
    p = tmp_path / "run.yaml"
    p.write_text("lr: 1e-3\n")
    assert load_yaml(p).lr == pytest.approx(1e-3)
    assert from_dict({"lr": "2E-2"}).lr == pytest.approx(0.02)
    with pytest.raises(ConfigError, match="'lr' must be a number, got '1e-3x'"):
        from_dict({"lr": "1e-3x"})
    with pytest.raises(ConfigError, match="'lr' must be a finite number"):
        from_dict({"lr": "nan"})


def test_cli_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "scaffold" in out and "digits-offline" in out
    assert "convnet" in out and "cifar10-dirichlet" in out


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert main(["run", "--method", "nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "allowed:" in err
    assert main(["run", "--benchmark", "digits", "--data-dir", str(tmp_path),
                 "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "no DIGITS domain files found" in err
    assert main(["run", "--benchmark", "digits", "--out", str(tmp_path / "z")]) == 2
    assert "--data-dir" in capsys.readouterr().err
    assert main(["run", "--width", "0", "--rounds", "1", "--out", str(tmp_path / "w")]) == 2


def test_cli_missing_domain_file(capsys, tmp_path):
    (tmp_path / "digits").mkdir()
    assert main(["run", "--benchmark", "digits", "--data-dir", str(tmp_path), "--domains",
                 "svhn", "--out", str(tmp_path / "o")]) == 2
    assert "svhn.npz" in capsys.readouterr().err


def test_cli_run_offline_tiny(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--rounds", "1", "--width", "8", "--depth", "2", "--train-cap", "60",
                 "--test-cap", "30", "--out", str(out), "--quiet", "--method", "fedprox",
                 "--method-arg", "mu=0.01"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"] == "digits-offline" and summary["method_args"] == {"mu": 0.01}
    assert len(summary["per_client_accuracy"]) >= 4
    printed = capsys.readouterr().out
    assert "mean (unweighted)" in printed


def test_config_yaml_flag_precedence(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rounds: 7\nlr: 0.5\n")
    from fedvl.cli import build_parser, config_from_args

    args = build_parser().parse_args(["run", "--config", str(p), "--rounds", "2"])
    cfg = config_from_args(args)
    assert cfg.rounds == 2 and cfg.lr == 0.5
    assert RunConfig().rounds == 20


def test_preset_sits_under_the_config_file_and_the_flags(tmp_path):
    from fedvl.cli import build_parser, config_from_args

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["run", *argv]))

    smoke = cfg("--preset", "smoke", "--method", "fedvck")
    assert (smoke.rounds, smoke.train_cap, smoke.test_cap) == (2, 100, 100)
    assert smoke.method_args == {"steps": 20, "server_epochs": 5}
    # A composed method gets both halves' cuts; a flag or the config file wins over the preset.
    assert cfg("--preset", "smoke", "--method", "fedprox+vhl").method_args == {
        "virtual_per_class": 20}
    p = tmp_path / "c.yaml"
    p.write_text("rounds: 3\nmethod: feddm\nmethod_args: {steps: 7}\n")
    mixed = cfg("--preset", "smoke", "--config", str(p), "--train-cap", "40")
    assert (mixed.rounds, mixed.train_cap, mixed.test_cap) == (3, 40, 100)
    assert mixed.method_args == {"steps": 7, "server_epochs": 5}
    assert cfg("--preset", "smoke", "--method", "fedavg").method_args == {}
    with pytest.raises(ConfigError, match="--preset sets up a new run"):
        config_from_args(build_parser().parse_args(["run", "--preset", "smoke"]), RunConfig())


def test_bare_run_is_the_quickstart_preset_and_bench_gives_each_method_its_cuts(monkeypatch):
    """`fedvl run` alone runs --preset quickstart; any --method, --config or --preset is the
    user's setting instead. `fedvl bench --preset` cuts every method's own budgets."""
    from fedvl.cli import build_parser, config_from_args
    from fedvl.cli.bench import cmd_bench
    from fedvl.cli.run import use_default_preset
    from fedvl.config import PRESETS, preset_method_args

    def cfg(*argv):
        args = build_parser().parse_args(["run", *argv])
        return use_default_preset(args), config_from_args(args)

    used, bare = cfg()
    assert used and bare.method == "fedlgd"
    assert bare.method_args == preset_method_args("quickstart", "fedlgd") != {}
    # The preset's warm-up is the run-level virtual distillation: FedAvg's comparison with
    # --local-data virtual trains on the same sets.
    from fedvl.algorithms.fedlgd import FedLGD
    from fedvl.run.assemble import virtual_spec

    lgd = FedLGD(env=None, params=FedLGD.Params(**bare.method_args))
    assert lgd.warmup_spec() == virtual_spec(bare)
    assert cfg("--seed", "3")[1].method_args == bare.method_args   # flags sit on top of it
    used, full = cfg("--method", "fedlgd")
    assert not used and full.method_args == {} and full.virtual_steps == 100
    assert not cfg("--preset", "smoke")[0]
    seen = {}

    def fake_bench(base, methods, seeds, out, margs, *a, **k):
        seen.update(base=base, margs=margs)
        raise SystemExit(0)

    monkeypatch.setattr("fedvl.eval.comparison.run_bench", fake_bench)
    args = build_parser().parse_args(["bench", "--methods", "fedavg,fedlgd,fedvck",
                                      "--preset", "smoke", "--method-arg", "fedvck.steps=3"])
    with pytest.raises(SystemExit):
        cmd_bench(args)
    assert seen["base"].rounds == PRESETS["smoke"]["rounds"]
    assert seen["margs"] == {"fedavg": {}, "fedlgd": preset_method_args("smoke", "fedlgd"),
                             "fedvck": {**preset_method_args("smoke", "fedvck"), "steps": 3}}


def test_default_run_is_fedlgd_on_offline_digits():
    """`fedvl run` with no flags: FedLGD on the embedded benchmark, no data directory needed."""
    from fedvl.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["run"]))
    assert (cfg.method, cfg.benchmark, cfg.data_dir, cfg.rounds) == ("fedlgd", "digits-offline",
                                                                     None, 20)
    validate(cfg)


@pytest.mark.parametrize("fields", [
    {},
    {"num_clients": 5, "dataset": "bloodmnist"},   # set though digits-offline reads neither
    {"benchmark": "medmnist", "dataset": "bloodmnist", "partition": "shards"},
    {"benchmark": "cifar10c", "severity": 5, "partitions": 2},
    {"local_data": "virtual", "ipc": 2, "aggregation": "trimmed-mean", "trim": 0.1},
])
def test_config_yaml_lists_what_applies_and_reads_back_identically(tmp_path, fields):
    from fedvl.config import dump_yaml

    cfg = from_dict(fields)
    dump_yaml(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert load_yaml(tmp_path / "config.yaml") == cfg
    if not fields:
        # A digits-offline run does not list MedMNIST's, CIFAR-10-C's or label skew's options.
        for key in ("dataset:", "num_clients:", "severity:", "alpha:", "ipc:", "trim:"):
            assert key not in text
    for key in fields:
        assert f"{key}:" in text


def test_paper_preset_sets_each_methods_budgets_and_rounds_under_the_config_and_flags(
        tmp_path, monkeypatch):
    """`--preset paper`: width 128 and each method's published budgets and rounds; the config
    file and the flags still win, in `fedvl run` and per method in `fedvl bench`."""
    from fedvl.cli import build_parser, config_from_args
    from fedvl.cli.bench import cmd_bench
    from fedvl.config import preset_method_args

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["run", *argv]))

    vck = cfg("--preset", "paper", "--method", "fedvck")
    assert vck.rounds == 10 and vck.model_args["width"] == 128
    assert vck.method_args == preset_method_args("paper", "fedvck")
    assert vck.method_args["steps"] == 1000
    assert cfg("--preset", "paper", "--method", "fedlgd").rounds == 100
    assert cfg("--preset", "paper", "--method", "fedvck", "--rounds", "3").rounds == 3
    p = tmp_path / "c.yaml"
    p.write_text("rounds: 4\nmethod: feddm\n")
    assert cfg("--preset", "paper", "--config", str(p)).rounds == 4
    assert cfg("--preset", "paper", "--method", "fedavg").rounds == 20   # no paper of its own
    seen = {}

    def fake_bench(base, methods, seeds, out, margs, *a, method_run=None, **k):
        seen.update(base=base, margs=margs, runs=method_run)
        raise SystemExit(0)

    monkeypatch.setattr("fedvl.eval.comparison.run_bench", fake_bench)
    for extra, want in (([], {"fedvck": {"rounds": 10}, "feddm": {"rounds": 20}}),
                        (["--rounds", "2"], {"fedvck": {"rounds": 2}, "feddm": {"rounds": 2}})):
        args = build_parser().parse_args(["bench", "--methods", "fedavg,fedvck,feddm",
                                          "--preset", "paper", *extra])
        with pytest.raises(SystemExit):
            cmd_bench(args)
        assert seen["runs"] == want
        assert seen["margs"]["feddm"] == preset_method_args("paper", "feddm")


# A config.yaml as `fedvl run` wrote it when RunConfig was one flat class: every key, each away
# from its default.
FLAT_CONFIG = """\
method: fedprox
method_args:
  mu: 0.05
benchmark: cifar10c
data_dir: /data/x
domains:
- a
- b
dataset: bloodmnist
train_cap: 123
test_cap: 45
num_clients: 7
alpha: 0.3
partition: shards
shards_per_client: 3
dominant_share: 0.6
image_size: 24
severity: 4
corruptions:
- fog
- snow
partitions: 2
public: digits
public_size: 999
local_data: virtual
ipc: 5
virtual_steps: 7
virtual_init: noise
virtual_batch_real: 16
model: alexnet
model_args:
  width: 16
client_models:
- convnet
- alexnet
rounds: 3
client_ratio: 0.5
local_epochs: 2
local_steps: 9
batch_size: 64
lr: 0.05
lr_decay: 0.99
momentum: 0.5
weight_decay: 0.001
aggregation: trimmed-mean
trim: 0.1
min_replies: 2
eval_every: 2
seed: 11
device: cuda:1
threads: 3
workers: 2
autocast: bf16
upload_guard: 0.75
stack_clients: true
log:
- tensorboard
"""
# Where each option lives (the rest, `method`, `method_args` and `seed`, sit on RunConfig).
SECTIONS = {
    "data": ("benchmark", "data_dir", "domains", "dataset", "train_cap", "test_cap",
             "num_clients", "alpha", "partition", "shards_per_client", "dominant_share",
             "image_size", "severity", "corruptions", "partitions", "public", "public_size"),
    "virtual": ("local_data", "ipc", "virtual_steps", "virtual_init", "virtual_batch_real"),
    "models": ("model", "model_args", "client_models"),
    "training": ("local_epochs", "local_steps", "batch_size", "lr", "lr_decay", "momentum",
                 "weight_decay", "autocast"),
    "loop": ("rounds", "client_ratio", "aggregation", "trim", "min_replies", "eval_every"),
    "privacy": ("upload_guard",),
    "engine": ("device", "threads", "workers", "stack_clients", "log"),
}


# Options added after that file was written: it loads them at their defaults and a config that
# leaves them there writes the old text back.
NEWER = {"holdout_clients": ("data", 0), "deterministic": ("engine", False)}


def _flat_values() -> dict:
    """The old file's values as a config that loads it holds them (model options overlay)."""
    values = yaml.safe_load(FLAT_CONFIG)
    return {**values, "model_args": {**RunConfig().model_args, **values["model_args"]},
            **{k: default for k, (_, default) in NEWER.items()}}


def test_an_old_flat_config_yaml_loads_to_the_same_values_and_writes_back_the_same(tmp_path):
    (tmp_path / "config.yaml").write_text(FLAT_CONFIG)
    cfg = validate(load_yaml(tmp_path / "config.yaml"))
    values = _flat_values()
    assert set(values) == set(RunConfig().to_dict())     # the file sets every option
    assert {"method", "method_args", "seed"} | {n for ns in SECTIONS.values() for n in ns} == \
        set(values) - set(NEWER)
    for name, (sec, default) in NEWER.items():
        assert getattr(getattr(cfg, sec), name) == default == getattr(cfg, name), name
    assert cfg.to_dict() == values
    for sec, names in SECTIONS.items():
        for name in names:
            assert getattr(getattr(cfg, sec), name) == values[name] == getattr(cfg, name), name
    # Written back flat, keys in the order they always had: the text reads back to `cfg`.
    dump_yaml(cfg, tmp_path / "again.yaml")
    again = (tmp_path / "again.yaml").read_text()
    assert again == FLAT_CONFIG.replace("  width: 16\n", "  width: 16\n  depth: 3\n")
    assert load_yaml(tmp_path / "again.yaml") == cfg


def test_each_flag_lands_in_its_section():
    from fedvl.cli import build_parser, config_from_args

    values = _flat_values()
    argv = ["run", "--method-arg", "mu=0.05", "--width", "16"]
    for name, v in values.items():
        if name in ("method_args", "model_args") or v is False:   # an unset switch: no flag
            continue
        flag = "--" + name.replace("_", "-")
        argv += [flag] if v is True else [flag, ",".join(v) if isinstance(v, list) else str(v)]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.method_args == {"mu": 0.05} and cfg.seed == values["seed"]
    for sec, names in SECTIONS.items():
        for name in names:
            assert getattr(getattr(cfg, sec), name) == values[name], name
    assert cfg == validate(from_dict(values))


def test_flat_access_reads_and_sets_the_option_in_its_section():
    cfg = RunConfig(lr=0.5, rounds=3)
    assert (cfg.training.lr, cfg.loop.rounds) == (0.5, 3) == (cfg.lr, cfg.rounds)
    cfg.upload_guard = 0.5
    assert cfg.privacy.upload_guard == 0.5
    other = dataclasses.replace(cfg, lr=0.25)
    assert (other.training.lr, cfg.training.lr, other.loop.rounds) == (0.25, 0.5, 3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'roundz'"):
        RunConfig(roundz=3)
    with pytest.raises(AttributeError):
        _ = cfg.roundz


def test_each_section_fills_the_settings_of_the_layer_that_reads_it():
    from fedvl.run.assemble import data_options, round_config, train_config, virtual_spec

    cfg = validate(from_dict(_flat_values()))
    # Every training option, SGD and no clipping: only a server may train with another
    # optimiser, and only a method's own option clips (FedDyn's code's `max_grad_norm`).
    assert dataclasses.asdict(train_config(cfg)) == {**dataclasses.asdict(cfg.training),
                                                     "optimizer": "sgd", "max_grad_norm": 0.0}
    data = data_options(cfg)
    for f in dataclasses.fields(data):
        if f.name == "only_client":  # a Flower node's own setting, no run option
            assert data.only_client is None
            continue
        assert getattr(data, f.name) == (cfg.seed if f.name == "seed" else
                                         getattr(cfg.data, f.name)), f.name
    assert dataclasses.asdict(round_config(cfg)) == {
        "rounds": 3, "client_ratio": 0.5, "eval_every": 2, "seed": 11, "min_replies": 2}
    spec = virtual_spec(cfg)
    assert (spec.ipc, spec.steps, spec.init, spec.batch_real) == (5, 7, "noise", 16)

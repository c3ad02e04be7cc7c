"""Command line: `fedvl run | list` (and the subcommands other modules register)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from fedvl.config import ConfigError, RunConfig, from_dict, load_yaml

# CLI flag -> config field for `fedvl run` (and every command that runs experiments).
RUN_FLAGS: dict[str, tuple[str, Any, str]] = {
    "method": ("method", str, "registered method name (see `fedvl list`)"),
    "benchmark": ("benchmark", str, "registered benchmark name"),
    "data-dir": ("data_dir", str, "directory holding the .npz datasets"),
    "domains": ("domains", str, "comma-separated subset of domains (digits)"),
    "train-cap": ("train_cap", int, "max training samples per client (class-stratified)"),
    "test-cap": ("test_cap", int, "max test samples per client"),
    "num-clients": ("num_clients", int, "clients of partitioned benchmarks"),
    "alpha": ("alpha", float, "Dirichlet concentration of label-skew benchmarks"),
    "image-size": ("image_size", int, "resize images to this side"),
    "local-data": ("local_data", str, "real, or virtual: clients train on distilled sets"),
    "ipc": ("ipc", int, "images per class of the local virtual sets"),
    "virtual-steps": ("virtual_steps", int, "DM steps distilling each local virtual set"),
    "virtual-init": ("virtual_init", str, "stats, noise or real initialisation"),
    "model": ("model", str, "registered model name"),
    "rounds": ("rounds", int, "communication rounds"),
    "client-ratio": ("client_ratio", float, "fraction of clients sampled per round"),
    "local-epochs": ("local_epochs", int, "local epochs per round"),
    "local-steps": ("local_steps", int, "local steps per round (overrides epochs)"),
    "batch-size": ("batch_size", int, "local batch size"),
    "lr": ("lr", float, "client learning rate"),
    "momentum": ("momentum", float, "client SGD momentum"),
    "weight-decay": ("weight_decay", float, "client weight decay"),
    "aggregation": ("aggregation", str, "samples or uniform"),
    "eval-every": ("eval_every", int, "evaluate every N rounds"),
    "seed": ("seed", int, "run seed"),
    "device": ("device", str, "cpu, cuda, cuda:N or auto"),
    "threads": ("threads", int, "torch CPU threads"),
}


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The experiment options shared by run-like commands."""
    p.add_argument("--config", help="YAML file with settings (flags override it)")
    for flag, (_, typ, helptext) in RUN_FLAGS.items():
        p.add_argument(f"--{flag}", type=typ, default=None, help=helptext)
    p.add_argument("--width", type=int, help="model width (shortcut for --model-arg width=N)")
    p.add_argument("--depth", type=int, help="model depth (shortcut)")
    p.add_argument("--norm", help="model normalisation (shortcut)")
    p.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, repeatable (e.g. mu=0.01)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="model option, repeatable")


def _kv(items: list[str], what: str) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{what} '{item}' must look like KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults < --config YAML < flags."""
    cfg = load_yaml(args.config) if args.config else RunConfig()
    data: dict[str, Any] = {}
    for flag, (field, _, _) in RUN_FLAGS.items():
        v = getattr(args, flag.replace("-", "_"))
        if v is not None:
            data[field] = v
    model_args = _kv(args.model_arg, "--model-arg")
    for k in ("width", "depth", "norm"):
        if getattr(args, k) is not None:
            model_args[k] = getattr(args, k)
    if model_args:
        data["model_args"] = model_args
    if args.method_arg:
        data["method_args"] = {**cfg.method_args, **_kv(args.method_arg, "--method-arg")}
    if "method" in data and data["method"] != cfg.method and not args.method_arg:
        data.setdefault("method_args", {})
    return from_dict(data, cfg)


def print_summary(summary: dict[str, Any]) -> None:
    """Per-client accuracy table with the unweighted mean."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{summary['method']} on {summary['benchmark']} "
                        f"(seed {summary['seed']}, {summary['rounds']} rounds)")
    table.add_column("client")
    table.add_column("accuracy", justify="right")
    glob = summary.get("global_accuracy")
    if glob:
        table.add_column("own model on all clients", justify="right")
    for name, acc in summary["per_client_accuracy"].items():
        row = [name, f"{100 * acc:.2f}%"]
        if glob:
            row.append(f"{100 * glob[name]:.2f}%")
        table.add_row(*row)
    mean_row = ["mean (unweighted)", f"{100 * summary['mean_accuracy']:.2f}%"]
    if glob:
        mean_row.append(f"{100 * summary['mean_global_accuracy']:.2f}%")
    table.add_row(*mean_row, style="bold")
    console = Console()
    console.print(table)
    mb = 1024 * 1024
    console.print(f"communication: up {summary['bytes_up'] / mb:.2f} MiB, down "
                  f"{summary['bytes_down'] / mb:.2f} MiB; wall {summary['wall_seconds']:.1f} s")
    console.print(f"run directory: {summary['run_dir']}")


def cmd_run(args: argparse.Namespace) -> int:
    """`fedvl run`: one experiment."""
    from fedvl.experiment import resume_experiment, run_experiment

    if args.resume:
        summary = resume_experiment(args.resume, progress=not args.quiet)
    else:
        cfg = config_from_args(args)
        summary = run_experiment(cfg, out=args.out, progress=not args.quiet)
    print_summary(summary)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """`fedvl list`: registered methods, benchmarks and models."""
    from fedvl.registry import ALGORITHMS, BENCHMARKS, MODELS

    for title, reg in (("methods", ALGORITHMS), ("benchmarks", BENCHMARKS), ("models", MODELS)):
        print(f"{title}: {', '.join(reg.names())}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `fedvl` argument parser."""
    parser = argparse.ArgumentParser(prog="fedvl", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run one federated experiment")
    add_run_options(run)
    run.add_argument("--out", help="run directory (default runs/<method>-<benchmark>-...)")
    run.add_argument("--resume", metavar="DIR", help="continue an interrupted run directory")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run)
    lst = sub.add_parser("list", help="list registered methods, benchmarks and models")
    lst.set_defaults(func=cmd_list)
    for register in _extensions():
        register(sub)
    return parser


def _extensions() -> list:
    """Subcommands contributed by other modules (each exposes `register_cli(subparsers)`)."""
    import importlib

    found = []
    for mod in ("fedvl.bench", "fedvl.distill.cli", "fedvl.flower.cli"):
        try:
            found.append(importlib.import_module(mod).register_cli)
        except ModuleNotFoundError as e:
            if e.name is None or not mod.startswith(e.name):
                raise
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; errors in config, data or messages print one line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["run"]
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        args = parser.parse_args(["run", *argv])
    try:
        return args.func(args)
    except (ConfigError, ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"fedvl: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

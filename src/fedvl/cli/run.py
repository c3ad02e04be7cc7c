"""`fedvl run` (one experiment) and `fedvl list` (what is registered)."""

from __future__ import annotations

import argparse
from typing import Any

from fedvl.cli.common import add_run_options, config_from_args, print_summary, resumed_config
from fedvl.config import DEFAULT_PRESET, ConfigError


def use_default_preset(args: argparse.Namespace) -> bool:
    """A new run given no --method, --config or --preset runs `DEFAULT_PRESET`; whether it did."""
    if args.resume or args.method is not None or args.config or args.preset:
        return False
    args.preset = DEFAULT_PRESET
    return True


def cmd_run(args: argparse.Namespace) -> int:
    """`fedvl run`: one experiment."""
    from fedvl.run.experiment import check_experiment, resume_experiment, run_experiment

    if use_default_preset(args):
        # Said before anything runs: what follows is the quick setting, not the method's own.
        print(f"fedvl: no --method given: running --preset {DEFAULT_PRESET} (FedLGD with reduced "
              "distillation budgets; docs/methods.md); `--method fedlgd` runs its full defaults")
    if args.dry_run:
        if args.resume:
            raise ConfigError("--dry-run checks a new run's settings; it does not take --resume")
        cfg = config_from_args(args)
        fed = check_experiment(cfg)
        print(f"fedvl: ok: {cfg.method} on {cfg.benchmark} ({len(fed.clients)} clients, model "
              f"{cfg.model}) passed every check; nothing was run or written")
        return 0
    if args.resume:
        rounds = resumed_config(args, args.resume).rounds
        summary = resume_experiment(args.resume, progress=not args.quiet, rounds=rounds)
    else:
        cfg = config_from_args(args)
        summary = run_experiment(cfg, out=args.out, progress=not args.quiet)
    print_summary(summary, args.preset)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """`fedvl list`: registered methods, benchmarks and models."""
    from fedvl.registry import ALGORITHMS, BENCHMARKS, MODELS

    for title, reg in (("methods", ALGORITHMS), ("benchmarks", BENCHMARKS), ("models", MODELS)):
        print(f"{title}: {', '.join(reg.names())}")
    return 0


def register_cli(sub: Any) -> None:
    """Add `fedvl run` and `fedvl list`."""
    run = sub.add_parser("run", help="run one federated experiment")
    add_run_options(run)
    run.add_argument("--out", help="run directory (default runs/<method>-<benchmark>-...)")
    run.add_argument("--resume", metavar="DIR",
                     help="continue an interrupted run directory; with --rounds N, continue a "
                     "finished or interrupted run to N rounds (other flags must match its "
                     "config.yaml)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--dry-run", action="store_true",
                     help="check the config, data, model and method options, then stop: "
                          "no training, no run directory")
    run.set_defaults(func=cmd_run)
    lst = sub.add_parser("list", help="list registered methods, benchmarks and models")
    lst.set_defaults(func=cmd_list)

"""`fedvl tune`: the command-line front end of `fedvl.eval.tuning`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from fedvl.cli.common import add_run_options, config_from_args
from fedvl.config import ConfigError, preset_method_args, preset_run_args
from fedvl.options import values_from_args

HELP = "search each method's hyperparameters with the same trial budget (Optuna)"


def parse_seeds(text: str) -> list[int]:
    """`0,1,2` -> [0, 1, 2]; anything else is one ConfigError."""
    try:
        seeds = [int(s) for s in text.split(",") if s]
    except ValueError as e:
        raise ConfigError(f"--seeds must be comma-separated integers, got '{text}'") from e
    if not seeds:
        raise ConfigError("--seeds must name at least one seed")
    return seeds


def fixed_options(args: argparse.Namespace) -> set[str]:
    """The run options the user set (a flag or a key of --config): held fixed, not searched."""
    from fedvl.config import RunConfig

    fixed = set(values_from_args(args, RunConfig))
    if args.config:
        try:
            data = yaml.safe_load(Path(args.config).read_text())
        except (OSError, yaml.YAMLError, ValueError):
            data = None   # config_from_args has already named what is wrong with the file
        if isinstance(data, dict):
            fixed |= {k for k in data if isinstance(k, str)}
    return fixed


def cmd_tune(args: argparse.Namespace) -> int:
    """`fedvl tune`."""
    # Here, not at import: `fedvl tune --help` starts without torch or optuna.
    from fedvl.eval.comparison import parse_method_args
    from fedvl.eval.tuning import require_optuna, tune
    from fedvl.registry import ALGORITHMS

    require_optuna()
    methods = [m for m in args.methods.split(",") if m]
    if not methods:
        raise ConfigError("--methods must name at least one method")
    for m in methods:
        try:
            ALGORITHMS.get(m)   # plain and composed (BASE+ADDON) names
        except KeyError as e:
            raise ConfigError(f"--methods names an unknown method: {e.args[0]}") from e
    if args.trials < 1:
        raise ConfigError(f"--trials {args.trials} is invalid; allowed: an integer >= 1 (the "
                          "finished trials every method gets)")
    seeds = parse_seeds(args.seeds)
    margs = parse_method_args(args.method_arg, methods)
    if args.preset:
        margs = {m: {**preset_method_args(args.preset, m), **margs[m]} for m in methods}
    args.method_arg = []
    base = config_from_args(args)
    if args.preset:
        for m in methods:
            # `fedvl bench --preset paper` runs each method with its own rounds; a search keeps
            # one setting for every method, so a difference is refused, not ignored.
            own = config_from_args(argparse.Namespace(**{**vars(args), "method": m}))
            differ = {k: getattr(own, k) for k in preset_run_args(args.preset, m)
                      if getattr(own, k) != getattr(base, k)}
            if differ:
                given = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in differ.items())
                raise ConfigError(f"--preset {args.preset} gives {m} run settings of its own "
                                  f"({given}); fedvl tune runs every method with the same "
                                  "ones: give them as flags")
    out = Path(args.out or f"runs/tune-{base.benchmark}")
    report = tune(base, methods, args.trials, out, margs, seeds=seeds,
                  val_fraction=args.val_fraction, fixed=fixed_options(args),
                  progress=not args.quiet)
    for m, entry in report["methods"].items():
        best = entry["best"]
        states = ", ".join(f"{n} {s}" for s, n in sorted(entry["states"].items()))
        if best is None:
            print(f"{m}: no completed trial ({states})")
            continue
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in {**best["run"],
                                                        **best["method_args"]}.items())
        print(f"{m}: best validation accuracy {100 * best['value']:.2f}% (trial "
              f"{best['trial']}; {states}): {shown or 'no option searched'}")
    print(f"written: {out / 'trials.json'}, {out / 'best'}/<method>.yaml, {out / 'study.db'}")
    print(f"compare them: fedvl bench --tuned {out} --methods {','.join(methods)} "
          f"--benchmark {base.benchmark}")
    return 0


def _fmt(v: Any) -> str:
    """A setting as the summary lines show it (floats to 4 significant digits)."""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def register_cli(sub: Any) -> None:
    """Add `fedvl tune` to the CLI."""
    from fedvl.eval.tuning import DEFAULT_VAL_FRACTION

    p = sub.add_parser("tune", help=HELP)
    add_run_options(p)
    p.add_argument("--methods", required=True, help="comma-separated method names")
    p.add_argument("--trials", type=int, default=20,
                   help="finished (completed or pruned) trials per method (default: 20)")
    p.add_argument("--seeds", default="0",
                   help="comma-separated seeds each trial runs; the objective is the mean over "
                   "them (default: 0)")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help="class-stratified fraction of each client's training images held out "
                   "as its validation set, on which trials are scored (default: "
                   f"{DEFAULT_VAL_FRACTION}); test sets are never used")
    p.add_argument("--out", help="output directory: study.db, trials.json, best/<method>.yaml "
                   "(default runs/tune-<benchmark>); run again to continue the studies")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_tune)

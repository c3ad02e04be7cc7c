"""Command line: `fedvl COMMAND`, one module per command group.

Each module (`run`, `bench`, `reproduce`, `tune`, `distill`, `flower`, `report`, `privacy`,
`unlearn`, `heterogeneity`, `perf`) exposes `register_cli(subparsers)`; `common` holds the run
flags they share, generated from the RunConfig fields. `fedvl` without a command runs
`fedvl run`. Only the named command's module is imported (the others appear as names with
their one-line help), so `fedvl --help` imports neither torch nor any command's dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from fedvl.options import ERROR_LINE_LIMIT, elided

__all__ = ["COMMANDS", "add_run_options", "build_parser", "config_from_args", "main",
           "print_summary"]

# command -> (module of fedvl.cli that registers it, its one-line help). The modules give the
# same help to `add_parser` (a test keeps the two equal); this copy lists the commands without
# importing them.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "run one federated experiment"),
    "list": ("run", "list registered methods, benchmarks and models"),
    "bench": ("bench", "compare methods over seeds on one benchmark"),
    "tune": ("tune", "search each method's hyperparameters with the same trial budget "
                     "(Optuna)"),
    "distill": ("distill", "distil one client's data into a synthetic set"),
    "flower": ("flower", "run on Flower (simulation or SuperLink/SuperNodes)"),
    "reproduce": ("reproduce", "re-run a paper's table from its spec (fedvl reproduce --list "
                               "names them)"),
    "report": ("report", "HTML report (figures, tables, images) of a run or bench"),
    "privacy": ("privacy", "membership inference (LiRA) against a finished run"),
    "unlearn": ("unlearn", "forget a class or a client of a finished --local-data virtual run "
                           "(QuickDrop-style)"),
    "heterogeneity": ("heterogeneity",
                      "client shift before/after local distillation (MMD, histograms, t-SNE)"),
    "perf": ("perf", "the bare loop, fedvl and peer frameworks on one FedAvg workload: "
                     "s/round, img/s, start-up, memory, accuracy"),
}


def __getattr__(name: str) -> Any:
    """`add_run_options`, `config_from_args`, `print_summary`: from `fedvl.cli.common`, lazily
    (it imports the run config, hence torch)."""
    if name in ("add_run_options", "config_from_args", "print_summary"):
        from fedvl.cli import common

        return getattr(common, name)
    raise AttributeError(f"module 'fedvl.cli' has no attribute '{name}'")


class Parser(argparse.ArgumentParser):
    """argparse with fedvl's error form: one bounded line instead of a usage dump.

    argparse echoes a bad value whole (`--lr` followed by 100,000 characters); the line is
    elided like every other error. Subcommand parsers are built from this class too, and none
    takes abbreviations: `--round 2` is an unknown flag, not `--rounds 2`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print one `fedvl: error:` line naming the command and exit with status 2."""
        text = f"{self.prog}: {message} (see `{self.prog} --help`)"
        print(f"fedvl: error: {elided(text, ERROR_LINE_LIMIT - len('fedvl: error: '))}",
              file=sys.stderr)
        sys.exit(2)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `fedvl` argument parser: every command in full, or only `command` in full.

    With `command` given (or "" for none), the other commands are entries with their help and
    no options, and their modules are not imported.
    """
    parser = Parser(prog="fedvl", description="fedvl: federated virtual learning. Commands: "
                    + ", ".join(COMMANDS) + " (`fedvl COMMAND --help` for each; no command "
                    "runs `fedvl run`).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    done: set[str] = set()
    for name, (module, text) in COMMANDS.items():
        if module in done:
            continue
        if command is None or COMMANDS.get(command, ("",))[0] == module:
            importlib.import_module(f"fedvl.cli.{module}").register_cli(sub)
            done.add(module)
        else:
            sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; errors in config, data or messages print one line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]   # `fedvl --rounds 2` is `fedvl run --rounds 2`
    command = argv[0] if argv[0] in COMMANDS else ""
    if command:
        # Before the command's module imports torch, whose allocations and threads they govern.
        from fedvl.engine.allocator import keep_freed_memory
        from fedvl.engine.omp import passive_waits

        keep_freed_memory()
        passive_waits()
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from fedvl.config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"fedvl: error: {elided(str(msg), ERROR_LINE_LIMIT - len('fedvl: error: '))}",
              file=sys.stderr)
        return 2

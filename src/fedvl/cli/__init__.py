"""Command line: `fedvl run | list | bench | distill | flower | report | privacy | heterogeneity |
perf`.

One module per command group (`run`, `bench`, `distill`, `flower`, `report`, `privacy`,
`heterogeneity`, `perf`), each exposing `register_cli(subparsers)`; `common` holds the run
flags they share, generated from the RunConfig fields. `fedvl` without a command runs `fedvl run`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from fedvl.cli import bench, distill, flower, heterogeneity, perf, privacy, report, run
from fedvl.cli.common import add_run_options, config_from_args, print_summary
from fedvl.config import ConfigError
from fedvl.engine.allocator import keep_freed_memory
from fedvl.options import ERROR_LINE_LIMIT, elided

__all__ = ["add_run_options", "build_parser", "config_from_args", "main", "print_summary"]


class Parser(argparse.ArgumentParser):
    """argparse with fedvl's error form: one bounded line instead of a usage dump.

    argparse echoes a bad value whole (`--lr` followed by 100,000 characters); the line is
    elided like every other error. Subcommand parsers are built from this class too.
    """

    def error(self, message: str) -> NoReturn:
        """Print one `fedvl: error:` line naming the command and exit with status 2."""
        text = f"{self.prog}: {message} (see `{self.prog} --help`)"
        print(f"fedvl: error: {elided(text, ERROR_LINE_LIMIT - len('fedvl: error: '))}",
              file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """The `fedvl` argument parser."""
    parser = Parser(prog="fedvl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    for module in (run, bench, distill, flower, report, privacy, heterogeneity, perf):
        module.register_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; errors in config, data or messages print one line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    keep_freed_memory()
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
        print(f"fedvl: error: {elided(str(msg), ERROR_LINE_LIMIT - len('fedvl: error: '))}",
              file=sys.stderr)
        return 2

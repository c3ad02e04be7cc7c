"""`fedvl report PATH`: an HTML page with the figures of a run or a `fedvl bench` directory."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_report(args: argparse.Namespace) -> int:
    """Write report.html (and its PNG/SVG figures) and print its path."""
    from fedvl.eval.html_report import write_report

    path = write_report(args.path, args.out)
    print(path)
    return 0


def register_cli(sub: Any) -> None:
    """Add `fedvl report` to the CLI."""
    p = sub.add_parser("report", help="HTML report (figures, tables, images) of a run or bench")
    p.add_argument("path", help="a run directory or a fedvl bench directory")
    p.add_argument("--out", help="where to write report.html and its figures (default: PATH)")
    p.set_defaults(func=cmd_report)

"""`fedvl reproduce TABLE`: a paper's (or fedvl's) table from its spec, in one command."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from fedvl.config import ConfigError

HELP = "re-run a paper's table from its spec (fedvl reproduce --list names them)"


def _seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        seeds = [int(s) for s in text.split(",") if s]
    except ValueError as e:
        raise ConfigError(f"--seeds must be comma-separated integers >= 0, got '{text}'") from e
    if not seeds or min(seeds) < 0:
        raise ConfigError(f"--seeds must be comma-separated integers >= 0, got '{text}'")
    return seeds


def _print_list() -> None:
    from fedvl.eval.reproduce import listing

    for t in listing():
        scales = "; ".join(f"{s}: {v['runs']} runs, {v['cost']}" for s, v in t["scales"].items())
        print(f"{t['name']}: {t['title']} ({t['arms']} arms, {t['claims']} claims) | {scales}")


def cmd_reproduce(args: argparse.Namespace) -> int:
    """`fedvl reproduce`."""
    if args.list:
        _print_list()
        return 0
    if not args.table:
        raise ConfigError("name a table (fedvl reproduce --list shows them) or give --list")
    from fedvl.eval import grid
    from fedvl.eval.reproduce import run_table
    from fedvl.eval.tables import load_spec, select_arms

    jobs = grid.parse_jobs(args.jobs)
    seeds = _seeds(args.seeds)
    spec = load_spec(args.table)
    if args.arms:
        spec = select_arms(spec, [a for a in args.arms.split(",") if a])
    if args.scale not in spec.scales:
        raise ConfigError(f"table '{spec.name}' has no scale '{args.scale}'; allowed: "
                          f"{', '.join(spec.scales)}")
    overrides: dict[str, Any] = {}
    for key in ("data_dir", "device", "threads", "workers"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    out = Path(args.out or f"runs/reproduce-{spec.name}-{args.scale}")
    out.mkdir(parents=True, exist_ok=True)
    command = command_line(args)
    result = run_table(spec, args.scale, out, command, seeds=seeds, overrides=overrides,
                       jobs=jobs, report_only=args.report_only, progress=not args.quiet)
    sys.stdout.write((out / "reproduce.md").read_text())
    verdicts = [c["status"] for c in result["claims"]]
    print(f"claims: {verdicts.count('holds')} hold, {verdicts.count('fails')} fail, "
          f"{verdicts.count('not enough seeds')} need more seeds; written: {out}")
    return 0


def register_cli(sub: Any) -> None:
    """Add `fedvl reproduce` to the CLI."""
    p = sub.add_parser("reproduce", help=HELP)
    p.add_argument("table", nargs="?", help="a table name (see --list) or a spec .yaml path")
    p.add_argument("--list", action="store_true",
                   help="list the tables, their arms and what each scale costs")
    p.add_argument("--scale", default="cpu",
                   help="cpu (about an hour on two cores) or paper (the paper's budgets, for a "
                   "GPU); a spec may name others")
    p.add_argument("--seeds", help="comma-separated seeds (default: the scale's)")
    p.add_argument("--arms", help="comma-separated subset of the table's arms (default: all)")
    p.add_argument("--data-dir", help="directory holding the datasets")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--threads", type=int, help="torch CPU threads of each run's server work")
    p.add_argument("--workers", type=int, help="clients run concurrently in a round")
    p.add_argument("--jobs", default="1", metavar="N",
                   help="runs at once as worker processes, or auto (as fedvl bench --jobs)")
    p.add_argument("--out", help="output folder (default runs/reproduce-TABLE-SCALE); "
                   "finished runs in it are reused")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing; tabulate the runs already finished in --out")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_reproduce)


def command_line(args: argparse.Namespace) -> str:
    """The `fedvl reproduce` line that gives this result (the flags that change it)."""
    parts = ["fedvl", "reproduce", str(args.table), "--scale", args.scale]
    for flag in ("arms", "seeds", "data_dir", "device", "threads", "workers", "jobs", "out"):
        value = getattr(args, flag)
        if value is not None and not (flag == "jobs" and value == "1"):
            parts += [f"--{flag.replace('_', '-')}", str(value)]
    return shlex.join(parts)

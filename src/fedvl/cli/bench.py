"""`fedvl bench`: the command-line front end of `fedvl.eval.comparison`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from fedvl.cli.common import add_run_options, config_from_args
from fedvl.config import ConfigError, preset_method_args, preset_run_args
from fedvl.defaults import (
    DEFAULT_PROTOCOL,
    ONE_SHOT_LOCAL_EPOCHS,
    PROTOCOLS,
    protocol_run_defaults,
)


def cmd_bench(args: argparse.Namespace) -> int:
    """`fedvl bench`."""
    # Here, not at import: `fedvl bench --help` starts without torch.
    from fedvl.eval.comparison import parse_method_args, render_markdown, run_bench
    from fedvl.eval.grid import parse_jobs, parse_memory

    # Before anything is read or run: a bad --jobs is refused at once.
    jobs = parse_jobs(args.jobs)
    max_memory = parse_memory(args.max_memory) if args.max_memory is not None else None
    methods = [m for m in args.methods.split(",") if m]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError as e:
        raise ConfigError(f"--seeds must be comma-separated integers, got '{args.seeds}'") from e
    if not methods or not seeds:
        raise ConfigError("--methods and --seeds must each name at least one value")
    margs = parse_method_args(args.method_arg, methods)
    one_shot = args.protocol == "one-shot"
    if one_shot and args.rounds not in (None, 1):
        raise ConfigError(f"--protocol one-shot runs every method for exactly one round; "
                          f"--rounds {args.rounds} contradicts it (drop --rounds)")
    # The protocol's local epochs sit under the preset, the config file and the flags.
    under = protocol_run_defaults(args.protocol) or None
    runs: dict[str, dict[str, Any]] = {}
    if args.tuned:
        from fedvl.eval.tuning import load_tuned

        # Each method's best settings of `fedvl tune`, under what --method-arg sets.
        tuned_args, tuned_run = load_tuned(args.tuned, methods)
        margs = {m: {**tuned_args[m], **margs[m]} for m in methods}
    if args.preset:
        # Each method gets its own cuts of the preset, under what --method-arg sets, and its
        # own run settings (the paper's rounds), under what the config file and flags set.
        margs = {m: {**preset_method_args(args.preset, m), **margs[m]} for m in methods}
        for m in methods:
            if keys := preset_run_args(args.preset, m):
                own = config_from_args(argparse.Namespace(**{**vars(args), "method": m,
                                                            "method_arg": []}), under=under)
                runs[m] = {k: getattr(own, k) for k in keys}
    if args.tuned:
        runs = {m: {**runs.get(m, {}), **tuned_run[m]} for m in methods}
    args.method_arg = []
    base = config_from_args(args, under=under)
    reference = None
    if args.reference:
        ref_path = Path(args.reference)
        if not ref_path.is_file():
            raise ConfigError(f"reference file '{ref_path}' does not exist")
        reference = yaml.safe_load(ref_path.read_text())
        if not isinstance(reference, dict):
            raise ConfigError(f"reference file '{ref_path}' must hold a mapping")
    target = args.target_acc
    if target is not None and not 0 < target <= 1:
        raise ConfigError(f"--target-acc {target} is not an accuracy; allowed: a fraction in "
                          "(0, 1], e.g. 0.6 for 60 %")
    out = Path(args.out or f"runs/bench-{base.benchmark}")
    comp = run_bench(base, methods, seeds, out, margs, reference, progress=not args.quiet,
                     method_run=runs,
                     report_only=args.report_only, target_acc=target, protocol=args.protocol,
                     tuned=args.tuned, jobs=jobs, max_memory=max_memory)
    print(render_markdown(comp))
    print("written: " + ", ".join(str(out / name) for name in comp["files"]))
    return 0


def register_cli(sub: Any) -> None:
    """Add `fedvl bench` to the CLI."""
    p = sub.add_parser("bench", help="compare methods over seeds on one benchmark")
    add_run_options(p)
    p.add_argument("--methods", required=True, help="comma-separated method names")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--reference", help="YAML with reference numbers to show beside ours")
    p.add_argument("--out", help="output directory (default runs/bench-<benchmark>)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing; tabulate the runs already finished in --out")
    p.add_argument("--target-acc", type=float, metavar="A",
                   help="also report, per method, the rounds to mean accuracy A (a fraction, "
                   "e.g. 0.6) and the speed-up over fedavg when it is benched")
    p.add_argument("--protocol", choices=PROTOCOLS, default=DEFAULT_PROTOCOL,
                   help="multi-round: every method runs --rounds rounds; one-shot: exactly one "
                   "round with every client (--client-ratio 1), local training "
                   f"--local-epochs {ONE_SHOT_LOCAL_EPOCHS} unless given, and a table of "
                   "accuracy against total bytes (docs/protocol.md)")
    p.add_argument("--tuned", metavar="DIR",
                   help="run each method with its best settings of `fedvl tune --out DIR` "
                   "(its tuned method options and client optimiser; every other setting from "
                   "these flags); --method-arg still overrides a method option")
    p.add_argument("--jobs", default="1", metavar="N",
                   help="run the methods x seeds grid on N worker processes on --device (each "
                   "with cores/N torch threads; the comparison of 1, the default, but for the "
                   "seconds), or auto: as many as the first run's measured peak memory fits in "
                   "90 %% of the free memory, at most one per CPU core (docs/performance.md)")
    p.add_argument("--max-memory", metavar="SIZE",
                   help="with --jobs auto: the memory the grid may fill on its device (RAM on "
                   "the CPU, GPU memory on CUDA), e.g. 8G, when less than is free")
    p.set_defaults(func=cmd_bench)

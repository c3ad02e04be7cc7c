"""`fedvl unlearn RUN_DIR --class C | --client K`: QuickDrop-style unlearning of a finished run."""

from __future__ import annotations

import argparse
from typing import Any

HELP = "forget a class or a client of a finished --local-data virtual run (QuickDrop-style)"


def cmd_unlearn(args: argparse.Namespace) -> int:
    """Ascent on the forgotten distilled data, recovery on the rest; print the table."""
    from fedvl.eval.unlearning import UnlearnSettings, replaced, table, unlearn_run

    s = replaced(UnlearnSettings(), ascent_steps=args.ascent_steps, ascent_lr=args.ascent_lr,
                 recovery_rounds=args.recovery_rounds, recovery_epochs=args.recovery_steps,
                 lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size)
    res = unlearn_run(args.run_dir, args.forget_class, args.client, args.out, s,
                      with_retrain=args.retrain)
    print(table(res))
    print(f"written: {args.out or args.run_dir}/unlearn.json, unlearned_model.pt")
    return 0


def register_cli(sub: Any) -> None:
    """Add `fedvl unlearn` to the CLI."""
    p = sub.add_parser("unlearn", help=HELP)
    p.add_argument("run_dir", help="a finished in-process run made with --local-data virtual")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--class", dest="forget_class", metavar="C",
                       help="forget class C (its distilled images from every client)")
    which.add_argument("--client", metavar="K",
                       help="forget client K (name or index: its whole distilled set)")
    p.add_argument("--out", help="where unlearn.json and unlearned_model.pt go (default: run)")
    p.add_argument("--retrain", action="store_true",
                   help="also retrain the run from scratch without the forgotten data (in "
                        "OUT/retrain) and compare: accuracy, attack AUC and time")
    p.add_argument("--ascent-steps", type=int,
                   help="SGD steps on the forgotten data, then reflected (default 1)")
    p.add_argument("--ascent-lr", type=float, help="learning rate of the ascent (default 0.01)")
    p.add_argument("--recovery-rounds", type=int,
                   help="FedAvg rounds on the remaining distilled data (default 5)")
    p.add_argument("--recovery-steps", type=int,
                   help="local epochs per recovery round (default 5)")
    p.add_argument("--lr", type=float, help="learning rate of the recovery (default 0.01)")
    p.add_argument("--weight-decay", type=float, help="SGD weight decay (default 0.001)")
    p.add_argument("--batch-size", type=int, help="batch size (default 256)")
    p.set_defaults(func=cmd_unlearn)

"""`fedvl privacy RUN_DIR --client NAME`: membership inference (LiRA) against a finished run."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_privacy(args: argparse.Namespace) -> int:
    """Run LiRA (online, offline) and the synthetic-data attack; print the AUCs."""
    from fedvl.eval.membership import run_lira

    res = run_lira(args.run_dir, args.client, args.shadows, args.out, progress=not args.quiet)
    for name, m in res["attacks"].items():
        print(f"{name:18s} AUC {m['auc']:.4f}  TPR@0.1%FPR {m['tpr_at_0.1%_fpr']:.4f}  "
              f"TPR@1%FPR {m['tpr_at_1%_fpr']:.4f}")
    print(f"written: {args.out or args.run_dir}/privacy.json, privacy_roc.png")
    return 0


def register_cli(sub: Any) -> None:
    """Add `fedvl privacy` to the CLI."""
    p = sub.add_parser("privacy", help="membership inference (LiRA) against a finished run")
    p.add_argument("run_dir", help="a finished in-process run directory")
    p.add_argument("--client", default="0", help="target client (name or index; default 0)")
    p.add_argument("--shadows", type=int, default=16,
                   help="shadow federations to train (even; default 16)")
    p.add_argument("--out", help="where privacy.json, the ROC and the shadows go (default: run)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_privacy)

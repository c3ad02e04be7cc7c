"""`fedvl heterogeneity`: how far apart the clients are, before and after local distillation."""

from __future__ import annotations

import argparse
from typing import Any

from fedvl.cli.common import add_run_options, config_from_args


def cmd_heterogeneity(args: argparse.Namespace) -> int:
    """Write heterogeneity.json and figures; print real vs virtual mean pairwise MMD^2."""
    from fedvl.config import load_yaml, validate
    from fedvl.eval.shift import analyse
    from fedvl.progress import StatusLine

    cfg = load_yaml(f"{args.run}/config.yaml") if args.run else validate(config_from_args(args))
    out = args.out or f"runs/heterogeneity-{cfg.benchmark}"
    line = None if args.quiet else StatusLine("heterogeneity: ")
    try:
        res = analyse(cfg, out, args.run, samples=args.samples, tsne_points=args.tsne_points,
                      progress=line)
    finally:
        if line is not None:
            line.close()
    for kind in ("pixels", "features"):
        r, v = res[kind]["real"], res[kind]["virtual"]
        print(f"{kind:8s} mean pairwise MMD^2: real {r['mean_pairwise_mmd2']:.4f} "
              f"(within-client {r['mean_within_client_mmd2']:.4f}), local virtual "
              f"{v['mean_pairwise_mmd2']:.4f} (within-client {v['mean_within_client_mmd2']:.4f})")
        if "mean_between_group_mmd2" in r:
            print(f"{'':8s} real: same group {r.get('mean_within_group_mmd2', float('nan')):.4f}"
                  f", different groups {r['mean_between_group_mmd2']:.4f}")
    print(f"written: {out}/heterogeneity.json and its figures")
    return 0


def register_cli(sub: Any) -> None:
    """Add `fedvl heterogeneity` to the CLI."""
    p = sub.add_parser("heterogeneity",
                       help="client shift before/after local distillation (MMD, histograms, t-SNE)")
    add_run_options(p)
    p.add_argument("--run", help="a finished run: its config, and its model for the features")
    p.add_argument("--samples", type=int, default=200, help="images per client half for MMD")
    p.add_argument("--tsne-points", type=int, default=150, help="real images per client in t-SNE")
    p.add_argument("--out", help="output directory (default runs/heterogeneity-<benchmark>)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_heterogeneity)

"""`fedvl perf`: the bare loop, fedvl (sequential, parallel, Flower) and peers on one workload."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from fedvl.options import ConfigError

DEFAULT_ENGINES = "bare,embedded,workers,processes,flower,pfl,blazefl"


def _counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(f"--clients must be comma-separated integers >= 1, got '{text}'")
    return counts


def _device(name: str) -> str:
    """`name` resolved as `fedvl run` resolves `--device` (cpu, cuda[:N] or auto), or a
    ConfigError saying what is allowed here."""
    import torch

    from fedvl.run.assemble import resolve_device

    try:
        device = resolve_device(name)
    except RuntimeError as e:   # not a device name torch knows
        raise ConfigError(f"--device must be cpu or cuda[:N] or auto, got '{name}'") from e
    except ValueError as e:     # CUDA asked for on a machine without it
        raise ConfigError(f"--device {name}: CUDA is not available on this machine ({e}); "
                          "allowed here: cpu") from e
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda[:N] or auto, got '{name}'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                          "CUDA device(s)")
    return "cpu" if device.type == "cpu" else str(device)


def _write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out)
    print(f"written: {out}")


def cmd_perf_distill(args: argparse.Namespace) -> int:
    """Measure every synthesis objective, print the table, write the JSON."""
    from fedvl.perf.synthesis import OBJECTIVES, run_distill_perf, table

    given = OBJECTIVES if args.objectives is None else args.objectives.split(",")
    names = [o.strip() for o in given if o.strip()]
    bad = sorted(set(names) - set(OBJECTIVES))
    if bad or not names:
        raise ConfigError(f"--objectives: unknown {bad or '(none given)'}; allowed: "
                          f"{', '.join(OBJECTIVES)}")
    if args.width < 1:
        raise ConfigError(f"--width must be >= 1, got {args.width}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if not args.seconds > 0:
        raise ConfigError(f"--seconds must be > 0, got {args.seconds}")
    if args.train_cap is not None and args.train_cap < 1:
        raise ConfigError(f"--train-cap must be >= 1, got {args.train_cap}")
    device = _device(args.device)
    result = run_distill_perf(names, args.benchmark or "digits-offline", args.data_dir,
                              args.train_cap, args.seed, args.width, device,
                              args.threads or 1, args.seconds, graph=args.graph)
    result["command"] = "fedvl perf " + " ".join(sys.argv[2:])
    print(table(result))
    _write(result, Path(args.out if args.out != "perf.json" else "perf-distill.json"))
    return 0


def cmd_perf(args: argparse.Namespace) -> int:
    """Measure every engine, print the table, write the JSON."""
    if args.distill:
        return cmd_perf_distill(args)
    from fedvl.perf.harness import ALL_ENGINES, run_perf, table
    from fedvl.perf.workload import Workload

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = sorted(set(engines) - set(ALL_ENGINES))
    if bad or not engines:
        raise ConfigError(f"--engines: unknown {bad or '(none given)'}; allowed: "
                          f"{', '.join(ALL_ENGINES)}")
    for name in ("train_per_client", "test_per_client", "width", "depth", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got "
                              f"{getattr(args, name)}")
    if args.rounds < 2:
        raise ConfigError("--rounds must be >= 2: the first round is the warm-up")
    if args.partitions is not None and args.partitions < 1:
        raise ConfigError(f"--partitions must be >= 1, got {args.partitions}")
    device = _device(args.device)
    w = Workload(benchmark=args.benchmark or "cifar10-dirichlet", data_dir=args.data_dir,
                 train_per_client=args.train_per_client, test_per_client=args.test_per_client,
                 alpha=args.alpha, width=args.width, depth=args.depth,
                 batch_size=args.batch_size, rounds=args.rounds, seed=args.seed,
                 device=device, partitions=args.partitions)
    workers = args.workers or os.cpu_count() or 1
    result: dict[str, Any] = run_perf(w, _counts(args.clients), engines, workers,
                                      args.peers_python, args.timeout)
    result["command"] = "fedvl perf " + " ".join(sys.argv[2:])
    print(table(result))
    _write(result, Path(args.out))
    return 0


def register_cli(sub: Any) -> None:
    """Add `fedvl perf` to the CLI."""
    p = sub.add_parser("perf", help="the bare loop, fedvl and peer frameworks on one FedAvg "
                                    "workload: s/round, img/s, start-up, memory, accuracy")
    p.add_argument("--benchmark", help="default: cifar10-dirichlet (engines), digits-offline "
                   "(--distill)")
    p.add_argument("--data-dir", help="directory holding the .npz datasets")
    p.add_argument("--clients", default="10", help="comma-separated client counts")
    p.add_argument("--train-per-client", type=int, default=200,
                   help="training images per client (with --partitions: per domain, before "
                   "the domain is split)")
    p.add_argument("--test-per-client", type=int, default=100,
                   help="test images per client (with --partitions: per domain)")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partitions", type=int, help="clients per domain of a domain benchmark "
                   "(digits-offline, npz-domains, imagefolder, cifar10c): its clients are the "
                   "domains times this")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto: where bare, embedded, "
                   "workers and stacked train (the other engines are CPU-only)")
    p.add_argument("--workers", type=int, help="parallel workers of every engine that has "
                                                "them (default: one per CPU core)")
    p.add_argument("--engines", default=DEFAULT_ENGINES,
                   help=f"comma-separated subset of {DEFAULT_ENGINES}")
    p.add_argument("--peers-python", help="interpreter that has the peer frameworks (default: "
                   "$FEDVL_PEER_PYTHON_PFL / _BLAZEFL per peer, else this one)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine run")
    p.add_argument("--out", default="perf.json", help="JSON written with the table's rows "
                   "(--distill: perf-distill.json unless given)")
    p.add_argument("--distill", action="store_true",
                   help="measure the synthesis objectives instead of the engines: GFLOP per "
                   "step, steps/s, GFLOP/s and share of the matmul rate on a client's threads")
    p.add_argument("--objectives", help="--distill: comma-separated objectives (default: "
                   "every one)")
    p.add_argument("--train-cap", type=int, default=100,
                   help="--distill: training images of the measured client (default 100)")
    p.add_argument("--threads", type=int, help="--distill: torch threads (default 1, a "
                   "client's)")
    p.add_argument("--seconds", type=float, default=3.0,
                   help="--distill: timed seconds per objective after the warm-up")
    p.add_argument("--graph", action="store_true",
                   help="--distill: captured steps (CUDA graphs) for the objectives that allow "
                        "them (dm, dm-fixed, embed-logit); the same split runs eagerly on a CPU")
    p.set_defaults(func=cmd_perf)

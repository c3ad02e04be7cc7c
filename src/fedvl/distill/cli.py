"""`fedvl distill`: condense one client's training data and evaluate the synthetic set."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from fedvl.config import ConfigError

MATCHING_CHOICES = ("dm", "kernel", "gm")
INIT_CHOICES = ("noise", "stats", "real")
DP_SPACES = ("image", "feature")
EVAL_SETS = ("distilled", "random_real", "noise")


def register_cli(subparsers: Any) -> None:
    """Add the `distill` subcommand."""
    p = subparsers.add_parser("distill", help="distil one client's data into a synthetic set")
    p.add_argument("--benchmark", default="digits-offline", help="registered benchmark name")
    p.add_argument("--data-dir", help="directory holding the .npz datasets")
    p.add_argument("--num-clients", type=int, help="clients of partitioned benchmarks")
    p.add_argument("--train-cap", type=int, help="max training samples per client")
    p.add_argument("--test-cap", type=int, help="max test samples per client")
    p.add_argument("--client", default="0", help="client index or name (e.g. mnist)")
    p.add_argument("--ipc", type=int, default=10, help="synthetic images per class")
    p.add_argument("--matching", default="dm", help="dm, kernel or gm")
    p.add_argument("--kernel", default="gaussian", help="kernel of --matching kernel: "
                   "linear, gaussian, polynomial")
    p.add_argument("--init", default="real", help="noise, stats or real")
    p.add_argument("--steps", type=int, default=200, help="synthesis steps")
    p.add_argument("--lr-img", type=float, help="image learning rate (default 1.0; 0.1 for gm)")
    p.add_argument("--batch-real", type=int, default=64, help="real images per class per step")
    p.add_argument("--no-dsa", action="store_true", help="disable siamese augmentation")
    p.add_argument("--model", default="convnet", help="registered model name")
    p.add_argument("--width", type=int, default=32, help="model width")
    p.add_argument("--depth", type=int, default=3, help="model depth")
    p.add_argument("--norm", default="instance", help="model normalisation")
    p.add_argument("--dp-noise", type=float, help="DP noise multiplier (enables DP)")
    p.add_argument("--dp-clip", type=float, help="DP per-sample clip norm (enables DP)")
    p.add_argument("--dp-delta", type=float, help="DP delta (default 1/(10 N))")
    p.add_argument("--dp-space", default="image", help="clip in 'image' or 'feature' space")
    p.add_argument("--eval-models", type=int, default=3, help="evaluation models per set")
    p.add_argument("--eval-epochs", type=int, default=300, help="epochs per evaluation model")
    p.add_argument("--eval-sets", default="distilled,random_real,noise",
                   help="comma-separated subset of distilled, random_real, noise to evaluate")
    p.add_argument("--seed", type=int, default=0, help="run seed")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_distill)


def _check(cond: bool, flag: str, allowed: str, value: object) -> None:
    if not cond:
        raise ConfigError(f"--{flag} {value!r} is invalid; {allowed}")


def cmd_distill(args: argparse.Namespace) -> int:
    """Run one distillation from parsed flags."""
    _check(args.matching in MATCHING_CHOICES, "matching", "allowed: dm, kernel, gm", args.matching)
    _check(args.init in INIT_CHOICES, "init", "allowed: noise, stats, real", args.init)
    _check(args.kernel in ("linear", "gaussian", "polynomial"), "kernel",
           "allowed: linear, gaussian, polynomial", args.kernel)
    _check(args.dp_space in DP_SPACES, "dp-space", "allowed: image, feature", args.dp_space)
    _check(args.ipc >= 1, "ipc", "must be >= 1", args.ipc)
    _check(args.steps >= 0, "steps", "must be >= 0", args.steps)
    _check(args.batch_real >= 1, "batch-real", "must be >= 1", args.batch_real)
    _check(args.eval_models >= 0, "eval-models", "must be >= 0", args.eval_models)
    _check(args.eval_epochs >= 1, "eval-epochs", "must be >= 1", args.eval_epochs)
    _check(args.width >= 1, "width", "must be >= 1", args.width)
    sets = [s for s in args.eval_sets.split(",") if s]
    _check(bool(sets) and set(sets) <= set(EVAL_SETS), "eval-sets",
           "allowed: comma-separated subset of " + ", ".join(EVAL_SETS), args.eval_sets)
    dp = args.dp_noise is not None or args.dp_clip is not None
    if dp:
        _check(args.dp_noise is not None and args.dp_noise >= 0, "dp-noise",
               "DP needs --dp-noise >= 0 together with --dp-clip", args.dp_noise)
        _check(args.dp_clip is not None and args.dp_clip > 0, "dp-clip",
               "DP needs --dp-clip > 0 together with --dp-noise", args.dp_clip)
        _check(args.matching == "dm", "matching", "DP is implemented for 'dm' only",
               args.matching)
        _check(args.dp_delta is None or 0 < args.dp_delta < 1, "dp-delta", "must be in (0, 1)",
               args.dp_delta)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_distill(args, dp)
    print(json.dumps({k: result[k] for k in ("accuracy", "steps", "seconds")}, indent=1))
    print(f"wrote {Path(args.out) / 'distill.json'}")
    return 0


def run_distill(args: argparse.Namespace, dp: bool) -> dict[str, Any]:
    """Distil, evaluate against random-real and noise sets of the same IPC, write outputs."""
    from fedvl.config import RunConfig, from_dict
    from fedvl.distill.augment import DSAConfig
    from fedvl.distill.evaluate import EvalConfig, evaluate_set
    from fedvl.distill.federated import init_set, owned_ipc
    from fedvl.distill.privacy import DPDistributionMatching
    from fedvl.distill.samplers import RandomModelSampler, UniformClassSampler
    from fedvl.distill.synthesize import DistributionMatching, GradientMatching, synthesize
    from fedvl.distill.synthetic import SyntheticSet
    from fedvl.engine.simulation import derive_seed
    from fedvl.experiment import build_federation
    from fedvl.models.base import build_model

    data: dict[str, Any] = {"benchmark": args.benchmark, "seed": args.seed}
    for key in ("data_dir", "num_clients", "train_cap", "test_cap"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    cfg = from_dict(data, RunConfig())
    from fedvl.registry import BENCHMARKS, MODELS

    _check(cfg.benchmark in BENCHMARKS, "benchmark", "allowed: " + ", ".join(BENCHMARKS.names()),
           cfg.benchmark)
    _check(args.model in MODELS, "model", "allowed: " + ", ".join(MODELS.names()), args.model)
    fed = build_federation(cfg)
    ci = fed.client_index(args.client)
    client = fed.clients[ci]
    k = fed.num_classes
    c, h, _ = fed.image_shape
    margs: dict[str, Any] = {}
    if args.model == "convnet":
        margs = {"width": args.width, "depth": args.depth, "norm": args.norm}
    # Fail on bad model options (and DP settings whose guarantee would not hold) before any work.
    probe = build_model(args.model, c, k, h, seed=0, **margs)
    if dp:
        from fedvl.distill.privacy import check_dp_setup

        try:
            check_dp_setup(args.init, probe)
        except ValueError as e:
            raise ConfigError(f"--dp-noise/--dp-clip: {e}") from e

    def model_fn(seed: int) -> Any:
        return build_model(args.model, c, k, h, seed=seed, **margs)

    def frozen(seed: int) -> Any:
        m = model_fn(seed)
        for p in m.parameters():
            p.requires_grad_(args.matching == "gm")
        return m

    gen = torch.Generator().manual_seed(derive_seed(args.seed, ci, 11))
    x, y = client.x_train, client.y_train
    # Under label skew only the classes the client owns are distilled (and compared).
    ipc = owned_ipc(y, k, args.ipc)
    syn = init_set(args.init, ipc, x, y, k, gen)
    rand_gen = torch.Generator().manual_seed(derive_seed(args.seed, ci, 12))
    random_real = SyntheticSet.from_real(ipc, x, y, k, rand_gen)
    noise_set = SyntheticSet.noise(ipc, k, (c, h, h), rand_gen)
    dsa = None if args.no_dsa else DSAConfig()
    sampler = UniformClassSampler(x, y, k, args.batch_real)
    extractor = RandomModelSampler(frozen)
    lr_img = args.lr_img if args.lr_img is not None else (0.1 if args.matching == "gm" else 1.0)
    if dp:
        objective: Any = DPDistributionMatching(
            x, y, extractor, k, batch_per_class=args.batch_real, clip=args.dp_clip,
            noise_multiplier=args.dp_noise, delta=args.dp_delta, space=args.dp_space)
    elif args.matching == "gm":
        objective = GradientMatching(sampler, extractor, k, dsa=dsa)
    else:
        objective = DistributionMatching(sampler, extractor, k,
                                         matching="dm" if args.matching == "dm" else "kernel",
                                         kernel=args.kernel, dsa=dsa)
    res = synthesize(syn, objective, args.steps, gen, lr_img=lr_img)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    syn.meta.update({"benchmark": args.benchmark, "client": client.name, "ipc": args.ipc,
                     "matching": args.matching, "steps": args.steps})
    syn.save(out / "synthetic.pt")
    syn.save_png(out / "synthetic.png", fed.mean, fed.std)
    ecfg = EvalConfig(epochs=args.eval_epochs, dsa=dsa)
    accuracy: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name, s in (("distilled", syn), ("random_real", random_real), ("noise", noise_set)):
        xs, ys = s.tensors()
        if args.eval_models and name in args.eval_sets.split(","):
            accuracy[name] = evaluate_set(xs, ys, client.x_test, client.y_test, model_fn,
                                          args.eval_models, ecfg, seed=args.seed)
        else:
            accuracy[name] = None
    summary: dict[str, Any] = {
        "benchmark": args.benchmark, "client": client.name, "ipc": args.ipc,
        "matching": args.matching, "init": args.init, "model": args.model, "model_args": margs,
        "lr_img": lr_img, "batch_real": args.batch_real, "dsa": dsa is not None,
        "steps": res.steps, "seconds": res.seconds, "eval_seconds": time.perf_counter() - t0,
        "eval_models": args.eval_models, "eval_epochs": args.eval_epochs,
        "accuracy": accuracy, "loss_curve": res.loss_curve, "seed": args.seed,
        "num_train": int(len(y)), "num_test": int(len(client.y_test)),
    }
    if dp:
        summary.update({"epsilon": res.epsilon, "delta": res.delta, "dp_noise": args.dp_noise,
                        "dp_clip": args.dp_clip, "dp_space": args.dp_space,
                        "dp_sample_rate": objective.sample_rate, "accountant": "rdp"})
    (out / "distill.json").write_text(json.dumps(summary, indent=1))
    return summary

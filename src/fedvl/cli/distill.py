"""`fedvl distill`: condense one client's training data and evaluate the synthetic set.

The command-line front end of `fedvl.distill`; it loads the benchmark through the experiment
layer, which the distillation primitives never import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedvl.config import ConfigError, RunConfig
from fedvl.options import FLAGS, add_flags, copy_option, from_args, option
from fedvl.progress import Sink, StatusLine, emit, reporting, scope
from fedvl.registry import MODELS

MATCHING_CHOICES = ("dm", "kernel", "gm")
INIT_CHOICES = ("noise", "stats", "real")
DP_SPACES = ("image", "feature")
EVAL_SETS = ("distilled", "random_real", "noise")
# The field's reference evaluation (DC-Bench; DD-Ranking's "hard label" setting): the whole
# CIFAR-10 training set as one client, IPC 10, ConvNet-3 width 128 with instance norm, DSA, and
# 5 fresh models trained 1,000 epochs each with SGD 0.01, momentum 0.9, weight decay 5e-4 (the
# evaluation's fixed optimiser), on the distilled set and on random real images alike.
DC_BENCH: dict[str, Any] = {"benchmark": "cifar10-dirichlet", "num_clients": 1, "client": "0",
                            "ipc": 10, "model": "convnet", "width": 128, "depth": 3,
                            "norm": "instance", "dsa": True, "eval_models": 5,
                            "eval_epochs": 1000, "eval_sets": "distilled,random_real"}
# The same pipeline at a size a 2-core CPU evaluates in about half an hour: 3 models x 300
# epochs per set (the 1,000-epoch evaluation takes 1.5 h per set there).
PROTOCOLS: dict[str, dict[str, Any]] = {
    "none": {}, "dc-bench": DC_BENCH,
    "dc-bench-cpu": {**DC_BENCH, "eval_models": 3, "eval_epochs": 300}}
# Its reference cells (CIFAR-10, ConvNet-3, IPC 10, accuracy in %: mean, std).
DC_BENCH_REFERENCE = {"random_real": (26.0, 1.2), "dm": (48.9, 0.6), "dc": (44.9, 0.5),
                      "dsa": (52.1, 0.5)}


def _eval_sets_ok(value: str) -> bool:
    sets = [s for s in value.split(",") if s]
    return bool(sets) and set(sets) <= set(EVAL_SETS)


@dataclass
class DistillOptions:
    """Everything `fedvl distill` takes besides `--out`."""

    benchmark: str = copy_option(RunConfig, "benchmark")
    data_dir: str | None = copy_option(RunConfig, "data_dir")
    dataset: str = copy_option(RunConfig, "dataset")
    num_clients: int | None = copy_option(RunConfig, "num_clients", default=None)
    train_cap: int | None = copy_option(RunConfig, "train_cap",
                                        help="max training samples per client")
    test_cap: int | None = copy_option(RunConfig, "test_cap")
    client: str = option("0", "client index or name (e.g. mnist)")
    ipc: int = option(10, "synthetic images per class", ge=1)
    matching: str = option("dm", "dm, kernel or gm", choices=MATCHING_CHOICES)
    kernel: str = option("gaussian", "kernel of --matching kernel",
                         choices=("linear", "gaussian", "polynomial"))
    init: str = option("real", "noise, stats or real", choices=INIT_CHOICES)
    steps: int = option(200, "synthesis steps", ge=0)
    lr_img: float | None = option(None, "image learning rate (default 1.0; 0.1 for gm)")
    batch_real: int = option(64, "real images per class per step", ge=1)
    dsa: bool = option(True, "disable siamese augmentation", flag="no-dsa")
    model: str = option("convnet", "registered model name", choices=MODELS.names)
    width: int = option(32, "model width", ge=1)
    depth: int = option(3, "model depth")
    norm: str = option("instance", "model normalisation")
    dp_noise: float | None = option(None, "DP noise multiplier (enables DP)")
    dp_clip: float | None = option(None, "DP per-sample clip norm (enables DP)")
    dp_delta: float | None = option(None, "DP delta (default 1/(10 N))", gt=0, lt=1)
    dp_space: str = option("image", "clip in 'image' or 'feature' space", choices=DP_SPACES)
    # A quick check by default, well under the synthesis time (the DM paper's budget, 20
    # models x 1000 epochs on each set, took several times longer than distilling).
    eval_models: int = option(1, "evaluation models per set (DM paper: 20)", ge=0)
    eval_epochs: int = option(100, "epochs per evaluation model (DM paper: 1000)", ge=1)
    eval_sets: str = option("distilled,random_real",
                            "comma-separated subset of distilled, random_real, noise to evaluate",
                            check=_eval_sets_ok,
                            allowed="allowed: comma-separated subset of " + ", ".join(EVAL_SETS))
    seed: int = copy_option(RunConfig, "seed")
    threads: int | None = copy_option(RunConfig, "threads")
    device: str = copy_option(RunConfig, "device")
    protocol: str = option("none", "dc-bench: evaluate as DC-Bench does (CIFAR-10 as one client, "
                           "IPC 10, ConvNet-3 width 128, DSA, 5 models x 1,000 epochs) and "
                           "report the gain over random real images; dc-bench-cpu: the same "
                           "with 3 models x 300 epochs", choices=tuple(PROTOCOLS))

    @property
    def dp(self) -> bool:
        """DP is on when either DP flag is given."""
        return self.dp_noise is not None or self.dp_clip is not None


def register_cli(subparsers: Any) -> None:
    """Add the `distill` subcommand."""
    p = subparsers.add_parser("distill", help="distil one client's data into a synthetic set")
    add_flags(p, DistillOptions)
    p.add_argument("--out", help="output directory (default runs/distill-<benchmark>-<client>-"
                                 "s<seed>); distill.json, synthetic.pt and synthetic.png go there")
    p.add_argument("--json", action="store_true",
                   help="also print the whole distill.json to stdout (instead of the table)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_distill)


def _refuse(flag: str, value: object, allowed: str) -> None:
    raise ConfigError(f"--{flag} {value!r} is invalid; {allowed}")


def check_dp(o: DistillOptions) -> None:
    """The DP flags come as a pair, and DP is implemented for distribution matching only."""
    if not o.dp:
        return
    if o.dp_noise is None or o.dp_noise < 0:
        _refuse("dp-noise", o.dp_noise, "DP needs --dp-noise >= 0 together with --dp-clip")
    if o.dp_clip is None or o.dp_clip <= 0:
        _refuse("dp-clip", o.dp_clip, "DP needs --dp-clip > 0 together with --dp-noise")
    if o.matching != "dm":
        _refuse("matching", o.matching, "DP is implemented for 'dm' only")


def apply_protocol(opts: DistillOptions, args: argparse.Namespace) -> DistillOptions:
    """`opts` with the evaluation protocol's fixed settings; a flag that contradicts one is
    refused, naming it (an unset flag reads None)."""
    fixed = PROTOCOLS[opts.protocol]
    for key, value in fixed.items():
        given = getattr(args, key, None)
        if given is not None and given != value:
            flag = "--no-dsa" if key == "dsa" else f"--{key.replace('_', '-')} {given!r}"
            raise ConfigError(f"--protocol {opts.protocol} fixes {key} to {value!r}; {flag} "
                              "contradicts it (drop it)")
    return dataclasses.replace(opts, **fixed)


def cmd_distill(args: argparse.Namespace) -> int:
    """Run one distillation from parsed flags."""
    opts = apply_protocol(from_args(args, DistillOptions, FLAGS), args)
    check_dp(opts)
    if opts.threads:
        import torch  # here, not at import: `fedvl distill --help` starts without it

        torch.set_num_threads(opts.threads)
    out = Path(args.out or f"runs/distill-{opts.benchmark}-{opts.client}-s{opts.seed}")
    line = None if args.quiet else StatusLine("distill: ")

    def show(event: dict[str, Any]) -> None:
        assert line is not None
        if event["phase"] == "begin":   # the settings passed every check: say what comes
            line.close()
            print(f"fedvl distill: {opts.steps} {opts.matching} steps at IPC {opts.ipc}, then "
                  f"{budget_words(opts)}", file=sys.stderr, flush=True)
        else:
            line(event)
    try:
        result = run_distill(opts, out, progress=None if line is None else show)
    finally:
        if line is not None:
            line.close()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_distill(result)
    # With --json, stdout is the JSON alone (for scripts).
    print(f"wrote {out / 'distill.json'}, synthetic.pt and synthetic.png",
          file=sys.stderr if args.json else sys.stdout)
    return 0


def budget_words(opts: DistillOptions) -> str:
    """What the evaluation will train, in words (the CLI says it before starting)."""
    sets = [s for s in opts.eval_sets.split(",") if s]
    if not opts.eval_models:
        return "no evaluation (--eval-models 0)"
    return (f"evaluation: {opts.eval_models} fresh model(s) x {opts.eval_epochs} epochs on each "
            f"of {', '.join(sets)} (the DM paper's budget: --eval-models 20 --eval-epochs 1000 "
            f"--eval-sets {','.join(EVAL_SETS)})")


def print_distill(result: dict[str, Any]) -> None:
    """A short table: test accuracy of fresh models trained on each set, and the times."""
    from rich.console import Console
    from rich.table import Table

    table = Table()
    table.add_column("set")
    table.add_column("test accuracy", justify="right")
    table.add_column("models x epochs", justify="right")
    for name, acc in result["accuracy"].items():
        if acc is None:
            continue
        spread = f" ± {100 * acc['std']:.2f}" if len(acc["values"]) > 1 else ""
        table.add_row(name, f"{100 * acc['mean']:.2f}%{spread}",
                      f"{result['eval_models']} x {result['eval_epochs']}")
    console = Console()
    # The title on its own line: a table title wraps at the table's width.
    console.print(f"IPC {result['ipc']} sets of client {result['client']} "
                  f"({result['num_train']} training images), tested on {result['num_test']}:",
                  soft_wrap=True)
    console.print(table)
    eps = f"; DP epsilon {result['epsilon']:.3g} at delta {result['delta']:.3g}" \
        if result.get("epsilon") is not None else ""
    console.print(f"synthesis {result['seconds']:.1f} s ({result['steps']} steps), evaluation "
                  f"{result['eval_seconds']:.1f} s{eps}")
    if result.get("protocol", "none") != "none":
        gain = result.get("gain_over_random_real")
        ref = ", ".join(f"{k} {m:.1f} ± {sd:.1f}" for k, (m, sd) in DC_BENCH_REFERENCE.items())
        console.print(("" if gain is None else f"gain over random real images: {gain:+.2f} "
                       "points; ") + f"DC-Bench reference cells (ConvNet-3, IPC 10): {ref}")


def run_distill(args: DistillOptions, out_dir: str | Path, progress: Sink | None = None
                ) -> dict[str, Any]:
    """Distil, evaluate against random-real and noise sets of the same IPC, write outputs.

    `progress` receives the synthesis steps and the evaluation epochs (`fedvl.progress`).
    """
    with reporting(progress):
        return _run_distill(args, out_dir)


def _run_distill(args: DistillOptions, out_dir: str | Path) -> dict[str, Any]:
    import torch

    from fedvl.config import from_dict
    from fedvl.devices import module_to
    from fedvl.distill.augment import DSAConfig
    from fedvl.distill.client_sets import init_set, owned_ipc
    from fedvl.distill.dp_matching import DPDistributionMatching
    from fedvl.distill.evaluate import EvalConfig, evaluate_set
    from fedvl.distill.samplers import RandomModelSampler, UniformClassSampler
    from fedvl.distill.synthesize import DistributionMatching, GradientMatching, synthesize
    from fedvl.distill.synthetic import SyntheticSet
    from fedvl.engine.simulation import derive_seed
    from fedvl.models.base import build_model
    from fedvl.run.assemble import build_federation, resolve_device

    data: dict[str, Any] = {"benchmark": args.benchmark, "dataset": args.dataset,
                            "seed": args.seed}
    for key in ("data_dir", "num_clients", "train_cap", "test_cap"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    cfg = from_dict(data, RunConfig())
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise ConfigError(f"--device {args.device!r}: {e}") from e
    dp = args.dp
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
        from fedvl.distill.dp_matching import check_dp_setup

        try:
            check_dp_setup(args.init, probe)
        except ValueError as e:
            raise ConfigError(f"--dp-noise/--dp-clip: {e}") from e

    def model_fn(seed: int) -> Any:
        # Built (and seeded) on the CPU, so a seed gives the same start on every device.
        return module_to(build_model(args.model, c, k, h, seed=seed, **margs), device)

    def frozen(seed: int) -> Any:
        m = model_fn(seed)
        for p in m.parameters():
            p.requires_grad_(args.matching == "gm")
        return m

    gen = torch.Generator().manual_seed(derive_seed(args.seed, ci, 11))
    x, y = client.x_train, client.y_train
    # Under label skew only the classes the client owns are distilled (and compared).
    ipc = owned_ipc(y, k, args.ipc)
    # The sets are drawn on the CPU generators (the same pixels on every device), then moved
    # with the data: every step after this runs on `device`.
    syn = init_set(args.init, ipc, x, y, k, gen).to(device)
    rand_gen = torch.Generator().manual_seed(derive_seed(args.seed, ci, 12))
    random_real = SyntheticSet.from_real(ipc, x, y, k, rand_gen).to(device)
    noise_set = SyntheticSet.noise(ipc, k, (c, h, h), rand_gen).to(device)
    x, y = x.to(device), y.to(device)
    x_test, y_test = client.x_test.to(device), client.y_test.to(device)
    dsa = DSAConfig() if args.dsa else None
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
    emit("begin")
    with scope(phase="synthesis"):
        res = synthesize(syn, objective, args.steps, gen, lr_img=lr_img)
    out = Path(out_dir)
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
            with scope(phase="evaluate", label=f"evaluating {name}"):
                accuracy[name] = evaluate_set(xs, ys, x_test, y_test, model_fn,
                                              args.eval_models, ecfg, seed=args.seed)
        else:
            accuracy[name] = None
    summary: dict[str, Any] = {
        "benchmark": args.benchmark, "client": client.name, "ipc": args.ipc,
        "matching": args.matching, "init": args.init, "model": args.model, "model_args": margs,
        "lr_img": lr_img, "batch_real": args.batch_real, "dsa": dsa is not None,
        "device": str(device),
        "steps": res.steps, "seconds": res.seconds, "eval_seconds": time.perf_counter() - t0,
        "eval_models": args.eval_models, "eval_epochs": args.eval_epochs,
        "accuracy": accuracy, "loss_curve": res.loss_curve, "seed": args.seed,
        "num_train": int(len(y)), "num_test": int(len(client.y_test)),
    }
    if args.protocol != "none":
        summary["protocol"] = args.protocol
        if accuracy.get("distilled") and accuracy.get("random_real"):
            # The field's measure of what distillation adds: the same pipeline on random
            # real images of the same IPC is the baseline.
            summary["gain_over_random_real"] = 100 * (accuracy["distilled"]["mean"]
                                                      - accuracy["random_real"]["mean"])
        summary["reference"] = {k: {"mean": m, "std": sd}
                                for k, (m, sd) in DC_BENCH_REFERENCE.items()}
    if dp:
        summary.update({"epsilon": res.epsilon, "delta": res.delta, "dp_noise": args.dp_noise,
                        "dp_clip": args.dp_clip, "dp_space": args.dp_space,
                        "dp_sample_rate": objective.sample_rate, "accountant": "rdp"})
    (out / "distill.json").write_text(json.dumps(summary, indent=1))
    return summary

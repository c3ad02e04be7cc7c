"""One method under several option settings ("arms") over seeds, each run a fresh `fedvl run`.

  python benchmarks/arms.py --set fedvck-ablation --seeds 0,1,2 --jobs 2 \\
      --run-arg=--benchmark=cifar10-dirichlet --run-arg=--alpha=0.05 ...
  python benchmarks/arms.py --set fedlgd-deviations --rounds 10 --seeds 0,1,2

A set names the method and its arms; an arm is the method options, model options and `fedvl run`
arguments it changes from the set's first arm (the library's default). `--run-arg` adds a `fedvl
run` argument to every arm (the benchmark, its data, the rounds); `--method-arg` a method option.
The results JSON holds the command, per arm the mean ± std (ddof 1, as `fedvl bench`) over seeds
of `mean_accuracy` and, where the benchmark has one, `global_test_accuracy`, every run's
numbers, and the wall seconds; with `--jobs N` N runs share the machine (wall seconds then
include the contention, accuracy does not depend on it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from provenance import machine, write_result


class Arm:
    """What one arm switches: method options, model options, extra `fedvl run` arguments."""

    def __init__(self, method: dict[str, str] | None = None,
                 model: dict[str, str] | None = None, run: list[str] | None = None) -> None:
        self.method, self.model, self.run = method or {}, model or {}, run or []

    def args(self) -> list[str]:
        """The arm's `fedvl run` arguments."""
        return [*[x for k, v in self.method.items() for x in ("--method-arg", f"{k}={v}")],
                *[x for k, v in self.model.items() for x in ("--model-arg", f"{k}={v}")],
                *self.run]


_VCK_OFF = {"server_dsa": "false", "history": "1", "importance_weights": "uniform", "beta": "0"}
IN = {"norm": "instance"}

# Set name -> (method, default benchmark, arms; the first arm is the reference).
SETS: dict[str, tuple[str, str, dict[str, Arm]]] = {
    # FedVCK's paper forms (the defaults) against the public code's, one at a time. The code's
    # contrastive form runs at its runs' weight 0.1; the paper's Eq. 16 weight is 1 (default).
    "fedvck-forms": ("fedvck", "digits-offline", {
        "paper (defaults)": Arm(),
        "init=real": Arm({"init": "real"}),
        "contrastive=code beta=0.1": Arm({"contrastive": "code", "beta": "0.1"}),
        "similarity=dot (Eq. 15 as printed)": Arm({"similarity": "dot"}),
        "importance_weights=softmax": Arm({"importance_weights": "softmax"}),
        "latent_stats=running": Arm({"latent_stats": "running"}),
        "first_padding=3": Arm(model={"first_padding": "3"}),
    }),
    # FedVCK on the instance-norm ConvNet every method of a `fedvl bench` shares, then one
    # component changed at a time, then the four server/sampling components off together.
    "fedvck-ablation": ("fedvck", "digits-offline", {
        "instance norm (as in bench)": Arm(model=IN),
        "batchnorm + latent constraint": Arm(model={"norm": "batch"}),
        "no server augmentation": Arm({"server_dsa": "false"}, IN),
        "history=1 (round's sets only)": Arm({"history": "1"}, IN),
        "no importance sampling": Arm({"importance_weights": "uniform"}, IN),
        "no relational loss (beta=0)": Arm({"beta": "0"}, IN),
        "all four off": Arm(_VCK_OFF, IN),
        "init=real": Arm({"init": "real"}, IN),
        "init=real + all four off": Arm({**_VCK_OFF, "init": "real"}, IN),
    }),
    # Each method's deviations from its paper or code that are not budget cuts, both ways.
    "fedlgd-deviations": ("fedlgd", "digits-offline", {
        "fedvl defaults": Arm(),
        "global_init=noise (paper)": Arm({"global_init": "noise"}),
        "global_stats=uniform (code)": Arm({"global_stats": "uniform"}),
        "momentum 0 (code)": Arm(run=["--momentum", "0"]),
        "aggregation uniform (code)": Arm(run=["--aggregation", "uniform"]),
    }),
    # FedLGD's local virtual sets from random real images (fedvl) or class statistics (paper).
    "fedlgd-init": ("fedlgd", "digits-offline", {
        "fedvl defaults (init=real)": Arm(),
        "init=stats (paper)": Arm({"init": "stats"}),
    }),
    # The synthesis budgets the defaults cut for a 2-core CPU, each against the paper's value
    # (the public code's where the paper does not say), one at a time.
    "feddm-budgets": ("feddm", "digits-offline", {
        "fedvl defaults (100 steps; 20 server epochs; 32 real per class)": Arm(),
        "steps=1000 (paper Sec. 4.1)": Arm({"steps": "1000"}),
        "server_epochs=500 (paper Sec. 4.1)": Arm({"server_epochs": "500"}),
        "batch_real=256 (paper Sec. 4.1)": Arm({"batch_real": "256"}),
    }),
    "fedvck-budgets": ("fedvck", "digits-offline", {
        "fedvl defaults (100 steps; 20 server epochs; 64 real per class)": Arm(),
        "steps=1000 (code; paper: not stated)": Arm({"steps": "1000"}),
        "server_epochs=1000 (code; paper: not stated)": Arm({"server_epochs": "1000"}),
        "batch_real=256 (code)": Arm({"batch_real": "256"}),
    }),
    "fedlgd-budgets": ("fedlgd", "digits-offline", {
        "fedvl defaults (20 local DM; 50 server GM steps; 32 real per class)": Arm(),
        "local_dm_steps=100 (paper Sec. 4.1)": Arm({"local_dm_steps": "100"}),
        "server_gm_steps=500 (paper Sec. 4.1)": Arm({"server_gm_steps": "500"}),
        "batch_real=256 (code; paper: not stated)": Arm({"batch_real": "256"}),
        "warmup_steps=10000 (code; paper: not stated)": Arm({"warmup_steps": "10000"}),
    }),
    "desa-budgets": ("desa", "digits-offline", {
        "fedvl defaults (100 anchor steps; 64 real per class)": Arm(),
        "anchor_steps=1000 (paper App. E)": Arm({"anchor_steps": "1000"}),
        "batch_real=256 (paper App. E)": Arm({"batch_real": "256"}),
    }),
    # The baselines' deviations from their papers' or public code's settings, both ways.
    "fedbn-deviations": ("fedbn", "digits-offline", {
        "fedvl defaults on the BatchNorm ConvNet": Arm(model={"norm": "batch"}),
        "aggregation uniform (code)": Arm(model={"norm": "batch"},
                                          run=["--aggregation", "uniform"]),
        "momentum 0 (code)": Arm(model={"norm": "batch"}, run=["--momentum", "0"]),
    }),
    "feddyn-deviations": ("feddyn", "digits-offline", {
        "fedvl defaults": Arm(),
        "code optimiser (lr 0.1; momentum 0; batch 50)": Arm(
            run=["--lr", "0.1", "--momentum", "0", "--batch-size", "50"]),
    }),
    "fedd3-deviations": ("fedd3", "digits-offline", {
        "fedvl defaults (init=stats; ipc 10)": Arm(),
        "init=real (official KIP)": Arm({"init": "real"}),
        "ipc=1 (official code)": Arm({"ipc": "1"}),
    }),
    "fedaf-deviations": ("fedaf", "digits-offline", {
        "fedvl defaults (init=noise; persist)": Arm(),
        "init=mean (paper)": Arm({"init": "mean"}),
        "persist=false (third-party code)": Arm({"persist": "false"}),
    }),
    "dynafed-deviations": ("dynafed", "digits-offline", {
        "fedvl defaults (10 unrolled steps; ipc 10)": Arm(),
        "syn_steps=20 (code)": Arm({"syn_steps": "20"}),
        "ipc=15 (code)": Arm({"ipc": "15"}),
    }),
    "feddm-deviations": ("feddm", "digits-offline", {
        "fedvl defaults": Arm(),
        "min_class_count=1": Arm({"min_class_count": "1"}),
    }),
    # FedDM's server terms: the paper's (Eq. 9 weights, Sec. 4.5 projection) against the public
    # code's, each spelled out so the arms do not depend on the defaults.
    "feddm-server-terms": ("feddm", "cifar10-dirichlet", {
        "paper (clients + projection)": Arm({"server_weighting": "clients",
                                            "server_projection": "true"}),
        "code (uniform; no projection)": Arm({"server_weighting": "uniform",
                                             "server_projection": "false"}),
        "clients; no projection": Arm({"server_weighting": "clients",
                                       "server_projection": "false"}),
        "uniform + projection": Arm({"server_weighting": "uniform",
                                     "server_projection": "true"}),
    }),
    # DP-FedAvg's clipping norm and learning rate with negligible noise (the clip-only
    # control) against FedAvg: which defaults still learn.
    "dp-fedavg-clip": ("fedavg", "digits-offline", {
        "fedavg (no DP)": Arm(),
        **{f"clip {c}, lr {lr}": Arm({"dp_noise": "1e-4", "dp_clip": c}, run=["--lr", lr])
           for c in ("1", "5", "10", "20") for lr in ("0.01", "0.05")},
        "fedavg (no DP), lr 0.05": Arm(run=["--lr", "0.05"]),
    }),
    # DP-FedAvg's clipping norm against the noise: which clip learns best at a given sigma.
    "dp-fedavg-clip-noise": ("fedavg", "digits-offline", {
        f"clip {c}, sigma {s}": Arm({"dp_noise": s, "dp_clip": c})
        for s in ("0.5", "1", "2") for c in ("1", "5", "10", "20")}),
    # DP-FedAvg at the default clip from the clip-only control down to strong noise.
    "dp-fedavg-epsilon": ("fedavg", "digits-offline", {
        "fedavg (no DP)": Arm(),
        **{f"sigma {s}": Arm({"dp_noise": s}) for s in ("1e-4", "0.3", "0.5", "1", "2")}}),
    # Does the client ratio matter on CIFAR-10-C once rounds, step size or local work grow?
    "cifar10c-ratio": ("fedavg", "cifar10c", {
        f"ratio {r}{name}": Arm(run=["--client-ratio", r, *extra])
        for name, extra in (("", []), (", lr 0.05", ["--lr", "0.05"]),
                            (", 5 local epochs", ["--local-epochs", "5"]))
        for r in ("0.2", "1.0")}),
    "desa-deviations": ("desa", "digits-offline", {
        "fedvl defaults": Arm(),
        "momentum 0 (code)": Arm(run=["--momentum", "0"]),
        "image size 32 (code)": Arm(run=["--image-size", "32"]),
    }),
    # DESA's KD term: Eq. 6 (the default) against the public code's form; and Eq. 5's SupCon
    # summed over the batch, which is fedvl's batch mean at lambda_reg = |B| = 2 x batch 32.
    "desa-kd-forms": ("desa", "digits-offline", {
        "kd_form=paper (default)": Arm(),
        "kd_form=code": Arm({"kd_form": "code"}),
        "paper + lambda_reg=64 (Eq. 5 sum)": Arm({"lambda_reg": "64"}),
    }),
}


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean, sample std (ddof 1, as `fedvl bench`) and count."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "n": len(values)}


def best_accuracy(summary: dict) -> float:
    """The best mean client accuracy over the evaluated rounds (the final one if none)."""
    curve = summary.get("accuracy_curve") or []
    return max([float(a) for _, a in curve], default=float(summary["mean_accuracy"]))


def one_run(args: list[str], work: Path) -> dict:
    """One `fedvl run` in a fresh process: its summary's accuracies and the wall seconds."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "fedvl.cli", "run", *args, "--out", str(work),
                        "--quiet"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"fedvl run {' '.join(args)} failed ({p.returncode}):\n{p.stderr}")
    s = json.loads((work / "summary.json").read_text())
    eps = (s.get("privacy") or {}).get("epsilon") or {}
    return {"mean_accuracy": s["mean_accuracy"], "best_accuracy": best_accuracy(s),
            "epsilon_max": max(eps.values()) if eps else None,
            "global_test_accuracy": s.get("global_test_accuracy"),
            # Personalised methods: each client's model on every client's test set (the DESA
            # paper's "global") and on the other clients' only.
            "mean_global_accuracy": s.get("mean_global_accuracy"),
            "mean_inter_accuracy": s.get("mean_inter_accuracy"),
            "process_seconds": wall, "engine_wall_seconds": s.get("wall_seconds"),
            "method_args": s.get("method_args"), "model_args": s.get("model_args")}


def run_arms(method: str, benchmark: str, arms: dict[str, Arm], seeds: list[int],
             base: list[str], jobs: int = 1) -> dict[str, dict]:
    """Every (arm, seed) as a fresh run, `jobs` at a time; per arm the runs and their means."""
    common = ["--method", method, "--benchmark", benchmark, *base]
    with tempfile.TemporaryDirectory(prefix="fedvl-arms-") as tmp:
        tasks = {(name, seed): [*common, *arm.args(), "--seed", str(seed)]
                 for name, arm in arms.items() for seed in seeds}
        with ThreadPoolExecutor(max(jobs, 1)) as pool:
            futures = {key: pool.submit(one_run, args, Path(tmp) / f"{i}")
                       for i, (key, args) in enumerate(tasks.items())}
            results = {key: f.result() for key, f in futures.items()}
    rows: dict[str, dict] = {}
    for name, arm in arms.items():
        runs = {seed: results[(name, seed)] for seed in seeds}
        glob = [r["global_test_accuracy"] for r in runs.values()]
        rows[name] = {"method_args": arm.method, "model_args": arm.model, "run_args": arm.run,
                      "mean_accuracy": mean_std([r["mean_accuracy"] for r in runs.values()]),
                      "best_accuracy": mean_std([r["best_accuracy"] for r in runs.values()]),
                      "global_test_accuracy": None if None in glob else mean_std(glob),
                      **{key: mean_std([r[key] for r in runs.values()])
                         for key in ("mean_global_accuracy", "mean_inter_accuracy")
                         if all(r[key] is not None for r in runs.values())},
                      "process_seconds": mean_std([r["process_seconds"]
                                                   for r in runs.values()]),
                      "runs": runs}
        acc = rows[name]["mean_accuracy"]
        print(f"{name:32s} {100 * acc['mean']:.2f} ± {100 * acc['std']:.2f}", flush=True)
    return rows


def main(default_set: str | None = None, default_out: str | None = None) -> None:
    """Run a set's arms over the seeds and write the results JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=SETS, default=default_set, required=default_set is None)
    ap.add_argument("--arms", help="comma-separated subset of the set's arms")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, help="(default: the run's)")
    ap.add_argument("--train-cap", type=int, help="(default: the run's)")
    ap.add_argument("--test-cap", type=int, help="(default: the run's)")
    ap.add_argument("--benchmark", help="benchmark (default: the set's)")
    ap.add_argument("--method", help="method (default: the set's; only for sets whose arms "
                    "switch no method option)")
    ap.add_argument("--run-arg", action="append", default=[], metavar="ARG",
                    help="extra `fedvl run` argument for every arm (e.g. --run-arg=--alpha=0.05)")
    ap.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="method option for every arm (e.g. steps=1000 on a GPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    ap.add_argument("--out", default=default_out,
                    help="results file (default: benchmarks/results/<set>-cpu.json)")
    a = ap.parse_args()
    method, benchmark, arms = SETS[a.set]
    benchmark = a.benchmark or benchmark
    if a.method and a.method != method:
        if any(arm.method for arm in arms.values()):
            ap.error(f"--method: set '{a.set}' switches {method} options; it runs {method} only")
        method = a.method
    if a.arms:
        unknown = [n for n in a.arms.split(",") if n not in arms]
        if unknown:
            ap.error(f"unknown arm(s) {unknown}; allowed: {', '.join(arms)}")
        arms = {n: arms[n] for n in a.arms.split(",")}
    seeds = [int(s) for s in a.seeds.split(",")]
    sizes = {"--rounds": a.rounds, "--train-cap": a.train_cap, "--test-cap": a.test_cap}
    base = [*[x for k, v in sizes.items() if v is not None for x in (k, str(v))],
            "--device", a.device,
            *(["--threads", str(a.threads)] if a.threads else []),
            *[x for kv in a.method_arg for x in ("--method-arg", kv)], *a.run_arg]
    load_start = list(os.getloadavg())
    t0 = time.perf_counter()
    rows = run_arms(method, benchmark, arms, seeds, base, a.jobs)
    write_result(a.out or f"benchmarks/results/{a.set}-cpu.json",
                 machine(f"device {a.device}, {a.jobs} run(s) at a time, load average "
                         f"{load_start} at the start, {list(os.getloadavg())} at the end"), {
                     "setting": {"set": a.set, "method": method, "benchmark": benchmark,
                                 "rounds": a.rounds, "train_cap": a.train_cap,
                                 "test_cap": a.test_cap, "seeds": seeds,
                                 "fedvl_run_args": base},
                     "arms": rows, "wall_seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()

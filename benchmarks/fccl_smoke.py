"""FCCL against FedDF on the embedded benchmark with ConvNet/AlexNet clients and a public set,
one seed, a few rounds: a smoke comparison (accuracy per round, cross-client accuracy, wall
time, bytes), one `fedvl bench` process per `--lr` (the run default and 0.001); then, for one
ConvNet and one AlexNet client, the time of a pretraining step and what the pretraining and one
local epoch from it give.

    python benchmarks/fccl_smoke.py --out benchmarks/results/fccl-smoke-amd-cpu.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import machine, write_result

KEPT = ("mean_accuracy", "per_client_accuracy", "mean_inter_accuracy", "mean_global_accuracy",
        "accuracy_curve", "wall_seconds", "client_seconds", "bytes_per_round", "bytes_by_kind",
        "bytes_up", "bytes_down", "method_args", "rejected_replies")


def bench(args: argparse.Namespace, out: Path, extra: list[str]) -> dict[str, object]:
    """The `fedvl bench` run (with `extra` flags): its command, exit code, process seconds and
    per-method fields."""
    argv = ["--benchmark", args.benchmark, "--client-models", "alternate",
            "--public", args.public, "--public-size", str(args.public_size),
            "--rounds", str(args.rounds), "--methods", args.methods, "--seeds", str(args.seed),
            "--threads", "1", "--quiet", *extra]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fedvl.cli", "bench", *argv, "--out", str(out)],
                          capture_output=True, text=True, check=False)
    seconds = round(time.perf_counter() - started, 1)
    runs: dict[str, object] = {}
    for m in args.methods.split(","):
        path = out / m / f"seed{args.seed}" / "summary.json"
        if path.is_file():
            s = json.loads(path.read_text())
            runs[m] = {k: s[k] for k in KEPT if k in s}
    return {"command": shlex.join(["fedvl", "bench", *argv, "--out", "DIR"]),
            "exit": done.returncode, "process_seconds": seconds, "runs": runs,
            **({} if done.returncode == 0 else
               {"error": done.stderr.strip().splitlines()[-3:]})}


def client_checks(args: argparse.Namespace) -> dict[str, object]:
    """For client 0 (ConvNet) and client 1 (AlexNet) of the smoke's federation, one thread:
    the ms of one Adam step of 32 of its images (which sizes `pretrain_epochs`), its test
    accuracy after FCCL's default pretraining, and after one local epoch from there: CE alone
    and FCCL's CE + two KLs (both teachers the pretrained model, as in round 0) under the run's
    default SGD (lr 0.01, momentum 0.9), and FCCL's at lr 0.001."""
    import copy

    import torch
    import torch.nn.functional as F

    from fedvl.algorithms.fccl import FCCL, NonForgettingTerm, pretrain
    from fedvl.config import RunConfig
    from fedvl.core.training import TrainConfig, evaluate, local_train
    from fedvl.run.assemble import build_env, build_federation

    torch.set_num_threads(1)
    cfg = RunConfig(method="fccl", benchmark=args.benchmark, client_models=["alternate"],
                    public=args.public, public_size=args.public_size, seed=args.seed)
    fed = build_federation(cfg)
    env = build_env(cfg, fed, torch.device("cpu"))
    p = FCCL.Params()
    out: dict[str, object] = {}
    for cid in (0, 1):
        c = fed.clients[cid]
        model = env.client_model_fn(cid)
        timed = copy.deepcopy(model)
        opt = torch.optim.Adam(timed.parameters(), lr=1e-3)
        x, y = c.x_train[:32], c.y_train[:32]
        for i in range(13):   # 3 warm-up steps, 10 timed
            if i == 3:
                started = time.perf_counter()
            loss = F.cross_entropy(timed(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        ms = (time.perf_counter() - started) / 10 * 1000
        pretrain(model, c.x_train, c.y_train, p.pretrain_epochs, 32, p.pretrain_lr,
                 torch.Generator().manual_seed(args.seed))
        row: dict[str, object] = {
            "client": c.name, "model": type(model).__name__,
            "parameters": sum(t.numel() for t in model.parameters()),
            "train_images": len(c.y_train), "adam_step_ms_batch32": round(ms, 1),
            "test_accuracy_pretrained": evaluate(model, c.x_test, c.y_test)[0]}
        arms = {"ce_sgd_lr0.01_m0.9": (0.01, False), "fccl_sgd_lr0.01_m0.9": (0.01, True),
                "fccl_sgd_lr0.001_m0.9": (0.001, True)}
        for arm, (lr, kl) in arms.items():
            student = copy.deepcopy(model)
            terms = (NonForgettingTerm(copy.deepcopy(model), copy.deepcopy(model)),) if kl else ()
            local_train(student, c.x_train, c.y_train,
                        TrainConfig(lr=lr, momentum=0.9, local_epochs=1, batch_size=32),
                        torch.Generator().manual_seed(args.seed), terms=terms)
            row[f"test_accuracy_after_one_epoch_{arm}"] = evaluate(student, c.x_test,
                                                                   c.y_test)[0]
        out[str(cid)] = row
    return out


def main() -> None:
    """Run the comparison, time the pretraining steps, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--benchmark", default="digits-offline")
    ap.add_argument("--public", default="digits-offline")
    ap.add_argument("--public-size", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--methods", default="feddf,fccl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lrs", default=",0.001",
                    help="comma-separated --lr of each bench run ('' = the run default)")
    ap.add_argument("--out", default="benchmarks/results/fccl-smoke-cpu.json")
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, lr in enumerate(a.lrs.split(",")):
            key = f"lr {lr}" if lr else "run defaults"
            results[key] = bench(a, Path(tmp) / str(i), ["--lr", lr] if lr else [])
            print(key, {m: (r.get("mean_accuracy"), r.get("wall_seconds"))
                        for m, r in results[key]["runs"].items()}, flush=True)
    checks = client_checks(a)
    print(checks, flush=True)
    write_result(a.out, machine("1 torch thread per run, the methods one after the other"), {
        "what": "a smoke comparison, one seed: FCCL and FedDF with their defaults and the run "
                "defaults but the flags in each `bench.*.command`; mean_accuracy is the unweighted "
                "mean over clients of each client's model on its own test set after the last "
                "round (fraction), accuracy_curve the same after each round, mean_inter_accuracy "
                "the mean of each client's model on the other clients' test sets, "
                "mean_global_accuracy on every client's test set; process_seconds includes "
                "start-up and data loading. client_checks: see `client_checks` in the script",
        "bench": results, "client_checks": checks})


if __name__ == "__main__":
    main()

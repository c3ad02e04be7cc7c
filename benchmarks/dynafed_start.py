"""DynaFed's synthesis from different label and inner-lr starts: how far the matching loss
falls, and what fine-tuning the last trajectory model on the pseudo set does to its accuracy.

  python benchmarks/dynafed_start.py --out benchmarks/results/dynafed-start-cpu.json
The trajectory theta_0 .. theta_{L-1} comes from one run of L - 1 rounds (FedAvg: nothing of
DynaFed acts before the synthesis); every arm then synthesises from that same trajectory on the
same seeded streams, fine-tunes theta_{L-1} as round L would and evaluates it on every client's
test set. Arms differ only in `label_init` and `lr_init` (the public scripts: 0 and 0.04).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

from provenance import write_result

ARMS = {"scripts (label_init=0, lr_init=0.04)": {"label_init": 0.0, "lr_init": 0.04},
        "label_init=10, lr_init=0.04": {"label_init": 10.0, "lr_init": 0.04},
        "label_init=0, lr_init=0.4": {"label_init": 0.0, "lr_init": 0.4},
        "label_init=10, lr_init=0.4": {"label_init": 10.0, "lr_init": 0.4},
        "label_init=10, lr_init=1.0 (fedvl default)": {"label_init": 10.0, "lr_init": 1.0}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--method-args", default="{}", help="JSON of further dynafed options of "
                   "every arm (e.g. trajectory_length)")
    a = p.parse_args()
    import torch

    from fedvl.algorithms.base import ServerContext, make_algorithm
    from fedvl.algorithms.dynafed import FINETUNE_STREAM
    from fedvl.config import RunConfig
    from fedvl.core.training import evaluate, mean_accuracy
    from fedvl.run.assemble import build_env, build_federation
    from fedvl.run.experiment import run_experiment

    torch.set_num_threads(1)
    extra = json.loads(a.method_args)
    base = RunConfig(method="dynafed", method_args={**extra, "iterations": a.iterations},
                     threads=1, workers=1)
    fed = build_federation(base)
    length = make_algorithm("dynafed", build_env(base, fed, torch.device("cpu")),
                            base.method_args).p.trajectory_length
    with tempfile.TemporaryDirectory(prefix="fedvl-dynafed-") as work:
        run_experiment(dataclasses.replace(base, rounds=length - 1), out=Path(work) / "r",
                       fed=fed)
        state = torch.load(Path(work) / "r" / "checkpoint.pt", weights_only=True)[
            "server_state"]
    cpu = torch.device("cpu")

    def accuracy(model) -> float:
        return mean_accuracy(evaluate(model, c.x_test, c.y_test)[0] for c in fed.clients)

    rows = {}
    for name, args in ARMS.items():
        alg = make_algorithm("dynafed", build_env(base, fed, cpu), {**base.method_args, **args})
        start = time.perf_counter()
        out = alg.synthesize(dict(state), ServerContext(length - 1, base.seed))
        seconds = time.perf_counter() - start
        model = alg.load_model(state["model"], cpu)
        before = accuracy(model)
        alg.finetune(model, out["pseudo_x"], out["pseudo_y"],
                     ServerContext(length - 1, base.seed).stream(FINETUNE_STREAM))
        rows[name] = {"options": args, "matching_loss_first_last": out["matching_loss"],
                      "syn_lr": out["syn_lr"], "accuracy_before": before,
                      "accuracy_fine_tuned": accuracy(model), "synthesis_seconds": seconds}
        print(f"{name}: loss {out['matching_loss']}, accuracy {100 * before:.2f} -> "
              f"{100 * rows[name]['accuracy_fine_tuned']:.2f} %", flush=True)
    write_result(a.out, f"{os.cpu_count()}-core CPU",
                 {"iterations": a.iterations, "method_args": extra,
                  "trajectory_length": length, "arms": rows})


if __name__ == "__main__":
    main()

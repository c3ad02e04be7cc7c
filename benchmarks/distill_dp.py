"""DP benchmark: epsilon of DP distribution matching vs the Opacus accountant, and accuracy of the
DP-distilled set vs the non-DP set (same scale, both without DSA, as DESA's DP path has none).

    OMP_NUM_THREADS=1 python benchmarks/distill_dp.py --steps 100 --ipc 10
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import torch
from provenance import machine, write_result

from fedvl.cli import main as fedvl_main

DATA = "/work/shared/data"


def opacus_epsilon(noise: float, rate: float, steps: int, delta: float) -> float:
    """The accountant's own number, stepped one noisy step at a time."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=noise, sample_rate=rate)
    return float(acc.get_epsilon(delta=delta))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ipc", type=int, default=10)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--eval-epochs", type=int, default=100)
    ap.add_argument("--eval-models", type=int, default=3)
    ap.add_argument("--test-cap", type=int, default=1000)
    ap.add_argument("--dp-space", default="feature")
    ap.add_argument("--batch-real", type=int, default=256)
    ap.add_argument("--train-cap", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/distill-dp.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    common = ["--benchmark", "digits", "--data-dir", DATA, "--client", "mnist", "--ipc",
              str(a.ipc), "--matching", "dm", "--init", "noise", "--no-dsa", "--steps",
              str(a.steps), "--width", str(a.width), "--batch-real", str(a.batch_real),
              "--eval-epochs", str(a.eval_epochs), "--eval-models", str(a.eval_models),
              "--test-cap",
              str(a.test_cap), "--threads", str(a.threads), "--eval-sets", "distilled"]
    if a.train_cap:
        common += ["--train-cap", str(a.train_cap)]
    # DESA's delta is 1/N (the library default is 1/(10 N)); digits' cap is exact per client.
    from fedvl.config import RunConfig
    from fedvl.run.assemble import build_federation

    fed = build_federation(RunConfig(benchmark="digits", data_dir=DATA))
    y = fed.clients[fed.client_index("mnist")].y_train
    n_run = min(a.train_cap, len(y)) if a.train_cap else len(y)
    common += ["--dp-delta", repr(1.0 / n_run)]
    runs = {}
    for name, extra in (("dp", ["--dp-noise", "0.6", "--dp-clip", "2", "--dp-space",
                                a.dp_space]), ("non_dp", [])):
        out = Path("runs") / f"distill-dp-{name}"
        argv = ["distill", *common, *extra, "--out", str(out)]
        if fedvl_main(argv) != 0:
            raise SystemExit(f"fedvl distill failed ({name})")
        res = json.loads((out / "distill.json").read_text())
        runs[name] = {"command": "fedvl " + shlex.join(argv), "accuracy": res["accuracy"],
                      "synth_seconds": res["seconds"], "epsilon": res.get("epsilon"),
                      "delta": res.get("delta"), "sample_rate": res.get("dp_sample_rate"),
                      "num_train": res["num_train"]}
    dp = runs["dp"]
    dp["opacus_epsilon_same_inputs"] = opacus_epsilon(0.6, dp["sample_rate"], a.steps,
                                                      dp["delta"])
    # The DESA setting itself on the full MNIST client (N = 60000): epsilon from our objective vs
    # the accountant stepped directly, for DESA's 1000 synthesis iterations.
    from fedvl.distill.dp_matching import DPDistributionMatching

    obj = DPDistributionMatching(torch.empty(len(y), 0), y, lambda g: None, fed.num_classes,
                                 batch_per_class=256, clip=2.0, noise_multiplier=0.6,
                                 delta=1.0 / len(y))
    desa = {"N": len(y), "delta": obj.delta, "sample_rate": obj.sample_rate, "steps": 1000}
    desa["epsilon_fedvl"] = obj.privacy_spent(1000)[0]
    desa["epsilon_opacus_direct"] = opacus_epsilon(0.6, obj.sample_rate, 1000, obj.delta)
    del fed
    write_result(a.out, machine(f"{a.threads} thread(s)"), {
           "setting": "DESA DP: clip 2, noise multiplier 0.6, Poisson rate batch/n_c, delta = 1/N; "
                      "desa_setting_full_mnist uses 256 real per class, the accuracy runs use "
                      "scale.batch_real_per_class; init noise; no DSA (synthesis or eval) in "
                      "either accuracy run",
           "scale": {"width": a.width, "steps": a.steps, "ipc": a.ipc,
                     "eval_epochs": a.eval_epochs, "eval_models": a.eval_models,
                     "test_cap": a.test_cap, "dp_space": a.dp_space,
                     "batch_real_per_class": a.batch_real, "train_cap": a.train_cap},
           "desa_setting_full_mnist": desa, "runs": runs})


if __name__ == "__main__":
    main()

"""Does VHL's pixel mapping of the virtual images change its gap to FedAvg? One bench per variant.

  python benchmarks/vhl_pixel_mapping.py --benchmark digits --data-dir /work/shared/data \
      --train-cap 500 --test-cap 500 --rounds 15 --width 32 --seeds 0,1,2 --threads 1
Variants: FedAvg, VHL with the default `affine` mapping ((x + 1) / 2 for the style generator)
and VHL with `pixel_mapping=clamp` (raw output clipped to [0, 1], as the VHL code's saved
images). Writes benchmarks/results/vhl-pixel-mapping-<benchmark>.json with the command, the
scale, per-seed accuracies, mean ± std, the per-seed difference to FedAvg and pixel statistics
of the two virtual sets.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from provenance import write_result

from fedvl.algorithms.base import make_algorithm
from fedvl.config import RunConfig
from fedvl.eval.comparison import parse_method_args, run_bench
from fedvl.run.assemble import build_env, build_federation

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "fedavg": ("fedavg", []),
    "vhl affine": ("vhl", []),
    "vhl clamp": ("vhl", ["pixel_mapping=clamp"]),
}


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean and sample std (0 for one value)."""
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
            "n": int(len(arr))}


def pixel_stats(cfg: RunConfig, mapping: str) -> dict[str, float]:
    """Statistics of the 8-bit virtual set VHL sends with seed `cfg.seed` and this mapping."""
    fed = build_federation(cfg)
    alg = make_algorithm("vhl", build_env(cfg, fed, torch.device("cpu")),
                         {"pixel_mapping": mapping})
    img = alg.virtual_dataset().images.float() / 255.0
    return {"mean": float(img.mean()), "std": float(img.std()),
            "fraction_at_0": float((img == 0).float().mean()),
            "fraction_at_1": float((img == 1).float().mean())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--benchmark", default="digits")
    p.add_argument("--data-dir")
    p.add_argument("--train-cap", type=int)
    p.add_argument("--test-cap", type=int)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int)
    p.add_argument("--work", default="runs/vhl-pixel-mapping")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    base = RunConfig(benchmark=a.benchmark, data_dir=a.data_dir, train_cap=a.train_cap,
                     test_cap=a.test_cap, rounds=a.rounds, threads=a.threads,
                     model_args={"width": a.width, "depth": 3, "norm": "instance"})
    t0 = time.time()
    rows: dict[str, dict] = {}
    for label, (method, args) in VARIANTS.items():
        margs = parse_method_args([f"{method}.{x}" for x in args], [method])
        out = Path(a.work) / a.benchmark / label.replace(" ", "_")
        comp = run_bench(base, [method], seeds, out, margs, progress=False)
        e = comp["methods"][method]
        per_seed = {}
        for seed, run in zip(e["seeds"], e["runs"], strict=True):
            s = json.loads((Path(run) / "summary.json").read_text())
            per_seed[str(seed)] = {"mean_accuracy": s["mean_accuracy"],
                                   "per_client_accuracy": s["per_client_accuracy"]}
        rows[label] = {"method": method, "method_args": margs[method],
                       "mean_accuracy": e["mean_accuracy"],
                       "per_client_accuracy": e["per_client_accuracy"],
                       "per_seed": per_seed, "wall_seconds": e["wall_seconds"],
                       "runs": e["runs"]}
        print(f"{label:12s} {100 * e['mean_accuracy']['mean']:.2f} ± "
              f"{100 * e['mean_accuracy']['std']:.2f}", flush=True)
    ref = rows["fedavg"]["per_seed"]
    for label, row in rows.items():
        if label == "fedavg":
            continue
        diffs = [row["per_seed"][s]["mean_accuracy"] - ref[s]["mean_accuracy"]
                 for s in row["per_seed"]]
        row["minus_fedavg"] = {"per_seed": dict(zip(row["per_seed"], diffs, strict=True)),
                               **mean_std(diffs)}
    pixels = {m: pixel_stats(replace(base, seed=seeds[0]), m) for m in ("affine", "clamp")}
    result = {
        "scale": {"benchmark": a.benchmark, "model": "convnet", "width": a.width, "depth": 3,
                  "norm": "instance", "rounds": a.rounds, "local_epochs": base.local_epochs,
                  "batch_size": base.batch_size, "lr": base.lr, "momentum": base.momentum,
                  "train_cap_per_client": a.train_cap, "test_cap_per_client": a.test_cap,
                  "seeds": seeds},
        "accuracy_note": "fractions in [0,1]; mean_accuracy = mean over clients of the global "
                         "model's test accuracy; mean +- sample std over seeds",
        "virtual_pixels_seed0": pixels,
        "variants": rows,
        "total_seconds": time.time() - t0,
    }
    out = Path(f"benchmarks/results/vhl-pixel-mapping-{a.benchmark}.json")
    write_result(out, f"{platform.processor() or platform.machine()}, "
                      f"{torch.get_num_threads()} torch threads, CPU only", result)
    print(f"wrote {out}")
    for label, row in rows.items():
        d = row.get("minus_fedavg")
        extra = f"  minus fedavg {100 * d['mean']:+.2f} ± {100 * d['std']:.2f}" if d else ""
        print(f"{label:12s} {100 * row['mean_accuracy']['mean']:.2f} ± "
              f"{100 * row['mean_accuracy']['std']:.2f}{extra}")


if __name__ == "__main__":
    main()

"""Which part of VHL helps or hurts on local virtual data: one `fedvl bench` per variant.

  python benchmarks/vhl_ablation.py --benchmark digits-offline --seeds 0,1,2 --threads 1
Every variant runs on the same cached local virtual sets as FedAvg (`--local-data virtual`,
the library defaults otherwise), so the differences are VHL's alone. Writes
benchmarks/results/vhl-ablation-<benchmark>.json with the command and mean ± std per variant.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from provenance import machine, write_result

from fedvl.config import RunConfig
from fedvl.eval.comparison import parse_method_args, run_bench

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "fedavg": ("fedavg", []),
    "vhl": ("vhl", []),
    "vhl alpha=0.1": ("vhl", ["alpha=0.1"]),
    "naive-vhl (no calibration)": ("naive-vhl", []),
    "vhl label_style=shared": ("vhl", ["label_style=shared"]),
    "vhl upsampled_noise": ("vhl", ["virtual_generator=upsampled_noise"]),
    "vhl virtual_batch_size=8": ("vhl", ["virtual_batch_size=8"]),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--benchmark", default="digits-offline")
    p.add_argument("--data-dir")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int)
    p.add_argument("--virtual-init", default="stats", help="local virtual set init (stats: paper)")
    p.add_argument("--work", default="runs/vhl-ablation")
    a = p.parse_args()
    base = RunConfig(benchmark=a.benchmark, data_dir=a.data_dir, rounds=a.rounds,
                     threads=a.threads, local_data="virtual", virtual_init=a.virtual_init)
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = {}
    t0 = time.time()
    for label, (method, args) in VARIANTS.items():
        margs = parse_method_args([f"{method}.{x}" for x in args], [method])
        out = Path(a.work) / a.benchmark / label.split(" (")[0].replace(" ", "_")
        comp = run_bench(base, [method], seeds, out, margs, progress=False)
        e = comp["methods"][method]
        rows[label] = {"method": method, "method_args": margs[method],
                       "mean_accuracy": e["mean_accuracy"],
                       "per_client_accuracy": e["per_client_accuracy"], "runs": e["runs"]}
        print(f"{label:32s} {100 * e['mean_accuracy']['mean']:.2f} ± "
              f"{100 * e['mean_accuracy']['std']:.2f}", flush=True)
    write_result(f"benchmarks/results/vhl-ablation-{a.benchmark}.json", machine(), {
        "config": {k: v for k, v in base.to_dict().items() if k not in ("method", "seed")},
        "variants": rows,
        "total_seconds": time.time() - t0,
    })


if __name__ == "__main__":
    main()

"""Speed of evaluation forwards of 256 rows against 64 (one torch thread), and whether every
row's logits are the same bit for bit at either size.

    python benchmarks/eval_batch.py --reps 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from provenance import write_result

from fedvl.engine.allocator import keep_freed_memory
from fedvl.models.base import build_model

CASES = [
    ("convnet", 3, 32, {"width": 32}),
    ("convnet", 1, 28, {"width": 32}),
    ("convnet", 3, 32, {"width": 32, "norm": "batch"}),
    ("convnet", 3, 32, {"width": 128}),
    ("alexnet", 3, 32, {}),
    ("resnet18", 3, 32, {}),
]


def forward_all(model: torch.nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """Logits of every row of `x`, `rows` rows per forward."""
    return torch.cat([model(x[i:i + rows]) for i in range(0, len(x), rows)])


def main() -> None:
    """Measure and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/eval-batch-cpu.json")
    args = ap.parse_args()
    keep_freed_memory()  # as in every fedvl process
    torch.set_num_threads(1)
    rows_out = []
    with torch.inference_mode():
        for name, channels, size, kw in CASES:
            model = build_model(name, channels, 10, size, seed=0, **kw).eval()
            x = torch.randn(args.images, channels, size, size,
                            generator=torch.Generator().manual_seed(0))
            ref = forward_all(model, x, 256)
            same = torch.equal(forward_all(model, x, 64), ref)
            times: dict[int, list[float]] = {256: [], 64: []}
            for _ in range(args.reps):
                for rows in (256, 64):
                    t = time.perf_counter()
                    forward_all(model, x, rows)
                    times[rows].append((time.perf_counter() - t) * 1000)
            row = {"model": name, "in_channels": channels, "image_size": size, "options": kw,
                   "images": args.images,
                   "ms_256_rows": round(statistics.median(times[256]), 1),
                   "ms_64_rows": round(statistics.median(times[64]), 1),
                   "identical_logits": same}
            row["speedup"] = round(row["ms_256_rows"] / row["ms_64_rows"], 2)
            rows_out.append(row)
            print(row, flush=True)
    write_result(args.out, f"{os.cpu_count()}-core CPU ({platform.machine()}, "
                 f"{platform.processor()}), torch {torch.__version__}, 1 torch thread, freed "
                 "memory kept", {"cases": rows_out})

if __name__ == "__main__":
    main()

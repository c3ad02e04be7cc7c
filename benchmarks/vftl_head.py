"""Where the first rounds' global-test predictions of FedAvg, VFTL and VHL go: real or virtual.

VFTL and VHL evaluate a classifier of C + V outputs (argmax over all of them, a virtual class
counting as wrong). This runs the setting of `vftl-cifar10-cpu.json` for `--rounds` rounds and
scores each round's global model on the global test set three ways: the accuracy over all
outputs (what the runs report), the accuracy with the argmax over the C real outputs only, and
the share of images predicted as a virtual class. The gap between the first two is what the
virtual outputs cost the reported accuracy; the real-only accuracy is what the trunk and the
real rows alone give.

    python benchmarks/vftl_head.py --data-dir ../shared/data --rounds 10 \\
        --out benchmarks/results/vftl-head-cifar10-cpu.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from provenance import machine, write_result

from fedvl.config import RunConfig
from fedvl.data.transforms import PixelImages
from fedvl.registry import ALGORITHMS
from fedvl.run.assemble import build_federation
from fedvl.run.experiment import run_experiment


@torch.no_grad()
def scores(model: torch.nn.Module, x: torch.Tensor | PixelImages, y: torch.Tensor,
           num_classes: int) -> dict[str, float]:
    """Accuracy over all outputs, over the real ones only, and the share predicted virtual."""
    model.eval()
    hits = real_hits = virtual = 0
    for i in range(0, len(y), 256):
        xb = x[i:i + 256]   # a PixelImages slice comes back as normalised floats
        logits, yb = model(xb), y[i:i + 256]
        top = logits.argmax(1)
        hits += int((top == yb).sum())
        real_hits += int((logits[:, :num_classes].argmax(1) == yb).sum())
        virtual += int((top >= num_classes).sum())
    n = len(y)
    return {"accuracy": hits / n, "real_outputs_accuracy": real_hits / n,
            "virtual_share": virtual / n}


def curve(cfg: RunConfig, fed: Any) -> list[dict[str, float]]:
    """The scores of the global model after each round of the run `cfg`."""
    cls = ALGORITHMS.get(cfg.method)
    original = cls.aggregate
    rows: list[dict[str, float]] = []
    x, y = fed.global_test

    def scored(self: Any, state: Any, ctx: Any, replies: Any) -> Any:
        new = original(self, state, ctx, replies)
        rows.append({"round": ctx.round + 1,
                     **scores(self.global_model(new), x, y, fed.num_classes)})
        return new

    own = "aggregate" in vars(cls)
    cls.aggregate = scored
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_experiment(cfg, out=Path(tmp) / "run", fed=fed)
    finally:
        if own:
            cls.aggregate = original
        else:
            del cls.aggregate
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--methods", default="fedavg,vftl,vhl")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results/vftl-head-cifar10-cpu.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    methods = [m for m in a.methods.split(",") if m]
    seeds = [int(s) for s in a.seeds.split(",") if s]
    # The setting of vftl-cifar10-cpu.json; the run's own evaluation only at its last round.
    base = RunConfig(benchmark="cifar10-dirichlet", data_dir=a.data_dir, num_clients=10,
                     alpha=0.1, client_ratio=0.5, train_cap=500, test_cap=200,
                     model_args={"width": 32}, rounds=a.rounds, eval_every=a.rounds,
                     lr_decay=0.992, threads=1)
    out: dict[str, Any] = {}
    for seed in seeds:
        fed = build_federation(replace(base, seed=seed))
        for m in methods:
            out.setdefault(m, {})[f"seed{seed}"] = curve(replace(base, method=m, seed=seed),
                                                         fed)
    summary = {m: {key: [float(np.mean([runs[s][r][key] for s in runs]))
                         for r in range(a.rounds)]
                   for key in ("accuracy", "real_outputs_accuracy", "virtual_share")}
               for m, runs in out.items()}
    write_result(a.out, machine("shared with other jobs"), {
        "setting": "cifar10-dirichlet, 10 clients, alpha 0.1, 5 per round, 500 training and 200 "
                   "test images per client, ConvNet width 32 depth 3 instance norm, SGD lr 0.01 "
                   "momentum 0.9 batch 32, lr decay 0.992 per round, every option of VFTL and "
                   "VHL at its default; scored on the 10,000-image global test set",
        "mean_over_seeds_by_round": summary, "per_seed": out,
        "wall_seconds": time.time() - t0})
    for m, s in summary.items():
        print(m, " ".join(f"r{r + 1}: {100 * s['accuracy'][r]:.1f}/"
                          f"{100 * s['real_outputs_accuracy'][r]:.1f}/"
                          f"{100 * s['virtual_share'][r]:.1f}" for r in range(a.rounds)))
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()

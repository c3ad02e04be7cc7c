"""Pixel statistics of VHL's virtual set under each pixel mapping (`affine`, fedvl's default,
and `clamp`, the VHL code's saved images): mean, std and the shares of black and white pixels.

  python benchmarks/vhl_pixel_mapping.py --benchmark digits --data-dir ../shared/data --seed 0
The accuracy of either mapping beside FedAvg is a table spec:
`fedvl reproduce benchmarks/tables/vhl-pixel-mapping.yaml --data-dir ../shared/data`.
"""

from __future__ import annotations

import argparse
import json

import torch

from fedvl.algorithms.base import make_algorithm
from fedvl.config import RunConfig
from fedvl.data.federated import FederatedDataset
from fedvl.run.assemble import build_env, build_federation


def pixel_stats(cfg: RunConfig, fed: FederatedDataset, mapping: str) -> dict[str, float]:
    """Statistics of the 8-bit virtual set VHL sends with seed `cfg.seed` and this mapping."""
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
    p.add_argument("--train-cap", type=int, default=500)
    p.add_argument("--test-cap", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    cfg = RunConfig(benchmark=a.benchmark, data_dir=a.data_dir, train_cap=a.train_cap,
                    test_cap=a.test_cap, seed=a.seed)
    fed = build_federation(cfg)   # one federation for both mappings
    print(json.dumps({m: pixel_stats(cfg, fed, m) for m in ("affine", "clamp")}, indent=2))


if __name__ == "__main__":
    main()

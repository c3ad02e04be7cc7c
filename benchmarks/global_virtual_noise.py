"""Why FedLGD's global virtual images look like noise: how far gradient matching moves them.

Compares a finished run's global virtual set with the set it started from (the same run's
settings with `server_gm_steps=0`, whose global set is its initialisation: the initial pixels
come from their own random stream) and with the clients' local virtual sets and real images, by
  - the relative change ||x - x0|| / ||x0|| of the global images,
  - the correlation of horizontally neighbouring pixels (about 0 for independent pixel noise,
    near 1 for natural images),
  - the correlation of each class's mean image with the mean real image of that class.

    fedvl run --out /tmp/default-run
    fedvl run --rounds 1 --method-arg server_gm_steps=0 --out /tmp/default-run-gm0
    python benchmarks/global_virtual_noise.py --run /tmp/default-run --init /tmp/default-run-gm0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from provenance import machine, write_result

from fedvl.config import load_yaml
from fedvl.run.assemble import build_federation
from fedvl.safeload import load_torch


def neighbour_corr(x: torch.Tensor) -> float:
    """Mean over images and channels of the correlation of pixels with their right neighbour."""
    a, b = x[..., :, :-1].flatten(2), x[..., :, 1:].flatten(2)
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    r = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)
    return float(r.mean())


def class_mean_corr(x: torch.Tensor, y: torch.Tensor, xr: torch.Tensor, yr: torch.Tensor
                    ) -> float:
    """Mean over classes of corr(mean image of x in class c, mean real image of class c)."""
    out = []
    for c in sorted(set(y.tolist()) & set(yr.tolist())):
        a = x[y == c].mean(0).flatten()
        b = xr[yr == c].mean(0).flatten()
        out.append(float(torch.corrcoef(torch.stack([a, b]))[0, 1]))
    return sum(out) / len(out)


def main() -> None:
    """Measure and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a finished FedLGD run directory")
    ap.add_argument("--init", required=True, help="the same settings with server_gm_steps=0")
    ap.add_argument("--out", default="benchmarks/results/global-virtual-noise-cpu.json")
    a = ap.parse_args()
    ck = load_torch(Path(a.run) / "checkpoint.pt", "checkpoint")
    ck0 = load_torch(Path(a.init) / "checkpoint.pt", "checkpoint")
    gx, gy = ck["server_state"]["global_x"], ck["server_state"]["global_y"]
    g0 = ck0["server_state"]["global_x"]
    fed = build_federation(load_yaml(Path(a.run) / "config.yaml"))
    xr = torch.cat([c.x_train for c in fed.clients])
    yr = torch.cat([c.y_train for c in fed.clients])
    # A checkpoint keeps each client's state as (arrays, meta).
    lx = [arrays["synthetic_images"]["local"] for arrays, _ in ck["client_states"].values()
          if "local" in arrays.get("synthetic_images", {})]
    res = {
        "global_relative_change": float((gx - g0).norm() / g0.norm()),
        "global_max_abs_change": float((gx - g0).abs().max()),
        "neighbour_pixel_correlation": {
            "global_final": neighbour_corr(gx), "global_init": neighbour_corr(g0),
            "real": neighbour_corr(xr),
            **({"local_virtual": neighbour_corr(torch.cat(lx))} if lx else {})},
        "class_mean_correlation_with_real": {
            "global_final": class_mean_corr(gx, gy, xr, yr),
            "global_init": class_mean_corr(g0, gy, xr, yr)},
        "global_images": int(len(gy)),
        "global_refreshes": sum(1 for e in ck["server_state"]["log"]
                                     if e.get("global_refresh")),
    }
    write_result(a.out, machine(), {"result": res})
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

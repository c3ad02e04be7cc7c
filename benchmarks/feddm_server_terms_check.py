"""Whether FedDM's two server terms act in a setting: the spread of the Eq. 9 weights and how far
the server model moves from w_t (the Sec. 4.5 projection only acts beyond rho).

One `fedvl run` of FedDM in this process with the projection on; every server step's distance
||w - w_t|| (before the projection) and every round's per-row weights are recorded.

    python benchmarks/feddm_server_terms_check.py --rounds 3 -- --benchmark cifar10-dirichlet \\
        --data-dir ../shared/data --alpha 0.1 --num-clients 10 --test-cap 200 \\
        --method-arg steps=20
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from provenance import machine, write_result

import fedvl.algorithms.feddm as feddm
from fedvl.cli import main as fedvl_main
from fedvl.engine.allocator import keep_freed_memory


def main() -> None:
    """Run FedDM once with both terms on; write the distances and weights."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/feddm-server-terms-check-cpu.json")
    ap.add_argument("run_args", nargs="*", help="further `fedvl run` flags (after --)")
    a = ap.parse_args()
    keep_freed_memory()
    distances: list[float] = []
    weights: list[dict[str, float]] = []
    rho: list[float] = []
    project, share = feddm.project_to_ball, feddm.client_share_weights

    def recording_project(params, center, r):
        d = torch.sqrt(sum(((p - c).double() ** 2).sum() for p, c in zip(params, center)))
        distances.append(float(d))
        rho[:] = [r]
        project(params, center, r)

    def recording_share(sizes):
        w = share(sizes)
        weights.append({"min": float(w.min()), "max": float(w.max()), "rows": len(w)})
        return w

    feddm.project_to_ball, feddm.client_share_weights = recording_project, recording_share
    with tempfile.TemporaryDirectory() as tmp:
        rc = fedvl_main(["run", "--method", "feddm", "--rounds", str(a.rounds), "--threads", "1",
                         "--method-arg", "server_weighting=clients", "--method-arg",
                         "server_projection=true", *a.run_args, "--out", tmp, "--quiet"])
    if rc:
        raise SystemExit(rc)
    fields = {"server_steps": len(distances), "rho": rho[0] if rho else None,
              "max_distance_from_w_t": max(distances, default=None),
              "steps_outside_rho": sum(d > rho[0] for d in distances) if rho else 0,
              "weights_per_round": weights}
    print(fields)
    write_result(a.out, machine(), fields)


if __name__ == "__main__":
    main()

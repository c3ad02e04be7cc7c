"""DP-FedAvg noise at DP-FedDM's epsilon: the noise multiplier that spends the same privacy.

For each client of the run's federation and each DP-FedDM noise multiplier sigma, DP-FedDM's
epsilon (its per-class Poisson rate max_c min(1, batch_real / n_c) over the classes it distils,
`steps` matching steps per round) and the DP-FedAvg noise multiplier whose local DP-SGD (rate
batch_size / n_k, local_epochs * ceil(n_k / batch_size) steps per round, or --local-steps)
reaches that epsilon; likewise FedLAP-DP's noise multiplier (Poisson rate batch_real / n_k,
at most iterations * outer_loop * steps real targets per round: its loop may stop earlier at
the trust radius, so its epsilon is at most the matched one). All assume the client takes
part in every round (with --client-ratio < 1 the epsilons are upper bounds). Each method uses
its own default delta, 1/(10 n) of the records it reads (FedDM reads only the classes it
distils, so its delta is the larger: the matched guarantees are at least as strong), unless
--delta sets one for all. A run uses one sigma for every client: `*_for_every_client` is the
largest per-client value. Prints a JSON table; writes nothing.

    python benchmarks/dp_matched_noise.py --rounds 10 --num-clients 10 --train-cap 200
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from fedvl.algorithms.feddm import FedDM
from fedvl.algorithms.fedlapdp import FedLAPDP
from fedvl.config import RunConfig
from fedvl.core.dp import compute_epsilon, default_delta, delta_for, noise_multiplier_for
from fedvl.core.training import num_batches
from fedvl.distill.client_sets import owned_ipc
from fedvl.distill.dp_matching import DPDistributionMatching
from fedvl.run.assemble import build_federation


def feddm_setting(y: torch.Tensor, k: int, p: FedDM.Params, delta: float | None
                  ) -> tuple[float, float]:
    """(sample rate, delta) of a client's DP-FedDM matching, as `FedDM.client_update` sets them."""
    keep = torch.tensor(owned_ipc(y, k, p.ipc, p.min_class_count))[y] > 0
    yk = y[keep]
    d = delta if delta is not None else delta_for(p.dp_delta, len(yk))
    # Only the rates are read: no extractor is drawn.
    dp = DPDistributionMatching(torch.zeros(len(yk), 1), yk, None, k,  # type: ignore[arg-type]
                                batch_per_class=p.batch_real, delta=d)
    return dp.sample_rate, d


def main() -> None:
    run, fdm, lap = RunConfig(), FedDM.Params(), FedLAPDP.Params()
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--benchmark", default=run.benchmark)
    ap.add_argument("--data-dir", default=run.data_dir)
    ap.add_argument("--rounds", type=int, default=run.rounds)
    ap.add_argument("--num-clients", type=int, default=run.num_clients)
    ap.add_argument("--alpha", type=float, default=run.alpha)
    ap.add_argument("--train-cap", type=int, default=run.train_cap)
    ap.add_argument("--seed", type=int, default=run.seed)
    ap.add_argument("--local-epochs", type=int, default=run.local_epochs)
    ap.add_argument("--local-steps", type=int, default=run.local_steps)
    ap.add_argument("--batch-size", type=int, default=run.batch_size)
    ap.add_argument("--feddm-steps", type=int, default=fdm.steps)
    ap.add_argument("--batch-real", type=int, default=fdm.batch_real)
    ap.add_argument("--ipc", type=int, default=fdm.ipc)
    ap.add_argument("--min-class-count", type=int, default=fdm.min_class_count)
    ap.add_argument("--lap-batch-real", type=int, default=lap.batch_real)
    ap.add_argument("--lap-targets", type=int,
                    default=lap.iterations * lap.outer_loop * lap.steps,
                    help="FedLAP-DP's most real targets per round (iterations x outer_loop x "
                         "steps)")
    ap.add_argument("--sigmas", default="1,3,5", help="DP-FedDM noise multipliers")
    ap.add_argument("--delta", type=float, default=None, help="one delta for both methods")
    a = ap.parse_args()
    cfg = dataclasses.replace(run, benchmark=a.benchmark, data_dir=a.data_dir,
                              num_clients=a.num_clients, alpha=a.alpha, train_cap=a.train_cap,
                              seed=a.seed)
    fed = build_federation(cfg)
    p = dataclasses.replace(fdm, steps=a.feddm_steps, batch_real=a.batch_real, ipc=a.ipc,
                            min_class_count=a.min_class_count)
    clients = {}
    for c in fed.clients:
        n = len(c.y_train)
        q_dm, d_dm = feddm_setting(c.y_train, fed.num_classes, p, a.delta)
        clients[c.name] = {
            "num_train": n,
            "feddm": {"sample_rate": q_dm, "steps": a.rounds * p.steps, "delta": d_dm},
            "fedavg": {"sample_rate": min(1.0, a.batch_size / n),
                       "steps": a.rounds * num_batches(n, a.batch_size, a.local_epochs,
                                                       a.local_steps),
                       "delta": a.delta if a.delta is not None else default_delta(n)},
            "fedlapdp": {"sample_rate": min(1.0, a.lap_batch_real / n),
                         "steps": a.rounds * a.lap_targets,
                         "delta": a.delta if a.delta is not None else default_delta(n)}}
    table = []
    for sigma in (float(s) for s in a.sigmas.split(",")):
        eps, noise, lap_noise = {}, {}, {}
        for name, c in clients.items():
            dm, avg, lp = c["feddm"], c["fedavg"], c["fedlapdp"]
            eps[name] = compute_epsilon(sigma, dm["sample_rate"], dm["steps"], dm["delta"])
            noise[name] = noise_multiplier_for(eps[name], avg["delta"], avg["sample_rate"],
                                               avg["steps"])
            lap_noise[name] = noise_multiplier_for(eps[name], lp["delta"], lp["sample_rate"],
                                                   lp["steps"])
        table.append({"feddm_noise": sigma, "epsilon": eps, "fedavg_noise": noise,
                      "fedavg_noise_for_every_client": max(noise.values()),
                      "fedlapdp_noise": lap_noise,
                      "fedlapdp_noise_for_every_client": max(lap_noise.values())})
    print(json.dumps({"setting": {"benchmark": a.benchmark, "rounds": a.rounds,
                                  "num_clients": len(fed.clients), "alpha": a.alpha,
                                  "train_cap": a.train_cap, "seed": a.seed,
                                  "fedavg": {"local_epochs": a.local_epochs,
                                             "local_steps": a.local_steps,
                                             "batch_size": a.batch_size},
                                  "feddm": {"steps": p.steps, "batch_real": p.batch_real,
                                            "ipc": p.ipc, "min_class_count": p.min_class_count},
                                  "fedlapdp": {"batch_real": a.lap_batch_real,
                                               "targets_per_round_at_most": a.lap_targets},
                                  "participation": "every round"},
                      "clients": clients, "table": table}, indent=2))


if __name__ == "__main__":
    main()

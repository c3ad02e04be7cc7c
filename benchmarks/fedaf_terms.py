"""FedAF's two knowledge terms: how large each is beside the loss it is added to, and what
switching each off changes.

  python benchmarks/fedaf_terms.py --rounds 5 --steps 50 --server-epochs 10

Runs `fedaf` on digits-offline (100 training and 100 test images per client) with its defaults,
then with `lambda_loc=0` and with `lambda_glob=0`, one seed. Every client condensation step
records L_DM and L_CDC (the scaled sliced Wasserstein term, before lambda_loc); every server
step records the batch CE and LGKM (before lambda_glob). The results hold each arm's accuracy
per round and the mean of each term over its first and last 50 records.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from provenance import machine, write_result

import fedvl.algorithms.fedaf as fedaf
from fedvl.config import RunConfig
from fedvl.run.assemble import build_federation
from fedvl.run.experiment import run_experiment

ARMS = {"defaults": {}, "lambda_loc=0": {"lambda_loc": 0.0}, "lambda_glob=0": {"lambda_glob": 0.0}}
EDGE = 50
RECORD: dict[str, list[float]] = {}


def _condensation_step(self, images, labels, generator):   # noqa: ANN001 - the patched method
    """`CollaborativeCondensation.__call__`, recording its two terms."""
    dm, _ = self.dm(images, labels, generator)
    k = self.target.shape[1]
    u = fedaf.class_means(self.model(images), labels, k)[0][self.classes]
    dirs = fedaf.random_directions(self.projections, k, generator).to(images.device)
    cdc = fedaf.knowledge_distance(u, self.target, dirs)
    RECORD.setdefault("l_dm", []).append(float(dm.detach()))
    RECORD.setdefault("l_cdc", []).append(float(cdc.detach()))
    return dm + self.weight * cdc, None


_lgkm = fedaf.lgkm_loss


def _lgkm_step(logits, y, soft, present, temperature):   # noqa: ANN001 - the patched function
    """`lgkm_loss`, recording it and the batch's CE."""
    out = _lgkm(logits, y, soft, present, temperature)
    RECORD.setdefault("lgkm", []).append(float(out.detach()))
    RECORD.setdefault("ce", []).append(float(F.cross_entropy(logits.detach(), y)))
    return out


def main() -> None:
    """Run the arms and write the results file."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--server-epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/fedaf-terms-cpu.json")
    args = ap.parse_args()
    fedaf.CollaborativeCondensation.__call__ = _condensation_step   # type: ignore[method-assign]
    fedaf.lgkm_loss = _lgkm_step
    torch.set_num_threads(1)
    results = {}
    for name, extra in ARMS.items():
        RECORD.clear()
        cfg = RunConfig(method="fedaf", benchmark="digits-offline", train_cap=100,
                        test_cap=100, rounds=args.rounds, seed=args.seed, threads=1,
                        method_args={"steps": args.steps, "server_epochs": args.server_epochs,
                                     **extra})
        with tempfile.TemporaryDirectory() as out:
            s = run_experiment(cfg, out=Path(out) / "run", fed=build_federation(cfg))
        terms = {k: {"first": statistics.fmean(v[:EDGE]), "last": statistics.fmean(v[-EDGE:]),
                     "records": len(v)} for k, v in RECORD.items()}
        results[name] = {"method_args": cfg.method_args, "mean_accuracy": s["mean_accuracy"],
                         "accuracy_curve": s["accuracy_curve"], "terms": terms}
        print(name, s["mean_accuracy"], flush=True)
    write_result(args.out, machine("shared with other processes"), {
        "setting": f"fedaf on digits-offline, 5 clients, 100 training / 100 test images per "
                   f"client, {args.rounds} rounds, seed {args.seed}, steps={args.steps}, "
                   f"server_epochs={args.server_epochs}; terms before their lambda",
        "arms": results})


if __name__ == "__main__":
    main()

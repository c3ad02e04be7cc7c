"""What DENSE's (or Co-Boosting's) server had to distil: its teachers, their ensemble and
their weight average.

  python benchmarks/dense_teachers.py --runs /tmp/dense05/dense --seeds 0,1,2 \
      --out benchmarks/results/dense-teachers-cifar10-a05-amd-cpu.json

For each seed, the finished DENSE run `RUNS/seedS` is run again from its own `config.yaml`
until its server receives the client models (the same seeded local training), and there
stopped: each teacher, the ensemble DENSE distils (the mean of the teachers' logits) and the
sample-weighted average of their weights (`weighted_average`, one-shot FedAvg's model) are
evaluated on every client's test set (mean client accuracy) and on the global test set, beside
the student the run recorded. The ensemble bounds what distillation can reach; the gap between
student and ensemble is what the distillation budget left, the gap between ensemble and average
what DENSE could gain over one-shot FedAvg. A Co-Boosting run (`--runs DIR/coboosting`) also
gets the ensemble under the weights its server ended with (`ensemble_weights` of its summary).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from provenance import machine, write_result


class Captured(Exception):
    """Raised once the client models have been evaluated, to skip the distillation."""


def teachers_row(run_dir: Path) -> dict:
    """The teachers, ensemble and average of one finished DENSE run, with its student."""
    import torch

    from fedvl.algorithms.coboosting import mixing_weights
    from fedvl.algorithms.dense import Ensemble
    from fedvl.config import load_yaml
    from fedvl.core.params import weighted_average
    from fedvl.core.training import evaluate, mean_accuracy
    from fedvl.registry import ALGORITHMS
    from fedvl.run.assemble import build_federation
    from fedvl.run.experiment import run_experiment

    cfg = load_yaml(run_dir / "config.yaml")
    method = ALGORITHMS.get(cfg.method)
    fed = build_federation(cfg)
    summary = json.loads((run_dir / "summary.json").read_text())
    row: dict = {}

    def scores(model: torch.nn.Module) -> dict:
        model.eval()
        out = {"mean_client_accuracy": mean_accuracy(
            evaluate(model, c.x_test, c.y_test)[0] for c in fed.clients)}
        if fed.global_test is not None:
            out["global_test_accuracy"] = evaluate(model, *fed.global_test)[0]
        return out

    class Weighted(torch.nn.Module):
        """The ensemble under fixed member weights, as Co-Boosting's server distils it."""

        def __init__(self, ensemble: Ensemble, w: torch.Tensor) -> None:
            super().__init__()
            self.ensemble, self.w = ensemble, w

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ensemble(x, mixing_weights(self.w, len(x)))

    logged = summary.get(cfg.method) or {}

    def capture(self, state, ctx, replies):  # type: ignore[no-untyped-def]
        members, weights = [], []
        for cid, reply in sorted(replies.items()):
            m = self.client_new_model(cid)
            m.load_state_dict(reply.get("weights"))
            members.append(m.eval().requires_grad_(False))
            weights.append(fed.clients[cid].num_train)
        avg = self.client_new_model(0)
        avg.load_state_dict(weighted_average([m.state_dict() for m in members], weights))
        row["teachers"] = [scores(m) for m in members]
        row["ensemble"] = scores(Ensemble(members))
        row["weight_average"] = scores(avg)
        if "ensemble_weights" in logged:
            w = torch.tensor([logged["ensemble_weights"][str(c)] for c in sorted(replies)])
            row["weighted_ensemble"] = scores(Weighted(Ensemble(members), w))
        raise Captured

    original = method.aggregate
    method.aggregate = capture  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory(prefix="fedvl-dense-") as work:
            run_experiment(cfg, out=Path(work) / "r", fed=fed)
    except Captured:
        pass
    finally:
        method.aggregate = original  # type: ignore[method-assign]
    row["student"] = {"mean_client_accuracy": summary["mean_accuracy"],
                      "global_test_accuracy": summary.get("global_test_accuracy")}
    row["server_log"] = logged
    return row


def main() -> None:
    """Evaluate every seed's teachers and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", required=True, help="a fedvl bench method directory (seedS/ in it)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import statistics

    import torch
    torch.set_num_threads(1)
    rows = {f"seed{s}": teachers_row(Path(a.runs) / f"seed{s}") for s in a.seeds.split(",")}

    def stat(pick) -> dict:  # type: ignore[no-untyped-def]
        xs = [pick(r) for r in rows.values()]
        return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                "n": len(xs)}

    # A benchmark without a global test set (digits-offline) reports the client mean only.
    first = next(iter(rows.values()))
    keys = [k for k in ("mean_client_accuracy", "global_test_accuracy")
            if first["ensemble"].get(k) is not None]
    summary = {}
    parts = ["student", "ensemble", "weight_average"]
    parts += ["weighted_ensemble"] if "weighted_ensemble" in first else []
    for part in parts:
        summary[part] = {k: stat(lambda r, part=part, k=k: r[part][k]) for k in keys}
    summary["best_teacher"] = {k: stat(lambda r, k=k: max(t[k] for t in r["teachers"]))
                               for k in keys}
    summary["mean_teacher"] = {k: stat(lambda r, k=k: statistics.fmean(t[k] for t in r["teachers"]))
                               for k in keys}
    write_result(a.out, machine(), {
        "setting": f"the finished runs under {a.runs}, seeds {a.seeds}",
        "summary": summary, "seeds": rows})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

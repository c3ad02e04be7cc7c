"""The gradient norm of every clipped local step of a spec arm's run: does the clip bind?

  python benchmarks/grad_norms.py benchmarks/tables/feddyn-deviations.yaml \
      --arms code-grad-clip-10,code-optimiser-and-grad-clip-10 --seed 0 \
      --out benchmarks/results/feddyn-grad-norms-amd-cpu.json

Runs each arm (its config as `fedvl reproduce` builds it) in this process and records the
total L2 norm that `torch.nn.utils.clip_grad_norm_` returns at every step (the norm before
clipping): so only arms whose local training clips (FedDyn's `max_grad_norm` > 0) are measured.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from provenance import machine, write_result


def main() -> None:
    """Run the arms, collect the norms, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--arms", required=True, help="comma-separated arms that clip")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", default="cpu")
    ap.add_argument("--data-dir", help="the datasets' directory, if the benchmark needs one")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from fedvl.eval.tables import arm_config, load_spec
    from fedvl.run.experiment import run_experiment

    norms: list[torch.Tensor] = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording(params, max_norm, *args, **kwargs):  # type: ignore[no-untyped-def]
        total = clip(params, max_norm, *args, **kwargs)
        norms.append(total.detach())
        return total

    torch.nn.utils.clip_grad_norm_ = recording
    spec, rows = load_spec(a.spec), {}
    for arm in a.arms.split(","):
        norms.clear()
        over = {"data_dir": a.data_dir} if a.data_dir else None
        with tempfile.TemporaryDirectory() as tmp:
            summary = run_experiment(arm_config(spec, a.scale, arm, a.seed, over), out=tmp)
        if not norms:
            raise SystemExit(f"arm '{arm}' clipped no step: its config sets no clip")
        t = torch.stack(norms).float()
        rows[arm] = {"steps": len(norms), "max": t.max().item(), "median": t.median().item(),
                     "p99": t.quantile(0.99).item(), "mean_accuracy": summary["mean_accuracy"]}
        print(arm, rows[arm], flush=True)
    write_result(a.out, machine(f"{torch.get_num_threads()} torch thread(s)"),
                 {"spec": a.spec, "scale": a.scale, "seed": a.seed, "arms": rows})


if __name__ == "__main__":
    main()

"""`fedvl unlearn` against retraining from scratch without the forgotten class, over seeds.

  python benchmarks/unlearn_vs_retrain.py --out /tmp/unlearn \
      --result benchmarks/results/unlearn-vs-retrain-digits-offline-amd-cpu.json
For each seed: a FedAvg run on local virtual sets (`fedvl run`, skipped when finished), then
`fedvl unlearn RUN --class C --retrain`, which unlearns (QuickDrop's ascent and recovery on the
distilled sets) and retrains the run from scratch on the clients' data without class C. Records
each stage's forgotten / kept accuracy and attack AUC, and the seconds of both.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
from pathlib import Path

from provenance import machine, write_result

RUN = "--method fedavg --benchmark digits-offline --local-data virtual --threads 1 --quiet"


def _ms(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="folder of the runs")
    p.add_argument("--result", required=True, help="results JSON to write")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--forget-class", default="3")
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    commands, per_seed = [], {}
    for seed in a.seeds.split(","):
        run_dir = Path(a.out) / f"seed{seed}"
        run = f"fedvl run {RUN} --rounds {a.rounds} --seed {seed} --out {run_dir}"
        unlearn = (f"fedvl unlearn {run_dir} --class {a.forget_class} --retrain "
                   f"--out {run_dir}/unlearn")
        commands += [run, unlearn]
        if not (run_dir / "summary.json").is_file():
            subprocess.run(shlex.split(run), check=True, stdout=subprocess.DEVNULL)
        subprocess.run(shlex.split(unlearn), check=True, stdout=subprocess.DEVNULL)
        res = json.loads((run_dir / "unlearn" / "unlearn.json").read_text())
        per_seed[seed] = {"stages": res["stages"], "seconds": res["seconds"],
                          "distilled_images": res["distilled_images"]}
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for stage in ("before", "after_ascent", "after_recovery", "retrained"):
        summary[stage] = {k: _ms([100 * s["stages"][stage][k] for s in per_seed.values()])
                          for k in ("forgotten_accuracy", "kept_accuracy")}
        summary[stage]["loss_attack_auc"] = _ms(
            [s["stages"][stage]["loss_attack_auc"] for s in per_seed.values()])
    summary["seconds"] = {k: _ms([s["seconds"][k] for s in per_seed.values()])
                          for k in ("unlearning", "retraining", "retraining_rounds",
                                    "original_run")}
    write_result(a.result, machine("one torch thread"), {
        "commands": commands, "forget_class": int(a.forget_class), "rounds": a.rounds,
        "summary (accuracy in %)": summary, "per_seed": per_seed})
    print(f"written: {a.result}")


if __name__ == "__main__":
    main()

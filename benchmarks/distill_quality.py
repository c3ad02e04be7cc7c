"""Quality benchmark: DM-distilled vs random-real vs noise sets of equal IPC (fresh ConvNets).

Runs `fedvl distill` in-process for each (benchmark, ipc) and appends the results, with the exact
command, to benchmarks/results/distill-quality.json after every run (partial results survive).

    OMP_NUM_THREADS=2 python benchmarks/distill_quality.py [--only cifar10] [--steps 200] ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
from pathlib import Path

import torch
from provenance import command, machine, write_result

from fedvl.cli import main as fedvl_main

DATA = "/work/shared/data"
SETS = {
    "cifar10": ["--benchmark", "cifar10-dirichlet", "--data-dir", DATA, "--num-clients", "1",
                "--client", "0"],
    "mnist": ["--benchmark", "digits", "--data-dir", DATA, "--client", "mnist"],
    "digits-offline": ["--benchmark", "digits-offline", "--client", "handwritten"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="cifar10,mnist,digits-offline")
    ap.add_argument("--ipcs", default="1,10")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch-real", type=int, default=32)
    ap.add_argument("--eval-epochs", type=int, default=150)
    ap.add_argument("--eval-models", type=int, default=3)
    ap.add_argument("--test-cap", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra", default="", help="extra flags passed to fedvl distill")
    ap.add_argument("--out", default="benchmarks/results/distill-quality.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    # The header is this invocation's: write_result writes it anew.
    for key in ("command", "date", "machine", "load_average_at_end"):
        doc.pop(key, None)
    # The file gathers the runs of several invocations: keep every one's command line.
    doc.setdefault("script_commands", []).append(command())
    doc.update({"note": "reduced CPU scale; accuracy = mean/std over eval models trained with DSA"})
    for name in a.only.split(","):
        for ipc in [int(v) for v in a.ipcs.split(",")]:
            run_dir = Path("runs") / f"distill-quality-{name}-ipc{ipc}"
            argv = ["distill", *SETS[name], "--ipc", str(ipc), "--matching", "dm",
                    "--init", "real", "--steps", str(a.steps), "--width", str(a.width),
                    "--batch-real", str(a.batch_real), "--eval-epochs", str(a.eval_epochs),
                    "--eval-models", str(a.eval_models), "--eval-sets",
                    "distilled,random_real,noise", "--test-cap", str(a.test_cap),
                    "--threads", str(a.threads), *shlex.split(a.extra), "--out", str(run_dir)]
            rc = fedvl_main(argv)
            if rc != 0:
                raise SystemExit(f"fedvl distill failed for {name} ipc {ipc}")
            res = json.loads((run_dir / "distill.json").read_text())
            doc["runs"].append({
                "dataset": name, "ipc": ipc, "command": "fedvl " + shlex.join(argv),
                "date": datetime.date.today().isoformat(),
                "scale": {"width": a.width, "steps": a.steps, "batch_real": a.batch_real,
                          "eval_epochs": a.eval_epochs, "eval_models": a.eval_models,
                          "test_cap": a.test_cap},
                "accuracy": res["accuracy"], "synth_seconds": res["seconds"],
                "eval_seconds": res["eval_seconds"],
                "loss_first_last": [res["loss_curve"][0], res["loss_curve"][-1]]
                if res["loss_curve"] else None,
                "num_train": res["num_train"], "num_test": res["num_test"],
            })
            write_result(out, machine(f"{a.threads} threads"), doc)


if __name__ == "__main__":
    main()

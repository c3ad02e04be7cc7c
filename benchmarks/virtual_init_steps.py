"""How local IPC, DM steps and initialisation shape the local virtual data (FedAvg trains on it).

  python benchmarks/virtual_init_steps.py --data-dir ../shared/data \
      --cells 10:200:stats,50:200:stats,10:1000:stats,50:1000:stats,10:200:real,50:200:real
  python benchmarks/virtual_init_steps.py --data-dir ../shared/data --methods fedavg,fedlgd \
      --cells 10:1000:stats,50:1000:stats --seeds 0,1,2 --device cuda   # FedLGD's cells

Each cell IPC:STEPS:INIT runs `virtual_comparison.py --methods M` (default fedavg) at the CPU
DIGITS scale of the FedLGD comparison (width 32, 100 rounds, 500 train / 500 test images per
client) in WORK/STEPS-INIT, so finished runs are reused and the comparison's own work directory
can be linked in. Writes benchmarks/results/virtual-digits-init-steps.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import machine, write_result


def parse_cells(text: str) -> list[tuple[int, int, str]]:
    """'10:200:stats,50:1000:real' -> [(10, 200, 'stats'), (50, 1000, 'real')]."""
    cells = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            raise SystemExit(f"bad cell '{item}': expected IPC:STEPS:INIT, e.g. 10:200:stats")
        cells.append((int(parts[0]), int(parts[1]), parts[2]))
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--cells", required=True, help="IPC:STEPS:INIT,... (INIT: stats|real|noise)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--work", default="/tmp/bench/init-steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default="fedavg", help="comma-separated methods of every cell")
    p.add_argument("--device", default="cpu")
    p.add_argument("--result", default="benchmarks/results/virtual-digits-init-steps.json")
    p.add_argument("--note", default="", help="recorded in the result (e.g. where runs came from)")
    a = p.parse_args()
    rows = []
    here = Path(__file__).parent
    for ipc, steps, init in parse_cells(a.cells):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "cell.json"
            subprocess.run(
                [sys.executable, str(here / "virtual_comparison.py"), "--benchmark", "digits",
                 "--data-dir", a.data_dir, "--ipc", str(ipc), "--virtual-steps", str(steps),
                 "--virtual-init", init, "--methods", a.methods, "--seeds", a.seeds,
                 "--device", a.device,
                 "--rounds", "100", "--train-cap", "500", "--test-cap", "500",
                 "--threads", str(a.threads), "--work", f"{a.work}/{steps}-{init}",
                 "--result", str(out)], check=True)
            cell = json.loads(out.read_text())
        for method in a.methods.split(","):
            res = cell["methods"][method]
            rows.append({"method": method, "ipc": ipc, "dm_steps": steps, "init": init,
                         "mean_accuracy": res["mean_accuracy"],
                         "per_client_accuracy": res["per_client_accuracy"],
                         "seeds": res.get("seeds"), "runs": res["runs"], "scale": cell["scale"]})
            print(f"IPC {ipc:>3}  {steps:>5} DM steps  init {init:<5}  {method} mean "
                  f"{100 * res['mean_accuracy']['mean']:.1f}")
    write_result(a.result, machine(), {"method": f"{a.methods} on each client's local virtual data",
                                       "note": a.note, "cells": rows})
    print(f"written: {a.result}")


if __name__ == "__main__":
    main()

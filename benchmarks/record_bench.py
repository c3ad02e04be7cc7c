"""Record a finished `fedvl bench` (or `fedvl run`) directory as a results file, with its command.

  python benchmarks/record_bench.py runs/bench-x --result benchmarks/results/x.json \
      --command "fedvl bench --methods fedavg,fedlgd --local-data virtual --seeds 0,1,2 ..."
Copies comparison.json (methods, config, reference, missing runs) -- and, for a `fedvl
reproduce` folder, its reproduce.json (per-seed values, rows, claim verdicts) under "reproduce";
or, for a single run directory, summary.json; or the JSON file given (privacy.json,
heterogeneity.json) -- and adds
the command, date, machine and load average, so the numbers in the README can be traced to one
command.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from provenance import load_average, machine, write_result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("bench_dir")
    p.add_argument("--result", required=True)
    p.add_argument("--command", required=True, help="the fedvl bench command that ran")
    p.add_argument("--note", default="")
    a = p.parse_args()
    src = Path(a.bench_dir)
    reproduced = src / "reproduce.json"
    if not src.is_file():
        src = src / "comparison.json"
        if not src.is_file():
            src = src.with_name("summary.json")
    comp = json.loads(src.read_text())
    if reproduced.is_file():
        comp["reproduce"] = json.loads(reproduced.read_text())
    # The command is the recorded run's, not this script's; the load is the one at recording.
    write_result(a.result, machine(), {"command": a.command,
                                       "load_average_at_record": load_average(),
                                       "note": a.note, **comp}, load=False)
    print(f"written: {a.result}")


if __name__ == "__main__":
    main()

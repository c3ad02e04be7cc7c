"""`fedvl perf --distill` before and after a change of code, one objective at a time, interleaved.

For each objective and repetition, the measurement (`fedvl.perf.synthesis.run_distill_perf`:
GFLOP per step, steps/s, GFLOP/s, share of the 1-thread matmul rate timed in the same process)
runs once with the old tree's code (`--before-src`, a `git worktree` of the old commit with this
checkout's `src/fedvl/perf/synthesis.py` copied in, its FedVCK sampler without `multiset=True`,
which the old code lacks) and once with this checkout's, alternating which goes first, so both
see the same background load. The median over repetitions is kept.

    git worktree add /tmp/before 0d35ef7
    cp src/fedvl/perf/synthesis.py /tmp/before/src/fedvl/perf/
    sed -i 's/, vck.replacement,$/, vck.replacement),/; /^ *multiset=True),$/d' \
        /tmp/before/src/fedvl/perf/synthesis.py
    python benchmarks/distill_objectives_ab.py --before-src /tmp/before/src --reps 3 \
        --out benchmarks/results/distill-objectives-ab-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from provenance import write_result

HERE = Path(__file__).resolve().parent
AFTER_SRC = HERE.parent / "src"
OBJECTIVES = "dm,dm-fixed,kernel-latent,embed-logit,gradient,target-gradient,vhl-generator"

ONE = r"""
import json, sys
from fedvl.perf.synthesis import run_distill_perf
r = run_distill_perf([sys.argv[1]], "digits-offline", None, int(sys.argv[2]), 0, int(sys.argv[3]),
                     "cpu", 1, float(sys.argv[4]))
print(json.dumps(r))
"""


def measure(src: Path, objective: str, train_cap: int, width: int, seconds: float
            ) -> dict:
    """One objective's row (and the matmul rate) measured with `src`'s code."""
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, "-c", ONE, objective, str(train_cap), str(width),
                          str(seconds)], env=env, check=True, capture_output=True, text=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    row = res["objectives"][objective]
    row["matmul_gflops"] = res["matmul_gflops"]["used"]
    return row


def main() -> None:
    """Run the interleaved comparison and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-src", required=True)
    ap.add_argument("--objectives", default=OBJECTIVES)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--train-cap", type=int, default=100)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default="benchmarks/results/distill-objectives-ab-cpu.json")
    a = ap.parse_args()
    trees = {"before": Path(a.before_src).resolve(), "after": AFTER_SRC}
    load_start = os.getloadavg()
    rows: dict[str, dict[str, list[dict]]] = {}
    for name in [o for o in a.objectives.split(",") if o]:
        rows[name] = {t: [] for t in trees}
        for rep in range(a.reps):
            for t in (list(trees) if rep % 2 == 0 else list(reversed(trees))):
                r = measure(trees[t], name, a.train_cap, a.width, a.seconds)
                rows[name][t].append(r)
                print(name, t, rep, round(r["gflop_per_step"], 3), round(r["steps_per_second"], 2),
                      f"{100 * r['share_of_matmul_rate']:.1f}%", flush=True)
    summary = {}
    for name, by in rows.items():
        med = {t: {k: statistics.median(r[k] for r in by[t])
                   for k in ("gflop_per_step", "steps_per_second", "gflops",
                             "share_of_matmul_rate", "matmul_gflops")} for t in trees}
        summary[name] = {**med, "speedup_steps_per_second":
                         med["after"]["steps_per_second"] / med["before"]["steps_per_second"],
                         "what": by["after"][0]["what"]}
    write_result(a.out, {"cpu_count": os.cpu_count(), "load_average_start": load_start,
                         "load_average_end": os.getloadavg()}, {
              "setting": f"digits-offline client 0, --train-cap {a.train_cap}, ConvNet width "
                         f"{a.width} depth 3, 1 torch thread (a client's), each method's "
                         f"default options; medians of {a.reps} interleaved repetitions",
              "summary": summary, "rows": rows})
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

"""Run a table spec (`fedvl.eval.tables`) at one scale and write its comparison with the paper.

Every arm x seed is one run of `fedvl.eval.comparison.run_bench` (resumable: finished runs in the
output folder are reused; `jobs` > 1 runs them as parallel processes, `fedvl.eval.grid`). Writes,
into the output folder: the bench's `comparison.json` / `comparison.md`, `reproduce.json` (the
spec, scale, command, per-seed values, rows and claim verdicts), `reproduce.md` (the table beside
the paper's column and each claim marked holds / fails / not enough seeds) and the `fedvl report`
page.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedvl.config import ConfigError
from fedvl.eval import tables
from fedvl.eval.comparison import run_bench
from fedvl.eval.tables import TableSpec

RESULT_JSON = "reproduce.json"
RESULT_MD = "reproduce.md"


def plan(spec: TableSpec, scale: str, seeds: list[int] | None = None,
         overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """What `run_table` hands `run_bench`: base config, arms, per-arm options and settings."""
    configs = {label: tables.arm_config(spec, scale, label, 0, overrides or {})
               for label in spec.arms}
    # The first arm's config is the base every other arm differs from.
    base = next(iter(configs.values()))
    base_values = base.to_dict()
    method_args, method_run, arm_methods = {}, {}, {}
    for label, arm in spec.arms.items():
        values = configs[label].to_dict()
        method_args[label] = values.pop("method_args")
        # Only what differs from the base travels per arm (its rows' "own settings").
        method_run[label] = {k: v for k, v in values.items()
                             if k not in ("method", "seed", "method_args")
                             and v != base_values.get(k)}
        arm_methods[label] = arm.method
    seeds = list(seeds) if seeds else spec.scales[scale].seeds
    seed_args = spec.scales[scale].seed_args
    per_seed = {label for by_arm in seed_args.values() for label in by_arm}
    for seed in seeds:
        lacking = sorted(per_seed - set(seed_args.get(seed, {})))
        if lacking:
            # A seed without its own options would run an unmatched setting under the arm's name.
            raise ConfigError(
                f"table '{spec.name}': arm(s) {', '.join(lacking)} take options per seed at scale "
                f"'{scale}' (seed_args gives seeds {', '.join(map(str, sorted(seed_args)))}); "
                f"seed {seed} has none: add them to the spec or pick those seeds")
    seed_method_args = {seed: {label: tables.arm_config(spec, scale, label, seed,
                                                        overrides or {}).method_args
                               for label in by_arm}
                        for seed, by_arm in seed_args.items() if seed in seeds}
    return {"base": base, "labels": list(spec.arms), "method_args": method_args,
            "method_run": method_run, "arm_methods": arm_methods, "seeds": seeds,
            "seed_method_args": seed_method_args}


def run_table(spec: TableSpec, scale: str, out: Path, command: str, *,
              seeds: list[int] | None = None, overrides: dict[str, Any] | None = None,
              jobs: int | str = 1, report_only: bool = False, progress: bool = True,
              report: bool = True) -> dict[str, Any]:
    """Run (or reuse) every arm x seed of `spec` at `scale`; write and return the result."""
    p = plan(spec, scale, seeds, overrides)
    reference = {"source": spec.source,
                 "methods": {label: {"mean_accuracy": arm.paper["mean"]}
                             for label, arm in spec.arms.items() if "mean" in arm.paper}}
    comp = run_bench(p["base"], p["labels"], p["seeds"], out, p["method_args"], reference,
                     progress=progress, report_only=report_only, method_run=p["method_run"],
                     protocol=spec.protocol, jobs=jobs, arm_methods=p["arm_methods"],
                     seed_method_args=p["seed_method_args"])
    runs = tables.summaries(comp)   # every finished run's summary.json, read once
    metric = tables.scale_metric(spec, scale)
    values = tables.per_seed(runs, metric)
    claims = tables.evaluate_claims(spec, values)
    rows = tables.table_rows(spec, comp, values, tables.per_client(runs, metric))
    result = {"table": spec.name, "title": spec.title, "source": spec.source, "scale": scale,
              "scale_source": spec.scales[scale].source, "metric": metric,
              "command": command, "seeds": p["seeds"], "per_seed": values, "rows": rows,
              "claims": claims, "missing": comp.get("missing", []),
              "arms": {k: asdict(a) for k, a in spec.arms.items()}}
    tmp = out / f"{RESULT_JSON}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / RESULT_JSON)
    (out / RESULT_MD).write_text(tables.render(spec, scale, command, rows, claims))
    if report and any(values.values()):
        from fedvl.eval.html_report import write_report

        write_report(out)
    return result


def listing() -> list[dict[str, Any]]:
    """Every shipped table: name, title, arms, and per scale its seeds and cost."""
    out = []
    for name in tables.spec_names():
        spec = tables.load_spec(name)
        out.append({"name": name, "title": spec.title, "arms": len(spec.arms),
                    "claims": len(spec.claims),
                    "scales": {s: {"seeds": len(sc.seeds), "runs": len(sc.seeds) * len(spec.arms),
                                   "cost": tables.cost_words(sc, len(spec.arms))}
                               for s, sc in spec.scales.items()}})
    return out

"""Every method x seed on one benchmark, resumable, with a comparison table (`fedvl bench`)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedvl.config import ConfigError, RunConfig, shared_model_args, validate
from fedvl.defaults import DEFAULT_PROTOCOL, PROTOCOLS
from fedvl.engine.logs import reported_epsilon
from fedvl.engine.recorder import accuracy_vs_bytes, read_metrics
from fedvl.eval import grid as grid_mod
from fedvl.eval import plots
from fedvl.eval.grid import GridRun
from fedvl.eval.tables import epsilon_cell, rejected_note

PLOT = "accuracy_vs_bytes.png"


def parse_method_args(items: list[str], methods: list[str]) -> dict[str, dict[str, Any]]:
    """`name.key=value` items -> {name: {key: value}}."""
    out: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for item in items:
        head, sep, value = item.partition("=")
        name, dot, key = head.partition(".")
        if not sep or not dot:
            raise ConfigError(f"bench --method-arg '{item}' must look like METHOD.KEY=VALUE")
        if name not in out:
            raise ConfigError(f"--method-arg names method '{name}', which is not in --methods "
                              f"({', '.join(methods)})")
        out[name][key] = yaml.safe_load(value)
    return out


def _mean_std(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    std = float(arr.std(ddof=1)) if len(arr) > 1 else 0.0
    return {"mean": float(arr.mean()), "std": std, "n": int(len(arr))}


def run_bench(
    base: RunConfig,
    methods: list[str],
    seeds: list[int],
    out: Path,
    method_args: dict[str, dict[str, Any]] | None = None,
    reference: dict[str, Any] | None = None,
    progress: bool = True,
    report_only: bool = False,
    target_acc: float | None = None,
    method_run: dict[str, dict[str, Any]] | None = None,
    protocol: str = DEFAULT_PROTOCOL,
    tuned: str | Path | None = None,
    jobs: int | str = 1,
    max_memory: int | None = None,
    arm_methods: dict[str, str] | None = None,
    seed_method_args: dict[int, dict[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Run (or reuse) every method x seed and write comparison.json / comparison.md.

    `methods` are row labels; `arm_methods` maps a label to the registered method it runs when
    they differ (`fedvl reproduce`'s arms: `fedlgd-ipc50` runs `fedlgd`), with its own options
    from `method_args` and run settings from `method_run`; `seed_method_args` (seed -> label ->
    options) replaces a label's options in that seed's run.

    `method_run` gives a method run settings of its own over `base` (`--preset paper`'s
    rounds); `tuned` names the `fedvl tune` directory those settings come from (recorded).
    `protocol` one-shot runs every method for exactly one round with every client (its local
    epochs are the caller's: `fedvl bench` sets them, see `ONE_SHOT_LOCAL_EPOCHS`).

    With `report_only`, nothing runs: the comparison covers the finished runs, and
    `missing` lists the method/seed pairs that have none. With `target_acc`, each method also
    gets its rounds to that mean accuracy and its speed-up over FedAvg (`summarize`).

    `jobs` > 1 runs the pending runs on that many worker processes, 'auto' on as many as one
    run's measured peak memory allows (`fedvl.eval.grid`; `max_memory` caps the memory it may
    fill); 1 runs them one after another in this process. The comparison is the same.
    """
    method_args, method_run = method_args or {}, method_run or {}
    arm_methods, seed_method_args = arm_methods or {}, seed_method_args or {}
    jobs = grid_mod.parse_jobs(jobs)
    if max_memory is not None and jobs != grid_mod.AUTO:
        raise ConfigError(f"--max-memory sizes --jobs auto; with --jobs {jobs} it would do "
                          "nothing (allowed: --max-memory with --jobs auto only)")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol {protocol!r} is unknown; allowed: {', '.join(PROTOCOLS)}")
    if protocol == "one-shot":
        if base.client_ratio != 1:
            raise ConfigError(f"--protocol one-shot has every client take part in its one "
                              f"round; --client-ratio {base.client_ratio} would leave some out "
                              "(drop it)")
        # One round, whatever a preset's or a method's paper settings say.
        base = replace(base, rounds=1)
        method_run = {m: {**r, "rounds": 1} for m, r in method_run.items()}
    # One model for every method: a method's preferred model (FedVCK's BatchNorm) would make
    # its lead partly the model's.
    base = shared_model_args(base)
    for m in methods:
        validate(replace(base, method=arm_methods.get(m, m), method_args=method_args.get(m, {}),
                         **method_run.get(m, {})))
    out.mkdir(parents=True, exist_ok=True)
    # Seed-major, as the runs have always run: the order of the table and of the work.
    grid = [GridRun(m, seed, replace(base, method=arm_methods.get(m, m), seed=seed,
                                     method_args=seed_method_args.get(seed, {}).get(
                                         m, method_args.get(m, {})),
                                     **method_run.get(m, {})), out / m / f"seed{seed}")
            for seed in seeds for m in methods]
    finished: dict[tuple[str, int], dict[str, Any]] = {}
    missing: list[str] = []
    todo: list[GridRun] = []
    for run in grid:
        done = run.run_dir / "summary.json"
        if done.is_file():
            finished[run.key] = json.loads(done.read_text())
        elif report_only:
            missing.append(f"{run.method}/seed{run.seed}")
        else:
            todo.append(run)
    finished.update(_run_grid(todo, jobs, progress, max_memory))
    summaries: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for run in grid:
        if run.key in finished:
            summaries[run.method].append(finished[run.key])
    comparison = summarize(base, {m: r for m, r in summaries.items() if r}, reference,
                           target_acc)
    for m, entry in comparison["methods"].items():
        # What this method runs with beyond the shared config: shown beside its row.
        entry["settings"] = {**method_args.get(m, {}), **method_run.get(m, {})}
    if missing:
        comparison["missing"] = missing
    comparison["protocol"] = protocol
    if tuned is not None:
        comparison["tuned"] = str(tuned)
    plotted = plot_accuracy_vs_bytes(comparison, out / PLOT)
    # Every file this call wrote into `out`, for the command's "written:" line.
    comparison["files"] = ["comparison.md", "comparison.json", *([PLOT] if plotted else [])]
    # A per-process temporary name: several bench processes may share one output folder.
    tmp = out / f"comparison.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(comparison, indent=2))
    os.replace(tmp, out / "comparison.json")
    (out / "comparison.md").write_text(render_markdown(comparison))
    return comparison


def _run_in_process(runs: list[GridRun], progress: bool) -> dict[tuple[str, int], Any]:
    """Run `runs` one after another in this process (`--jobs 1`); each one's summary."""
    from fedvl.run.assemble import build_federation
    from fedvl.run.experiment import run_experiment

    out: dict[tuple[str, int], Any] = {}
    fed, fed_key = None, None
    for run in runs:
        if fed is None or fed_key != (run.seed, run.cfg.data):
            # One federation per seed and data setting, shared by its methods: the same data,
            # built once (a table's arms may change the data, e.g. its client count).
            fed, fed_key = build_federation(run.cfg), (run.seed, run.cfg.data)
        out[run.key] = run_experiment(run.cfg, out=run.run_dir, resume=run.resume,
                                      progress=progress, fed=fed)
    return out


def _run_grid(todo: list[GridRun], jobs: int | str, progress: bool,
              max_memory: int | None) -> dict[tuple[str, int], Any]:
    """The pending runs on `jobs` processes (1: in this process; 'auto': measured); summaries.

    `--jobs auto` runs the first pending run alone in its own process, measures its peak memory
    and picks N for the rest from it (`grid.choose_jobs`), saying why in one line; a grid whose
    run does not fit is refused there, before any other run starts.
    """
    if not todo:
        return {}
    if jobs == grid_mod.AUTO:
        if len(todo) == 1:
            print("fedvl bench --jobs auto: 1 process (one run left to do)", file=sys.stderr)
            return _run_in_process(todo, progress)
        cores = grid_mod.cpu_cores()
        first = grid_mod.run_processes(todo[:1], 1, cores, progress)[todo[0].key]
        n, why = grid_mod.choose_jobs(grid_mod.device_memories(first, max_memory), cores)
        print(why, file=sys.stderr)
        return {todo[0].key: first.summary, **_run_grid(todo[1:], n, progress, None)}
    n = min(int(jobs), len(todo))
    if n == 1:
        return _run_in_process(todo, progress)
    return {k: f.summary for k, f in grid_mod.run_processes(todo, n, progress=progress).items()}


def _bytes_curve(run: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's accuracy-vs-bytes points (rebuilt from metrics.jsonl for older summaries)."""
    if "accuracy_vs_bytes" in run:
        return run["accuracy_vs_bytes"]
    return accuracy_vs_bytes(read_metrics(run["run_dir"])) if run.get("run_dir") else []


def _mean_bytes_curve(curves: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Bytes and accuracies averaged over seeds at every round all runs evaluated."""
    if not curves or any(not c for c in curves):
        return []
    per_run = [{int(p["round"]): p for p in c} for c in curves]
    out = []
    for rnd in sorted(set.intersection(*(set(c) for c in per_run))):
        pts = [c[rnd] for c in per_run]
        point = {"round": rnd, "bytes": float(np.mean([p["bytes"] for p in pts])),
                 "mean_accuracy": float(np.mean([p["mean_accuracy"] for p in pts]))}
        if all("global_test_accuracy" in p for p in pts):
            point["global_test_accuracy"] = float(np.mean([p["global_test_accuracy"]
                                                           for p in pts]))
        out.append(point)
    return out


def plot_accuracy_vs_bytes(comp: dict[str, Any], path: Path) -> bool:
    """Draw every method's seed-mean accuracy against cumulative MiB exchanged (log x-axis).

    Returns whether a plot was written (no method with a curve: nothing is written).
    """
    curves = {m: e["accuracy_vs_bytes"] for m, e in comp["methods"].items()
              if e.get("accuracy_vs_bytes")}
    if not curves:
        return False
    plots.save(plots.accuracy_vs_bytes(curves, comp["benchmark"]), path)
    return True


def _mean_curve(curves: list[list[list[float]] | None]) -> list[list[float]]:
    """Mean accuracy over seeds at every round all runs evaluated ([] if a run has no curve)."""
    if not curves or any(not c for c in curves):
        return []
    per_run = [{int(rnd): float(acc) for rnd, acc in c} for c in curves]
    common = sorted(set.intersection(*(set(c) for c in per_run)))
    return [[rnd, float(np.mean([c[rnd] for c in per_run]))] for rnd in common]


def rounds_to_target(curve: list[list[float]] | None, target: float) -> int | None:
    """Rounds a run needed to reach mean accuracy `target`: 1 + the index of the first
    evaluated round at or above it (None: never reached, or no curve)."""
    for rnd, acc in curve or []:
        if acc >= target:
            return int(rnd) + 1
    return None


def target_entry(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Rounds to `target` per seed, and their mean over the seeds that reached it (None when
    none did)."""
    per_seed = [rounds_to_target(r.get("accuracy_curve"), target) for r in runs]
    hit = [n for n in per_seed if n is not None]
    return {"per_seed": per_seed, "reached": len(hit), "n": len(runs),
            "mean_rounds": float(np.mean(hit)) if hit else None}


def summarize(base: RunConfig, summaries: dict[str, list[dict[str, Any]]],
              reference: dict[str, Any] | None, target_acc: float | None = None
              ) -> dict[str, Any]:
    """Mean ± std over seeds of every method's accuracies, bytes and time.

    Per method: the final mean accuracy, the best over the evaluated rounds (when every run has
    its accuracy curve) and, with `target_acc`, the rounds each seed took to reach it (mean
    over the seeds that did) and the speed-up over FedAvg's mean rounds when fedavg is
    compared and reached it too.
    """
    methods: dict[str, Any] = {}
    for m, runs in summaries.items():
        clients = list(runs[0]["per_client_accuracy"])
        entry: dict[str, Any] = {
            "mean_accuracy": _mean_std([r["mean_accuracy"] for r in runs]),
            "per_client_accuracy": {
                c: _mean_std([r["per_client_accuracy"][c] for r in runs]) for c in clients},
            "bytes_up": float(np.mean([r["bytes_up"] for r in runs])),
            "bytes_peer": float(np.mean([r.get("bytes_peer", 0) for r in runs])),
            "bytes_down": float(np.mean([r["bytes_down"] for r in runs])),
            # Everything the run's messages carried: up + down (+ peer), from its ledger.
            "bytes_total": float(np.mean([r["bytes_up"] + r["bytes_down"]
                                          + r.get("bytes_peer", 0) for r in runs])),
            "bytes_per_round": {
                d: float(np.mean([r["bytes_per_round"][d] for r in runs]))
                for d in ("up", "down", "peer") if all(d in r["bytes_per_round"] for r in runs)},
            "bytes_by_kind": runs[0]["bytes_by_kind"],
            "rounds": runs[0].get("rounds"),
            # Every client's training-set size (the same split for every seed of a benchmark).
            "train_samples": runs[0].get("train_samples"),
            "wall_seconds": _mean_std([r["wall_seconds"] for r in runs]),
            # Before round 0 (data, local virtual sets; 0 when a cache held them): None in
            # summaries written before it was recorded.
            "setup_seconds": (_mean_std([r["setup_seconds"] for r in runs])
                              if all("setup_seconds" in r for r in runs) else None),
            "seeds": [r["seed"] for r in runs],
            "runs": [r["run_dir"] for r in runs],
        }
        curve = _mean_curve([r.get("accuracy_curve") for r in runs])
        if curve:
            entry["accuracy_curve"] = curve
        if runs and all(r.get("accuracy_curve") for r in runs):
            # Each seed's best evaluated round (not the best of the seed-mean curve).
            entry["best_accuracy"] = _mean_std([max(a for _, a in r["accuracy_curve"])
                                                for r in runs])
            # The round of each seed's peak (1-based, the first if tied): a peak well before
            # the last round means the final accuracy undersells the method, or it overfits.
            entry["best_round"] = _mean_std([
                1 + max(r["accuracy_curve"], key=lambda p: p[1])[0] for r in runs])
        if target_acc is not None:
            entry["target"] = target_entry(runs, target_acc)
        by_bytes = _mean_bytes_curve([_bytes_curve(r) for r in runs])
        if by_bytes:
            entry["accuracy_vs_bytes"] = by_bytes
        for key in ("mean_global_accuracy", "mean_inter_accuracy", "worst_accuracy",
                    "mean_holdout_accuracy"):
            if all(key in r for r in runs):
                entry[key] = _mean_std([r[key] for r in runs])
        if all("inter_accuracy" in r for r in runs):
            entry["per_client_inter_accuracy"] = {
                c: _mean_std([r["inter_accuracy"][c] for r in runs]) for c in clients}
        if all(r.get("global_test_accuracy") is not None for r in runs):
            entry["global_test_accuracy"] = _mean_std([r["global_test_accuracy"] for r in runs])
        entry.update(privacy_range(runs))
        # An honest run has none: a reply the server refused leaves its client out of a round.
        rejected = sum(len(r.get("rejected_replies") or []) for r in runs)
        if rejected:
            entry["rejected_replies"] = rejected
        methods[m] = entry
    if target_acc is not None:
        speed_up(methods)
    cfg = base.to_dict()
    cfg.pop("method")
    cfg.pop("seed")
    out = {"benchmark": base.benchmark, "config": cfg, "methods": methods,
           "reference": reference or {}}
    if target_acc is not None:
        out["target_accuracy"] = target_acc
    return out


def privacy_range(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ε range over every client and seed and the noise multipliers of runs that report a
    DP guarantee (`privacy` in summary.json); empty for runs without DP."""
    eps = [float(v) for r in runs for v in (reported_epsilon(r) or {}).values()
           if isinstance(v, (int, float))]
    if not eps:
        return {}
    sigmas = {float(r["privacy"].get("noise_multiplier", 0.0)) for r in runs
              if isinstance(r.get("privacy"), dict)}
    return {"epsilon_range": [min(eps), max(eps)], "noise_multiplier": sorted(sigmas)}


BASELINE = "fedavg"   # the method speed-ups are measured against


def speed_up(methods: dict[str, Any]) -> None:
    """Add each method's speed-up over FedAvg to its `target` entry, in place: FedAvg's mean
    rounds to the target / the method's (None where either did not reach it)."""
    base = methods.get(BASELINE, {}).get("target", {}).get("mean_rounds")
    for e in methods.values():
        mine = e["target"]["mean_rounds"]
        e["target"]["speed_up"] = base / mine if base is not None and mine else None


def comparison_tables(comp: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The comparison as (caption, header, rows) tables of formatted cells (accuracies in %)."""
    methods = comp["methods"]
    clients = list(next(iter(methods.values()))["per_client_accuracy"]) if methods else []
    ref = comp.get("reference") or {}
    ref_methods = ref.get("methods", {})
    glob = bool(methods) and all("global_test_accuracy" in e for e in methods.values())
    inter = bool(methods) and all("mean_inter_accuracy" in e for e in methods.values())
    unseen = bool(methods) and all("mean_holdout_accuracy" in e for e in methods.values())
    peer = any(e.get("bytes_peer") for e in methods.values())
    best = bool(methods) and all("best_accuracy" in e for e in methods.values())
    target = comp.get("target_accuracy")
    fedavg = BASELINE in methods
    # One seed everywhere: no spread, so the headers do not promise one.
    pm = "" if all(e["mean_accuracy"].get("n", 2) < 2 for e in methods.values()) else " ± std"
    head = ["method", *clients, f"mean{pm}", *([f"best{pm}", "best at round"] if best else []),
            *(["global test"] if glob else []),
            *([f"inter{pm}", "worst"] if inter else []),
            *([f"unseen clients{pm}"] if unseen else []), "seeds"]
    if target is not None:
        head.append(f"rounds to {100 * target:.4g}%")
        if fedavg:
            head.append(f"speed-up vs {BASELINE}")
    if ref_methods:
        head.append(f"reference ({ref.get('source', 'paper')})")
    dp = any(e.get("epsilon_range") for e in methods.values())
    if dp:
        head.append("ε (clients, seeds)")
    setup = any(e.get("setup_seconds") for e in methods.values())
    head += ["MiB up", "MiB down", *(["MiB peer"] if peer else []), "s / run",
             *(["setup s"] if setup else [])]
    settings = any(e.get("settings") for e in methods.values())
    if settings:
        head.append("own settings")
    rows = []
    for m, e in methods.items():
        row = [m] + [f"{100 * e['per_client_accuracy'][c]['mean']:.2f}" for c in clients]
        acc = e["mean_accuracy"]
        row.append(_pm(acc))
        if best:
            b = e["best_accuracy"]
            row.append(_pm(b))
            at = e.get("best_round")   # absent in comparisons written before it existed
            row.append("—" if at is None else f"{at['mean']:.1f}")
        if glob:
            g = e["global_test_accuracy"]
            row.append(_pm(g))
        if inter:
            i = e["mean_inter_accuracy"]
            row.append(_pm(i))
            row.append(f"{100 * e['worst_accuracy']['mean']:.2f}")
        if unseen:
            row.append(_pm(e["mean_holdout_accuracy"]))
        row.append(str(acc["n"]))
        if target is not None:
            row += _target_cells(e["target"], fedavg)
        if ref_methods:
            r = ref_methods.get(m, {})
            row.append(str(r.get("mean_accuracy", "")) if isinstance(r, dict) else str(r))
        if dp:
            row.append(epsilon_cell(e))
        row += [f"{e['bytes_up'] / 2**20:.2f}", f"{e['bytes_down'] / 2**20:.2f}",
                *([f"{e.get('bytes_peer', 0) / 2**20:.2f}"] if peer else []),
                f"{e['wall_seconds']['mean']:.1f}"]
        if setup:
            row.append("—" if not e.get("setup_seconds") else f"{e['setup_seconds']['mean']:.1f}")
        if settings:
            row.append(", ".join(f"{k}={_setting(v)}" for k, v in e.get("settings", {}).items())
                       or "—")
        rows.append(row)
    tables = [(comp["benchmark"], head, rows)]
    if one_round(comp):
        tables.append(bytes_table(comp))
    if methods and all("per_client_inter_accuracy" in e for e in methods.values()):
        # Inter (DESA's "global") accuracy: each client's model on every other client's test set.
        tables.append(("Inter accuracy per client (its model on the other clients' test sets)",
                       ["method", *clients, "mean"],
                       [[m, *(f"{100 * e['per_client_inter_accuracy'][c]['mean']:.2f}"
                              for c in clients),
                         f"{100 * e['mean_inter_accuracy']['mean']:.2f}"]
                        for m, e in methods.items()]))
    return tables


def one_round(comp: dict[str, Any]) -> bool:
    """Whether every method of the comparison ran exactly one round (the one-shot protocol)."""
    methods = comp.get("methods", {})
    return bool(methods) and all(e.get("rounds") == 1 for e in methods.values())


def _by_kind(by_kind: dict[str, dict[str, int]], direction: str) -> str:
    """'kind N B, ...' of the kinds that crossed in `direction` (— when none did)."""
    sent = [f"{k} {v[direction]:,} B" for k, v in by_kind.items() if v.get(direction)]
    return ", ".join(sent) or "—"


def bytes_table(comp: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Accuracy against the total bytes of the one round each method ran, with what crossed
    per direction and payload kind (the kinds of the first seed's run)."""
    methods = comp["methods"]
    pm = "" if all(e["mean_accuracy"].get("n", 2) < 2 for e in methods.values()) else " ± std"
    glob = all("global_test_accuracy" in e for e in methods.values())
    head = ["method", f"mean{pm}", *(["global test"] if glob else []), "bytes total",
            "MiB total", "up by kind", "down by kind"]
    rows = []
    for m, e in methods.items():
        total = e.get("bytes_total", e["bytes_up"] + e["bytes_down"] + e.get("bytes_peer", 0))
        kinds = e.get("bytes_by_kind") or {}
        rows.append([m, _pm(e["mean_accuracy"]),
                     *([_pm(e["global_test_accuracy"])] if glob else []),
                     f"{total:,.0f}", f"{total / 2**20:.2f}", _by_kind(kinds, "up"),
                     _by_kind(kinds, "down")])
    return ("Accuracy against total bytes (one communication round: uplink + downlink"
            " + peer, from the byte ledger)", head, rows)
def _setting(value: Any) -> str:
    """A setting in the "own settings" cell (a tuned float to 4 significant digits)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _pm(stat: dict[str, Any]) -> str:
    """A mean ± std cell in %; the mean alone when one seed gave it (no spread to show)."""
    if stat.get("n", 2) < 2:
        return f"{100 * stat['mean']:.2f}"
    return f"{100 * stat['mean']:.2f} ± {100 * stat['std']:.2f}"


def _target_cells(t: dict[str, Any], fedavg: bool) -> list[str]:
    """The rounds-to-target cell (with how many seeds reached it, when not all did) and,
    when FedAvg is compared, the speed-up cell."""
    if t["mean_rounds"] is None:
        cells = ["not reached"]
    else:
        cells = [f"{t['mean_rounds']:.1f}" + ("" if t["reached"] == t["n"]
                                               else f" ({t['reached']}/{t['n']} seeds)")]
    if fedavg:
        cells.append("—" if t.get("speed_up") is None else f"{t['speed_up']:.2f}x")
    return cells


def comparison_notes(comp: dict[str, Any]) -> list[str]:
    """The sentences under the comparison tables (how to read them, what did not finish)."""
    methods = comp.get("methods", {})
    one = bool(methods) and all(e["mean_accuracy"].get("n", 2) < 2 for e in methods.values())
    notes = ["Accuracy in %, one seed per method (run more seeds for a spread)." if one else
             "Accuracy in %, mean over the seeds that finished (± sample std; one value "
             "alone where one seed finished)."]
    if methods and all("best_accuracy" in e for e in methods.values()):
        notes.append("Best: each seed's highest mean accuracy over the evaluated rounds, then "
                     "mean ± std over seeds (best at round: the mean over seeds of that round, "
                     "1-based); mean: the final one.")
    if comp.get("target_accuracy") is not None:
        notes.append(f"Rounds to {100 * comp['target_accuracy']:.4g}%: the first round whose "
                     "mean accuracy reaches it (1-based), per seed, then the mean over the "
                     "seeds that reached it" + ("; speed-up: FedAvg's rounds / the method's."
                                               if BASELINE in methods else "."))
    cfg = comp.get("config") or {}
    if cfg.get("model"):
        opts = ", ".join(f"{k} {v}" for k, v in sorted((cfg.get("model_args") or {}).items()))
        notes.append(f"Every method runs the same model: {cfg['model']}"
                     + (f" ({opts})" if opts else "") + ", the same data"
                     + ("" if comp.get("tuned") else " and the same local training")
                     + ("; own settings: what a method runs with beyond that."
                                   if any(e.get("settings") for e in methods.values())
                                   else "."))
    if comp.get("protocol") == "one-shot":
        local = (f"{cfg['local_steps']} local steps" if cfg.get("local_steps")
                 else f"{cfg.get('local_epochs')} local epochs")
        notes.append("One-shot protocol: every method ran exactly one communication round "
                     f"with every client; clients that train a model trained {local} in it.")
    if comp.get("tuned"):
        notes.append(f"Own settings tuned: each method's best trial of `fedvl tune` in "
                     f"{comp['tuned']} (scored on validation rows of the clients' training "
                     "data, never on these test sets).")
    if "centralised" in methods:
        notes.append("centralised is the pooled-data upper reference, not a federated method: "
                     "its clients upload their raw training data once (its MiB up).")
    if any(e.get("rejected_replies") for e in methods.values()):
        notes.append(rejected_note({m: e.get("rejected_replies", 0) for m, e in methods.items()}))
    if comp.get("missing"):
        notes.append("Not finished: " + ", ".join(comp["missing"]) + ".")
    return notes


def render_markdown(comp: dict[str, Any]) -> str:
    """The comparison as Markdown tables (accuracies in %)."""
    lines = [f"# {comp['benchmark']}"]
    for i, (caption, head, rows) in enumerate(comparison_tables(comp)):
        lines += ["", *([f"{caption}:", ""] if i else []), "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]
    lines += ["", *comparison_notes(comp)]
    return "\n".join(lines) + "\n"

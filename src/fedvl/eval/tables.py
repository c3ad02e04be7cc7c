"""Table specs: a paper's (or fedvl's) table as data, expanded into runs, its claims checked.

A spec is one YAML file in `fedvl/tables/` (package data, so an installed fedvl has them):

    title: FedLGD Table 1, DIGITS, local IPC 10
    source: FedLGD Sec. 4.1, Table 1           # where the paper's numbers come from
    metric: mean_accuracy                       # the per-seed value the table and claims use
    run: {benchmark: digits, local_data: virtual, ...}   # `fedvl run` settings of every arm
    arms:                                       # the table's rows: label -> what it runs
      fedavg: {paper: 75.9}
      fedlgd: {args: {lambda_reg: 10}, paper: {mean: 80.6, mnist: 95.8}}
      fedlgd-ipc50: {method: fedlgd, run: {ipc: 50}, paper: 86.7}
    scales:                                     # named sizes; `cpu` is required
      cpu: {seeds: [0, 1, 2], run: {train_cap: 500, rounds: 100}, cost: {...}}
      paper: {seeds: [0, 1, 2], run: {...}, args: {fedlgd: {...}}, source: FedLGD App. B}
      final: {seeds: [0, 1, 2], metric: global_test_accuracy}   # a scale may report its own
      matched: {seed_args: {1: {dp-fedavg: {dp_noise: 0.2595}}}}  # options of one seed's run
    claims: ["fedlgd > vhl > fedavg", "fedlgd-ipc50 > fedlgd"]

An arm's label is its method unless `method:` says otherwise. A scale's `run` overlays the
spec's, an arm's `run` overlays both; a scale's `args` give an arm's method options at that
scale over the arm's own, and its `seed_args` one seed's over those (a noise matched to that
seed's split, derived by a tool outside the spec). Claims: `A > B [> C ...]` (each neighbour
pair, by the seed means), `A > B + G` (A leads by more than G points), `A ~ B +- T` (within T
points). A claim holds or fails on the seeds both arms finished, and is "not enough seeds"
below `min_seeds` of them (default 3, the runs the seed papers report).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedvl.config import (
    PRESETS,
    ConfigError,
    RunConfig,
    from_dict,
    preset_method_args,
    preset_run_args,
    validate,
)
from fedvl.defaults import protocol_run_defaults

SPEC_PACKAGE = "fedvl.tables"
SCALES_REQUIRED = ("cpu",)
# Per-seed values a table can report: summary.json keys, or computed from a run's curves.
METRICS = ("mean_accuracy", "best_accuracy", "mean_global_accuracy", "mean_inter_accuracy",
           "global_test_accuracy", "best_global_test_accuracy", "worst_accuracy")
MIN_SEEDS = 3
# The per-client value beside each metric (a run's summary key: client -> fraction): the paper's
# per-client cells are of the same kind. Metrics of one global model show each client's test set.
PER_CLIENT = {"mean_global_accuracy": "global_accuracy", "mean_inter_accuracy": "inter_accuracy"}
PER_CLIENT_WORDS = {"global_accuracy": "each client's model on every client's test set",
                    "inter_accuracy": "each client's model on the other clients' test sets",
                    "per_client_accuracy": "each client's test set"}
_LABEL = re.compile(r"[a-z0-9][a-z0-9_.+-]*")
_SPEC_KEYS = {"title", "source", "metric", "protocol", "run", "arms", "scales", "claims",
              "min_seeds", "doc", "note"}
_ARM_KEYS = {"method", "args", "run", "paper", "about"}
_SCALE_KEYS = {"seeds", "run", "args", "source", "cost", "recorded", "note", "preset",
               "metric", "seed_args"}


@dataclass(frozen=True)
class Arm:
    """One row of a table: the method it runs, its options and run settings, the paper's cell."""

    label: str
    method: str
    args: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    paper: dict[str, float] = field(default_factory=dict)   # "mean" and per-client cells
    about: str = ""   # what the arm changes, in words (shown beside its label)


@dataclass(frozen=True)
class Scale:
    """A named size of a table: its seeds, run settings, per-arm options and measured cost."""

    name: str
    seeds: list[int]
    run: dict[str, Any] = field(default_factory=dict)
    args: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = ""
    cost: dict[str, Any] = field(default_factory=dict)
    recorded: str = ""
    preset: str = ""   # a `--preset`: each method's budgets, under the scale's and arm's settings
    metric: str = ""   # the scale's own metric, where it differs from the spec's
    # seed -> arm label -> method options of that seed's run, over `args`.
    seed_args: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Claim:
    """`left OP right (+ gap | +- tolerance)` pairs of a claim line, in order."""

    text: str
    pairs: list[tuple[str, str, str, float]]   # (a, op, b, margin) with op '>' or '~'


@dataclass(frozen=True)
class TableSpec:
    """A table: shared run settings, arms, scales, the paper's numbers and claims."""

    name: str
    title: str
    source: str
    metric: str
    protocol: str
    run: dict[str, Any]
    arms: dict[str, Arm]
    scales: dict[str, Scale]
    claims: list[Claim]
    min_seeds: int = MIN_SEEDS
    doc: str = ""
    note: str = ""


def _fail(name: str, what: str) -> ConfigError:
    return ConfigError(f"table spec '{name}': {what}")


def _mapping(name: str, where: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(name, f"{where} must be a mapping, got {type(value).__name__}")
    return dict(value)


def _unknown(name: str, where: str, got: dict[str, Any], allowed: set[str]) -> None:
    if extra := sorted(set(got) - allowed):
        raise _fail(name, f"{where} has unknown key(s) {', '.join(extra)}; allowed: "
                    f"{', '.join(sorted(allowed))}")


def parse_claim(name: str, text: str, labels: set[str]) -> Claim:
    """A claim line -> its ordered (a, op, b, margin) pairs; unknown labels are refused."""
    tokens = str(text).split()
    pairs: list[tuple[str, str, str, float]] = []
    i = 0
    if not tokens:
        raise _fail(name, "an empty claim")
    prev = tokens[0]
    i = 1
    while i < len(tokens):
        op = tokens[i]
        if op not in (">", "~") or i + 1 >= len(tokens):
            raise _fail(name, f"claim '{text}' is not 'A > B [> C ...]', 'A > B + G' or "
                        "'A ~ B +- T' (spaces around each operator)")
        right = tokens[i + 1]
        i += 2
        margin = 0.0
        if i < len(tokens) and tokens[i] in ("+", "+-", "±"):
            if (tokens[i] == "+") != (op == ">") or i + 1 >= len(tokens):
                raise _fail(name, f"claim '{text}': '+ G' follows '>', '+- T' follows '~'")
            try:
                margin = float(tokens[i + 1])
            except ValueError as e:
                raise _fail(name, f"claim '{text}': margin '{tokens[i + 1]}' is not a "
                            "number") from e
            i += 2
        elif op == "~":
            raise _fail(name, f"claim '{text}': '~' needs its tolerance, 'A ~ B +- T'")
        for lab in (prev, right):
            if lab not in labels:
                raise _fail(name, f"claim '{text}' names '{lab}', which is not an arm; "
                            f"allowed: {', '.join(sorted(labels))}")
        pairs.append((prev, op, right, margin))
        prev = right
    if not pairs:
        raise _fail(name, f"claim '{text}' compares nothing")
    return Claim(str(text), pairs)


def _paper_cells(name: str, label: str, value: Any) -> dict[str, float]:
    if value is None:
        return {}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"mean": float(value)}
    if isinstance(value, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                       for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    raise _fail(name, f"arm '{label}': paper must be a number or a mapping of numbers "
                "(mean and per-client cells)")


def parse_spec(name: str, data: Any) -> TableSpec:
    """Check and build a spec from its YAML data; one ConfigError names what is wrong."""
    from fedvl.algorithms.base import parse_params
    from fedvl.registry import ALGORITHMS

    data = _mapping(name, "the file", data)
    _unknown(name, "the file", data, _SPEC_KEYS)
    for key in ("title", "source", "arms", "scales"):
        if key not in data:
            raise _fail(name, f"'{key}' is missing")
    metric = data.get("metric", "mean_accuracy")
    if metric not in METRICS:
        raise _fail(name, f"metric '{metric}' is unknown; allowed: {', '.join(METRICS)}")
    protocol = data.get("protocol", "multi-round")
    run = _mapping(name, "run", data.get("run"))
    arms: dict[str, Arm] = {}
    for label, body in _mapping(name, "arms", data["arms"]).items():
        label = str(label)
        if not _LABEL.fullmatch(label):
            raise _fail(name, f"arm label '{label}' must be lower-case letters, digits and "
                        "_.+- (it names a directory)")
        body = _mapping(name, f"arm '{label}'", body)
        _unknown(name, f"arm '{label}'", body, _ARM_KEYS)
        method = str(body.get("method", label))
        try:
            ALGORITHMS.get(method)
        except KeyError as e:
            raise _fail(name, f"arm '{label}' runs method '{method}', which is not "
                        "registered (`fedvl list` names them)") from e
        arms[label] = Arm(label, method, _mapping(name, f"arm '{label}' args", body.get("args")),
                          _mapping(name, f"arm '{label}' run", body.get("run")),
                          _paper_cells(name, label, body.get("paper")),
                          str(body.get("about", "")))
    if not arms:
        raise _fail(name, "'arms' names no arm")
    scales: dict[str, Scale] = {}
    for sname, body in _mapping(name, "scales", data["scales"]).items():
        body = _mapping(name, f"scale '{sname}'", body)
        _unknown(name, f"scale '{sname}'", body, _SCALE_KEYS)
        seeds = body.get("seeds", [0, 1, 2])
        if (not isinstance(seeds, list) or not seeds
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                           for s in seeds)):
            raise _fail(name, f"scale '{sname}': seeds must be a list of integers >= 0")
        args = _mapping(name, f"scale '{sname}' args", body.get("args"))
        smetric = str(body.get("metric", ""))
        if smetric and smetric not in METRICS:
            raise _fail(name, f"scale '{sname}': metric '{smetric}' is unknown; allowed: "
                        f"{', '.join(METRICS)}")
        for label in args:
            if label not in arms:
                raise _fail(name, f"scale '{sname}' sets args of '{label}', which is not an "
                            f"arm; allowed: {', '.join(arms)}")
        seed_args = _seed_args(name, sname, body.get("seed_args"), seeds, set(arms))
        cost = _mapping(name, f"scale '{sname}' cost", body.get("cost"))
        covered = cost.get("arms", [])
        if not isinstance(covered, list) or not set(covered) <= set(arms):
            raise _fail(name, f"scale '{sname}': cost arms must be a list of the table's arms; "
                        f"allowed: {', '.join(arms)}")
        scales[str(sname)] = Scale(str(sname), list(seeds),
                                   _mapping(name, f"scale '{sname}' run", body.get("run")),
                                   {k: _mapping(name, f"scale '{sname}' args of {k}", v)
                                    for k, v in args.items()},
                                   str(body.get("source", "")),
                                   cost,
                                   str(body.get("recorded", "")), str(body.get("preset", "")),
                                   smetric, seed_args)
    for required in SCALES_REQUIRED:
        if required not in scales:
            raise _fail(name, f"scale '{required}' is missing (every table has one)")
    claims = [parse_claim(name, c, set(arms)) for c in data.get("claims") or []]
    min_seeds = data.get("min_seeds", MIN_SEEDS)
    if not isinstance(min_seeds, int) or min_seeds < 1:
        raise _fail(name, "min_seeds must be an integer >= 1")
    spec = TableSpec(name, str(data["title"]), str(data["source"]), metric, protocol, run, arms,
                     scales, claims, min_seeds, str(data.get("doc", "")),
                     str(data.get("note", "")))
    for sname, sc in scales.items():
        for label, arm in arms.items():
            # Every arm's config and options are valid at every scale and at every seed given
            # its own options: a misspelt option is refused here, not an hour into a table.
            for seed in {0, *sc.seed_args}:
                args = arm_config(spec, sname, label, seed).method_args
                try:
                    parse_params(ALGORITHMS.get(arm.method), args)
                except ConfigError as e:
                    raise _fail(name, f"arm '{label}' at scale '{sname}': {e}") from e
    return spec


def _seed_args(name: str, sname: str, value: Any, seeds: list[int], labels: set[str]
               ) -> dict[int, dict[str, dict[str, Any]]]:
    """A scale's `seed_args` checked: seeds of the scale, arms of the table, option mappings."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for seed, by_arm in _mapping(name, f"scale '{sname}' seed_args", value).items():
        if not isinstance(seed, int) or isinstance(seed, bool) or seed not in seeds:
            raise _fail(name, f"scale '{sname}': seed_args names seed {seed!r}, which is not "
                        f"one of the scale's seeds; allowed: {', '.join(map(str, seeds))}")
        by_arm = _mapping(name, f"scale '{sname}' seed_args of seed {seed}", by_arm)
        for label, args in by_arm.items():
            if label not in labels:
                raise _fail(name, f"scale '{sname}': seed_args of seed {seed} sets '{label}', "
                            f"which is not an arm; allowed: {', '.join(sorted(labels))}")
            by_arm[label] = _mapping(name, f"scale '{sname}' seed_args of {seed}/{label}", args)
        out[seed] = by_arm
    return out


def spec_names() -> list[str]:
    """The names of the tables shipped with fedvl, sorted."""
    files = resources.files(SPEC_PACKAGE)
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def load_spec(name_or_path: str | Path) -> TableSpec:
    """A shipped table by name, or a spec file by path; ConfigError names what is wrong."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        text, name = path.read_text(), path.stem
    else:
        name = str(name_or_path)
        if name not in spec_names():
            raise ConfigError(f"table '{name}' is unknown; allowed: {', '.join(spec_names())} "
                              "or the path of a spec .yaml file")
        text = resources.files(SPEC_PACKAGE).joinpath(f"{name}.yaml").read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"table spec '{name}' is not valid YAML: {e}") from e
    return parse_spec(name, data)


def scale_metric(spec: TableSpec, scale: str) -> str:
    """The metric a scale reports: its own where it names one, else the spec's."""
    return spec.scales[scale].metric or spec.metric


def select_arms(spec: TableSpec, labels: list[str]) -> TableSpec:
    """`spec` with only the arms `labels` (in the spec's order) and the claims among them."""
    unknown = [a for a in labels if a not in spec.arms]
    if unknown or not labels:
        raise ConfigError(f"table '{spec.name}' has no arm(s) {', '.join(unknown) or '(none)'}; "
                          f"allowed: {', '.join(spec.arms)}")
    keep = {k: v for k, v in spec.arms.items() if k in labels}
    claims = [c for c in spec.claims if all(a in keep and b in keep for a, _, b, _ in c.pairs)]
    return replace(spec, arms=keep, claims=claims)


def arm_config(spec: TableSpec, scale: str, label: str, seed: int,
               overrides: dict[str, Any] | None = None) -> RunConfig:
    """The RunConfig of one arm at one scale and seed (`overrides`: the user's run settings)."""
    if scale not in spec.scales:
        raise ConfigError(f"table '{spec.name}' has no scale '{scale}'; allowed: "
                          f"{', '.join(spec.scales)}")
    sc, arm = spec.scales[scale], spec.arms[label]
    pre_run: dict[str, Any] = {}
    pre_args: dict[str, Any] = {}
    if sc.preset:
        if sc.preset not in PRESETS:
            raise _fail(spec.name, f"scale '{scale}': preset '{sc.preset}' is unknown; "
                        f"allowed: {', '.join(sorted(PRESETS))}")
        pre_run = {k: v for k, v in PRESETS[sc.preset].items() if k != "method"}
        pre_run.update(preset_run_args(sc.preset, arm.method))
        pre_args = preset_method_args(sc.preset, arm.method)
    values: dict[str, Any] = {}
    # The preset's per-method budgets and rounds beat the spec's shared settings and yield to
    # what the scale, the arm and the user set.
    # Under them all, the protocol's own settings (as `fedvl bench --protocol` gives them).
    under = protocol_run_defaults(spec.protocol)
    for layer in (under, spec.run, pre_run, sc.run, arm.run, overrides or {}):
        # Model options merge key by key: a scale's width keeps the spec's norm.
        models = {**values.get("model_args", {}), **layer.get("model_args", {})}
        values.update(layer)
        if models:
            values["model_args"] = models
    args = {**pre_args, **arm.args, **sc.args.get(label, {}),
            **sc.seed_args.get(seed, {}).get(label, {})}
    try:
        return validate(from_dict({**values, "method": arm.method, "method_args": args,
                                   "seed": seed}))
    except ConfigError as e:
        raise _fail(spec.name, f"arm '{label}' at scale '{scale}': {e}") from e


def seed_value(summary: dict[str, Any], metric: str) -> float | None:
    """One run's value of `metric` (a fraction), or None where the run does not report it."""
    if metric == "best_accuracy":
        curve = summary.get("accuracy_curve")
        return max(a for _, a in curve) if curve else None
    if metric == "best_global_test_accuracy":
        run_dir = summary.get("run_dir")
        path = Path(run_dir) / "metrics.jsonl" if run_dir else None
        if path is None or not path.is_file():
            return None
        vals = [json.loads(line).get("global_test_accuracy")
                for line in path.read_text().splitlines() if line.strip()]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None
    value = summary.get(metric)
    return float(value) if isinstance(value, (int, float)) else None


def summaries(comp: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """Arm label -> {seed: the run's summary.json} for the finished runs of a comparison."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for label, entry in comp["methods"].items():
        runs: dict[int, dict[str, Any]] = {}
        for seed, run_dir in zip(entry["seeds"], entry["runs"]):
            path = Path(run_dir) / "summary.json"
            if path.is_file():
                summary = json.loads(path.read_text())
                summary.setdefault("run_dir", run_dir)
                runs[int(seed)] = summary
        out[label] = runs
    return out


def per_seed(runs_by_arm: dict[str, dict[int, dict[str, Any]]], metric: str
             ) -> dict[str, dict[int, float]]:
    """Arm label -> {seed: metric in %} from the finished runs' summaries (`summaries`)."""
    out: dict[str, dict[int, float]] = {}
    for label, runs in runs_by_arm.items():
        vals = {seed: seed_value(s, metric) for seed, s in runs.items()}
        out[label] = {seed: 100.0 * v for seed, v in vals.items() if v is not None}
    return out


def per_client(runs_by_arm: dict[str, dict[int, dict[str, Any]]], metric: str
               ) -> dict[str, dict[str, float]]:
    """Arm label -> {client: mean over seeds in %} of the metric's per-client counterpart."""
    key = PER_CLIENT.get(metric, "per_client_accuracy")
    out: dict[str, dict[str, float]] = {}
    for label, runs in runs_by_arm.items():
        cells = [s[key] for s in runs.values() if isinstance(s.get(key), dict)]
        if cells:
            out[label] = {c: 100.0 * float(np.mean([cell[c] for cell in cells]))
                          for c in cells[0] if all(c in cell for cell in cells)}
    return out


def _stat(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
            "n": int(len(a))}


def evaluate_claims(spec: TableSpec, values: dict[str, dict[int, float]]
                    ) -> list[dict[str, Any]]:
    """Each claim: holds, fails or not enough seeds, with every pair's paired difference."""
    out = []
    for claim in spec.claims:
        pairs, status = [], "holds"
        for a, op, b, margin in claim.pairs:
            seeds = sorted(set(values.get(a, {})) & set(values.get(b, {})))
            diffs = [values[a][s] - values[b][s] for s in seeds]
            entry: dict[str, Any] = {"a": a, "op": op, "b": b, "margin": margin,
                                     "seeds": seeds}
            if len(seeds) < spec.min_seeds:
                entry["status"] = "not enough seeds"
            else:
                d = _stat(diffs)
                ok = d["mean"] > margin if op == ">" else abs(d["mean"]) <= margin
                entry.update(difference=d, per_seed=diffs,
                             status="holds" if ok else "fails")
            pairs.append(entry)
        statuses = {p["status"] for p in pairs}
        if "fails" in statuses:
            status = "fails"
        elif "not enough seeds" in statuses:
            status = "not enough seeds"
        out.append({"claim": claim.text, "status": status, "pairs": pairs})
    return out


def table_rows(spec: TableSpec, comp: dict[str, Any], values: dict[str, dict[int, float]],
               clients: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per arm: the metric's mean ± std over seeds (`values`), the paper's cell and the
    per-client cells (`clients`, from `per_client`)."""
    rows = []
    for label, arm in spec.arms.items():
        entry = comp["methods"].get(label)
        vals = list(values.get(label, {}).values())
        row: dict[str, Any] = {"arm": label, "method": arm.method, "about": arm.about,
                               "value": _stat(vals) if vals else None,
                               "paper": arm.paper.get("mean")}
        if label in clients:
            row["per_client"] = clients[label]
        if entry:
            row["bytes_up"], row["bytes_down"] = entry["bytes_up"], entry["bytes_down"]
            row["seconds"] = entry["wall_seconds"]["mean"]
            if entry.get("setup_seconds"):
                row["setup_seconds"] = entry["setup_seconds"]["mean"]
            if entry.get("epsilon_range"):
                row["epsilon_range"] = entry["epsilon_range"]
            if entry.get("rejected_replies"):
                row["rejected_replies"] = entry["rejected_replies"]
        row["paper_per_client"] = {k: v for k, v in arm.paper.items() if k != "mean"}
        rows.append(row)
    return rows


def rejected_note(counts: dict[str, int]) -> str:
    """The warning under a table whose runs had replies the server rejected."""
    named = ", ".join(f"{label} {n}" for label, n in counts.items() if n)
    return (f"**Replies rejected** (over all seeds: {named}). An honest run has none: each "
            "left its client out of a round, so these rows are not the method's numbers; "
            "each run's summary.json `rejected_replies` says why.")


def epsilon_cell(entry: dict[str, Any]) -> str:
    """'ε lo–hi' over clients and seeds (one value when they agree; — without DP)."""
    rng = entry.get("epsilon_range")
    if not rng:
        return "—"
    lo, hi = (f"{v:.3g}" for v in rng)
    return lo if lo == hi else f"{lo}–{hi}"


def _cell(v: float | None, digits: int = 2) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def render(spec: TableSpec, scale: str, command: str, rows: list[dict[str, Any]],
           claims: list[dict[str, Any]]) -> str:
    """The reproduced table as Markdown: ours beside the paper's, then every claim's verdict."""
    sc, metric = spec.scales[scale], scale_metric(spec, scale)
    lines = [f"# {spec.title}", "", f"`{command}`", "",
             f"Paper: {spec.source}. Scale `{scale}`" + (f" ({sc.source})" if sc.source else "")
             + f"; metric `{metric}` in %, mean ± std over seeds.", ""]
    clients: list[str] = []
    for r in rows:
        for c in r.get("per_client", {}):
            if c not in clients:
                clients.append(c)
    about = any(r.get("about") for r in rows)
    dp = any(r.get("epsilon_range") for r in rows)
    setup = any("setup_seconds" in r for r in rows)
    head = ["arm", *(["what it changes"] if about else []), "method", *clients, "ours",
            "seeds", "paper", "ours − paper", *(["ε (clients, seeds)"] if dp else []),
            "MiB up", "MiB down", "s / run", *(["setup s"] if setup else [])]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        v = r["value"]
        ours = "—" if v is None else (f"{v['mean']:.2f} ± {v['std']:.2f}" if v["n"] > 1
                                      else f"{v['mean']:.2f}")
        gap = None if v is None or r["paper"] is None else v["mean"] - r["paper"]
        per = r.get("per_client", {})
        pp = r.get("paper_per_client", {})
        cells = [_cell(per.get(c)) + (f" ({pp[c]:g})" if c in pp else "") for c in clients]
        lines.append("| " + " | ".join([
            r["arm"], *([r.get("about") or "—"] if about else []), r["method"], *cells, ours,
            str(0 if v is None else v["n"]),
            _cell(r["paper"]), _cell(gap), *([epsilon_cell(r)] if dp else []),
            _cell(r["bytes_up"] / 2**20 if "bytes_up" in r else None),
            _cell(r["bytes_down"] / 2**20 if "bytes_down" in r else None),
            _cell(r.get("seconds"), 1), *([_cell(r.get("setup_seconds"), 1)] if setup else [])
        ]) + " |")
    words = PER_CLIENT_WORDS[PER_CLIENT.get(metric, "per_client_accuracy")]
    lines += ["", f"Per-client cells: {words}, mean over seeds"
              + (" (the paper's, where it gives one)." if any(r.get("paper_per_client")
                                                          for r in rows) else ".")]
    if any(r.get("rejected_replies") for r in rows):
        lines += ["", rejected_note({r["arm"]: r.get("rejected_replies", 0) for r in rows})]
    if claims:
        lines += ["", "| claim | verdict | paired difference (points) |", "|---|---|---|"]
        for c in claims:
            detail = "; ".join(
                f"{p['a']} − {p['b']}: " + (
                    f"{p['difference']['mean']:+.2f} ± {p['difference']['std']:.2f} "
                    f"({len(p['seeds'])} seeds)" if "difference" in p
                    else f"{len(p['seeds'])} seed(s), {spec.min_seeds} needed")
                for p in c["pairs"])
            lines.append(f"| {c['claim']} | {c['status']} | {detail} |")
    if spec.note:
        lines += ["", spec.note.strip()]
    return "\n".join(lines) + "\n"


def cost_words(scale: Scale, arms: int) -> str:
    """What a scale of a table of `arms` arms costs, from its spec: measured or estimated
    seconds (for the arms the cost covers, when not all), or 'not measured'."""
    cost = scale.cost
    if not cost.get("seconds"):
        return "not measured"
    hours = float(cost["seconds"]) / 3600
    how = "measured" if cost.get("measured") else "estimated"
    covered = cost.get("arms")
    part = f" for {len(covered)} of {arms} arms" if covered and len(covered) < arms else ""
    where = cost.get("device", "")
    return f"{hours:.1f} h {how}{part}" + (f" on {where}" if where else "")

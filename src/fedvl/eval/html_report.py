"""`fedvl report PATH`: one self-contained HTML page (and its figures) for a run or a bench folder.

PATH is a run directory (`summary.json` in it) or a `fedvl bench` directory
(`METHOD/seedN/summary.json`). The page shows, each only where the runs hold the data: the
comparison table (with the paper reference when the bench had one), accuracy over rounds with a
± std band over seeds, accuracy against cumulative bytes, bytes per round by message kind, final
per-client accuracy, the intra/inter accuracy matrix of per-client models, the runs' image grids,
the upload audit (each client's largest |r| of an upload with its private images, per round,
and what its guard withheld), where each round's time went (stacked by phase), and the config
and provenance. Figures are written as PNG and SVG
beside `report.html`, which embeds the PNGs (base64) so the file opens from disk with no
network.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedvl.config import load_yaml
from fedvl.core.audit import DEFAULT_GUARD
from fedvl.engine.recorder import CONFIG, SUMMARY, read_metrics
from fedvl.eval import plots
from fedvl.eval.comparison import comparison_notes, comparison_tables, summarize
from fedvl.timing import PHASES

REPORT = "report.html"
FIGURES = "report-figures"
TEMPLATE = "report.html.j2"


@dataclass
class Figure:
    """One figure of the report: its caption and the files it was written to."""

    name: str
    caption: str
    png: Path
    svg: Path
    small: bool = False


@dataclass
class Runs:
    """The finished runs under PATH, grouped by method (seed order)."""

    root: Path
    by_method: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    dirs: dict[str, list[Path]] = field(default_factory=dict)
    reference: dict[str, Any] | None = None
    single: bool = False


def find_runs(path: str | Path) -> Runs:
    """The run summaries under `path` (one run directory, or a bench directory of them)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"report: '{root}' is not a directory")
    if (root / SUMMARY).is_file():
        s = _load_summary(root / SUMMARY)
        return Runs(root, {s["method"]: [s]}, {s["method"]: [root]}, single=True)
    found = sorted(root.glob(f"*/*/{SUMMARY}"))
    if not found:
        raise FileNotFoundError(
            f"report: '{root}' is neither a run directory (with {SUMMARY}) nor a fedvl bench "
            f"directory (with METHOD/seedN/{SUMMARY})")
    runs = Runs(root)
    comp_file = root / "comparison.json"
    order: list[str] = []
    if comp_file.is_file():
        comp = json.loads(comp_file.read_text())
        runs.reference = comp.get("reference") or None
        order = list(comp.get("methods", {}))
    pairs = [(f.parent.parent.name, f.parent) for f in found]
    methods = [m for m in order if any(p == m for p, _ in pairs)]
    methods += sorted({m for m, _ in pairs} - set(methods))
    for m in methods:
        dirs = sorted((d for p, d in pairs if p == m), key=_seed_key)
        runs.by_method[m] = [_load_summary(d / SUMMARY) for d in dirs]
        runs.dirs[m] = dirs
    return runs


def _seed_key(d: Path) -> tuple[int, str]:
    """Sort seed directories numerically (seed10 after seed9)."""
    tail = d.name.removeprefix("seed")
    return (int(tail), "") if tail.isdigit() else (1 << 30, d.name)


def _load_summary(path: Path) -> dict[str, Any]:
    """A summary.json, or one clear error naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"report: '{path}' is not a readable summary ({e})") from e
    if not isinstance(data, dict) or "per_client_accuracy" not in data or "method" not in data:
        raise ValueError(f"report: '{path}' is not a fedvl run summary (no method / "
                         "per_client_accuracy)")
    return data


def _comparison(runs: Runs) -> dict[str, Any]:
    """Seed means of every method, computed afresh from the summaries found."""
    first = runs.dirs[next(iter(runs.dirs))][0]
    base = load_yaml(first / CONFIG)
    comp = summarize(base, runs.by_method, runs.reference)
    if runs.single:
        comp["benchmark"] = f"{comp['benchmark']} ({next(iter(runs.by_method))}, one run)"
    return comp


def make_figures(runs: Runs, comp: dict[str, Any], out: Path) -> list[Figure]:
    """Draw every figure the runs have data for into `out`; return them in page order."""
    out.mkdir(parents=True, exist_ok=True)
    figs: list[Figure] = []

    def add(name: str, caption: str, fig: Any, small: bool = False) -> None:
        png, svg = plots.save(fig, out / name, ("png", "svg"))
        figs.append(Figure(name, caption, png, svg, small))

    title = comp["benchmark"]
    series = {m: [s.get("accuracy_curve") or [] for s in ss] for m, ss in runs.by_method.items()}
    if any(c for cs in series.values() for c in cs):
        add("accuracy_rounds", "Mean client accuracy over rounds (mean ± std over seeds).",
            plots.accuracy_over_rounds(series, title))
    for m, ss in runs.by_method.items():
        per_client: dict[str, list[list[list[float]]]] = {}
        for s in ss:
            for c, curves in _per_client_curves(s).items():
                per_client.setdefault(c, []).extend(curves)
        if per_client:
            name = "accuracy_rounds_per_client" + ("" if runs.single else f"_{m}")
            add(name, f"{m}: each client's accuracy over rounds (mean ± std over seeds).",
                plots.accuracy_over_rounds(per_client, f"{title}: {m}", "client accuracy (%)"),
                small=not runs.single)
    curves = {m: e["accuracy_vs_bytes"] for m, e in comp["methods"].items()
              if e.get("accuracy_vs_bytes")}
    if curves:
        add("accuracy_vs_bytes", "Accuracy against cumulative bytes exchanged (seed mean).",
            plots.accuracy_vs_bytes(curves, title))
    per_kind = {m: _bytes_per_round_by_kind(e) for m, e in comp["methods"].items()}
    if any(per_kind.values()):
        add("bytes_by_kind", "Bytes per round by message kind (all directions; total over the "
            "run divided by its rounds).", plots.bytes_by_kind(per_kind, title))
    bars = {m: {c: (v["mean"], v["std"]) for c, v in e["per_client_accuracy"].items()}
            for m, e in comp["methods"].items()}
    add("per_client_accuracy", "Final accuracy of each client on its own test set "
        "(mean, error bar: std over seeds).", plots.per_client_bars(bars, title))
    for m, ss in runs.by_method.items():
        mats = [s["cross_accuracy"] for s in ss if s.get("cross_accuracy")]
        if mats and len(mats) == len(ss):
            clients = list(ss[0]["per_client_accuracy"])
            add(f"cross_accuracy_{m}", f"{m}: accuracy of each client's model (row) on each "
                f"client's test set (column); diagonal = intra, off-diagonal = inter "
                f"(mean over {len(mats)} seed(s)).",
                plots.cross_heatmap(np.mean(np.asarray(mats, dtype=float), axis=0).tolist(),
                                    clients, m), small=True)
    for m, dirs in runs.dirs.items():
        audit = _audit_entries(runs.by_method[m][0])
        if audit:
            curves: dict[str, list[list[float]]] = {}
            for a in audit:
                curves.setdefault(a["client"], []).append([a["round"], a["max_corr"]])
            guard = _guard(dirs[0])
            name = "upload_audit" + ("" if runs.single else f"_{m}")
            add(name, f"{m} ({dirs[0].name}): each client's largest |Pearson r| between an "
                f"image-shaped upload and its private images, per round; above the guard "
                f"({guard:g}) the upload was withheld.",
                plots.upload_audit(curves, guard, f"{title}: {m}"), small=not runs.single)
    for m, dirs in runs.dirs.items():
        rows = _phase_rows(runs.by_method[m][0])
        if rows:   # runs recorded before the timing keys existed have none
            name = "time_by_phase" + ("" if runs.single else f"_{m}")
            add(name, f"{m} ({dirs[0].name}): where each round's time went (seconds: client "
                f"synthesis and training, server synthesis and training, evaluation, other).",
                plots.time_by_phase(rows, f"{title}: {m}"), small=not runs.single)
    return figs


def _phase_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """A summary's `round_time_by_phase` entries that have its form (others are skipped)."""
    return [r for r in summary.get("round_time_by_phase") or []
            if isinstance(r, dict) and isinstance(r.get("round"), int)
            and all(isinstance(r.get(p, 0.0), int | float) for p in PHASES)]


def _audit_entries(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """A summary's `upload_audit` entries that have the audit's form (others are skipped)."""
    out = []
    for a in summary.get("upload_audit") or []:
        if (isinstance(a, dict) and isinstance(a.get("round"), int)
                and isinstance(a.get("max_corr"), int | float)
                and isinstance(a.get("client"), str)):
            out.append({"round": a["round"], "client": a["client"],
                        "max_corr": float(a["max_corr"]), "tensor": str(a.get("tensor", "")),
                        "withheld": a.get("withheld") is True})
    return out


def _guard(run_dir: Path) -> float:
    """The run's --upload-guard (its config.yaml; the default when the file has none)."""
    try:
        return float(load_yaml(run_dir / CONFIG).upload_guard)
    except (OSError, ValueError):
        return DEFAULT_GUARD


def _upload_audit(runs: Runs) -> list[dict[str, Any]]:
    """Each run's upload audit as a table: per client, the rounds audited, the largest |r|
    (its round and tensor) and the rounds whose upload the guard withheld."""
    out = []
    for m, dirs in runs.dirs.items():
        for d, s in zip(dirs, runs.by_method[m], strict=True):
            per: dict[str, list[dict[str, Any]]] = {}
            for a in _audit_entries(s):
                per.setdefault(a["client"], []).append(a)
            if not per:
                continue
            rows = []
            for client, items in per.items():
                top = max(items, key=lambda a: a["max_corr"])
                withheld = [str(a["round"]) for a in items if a["withheld"]]
                rows.append([client, str(len(items)), f"{top['max_corr']:.4f}", str(top["round"]),
                             top["tensor"], ", ".join(withheld) or "none"])
            out.append({"caption": f"{m} · {d.name}: upload guard {_guard(d):g}", "rows": rows})
    return out


def _per_client_curves(summary: dict[str, Any]) -> dict[str, list[list[list[float]]]]:
    """{client: [curve]} from a run's metrics.jsonl (empty when it has none)."""
    out: dict[str, list[list[float]]] = {}
    for rec in read_metrics(summary.get("run_dir", "")) if summary.get("run_dir") else []:
        for c, a in (rec.get("per_client_accuracy") or {}).items():
            out.setdefault(c, []).append([rec["round"], a])
    return {c: [curve] for c, curve in out.items()}


def _bytes_per_round_by_kind(entry: dict[str, Any]) -> dict[str, float]:
    """{kind: bytes per round, all directions} of one method's comparison entry."""
    rounds = entry.get("rounds") or 0
    if not rounds:
        return {}
    return {k: sum(v.values()) / rounds for k, v in (entry.get("bytes_by_kind") or {}).items()
            if sum(v.values())}


def _images(runs: Runs) -> list[dict[str, str]]:
    """The PNG grids the runs wrote (first seed of each method), as embeddable entries."""
    out = []
    for m, dirs in runs.dirs.items():
        d = dirs[0]
        for png in sorted(d.glob("*.png")):
            if ".tmp." in png.name or png.name == "privacy_roc.png":
                continue
            out.append({"caption": f"{m} · {d.name} · {png.name}", "data": _data_uri(png)})
    return out


def _privacy(runs: Runs) -> list[dict[str, Any]]:
    """The membership-inference results (`fedvl privacy`) found in the runs' directories."""
    out = []
    for m, dirs in runs.dirs.items():
        for d in dirs:
            f = d / "privacy.json"
            if not f.is_file():
                continue
            res = json.loads(f.read_text())
            rows = [[name, f"{a['auc']:.4f}", f"{a['tpr_at_0.1%_fpr']:.4f}",
                     f"{a['tpr_at_1%_fpr']:.4f}"] for name, a in res["attacks"].items()]
            roc = d / "privacy_roc.png"
            out.append({"caption": f"{m} · {d.name}: client {res['client']}, "
                                   f"{res['shadows']} shadow models",
                        "rows": rows, "roc": _data_uri(roc) if roc.is_file() else ""})
    return out


def _data_uri(png: Path) -> str:
    """A PNG file as a data: URI (so the page needs no other file)."""
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def _provenance(runs: Runs) -> list[tuple[str, str]]:
    """Where the numbers come from: versions, device, seeds, method options, run folders."""
    rows = []
    for m, ss in runs.by_method.items():
        s = ss[0]
        rows.append((m, f"seeds {[x.get('seed') for x in ss]}; method args "
                        f"{json.dumps(s.get('method_args', {}))}; model {s.get('model')}; "
                        f"device {s.get('device')}; threads {s.get('threads')}; fedvl "
                        f"{s.get('fedvl_version')}"))
    for m, dirs in runs.dirs.items():
        rows.append((f"{m} runs", ", ".join(str(d) for d in dirs)))
    return rows


def render_html(runs: Runs, comp: dict[str, Any], figs: list[Figure]) -> str:
    """The report page (the Jinja2 template filled in; figures and images embedded)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)
    first = runs.dirs[next(iter(runs.dirs))][0]
    return env.get_template(TEMPLATE).render(
        title=comp["benchmark"],
        tables=comparison_tables(comp),
        notes=comparison_notes(comp),
        figures=[{"caption": f.caption, "name": f.name, "data": _data_uri(f.png),
                  "small": f.small} for f in figs],
        images=_images(runs),
        privacy=_privacy(runs),
        upload_audit=_upload_audit(runs),
        config=(first / CONFIG).read_text() if (first / CONFIG).is_file() else "",
        provenance=_provenance(runs),
        reference=comp.get("reference") or {},
    )


def write_report(path: str | Path, out: str | Path | None = None) -> Path:
    """Write `report.html` (and its figures) for the run or bench directory `path`."""
    runs = find_runs(path)
    dest = Path(out) if out is not None else runs.root
    dest.mkdir(parents=True, exist_ok=True)
    comp = _comparison(runs)
    figs = make_figures(runs, comp, dest / FIGURES)
    html = render_html(runs, comp, figs)
    tmp = dest / f"{REPORT}.{os.getpid()}.tmp"
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, dest / REPORT)
    return dest / REPORT

"""What the experiment commands share: the run flags, config resolution and the summary table."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from fedvl.config import (
    PRESETS,
    ConfigError,
    RunConfig,
    from_dict,
    load_yaml,
    preset_method_args,
    preset_run_args,
    yaml_problem,
)
from fedvl.defaults import DEFAULT_GUARD
from fedvl.options import add_flags, option_fields, shown, values_from_args


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The experiment options shared by run-like commands: one flag per RunConfig field."""
    p.add_argument("--config", help="YAML file with settings (flags override it)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="smoke: a quick try (2 rounds, 100 training and 100 test images per "
                   "client, the method's costly budgets cut: docs/methods.md); quickstart: what "
                   "a bare `fedvl run` runs (FedLGD, reduced distillation budgets); paper: each "
                   "method's published budgets and rounds, ConvNet width 128 (for a GPU); the "
                   "config file and flags override it")
    add_flags(p, RunConfig)
    p.add_argument("--width", type=int, help="model width (shortcut for --model-arg width=N)")
    p.add_argument("--depth", type=int, help="model depth (shortcut)")
    p.add_argument("--norm", help="model normalisation (shortcut)")
    p.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, repeatable (e.g. mu=0.01)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="model option, repeatable")


def parse_kv(items: list[str], what: str) -> dict[str, Any]:
    """`KEY=VALUE` strings -> {key: YAML-parsed value}; a bad item is one ConfigError."""
    out = {}
    for item in items:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise ConfigError(f"{what} {shown(item)} must look like KEY=VALUE")
        try:
            out[k.strip()] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise ConfigError(f"{what} {shown(item)}: the value is not valid YAML "
                              f"({yaml_problem(e)})") from e
        except (ValueError, RecursionError) as e:  # an int past Python's digits; deep nesting
            raise ConfigError(f"{what} {shown(item)}: the value cannot be read "
                              f"({type(e).__name__})") from e
    return out


def config_from_args(args: argparse.Namespace, base: RunConfig | None = None,
                     under: dict[str, Any] | None = None) -> RunConfig:
    """Defaults (or `base`) < `under` (a command's own defaults, e.g. `fedvl bench --protocol
    one-shot`'s local epochs) < --preset (and the method's part of it) < --config YAML < flags."""
    preset = getattr(args, "preset", None)
    if preset and base is not None:
        raise ConfigError("--preset sets up a new run; a resumed run keeps its config.yaml")
    if under:
        base = from_dict(dict(under), base)
    data = values_from_args(args, RunConfig)
    model_args = parse_kv(args.model_arg, "--model-arg")
    for k in ("width", "depth", "norm"):
        if getattr(args, k) is not None:
            model_args[k] = getattr(args, k)
    if model_args:
        data["model_args"] = model_args

    def layered(start: RunConfig | None) -> RunConfig:
        cfg = load_yaml(args.config, start) if args.config else (start or RunConfig())
        given = dict(data)
        if args.method_arg:
            given["method_args"] = {**cfg.method_args,
                                    **parse_kv(args.method_arg, "--method-arg")}
        if "method" in given and given["method"] != cfg.method and not args.method_arg:
            given.setdefault("method_args", {})
        return from_dict(given, cfg)

    if not preset:
        return layered(base)
    cfg = layered(from_dict(dict(PRESETS[preset]), base))
    # The method is known only now (flags > YAML > preset); its run settings (the paper's
    # rounds) sit with the preset's, under the YAML and the flags: layered again.
    if run := preset_run_args(preset, cfg.method):
        cfg = layered(from_dict({**PRESETS[preset], **run}, base))
    # The method's own cuts, under any option the config file or a flag sets.
    return dataclasses.replace(cfg, method_args={**preset_method_args(preset, cfg.method),
                                                 **cfg.method_args})


# Config fields set by a repeatable flag rather than one of their own.
_FLAG_OF = {"method_args": "--method-arg", "model_args": "--model-arg (or --width/--depth/--norm)"}


def resumed_config(args: argparse.Namespace, run_dir: str | Path, extend: bool = True
                   ) -> RunConfig:
    """The config a `--resume run_dir` continues with: the run's config.yaml, `--rounds` maybe
    raised (`extend`), every other flag equal to what it records or refused.

    A flag differing from the run's settings would silently not apply to the rounds already
    run, so it is one ConfigError naming it; flags equal to the stored value are accepted.
    """
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"'{run_dir}' is not a run directory (no config.yaml)")
    stored = load_yaml(path)
    if getattr(args, "out", None) and Path(args.out) != Path(run_dir):
        raise ConfigError(f"--out {shown(args.out)} differs from --resume {shown(str(run_dir))}: "
                          "a resumed run writes to its own directory; drop --out")
    asked = config_from_args(args, stored)
    for f in option_fields(RunConfig):
        old, new = getattr(stored, f.name), getattr(asked, f.name)
        if old == new or (f.name == "rounds" and extend):
            continue
        flag = _FLAG_OF.get(f.name, "--" + f.name.replace("_", "-"))
        only = ("only --rounds may change (it extends the run)" if extend else
                "this command resumes a run as recorded, with no setting changed")
        raise ConfigError(f"--resume continues '{run_dir}' with the settings of its config.yaml: "
                          f"{flag} {shown(new, 60)} differs from its {shown(old, 60)}; {only}")
    return asked


def print_summary(summary: dict[str, Any], preset: str | None = None) -> None:
    """Per-client accuracy table with the unweighted mean (`preset`: the run's `--preset`)."""
    from rich.console import Console
    from rich.table import Table

    # The heading is its own line: as a table title rich wraps it to the (narrow) table width,
    # mid-phrase.
    heading = (f"{summary['method']} on {summary['benchmark']} (seed {summary['seed']}, "
               f"{summary['rounds']} rounds)")
    table = Table()
    table.add_column("client")
    table.add_column("accuracy", justify="right")
    glob = summary.get("global_accuracy")
    inter = summary.get("inter_accuracy")
    if glob:
        table.add_column("own model on all clients", justify="right")
    if inter:
        table.add_column("on the other clients (inter)", justify="right")
    for name, acc in summary["per_client_accuracy"].items():
        row = [name, f"{100 * acc:.2f}%"]
        if glob:
            row.append(f"{100 * glob[name]:.2f}%")
        if inter:
            row.append(f"{100 * inter[name]:.2f}%")
        table.add_row(*row)
    mean_row = ["mean (unweighted)", f"{100 * summary['mean_accuracy']:.2f}%"]
    if glob:
        mean_row.append(f"{100 * summary['mean_global_accuracy']:.2f}%")
    if inter:
        mean_row.append(f"{100 * summary['mean_inter_accuracy']:.2f}%")
    table.add_row(*mean_row, style="bold")
    if "worst_accuracy" in summary:
        table.add_row("worst client", f"{100 * summary['worst_accuracy']:.2f}%")
    console = Console()
    console.print(heading, style="bold", highlight=False, overflow="ignore", crop=False)
    console.print(table)
    if "holdout_accuracy" in summary:
        how = ("a peer's model fine-tuned" if "holdout_source" in summary
               else "the global model")
        cells = ", ".join(f"{n} {100 * a:.2f}%" for n, a in summary["holdout_accuracy"].items())
        console.print(f"unseen clients ({how}): mean "
                      f"{100 * summary['mean_holdout_accuracy']:.2f}% ({cells})",
                      highlight=False, soft_wrap=True)
    mb = 1024 * 1024
    peer = summary.get("bytes_peer", 0)
    console.print(f"communication: up {summary['bytes_up'] / mb:.2f} MiB, down "
                  f"{summary['bytes_down'] / mb:.2f} MiB"
                  + (f", peer-to-peer {peer / mb:.2f} MiB" if peer else "")
                  + f"; wall {summary['wall_seconds']:.1f} s")
    from fedvl.timing import shares

    if spent := shares(summary.get("time_by_phase") or {}):   # absent in older summaries
        console.print(f"time: {spent}", highlight=False, soft_wrap=True)
    for line in what_left_the_clients(summary, preset):
        console.print(line, highlight=False)
    if rejected := summary.get("rejected_replies"):
        first = rejected[0]
        console.print(f"rejected replies: {len(rejected)} (the first: round {first['round']}, "
                      f"{first['client']}: {first['reason']}); an honest run has none, see "
                      "summary.json", style="bold red", highlight=False, markup=False,
                      soft_wrap=True)
    console.print(f"run directory: {summary['run_dir']}")


# Kinds that are images: what a reader of "what left the clients" looks for first.
_IMAGE_KINDS = ("synthetic_images", "mean_images", "raw_images")


def _size(n: float) -> str:
    """Bytes in the unit that reads best (B, KiB, MiB)."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def what_left_the_clients(summary: dict[str, Any], preset: str | None = None) -> list[str]:
    """Lines on what the clients sent (kinds and bytes), the upload audit, and the command that
    compares the run with FedAvg on the same data (under the same `preset`)."""
    by_kind = summary.get("bytes_by_kind", {})
    sent = {k: v.get("up", 0) + v.get("peer", 0) for k, v in by_kind.items()}
    sent = {k: n for k, n in sorted(sent.items(), key=lambda kv: -kv[1]) if n}
    lines = ["sent by the clients: " + (", ".join(f"{k} {_size(n)}" for k, n in sent.items())
                                        or "nothing")]
    if not any(k in sent for k in _IMAGE_KINDS):
        lines[0] += "; no image left any client"
    audit = summary.get("upload_audit") or []
    if audit:
        top = max(audit, key=lambda a: a["max_corr"])
        withheld = sum(1 for a in audit if a.get("withheld"))
        lines.append(f"upload audit: largest |r| with a private image {top['max_corr']:.3f} "
                     f"({top['client']}, round {top['round']}, {top['tensor']}); "
                     + (f"{withheld} upload(s) withheld by the guard" if withheld
                        else "nothing withheld"))
        if not withheld and top["max_corr"] > summary.get("upload_guard", DEFAULT_GUARD):
            lines.append("  above the guard but sent: this setting uploads images that are, "
                         "or start as, private ones, by design (init=real, a coreset; "
                         "docs/reliability.md)")
    method, virtual = summary.get("method", ""), summary.get("dataset_info", {}).get(
        "local_data") == "virtual"
    same = (f"--benchmark {summary.get('benchmark')} --seeds {summary.get('seed')}"
            + (f" --preset {preset}" if preset else ""))
    if method == "fedlgd" or virtual:
        lines.append("clients trained on their local virtual sets; the same with FedAvg: "
                     f"fedvl bench --methods fedavg,{method} --local-data virtual {same}")
    elif method and method != "fedavg":
        lines.append(f"against FedAvg: fedvl bench --methods fedavg,{method} {same}")
    return lines

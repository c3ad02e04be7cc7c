"""Bytes per round and in total for every method, read from the ledgers in comparison results.

  python benchmarks/bytes_table.py benchmarks/results/virtual-digits-ipc10.json \
      benchmarks/results/virtual-digits-ipc10-gpu.json
Writes benchmarks/results/bytes-per-method.json and prints a Markdown table (MiB). The numbers
are the engine's byte ledger (every tensor of every message, counted per kind), averaged over
the seeds of each comparison.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from provenance import provenance

MIB = 2**20


def table(path: Path) -> dict[str, dict[str, object]]:
    """{method: bytes per round / total / per kind} from one comparison result file."""
    data = json.loads(path.read_text())
    rounds = (data.get("scale") or data["config"])["rounds"]
    out: dict[str, dict[str, object]] = {}
    for m, e in data["methods"].items():
        out[m] = {
            "rounds": rounds,
            "per_round": e["bytes_per_round"],
            "total": {"up": e["bytes_up"], "down": e["bytes_down"]},
            "by_kind": e["bytes_by_kind"],
        }
    return out


def render(name: str, rows: dict[str, dict[str, object]]) -> str:
    """One Markdown table: MiB per round and in total, up and down, and the kinds sent."""
    lines = [f"### {name}", "", "| method | MiB/round up | MiB/round down | MiB total up | "
             "MiB total down | kinds (total MiB down) |", "|---|---|---|---|---|---|"]
    for m, r in rows.items():
        per, tot = r["per_round"], r["total"]
        kinds = ", ".join(f"{k} {v['down'] / MIB:.2f}" for k, v in r["by_kind"].items())
        lines.append(f"| {m} | {per['up'] / MIB:.3f} | {per['down'] / MIB:.3f} | "
                     f"{tot['up'] / MIB:.1f} | {tot['down'] / MIB:.1f} | {kinds} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results", nargs="+", help="comparison result JSON files")
    p.add_argument("--out", default="benchmarks/results/bytes-per-method.json")
    a = p.parse_args()
    tables = {Path(f).name: table(Path(f)) for f in a.results}
    Path(a.out).write_text(json.dumps({
        **provenance(),
        "note": "bytes from the engine's ledger, mean over each comparison's seeds",
        "tables": tables}, indent=2))
    for name, rows in tables.items():
        print(render(name, rows))


if __name__ == "__main__":
    main()

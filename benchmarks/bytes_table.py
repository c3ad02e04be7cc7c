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

from provenance import machine, write_result

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
            "total": {"up": e["bytes_up"], "down": e["bytes_down"],
                      **({"peer": e["bytes_peer"]} if e.get("bytes_peer") else {})},
            "by_kind": e["bytes_by_kind"],
        }
        share = synthetic_share(e, rounds)
        if share is not None:
            out[m]["synthetic_upload"] = share
    return out


def synthetic_share(e: dict, rounds: int) -> dict[str, float] | None:
    """Synthetic images uploaded per round (from the int64 label bytes of the first seed's
    ledger) and as a share of all clients' training images (FedVCK Tab. 5/9's p%)."""
    labels = e["bytes_by_kind"].get("synthetic_labels", {}).get("up", 0)
    samples = e.get("train_samples")
    if not labels or not samples:
        return None
    per_round = labels / 8 / rounds
    total = sum(samples.values())
    return {"images_per_round": per_round, "train_images": total,
            "percent_of_train_per_round": 100 * per_round / total}


def render(name: str, rows: dict[str, dict[str, object]]) -> str:
    """One Markdown table: MiB per round and in total, up and down, and the kinds sent."""
    lines = [f"### {name}", "", "| method | MiB/round up | MiB/round down | MiB/round peer | "
             "MiB total up | MiB total down | synthetic up per round | kinds (total MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for m, r in rows.items():
        per, tot = r["per_round"], r["total"]
        kinds = ", ".join(f"{k} {sum(v.values()) / MIB:.2f}" for k, v in r["by_kind"].items())
        syn = r.get("synthetic_upload")
        syn_txt = (f"{syn['images_per_round']:.0f} img ({syn['percent_of_train_per_round']:.1f}"
                   " % of the training images)") if syn else ""
        lines.append(f"| {m} | {per['up'] / MIB:.3f} | {per['down'] / MIB:.3f} | "
                     f"{per.get('peer', 0) / MIB:.3f} | {tot['up'] / MIB:.1f} | "
                     f"{tot['down'] / MIB:.1f} | {syn_txt} | {kinds} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results", nargs="+", help="comparison result JSON files")
    p.add_argument("--out", default="benchmarks/results/bytes-per-method.json")
    a = p.parse_args()
    tables = {Path(f).name: table(Path(f)) for f in a.results}
    write_result(a.out, machine(), {
        "note": "bytes from the engine's ledger, mean over each comparison's seeds",
        "tables": tables})
    for name, rows in tables.items():
        print(render(name, rows))


if __name__ == "__main__":
    main()

"""Plot accuracy against epsilon from a recorded results file of DP arms.

  python benchmarks/plot_epsilon.py benchmarks/results/dp-fedavg-epsilon-cpu.json

The file holds, per arm, its runs' `epsilon_max` and `mean_accuracy` (the recorded
`dp-fedavg-*-cpu.json` files; `fedvl reproduce benchmarks/tables/dp-fedavg-epsilon.yaml`
re-runs the arms). Arms whose runs report an epsilon are points (mean ± std over seeds against
the largest client epsilon, log scale); the clip-only control (epsilon above 1e6) and arms
without DP are horizontal reference lines. Writes the PNG beside the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CLIP_ONLY = 1e6


def main() -> None:
    """Read the results file and write the plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    a = ap.parse_args()
    path = Path(a.results)
    d = json.loads(path.read_text())
    points, lines = [], []
    for name, arm in d["arms"].items():
        eps = [r["epsilon_max"] for r in arm["runs"].values()]
        acc = 100 * arm["mean_accuracy"]["mean"], 100 * arm["mean_accuracy"]["std"]
        if None in eps:
            lines.append((name, *acc))
        elif min(eps) > CLIP_ONLY:
            lines.append((f"clip-only control ({name})", *acc))
        else:
            points.append((max(eps), *acc, name))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    points.sort()
    ax.errorbar([p[0] for p in points], [p[1] for p in points], [p[2] for p in points],
                marker="o", capsize=3, label=d["setting"]["method"] + " (DP)")
    for (x, y, _, name) in points:
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for style, (name, y, _) in zip(("--", ":", "-."), lines, strict=False):
        ax.axhline(y, linestyle=style, color="grey", label=f"{name}: {y:.1f}")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon (largest over clients)")
    ax.set_ylabel("mean client accuracy (%)")
    ax.set_title(f"{d['setting']['benchmark']}, {d['setting']['rounds']} rounds, "
                 f"{len(d['setting']['seeds'])} seeds", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"written: {out}")


if __name__ == "__main__":
    main()

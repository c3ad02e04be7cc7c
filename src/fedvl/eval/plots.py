"""Figures of runs and comparisons (matplotlib, headless): curves, bytes, per-client bars, heatmaps.

Every function takes plain numbers (no run directories), draws one figure and returns it; `save`
writes a figure as PNG and SVG atomically. `fedvl bench` and `fedvl report` share them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def pyplot() -> Any:
    """pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, formats: Sequence[str] = ("png",)) -> list[Path]:
    """Write `fig` as `path` with each suffix in `formats` (atomically) and close it."""
    plt = pyplot()
    written = []
    for fmt in formats:
        final = path.with_suffix(f".{fmt}")
        tmp = final.with_name(f"{final.stem}.{os.getpid()}.tmp.{fmt}")
        fig.savefig(tmp, dpi=120, format=fmt)
        os.replace(tmp, final)
        written.append(final)
    plt.close(fig)
    return written


def accuracy_vs_bytes(curves: dict[str, list[dict[str, Any]]], title: str) -> Any:
    """Each method's seed-mean accuracy against cumulative MiB exchanged (log x-axis).

    Global-test accuracy when every curve has it, mean client accuracy otherwise.
    """
    plt = pyplot()
    key = ("global_test_accuracy" if all("global_test_accuracy" in c[0] for c in curves.values())
           else "mean_accuracy")
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, c in curves.items():
        ax.plot([p["bytes"] / 2**20 for p in c], [100 * p[key] for p in c], marker="o", label=m)
    ax.set_xscale("log")
    ax.set_xlabel("MiB exchanged (up + down + peer, cumulative)")
    ax.set_ylabel(("global test" if key == "global_test_accuracy" else "mean client")
                  + " accuracy (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def accuracy_over_rounds(series: dict[str, list[list[list[float]]]], title: str,
                         ylabel: str = "mean client accuracy (%)") -> Any:
    """Mean over seeds of each method's accuracy per round, with a ± std band.

    `series[name]` holds one `[[round, accuracy], ...]` curve per seed; only rounds every seed
    evaluated are drawn.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curves in series.items():
        per_seed = [{int(r): float(a) for r, a in c} for c in curves if c]
        if not per_seed:
            continue
        rounds = sorted(set.intersection(*(set(c) for c in per_seed)))
        acc = np.array([[100 * c[r] for r in rounds] for c in per_seed])
        mean = acc.mean(axis=0)
        (line,) = ax.plot(rounds, mean, marker="o", markersize=3,
                          label=f"{name} (n={len(per_seed)})")
        if len(per_seed) > 1:
            std = acc.std(axis=0, ddof=1)
            ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # no round 1.5 on a 2-round run
    return finish(fig, ax, "round", ylabel, title)


def bytes_by_kind(per_method: dict[str, dict[str, float]], title: str) -> Any:
    """Stacked bars: MiB per round of each message kind (all directions), one bar per method."""
    plt = pyplot()
    kinds = sorted({k for v in per_method.values() for k in v})
    names = list(per_method)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(names) + 2), 4))
    bottom = np.zeros(len(names))
    for kind in kinds:
        vals = np.array([per_method[m].get(kind, 0.0) / 2**20 for m in names])
        ax.bar(names, vals, bottom=bottom, label=kind)
        bottom += vals
    ax.set_ylabel("MiB per round")
    ax.margins(y=0.1)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def per_client_bars(per_method: dict[str, dict[str, tuple[float, float]]], title: str,
                    ylabel: str = "final accuracy (%)") -> Any:
    """Grouped bars of each client's final accuracy (mean, std error bar) per method."""
    plt = pyplot()
    names = list(per_method)
    clients = list(next(iter(per_method.values()))) if names else []
    width = 0.8 / max(1, len(names))
    x = np.arange(len(clients))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(clients) * max(1, len(names)) / 2 + 2),
                                    4))
    for i, m in enumerate(names):
        mean = [100 * per_method[m][c][0] for c in clients]
        std = [100 * per_method[m][c][1] for c in clients]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, mean, width, yerr=std, label=m,
               capsize=2)
    ax.set_xticks(x, clients, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    # Head room above 100 % for the legend, so it never covers a bar.
    ax.set_ylim(0, 118)
    ax.legend(fontsize="small", loc="upper center", ncols=min(len(names), 6))
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def cross_heatmap(matrix: Sequence[Sequence[float]], clients: Sequence[str], title: str) -> Any:
    """Heatmap of accuracy (%) of client i's model (row) on client j's test set (column)."""
    plt = pyplot()
    m = 100 * np.asarray(matrix, dtype=float)
    n = len(clients)
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * n, 0.8 + 0.6 * n))
    im = ax.imshow(m, vmin=0, vmax=100, cmap="viridis")
    if n <= 12:
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{m[i, j]:.0f}", ha="center", va="center",
                        color="white" if m[i, j] < 60 else "black", fontsize=8)
    ax.set_xticks(range(n), clients, rotation=30, ha="right")
    ax.set_yticks(range(n), clients)
    ax.set_xlabel("test set of client")
    ax.set_ylabel("model of client")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return fig


def mmd_pair(real: Sequence[Sequence[float]], virtual: Sequence[Sequence[float]],
             clients: Sequence[str], title: str) -> Any:
    """Two client x client MMD^2 heatmaps on one colour scale: real data, local virtual data.

    The diagonal is what the caller puts there (e.g. the within-client floor).
    """
    plt = pyplot()
    a, b = np.asarray(real, dtype=float), np.asarray(virtual, dtype=float)
    vmax = max(a.max(), b.max(), 1e-12)
    n = len(clients)
    fig, axes = plt.subplots(1, 2, figsize=(3.0 + 1.6 * n, 1.6 + 0.6 * n), layout="constrained")
    for ax, m, name in ((axes[0], a, "real"), (axes[1], b, "local virtual")):
        im = ax.imshow(m, vmin=0, vmax=vmax, cmap="magma")
        if n <= 10:
            for i in range(n):
                for j in range(n):
                    ax.text(j, i, f"{m[i, j]:.3f}", ha="center", va="center", fontsize=7,
                            color="white" if m[i, j] < 0.6 * vmax else "black")
        ax.set_xticks(range(n), clients, rotation=30, ha="right")
        ax.set_yticks(range(n), clients if ax is axes[0] else [""] * n)
        ax.set_title(f"{title}: {name}")
    fig.colorbar(im, ax=list(axes), fraction=0.046, pad=0.04)
    return fig


def tsne_scatter(emb: np.ndarray, client: np.ndarray, label: np.ndarray, virtual: np.ndarray,
                 clients: Sequence[str]) -> Any:
    """2-D embedding coloured by client (left) and by class (right); virtual points as stars."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    cmap = plt.get_cmap("tab10")
    for ax, key, names in ((axes[0], client, list(clients)),
                           (axes[1], label, [str(k) for k in range(int(label.max()) + 1)])):
        for k, name in enumerate(names):
            for is_v, marker, size in ((False, "o", 6), (True, "*", 60)):
                sel = (key == k) & (virtual == is_v)
                if sel.any():
                    ax.scatter(emb[sel, 0], emb[sel, 1], s=size, marker=marker,
                               color=cmap(k % 10), alpha=0.9 if is_v else 0.4,
                               edgecolors="black" if is_v else "none", linewidths=0.3,
                               label=name if not is_v else None)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.legend(fontsize="x-small", markerscale=2, loc="best")
    axes[0].set_title("t-SNE by client (stars: local virtual data)")
    axes[1].set_title("t-SNE by class (stars: local virtual data)")
    fig.tight_layout()
    return fig


def upload_audit(curves: dict[str, list[list[float]]], guard: float, title: str) -> Any:
    """Each client's largest |Pearson r| of an upload with its private images, per round, and
    the upload guard's threshold (uploads above it are withheld)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for client, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=client)
    from matplotlib.ticker import MaxNLocator

    ax.axhline(guard, color="red", linestyle="--", linewidth=1, label=f"guard {guard:g}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # rounds are whole numbers
    ax.set_ylim(0, 1.05)
    return finish(fig, ax, "round", "largest |r| with a private image", title)


def time_by_phase(rounds: Sequence[dict[str, Any]], title: str) -> Any:
    """Stacked bars: each round's seconds by phase (`fedvl.timing.PHASES`), one bar per round."""
    from matplotlib.ticker import MaxNLocator

    from fedvl.timing import PHASE_WORDS, PHASES

    plt = pyplot()
    x = [int(r["round"]) for r in rounds]
    fig, ax = plt.subplots(figsize=(min(12.0, max(6.0, 0.2 * len(x) + 3)), 4))
    bottom = np.zeros(len(x))
    for phase in PHASES:
        vals = np.array([float(r.get(phase, 0.0)) for r in rounds])
        ax.bar(x, vals, bottom=bottom, label=PHASE_WORDS[phase])
        bottom += vals
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_axisbelow(True)   # the grid behind the bars
    return finish(fig, ax, "round", "seconds", title)


def finish(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str) -> Any:
    """Label a one-axes plot, add its grid and legend, lay it out; returns `fig`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig

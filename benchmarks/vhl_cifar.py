"""FedAvg, FedAvg+VHL (and VFTL) on CIFAR-10 Dirichlet(0.1), 10 clients, 5 per round, CPU scale.

Runs `fedvl bench` (resumable: finished runs are reused) and writes
benchmarks/results/vhl-cifar10.json (or `--result`) with the command, scale, date, machine,
per-method mean ± std (mean client accuracy, global-test accuracy: final, best over the
evaluated rounds and mean over those of the first 10 rounds) and bytes; a PNG grid of the
virtual data goes to the bench directory.

    python benchmarks/vhl_cifar.py --data-dir /work/shared/data --bench-dir runs/vhl-cifar10

With `--lr-decay 0.992 --eval-every 1` it follows the VHL paper's protocol (best global-test
accuracy over rounds, the client learning rate decayed by 0.992 per round); for each of the
pairs (fedavg, vhl), (fedavg, vftl), (vftl, vhl) that ran, the entry holds their difference
paired by seed with a 95 % t interval. VHL's Table 6 control, VFTL beside FedAvg and VHL:
    python benchmarks/vhl_cifar.py ... --methods fedavg,vftl,vhl --label vftl \
        --result benchmarks/results/vftl-cifar10-cpu.json

Extra settings can be compared under another label, e.g. a VHL variant:
    python benchmarks/vhl_cifar.py ... --methods fedavg,vhl --method-arg vhl.alpha=0.5 \
        --label alpha0.5 --bench-dir runs/vhl-cifar10-a05
(the JSON keeps one entry per label).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import time
from pathlib import Path

import numpy as np
import torch
from provenance import command, machine, write_result

from fedvl.cli import main as fedvl_main

RESULT = Path(__file__).resolve().parent / "results" / "vhl-cifar10.json"
# The paper's CIFAR-10 numbers (Table 6, FedAvg column; ResNet-18).
PAPER = {"fedavg": 79.98, "vhl": 87.82, "vftl": 80.38}
# Differences recorded paired by seed, (a, b) as b − a, where both methods ran.
PAIRS = (("fedavg", "vhl"), ("fedavg", "vftl"), ("vftl", "vhl"))
# "At the beginning of training" (VHL Sec. 5.3 on VFTL): the evaluations of rounds 1..EARLY.
EARLY = 10


def _ms(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
            "n": len(a), "values": [float(v) for v in a]}


def global_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(round, 1-based; global-test accuracy) of every evaluated round."""
    points = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if line.strip()]
    return [(int(p["round"]) + 1, float(p["global_test_accuracy"])) for p in points
            if p.get("global_test_accuracy") is not None]


def best_global(run_dir: Path) -> tuple[float, int]:
    """The highest global-test accuracy over the evaluated rounds and its round (1-based)."""
    rnd, acc = max(global_curve(run_dir), key=lambda x: x[1])
    return acc, rnd


def early_global(run_dir: Path) -> float:
    """The mean global-test accuracy of the rounds evaluated among the first `EARLY`."""
    return float(np.mean([acc for rnd, acc in global_curve(run_dir) if rnd <= EARLY]))


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of b − a over paired seeds with its 95 % Student-t interval."""
    from scipy import stats

    d = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    half = (float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
            if len(d) > 1 else float("nan"))
    return {"mean": float(d.mean()), "ci95_low": float(d.mean()) - half,
            "ci95_high": float(d.mean()) + half, "n": len(d), "values": [float(x) for x in d],
            "positive": int((d > 0).sum())}


def collect(bench_dir: Path, methods: list[str]) -> dict:
    """Per-method statistics from the bench's run directories."""
    comp = json.loads((bench_dir / "comparison.json").read_text())
    out = {}
    for m in methods:
        dirs = [Path(d) for d in comp["methods"][m]["runs"]]
        runs = [json.loads((d / "summary.json").read_text()) for d in dirs]
        best = [best_global(d) for d in dirs]
        out[m] = {
            "best_global_test_accuracy": _ms([acc for acc, _ in best]),
            "best_global_test_round": [rnd for _, rnd in best],
            f"early_global_test_accuracy_rounds_1_{EARLY}": _ms([early_global(d) for d in dirs]),
            "global_test_accuracy": _ms([r["global_test_accuracy"] for r in runs]),
            "mean_client_accuracy": _ms([r["mean_accuracy"] for r in runs]),
            "bytes_up": comp["methods"][m]["bytes_up"],
            "bytes_down": comp["methods"][m]["bytes_down"],
            "bytes_by_kind": comp["methods"][m]["bytes_by_kind"],
            "wall_seconds": comp["methods"][m]["wall_seconds"],
            "accuracy_curve_seed0": runs[0].get("accuracy_curve"),
            "seeds": comp["methods"][m]["seeds"],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default="/work/shared/data")
    p.add_argument("--bench-dir", default="runs/vhl-cifar10")
    p.add_argument("--methods", default="fedavg,vhl")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--train-cap", type=int, default=500,
                   help="training images kept per client (class-stratified)")
    p.add_argument("--test-cap", type=int, default=200)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--lr-decay", type=float, default=1.0,
                   help="per-round client learning-rate factor (the VHL paper: 0.992)")
    p.add_argument("--method-arg", action="append", default=[])
    p.add_argument("--label", default="main", help="key of this comparison in the JSON")
    p.add_argument("--note", default="")
    p.add_argument("--result", default=str(RESULT), help="results file to write")
    a = p.parse_args()
    argv = ["bench", "--benchmark", "cifar10-dirichlet", "--data-dir", a.data_dir,
            "--num-clients", "10", "--alpha", "0.1", "--client-ratio", "0.5",
            "--train-cap", str(a.train_cap), "--test-cap", str(a.test_cap),
            "--width", str(a.width), "--rounds", str(a.rounds), "--eval-every",
            str(a.eval_every), "--lr-decay", str(a.lr_decay), "--threads", "1",
            "--methods", a.methods, "--seeds", a.seeds,
            "--out", a.bench_dir, "--quiet"]
    for item in a.method_arg:
        argv += ["--method-arg", item]
    t0 = time.time()
    rc = fedvl_main(argv)
    if rc:
        raise SystemExit(rc)
    methods = [m for m in a.methods.split(",") if m]
    bench_dir = Path(a.bench_dir)
    results = collect(bench_dir, methods)
    # A picture of the virtual data the VHL runs used (seed 0, 10 images per class).
    from fedvl.virtual import make_virtual_dataset, save_grid

    grid = None
    if any("vhl" in m for m in methods):
        seed = int(np.random.SeedSequence([0, 4242]).generate_state(1)[0])
        d = make_virtual_dataset("style_gan", 10, 200, (3, 32, 32), seed)
        grid = save_grid(d.images.view(10, 200, 3, 32, 32)[:, :10].reshape(-1, 3, 32, 32),
                         bench_dir / "vhl-virtual-style_gan.png", nrow=10, scale=2)
    result = Path(a.result)
    doc = json.loads(result.read_text()) if result.is_file() else {}
    # The header is this invocation's: write_result writes it anew.
    for key in ("command", "date", "machine", "load_average_at_end"):
        doc.pop(key, None)
    doc.setdefault("description", f"{' vs '.join(methods)}, CIFAR-10 Dirichlet(0.1), 10 "
                   "clients, 5 sampled per round, reduced CPU scale (see 'scale')")
    doc.setdefault("paper_reference", {"source": "Tang et al. ICML 2022, ResNet18, 1000 rounds",
                                       **{m: v for m, v in PAPER.items() if m in methods}})
    doc.setdefault("comparisons", {})[a.label] = {
        "command": command(),
        "fedvl_command": "fedvl " + " ".join(shlex.quote(x) for x in argv),
        "scale": {"model": f"convnet width {a.width} depth 3 instance norm",
                  "train_cap_per_client": a.train_cap, "test_cap_per_client": a.test_cap,
                  "rounds": a.rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.01,
                  "momentum": 0.9, "lr_decay": a.lr_decay, "eval_every": a.eval_every,
                  "threads": 1,
                  "method_args": a.method_arg},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__, "note": "2 CPU cores shared with other jobs"},
        "wall_seconds_this_invocation": time.time() - t0,
        "methods": results,
        **{f"paired_{b}_minus_{a_}": {
            key: paired(results[a_][key]["values"], results[b][key]["values"])
            for key in ("best_global_test_accuracy", "global_test_accuracy",
                        f"early_global_test_accuracy_rounds_1_{EARLY}")}
           for a_, b in PAIRS if {a_, b} <= set(results)},
        "virtual_data_png": str(grid) if grid else None,
        "note": a.note,
    }
    write_result(result, machine("shared with other jobs"), doc)
    for m, r in results.items():
        g, c = r["global_test_accuracy"], r["mean_client_accuracy"]
        print(f"{a.label:>10} {m:>12}: global test {100 * g['mean']:.2f} ± {100 * g['std']:.2f}"
              f"  mean client {100 * c['mean']:.2f} ± {100 * c['std']:.2f}"
              f"  down {r['bytes_down'] / 2**20:.1f} MiB")
    for a_, b in PAIRS:
        for key, d in doc["comparisons"][a.label].get(f"paired_{b}_minus_{a_}", {}).items():
            print(f"{b} - {a_}, {key}: {100 * d['mean']:+.2f} points, 95 % CI "
                  f"[{100 * d['ci95_low']:+.2f}, {100 * d['ci95_high']:+.2f}], "
                  f"{d['positive']}/{d['n']} seeds positive")
    print(f"written: {result}")


if __name__ == "__main__":
    main()

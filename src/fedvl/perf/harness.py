"""Run every engine on one workload, each in its own process, and tabulate the measurements.

Per engine: seconds per warm round (median of the rounds after the first), images per second,
the ratio of its warm round to the bare loop's, start-up (process launch to the first round's
start), peak resident memory of its whole process tree (sampled from /proc every 50 ms; the
process's own peak where /proc is missing) and final mean client accuracy; on a GPU
(`Workload.device` cuda) also the engine's peak GPU memory and the GPU's mean utilisation over
its warm rounds (NVML, sampled every 50 ms, when `pynvml` or `nvidia-smi` is there); and its
achieved training GFLOP/s (the workload's counted FLOPs per round over its warm round) as a share
of the machine's dense fp32 matmul rate, measured in the same run with the engines' thread count
(`fedvl.perf.flops`). An engine
that cannot start, fails, is not installed or does not run on the device gets a row saying so:
nothing is dropped silently.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fedvl.perf import peers
from fedvl.perf.engines import DEVICE_ENGINES, ENGINES
from fedvl.perf.flops import matmul_rate, round_flops
from fedvl.perf.workload import Workload, build_net, export_arrays, load_arrays

ALL_ENGINES = (*ENGINES, *peers.PEERS)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _tree_rss(root: int) -> int | None:
    """Bytes resident in process `root` and all its descendants (None without /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(fields[1]), []).append(int(d.name))
            rss[int(d.name)] = int(fields[21]) * PAGE
        except (OSError, ValueError, IndexError):
            continue   # the process ended while we looked
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def gpu_utilisation_reader() -> Any:
    """A function returning the first GPU's utilisation in percent now, or None without NVML."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - no pynvml or no driver: try the command-line tool
        pass

    def smi() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu",
                                  "--format=csv,noheader,nounits", "--id=0"],
                                 capture_output=True, text=True, timeout=5, check=True)
            return float(out.stdout.strip().splitlines()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None
    return smi if smi() is not None else None


def mean_in_window(samples: list[tuple[float, float]], start: float, end: float
                   ) -> float | None:
    """Mean of the (time, value) samples taken between `start` and `end`; None if none were."""
    inside = [v for t, v in samples if start <= t <= end]
    return statistics.fmean(inside) if inside else None


def run_process(cmd: list[str], timeout: float, gpu: Any = None
                ) -> tuple[int, float, int | None, str, list[tuple[float, float]]]:
    """Run `cmd`; its exit code, launch time, peak tree RSS in bytes, its output tail and
    (with a `gpu` utilisation reader) timed GPU utilisation samples."""
    launched = time.time()
    util: list[tuple[float, float]] = []
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        peak: list[int | None] = [None]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                r = _tree_rss(p.pid)
                if r is not None:
                    peak[0] = max(peak[0] or 0, r)
                if gpu is not None and (u := gpu()) is not None:
                    util.append((time.time(), u))
                done.wait(0.05)
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            code = p.wait()
        finally:
            done.set()
            t.join()
        log.seek(0)
        tail = log.read().decode(errors="replace")[-2000:]
    if peak[0] is None:  # no /proc: the largest child's own peak (kilobytes on Linux)
        peak[0] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return code, launched, peak[0], tail, util


def engine_command(engine: str, w: Workload, arrays: Path, out: Path, workers: int,
                   python: str, peers_python: str | None) -> list[str]:
    """The command line that runs `engine` on the workload."""
    if engine in peers.PEERS:
        return peers.command(engine, peers_python or peers.default_python(engine), w.to_json(),
                             str(arrays), str(out), workers)
    return [python, "-m", "fedvl.perf.engines", engine, w.to_json(), str(arrays), str(out),
            str(workers)]


def measure(engine: str, w: Workload, arrays: Path, images: int, workdir: Path, workers: int,
            peers_python: str | None, timeout: float, gpu: Any = None) -> dict[str, Any]:
    """One engine's row of the table (`peers_python` None: each peer's `default_python`;
    `gpu` a utilisation reader or None)."""
    row: dict[str, Any] = {"engine": engine, "clients": w.clients, "workers": workers}
    if w.device != "cpu" and engine not in DEVICE_ENGINES:
        return {**row, "status": "unavailable",
                "reason": f"runs on the CPU only; on {w.device}: {', '.join(DEVICE_ENGINES)}"}
    if engine in peers.PEERS:
        peers_python = peers_python or peers.default_python(engine)
        why = peers.unavailable(engine, peers_python)
        if why is not None:
            return {**row, "status": "unavailable", "reason": why}
        row["version"] = peers.version(engine, peers_python)
    out = workdir / engine / "row.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = engine_command(engine, w, arrays, out, workers, sys.executable, peers_python)
    code, launched, peak, tail, util = run_process(cmd, timeout, gpu)
    if code != 0 or not out.is_file():
        return {**row, "status": "failed", "exit_code": code, "reason": tail.strip()[-600:]}
    res = json.loads(out.read_text())
    secs = [e - s for s, e in zip(res["round_starts"], res["round_ends"], strict=True)]
    warm = statistics.median(secs[1:]) if len(secs) > 1 else secs[0]
    extra: dict[str, Any] = {}
    if "peak_gpu_mib" in res:
        extra["peak_gpu_mib"] = res["peak_gpu_mib"]
    if gpu is not None and len(secs) > 1:
        extra["gpu_utilisation_percent"] = mean_in_window(util, res["round_starts"][1],
                                                          res["round_ends"][-1])
    return {**row, **extra, "status": "ok", "setting": res.get("setting"),
            "version": res.get("version", row.get("version")),
            "warm_round_seconds": warm, "first_round_seconds": secs[0],
            "round_seconds": secs, "images_per_round": images,
            "images_per_second": images / warm,
            "startup_seconds": res["round_starts"][0] - launched,
            "total_seconds": res["round_ends"][-1] - launched,
            "peak_rss_mib": None if peak is None else peak / 2**20,
            "accuracy": res["accuracy"], "eval_seconds": res.get("eval_seconds")}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.machine(),
                            "cpu_count": os.cpu_count(), "python": platform.python_version(),
                            "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def run_perf(base: Workload, client_counts: list[int], engines: list[str], workers: int,
             peers_python: str | None = None, timeout: float = 3600.0,
             workdir: Path | None = None) -> dict[str, Any]:
    """Every engine on the workload at each client count; the rows and the machine."""
    bad = sorted(set(engines) - set(ALL_ENGINES))
    if bad:
        raise ValueError(f"unknown engine(s) {bad}; allowed: {', '.join(ALL_ENGINES)}")
    rows = []
    gpu = gpu_utilisation_reader() if base.device != "cpu" else None
    # The ceiling is measured before any engine runs, with as many threads as the engines
    # use in total, so that each engine's achieved rate is read against the same machine.
    print(f"  timing a dense fp32 matmul on {base.device} ...", file=sys.stderr, flush=True)
    load_start = _load()
    matmul = matmul_rate(workers, base.device)
    with tempfile.TemporaryDirectory(prefix="fedvl-perf-") as tmp:
        root = Path(workdir or tmp)
        for k in client_counts:
            w = Workload(**{**asdict(base), "clients": k})
            arrays = export_arrays(w, root / f"clients{k}.npz")
            data = load_arrays(arrays)
            # Every engine runs the same model on the same batches: one count per setting.
            flops = round_flops(build_net(w, data), data.train, w.batch_size)
            for engine in engines:
                row = measure(engine, w, arrays, data.images_per_round, root / f"clients{k}",
                              workers, peers_python, timeout, gpu)
                # A domain benchmark's clients are its domains (times --partitions).
                row["clients"] = data.num_clients
                if row["status"] == "ok":
                    row["flops_per_round"] = flops
                    row["gflops"] = flops / row["warm_round_seconds"] / 1e9
                    row["share_of_matmul"] = row["gflops"] / matmul["gflops"]
                rows.append(row)
                print_row(row)
    # The bare loop is one model with no federation, not a bound: an engine that trains
    # clients in parallel beats it (a ratio above 1).
    bare = {r["clients"]: r["warm_round_seconds"] for r in rows
            if r["engine"] == "bare" and r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok" and r["clients"] in bare:
            r["bare_loop_ratio"] = bare[r["clients"]] / r["warm_round_seconds"]
    return {"workload": asdict(base), "clients": client_counts, "workers": workers,
            "machine": machine(), "matmul_gflops": matmul["gflops"], "matmul": matmul,
            "load_average": {"start": load_start, "end": _load()}, "rows": rows}


def _load() -> list[float] | None:
    # Other work on the machine slows every engine and the matmul alike: the record says how
    # busy it was (1, 5 and 15 minute load averages), where the platform reports it.
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def print_row(row: dict[str, Any]) -> None:
    """One finished row, printed as it comes (long runs show progress)."""
    if row["status"] == "ok":
        print(f"  {row['engine']:9s} {row['clients']:5d} clients: "
              f"{row['warm_round_seconds']:.3f} s/round, "
              f"{row.get('gflops', float('nan')):.1f} GFLOP/s, acc {row['accuracy']:.3f}",
              file=sys.stderr, flush=True)
    else:
        print(f"  {row['engine']:9s} {row['clients']:5d} clients: {row['status']}: "
              f"{row.get('reason', '')[:120]}", file=sys.stderr, flush=True)


def table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table."""
    on_gpu = result["workload"].get("device", "cpu") != "cpu"
    head = ("| engine | clients | warm s/round | img/s | × bare loop | start-up s | total s | "
            "peak RSS MiB | accuracy | GFLOP/s | share of matmul |")
    cols = 11
    if on_gpu:
        head += " peak GPU MiB | GPU util % |"
        cols += 2
    lines = [head, "|" + "---|" * cols]

    def fmt(v: float | None, spec: str) -> str:
        return "" if v is None else format(v, spec)
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['engine']} | {r['clients']} | {r['status']}: "
                         f"{r.get('reason', '')[:80]} |" + " |" * (cols - 3))
            continue
        line = (f"| {r['engine']} | {r['clients']} | {r['warm_round_seconds']:.3f} | "
                f"{r['images_per_second']:.0f} | {fmt(r.get('bare_loop_ratio'), '.2f')} | "
                f"{r['startup_seconds']:.1f} | {r['total_seconds']:.1f} | "
                f"{fmt(r.get('peak_rss_mib'), '.0f')} | {r['accuracy']:.3f} | "
                f"{fmt(r.get('gflops'), '.2f')} | "
                f"{fmt(r.get('share_of_matmul'), '.1%')} |")
        if on_gpu:
            line += (f" {fmt(r.get('peak_gpu_mib'), '.0f')} |"
                     f" {fmt(r.get('gpu_utilisation_percent'), '.0f')} |")
        lines.append(line)
    if "matmul" in result:
        lines += ["", matmul_line(result["matmul"])]
    return "\n".join(lines)


def matmul_line(m: dict[str, Any]) -> str:
    """The sentence under the table that says what "share of matmul" is measured against."""
    where = f"{m['threads']} torch thread(s)" if "threads" in m else m["device"]
    return (f"share of matmul: achieved training GFLOP/s (convolutions and matrix products of "
            f"forward + backward, counted by FlopCounterMode) over this machine's dense fp32 "
            f"matmul rate, {m['gflops']:.1f} GFLOP/s ({m['n']} x {m['n']}, {where}, best of "
            f"{m['repeats']}), the real ceiling.")

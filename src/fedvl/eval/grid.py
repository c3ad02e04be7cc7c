"""`fedvl bench --jobs`: the runs of a methods x seeds grid as parallel worker processes.

Each pending run becomes one `python -m fedvl.eval.grid` process, started with `subprocess`
rather than handed to a `ProcessPoolExecutor`:

- one fresh process per run: fedvl keeps freed memory inside its process (`keep_freed_memory`),
  so a pool worker reused for a second run would carry the first one's pages, and the peak
  measured for `--jobs auto` would not be one run's;
- the run's config travels as the `config.yaml` text a resumed run starts from (`dump_yaml`,
  `load_yaml`), exactly the RunConfig the in-process path runs, with no flags re-parsed;
- an error or Ctrl-C stops the grid cleanly: every child gets one SIGINT (children run in their
  own session, so a terminal's Ctrl-C reaches only the parent, which forwards it once) and
  handles it as an interrupted `fedvl run` does: a run with a checkpoint keeps it and is resumed
  by the next `fedvl bench`, one before its first checkpoint removes what it wrote. A pool
  cannot interrupt a task it is running;
- each child writes its output to a log of its own, shown when it fails: the progress bars of
  N runs would interleave on one terminal.

Every process runs on the grid's `--device` with max(1, cores // N) client workers on the CPU
unless `--workers` says otherwise; clients train on one torch thread whatever the count, so
that changes no number. The server's own work keeps the run's `--threads` (by default what
`--jobs 1` uses): a method that trains or distils on the server can round differently on
another thread count, and one configuration gives the same numbers whatever N. The price is
N processes' server threads sharing the cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from fedvl.config import ConfigError, RunConfig, dump_yaml
from fedvl.options import shown

AUTO = "auto"
# The share of the free memory that `--jobs auto` fills: the rest absorbs what one run's peak
# does not show (CUDA contexts of the other processes, allocator slack, the parent itself).
MEMORY_SHARE = 0.9
POLL_SECONDS = 0.05
# How long stopped children get to leave their run directories resumable before being killed.
STOP_SECONDS = 30.0
LOG_TAIL_LINES = 20
MIB = 2**20
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)

Key = tuple[str, int]


def parse_jobs(value: str | int) -> int | str:
    """`--jobs` as a process count >= 1 or 'auto'; anything else is one ConfigError."""
    text = str(value).strip()
    if text.lower() == AUTO:
        return AUTO
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise ConfigError(f"--jobs {shown(value)} is invalid; allowed: a whole number of "
                          "processes >= 1, or auto (from one run's measured peak memory)")
    return jobs


def parse_memory(value: str) -> int:
    """`--max-memory` ('512M', '8G', '8GiB', bytes) in bytes; anything else is one ConfigError."""
    match = _SIZE.fullmatch(str(value).strip())
    size = int(float(match[1]) * _UNITS[match[2].lower()]) if match else 0
    if size < 1:
        raise ConfigError(f"--max-memory {shown(value)} is invalid; allowed: a size above 0 "
                          "such as 512M, 8G or 8GiB (binary K, M, G, T), or bytes")
    return size


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # no affinity masks on this OS
        return max(1, os.cpu_count() or 1)


def available_ram() -> int:
    """Bytes of RAM a new process can still take: MemAvailable, within a cgroup's limit."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        # A container's memory limit binds before the host's free memory does (cgroup v2).
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = min(free, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return free


@dataclass(frozen=True)
class GridRun:
    """One (method, seed) run of a grid: its config, directory and whether it resumes."""

    method: str
    seed: int
    cfg: RunConfig
    run_dir: Path

    @property
    def key(self) -> Key:
        """(method, seed)."""
        return (self.method, self.seed)

    @property
    def resume(self) -> bool:
        """Whether an interrupted run left a checkpoint to continue from."""
        return (self.run_dir / "checkpoint.pt").is_file()


@dataclass(frozen=True)
class Finished:
    """A run done in its own process: its summary and the peaks the process reported."""

    summary: dict[str, Any]
    seconds: float
    peak: dict[str, Any]


@dataclass(frozen=True)
class Memory:
    """One memory a run takes from: its measured peak and what is free for the grid."""

    where: str       # "RAM", "cuda:0 memory"
    peak: int        # bytes one run peaked at
    free: int        # bytes free now
    budget: int | None = None   # --max-memory, when it gives less than is free


def choose_jobs(memories: Sequence[Memory], cores: int) -> tuple[int, str]:
    """`--jobs auto`'s process count and the line saying why; a run that fits no memory is a
    ConfigError.

    N = min(cores, floor(usable * MEMORY_SHARE / peak)) over every memory a run takes from,
    where usable is the free memory (or --max-memory when lower); on a GPU the cores cap it
    too, as every process needs a core to drive its kernels.
    """
    fits: list[tuple[int, str]] = []
    for m in memories:
        capped = m.budget is not None and m.budget <= m.free
        usable = m.budget if capped and m.budget is not None else m.free
        has = f"{_size(usable)} of --max-memory" if capped else f"{_size(usable)} free"
        n = math.floor(usable * MEMORY_SHARE / max(m.peak, 1))
        if n < 1:
            need = math.ceil(m.peak / MEMORY_SHARE / MIB)
            raise ConfigError(
                f"--jobs auto: one run of this grid peaked at {_size(m.peak)} of {m.where}, "
                f"more than {MEMORY_SHARE:g} x {has}; nothing more started (allowed: "
                + (f"--max-memory {need}M or more)" if capped
                   else f"{need:,} MiB of {m.where} free or more)"))
        fits.append((n, f"{m.where}: one run peaked at {_size(m.peak)}, "
                        f"{MEMORY_SHARE:g} x {has} fits {n}"))
    n = min([cores, *(f for f, _ in fits)])
    bound = "the CPU cores" if n == cores else "memory"
    why = "; ".join([f"{cores} CPU cores", *(w for _, w in fits)])
    return n, f"fedvl bench --jobs auto: {n} process{'es' * (n != 1)} (bound by {bound}: {why})"


def _size(n: int) -> str:
    """Bytes for a message: MiB, or KiB / bytes when smaller."""
    if n >= MIB:
        return f"{n / MIB:,.0f} MiB"
    return f"{n / 2**10:,.0f} KiB" if n >= 2**10 else f"{n:,} bytes"


def device_memories(done: Finished, max_memory: int | None) -> list[Memory]:
    """What a measured run took from the grid's device (and from RAM on a GPU)."""
    rss = int(done.peak.get("rss_bytes") or 0)
    cuda = done.peak.get("cuda")
    if not cuda:
        return [Memory("RAM", rss, available_ram(), max_memory)]
    # The caching allocator's reserve is what the process holds on the device; the free memory
    # is what the child saw beside its own context, before its run allocated anything.
    return [Memory(f"{cuda['device']} memory", int(cuda["max_reserved"]), int(cuda["free"]),
                   max_memory),
            Memory("RAM", rss, available_ram())]


@dataclass
class _Child:
    run: GridRun
    proc: subprocess.Popen[bytes]
    log: Path
    log_file: IO[bytes]
    result: Path
    started: float


def _child_config(cfg: RunConfig, threads: int) -> RunConfig:
    """`cfg` with this process's share of the cores as client workers where the user left them
    open; the server's threads are what `--jobs 1` would give it here (they can change its
    numbers), resolved in this process, as a child's own default could differ."""
    from fedvl.engine.threads import default_workers, resolve_threads

    if cfg.threads is None:
        cfg = replace(cfg, threads=resolve_threads(None))
    if cfg.workers is None:
        cfg = replace(cfg, workers=default_workers(cfg.device, cores=threads))
    return cfg


def _start(run: GridRun, work: Path, threads: int) -> _Child:
    """Launch `run` in a fresh `python -m fedvl.eval.grid` process."""
    name = f"{run.method}-seed{run.seed}"
    cfg_path, result, log = (work / f"{name}.yaml", work / f"{name}.result.json",
                             work / f"{name}.log")
    dump_yaml(_child_config(run.cfg, threads), cfg_path)
    cmd = [sys.executable, "-m", "fedvl.eval.grid", "--config", str(cfg_path), "--out",
           str(run.run_dir), "--result", str(result), "--parent", str(os.getpid()),
           *(["--resume"] if run.resume else [])]
    env = dict(os.environ)
    # The child imports the very fedvl this process runs, installed or not.
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    log_file = log.open("wb")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, env=env,
                                start_new_session=os.name == "posix")
    except BaseException:
        log_file.close()
        raise
    return _Child(run, proc, log, log_file, result, time.perf_counter())


def _stop(children: Sequence[_Child]) -> None:
    """Interrupt the running children as Ctrl-C would, then kill those that outlast STOP_SECONDS.

    SIGINT lets each one leave its run directory resumable (or remove a start that has no
    checkpoint yet); a kill is the last resort.
    """
    live = [c for c in children if c.proc.poll() is None]
    for c in live:
        try:
            c.proc.send_signal(signal.SIGINT)
        except OSError:
            pass
    deadline = time.monotonic() + STOP_SECONDS
    for c in live:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def _failure(c: _Child) -> ValueError:
    """Show a failed child's last log lines; the one-line error that ends the grid."""
    lines = c.log.read_text(errors="replace").splitlines() if c.log.is_file() else []
    tail = [line for line in lines if line.strip()][-LOG_TAIL_LINES:]
    if len(tail) > 1:   # a traceback: one line alone is in the error itself
        print(f"--- last lines of {c.run.method}/seed{c.run.seed}'s process ---", *tail,
              sep="\n", file=sys.stderr)
    last = tail[-1].strip().removeprefix("fedvl: error: ") if tail else "no output"
    return ValueError(f"bench run {c.run.method}/seed{c.run.seed} failed in its process "
                      f"(exit {c.proc.returncode}: {last}); the other runs were stopped, the "
                      "finished ones kept: the same command resumes the grid")


def run_processes(runs: Sequence[GridRun], processes: int, cores: int | None = None,
                  progress: bool = True) -> dict[Key, Finished]:
    """Run `runs` in order on `processes` worker processes at a time; each one's summary.

    Runs start in the grid's order and results are keyed by (method, seed), so the caller
    tabulates them in that order whatever order they finish in. The first failure stops the
    others (see `_stop`) and raises; finished runs stay on disk for the next `fedvl bench`.
    """
    cores = cores or cpu_cores()
    processes = max(1, min(processes, len(runs)))
    threads = max(1, cores // processes)
    queue, running = deque(runs), []
    done: dict[Key, Finished] = {}
    work = Path(tempfile.mkdtemp(prefix="fedvl-grid-"))
    try:
        while queue or running:
            while queue and len(running) < processes:
                running.append(_start(queue.popleft(), work, threads))
            ended = [c for c in running if c.proc.poll() is not None]
            if not ended:
                time.sleep(POLL_SECONDS)
                continue
            for c in ended:
                running.remove(c)
                c.log_file.close()
                if c.proc.returncode != 0:
                    raise _failure(c)
                summary = json.loads((c.run.run_dir / "summary.json").read_text())
                peak = json.loads(c.result.read_text()) if c.result.is_file() else {}
                done[c.run.key] = Finished(summary, time.perf_counter() - c.started, peak)
                if progress:
                    print(f"bench: {c.run.method} seed {c.run.seed} finished in "
                          f"{done[c.run.key].seconds:.1f} s ({len(done)}/{len(runs)}, "
                          f"{processes} processes x {threads} client workers)", file=sys.stderr)
    except BaseException:
        _stop(running)
        raise
    finally:
        for c in running:
            c.log_file.close()
        shutil.rmtree(work, ignore_errors=True)
    return done


# -- the child: one run, then its peaks ------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """Ask Linux to interrupt this process when the bench process dies (a killed parent must
    not leave runs writing into a grid that a new `fedvl bench` resumes)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGINT))
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:   # it died before the request was in place
        raise SystemExit(f"fedvl bench process {parent} is gone; this run is not started")


def _peaks(device: Any, free: tuple[int, int] | None) -> dict[str, Any]:
    """This process's peak resident memory and, on CUDA, the allocator's peaks."""
    import resource

    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    out: dict[str, Any] = {"rss_bytes": rss if sys.platform == "darwin" else rss * 1024}
    if device.type == "cuda" and free is not None:
        out["cuda"] = {"device": str(device),
                       "max_allocated": torch.cuda.max_memory_allocated(device),
                       "max_reserved": torch.cuda.max_memory_reserved(device),
                       "free": free[0], "total": free[1]}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """One grid run in this process (`python -m fedvl.eval.grid`); its peaks to --result."""
    # Before torch is imported, as `fedvl` does: the allocator and OpenMP read them once.
    from fedvl.engine.allocator import keep_freed_memory
    from fedvl.engine.omp import passive_waits

    keep_freed_memory()
    passive_waits()
    p = argparse.ArgumentParser(prog="python -m fedvl.eval.grid")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    _die_with_parent(args.parent)

    import torch

    from fedvl.config import load_yaml
    from fedvl.run.assemble import resolve_device
    from fedvl.run.experiment import run_experiment

    cfg = load_yaml(args.config)
    device = resolve_device(cfg.device)
    # Free device memory as this process sees it beside its own context, before the run.
    free = torch.cuda.mem_get_info(device) if device.type == "cuda" else None
    try:
        run_experiment(cfg, out=args.out, resume=args.resume, progress=False)
    except (ConfigError, ValueError, KeyError, FileNotFoundError) as e:
        # What `fedvl run` prints for a bad config or data: one line, which the parent shows.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"fedvl: error: {msg}", file=sys.stderr)
        return 2
    result = Path(args.result)
    tmp = result.with_name(result.name + ".tmp")
    tmp.write_text(json.dumps(_peaks(device, free)))
    os.replace(tmp, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

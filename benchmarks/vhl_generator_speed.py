"""Speed: VHL's virtual-data generator (`make_virtual_dataset('style_gan', ...)`) on a device.

One call generates VHL's default virtual set, as `VHLAddon.virtual_dataset` does at the start of
a run: 10 virtual classes (as many as CIFAR-10's) x 200 images (`VHLParams.virtual_per_class`)
of 3 x 32 x 32. The generator's weights and styles are drawn on the CPU, its forward passes run
on `--device`, and the images come back to the CPU (inside the timed call). Each thread count of
`--threads` is timed in interleaved repetitions after one untimed warm-up call; the SHA-256 of
each setting's images shows whether they are the same.

    python benchmarks/vhl_generator_speed.py --threads 1 2
    python benchmarks/vhl_generator_speed.py --device cuda   # -> vhl-generator-device-h200.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import re
import statistics
import subprocess
import time

from provenance import command, load_average, machine, write_result

from fedvl.engine.omp import POLICY_VAR, passive_waits

# The command as the user typed it, before the script adds a wait policy to the environment.
COMMAND = command()
# Before torch loads, as `fedvl` does: OpenMP threads then sleep at a barrier instead of
# spinning, which on a shared machine decides what 2 threads cost (fedvl.engine.omp).
PASSIVE_SET_HERE = passive_waits()

import torch  # noqa: E402

from fedvl.engine.allocator import keep_freed_memory  # noqa: E402
from fedvl.virtual import make_virtual_dataset  # noqa: E402


def cpu_model() -> str:
    """The host CPU as `lscpu` names it (its `Model name`), else /proc/cpuinfo's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return machine().split(",")[0]


def device_tag(device: torch.device) -> str:
    """The results file's device word: `cpu`, or the GPU's model (`h200` for an NVIDIA H200)."""
    if device.type != "cuda":
        return device.type
    # The first word with a digit is the model ("NVIDIA H200 NVL", "Tesla V100-SXM2-16GB").
    words = [w for w in torch.cuda.get_device_name(device).split() if re.search(r"\d", w)]
    return re.sub(r"[^a-z0-9]+", "-", words[0].lower()).strip("-") if words else "gpu"


def timed_call(device: torch.device, args: argparse.Namespace) -> tuple[float, str]:
    """Seconds of one generator call and the SHA-256 of its images."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    data = make_virtual_dataset(args.generator, args.classes, args.per_class,
                                (3, args.size, args.size), args.seed, device=device)
    seconds = time.perf_counter() - t   # the images are on the CPU: the device's work is done
    return seconds, hashlib.sha256(data.images.numpy().tobytes()).hexdigest()


def main() -> None:
    """Measure and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch CPU thread counts to time, one after another per repetition")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per thread count")
    ap.add_argument("--generator", default="style_gan")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--per-class", type=int, default=200)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="results file (default benchmarks/results/vhl-generator-device-"
                         "<cpu, or the GPU model: h200>.json)")
    args = ap.parse_args()
    if args.reps < 1 or any(t < 1 for t in args.threads):
        ap.error(f"--reps {args.reps} and --threads {args.threads} must be >= 1")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r} is not a device; allowed: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device} asked for, but torch sees no CUDA device")
    out = args.out or f"benchmarks/results/vhl-generator-device-{device_tag(device)}.json"
    keep_freed_memory()
    load_at_start = load_average()
    start = dt.datetime.now(dt.UTC)
    seconds: dict[int, list[float]] = {t: [] for t in args.threads}
    digests: dict[int, set[str]] = {t: set() for t in args.threads}
    for t in args.threads:
        torch.set_num_threads(t)
        # First call of a setting pays one-time costs (CUDA context, kernel loads, allocator).
        digests[t].add(timed_call(device, args)[1])
    for rep in range(args.reps):
        for t in args.threads:
            torch.set_num_threads(t)
            s, digest = timed_call(device, args)
            seconds[t].append(s)
            digests[t].add(digest)
            print(f"rep {rep} threads {t}: {s:.3f} s", flush=True)
    rows = []
    for t in args.threads:
        med = statistics.median(seconds[t])
        rows.append({"threads": t, "seconds_per_call": [round(s, 4) for s in seconds[t]],
                     "median_seconds": round(med, 4), "calls_per_second": round(1 / med, 3),
                     "images_sha256": sorted(digests[t])})
        print(f"threads {t}: median {med:.3f} s per call, {1 / med:.2f} calls/s", flush=True)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"the CPU, {os.cpu_count()} cores")
    write_result(out, machine(f"run on {where}"), {
        "command": COMMAND,
        "date": start.strftime("%Y-%m-%d"),
        "date_utc": start.strftime("%a %b %d %H:%M:%S UTC %Y"),
        "host_cpu": cpu_model(),
        "device": str(device),
        "torch": torch.__version__,
        "setting": f"make_virtual_dataset({args.generator!r}, {args.classes}, {args.per_class}, "
                   f"(3, {args.size}, {args.size}), {args.seed}, device={str(device)!r}); one "
                   f"untimed warm-up call per thread count, then {args.reps} interleaved "
                   "repetitions",
        "omp_wait_policy": (f"{os.environ.get(POLICY_VAR)} (set by the script, as the fedvl "
                            "command line sets it)" if PASSIVE_SET_HERE
                            else os.environ.get(POLICY_VAR, "libgomp default")),
        "load_average_at_start": load_at_start,
        "rows": rows,
        "same_images_in_every_setting": len({d for ds in digests.values() for d in ds}) == 1,
    })
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

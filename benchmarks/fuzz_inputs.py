"""Fuzzing `fedvl run`'s inputs: generated configs through the dry run, a sample through real runs.

  python benchmarks/fuzz_inputs.py --cases 10000 --real 30 \
      --result benchmarks/results/fuzz-inputs-cpu.json

Every case is `fedvl run ARGV --dry-run` through the real entry point (`fedvl.cli.main`, in
this process for speed: argument parsing, the config check, data, models and method options,
as the command line runs them). Case families, drawn from one seeded generator:

* `flag`: one to four `--flag=VALUE` of real RunConfig flags with hostile values (huge,
  negative, zero, NaN, inf, 1e308, 100,000-character strings, control characters, wrong types);
* `yaml`: a `--config` file: real and unknown keys, values of every type, nesting, bad YAML;
* `method-arg`: a registered method with `--method-arg` items, its real option names (and
  unknown ones) with hostile values;
* `model-arg`: `--width/--depth/--norm/--model-arg` with hostile values;
* `mixed`: all of the above at once, on the shipped benchmarks and on a tiny data folder of
  `npz-domains` / `digits` files (one with labels of 10^7).

The outcome of each case is one of: exit 0 having passed every check; one `fedvl: error:` line
(argparse's errors included); or a failure of the property: a traceback (an exception out of
`main`), an error of several lines, a line over 300 characters, or files left in `--out`.
Per-client caps are clamped to a few images in this process (`CAP`): a valid request for 5,000
images per client is slow, not wrong, and the clipping of huge caps is measured separately,
unclamped, in child processes (`huge caps`, with their peak RSS). A sample of the cases that
passed (and some that failed) then runs for real, 1 round on tiny caps, as child processes
`python -m fedvl.cli run ... --rounds 1`: exit 0 with a summary, or one error line and no run
directory left unless a checkpoint was written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from provenance import write_result

from fedvl.cli import main
from fedvl.config import RunConfig
from fedvl.options import ERROR_LINE_LIMIT, kind_of, option_fields, spec_of
from fedvl.registry import ALGORITHMS, BENCHMARKS, MODELS
from fedvl.run import assemble

CAP = 6   # per-client images in the in-process dry runs (see the module docstring)
_ORDER = list(RunConfig().to_dict())   # config.yaml's order, as the recorded cases used
FIELDS = {f.name: f for f in sorted(option_fields(RunConfig), key=lambda f: _ORDER.index(f.name))}
CLI_FIELDS = [n for n, f in FIELDS.items() if spec_of(f).cli]
METHODS = ALGORITHMS.base_names()
OPTIONS = {m: {f.name: f for f in dataclasses.fields(ALGORITHMS.get(m).Params)} for m in METHODS}
LONG = "x" * 100_000
HUGE_INTS = ["99999999999999999999", str(2**63), str(2**31), str(2**64 + 1), "9" * 400,
             "-99999999999999999999", str(-2**63)]
SMALL_INTS = ["0", "-1", "1", "2", "3", "4", "7", "16", "40"]
FLOATS = ["nan", "inf", "-inf", "1e308", "-1e308", "1e39", "3.5e38", "1e-320", "0", "-0.0",
          "0.5", "1.5", "-0.5", "1e30", "0.01", "1"]
STRINGS = [LONG, "x" * 5000, "", " ", "\x1b[31mred", "a\nb", "a\x00b", "é", "../..", "/",
           "~nosuch/x", ",", ",,,", "a,b", ",".join(["mnist"] * 2000), "cuda:99", "cuda:-1",
           "true", "null", "[1, 2]", "{a: 1}", "'", "!!python/object:os.system", "1e400"]
NAMES = sorted({*METHODS, "fedprox+vhl", "fedavg+nope", *BENCHMARKS.names(), *MODELS.names(),
                "cpu", "auto", "cuda", "alternate", "real", "virtual", "noise", "stats",
                "samples", "median", "trimmed-mean", "handwritten", "printed-clean", "mnist",
                "usps", "d1", "d2", "big", "none", "bf16", "dirichlet", "shards", "dominant"})
TINY = ["--method", "fedavg", "--rounds", "1", "--width", "4", "--depth", "1"]


def hostile(rng: random.Random, base: str = "any") -> str:
    """A value as command-line text: of the field's type near its limits, or anything."""
    pools = {"int": SMALL_INTS * 3 + HUGE_INTS, "float": FLOATS * 2 + HUGE_INTS,
             "str": NAMES * 2 + STRINGS, "list": NAMES + STRINGS}
    pool = pools.get(base, [])
    if pool and rng.random() < 0.7:
        return rng.choice(pool)
    return rng.choice(SMALL_INTS + HUGE_INTS + FLOATS + STRINGS + NAMES)


def yaml_value(rng: random.Random, depth: int = 0) -> Any:
    """A random YAML value: numbers past every limit, strings, lists, nested mappings."""
    r = rng.random()
    if r < 0.15 and depth < 3:
        return [yaml_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.25 and depth < 3:
        return {rng.choice(["width", "depth", "norm", "mu", "k", 1]): yaml_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    if r < 0.35:
        return rng.choice([None, True, False])
    if r < 0.55:
        return rng.choice([0, -1, 1, 3, 2**31, 2**63, 10**20, -10**20, 10**400])
    if r < 0.7:
        return rng.choice([float("nan"), float("inf"), -float("inf"), 1e308, 1e39, 0.5, -0.5])
    return rng.choice(NAMES + STRINGS)


def flag_case(rng: random.Random) -> list[str]:
    """One to four real flags with hostile values, over the tiny base run."""
    argv = list(TINY)
    for name in rng.sample(CLI_FIELDS, rng.randint(1, 4)):
        f = FIELDS[name]
        flag = "--" + (spec_of(f).flag or name.replace("_", "-"))
        if kind_of(f).base == "bool":
            argv.append(flag if f.default is False else "--no-" + name.replace("_", "-"))
        else:
            argv.append(f"{flag}={hostile(rng, kind_of(f).base)}")
    return argv


def method_case(rng: random.Random) -> list[str]:
    """A registered method with real (or unknown) options set to hostile values."""
    method = rng.choice(METHODS)
    argv = ["--method", method, "--rounds", "1", "--width", "4", "--depth", "1"]
    options = OPTIONS[method]
    for _ in range(rng.randint(1, 3)):
        if options and rng.random() < 0.85:
            name = rng.choice(sorted(options))
            argv.append(f"--method-arg={name}={hostile(rng, kind_of(options[name]).base)}")
        else:
            argv.append(f"--method-arg={rng.choice(STRINGS + NAMES)}={hostile(rng)}")
    return argv


def model_case(rng: random.Random) -> list[str]:
    """Model shortcuts and `--model-arg` with hostile values."""
    argv = ["--method", rng.choice(["fedavg", "fedprox", "moon", "local"]), "--rounds", "1"]
    for _ in range(rng.randint(1, 3)):
        which = rng.choice(["--width", "--depth", "--norm", "--model-arg", "--model",
                            "--client-models", "--image-size"])
        if which == "--model-arg":
            key = rng.choice(["width", "depth", "norm", "pooling", "x" * 300, ""])
            argv.append(f"--model-arg={key}={hostile(rng)}")
        else:
            base = "str" if which in ("--norm", "--model") else "int"
            argv.append(f"{which}={hostile(rng, base)}")
    return argv


def yaml_case(rng: random.Random, work: Path) -> list[str]:
    """A `--config` file: a mapping of real and unknown keys, or a damaged document."""
    doc: dict[Any, Any] = {"method": "fedavg", "rounds": 1, "model_args": {"width": 4, "depth": 1}}
    for _ in range(rng.randint(1, 5)):
        key = rng.choice(list(FIELDS) * 3 + ["nope", "x" * 1000, 1, None, True])
        doc[key] = yaml_value(rng)
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        text = "method: fedavg\n"
    kind = rng.random()
    if kind < 0.1:   # a random edit
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice(["[", "{", ":", "\x00", "\t", "'", "&a *a"]) + text[at + 1:]
    elif kind < 0.15:
        text = rng.choice(["[]", "0", "", "- a", "[" * 3000, "rounds: " + "9" * 5000])
    path = work / f"cfg{rng.randrange(10**9)}.yaml"
    path.write_text(text, errors="surrogatepass")
    return ["--config", str(path)]


def mixed_case(rng: random.Random, work: Path, data_dir: Path) -> list[str]:
    """Every family at once, on the shipped benchmarks or the tiny data folder."""
    argv = rng.choice([flag_case, method_case, model_case])(rng)
    if rng.random() < 0.3:
        argv += yaml_case(rng, work)
    if rng.random() < 0.6:
        bench = rng.choice(["npz-domains", "digits", "imagefolder", "digits-offline"])
        sub = rng.choice(["npz", "npz", "npz-bad-labels", ""])
        folder = data_dir / sub if bench == "npz-domains" and sub else data_dir
        argv += [f"--benchmark={bench}", f"--data-dir={folder}"]
    return argv


def make_case(family: str, rng: random.Random, work: Path, data_dir: Path) -> list[str]:
    """The argv (after `fedvl run`) of one case of `family`."""
    if family == "flag":
        return flag_case(rng)
    if family == "yaml":
        return TINY + yaml_case(rng, work)
    if family == "method-arg":
        return method_case(rng)
    if family == "model-arg":
        return model_case(rng)
    return mixed_case(rng, work, data_dir)


def tiny_data(root: Path) -> Path:
    """A data folder: npz-domains (two domains; one folder with a label of 10^7), digits."""
    rng = np.random.default_rng(0)

    def arrays(n: int, labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
        return {"x_train": rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8),
                "y_train": np.arange(n) % 10 if labels is None else labels,
                "x_test": rng.integers(0, 256, (10, 28, 28, 1), dtype=np.uint8),
                "y_test": np.arange(10) % 10}

    for sub in ("npz", "npz-bad-labels", "digits"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for d in ("d1", "d2"):
        np.savez(root / "npz" / f"{d}.npz", **arrays(40))
    np.savez(root / "npz-bad-labels" / "d1.npz", **arrays(40))
    np.savez(root / "npz-bad-labels" / "big.npz", **arrays(40, np.full(40, 10**7)))
    for d in ("mnist", "usps"):
        np.savez(root / "digits" / f"{d}.npz", **arrays(40))
    return root


def classify(code: int | None, out: str, err: str, escaped: BaseException | None,
             left: bool) -> tuple[str, list[str]]:
    """(outcome, property failures) of one dry run."""
    problems = []
    if escaped is not None or "Traceback" in err:
        problems.append("traceback")
    if left:
        problems.append("leftover files")
    lines = err.splitlines()
    if code == 0:
        if "passed every check" not in out:
            problems.append("exit 0 without passing")
        return "exit 0", problems
    errors = [x for x in lines if x.startswith("fedvl: error: ")]
    if len(errors) != 1 or not err.endswith(errors[0] + "\n"):
        problems.append("not one error line")
    if any(len(x) > ERROR_LINE_LIMIT for x in errors):
        problems.append("error line over 300 characters")
    return "one-line error", problems


class CaseTimeout(Exception):
    """A dry run took longer than `--case-timeout` (raised by SIGALRM)."""


def _alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout


def dry_run(argv: list[str], work: Path, timeout: int) -> dict[str, Any]:
    """`fedvl run ARGV --out DIR --dry-run` in this process; the outcome and what broke."""
    out_dir = work / "out"
    stdout, stderr = io.StringIO(), io.StringIO()
    escaped: BaseException | None = None
    code: int | None = None
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(["run", *argv, "--out", str(out_dir), "--dry-run"])
        except SystemExit as e:   # argparse's one-line errors exit 2
            code = e.code if isinstance(e.code, int) else 1
        except CaseTimeout:
            signal.alarm(0)
            return {"outcome": "timeout", "problems": ["slow dry run"], "argv": _short(argv)}
        except Exception as e:  # noqa: BLE001 - the property under test: nothing escapes
            escaped = e
            stderr.write(traceback.format_exc())
        finally:
            signal.alarm(0)
    outcome, problems = classify(code, stdout.getvalue(), stderr.getvalue(), escaped,
                                 out_dir.exists())
    row: dict[str, Any] = {"outcome": outcome, "problems": problems}
    if problems:
        row["argv"] = _short(argv)
        row["stderr_tail"] = stderr.getvalue()[-600:]
    else:
        row["error"] = stderr.getvalue().strip()[:ERROR_LINE_LIMIT]
    return row


def _short(argv: list[str]) -> list[str]:
    """`argv` with long values cut, for the results file."""
    return [a if len(a) <= 200 else a[:100] + f"...({len(a)} chars)" for a in argv]


# Runs the command line in a child and writes its peak RSS (VmHWM, KiB) to $FEDVL_FUZZ_HWM at
# exit: the kernel's ru_maxrss of a child starts at the parent's size, so it is not used.
_WRAP = """
import atexit, os, runpy, sys
def _hwm():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM"))
    with open(os.environ["FEDVL_FUZZ_HWM"], "w") as out:
        out.write(kib)
atexit.register(_hwm)
sys.argv = ["fedvl", *sys.argv[1:]]
runpy.run_module("fedvl.cli", run_name="__main__")
"""


def child(argv: list[str], timeout: float) -> dict[str, Any]:
    """`fedvl ARGV` as a child process: exit code, output, its own peak RSS (MiB)."""
    hwm = Path(tempfile.mkstemp()[1])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _WRAP, *argv], capture_output=True,
                              text=True, timeout=timeout,
                              env={**os.environ, "FEDVL_FUZZ_HWM": str(hwm)})
    except subprocess.TimeoutExpired:
        return {"exit": None, "timeout": True, "seconds": timeout}
    text = hwm.read_text().strip()
    hwm.unlink()
    return {"exit": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
            "peak_rss_mib": int(text) / 1024 if text else None,
            "seconds": time.perf_counter() - t0}


def real_run(argv: list[str], work: Path, timeout: float) -> dict[str, Any]:
    """One tiny real run of a case (1 round, tiny caps) as a child process."""
    out_dir = work / "run"
    res = child(["run", *argv, "--rounds", "1", "--train-cap", "8", "--test-cap", "4",
                 "--eval-every", "1", "--quiet", "--out", str(out_dir)], timeout)
    problems = []
    if res.get("timeout"):
        return {"outcome": "timeout", "problems": [], "argv": _short(argv)}
    err = res["stderr"]
    errors = [x for x in err.splitlines() if x.startswith("fedvl: error: ")]
    if "Traceback" in err:
        problems.append("traceback")
    if res["exit"] != 0:
        if len(errors) != 1 or not err.endswith(errors[0] + "\n"):
            problems.append("not one error line")
        if any(len(x) > ERROR_LINE_LIMIT for x in errors):
            problems.append("error line over 300 characters")
        if out_dir.exists() and not (out_dir / "checkpoint.pt").exists():
            problems.append("leftover files")
    elif not (out_dir / "summary.json").is_file():
        problems.append("exit 0 without summary.json")
    row = {"outcome": "exit 0" if res["exit"] == 0 else "one-line error", "problems": problems,
           "seconds": round(res["seconds"], 2)}
    if problems:
        row["argv"] = [a if len(a) <= 200 else a[:100] + f"...({len(a)} chars)" for a in argv]
        row["stderr_tail"] = err[-600:]
    return row


HUGE_CAPS = [
    ["--train-cap", "99999999999999999999", "--dry-run"],
    ["--train-cap", "99999999999999999999", "--test-cap", "99999999999999999999", "--dry-run"],
    ["--test-cap", str(2**63), "--dry-run"],
    ["--benchmark", "cifar10-dirichlet", "--train-cap", "99999999999999999999", "--test-cap",
     "99999999999999999999", "--num-clients", "2", "--dry-run"],
    ["--benchmark", "medmnist", "--train-cap", "99999999999999999999", "--test-cap",
     "99999999999999999999", "--num-clients", "2", "--dry-run"],
]


def main_(a: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="fedvl-fuzz-"))
    os.environ["FEDVL_CACHE_DIR"] = str(root / "cache")
    data_dir = tiny_data(root / "data")
    rng = random.Random(a.seed)
    real_build = assemble.build_federation

    def small_federation(cfg: RunConfig):
        # Sizes only: every check of the benchmark and its options still runs.
        return real_build(dataclasses.replace(cfg, train_cap=min(cfg.train_cap or CAP, CAP),
                                              test_cap=min(cfg.test_cap or CAP, CAP)))

    assemble.build_federation = small_federation
    # A huge allocation (a width of 10^5) must fail as MemoryError, not swap the machine.
    resource.setrlimit(resource.RLIMIT_AS, (a.memory_gib << 30, resource.RLIM_INFINITY))
    counts: Counter[str] = Counter()
    by_family: dict[str, Counter[str]] = {}
    failures: list[dict[str, Any]] = []
    passed: list[tuple[str, list[str]]] = []
    failed: list[tuple[str, list[str]]] = []
    slow: list[tuple[float, str, list[str]]] = []
    t0 = time.perf_counter()
    for i in range(a.cases):
        family = rng.choice(["flag", "flag", "yaml", "method-arg", "method-arg", "model-arg",
                             "mixed", "mixed"])
        work = Path(tempfile.mkdtemp(dir=root))
        argv = make_case(family, rng, work, data_dir)
        t_case = time.perf_counter()
        row = dry_run(argv, work, a.case_timeout)
        slow.append((time.perf_counter() - t_case, family, argv))
        slow = sorted(slow, key=lambda x: -x[0])[:10]
        fam = by_family.setdefault(family, Counter())
        for c in (counts, fam):
            c["cases"] += 1
            c[row["outcome"]] += 1
            for p in row["problems"]:
                c[p] += 1
        if row["problems"]:
            failures.append({"case": i, "family": family, **row})
        (passed if row["outcome"] == "exit 0" else failed).append((family, argv))
        if (i + 1) % 500 == 0:
            print(f"{i + 1} cases, {time.perf_counter() - t0:.0f} s: {dict(counts)}", flush=True)
    dry_seconds = time.perf_counter() - t0
    assemble.build_federation = real_build
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    # Real tiny runs: mostly cases that passed the check, some that did not.
    sample = rng.sample(passed, min(len(passed), a.real - a.real // 4))
    sample += rng.sample(failed, min(len(failed), a.real // 4))
    real_counts: Counter[str] = Counter()
    timeouts: list[list[str]] = []
    for family, argv in sample:
        work = Path(tempfile.mkdtemp(dir=root))
        row = real_run(argv, work, a.timeout)
        real_counts["cases"] += 1
        real_counts[row["outcome"]] += 1
        for p in row["problems"]:
            real_counts[p] += 1
        if row["problems"]:
            failures.append({"real_run": True, "family": family, **row})
        if row["outcome"] == "timeout":   # slow, not wrong: listed to show what was slow
            timeouts.append(row["argv"])
        print("real", row["outcome"], row["problems"], flush=True)

    # Huge caps through the real command line, unclamped: clipped before anything is built.
    huge = []
    for argv in HUGE_CAPS:
        extra = ["--data-dir", a.data_dir] if "--benchmark" in argv else []
        if extra and not Path(a.data_dir).is_dir():
            continue
        res = child(["run", *argv, *extra], a.timeout)
        huge.append({"argv": ["fedvl", "run", *argv, *extra], "exit": res.get("exit"),
                     "stderr": (res.get("stderr") or "")[-300:],
                     "peak_rss_mib": round(res.get("peak_rss_mib") or 0, 1),
                     "seconds": round(res.get("seconds", 0), 1)})
        print("huge caps", huge[-1], flush=True)

    goal_keys = ("traceback", "slow dry run", "not one error line",
                 "error line over 300 characters", "leftover files", "exit 0 without passing",
                 "exit 0 without summary.json")
    write_result(a.result, "CPU (2 cores), in-process dry runs, child-process real runs", {
        "seed": a.seed,
        "dry_runs": {"counts": dict(counts), "seconds": round(dry_seconds, 1),
                     "by_family": {k: dict(v) for k, v in sorted(by_family.items())}},
        "real_runs": dict(real_counts),
        "real_run_timeouts": timeouts,
        "huge_caps": huge,
        "property_failures": {k: counts[k] + real_counts[k] for k in goal_keys},
        "goal": "0 tracebacks, 0 errors of several lines, 0 lines over 300 characters, 0 "
                "leftover files",
        "failures": failures[:50],
        "slowest_dry_runs": [{"seconds": round(t, 2), "family": f,
                              "argv": [x if len(x) <= 120 else x[:60] + "..." for x in v]}
                             for t, f, v in slow],
        "note": f"Per-client caps clamped to {CAP} in the in-process dry runs (sizes only); "
                f"address space limited to {a.memory_gib} GiB there; real runs: 1 round, "
                "--train-cap 8 --test-cap 4, as child processes; huge_caps: unclamped child "
                "processes, peak_rss_mib the child's VmHWM.",
    })
    print(f"written: {a.result}: {dict(counts)}; real {dict(real_counts)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--real", type=int, default=30, help="tiny real runs (child processes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per child process")
    p.add_argument("--case-timeout", type=int, default=60, help="seconds per dry run")
    p.add_argument("--memory-gib", type=int, default=8, help="address-space limit, dry runs")
    p.add_argument("--data-dir", default="../shared/data",
                   help="real datasets for the huge-cap cases of cifar10 and medmnist")
    p.add_argument("--result", default="benchmarks/results/fuzz-inputs-cpu.json")
    main_(p.parse_args())

"""Property tests: hostile `fedvl run` input gives one clear error line, never a traceback.

Two inputs are fuzzed with hypothesis, both through the real entry point `fedvl.cli.main`:

* the YAML file of `fedvl run --config FILE`: random documents (real RunConfig field names and
  random keys; ints, huge ints, floats, NaN/inf, strings, lists, nested mappings, null,
  booleans, dates), YAML with random edits, and random bytes;
* `--method-arg KEY=VALUE`: random registered methods with their real option names (and
  random ones), given values of every type as YAML text, including malformed YAML, plus up to
  two run flags (`--FLAG=VALUE`) with hostile values.

Both draw from the case families of `benchmarks/fuzz_inputs.py` (which runs 10,000 of them):
huge ints (2^63, 10^20, 400 digits), negative and zero, NaN, inf, floats past float32 (1e39,
1e308), 100,000-character strings, control characters, wrong types, unknown keys, and a tiny
data folder (`@DATA@`) of npz-domains files, one with labels of 10^7.

Each example runs `fedvl run ... --dry-run`, which makes every check a start makes (config,
device, data, model, method options) and stops before training, so an example takes
milliseconds. The property: exit 0 having written nothing, or exit non-zero with exactly one
line on stderr, `fedvl: error: ...`, no traceback, and the output folder exactly as before.
Data loading is the real `build_federation` with the per-client caps clamped to a few images
(a fuzzed `train_cap: 100000` is a valid request, just a slow one). Failing starts of real
runs, and data files that are damaged, are covered by tests/test_corrupt_files.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedvl.cli import main
from fedvl.config import RunConfig
from fedvl.options import ERROR_LINE_LIMIT, kind_of, option_fields, spec_of
from fedvl.registry import ALGORITHMS, BENCHMARKS, MODELS
from fedvl.run import assemble

# Examples per property (the docs report these numbers as "configs fuzzed"); the environment
# variable raises them for a longer hunt, e.g. FEDVL_FUZZ_EXAMPLES=5000.
YAML_EXAMPLES = int(os.environ.get("FEDVL_FUZZ_EXAMPLES", 300))
METHOD_ARG_EXAMPLES = int(os.environ.get("FEDVL_FUZZ_EXAMPLES", 200))
# Derandomized: the same examples on every machine, so a failure is reproducible in CI.
FUZZ = {"deadline": None, "database": None, "derandomize": True,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}

FIELDS = list(RunConfig().to_dict())   # the YAML keys, in config.yaml's order
# Strings that mean something to some field, so random documents reach the deeper checks.
WORDS = sorted({*ALGORITHMS.base_names(), "fedprox+vhl", "fedavg+nope", *BENCHMARKS.names(),
                *MODELS.names(), "cpu", "cuda", "cuda:0", "cuda:x", "auto", "alternate", "real",
                "virtual", "stats", "noise", "samples", "uniform", "median", "trimmed-mean",
                "handwritten", "printed-clean", "mnist", ".", "..", "/", "", " ", "a,b",
                "@DATA@", "@DATA@/bad-labels"})
# The `fedvl run` settings every "nearly valid" document starts from: a tiny, fast check.
TINY = {"method": "fedavg", "benchmark": "digits-offline", "rounds": 1, "train_cap": 4,
        "test_cap": 2, "model_args": {"width": 4, "depth": 1}}
# A valid request for a huge federation is slow, not wrong; the checks see a few images.
CAP = 4

ints = st.one_of(st.integers(-3, 40),
                 st.sampled_from([0, -1, 2**31, -2**31, 2**63, 2**64 + 1, 10**20, 10**30,
                                  -10**30, 10**400]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, 0.5, 1.0, -0.1, 1.5, 1e-300, 1e300, 1e39, 3.5e38,
                                    -1e308]))
# Values long enough to flood an error line if one were echoed whole.
LONG = ["x" * 100_000, ",".join(["mnist"] * 2000), "\x1b[31m" * 50]
texts = st.one_of(st.text(max_size=12), st.sampled_from(WORDS), st.sampled_from(LONG))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts,
                    st.dates(min_value=datetime.date(1, 1, 1)))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.one_of(texts, st.sampled_from(
                                ["width", "depth", "norm", "mu"])), inner, max_size=3)),
    max_leaves=8)
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=10), ints, st.none(), st.booleans())
model_args = st.dictionaries(st.one_of(st.sampled_from(["width", "depth", "norm"]), texts),
                             st.one_of(st.integers(-2, 16), values), max_size=3)
field_values = st.one_of(values, model_args)


def plausible(f: dataclasses.Field) -> st.SearchStrategy:
    """Values of the option's own type near its limits: what a user might really write."""
    base = kind_of(f).base
    choices = spec_of(f).choices
    choices = list(choices() if callable(choices) else choices or [])
    if base == "int":
        return st.integers(-1, 8)
    if base == "float":
        return st.sampled_from([-0.5, 0.0, 0.05, 0.3, 0.5, 0.99, 1.0, 1.5])
    if base == "bool":
        return st.booleans()
    if base == "str":
        return st.sampled_from(choices or WORDS)
    if base == "list":
        return st.lists(st.sampled_from(choices or WORDS), max_size=3)
    return model_args if f.name == "model_args" else values


FIELD = {f.name: f for f in option_fields(RunConfig)}


def _fields(names: list[str]) -> st.SearchStrategy:
    """A mapping of the given fields to plausible or random values."""
    return st.fixed_dictionaries({n: st.one_of(plausible(FIELD[n]), plausible(FIELD[n]),
                                               field_values) for n in names})


nearly_valid = st.builds(lambda extra: {**TINY, **extra},
                         st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)
                         .flatmap(_fields))
any_mapping = st.dictionaries(keys, field_values, max_size=5)
documents = st.one_of(nearly_valid, nearly_valid, any_mapping, values)


def _dump(doc: object) -> bytes:
    """`doc` as the bytes of a YAML file."""
    return yaml.safe_dump(doc, allow_unicode=True).encode()


@st.composite
def config_files(draw: st.DrawFn) -> bytes:
    """The bytes of a `--config` file: YAML, YAML with a random edit, or random bytes."""
    kind = draw(st.sampled_from(["yaml", "yaml", "yaml", "edited", "text", "bytes"]))
    if kind == "yaml":
        return _dump(draw(documents))
    if kind == "edited":
        raw = _dump(draw(nearly_valid))
        at = draw(st.integers(0, len(raw)))
        cut = draw(st.integers(0, 4))
        return raw[:at] + draw(st.binary(max_size=4)) + raw[at + cut:]
    if kind == "text":
        return draw(st.text(max_size=80)).encode("utf-8", "surrogatepass")
    return draw(st.binary(max_size=80))


# Registered methods and their real options (the base methods; compositions reuse them).
METHOD_OPTIONS = {m: {f.name: f for f in dataclasses.fields(ALGORITHMS.get(m).Params)}
                  for m in ALGORITHMS.base_names()}
yaml_texts = st.one_of(
    st.text(max_size=10),
    st.sampled_from(["", "nan", ".nan", ".inf", "-.inf", "1e400", "[1, 2]", "{a: 1}", "true",
                     "null", "~", "[", "{", "'", "a: b: c", "!!python/object:os.system", "&a [*a]",
                     "*b", "- x", "!!binary aGk=", "2024-01-01", "0x10", "1_000", "-0", "all",
                     "sampled", "stats", "noise", "real", "cosine"]),
    ints.map(str), floats.map(repr), st.sampled_from(LONG))


# Run flags that take a value (bool flags take none), for the hostile `--FLAG=VALUE` family.
RUN_FLAGS = {f"--{spec_of(f).flag or f.name.replace('_', '-')}": f
             for f in option_fields(RunConfig)
             if spec_of(f).cli and kind_of(f).base != "bool"}


@st.composite
def run_flags(draw: st.DrawFn) -> list[str]:
    """Up to two run flags with values of their own type near the limits, or hostile text."""
    flags = draw(st.lists(st.sampled_from(sorted(RUN_FLAGS)), max_size=2, unique=True))
    return [f"{flag}={draw(st.one_of(plausible(RUN_FLAGS[flag]).map(str), yaml_texts))}"
            for flag in flags]


@st.composite
def method_args(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A registered method and `--method-arg` items: its real option names or random keys."""
    method = draw(st.sampled_from(sorted(METHOD_OPTIONS)))
    options = METHOD_OPTIONS[method]
    items = []
    for _ in range(draw(st.integers(1, 3))):
        # Mostly real options, so that many examples pass and reach the method's own checks.
        kind = draw(st.sampled_from(["real"] * 6 + ["random key", "no ="]))
        if kind == "real" and options:
            name = draw(st.sampled_from(sorted(options)))
            plain = plausible(options[name]).map(_yaml_text)
            value = draw(st.one_of(plain, plain, yaml_texts))
            items.append(f"{name}={value}")
        elif kind == "no =":
            items.append(draw(st.text(max_size=8)))
        else:
            items.append(f"{draw(st.text(max_size=8))}={draw(yaml_texts)}")
    return method, items


def _yaml_text(value: object) -> str:
    """`value` as the YAML text a user would type after `KEY=`."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


STATS: Counter[str] = Counter()


def tiny_domains(folder: Path) -> None:
    """npz-domains files: two good domains, and `bad-labels/` with a label of 10^7."""
    rng = np.random.default_rng(0)
    (folder / "bad-labels").mkdir(parents=True)
    for path, top in ((folder / "d1.npz", 9), (folder / "d2.npz", 9),
                      (folder / "bad-labels" / "d1.npz", 9),
                      (folder / "bad-labels" / "big.npz", 10**7)):
        y = np.arange(12) % 10
        y[-1] = top
        np.savez(path, x_train=rng.integers(0, 256, (12, 8, 8), dtype=np.uint8), y_train=y,
                 x_test=rng.integers(0, 256, (4, 8, 8), dtype=np.uint8), y_test=np.arange(4))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A scratch folder, a private data cache, and data loading with clamped per-client caps."""
    root = tmp_path_factory.mktemp("fuzz")
    real = assemble.build_federation

    def small_federation(cfg: RunConfig):
        # Only the sizes change; every check of the benchmark and its options still runs.
        return real(dataclasses.replace(cfg, train_cap=min(cfg.train_cap or CAP, CAP),
                                        test_cap=min(cfg.test_cap or CAP, CAP)))

    tiny_domains(root / "data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDVL_CACHE_DIR", str(root / "cache"))
        mp.setattr(assemble, "build_federation", small_federation)
        yield root
    print(f"\nfuzzed `fedvl run` inputs: {dict(sorted(STATS.items()))}")


def run_cli(root: Path, argv: list[str], what: str) -> tuple[int, str]:
    """Run `fedvl` in-process on `argv` + a fresh --out; check the property; (exit code, err)."""
    argv = [a.replace("@DATA@", str(root / "data")) for a in argv]
    work = Path(tempfile.mkdtemp(dir=root))
    out_parent = work / "out"
    out_parent.mkdir()
    (out_parent / "keep.txt").write_text("an earlier file\n")
    before = sorted(p.name for p in out_parent.iterdir())
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main([*argv, "--out", str(out_parent / "run"), "--dry-run"])
        except SystemExit as e:  # argparse's own usage errors; not expected from these inputs
            code = e.code if isinstance(e.code, int) else 1
    err = stderr.getvalue()
    assert "Traceback" not in err
    # A check writes nothing, whether it passes or fails.
    assert sorted(p.name for p in out_parent.iterdir()) == before
    if code == 0:
        assert "passed every check" in stdout.getvalue(), stdout.getvalue()
        assert err == "", err
        STATS[f"{what} ok"] += 1
    else:
        # One line, and no raw control characters from the input (escapes, newlines).
        assert err.endswith("\n") and err.count("\n") == 1, err
        line = err[:-1]
        assert line.isprintable(), err
        assert line.startswith("fedvl: error: ") and len(line) > 30, err
        # Bounded: a huge value is shown shortened, not dumped whole into the message.
        assert len(line) <= ERROR_LINE_LIMIT, err
        STATS[f"{what} rejected"] += 1
    return code, err


@settings(max_examples=YAML_EXAMPLES, **FUZZ)
@given(content=config_files())
def test_fuzzed_config_file_runs_or_is_one_clear_error(sandbox, content):
    """Any --config file: a passing check, or one `fedvl: error:` line naming the problem."""
    work = Path(tempfile.mkdtemp(dir=sandbox))
    cfg = work / "run.yaml"
    cfg.write_bytes(content.replace(b"@DATA@", str(sandbox / "data").encode()))
    code, err = run_cli(sandbox, ["run", "--config", str(cfg)], "config file")
    if code != 0:
        # The message points somewhere: at the file, a field of it, or the part of the run
        # (model, method, data) that a valid-looking value turned out not to fit.
        named = [str(cfg), "config field", "model", "method", "benchmark", "data ", "domain",
                 "device", "norm"]
        assert any(word in err for word in named), err


@settings(max_examples=METHOD_ARG_EXAMPLES, **FUZZ)
@given(case=method_args(), flags=run_flags())
def test_fuzzed_method_args_run_or_are_one_clear_error(sandbox, case, flags):
    """Any --method-arg items (and run flags): a passing check, or one `fedvl: error:` line
    naming the option."""
    method, items = case
    argv = ["run", "--method", method, "--rounds", "1", "--train-cap", "4", "--test-cap", "2",
            "--width", "4", "--depth", "1"]
    # `--method-arg=ITEM`: an item starting with '-' must not be read as a flag by argparse.
    argv += [f"--method-arg={item}" for item in items] + flags
    code, err = run_cli(sandbox, argv, "method args")
    if code != 0:
        # The message names the item, the method, or one of its options (rules that span
        # several options name the one to change: "differential privacy needs init 'noise'"),
        # or what a run flag set: the flag's field, the data, the model or the device.
        named = ["--method-arg", "option", method, *METHOD_OPTIONS[method]]
        if flags:
            named += [f.split("=")[0].lstrip("-").replace("-", "_") for f in flags]
            named += [f.split("=")[0] for f in flags]
            named += ["config field", "model", "benchmark", "data", "domain", "device",
                      "clients", "argument"]
        assert any(word in err for word in named), err


def test_one_known_good_config_passes_the_check(sandbox, tmp_path):
    """The tiny base document of the fuzzer is itself valid (so "ok" examples are reachable)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(_dump(TINY))
    assert run_cli(sandbox, ["run", "--config", str(cfg)], "fixed")[0] == 0


# What the fuzzer and the probing around it found; each was a traceback, a message of several
# lines (or with raw control characters), or a silently accepted value.
FOUND = [
    ("keys of mixed types", b"0: {}\n? ''\n: {}\n", "unknown config key(s) ['', 0]"),
    ("a null key", b"null: {}\n", "unknown config key(s) [None]"),
    ("a control character", b"\x1f", "is not valid YAML: unacceptable character #x001f"),
    ("a YAML syntax error", b"rounds: [1,\n", "is not valid YAML: expected the node content"),
    ("not UTF-8", "method: fédavg\n".encode("latin-1"), "is not UTF-8 text (byte 9"),
    ("an int past Python's digit limit", b"rounds: " + b"9" * 5000 + b"\n",
     "holds a value that cannot be read"),
    ("nesting 5000 deep", b"[" * 5000 + b"]" * 5000, "is nested too deeply"),
    ("a list, not a mapping", b"[]\n", "got a value of type list"),
    ("a number, not a mapping", b"0\n", "got a value of type int"),
    ("NaN learning rate", b"lr: .nan\n", "config field 'lr' must be a finite number, got nan"),
    ("NaN client ratio", b"client_ratio: .nan\n", "'client_ratio' must be a finite number"),
    ("infinite alpha", b"alpha: .inf\n", "'alpha' must be a finite number, got inf"),
    ("an int too large for a float", b"lr: " + b"9" * 400 + b"\n", "must be a finite number"),
    ("negative seed", b"seed: -1\n", "config field 'seed' = -1 is invalid; must be >= 0"),
    ("threads past an int", b"threads: 4294967296\n", "'threads' = 4294967296 is invalid"),
    ("image side 0", b"image_size: 0\n", "'image_size' = 0 is invalid; must be in [1, 1024]"),
    ("image too small for the model", b"method: fedavg\nimage_size: 1\ntrain_cap: 4\n"
     b"model_args: {width: 4, depth: 1}\n", "model 'convnet' with options"),
    ("a method name with a newline", b'method: "fed\\navg"\n', "unknown method 'fed\\navg'"),
    ("an escape sequence in data_dir", b'benchmark: digits\ndata_dir: "\\e[31mred"\n',
     "data directory '\\x1b[31mred' does not exist"),
    ("a NUL byte in data_dir", b'benchmark: digits\ndata_dir: "a\\0b"\n',
     "data directory 'a\\x00b' does not exist"),
    ("an unknown user's home", b'benchmark: digits\ndata_dir: "~nosuchuser/x"\n',
     "data directory '~nosuchuser/x' cannot be used"),
    ("50 unknown keys", "".join(f"k{i}: 1\n" for i in range(50)).encode(), "'k17', ...]"),
    ("2^63 - 1 clients per domain", b"method: fedavg\npartitions: 9223372036854775807\n",
     "clients cannot split"),
    ("2^63 - 1 clients of npz domains", b"benchmark: npz-domains\ndata_dir: '@DATA@'\n"
     b"partitions: 9223372036854775807\n", "clients cannot split"),
    ("10^20 clients", b"partitions: 100000000000000000000\n",
     "'partitions' must be an integer within int64's range"),
    ("an lr past float32", b"lr: 1.0e+39\n", "within float32's range"),
    ("2^63 local epochs (a 1-round run that never ends)", b"local_epochs: 9223372036854775808\n",
     "config field 'local_epochs' must be an integer within int64's range"),
    ("a negative CUDA index (a torch RuntimeError)", b"device: cuda:-1\n",
     "config field 'device' = 'cuda:-1' is invalid; allowed: cpu, cuda, cuda:N, auto"),
    ("depth 2^64 + 1 (a ConvNet built layer by layer, forever)",
     b"model_args: {depth: 18446744073709551617}\n",
     "model option 'depth' = 18446744073709551617 is invalid; must be in [1, 64]"),
    ("width 5000 (14 GB per convolution)", b"model_args: {width: 5000}\n",
     "model option 'width' = 5000 is invalid; must be in [1, 4096]"),
    ("labels of 10^7", b"benchmark: npz-domains\ndata_dir: '@DATA@/bad-labels'\n",
     "holds label 10000000; allowed: 0..9"),
    ("a 100,000-character domain", b"domains: [" + b"x" * 100_000 + b"]\n",
     "unknown digits-offline domain(s) ['xxxx"),
]


@pytest.mark.parametrize("case, content, fragment", FOUND, ids=[c[0] for c in FOUND])
def test_found_by_fuzzing_config_files(sandbox, case, content, fragment):
    """Each input the fuzzer broke on: now one clear line (the fragment shows which)."""
    cfg = Path(tempfile.mkdtemp(dir=sandbox)) / "run.yaml"
    cfg.write_bytes(content.replace(b"@DATA@", str(sandbox / "data").encode()))
    code, err = run_cli(sandbox, ["run", "--config", str(cfg)], "found")
    assert code == 2 and fragment in err, err


def test_empty_domain_list_means_every_domain(sandbox, tmp_path):
    """`domains: []` (or `--domains ""`) was an IndexError; it now means no subset."""
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(_dump({**TINY, "domains": []}))
    assert run_cli(sandbox, ["run", "--config", str(cfg)], "found")[0] == 0


METHOD_ARGS_FOUND = [
    ("mu=[", "--method-arg 'mu=[': the value is not valid YAML (expected the node content"),
    ("mu=\x1b[31m", "--method-arg 'mu=\\x1b[31m': the value is not valid YAML"),
    ("a\x1eb", "--method-arg 'a\\x1eb' must look like KEY=VALUE"),
    ("=1", "--method-arg '=1' must look like KEY=VALUE"),
    ("mu=" + "9" * 5000, "the value cannot be read (ValueError)"),
    ("mu=" + "[" * 3000 + "]" * 3000, "the value cannot be read (RecursionError)"),
    ("mu=.nan", "fedprox option 'mu' must be a finite number, got nan"),
    ("mu=1.0e+400", "fedprox option 'mu' must be a finite number, got inf"),
    ("mu=!!python/name:os.system", "could not determine a constructor"),
    # A denormal noise squared to 0.0: a ZeroDivisionError in the privacy accountant.
    ("dp_noise=1e-320", "fedprox option 'dp_noise' must be 0 or at least float32's smallest "
     "normal number"),
]


@pytest.mark.parametrize("item, fragment", METHOD_ARGS_FOUND,
                         ids=[ascii(c[0][:16]) for c in METHOD_ARGS_FOUND])
def test_found_by_fuzzing_method_args(sandbox, item, fragment):
    """Each `--method-arg` the fuzzer broke on: now one clear line."""
    code, err = run_cli(sandbox, ["run", "--method", "fedprox", f"--method-arg={item}"], "found")
    assert code == 2 and fragment in err, err

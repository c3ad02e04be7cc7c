"""Damaged inputs and failed starts: one clear error line naming the file, nothing half-written.

Each data case builds a tiny fake `--data-dir` in tmp_path (the shared datasets are never
copied) with one damaged `digits/mnist.npz`, runs `fedvl run` in-process and checks the one
`fedvl: error:` line: it names the file and says what is wrong. `CASES` is the table the docs
reproduce. The second half checks that a start which fails removes what it created.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedvl.cli import main
from fedvl.engine.recorder import RunRecorder

TINY_RUN = ["run", "--benchmark", "digits", "--domains", "mnist", "--method", "fedavg",
            "--rounds", "1", "--train-cap", "20", "--test-cap", "10", "--width", "4",
            "--depth", "1", "--quiet"]


def good_arrays(n_train: int = 40, n_test: int = 20) -> dict[str, np.ndarray]:
    """A valid, tiny DIGITS domain: uint8 N x 28 x 28 x 1 images, int64 labels 0..9."""
    rng = np.random.default_rng(0)
    return {"x_train": rng.integers(0, 256, (n_train, 28, 28, 1), dtype=np.uint8),
            "y_train": np.arange(n_train, dtype=np.int64) % 10,
            "x_test": rng.integers(0, 256, (n_test, 28, 28, 1), dtype=np.uint8),
            "y_test": np.arange(n_test, dtype=np.int64) % 10}


def npz_bytes(arrays: dict[str, np.ndarray], compressed: bool = True) -> bytes:
    """The bytes of an `.npz` holding `arrays`."""
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def _flip_inside_member(raw: bytes) -> bytes:
    """Flip one byte in the middle of the first member's compressed data (the CRC catches it)."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        info = z.infolist()[0]
    # Local header: 30 bytes + name + extra field, then the data.
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    b = bytearray(raw)
    b[start + info.compress_size // 2] ^= 0xFF
    return bytes(b)


def _break_header(raw: bytes) -> bytes:
    """Overwrite part of the first .npy header of an uncompressed archive (CRC left stale)."""
    at = raw.index(b"'descr'")
    return raw[:at] + b"'d\x00\x9e\nr'" + raw[at + 7:]


def _without(key: str) -> bytes:
    """A valid archive with array `key` left out."""
    arrays = good_arrays()
    del arrays[key]
    return npz_bytes(arrays)


def _replace(**changes: np.ndarray) -> bytes:
    """A valid archive with some arrays replaced."""
    return npz_bytes({**good_arrays(), **changes})


GOOD = npz_bytes(good_arrays())
# (case, file bytes, fragments the error line must contain). The docs table lists these.
CASES = [
    ("truncated to half", GOOD[: len(GOOD) // 2], ["is not a readable .npz", "BadZipFile"]),
    ("truncated to 10 bytes", GOOD[:10], ["is not a readable .npz", "BadZipFile"]),
    ("empty file", b"", ["is not a readable .npz archive: it is empty"]),
    ("garbage bytes", b"this is not a numpy archive\n" * 4,
     ["is not a readable .npz archive: it starts with b'this'"]),
    ("a byte flipped inside a member", _flip_inside_member(GOOD),
     ["is not a readable .npz", "Bad CRC-32"]),
    ("an .npy header overwritten", _break_header(npz_bytes(good_arrays(), compressed=False)),
     ["is not a readable .npz", "header"]),
    ("array y_test missing", _without("y_test"), ["lacks array(s) ['y_test']"]),
    ("object array (pickled)", _replace(y_train=np.array([None] * 40, dtype=object)),
     ["holds an array of Python objects (a pickle), which is never loaded"]),
    ("images float32", _replace(x_train=good_arrays()["x_train"].astype(np.float32)),
     ["'x_train' must hold uint8 images", "float32"]),
    ("images flattened N x 784", _replace(x_train=np.zeros((40, 784), np.uint8)),
     ["'x_train' must hold uint8 images", "(40, 784)"]),
    ("images with 4 channels", _replace(x_test=np.zeros((20, 28, 28, 4), np.uint8)),
     ["'x_test' must hold uint8 images", "(20, 28, 28, 4)"]),
    ("no training images", _replace(x_train=np.zeros((0, 28, 28, 1), np.uint8),
                                    y_train=np.zeros(0, np.int64)),
     ["'x_train' holds no images"]),
    ("labels float64", _replace(y_train=np.zeros(40)), ["'y_train' must hold integer labels"]),
    ("labels N x 1", _replace(y_test=np.zeros((20, 1), np.int64)),
     ["'y_test' must hold integer labels", "(20, 1)"]),
    ("one label short", _replace(y_train=np.zeros(39, np.int64)),
     ["40 images in 'x_train' but 39 labels in 'y_train'"]),
    ("label 12 in a 10-class set", _replace(y_train=np.arange(40, dtype=np.int64) % 13),
     ["'y_train' holds labels 0..12; allowed: 0..9"]),
    ("negative label", _replace(y_test=np.arange(20, dtype=np.int64) - 1),
     ["'y_test' holds labels -1..18; allowed: 0..9"]),
]


def one_error_line(capsys) -> str:
    """The single stderr line of a failed command (asserting it is one line, no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("fedvl: error: "), err
    return err.strip()


@pytest.mark.parametrize("case, content, fragments", CASES, ids=[c[0] for c in CASES])
def test_damaged_digits_file_is_one_clear_error_naming_it(tmp_path, capsys, case, content,
                                                          fragments):
    """A damaged `digits/mnist.npz`: exit 2, one line naming the file and the problem."""
    data = tmp_path / "data"
    (data / "digits").mkdir(parents=True)
    bad = data / "digits" / "mnist.npz"
    bad.write_bytes(content)
    out = tmp_path / "runs" / "r"
    assert main([*TINY_RUN, "--data-dir", str(data), "--out", str(out)]) == 2
    line = one_error_line(capsys)
    assert f"'{bad}'" in line, line
    for fragment in fragments:
        assert fragment in line, (case, line)
    assert not (tmp_path / "runs").exists()
    print(f"{case}: {line}")


def test_fake_digits_dir_runs(tmp_path, capsys):
    """The undamaged fake file runs, so the cases above fail only by their damage."""
    data = tmp_path / "data"
    (data / "digits").mkdir(parents=True)
    (data / "digits" / "mnist.npz").write_bytes(GOOD)
    out = tmp_path / "run"
    assert main([*TINY_RUN, "--data-dir", str(data), "--out", str(out)]) == 0
    assert (out / "summary.json").is_file()


@pytest.mark.parametrize("benchmark, rel", [("cifar10-dirichlet", "cifar10.npz"),
                                            ("medmnist", "medmnist/pneumoniamnist.npz")])
def test_truncated_file_of_other_benchmarks(tmp_path, capsys, benchmark, rel):
    """CIFAR-10 and MedMNIST read through the same checked loader."""
    bad = tmp_path / rel
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(GOOD[:100])
    assert main(["run", "--benchmark", benchmark, "--data-dir", str(tmp_path), "--method",
                 "fedavg", "--out", str(tmp_path / "run"), "--dry-run"]) == 2
    line = one_error_line(capsys)
    assert f"'{bad}'" in line and "is not a readable .npz" in line
    assert not (tmp_path / "run").exists()


def test_data_dir_that_is_a_file(tmp_path, capsys):
    """`--data-dir` naming a file says so (not "does not exist")."""
    f = tmp_path / "f.txt"
    f.write_text("x")
    assert main(["run", "--benchmark", "digits", "--data-dir", str(f), "--dry-run"]) == 2
    assert "is not a directory" in one_error_line(capsys)


def test_damaged_config_yaml_on_resume_names_the_file(tmp_path, capsys):
    """`--resume` of a run whose config.yaml is damaged: one line naming that file."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_bytes(b"rounds: [1,\n")
    assert main(["run", "--resume", str(run)]) == 2
    line = one_error_line(capsys)
    assert str(run / "config.yaml") in line and "is not valid YAML" in line
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


# -- failed starts ---------------------------------------------------------------------------
@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A fake `--data-dir` with one good tiny DIGITS domain."""
    d = tmp_path / "data"
    (d / "digits").mkdir(parents=True)
    (d / "digits" / "mnist.npz").write_bytes(GOOD)
    return d


def _fail_in_round(monkeypatch, exc: BaseException, after_calls: int = 0) -> None:
    """Make the run fail while writing metrics, after `after_calls` successful writes."""
    calls = []
    real = RunRecorder.write_metrics

    def write_metrics(self, history):
        if len(calls) >= after_calls:
            raise exc
        calls.append(1)
        real(self, history)

    monkeypatch.setattr(RunRecorder, "write_metrics", write_metrics)


def test_failed_start_removes_the_run_directory_it_created(data_dir, tmp_path, capsys,
                                                           monkeypatch):
    """A run failing in round 1 leaves no directory behind, parents it created included."""
    _fail_in_round(monkeypatch, ValueError("disk says no"))
    out = tmp_path / "new" / "nested" / "run"
    assert main([*TINY_RUN, "--data-dir", str(data_dir), "--out", str(out)]) == 2
    assert one_error_line(capsys) == "fedvl: error: disk says no"
    assert not (tmp_path / "new").exists()


def test_failed_start_keeps_a_directory_that_existed(data_dir, tmp_path, capsys, monkeypatch):
    """In a directory that existed, only what the failed start wrote is removed."""
    _fail_in_round(monkeypatch, ValueError("disk says no"))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me\n")
    assert main([*TINY_RUN, "--data-dir", str(data_dir), "--out", str(out)]) == 2
    one_error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me\n"


def test_interrupted_start_is_removed_too(data_dir, tmp_path, monkeypatch):
    """Ctrl-C before the first checkpoint: nothing to resume, so nothing is left."""
    _fail_in_round(monkeypatch, KeyboardInterrupt())
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        main([*TINY_RUN, "--data-dir", str(data_dir), "--out", str(out)])
    assert not out.exists()


def test_failure_after_a_checkpoint_keeps_the_resumable_run(data_dir, tmp_path, capsys,
                                                            monkeypatch):
    """A run that failed after round 1 was checkpointed is kept: `--resume` continues it."""
    _fail_in_round(monkeypatch, ValueError("disk full"), after_calls=1)
    out = tmp_path / "run"
    args = [*TINY_RUN, "--data-dir", str(data_dir), "--out", str(out)]
    args[args.index("--rounds") + 1] = "2"
    assert main(args) == 2
    one_error_line(capsys)
    assert {"config.yaml", "checkpoint.pt", "metrics.jsonl"} <= {p.name for p in out.iterdir()}
    monkeypatch.undo()
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert (out / "summary.json").is_file()


def test_out_path_that_is_a_file_is_one_error(data_dir, tmp_path, capsys):
    """`--out` naming an existing file: one line, and the file is untouched."""
    out = tmp_path / "taken"
    out.write_text("not a directory\n")
    assert main([*TINY_RUN, "--data-dir", str(data_dir), "--out", str(out)]) == 2
    line = one_error_line(capsys)
    assert "cannot create run directory" in line and str(out) in line
    assert out.read_text() == "not a directory\n"


def test_dry_run_writes_nothing(data_dir, tmp_path, capsys):
    """`--dry-run` checks everything a start checks and creates no run directory."""
    out = tmp_path / "run"
    assert main([*TINY_RUN, "--data-dir", str(data_dir), "--out", str(out), "--dry-run"]) == 0
    assert "passed every check" in capsys.readouterr().out
    assert not out.exists()

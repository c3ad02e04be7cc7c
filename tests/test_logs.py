"""`--log tensorboard,wandb`: the numbers of metrics.jsonl, each client's ε and the PNG grids of
virtual data, logged per round on both transports; a resumed run logs no round twice; a bad
kind or a missing package is one error before anything is written.

TensorBoard's event files are read back with its own `EventAccumulator`. W&B is not installed
here: its path runs against a stand-in `wandb` module put in `sys.modules`, which records what
fedvl hands it; the error for the missing package is the real one.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedvl.cli import main
from fedvl.config import ConfigError, RunConfig, validate
from fedvl.engine.driver import TIMING_KEYS
from fedvl.engine.logs import TENSORBOARD_DIR, WANDB_DIR, WANDB_ID, check_logs, read_png
from fedvl.engine.recorder import RunRecorder
from fedvl.run.experiment import resume_experiment, run_experiment
from tests.conftest import SMALL_ARGS

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

DOMAINS = ["handwritten", "printed-clean", "handwritten-thick"]


def tiny(method: str = "fedavg", rounds: int = 2, **kw: Any) -> RunConfig:
    """A 2-round run on three digits-offline clients, width-8 ConvNet, logged to TensorBoard."""
    values: dict[str, Any] = dict(
        method=method, benchmark="digits-offline", domains=DOMAINS, rounds=rounds, train_cap=40,
        test_cap=20, batch_size=16, lr=0.05, momentum=0.0, threads=1, workers=1,
        model_args={"width": 8, "depth": 2, "norm": "instance"}, log=["tensorboard"])
    values.update(kw)
    return RunConfig(**values)


def rows(run: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def events(run: Path) -> EventAccumulator:
    """Every event TensorBoard would show for the run (nothing sampled away)."""
    acc = EventAccumulator(str(run / TENSORBOARD_DIR), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def logged(run: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the run's TensorBoard scalars."""
    acc = events(run)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(v: float) -> float:
    """`v` as TensorBoard keeps a scalar (32-bit float)."""
    return float(np.float32(v))


def expected(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """What the logs must hold, read straight from metrics.jsonl: tag -> [(round, value)]."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        flat = {k: r[k] for k in ("mean_accuracy", "train_loss", "round_bytes_up",
                                  "round_bytes_down", "round_bytes_peer") if k in r}
        for key in ("per_client_accuracy", "per_client_loss"):
            flat.update({f"{key}/{c}": v for c, v in r.get(key, {}).items()})
        for tag, v in flat.items():
            out.setdefault(tag, []).append((r["round"], f32(v)))
    return out


def test_tensorboard_holds_each_round_and_client_of_metrics_jsonl(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_experiment(tiny(), out=run)
    records = rows(run)
    assert [r["round"] for r in records] == [0, 1]
    want = expected(records)
    assert {f"per_client_accuracy/{d}" for d in DOMAINS} <= set(want)
    assert {f"per_client_loss/{d}" for d in DOMAINS} <= set(want)
    assert {"round_bytes_up", "round_bytes_down", "mean_accuracy"} <= set(want)
    assert logged(run) == want
    # config.yaml records the option, so a resumed run logs to the same kinds.
    assert "log:\n- tensorboard\n" in (run / "config.yaml").read_text()


def test_logging_changes_no_number_and_no_logs_leave_no_trace(tmp_path: Path) -> None:
    plain, logged_run = tmp_path / "plain", tmp_path / "logged"
    run_experiment(tiny(log=None), out=plain)
    run_experiment(tiny(), out=logged_run)
    assert not (plain / TENSORBOARD_DIR).exists() and not (plain / WANDB_DIR).exists()
    assert "log:" not in (plain / "config.yaml").read_text()

    def untimed(run: Path) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows(run)]

    assert untimed(plain) == untimed(logged_run)


def test_dp_runs_log_each_clients_epsilon(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny(method_args={"dp_noise": 1.0, "dp_clip": 10.0})
    summary = run_experiment(cfg, out=run)
    eps = summary["privacy"]["epsilon"]
    assert set(eps) == set(DOMAINS)
    got = logged(run)
    for client, final in eps.items():
        steps = got[f"epsilon/{client}"]
        assert [s for s, _ in steps] == [0, 1]
        # ε composes every DP step so far: it grows, and the last round's is the summary's.
        assert steps[0][1] < steps[1][1] == f32(final)
    # The other tags are the metrics rows', as without DP.
    assert {t: v for t, v in got.items() if not t.startswith("epsilon/")} == expected(rows(run))


def _images(run: Path) -> dict[str, tuple[int, np.ndarray]]:
    """image tag -> (step, RGB pixels) of the run's TensorBoard images."""
    from PIL import Image

    acc = events(run)
    out = {}
    for tag in acc.Tags()["images"]:
        (event,) = acc.Images(tag)
        with Image.open(io.BytesIO(event.encoded_image_string)) as im:
            out[tag] = (event.step, np.asarray(im.convert("RGB")))
    return out


def fedlgd(**kw: Any) -> RunConfig:
    """FedLGD at its smallest: it saves its global and local virtual sets as PNG grids."""
    return tiny("fedlgd", method_args=dict(SMALL_ARGS["fedlgd"]), **kw)


def test_virtual_data_grids_are_logged_as_the_pngs_saved(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = run_experiment(fedlgd(), out=run)
    pngs = summary["images"]
    assert "global_virtual.png" in pngs and len(pngs) == 1 + len(DOMAINS)
    images = _images(run)
    assert set(images) == {f"images/{p[:-4]}" for p in pngs}
    for png in pngs:
        step, pixels = images[f"images/{png[:-4]}"]
        assert step == 1   # the last round
        assert np.array_equal(pixels, read_png(run / png))


def test_resume_after_an_interrupted_round_logs_no_round_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    real = RunRecorder.save_checkpoint

    def crash_after_logging_round_1(self: RunRecorder, ck: dict) -> None:
        if ck["round"] == 1:   # round 1 is in metrics.jsonl and the logs, not in a checkpoint
            raise KeyboardInterrupt
        real(self, ck)

    monkeypatch.setattr(RunRecorder, "save_checkpoint", crash_after_logging_round_1)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(tiny(rounds=3), out=run)
    assert {s for s, _ in logged(run)["mean_accuracy"]} == {0, 1}
    monkeypatch.setattr(RunRecorder, "save_checkpoint", real)
    resume_experiment(run)   # runs rounds 1 and 2 again: round 1 twice on disk
    assert len(list((run / TENSORBOARD_DIR).iterdir())) == 2   # one event file per attempt
    records = rows(run)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert logged(run) == expected(records)   # each step once: purge_step hid the first


def test_extending_a_finished_run_logs_only_the_new_rounds(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_experiment(tiny(rounds=2), out=run)
    resume_experiment(run, rounds=3)
    records = rows(run)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert logged(run) == expected(records)


# -- Weights & Biases, through a stand-in module ------------------------------------------------
class FakeWandbRun:
    """What `wandb.init` returns: it records the logged dicts and how the run finished."""

    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def log(self, values: dict[str, Any], step: int) -> None:
        self.calls.append(("log", (step, dict(values))))

    def finish(self, exit_code: int = 0) -> None:
        self.calls.append(("finish", exit_code))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """A `wandb` module in sys.modules recording every call fedvl makes; the call list."""
    calls: list[tuple[str, Any]] = []
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)   # found by find_spec

    def init(**kw: Any) -> FakeWandbRun:
        calls.append(("init", kw))
        return FakeWandbRun(calls)

    class Image:
        def __init__(self, data: np.ndarray, caption: str = "") -> None:
            self.data, self.caption = data, caption

    mod.init, mod.Image = init, Image
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_wandb_gets_the_same_numbers_offline_and_a_resumed_run_continues_it(
        tmp_path: Path, fake_wandb: list[tuple[str, Any]]) -> None:
    run = tmp_path / "run"
    summary = run_experiment(fedlgd(log=["tensorboard", "wandb"]), out=run)
    (kind, init), *rest = fake_wandb
    assert kind == "init"
    assert init["mode"] == "offline" and init["dir"] == str(run) and init["config"]["rounds"] == 2
    run_id = init["id"]
    assert (run / WANDB_DIR / WANDB_ID).read_text().strip() == run_id
    logs = [args for kind, args in rest if kind == "log"]
    records = rows(run)
    # Each round's dict: metrics.jsonl's numbers at full precision, the step its round.
    for (step, values), r in zip(logs, records, strict=False):
        assert step == r["round"]
        assert values["mean_accuracy"] == r["mean_accuracy"]
        for client in DOMAINS:
            assert values[f"per_client_loss/{client}"] == r["per_client_loss"][client]
    # The same values TensorBoard got (which keeps them as 32-bit floats).
    from_wandb: dict[str, list[tuple[int, float]]] = {}
    for step, values in logs[:len(records)]:
        for tag, v in values.items():
            from_wandb.setdefault(tag, []).append((step, f32(v)))
    assert from_wandb == logged(run)
    # Then the PNG grids, at the last round, and a clean finish.
    step, grids = logs[len(records)]
    assert step == 1 and set(grids) == {f"images/{p[:-4]}" for p in summary["images"]}
    assert np.array_equal(grids["images/global_virtual"].data, read_png(run / "global_virtual.png"))
    assert rest[-1] == ("finish", 0)

    fake_wandb.clear()
    resume_experiment(run, rounds=3)
    (kind, init), *rest = fake_wandb
    assert init["id"] == run_id and init["resume"] == "allow"   # the same W&B run, continued
    assert [args[0] for kind, args in rest if kind == "log"] == [2, 2]   # round 2, its grids


def test_a_fresh_run_in_the_same_directory_gets_a_new_wandb_run(
        tmp_path: Path, fake_wandb: list[tuple[str, Any]]) -> None:
    run = tmp_path / "run"
    run_experiment(tiny(rounds=1, log=["wandb"]), out=run)
    run_experiment(tiny(rounds=1, log=["wandb"]), out=run)
    first, second = (args["id"] for kind, args in fake_wandb if kind == "init")
    assert first != second


# -- bad input ---------------------------------------------------------------------------------
def test_an_unknown_kind_is_one_error_listing_the_allowed_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match=r"config field 'log' = \['tensorboard', 'csv'\] is "
                                          r"invalid; allowed: tensorboard, wandb"):
        validate(RunConfig(log=["tensorboard", "csv"]))
    out = tmp_path / "run"
    assert main(["run", "--method", "fedavg", "--rounds", "1", "--log", "tb", "--out", str(out),
                 "--quiet"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "'log' = ['tb'] is invalid; allowed: tensorboard, wandb" in line
    assert not out.exists()
    (tmp_path / "c.yaml").write_text("log: [tensorboard, nope]\n")
    with pytest.raises(ConfigError, match="allowed: tensorboard, wandb"):
        from fedvl.config import load_yaml
        validate(load_yaml(tmp_path / "c.yaml"))


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_missing_wandb_is_one_error_naming_pip_install_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    for extra in ([], ["--dry-run"]):
        assert main(["run", "--method", "fedavg", "--rounds", "1", "--log", "tensorboard,wandb",
                     "--out", str(out), "--quiet", *extra]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line == ("fedvl: error: --log wandb needs the wandb package, which is not "
                        "installed: pip install wandb")
        assert not out.exists()


def test_missing_tensorboard_names_the_extra_and_leaves_an_old_directory_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    run_experiment(tiny(rounds=1, log=None), out=run)
    before = sorted(p.name for p in run.iterdir())
    # A None entry is how Python marks a module that cannot be imported: find_spec says None.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"--log tensorboard needs the tensorboard package, "
                                          r"which is not installed: pip install 'fedvl\[logs\]'"):
        check_logs(["tensorboard"])
    with pytest.raises(ConfigError, match="pip install 'fedvl"):
        run_experiment(tiny(rounds=1), out=run)
    assert sorted(p.name for p in run.iterdir()) == before


# -- Flower ------------------------------------------------------------------------------------
def test_flower_logs_the_same_values_and_grids_as_the_embedded_engine(tmp_path: Path) -> None:
    pytest.importorskip("flwr")
    from tests.conftest import FakeGrid, run_on_grid

    cfg = fedlgd()
    run_on_grid(FakeGrid(len(DOMAINS)), cfg, tmp_path, name="flower", round_timeout=60)
    run_experiment(cfg, out=tmp_path / "embedded")
    flower, embedded = tmp_path / "flower", tmp_path / "embedded"
    assert logged(flower) == logged(embedded) == expected(rows(flower))
    # The server holds only the global virtual set; the local ones stay on the nodes.
    assert _images(flower).keys() == {"images/global_virtual"}
    step, pixels = _images(flower)["images/global_virtual"]
    assert step == 1 and np.array_equal(pixels, _images(embedded)["images/global_virtual"][1])


"""`fedvl tune`: the same trial budget per method, validation rows carved from the clients'
training data (no test image read), pruning, resumable studies, the best settings as a config
`fedvl run` and `fedvl bench --tuned` use, and one error when Optuna is missing."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fedvl
from fedvl.cli import main
from fedvl.config import ConfigError, RunConfig, load_yaml
from fedvl.eval import tuning
from fedvl.options import check_value, coerce, option_fields, search_space, spec_of
from fedvl.registry import ALGORITHMS
from fedvl.run import assemble, experiment
from tests.conftest import make_toy_federation

optuna = pytest.importorskip("optuna")

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--benchmark", "digits-offline", "--train-cap", "40", "--test-cap", "20", "--width",
         "8", "--depth", "2", "--quiet"]


def tiny(**changes) -> RunConfig:
    """Two rounds of a width-8 ConvNet on digits-offline, 40 training images per client."""
    values = dict(benchmark="digits-offline", train_cap=40, test_cap=20, rounds=2,
                  model_args={"width": 8, "depth": 2}, workers=1)
    return RunConfig(**{**values, **changes})


class Poisoned(torch.Tensor):
    """A tensor that fails on any use: a test set that must never be read."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"a test tensor was read ({getattr(func, '__name__', func)})")


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(Poisoned)


@pytest.fixture
def calls(monkeypatch):
    """Every run a search starts: (config, federation), the test sets of the benchmark poisoned.

    Also keeps the federation the benchmark built (`built`), before the validation split.
    """
    seen: dict[str, list] = {"runs": [], "built": []}
    real_build, real_run = assemble.build_federation, experiment.run_experiment

    def build(cfg):
        fed = real_build(cfg)
        seen["built"].append(fed)
        clients = [type(c)(c.name, c.x_train, c.y_train, poison(c.x_test), poison(c.y_test))
                   for c in fed.clients]
        gt = (None if fed.global_test is None
              else tuple(poison(t) for t in fed.global_test))
        return type(fed)(fed.name, clients, fed.num_classes, fed.mean, fed.std, gt, fed.info,
                         fed.holdout)

    def run(cfg, *args, **kwargs):
        seen["runs"].append((cfg, kwargs.get("fed")))
        return real_run(cfg, *args, **kwargs)

    monkeypatch.setattr(assemble, "build_federation", build)
    monkeypatch.setattr(experiment, "run_experiment", run)
    return seen


def test_poisoned_test_sets_fail_a_plain_run(calls, tmp_path):
    # The control: the poison is real, a run that scores on test data meets it.
    fed = assemble.build_federation(tiny(method="fedavg"))
    with pytest.raises(AssertionError, match="test tensor was read"):
        experiment.run_experiment(tiny(method="fedavg", rounds=1), out=tmp_path / "r", fed=fed)


def test_same_budget_per_method_on_validation_rows_never_test_data(calls, tmp_path):
    report = tuning.tune(tiny(), ["fedavg", "fedprox"], 2, tmp_path / "t", progress=False)
    for m in ("fedavg", "fedprox"):
        entry = report["methods"][m]
        assert entry["finished"] == 2 and entry["states"] == {"complete": 2}
        assert all(0 <= t["value"] <= 1 for t in entry["trials"])
    assert set(report["methods"]["fedprox"]["space"]["method_args"]) == {"mu"}
    assert report["methods"]["fedavg"]["space"]["method_args"] == {}
    assert set(report["methods"]["fedavg"]["space"]["run"]) == set(search_space(RunConfig))
    assert len(calls["runs"]) == 4
    built = calls["built"][0]
    for cfg, fed in calls["runs"]:
        # Every trial ran on the split federation: no test set, no global test, no held-out.
        assert fed.global_test is None and fed.holdout == []
        for k, (c, orig) in enumerate(zip(fed.clients, built.clients, strict=True)):
            keep, val = assemble.validation_rows(orig.y_train, 0.2, cfg.seed, k)
            assert not set(keep.tolist()) & set(val.tolist())
            assert len(keep) + len(val) == orig.num_train == 40 and len(val) == 8
            assert torch.equal(c.x_train, orig.x_train[keep])
            assert torch.equal(c.x_test, orig.x_train[val])
            assert torch.equal(c.y_test, orig.y_train[val])
    # The objective is the run's mean accuracy on those validation rows.
    first = report["methods"]["fedavg"]["trials"][0]
    summary = json.loads((Path(first["run_dir"]) / "seed0" / "summary.json").read_text())
    assert first["value"] == pytest.approx(summary["mean_accuracy"])
    assert summary["dataset_info"]["validation_rows"] == {c.name: 8 for c in built.clients}
    assert not (Path(first["run_dir"]) / "seed0" / "checkpoint.pt").exists()


def test_validation_rows_are_stratified_seeded_and_leave_training_rows():
    y = make_toy_federation(n_train=48).clients[0].y_train   # 4 classes x 12
    keep, val = assemble.validation_rows(y, 0.25, seed=0, client=0)
    assert sorted(keep.tolist() + val.tolist()) == list(range(48))
    assert torch.bincount(y[val], minlength=4).tolist() == [3, 3, 3, 3]
    again = assemble.validation_rows(y, 0.25, seed=0, client=0)[1]
    other = assemble.validation_rows(y, 0.25, seed=0, client=1)[1]
    assert torch.equal(val, again) and not torch.equal(val, other)
    assert len(assemble.validation_rows(y[:2], 0.9, 0, 0)[0]) == 1   # one row always trains
    with pytest.raises(ValueError, match="2 or more"):
        assemble.validation_rows(y[:1], 0.2, 0, 0)


def test_resuming_continues_to_the_budget_without_redoing_trials(calls, tmp_path):
    out = tmp_path / "t"
    first = tuning.tune(tiny(rounds=1), ["fedavg"], 2, out, progress=False)
    assert len(calls["runs"]) == 2
    second = tuning.tune(tiny(rounds=1), ["fedavg"], 3, out, progress=False)
    assert len(calls["runs"]) == 3   # one more trial, the two finished ones kept
    old, new = first["methods"]["fedavg"]["trials"], second["methods"]["fedavg"]["trials"]
    assert [t["number"] for t in new] == [0, 1, 2] and new[:2] == old
    assert new[2]["params"] != new[0]["params"] and new[2]["params"] != new[1]["params"]
    tuning.tune(tiny(rounds=1), ["fedavg"], 3, out, progress=False)
    assert len(calls["runs"]) == 3   # the budget is spent: nothing runs
    with pytest.raises(ConfigError, match="differ in: rounds"):
        tuning.tune(tiny(rounds=2), ["fedavg"], 3, out, progress=False)
    with pytest.raises(ConfigError, match="already has 3 finished trials, more than --trials 2"):
        tuning.tune(tiny(rounds=1), ["fedavg"], 2, out, progress=False)


class PruneAfterFirstRound(optuna.pruners.BasePruner):
    """Prunes every trial once it reports a round after the first."""

    def prune(self, study, trial) -> bool:
        return trial.last_step is not None and trial.last_step >= 1


def test_pruned_trials_stop_early_count_and_are_recorded(calls, tmp_path):
    report = tuning.tune(tiny(rounds=3), ["fedavg"], 2, tmp_path / "t", progress=False,
                         pruner=PruneAfterFirstRound())
    entry = report["methods"]["fedavg"]
    assert entry["finished"] == 2 and entry["states"] == {"pruned": 2}
    for t in entry["trials"]:
        assert t["state"] == "pruned" and t["pruned_round"] == 1
        assert t["pruned_at"] == {"seed": 0, "round": 1}
        assert [r["round"] for r in t["reported"]] == [0, 1]
        # Round 2 never ran.
        assert len((Path(t["run_dir"]) / "seed0" / "metrics.jsonl").read_text().splitlines()) == 2
    assert entry["best"] is None and not (tmp_path / "t" / "best" / "fedavg.yaml").exists()
    saved = json.loads((tmp_path / "t" / "trials.json").read_text())
    assert saved["methods"]["fedavg"]["trials"][0]["state"] == "pruned"


def test_best_yaml_loads_in_fedvl_run_and_bench_tuned_uses_it(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["tune", *FLAGS, "--methods", "fedavg,fedprox", "--trials", "2", "--rounds",
                 "1", "--out", str(out)]) == 0
    assert "compare them: fedvl bench --tuned" in capsys.readouterr().out
    report = json.loads((out / "trials.json").read_text())
    for m in ("fedavg", "fedprox"):
        best = report["methods"][m]["best"]
        trial = report["methods"][m]["trials"][best["trial"]]
        assert best["value"] == max(t["value"] for t in report["methods"][m]["trials"])
        assert {**best["run"], **best["method_args"]} == {**trial["params"]["run"],
                                                          **trial["params"]["method_args"]}
        cfg = load_yaml(out / "best" / f"{m}.yaml")
        assert cfg.method == m and cfg.method_args == best["method_args"]
        assert {k: getattr(cfg, k) for k in best["run"]} == best["run"]
        assert (cfg.benchmark, cfg.rounds, cfg.train_cap) == ("digits-offline", 1, 40)
    run_dir = tmp_path / "run"
    assert main(["run", "--config", str(out / "best" / "fedprox.yaml"), "--out", str(run_dir),
                 "--quiet"]) == 0
    ran = load_yaml(run_dir / "config.yaml")
    best = report["methods"]["fedprox"]["best"]
    assert ran.method_args == best["method_args"]
    assert {k: getattr(ran, k) for k in best["run"]} == best["run"]

    bench = tmp_path / "b"
    assert main(["bench", *FLAGS, "--rounds", "1", "--seeds", "0", "--methods",
                 "fedavg,fedprox", "--tuned", str(out), "--out", str(bench)]) == 0
    comp = json.loads((bench / "comparison.json").read_text())
    assert comp["tuned"] == str(out)
    for m in ("fedavg", "fedprox"):
        best = report["methods"][m]["best"]
        assert comp["methods"][m]["settings"] == {**best["method_args"], **best["run"]}
        ran = load_yaml(bench / m / "seed0" / "config.yaml")
        assert {k: getattr(ran, k) for k in best["run"]} == best["run"]
        assert ran.method_args == best["method_args"]
    md = (bench / "comparison.md").read_text()
    assert "own settings" in md and "Own settings tuned" in md
    lr = report["methods"]["fedprox"]["best"]["run"]["lr"]
    assert f"lr={lr:.4g}" in md


def test_flags_hold_options_fixed_and_method_args_too(calls, tmp_path):
    report = tuning.tune(tiny(rounds=1, lr=0.05), ["fedprox"], 1, tmp_path / "t",
                         method_args={"fedprox": {"mu": 0.1}}, fixed={"lr"}, progress=False)
    entry = report["methods"]["fedprox"]
    assert "lr" not in entry["space"]["run"] and entry["space"]["method_args"] == {}
    cfg, _ = calls["runs"][0]
    assert cfg.lr == 0.05 and cfg.method_args == {"mu": 0.1}


@pytest.mark.parametrize("argv, words", [
    (["--methods", "fedavg,nosuch", "--trials", "2"], "unknown method 'nosuch'"),
    (["--methods", "fedavg", "--trials", "0"], "--trials 0 is invalid; allowed: an integer >= 1"),
    (["--methods", "fedavg", "--val-fraction", "1.5"], "--val-fraction 1.5 is invalid"),
    (["--methods", "fedavg", "--seeds", "a"], "--seeds must be comma-separated integers"),
    (["--methods", "fedavg,feddm", "--preset", "paper"],
     "--preset paper gives feddm run settings of its own (--rounds 20)"),
])
def test_bad_input_is_one_error_line(argv, words, tmp_path, capsys):
    assert main(["tune", *FLAGS, *argv, "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_bench_tuned_names_a_missing_method(tmp_path, capsys):
    (tmp_path / "t" / "best").mkdir(parents=True)
    assert main(["bench", *FLAGS, "--methods", "moon", "--tuned", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tuned settings of moon" in err[0]


def test_missing_optuna_is_one_error_naming_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)   # `import optuna` raises ImportError
    assert main(["tune", *FLAGS, "--methods", "fedavg", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'fedvl[tune]'" in err[0]
    assert not (tmp_path / "t").exists()


def test_every_declared_space_lies_within_its_options_limits():
    classes = [RunConfig, *(ALGORITHMS.get(m).Params for m in ALGORITHMS.names())]
    for cls in classes:
        for f in option_fields(cls):
            space = spec_of(f).tune
            for value in () if space is None else space.values():
                check_value(f, coerce(f, value))


def test_docs_table_lists_every_declared_space():
    text = (ROOT / "docs" / "protocol.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines()
            if line.startswith("| ")}
    for name, space in search_space(RunConfig).items():
        assert f"`{name}`" in rows["every method"] and space.describe() in rows["every method"]
    for m in ALGORITHMS.names():
        if "+" in m:
            continue
        for name, space in search_space(ALGORITHMS.get(m).Params).items():
            assert m in rows, m
            assert f"`{name}` {space.describe()}" in rows[m], (m, name)


def optuna_imports(path: Path) -> list[tuple[int, bool]]:
    """(line, at module level) of every import of optuna in one source file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "optuna" or n.startswith("optuna.") for n in names):
            found.append((node.lineno, id(node) in top))
    return found


def test_only_the_tuning_module_imports_optuna_and_only_lazily():
    package = Path(fedvl.__file__).parent
    importers = {str(f.relative_to(package)): lines for f in package.rglob("*.py")
                 if (lines := optuna_imports(f))}
    assert set(importers) == {"eval/tuning.py"}
    assert not any(at_top for _, at_top in importers["eval/tuning.py"])


def test_tune_help_starts_without_torch_or_optuna():
    probe = ("import sys\nfrom fedvl.cli import main\ntry:\n    main(['tune', '--help'])\n"
             "except SystemExit:\n    pass\n"
             "print('LOADED', sorted(m for m in ('torch', 'optuna') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert "--val-fraction" in out and "--trials" in out
    assert out.strip().splitlines()[-1] == "LOADED []"


def test_a_search_skips_the_client_optimiser_only_where_clients_train_no_model(tmp_path):
    # The declaration must hold: such a method computes the same numbers whatever the client
    # optimiser, so the trials it would spend there are wasted; every other method searches it.
    from dataclasses import replace

    from tests.conftest import small_cfg

    training = set(search_space(tuning.TrainingSection))
    flagged = [m for m in ALGORITHMS.names() if not ALGORITHMS.get(m).trains_client_models]
    assert {"feddm", "fedvck", "fedd3", "fedaf"} <= set(flagged)
    fed = make_toy_federation()
    for m in flagged:
        assert not training & set(tuning.run_space(small_cfg(m), method=m)), m
        cfg = small_cfg(m, rounds=2)
        other = replace(cfg, lr=0.001, batch_size=16, local_epochs=3, momentum=0.9,
                        weight_decay=1e-3)
        a, b = (experiment.run_experiment(c, out=tmp_path / f"{m}-{i}", fed=fed)
                for i, c in enumerate((cfg, other)))
        assert (a["accuracy_curve"], a["per_client_loss"]) == (
            b["accuracy_curve"], b["per_client_loss"]), m
    assert training <= set(tuning.run_space(small_cfg("fedavg"), method="fedavg"))

"""`fedvl reproduce`: every shipped table spec parses into valid runs, claims are judged from
per-seed values, bad specs are one clear error, and a tiny spec runs end to end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fedvl.cli import main
from fedvl.cli.common import add_run_options, config_from_args
from fedvl.config import ConfigError, shared_model_args
from fedvl.eval import reproduce, tables

TINY = """
title: tiny
source: none
run: {benchmark: digits-offline, rounds: 1, train_cap: 12, test_cap: 12, threads: 1,
      model_args: {width: 4, depth: 1}}
arms:
  fedavg: {paper: 50}
  prox: {method: fedprox, args: {mu: 0.5, dp_noise: 1.0}, paper: {mean: 40, handwritten: 30}}
claims: ["fedavg > prox", "fedavg ~ prox +- 100"]
min_seeds: 1
scales:
  cpu: {seeds: [1], seed_args: {1: {prox: {mu: 0.25}}}}
"""


@pytest.mark.parametrize("name", tables.spec_names())
def test_every_shipped_table_expands_to_valid_runs_at_every_scale(name: str) -> None:
    spec = tables.load_spec(name)   # checks every arm's config at every scale
    assert "cpu" in spec.scales and spec.claims and spec.source
    for scale in spec.scales:
        p = reproduce.plan(spec, scale)
        assert set(p["arm_methods"]) == set(spec.arms)
    labels = list(spec.arms)
    # Claims evaluate on any finished values: arm i gets i points.
    values = {a: {s: float(i) for s in (0, 1, 2)} for i, a in enumerate(labels)}
    assert {c["status"] for c in tables.evaluate_claims(spec, values)} <= {"holds", "fails"}


BENCHMARK_SPECS = sorted((Path(__file__).resolve().parent.parent / "benchmarks" / "tables")
                         .glob("*.yaml"))


@pytest.mark.parametrize("path", BENCHMARK_SPECS, ids=lambda p: p.stem)
def test_every_benchmark_spec_loads(path: Path) -> None:
    """Each spec of benchmarks/tables/ parses, with every arm's config valid at every scale."""
    spec = tables.load_spec(path)
    assert spec.name == path.stem and "cpu" in spec.scales


def test_a_table_is_the_bench_command_it_replaces() -> None:
    """The spec's runs are exactly those of the `fedvl bench` line of its recorded results."""
    spec = tables.load_spec("fedvl-digits-offline-virtual")
    p = reproduce.plan(spec, "cpu")
    parser = argparse.ArgumentParser()
    add_run_options(parser)
    args = parser.parse_args(["--local-data", "virtual", "--threads", "1"])
    for label in spec.arms:
        args.method, args.method_arg = label, []
        want = shared_model_args(config_from_args(args))
        got = shared_model_args(tables.arm_config(spec, "cpu", label, 0))
        assert got.to_dict() == want.to_dict()
    assert p["seeds"] == [0, 1, 2]


def _spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


def test_a_one_shot_table_trains_the_protocols_local_epochs(tmp_path: Path) -> None:
    """`protocol: one-shot` gives the one round `fedvl bench --protocol one-shot`'s epochs."""
    from fedvl.defaults import ONE_SHOT_LOCAL_EPOCHS

    text = TINY.replace("title: tiny", "title: tiny\nprotocol: one-shot")
    spec = tables.load_spec(_spec(tmp_path, text))
    assert tables.arm_config(spec, "cpu", "fedavg", 1).training.local_epochs \
        == ONE_SHOT_LOCAL_EPOCHS
    assert tables.arm_config(spec, "cpu", "fedavg", 1,
                             {"local_epochs": 3}).training.local_epochs == 3


def test_claims_hold_fail_or_need_seeds_on_paired_differences() -> None:
    spec = tables.parse_spec("t", {"title": "t", "source": "s", "run": {"rounds": 1},
                                   "arms": {"fedavg": {}, "fedprox": {}, "scaffold": {}},
                                   "scales": {"cpu": {"seeds": [0, 1, 2]}},
                                   "claims": ["scaffold > fedprox > fedavg",
                                              "scaffold > fedavg + 5", "fedavg ~ fedprox +- 1"]})
    values = {"fedavg": {0: 10.0, 1: 11.0, 2: 12.0}, "fedprox": {0: 10.5, 1: 11.5, 2: 12.5},
              "scaffold": {0: 14.0, 1: 16.0, 2: 18.0}}
    out = {c["claim"]: c for c in tables.evaluate_claims(spec, values)}
    assert out["scaffold > fedprox > fedavg"]["status"] == "holds"
    assert out["scaffold > fedavg + 5"]["status"] == "fails"      # leads by 5.0, not more
    assert out["fedavg ~ fedprox +- 1"]["status"] == "holds"
    assert out["scaffold > fedavg + 5"]["pairs"][0]["difference"]["mean"] == pytest.approx(5.0)
    del values["fedprox"][2]
    assert {c["status"] for c in tables.evaluate_claims(spec, values)} == {
        "not enough seeds", "fails"}


@pytest.mark.parametrize("change, words", [
    ({"arms": {"fedavg": {}, "x": {"method": "nope"}}}, "not registered"),
    ({"claims": ["fedavg > ghost"]}, "not an arm"),
    ({"claims": ["fedavg >> fedavg"]}, "spaces around each operator"),
    ({"claims": ["fedavg ~ fedavg"]}, "tolerance"),
    ({"metric": "speed"}, "metric 'speed' is unknown"),
    ({"scales": {"cpu": {"metric": "speed"}}}, "scale 'cpu': metric 'speed' is unknown"),
    ({"scales": {"gpu": {}}}, "scale 'cpu' is missing"),
    ({"colour": 1}, "unknown key(s) colour"),
    ({"run": {"rounds": -1}}, "rounds"),
    ({"arms": {"Bad Label": {}}}, "lower-case"),
    ({"scales": {"cpu": {"seeds": [0], "seed_args": {3: {"fedavg": {}}}}}},
     "seed_args names seed 3, which is not one of the scale's seeds"),
    ({"scales": {"cpu": {"seeds": [0], "seed_args": {0: {"ghost": {}}}}}}, "'ghost', which is not"),
    ({"scales": {"cpu": {"seeds": [0], "seed_args": {0: {"fedavg": {"mu": 1}}}}}}, "mu"),
    ({"scales": {"cpu": {"cost": {"seconds": 9, "arms": ["ghost"]}}}}, "cost arms must be"),
])
def test_a_bad_spec_is_one_error_naming_what_is_wrong(change: dict, words: str) -> None:
    data = {"title": "t", "source": "s", "arms": {"fedavg": {}},
            "scales": {"cpu": {"seeds": [0]}}, **change}
    with pytest.raises(ConfigError, match="table spec 't'") as e:
        tables.parse_spec("t", data)
    assert words in str(e.value)


def test_a_cost_says_which_arms_it_covers_when_not_all() -> None:
    spec = tables.parse_spec("t", {"title": "t", "source": "s",
                                   "arms": {"fedavg": {}, "fedprox": {}},
                                   "scales": {"cpu": {"cost": {"seconds": 7200, "measured": "f",
                                                               "arms": ["fedavg"]}},
                                              "gpu": {"cost": {"seconds": 3600}}}})
    assert tables.cost_words(spec.scales["cpu"], 2) == "2.0 h measured for 1 of 2 arms"
    assert tables.cost_words(spec.scales["gpu"], 2) == "1.0 h estimated"


def test_a_row_whose_runs_had_rejected_replies_is_flagged() -> None:
    """An honest run's replies are all taken: rejections mean the row is not the method's."""
    spec = tables.parse_spec("t", {"title": "t", "source": "s",
                                   "arms": {"fedavg": {}, "fedprox": {}}, "scales": {"cpu": {}}})
    entry = {"bytes_up": 1.0, "bytes_down": 1.0, "wall_seconds": {"mean": 1.0}}
    comp = {"methods": {"fedavg": entry, "fedprox": {**entry, "rejected_replies": 3}}}
    text = tables.render(spec, "cpu", "c", tables.table_rows(spec, comp, {}, {}), [])
    assert "**Replies rejected** (over all seeds: fedprox 3)" in text


def test_a_scale_reports_its_own_metric_where_it_names_one() -> None:
    spec = tables.parse_spec("t", {"title": "t", "source": "s", "arms": {"fedavg": {}},
                                   "scales": {"cpu": {}, "final": {
                                       "metric": "global_test_accuracy"}}})
    assert tables.scale_metric(spec, "cpu") == "mean_accuracy"
    assert tables.scale_metric(spec, "final") == "global_test_accuracy"
    assert "metric `global_test_accuracy`" in tables.render(spec, "final", "c", [], [])


def test_a_seed_runs_its_own_options_and_a_seed_without_them_is_refused() -> None:
    """`seed_args` (a noise matched to one seed's split) reach that seed's run only; a seed the
    spec gives none would run an unmatched setting under the arm's name, so it is refused."""
    spec = tables.parse_spec("t", {"title": "t", "source": "s",
                                   "arms": {"fedavg": {}, "fedprox": {"args": {"mu": 0.5}}},
                                   "scales": {"cpu": {"seeds": [0, 1], "seed_args": {
                                       0: {"fedprox": {"mu": 0.1}}, 1: {"fedprox": {"mu": 0.2}}}}}})
    p = reproduce.plan(spec, "cpu")
    assert p["seed_method_args"] == {0: {"fedprox": {"mu": 0.1}}, 1: {"fedprox": {"mu": 0.2}}}
    assert tables.arm_config(spec, "cpu", "fedprox", 1).method_args == {"mu": 0.2}
    with pytest.raises(ConfigError, match="fedprox take options per seed.*seed 2 has none"):
        reproduce.plan(spec, "cpu", seeds=[2])


def test_unknown_table_and_scale_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "no-such-table"]) == 2
    assert "fedlgd-digits" in capsys.readouterr().err
    assert main(["reproduce", "fedlgd-digits", "--scale", "huge"]) == 2
    assert "allowed: cpu, paper" in capsys.readouterr().err


def test_a_tiny_table_runs_resumes_and_writes_its_verdicts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, out = _spec(tmp_path, TINY), tmp_path / "out"
    assert main(["reproduce", str(spec), "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "| fedavg ~ prox +- 100 | holds |" in text and "(30)" in text
    result = json.loads((out / "reproduce.json").read_text())
    # The DP arm's epsilon range over clients and seeds; the arm without DP has none.
    rows = {r["arm"]: r for r in result["rows"]}
    lo, hi = rows["prox"]["epsilon_range"]
    assert 0 < lo <= hi < float("inf") and "epsilon_range" not in rows["fedavg"]
    assert "ε (clients, seeds)" in text and f"{hi:.3g} |" in text
    # What a run spends before round 0 (data, local sets) is part of a table's cost.
    assert rows["fedavg"]["setup_seconds"] > 0 and "| setup s |" in text
    assert set(result["per_seed"]["prox"]) == {"1"}
    assert result["command"].startswith("fedvl reproduce ")
    assert (out / "report.html").is_file() and (out / "prox" / "seed1" / "summary.json").is_file()
    assert "mu: 0.25" in (out / "prox" / "seed1" / "config.yaml").read_text()   # its seed_args
    before = (out / "prox" / "seed1" / "summary.json").stat().st_mtime_ns
    assert main(["reproduce", str(spec), "--out", str(out), "--quiet", "--report-only"]) == 0
    assert (out / "prox" / "seed1" / "summary.json").stat().st_mtime_ns == before
    assert json.loads((out / "reproduce.json").read_text())["per_seed"] == result["per_seed"]
    assert main(["reproduce", "--list"]) == 0
    assert "fedlgd-digits: FedLGD Table 1" in capsys.readouterr().out

"""`fedvl bench`: method x seed runs, reuse of finished runs, the comparison files."""

from __future__ import annotations

import json

import pytest

from fedvl.cli import main
from fedvl.config import ConfigError
from fedvl.eval.comparison import parse_method_args

ARGS = ["--benchmark", "digits-offline", "--train-cap", "30", "--test-cap", "20", "--rounds",
        "2", "--width", "8", "--depth", "2", "--batch-size", "16", "--quiet"]


def test_bench_writes_comparison_and_reuses_finished_runs(tmp_path):
    out = tmp_path / "b"
    argv = ["bench", *ARGS, "--methods", "fedavg,fedprox", "--seeds", "0,1",
            "--method-arg", "fedprox.mu=0.1", "--out", str(out)]
    assert main(argv) == 0
    comp = json.loads((out / "comparison.json").read_text())
    for m in ("fedavg", "fedprox"):
        e = comp["methods"][m]
        assert e["mean_accuracy"]["n"] == 2 and 0 <= e["mean_accuracy"]["mean"] <= 1
        assert set(e["per_client_accuracy"]) == {"handwritten", "handwritten-color",
                                                 "printed-clutter", "printed-clean",
                                                 "handwritten-thick"}
        assert e["bytes_up"] > 0 and e["bytes_down"] > 0 and len(e["runs"]) == 2
        runs = [json.loads((out / m / f"seed{s}" / "summary.json").read_text()) for s in (0, 1)]
        rounds = [rnd for rnd, _ in runs[0]["accuracy_curve"]]
        want = [(a0 + a1) / 2 for (_, a0), (_, a1) in
                zip(runs[0]["accuracy_curve"], runs[1]["accuracy_curve"], strict=True)]
        assert [rnd for rnd, _ in e["accuracy_curve"]] == rounds == [0, 1]
        assert [a for _, a in e["accuracy_curve"]] == pytest.approx(want)
        # Accuracy against cumulative bytes: each run's points are its metrics.jsonl summed up.
        for r in runs:
            lines = (out / m / f"seed{r['seed']}" / "metrics.jsonl").read_text().splitlines()
            recs = [json.loads(line) for line in lines]
            sums = [sum(x["round_bytes_up"] + x["round_bytes_down"] for x in recs[: i + 1])
                    for i in range(len(recs))]
            assert [p["bytes"] for p in r["accuracy_vs_bytes"]] == sums
            assert sums[-1] == r["bytes_up"] + r["bytes_down"]
        assert [p["bytes"] for p in e["accuracy_vs_bytes"]] == pytest.approx(
            [(p0["bytes"] + p1["bytes"]) / 2 for p0, p1 in
             zip(runs[0]["accuracy_vs_bytes"], runs[1]["accuracy_vs_bytes"], strict=True)])
        assert [p["mean_accuracy"] for p in e["accuracy_vs_bytes"]] == pytest.approx(want)
    assert (out / "accuracy_vs_bytes.png").stat().st_size > 0
    cfg = json.loads((out / "fedprox" / "seed1" / "summary.json").read_text())
    assert cfg["method_args"] == {"mu": 0.1}
    stamp = (out / "fedavg" / "seed0" / "summary.json").stat().st_mtime_ns
    assert main(argv) == 0  # everything finished: nothing runs again
    comp_before = json.loads((out / "comparison.json").read_text())
    assert (out / "fedavg" / "seed0" / "summary.json").stat().st_mtime_ns == stamp

    # Summaries written before the curve existed: it is rebuilt from metrics.jsonl.
    path = out / "fedavg" / "seed0" / "summary.json"
    old = json.loads(path.read_text())
    old.pop("accuracy_vs_bytes")
    path.write_text(json.dumps(old))
    (out / "fedprox" / "seed1" / "summary.json").unlink()
    assert main([*argv, "--report-only"]) == 0
    comp = json.loads((out / "comparison.json").read_text())
    assert comp["methods"]["fedavg"]["accuracy_vs_bytes"] == \
        comp_before["methods"]["fedavg"]["accuracy_vs_bytes"]
    assert comp["missing"] == ["fedprox/seed1"]
    assert comp["methods"]["fedprox"]["mean_accuracy"]["n"] == 1
    assert not (out / "fedprox" / "seed1" / "summary.json").exists()
    assert "Not finished: fedprox/seed1" in (out / "comparison.md").read_text()


def test_method_args_must_name_a_benched_method():
    assert parse_method_args(["fedprox.mu=0.5"], ["fedavg", "fedprox"])["fedprox"] == {"mu": 0.5}
    with pytest.raises(ConfigError, match="not in --methods"):
        parse_method_args(["moon.mu=1"], ["fedavg"])
    with pytest.raises(ConfigError, match="METHOD.KEY=VALUE"):
        parse_method_args(["mu=1"], ["fedavg"])


def test_global_test_accuracy_is_aggregated_over_seeds():
    from fedvl.config import RunConfig
    from fedvl.eval.comparison import render_markdown, summarize

    def run(seed: int, glob: float | None) -> dict:
        out = {"seed": seed, "run_dir": f"r{seed}", "per_client_accuracy": {"a": 0.5},
               "mean_accuracy": 0.5, "bytes_up": 1, "bytes_down": 1, "bytes_by_kind": {},
               "bytes_per_round": {"up": 1, "down": 1}, "wall_seconds": 1.0}
        if glob is not None:
            out["global_test_accuracy"] = glob
        return out

    comp = summarize(RunConfig(), {"fedavg": [run(0, 0.2), run(1, 0.4)]}, None)
    g = comp["methods"]["fedavg"]["global_test_accuracy"]
    assert g["mean"] == pytest.approx(0.3) and g["n"] == 2
    assert "| global test |" in render_markdown(comp) and "30.00 ±" in render_markdown(comp)
    # Benchmarks without a global test set have no such entry and no column.
    comp = summarize(RunConfig(), {"fedavg": [run(0, None)]}, None)
    assert "global_test_accuracy" not in comp["methods"]["fedavg"]
    assert "global test" not in render_markdown(comp)


def test_inter_accuracy_is_aggregated_per_client_over_seeds():
    from fedvl.config import RunConfig
    from fedvl.eval.comparison import render_markdown, summarize

    def run(seed: int, inter: dict[str, float]) -> dict:
        return {"seed": seed, "run_dir": f"r{seed}", "per_client_accuracy": {"a": 0.9, "b": 0.8},
                "mean_accuracy": 0.85, "bytes_up": 0, "bytes_down": 0, "bytes_by_kind": {},
                "bytes_per_round": {"up": 0, "down": 0}, "wall_seconds": 1.0,
                "inter_accuracy": inter, "mean_inter_accuracy": sum(inter.values()) / 2,
                "worst_accuracy": 0.8}

    comp = summarize(RunConfig(), {"desa": [run(0, {"a": 0.5, "b": 0.7}),
                                            run(1, {"a": 0.3, "b": 0.5})]}, None)
    per = comp["methods"]["desa"]["per_client_inter_accuracy"]
    assert per["a"]["mean"] == pytest.approx(0.4) and per["b"]["mean"] == pytest.approx(0.6)
    assert comp["methods"]["desa"]["mean_inter_accuracy"]["mean"] == pytest.approx(0.5)
    md = render_markdown(comp)
    assert "Inter accuracy per client" in md and "| desa | 40.00 | 60.00 | 50.00 |" in md


def test_every_method_runs_the_comparisons_model_and_own_settings_show(tmp_path):
    """FedVCK prefers a BatchNorm ConvNet; in a comparison it runs the shared model unless the
    whole comparison asks for BatchNorm, and its own options show in a column."""
    import yaml

    out = tmp_path / "b"
    argv = ["bench", *ARGS, "--rounds", "1", "--methods", "fedavg,fedvck", "--seeds", "0",
            "--method-arg", "fedvck.steps=2", "--method-arg", "fedvck.server_epochs=1",
            "--out", str(out)]
    assert main(argv) == 0
    norms = {m: yaml.safe_load((out / m / "seed0" / "config.yaml").read_text())["model_args"]
             ["norm"] for m in ("fedavg", "fedvck")}
    assert norms == {"fedavg": "instance", "fedvck": "instance"}
    md = (out / "comparison.md").read_text()
    assert "own settings" in md and "steps=2, server_epochs=1" in md
    assert "Every method runs the same model: convnet (" in md and "norm instance" in md


def test_best_accuracy_comes_with_the_round_of_its_peak():
    """A method that peaks early shows it: the best accuracy and the (1-based) round of each
    seed's peak, averaged over seeds, beside the final one."""
    from fedvl.config import RunConfig
    from fedvl.eval.comparison import render_markdown, summarize

    def run(seed: int, curve: list[float]) -> dict:
        return {"seed": seed, "run_dir": f"r{seed}", "per_client_accuracy": {"a": curve[-1]},
                "mean_accuracy": curve[-1], "bytes_up": 1, "bytes_down": 1,
                "bytes_by_kind": {}, "bytes_per_round": {"up": 1, "down": 1},
                "wall_seconds": 1.0, "accuracy_curve": [[i, a] for i, a in enumerate(curve)]}

    comp = summarize(RunConfig(), {"fedlgd": [run(0, [0.1, 0.8, 0.6]),
                                              run(1, [0.2, 0.5, 0.7])]}, None)
    e = comp["methods"]["fedlgd"]
    assert e["best_accuracy"]["mean"] == pytest.approx(0.75)
    assert e["best_round"]["mean"] == pytest.approx(2.5)    # rounds 2 and 3
    md = render_markdown(comp)
    assert "| best at round |" in md and "| 2.5 |" in md


def test_one_shot_protocol_runs_one_round_and_tabulates_total_bytes(tmp_path, capsys):
    """`--protocol one-shot`: one round per method whatever a preset says, every client, the
    local epochs the protocol's default unless given, and accuracy against total bytes (uplink
    + downlink, per payload kind) in comparison.json and comparison.md."""
    out = tmp_path / "b"
    one_shot = ["bench", "--benchmark", "digits-offline", "--train-cap", "30", "--test-cap",
                "20", "--width", "8", "--depth", "2", "--batch-size", "16", "--quiet",
                "--methods", "fedd3,fedavg", "--seeds", "0", "--protocol", "one-shot",
                "--out", str(out)]
    # Nothing run yet: the config shows the protocol's defaults (a preset's rounds lose too).
    assert main([*one_shot, "--preset", "smoke", "--report-only"]) == 0
    cfg = json.loads((out / "comparison.json").read_text())["config"]
    assert (cfg["rounds"], cfg["local_epochs"]) == (1, 50)
    small = ["--local-epochs", "1", *(f"--method-arg=fedd3.{a}" for a in (
        "ipc=1", "steps=2", "server_epochs=2"))]
    assert main([*one_shot, *small]) == 0
    comp = json.loads((out / "comparison.json").read_text())
    assert comp["protocol"] == "one-shot" and comp["config"]["local_epochs"] == 1
    for m in ("fedd3", "fedavg"):
        s = json.loads((out / m / "seed0" / "summary.json").read_text())
        e = comp["methods"][m]
        assert s["rounds"] == e["rounds"] == 1
        assert e["bytes_total"] == s["bytes_up"] + s["bytes_down"] > 0
    assert comp["methods"]["fedd3"]["bytes_down"] == 0
    # The model's bytes go both ways for FedAvg; FedD3 sends its images up only.
    fedavg = comp["methods"]["fedavg"]
    assert fedavg["bytes_by_kind"]["weights"]["up"] == fedavg["bytes_by_kind"]["weights"][
        "down"] == fedavg["bytes_total"] / 2
    md = (out / "comparison.md").read_text()
    assert "Accuracy against total bytes" in md and "One-shot protocol" in md
    d3 = comp["methods"]["fedd3"]
    assert f"| {d3['bytes_total']:,.0f} |" in md
    assert f"synthetic_images {d3['bytes_by_kind']['synthetic_images']['up']:,} B" in md
    for bad, why in (("--rounds=3", "exactly one round; --rounds 3"),
                     ("--client-ratio=0.5", "--client-ratio 0.5 would leave some out")):
        assert main([*one_shot, bad]) == 2
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*one_shot, "--protocol=two-shot"])
    assert "invalid choice: 'two-shot'" in capsys.readouterr().err

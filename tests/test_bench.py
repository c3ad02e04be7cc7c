"""`fedvl bench`: method x seed runs, reuse of finished runs, the comparison files."""

from __future__ import annotations

import json

import pytest
import yaml

from fedvl.cli import main
from fedvl.config import ConfigError
from fedvl.eval.comparison import parse_method_args

# The --jobs tests start worker processes: 35 s of test calls on 2 cores.
pytestmark = pytest.mark.slow(seconds=35)

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


# -- `fedvl bench --jobs`: the grid on worker processes ---------------------------------------


def _numbers(out) -> dict:
    """comparison.json without what differs between two runs of one grid: time and folder."""
    comp = json.loads((out / "comparison.json").read_text())
    for e in comp["methods"].values():
        e.pop("wall_seconds")
        e.pop("setup_seconds")
        e["runs"] = [str(type(out)(r).relative_to(out)) for r in e["runs"]]
    return comp


def test_jobs_2_resumes_a_stopped_grid_with_the_numbers_and_order_of_jobs_1(tmp_path, monkeypatch,
                                                                         capsys):
    """Two worker processes continue a one-process grid stopped in its second run's round 1:
    the finished run is not run again, the stopped one goes on from its checkpoint, and the
    comparison is the one an uninterrupted one-process grid gives, in the grid's order."""
    from fedvl.eval.grid import cpu_cores
    from fedvl.run import experiment

    class Stop(Exception):
        pass

    def stop(rnd: int, record: dict) -> None:
        raise Stop

    real = experiment.run_experiment

    def interrupted(cfg, **kw):
        stopped = (cfg.method, cfg.seed) == ("fedprox", 0)
        return real(cfg, **kw, **({"on_round": stop} if stopped else {}))

    grid = ["bench", *ARGS, "--methods", "fedprox,fedavg", "--seeds", "1,0"]
    assert main([*grid, "--out", str(tmp_path / "one")]) == 0
    monkeypatch.setattr(experiment, "run_experiment", interrupted)
    with pytest.raises(Stop):
        main([*grid, "--out", str(tmp_path / "two")])
    monkeypatch.undo()
    cut = tmp_path / "two" / "fedprox" / "seed0"
    done = {p: p.stat().st_mtime_ns for p in (tmp_path / "two").glob("*/seed*/summary.json")}
    assert tmp_path / "two" / "fedprox" / "seed1" / "summary.json" in done
    assert not (tmp_path / "two" / "fedavg" / "seed0" / "summary.json").exists()
    assert (cut / "checkpoint.pt").is_file() and not (cut / "summary.json").exists()
    round0 = (cut / "metrics.jsonl").read_text()
    assert len(round0.splitlines()) == 1
    assert main([*grid, "--out", str(tmp_path / "two"), "--jobs", "2"]) == 0, \
        capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in done} == done    # not run again
    # Round 0 is the stopped run's own record (timings included): it was not run again.
    metrics = (cut / "metrics.jsonl").read_text()
    assert metrics.startswith(round0) and len(metrics.splitlines()) == 2
    one, two = _numbers(tmp_path / "one"), _numbers(tmp_path / "two")
    assert two == one
    assert list(two["methods"]) == ["fedprox", "fedavg"]
    assert two["methods"]["fedavg"]["seeds"] == [1, 0] and "missing" not in two
    md = [(tmp_path / d / "comparison.md").read_text().splitlines() for d in ("one", "two")]
    # The table's cells but the two time columns (seconds per run and setup, the last two).
    assert [r.rsplit("|", 3)[0] for r in md[0]] == [r.rsplit("|", 3)[0] for r in md[1]]
    # The cores shared as client workers; the server keeps the threads --jobs 1 gives it.
    cfg = yaml.safe_load((tmp_path / "two" / "fedavg" / "seed0" / "config.yaml").read_text())
    assert cfg["workers"] == max(1, cpu_cores() // 2)
    one_cfg = yaml.safe_load((tmp_path / "one" / "fedavg" / "seed0" / "config.yaml").read_text())
    assert cfg.get("threads") == one_cfg.get("threads")
    assert not list(tmp_path.glob("**/*.tmp"))


def test_jobs_must_be_a_whole_number_or_auto(tmp_path, capsys):
    out = tmp_path / "b"
    grid = ["bench", *ARGS, "--methods", "fedavg", "--seeds", "0", "--out", str(out)]
    for bad in ("0", "x", "1.5"):
        assert main([*grid, "--jobs", bad]) == 2
        err = capsys.readouterr().err
        assert f"--jobs '{bad}' is invalid; allowed: a whole number of processes >= 1, or " \
               "auto" in err and len(err.splitlines()) == 1
    assert main([*grid, "--jobs", "2", "--max-memory", "8G"]) == 2
    assert "allowed: --max-memory with --jobs auto only" in capsys.readouterr().err
    assert main([*grid, "--jobs", "auto", "--max-memory", "lots"]) == 2
    assert "--max-memory 'lots' is invalid; allowed: a size" in capsys.readouterr().err
    assert not out.exists()   # refused before anything ran


def test_jobs_auto_picks_n_from_one_runs_measured_peak(tmp_path, capsys):
    """`--jobs auto` runs the first run alone, measures its peak and sizes N from it; a run
    that does not fit is refused before the others start."""
    from fedvl.eval.grid import Finished, Memory, choose_jobs, device_memories

    gib = 2**30
    assert choose_jobs([Memory("RAM", peak=gib, free=10 * gib)], cores=4)[0] == 4
    n, why = choose_jobs([Memory("RAM", peak=gib, free=10 * gib)], cores=64)
    assert n == 9 and "bound by memory" in why and "0.9 x 10,240 MiB free fits 9" in why
    n, why = choose_jobs([Memory("cuda:0 memory", gib, 80 * gib, budget=3 * gib),
                          Memory("RAM", gib, 100 * gib)], cores=16)
    assert n == 2 and "3,072 MiB of --max-memory fits 2" in why
    with pytest.raises(ConfigError, match="peaked at 2,048 MiB of RAM, more than 0.9 x 1,024 "
                       "MiB free; nothing more started"):
        choose_jobs([Memory("RAM", peak=2 * gib, free=gib)], cores=2)
    # On a GPU the allocator's peak reserve against the free memory its process saw, and RAM.
    cuda = {"device": "cuda:0", "max_allocated": gib, "max_reserved": 2 * gib,
            "free": 60 * gib, "total": 80 * gib}
    gpu, ram = device_memories(Finished({}, 1.0, {"rss_bytes": gib, "cuda": cuda}), None)
    assert (gpu.where, gpu.peak, gpu.free, ram.where, ram.peak) == (
        "cuda:0 memory", 2 * gib, 60 * gib, "RAM", gib)

    out = tmp_path / "b"
    grid = ["bench", *ARGS, "--methods", "fedavg", "--seeds", "0,1,2", "--out", str(out),
            "--jobs", "auto"]
    rc = main([*grid, "--max-memory", "1M"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert err[-1].startswith("fedvl: error: --jobs auto: one run of this grid peaked at ")
    assert "of --max-memory; nothing more started (allowed: --max-memory" in err[-1]
    assert (out / "fedavg" / "seed0" / "summary.json").is_file()    # the measured run
    assert not (out / "fedavg" / "seed1").exists() and not (out / "fedavg" / "seed2").exists()
    rc = main(grid)
    err = capsys.readouterr().err.splitlines()
    assert rc == 0, err
    line = next(x for x in err if "--jobs auto" in x)
    n = int(line.split("--jobs auto: ")[1].split()[0])
    assert n >= 1 and "RAM: one run peaked at " in line and "free fits " in line
    comp = json.loads((out / "comparison.json").read_text())
    assert comp["methods"]["fedavg"]["seeds"] == [0, 1, 2]

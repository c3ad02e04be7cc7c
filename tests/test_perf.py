"""`fedvl perf` on a tiny workload: every engine gets a row with every column, or says why not."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from fedvl.cli import main
from fedvl.perf.engines import _config
from fedvl.perf.flops import batch_sizes, matmul_rate, round_flops, training_step_flops
from fedvl.perf.harness import mean_in_window, measure, run_perf, table
from fedvl.perf.synthesis import FlopCount, run_distill_perf
from fedvl.perf.synthesis import table as distill_table
from fedvl.perf.workload import Workload, build_net, export_arrays, load_arrays
from fedvl.run.assemble import build_env, build_federation

pytestmark = pytest.mark.slow(seconds=26)

TINY = Workload(benchmark="digits-offline", train_per_client=16, test_per_client=8, width=4,
                depth=1, rounds=2)
COLUMNS = {"engine", "clients", "workers", "status", "setting", "warm_round_seconds",
           "first_round_seconds", "round_seconds", "images_per_round", "images_per_second",
           "startup_seconds", "total_seconds", "peak_rss_mib", "accuracy", "bare_loop_ratio",
           "flops_per_round", "gflops", "share_of_matmul"}


def test_every_engine_gets_a_full_row_or_a_reason(tmp_path, capsys, monkeypatch) -> None:
    """`fedvl perf` over every engine: a full row each (or why not), the JSON and the table."""
    # digits-offline's five domains, each split in two: ten clients.
    w = Workload(**{**dataclasses.asdict(TINY), "partitions": 2})
    out = tmp_path / "perf.json"
    monkeypatch.setattr(sys, "argv", ["fedvl", "perf"])
    assert main(["perf", "--benchmark", w.benchmark, "--clients", "5", "--partitions", "2",
                 "--train-per-client", str(w.train_per_client), "--test-per-client",
                 str(w.test_per_client), "--width", str(w.width), "--depth", str(w.depth),
                 "--rounds", str(w.rounds), "--workers", "2",
                 "--engines", "bare,embedded,workers,processes,stacked,pfl",
                 "--peers-python", str(tmp_path / "no-such-python"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["engine"]: r for r in res["rows"]}
    for engine in ("bare", "embedded", "workers", "processes", "stacked"):
        assert rows[engine]["status"] == "ok", rows[engine]
        assert COLUMNS - {"bare_loop_ratio"} <= set(rows[engine]), COLUMNS - set(rows[engine])
        assert "bare_loop_ratio" in rows[engine] or engine == "stacked"
        assert rows[engine]["clients"] == 10
        assert len(rows[engine]["round_seconds"]) == w.rounds
        assert 0 <= rows[engine]["accuracy"] <= 1
        assert rows[engine]["peak_rss_mib"] > 10
        assert rows[engine]["startup_seconds"] > 0
        assert rows[engine]["gflops"] > 0
        assert rows[engine]["share_of_matmul"] == rows[engine]["gflops"] / res["matmul_gflops"]
    # The same arrays for everyone: one round visits every client's training images once.
    assert rows["bare"]["images_per_round"] == rows["workers"]["images_per_round"] == 10 * 8
    # Sequential and parallel clients compute the same model.
    assert rows["embedded"]["accuracy"] == rows["workers"]["accuracy"]
    # Processes run the same training from the same weights; only the order of the weighted
    # sums differs. Stacked clients compute client-by-client training to float rounding.
    for engine in ("processes", "stacked"):
        assert rows[engine]["accuracy"] == pytest.approx(rows["embedded"]["accuracy"], abs=0.03)
    assert "stacked" in rows["stacked"]["setting"]
    assert rows["pfl"]["status"] == "unavailable" and rows["pfl"]["reason"]
    assert {"platform", "cpu_count", "torch"} <= set(res["machine"])
    assert res["matmul"]["threads"] >= 1 and "start" in res["load_average"]
    assert "| pfl | 10 | unavailable" in table(res)
    printed = capsys.readouterr().out
    assert "| bare | 10 |" in printed and "GFLOP/s | share of matmul |" in printed
    assert "dense fp32 matmul rate" in printed


def test_exported_arrays_and_model_are_the_workload(tmp_path) -> None:
    data = load_arrays(export_arrays(TINY, tmp_path / "a.npz"))
    assert len(data.train) == 5 and all(len(y) == 16 for _, y in data.train)
    assert data.image_shape == (3, 28, 28)   # digits-offline renders 28 x 28
    a, b = build_net(TINY, data), build_net(TINY, data)
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert Workload.from_json(TINY.to_json()) == TINY
    # Every engine starts from the weights `fedvl run` starts from.
    cfg = _config(TINY, 1)
    fed = build_federation(cfg)
    run_model = build_env(cfg, fed, torch.device("cpu")).model_fn()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), run_model.parameters(),
                                                  strict=True))


def test_cpu_only_engines_say_so_on_a_gpu(tmp_path) -> None:
    w = Workload(**{**dataclasses.asdict(TINY), "device": "cuda"})
    for engine in ("processes", "flower", "pfl", "blazefl"):
        row = measure(engine, w, tmp_path / "none.npz", 0, tmp_path, 2, None, 60)
        assert row["status"] == "unavailable" and "CPU only" in row["reason"]
    res = {"workload": dataclasses.asdict(w), "rows": [
        {"engine": "bare", "clients": 5, "status": "ok", "warm_round_seconds": 0.5,
         "images_per_second": 160.0, "bare_loop_ratio": 1.0, "startup_seconds": 1.0,
         "total_seconds": 2.0, "peak_rss_mib": 300.0, "accuracy": 0.5, "peak_gpu_mib": 42.0,
         "gpu_utilisation_percent": 87.4},
        row]}
    text = table(res)
    assert "peak GPU MiB | GPU util % |" in text and "| 42 | 87 |" in text
    assert text.splitlines()[-1].count("|") == text.splitlines()[0].count("|")


def test_gpu_utilisation_is_averaged_over_the_warm_rounds() -> None:
    samples = [(0.0, 0.0), (1.0, 50.0), (2.0, 100.0), (3.0, 0.0)]
    assert mean_in_window(samples, 1.0, 2.0) == 75.0
    assert mean_in_window(samples, 5.0, 6.0) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_refuses_a_device_it_does_not_have(tmp_path, capsys) -> None:
    for device, msg in (("cuda", "CUDA is not available"), ("tpu", "cpu or cuda")):
        assert main(["perf", "--benchmark", "digits-offline", "--device", device, "--out",
                     str(tmp_path / "x.json")]) != 0
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_cli_refuses_bad_input(tmp_path, capsys) -> None:
    for bad, msg in ((["--engines", "fast"], "unknown"), (["--clients", "x"], "--clients"),
                     (["--rounds", "1"], "warm-up")):
        assert main(["perf", "--benchmark", "digits-offline", *bad, "--out",
                     str(tmp_path / "x.json")]) != 0
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("engine", ["nonsense"])
def test_unknown_engine_is_one_error(engine) -> None:
    with pytest.raises(ValueError, match="allowed: bare"):
        run_perf(TINY, [5], [engine], 1, sys.executable)


def test_flop_count_is_the_analytic_count() -> None:
    # FlopCounterMode counts 2*B*in*out per matrix product: the forward product, the weight
    # gradient and, for a layer whose input needs a gradient, the input gradient too; the
    # first layer's input (the images) needs none, so it costs 2x its forward, later ones 3x.
    b, fin, hidden, out = 4, 12, 5, 3
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(fin, hidden),
                              torch.nn.ReLU(), torch.nn.Linear(hidden, out))
    x, y = torch.randn(b, 3, 2, 2), torch.randint(0, out, (b,))
    per_image = 2 * 2 * fin * hidden + 3 * 2 * hidden * out
    assert training_step_flops(net, x, y) == b * per_image
    assert all(p.grad is None for p in net.parameters())   # counting leaves no gradients
    # One round: every client's batches, the last one smaller (5 -> 2, 2, 1 and 3 -> 2, 1).
    assert batch_sizes(5, 2) == [2, 2, 1]
    clients = [(torch.randn(n, 3, 2, 2), torch.randint(0, out, (n,))) for n in (5, 3)]
    assert round_flops(net, clients, 2) == 8 * per_image


def test_matmul_rate_reports_how_it_was_measured() -> None:
    m = matmul_rate(1, "cpu", n=64, repeats=2)
    assert m["gflops"] > 0 and m["threads"] == 1 and m["n"] == 64 and m["repeats"] == 2
    res = {"workload": dataclasses.asdict(TINY), "matmul": m, "rows": []}
    assert "64 x 64, 1 torch thread(s), best of 2" in table(res)


def test_dispatch_flop_count_sees_autograd_grad_without_weight_gradients() -> None:
    # Synthesis differentiates w.r.t. the images only: the count is the forward plus the input
    # gradient of each layer (2x the forward for a two-layer MLP), no weight gradient.
    b, fin, hidden, out = 4, 12, 5, 3
    net = torch.nn.Sequential(torch.nn.Linear(fin, hidden), torch.nn.ReLU(),
                              torch.nn.Linear(hidden, out))
    x = torch.randn(b, fin, requires_grad=True)
    with FlopCount() as fc:
        torch.autograd.grad(net(x).sum(), x)
    assert fc.total == 2 * (2 * b * fin * hidden + 2 * b * hidden * out)


def test_perf_distill_rows_and_cli(tmp_path, capsys) -> None:
    names = ["dm", "kernel-latent", "embed-logit", "dp-embed-logit"]
    res = run_distill_perf(names, "digits-offline", None, 40, 0, 4, "cpu", 1, 0.01, matmul_n=64)
    rows = res["objectives"]
    assert list(rows) == names
    for r in rows.values():
        assert r["gflop_per_step"] > 0 and r["steps_per_second"] > 0
        assert r["gflops"] == pytest.approx(r["gflop_per_step"] * r["steps_per_second"])
        assert r["share_of_matmul_rate"] > 0
    assert "kernel-latent" in distill_table(res)
    assert main(["perf", "--distill", "--objectives", "dm,nope", "--out",
                 str(tmp_path / "d.json")]) != 0
    assert "nope" in capsys.readouterr().err and not (tmp_path / "d.json").exists()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="needs /proc")
def test_resident_memory_skips_processes_that_end_while_it_reads(monkeypatch) -> None:
    import os
    from pathlib import Path

    from fedvl.perf import harness

    real = Path.read_text

    def read_text(self, *args, **kwargs):
        # Every other process ends between the listing of /proc and the read of its stat.
        if self.name == "stat" and self.parent.name != str(os.getpid()):
            raise FileNotFoundError(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    # The process measured still counts (its own stat is read); nothing fails.
    alone = harness._tree_rss(os.getpid())
    assert alone is not None and alone > 0

"""What the commands print and draw: no spread for one seed, every written file named, whole
round numbers on round axes, table headings kept whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedvl.cli import main


def fake_run(seed: int) -> dict:
    """A finished run's summary, as `summarize` reads it."""
    return {"seed": seed, "run_dir": f"r{seed}", "per_client_accuracy": {"a": 0.5},
            "mean_accuracy": 0.5 + seed / 10, "bytes_up": 1, "bytes_down": 1,
            "bytes_by_kind": {}, "bytes_per_round": {"up": 1, "down": 1}, "wall_seconds": 1.0}


def test_one_seed_shows_the_value_alone() -> None:
    from fedvl.config import RunConfig
    from fedvl.eval.comparison import render_markdown, summarize

    one = render_markdown(summarize(RunConfig(), {"fedavg": [fake_run(0)]}, None))
    assert "±" not in one and "| 50.00 |" in one and "one seed per method" in one
    two = render_markdown(summarize(RunConfig(), {"fedavg": [fake_run(0), fake_run(1)]}, None))
    assert "| 55.00 ± 7.07 |" in two


def test_bench_names_every_file_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench"
    assert main(["bench", "--methods", "fedavg", "--seeds", "0", "--rounds", "1",
                 "--train-cap", "20", "--test-cap", "10", "--width", "8", "--depth", "2",
                 "--quiet", "--out", str(out)]) == 0
    written = next(line for line in capsys.readouterr().out.splitlines()
                   if line.startswith("written: "))
    names = sorted(Path(p).name for p in written.removeprefix("written: ").split(", "))
    on_disk = sorted(p.name for p in out.iterdir() if p.is_file())
    assert names == on_disk and "accuracy_vs_bytes.png" in names


def test_round_axis_has_whole_rounds() -> None:
    from fedvl.eval import plots

    fig = plots.accuracy_over_rounds({"fedavg": [[[0, 0.4], [1, 0.5]]]}, "two rounds")
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_summary_heading_is_one_line(capsys: pytest.CaptureFixture) -> None:
    from fedvl.cli.common import print_summary

    print_summary({"method": "fedlgd", "benchmark": "digits-offline", "seed": 0, "rounds": 20,
                   "per_client_accuracy": {"a": 0.5}, "mean_accuracy": 0.5, "bytes_up": 1,
                   "bytes_down": 1, "wall_seconds": 1.0, "run_dir": "x"})
    assert "fedlgd on digits-offline (seed 0, 20 rounds)" in capsys.readouterr().out


def test_summary_says_where_the_time_went(capsys: pytest.CaptureFixture) -> None:
    from fedvl.cli.common import print_summary

    s = {"method": "feddm", "benchmark": "digits-offline", "seed": 0, "rounds": 2,
         "per_client_accuracy": {"a": 0.5}, "mean_accuracy": 0.5, "bytes_up": 1,
         "bytes_down": 1, "wall_seconds": 10.0, "run_dir": "x"}
    print_summary(s)   # a summary written before the timing keys existed
    assert "time:" not in capsys.readouterr().out
    print_summary({**s, "time_by_phase": {"client_synthesis": 6.2, "client_training": 0.3,
                                          "server_synthesis": 0.0, "server_training": 3.0,
                                          "evaluation": 0.1, "other": 0.4}})
    assert ("time: client synthesis 62 %, client training 3 %, server training 30 %, "
            "evaluation 1 %, other 4 %") in capsys.readouterr().out


def test_summary_warns_of_rejected_replies(capsys: pytest.CaptureFixture) -> None:
    from fedvl.cli.common import print_summary

    s = {"method": "fedlgd", "benchmark": "digits", "seed": 0, "rounds": 2,
         "per_client_accuracy": {"a": 0.5}, "mean_accuracy": 0.5, "bytes_up": 1,
         "bytes_down": 1, "wall_seconds": 1.0, "run_dir": "x"}
    print_summary({**s, "rejected_replies": []})
    assert "rejected" not in capsys.readouterr().out
    print_summary({**s, "rejected_replies": [
        {"round": 1, "client": "usps", "reason": "meta/num_examples: 600 is outside [1, 500]"},
        {"round": 2, "client": "usps", "reason": "the same"}]})
    assert ("rejected replies: 2 (the first: round 1, usps: meta/num_examples: 600 is outside "
            "[1, 500])") in capsys.readouterr().out


def test_run_epilogue_says_what_left_the_clients_and_how_to_compare() -> None:
    """After the table: the kinds and bytes the clients sent, the upload audit's largest value
    when images were sent, and the FedAvg comparison on the same (virtual) data."""
    from fedvl.cli.common import what_left_the_clients

    lgd = {"method": "fedlgd", "benchmark": "digits-offline", "seed": 0, "upload_audit": [],
           "bytes_by_kind": {"weights": {"up": 3 << 20, "down": 3 << 20},
                             "statistics": {"up": 1400, "down": 0},
                             "synthetic_images": {"up": 0, "down": 5 << 20}}}
    lines = what_left_the_clients(lgd)
    assert lines[0] == ("sent by the clients: weights 3.00 MiB, statistics 1.37 KiB; no image "
                        "left any client")
    assert lines[1].endswith("fedvl bench --methods fedavg,fedlgd --local-data virtual "
                             "--benchmark digits-offline --seeds 0")
    # A preset run's comparison runs under the same preset (the same virtual sets and rounds).
    assert what_left_the_clients(lgd, "quickstart")[1].endswith("--seeds 0 --preset quickstart")
    dm = {"method": "feddm", "benchmark": "digits-offline", "seed": 1,
          "bytes_by_kind": {"synthetic_images": {"up": 2048, "down": 0},
                            "weights": {"up": 0, "down": 100}},
          "upload_audit": [{"round": 0, "client": "a", "max_corr": 0.31,
                            "tensor": "synthetic_images/x", "withheld": False},
                           {"round": 1, "client": "b", "max_corr": 0.95,
                            "tensor": "synthetic_images/x", "withheld": True}]}
    lines = what_left_the_clients(dm)
    assert lines == ["sent by the clients: synthetic_images 2.00 KiB",
                     "upload audit: largest |r| with a private image 0.950 (b, round 1, "
                     "synthetic_images/x); 1 upload(s) withheld by the guard",
                     "against FedAvg: fedvl bench --methods fedavg,feddm --benchmark "
                     "digits-offline --seeds 1"]
    # Above the guard yet sent: the real-initialised uploads the guard exempts, said so.
    dm["upload_audit"][1]["withheld"] = False
    assert what_left_the_clients(dm)[2].startswith("  above the guard but sent")

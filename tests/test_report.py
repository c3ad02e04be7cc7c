"""`fedvl report`: the HTML page and figures of a run or a bench directory."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from fedvl.cli import main

ARGS = ["--benchmark", "digits-offline", "--train-cap", "30", "--test-cap", "20", "--rounds",
        "2", "--width", "8", "--depth", "2", "--batch-size", "16", "--quiet"]


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rep") / "bench"
    assert main(["bench", *ARGS, "--methods", "fedavg,local", "--seeds", "0,1",
                 "--out", str(out)]) == 0
    return out


def _report(path, capsys, *extra):
    assert main(["report", str(path), *extra]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    return printed


def test_bench_report_lists_every_method_and_embeds_its_figures(bench_dir, capsys):
    printed = _report(bench_dir, capsys)
    page = bench_dir / "report.html"
    assert printed == str(page)
    html = page.read_text()
    comp = json.loads((bench_dir / "comparison.json").read_text())
    for m in comp["methods"]:
        assert re.search(rf"<tr><td>{m}</td>", html), m
    # The table's seed-mean accuracy is the comparison's (recomputed from the summaries).
    acc = comp["methods"]["fedavg"]["mean_accuracy"]
    assert f"{100 * acc['mean']:.2f} ± {100 * acc['std']:.2f}" in html
    figs = bench_dir / "report-figures"
    for name in ("accuracy_rounds", "accuracy_vs_bytes", "bytes_by_kind", "per_client_accuracy",
                 "cross_accuracy_local", "accuracy_rounds_per_client_fedavg",
                 "accuracy_rounds_per_client_local", "time_by_phase_fedavg",
                 "time_by_phase_local"):
        assert (figs / f"{name}.png").stat().st_size > 0 and (figs / f"{name}.svg").is_file()
        assert f'id="fig-{name}"' in html
    # FedAvg has one global model: no intra/inter matrix for it.
    assert not (figs / "cross_accuracy_fedavg.png").exists()
    # Self-contained: every image is inline, nothing is fetched.
    assert "data:image/png;base64," in html
    assert not re.search(r'(src|href)="(?!data:)[^"#]', html)
    assert "Config and provenance" in html and "benchmark: digits-offline" in html
    assert "fedvl 0." in html


def test_run_report_has_per_client_curves_and_image_grids(tmp_path, capsys):
    run = tmp_path / "run"
    desa = ["ipc=2", "anchor_steps=2", "batch_real=4", "dsa=false"]
    assert main(["run", *ARGS, "--method", "desa", "--client-models", "alternate",
                 *(a for kv in desa for a in ("--method-arg", kv)), "--out", str(run)]) == 0
    assert list(run.glob("*.png")), "the run wrote no image grid to report"
    out = tmp_path / "rep"
    _report(run, capsys, "--out", str(out))
    html = (out / "report.html").read_text()
    for name in ("accuracy_rounds_per_client", "cross_accuracy_desa", "bytes_by_kind"):
        assert (out / "report-figures" / f"{name}.png").is_file(), name
    for png in run.glob("*.png"):
        assert png.name in html
    assert html.count("data:image/png;base64,") >= 2 + len(list(run.glob("*.png")))


def test_time_by_phase_is_one_stacked_bar_per_round_and_optional(bench_dir, tmp_path, capsys):
    """The figure stacks each round's phases into one bar; a run recorded before the timing
    keys existed still renders, without it."""
    from fedvl.eval import plots
    from fedvl.timing import PHASES

    run = json.loads((bench_dir / "fedavg" / "seed0" / "summary.json").read_text())
    rows = run["round_time_by_phase"]
    assert [r["round"] for r in rows] == [0, 1]
    ax = plots.time_by_phase(rows, "t").axes[0]
    assert len(ax.patches) == len(PHASES) * len(rows)
    # The last phase's bars top each round's stack: there, the sum of its phases.
    tops = [bar.get_y() + bar.get_height() for bar in ax.patches[-len(rows):]]
    assert tops == pytest.approx([sum(r[p] for p in PHASES) for r in rows])
    old = tmp_path / "old"
    shutil.copytree(bench_dir / "fedavg" / "seed0", old)
    for k in ("time_by_phase", "round_time_by_phase", "client_seconds_summed"):
        run.pop(k)
    (old / "summary.json").write_text(json.dumps(run))
    _report(old, capsys, "--out", str(tmp_path / "rep"))
    assert (tmp_path / "rep" / "report-figures" / "accuracy_rounds.png").is_file()
    assert not list((tmp_path / "rep" / "report-figures").glob("time_by_phase*"))


def test_report_of_a_folder_without_runs_is_one_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "neither a run directory" in err and "METHOD/seedN/summary.json" in err
    (tmp_path / "summary.json").write_text("{not json")
    assert main(["report", str(tmp_path)]) == 2
    assert "not a readable summary" in capsys.readouterr().err


CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(b)), None)


def _screenshot(page, shot) -> np.ndarray:
    """What a person sees of `page` in headless Chromium: the whole page as an RGB array."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--window-size=1200,6000"]
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", page.as_uri()], check=True,
                   capture_output=True, timeout=120)
    from PIL import Image

    return np.asarray(Image.open(shot).convert("RGB"), dtype=float)


def _coloured(pixels: np.ndarray) -> float:
    """Share of pixels with a clear hue: the plotted curves and bars, never text or page."""
    return float(((pixels.max(-1) - pixels.min(-1)) > 60).mean())


def test_report_renders_in_headless_chromium(bench_dir, capsys, tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install headless Chromium (.ci/run: apt-get install chromium)")
        pytest.skip("headless Chromium not installed (Debian: apt install chromium)")
    _report(bench_dir, capsys)
    page = (bench_dir / "report.html").resolve()
    seen = _screenshot(page, tmp_path / "shot.png")
    assert seen.std() > 5, "the rendered page is blank"
    # The figures are drawn: the same page with its images' data removed shows (nearly) no
    # colour, the real one shows the curves. Control first, so the measure itself is tested.
    html = page.read_text()
    assert html.count("<img") >= 3
    broken = tmp_path / "broken.html"
    broken.write_text(re.sub(r'src="data:image/png;base64,[^"]*"', 'src=""', html))
    control = _coloured(_screenshot(broken.resolve(), tmp_path / "broken.png"))
    assert control < 1e-4 and _coloured(seen) > 100 * max(control, 1e-5), (
        control, _coloured(seen))
    flags = ["--headless", "--no-sandbox", "--disable-gpu"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    assert "<table" in dom and "fedavg" in dom

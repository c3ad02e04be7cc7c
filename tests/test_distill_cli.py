"""`fedvl distill` end to end on digits-offline at tiny scale, and its input errors."""

import json

import pytest
import torch

from fedvl.cli import main
from fedvl.distill.synthetic import SyntheticSet

TINY = ["--benchmark", "digits-offline", "--ipc", "1", "--steps", "3", "--width", "8",
        "--depth", "2", "--batch-real", "4", "--eval-models", "2", "--eval-epochs", "2",
        "--train-cap", "100", "--test-cap", "40"]


def test_cli_end_to_end_writes_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["distill", *TINY, "--client", "handwritten", "--out", str(out)]) == 0
    res = json.loads((out / "distill.json").read_text())
    for key in ("accuracy", "loss_curve", "steps", "seconds"):
        assert key in res
    assert set(res["accuracy"]) == {"distilled", "random_real", "noise"}
    assert len(res["accuracy"]["distilled"]["values"]) == 2
    assert res["steps"] == 3 and len(res["loss_curve"]) == 3
    assert "epsilon" not in res and res["device"] == "cpu"
    s = SyntheticSet.load(out / "synthetic.pt")
    # Only classes the client owns (>= 10 of its 100 images) are distilled.
    from fedvl.config import RunConfig
    from fedvl.distill.client_sets import owned_ipc
    from fedvl.run.assemble import build_federation

    fed = build_federation(RunConfig(benchmark="digits-offline", train_cap=100, test_cap=40))
    y = fed.clients[fed.client_index("handwritten")].y_train
    assert s.ipc == owned_ipc(y, 10, 1) and sum(s.ipc) >= 5
    assert (out / "synthetic.png").stat().st_size > 0


def test_cli_dp_reports_epsilon(tmp_path):
    out = tmp_path / "dp"
    argv = ["distill", *TINY, "--client", "0", "--dp-noise", "1.0", "--dp-clip", "1.0",
            "--dp-space", "feature", "--init", "noise", "--eval-models", "0", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads((out / "distill.json").read_text())
    from fedvl.core.dp import compute_epsilon

    # The default delta is below 1/N.
    assert res["delta"] == pytest.approx(1 / (10 * res["num_train"]))
    assert res["epsilon"] == pytest.approx(
        compute_epsilon(1.0, res["dp_sample_rate"], 3, res["delta"]))


@pytest.mark.parametrize("flags,needle", [
    (["--matching", "foo"], "--matching 'foo' is invalid; allowed: dm, kernel, gm"),
    (["--init", "zeros"], "--init 'zeros' is invalid; allowed: noise, stats, real"),
    (["--ipc", "0"], "--ipc 0 is invalid"),
    (["--dp-noise", "1.0"], "--dp-clip"),
    # DP whose guarantee would not hold: images start from private data, or BN mixes samples.
    (["--dp-noise", "1.0", "--dp-clip", "1.0"], "needs init 'noise'; init 'real'"),
    (["--dp-noise", "1.0", "--dp-clip", "1.0", "--init", "stats"], "init 'stats'"),
    (["--dp-noise", "1.0", "--dp-clip", "1.0", "--init", "noise", "--norm", "batch"],
     "BatchNorm"),
    (["--dp-noise", "1.0", "--dp-clip", "1.0", "--init", "noise", "--dp-delta", "1.5"],
     "--dp-delta 1.5 is invalid"),
    (["--client", "nosuch"], "unknown client 'nosuch'"),
    (["--benchmark", "nosuch"], "--benchmark 'nosuch' is invalid; allowed:"),
    (["--device", "tpu"], "--device 'tpu' is invalid"),
    pytest.param(["--device", "cuda"], "no CUDA device is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")),
])
def test_cli_bad_input_gives_one_clear_error(tmp_path, capsys, flags, needle):
    argv = ["distill", *TINY, "--out", str(tmp_path / "x"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_dc_bench_protocol_fixes_the_evaluation_and_refuses_a_contradicting_flag(capsys):
    """`--protocol dc-bench` sets DC-Bench's pipeline; a flag against it is one clear error."""
    import argparse

    from fedvl.cli.distill import DC_BENCH, DistillOptions, apply_protocol
    from fedvl.options import FLAGS, add_flags, from_args

    parser = argparse.ArgumentParser()
    add_flags(parser, DistillOptions)
    args = parser.parse_args(["--protocol", "dc-bench", "--steps", "7"])
    opts = apply_protocol(from_args(args, DistillOptions, FLAGS), args)
    assert {k: getattr(opts, k) for k in DC_BENCH} == DC_BENCH and opts.steps == 7
    assert main(["distill", "--protocol", "dc-bench", "--eval-epochs", "300"]) == 2
    assert "fixes eval_epochs to 1000; --eval-epochs 300 contradicts it" in capsys.readouterr().err

"""`fedvl unlearn`: QuickDrop-style ascent on the forgotten distilled data, then recovery."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedvl.cli import main
from fedvl.config import ConfigError, RunConfig
from fedvl.eval.unlearning import UnlearnSettings, ascend, unlearn_run
from fedvl.run.assemble import trained_model


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Two rounds of FedAvg on tiny local virtual sets (ipc 2, 2 DM steps)."""
    from fedvl.run.experiment import run_experiment

    root = tmp_path_factory.mktemp("unlearn")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDVL_CACHE_DIR", str(root / "cache"))
        cfg = RunConfig(method="fedavg", benchmark="digits-offline", local_data="virtual",
                        ipc=2, virtual_steps=2, rounds=2, train_cap=20, test_cap=20, threads=1,
                        batch_size=16, lr=0.05, model_args={"width": 8, "depth": 1})
        run_experiment(cfg, out=root / "run")
        yield root / "run"


def _best_class(run: Path) -> int:
    """The class the run's model gets most test images of right (so forgetting can show)."""
    from fedvl.config import load_yaml
    from fedvl.run.assemble import build_federation

    fed = build_federation(load_yaml(run / "config.yaml"))
    model = trained_model(run, 0, fed)
    x = torch.cat([c.x_test for c in fed.clients])
    y = torch.cat([c.y_test for c in fed.clients])
    with torch.no_grad():
        right = model(x).argmax(1) == y
    return int(torch.bincount(y[right], minlength=fed.num_classes).argmax())


def test_forgetting_a_class_drops_it_and_recovery_restores_the_rest(run: Path,
                                                                    tmp_path: Path) -> None:
    c = _best_class(run)
    s = UnlearnSettings(ascent_steps=5, ascent_lr=0.5, recovery_rounds=2, recovery_epochs=3,
                        lr=0.05)
    res = unlearn_run(run, forget_class=c, out=tmp_path, settings=s)
    before, ascent, recovered = (res["stages"][k] for k in
                                 ("before", "after_ascent", "after_recovery"))
    assert before["forgotten_accuracy"] > 0
    assert ascent["forgotten_accuracy"] < before["forgotten_accuracy"]
    assert recovered["kept_accuracy"] > ascent["kept_accuracy"]
    assert res["forget"] == {"kind": "class", "index": c, "name": str(c)}
    sizes = json.loads((run / "summary.json").read_text())["train_samples"]
    assert 0 < res["distilled_images"]["forgotten"] <= 2 * len(sizes)   # ipc 2 per client
    assert sum(res["distilled_images"].values()) == sum(sizes.values())
    assert 0 <= before["loss_attack_auc"] <= 1
    assert res["seconds"]["original_run"] > 0 and res["seconds"]["unlearning"] > 0
    assert json.loads((tmp_path / "unlearn.json").read_text())["stages"] == res["stages"]
    assert (tmp_path / "unlearned_model.pt").stat().st_size > 0


def test_retraining_without_the_class_is_the_run_on_the_data_without_it(run: Path,
                                                                         tmp_path: Path) -> None:
    c = _best_class(run)
    s = UnlearnSettings(recovery_rounds=1, recovery_epochs=1)
    res = unlearn_run(run, forget_class=c, out=tmp_path, settings=s, with_retrain=True)
    retrained = json.loads((tmp_path / "retrain" / "summary.json").read_text())
    original = json.loads((run / "summary.json").read_text())
    # The same run from scratch whose clients distilled no image of class c: only the
    # forgotten distilled images are missing.
    assert (sum(retrained["train_samples"].values())
            == sum(original["train_samples"].values()) - res["distilled_images"]["forgotten"])
    assert retrained["rounds"] == original["rounds"]
    assert set(res["stages"]["retrained"]) == set(res["stages"]["before"])
    assert res["seconds"]["retraining"] > res["seconds"]["retraining_rounds"] > 0


def test_ascent_is_the_reflected_descent_of_quickdrop() -> None:
    from fedvl.models.base import build_model

    model = build_model("convnet", 3, 4, 8, seed=0, width=4, depth=1).train()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, 8, 8, generator=g), torch.tensor([0, 1, 2, 3, 0, 1])
    start = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    s = UnlearnSettings(ascent_steps=1, ascent_lr=0.1, weight_decay=0.0)
    ascend(model, x, y, s, torch.Generator().manual_seed(0))
    # One full-batch step, reflected: theta_0 + (theta_0 - (theta_0 - lr g)) = theta_0 + lr g.
    for p, p0, gr in zip(model.parameters(), start, grads, strict=True):
        assert torch.allclose(p, p0 + 0.1 * gr, atol=1e-5)


def test_forgetting_a_client_keeps_the_others(run: Path, tmp_path: Path) -> None:
    s = UnlearnSettings(recovery_rounds=1, recovery_epochs=1)
    res = unlearn_run(run, forget_client="1", out=tmp_path, settings=s)
    assert res["forget"]["kind"] == "client" and res["forget"]["index"] == 1
    sizes = json.loads((run / "summary.json").read_text())["train_samples"]
    assert res["distilled_images"]["forgotten"] == sizes[res["forget"]["name"]]
    assert res["distilled_images"]["kept"] == sum(sizes.values()) - sizes[res["forget"]["name"]]


@pytest.mark.parametrize("argv,words", [
    (["--class", "10"], "--class 10 is not a class of"),
    (["--class", "x"], "allowed: 0 to 9"),
    (["--client", "7"], "client index 7 out of range 0..4"),
    (["--class", "1", "--client", "1"], "not allowed with argument"),
    (["--class", "1", "--ascent-steps", "-1"], "--ascent-steps -1 is negative"),
])
def test_bad_input_is_one_clear_error(run: Path, capsys: pytest.CaptureFixture, argv: list[str],
                                      words: str) -> None:
    both = "--client" in argv and "--class" in argv
    with pytest.raises(SystemExit) if both else contextlib.nullcontext():
        assert main(["unlearn", str(run), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedvl: error:") and words in err[0], err


def test_a_run_without_virtual_data_is_refused(run: Path, tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text((run / "config.yaml").read_text()
                                          .replace("local_data: virtual", "local_data: real"))
    with pytest.raises(ConfigError, match="--local-data virtual"):
        unlearn_run(tmp_path, forget_class=0)


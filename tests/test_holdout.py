"""`--holdout-clients`: clients never trained on, scored each evaluation as unseen clients."""

from __future__ import annotations

import pytest
import torch

from fedvl.config import RunConfig
from fedvl.core.training import TrainConfig
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.engine.holdout import holdout_scores
from fedvl.run.assemble import hold_out


class Constant(torch.nn.Module):
    """Predicts class `k` for every input; `scale` is a weight fine-tuning can move."""

    def __init__(self, k: int, classes: int = 3) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.full((classes,), -5.0))
        with torch.no_grad():
            self.bias[k] = 5.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(len(x), -1)

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.flatten(1), self(x)


def client(name: str, labels: list[int], test: list[int]) -> ClientData:
    return ClientData(name=name, x_train=torch.zeros(len(labels), 1, 2, 2),
                      y_train=torch.tensor(labels), x_test=torch.zeros(len(test), 1, 2, 2),
                      y_test=torch.tensor(test))


def test_the_same_clients_are_held_out_for_every_seed_and_keep_their_names(tmp_path):
    fed = FederatedDataset("f", [client(f"c{i}", [0], [0]) for i in range(5)], 3, (0.5,), (0.5,))
    a, b = hold_out(fed, 2), hold_out(fed, 2)
    assert [c.name for c in a.holdout] == [c.name for c in b.holdout]
    assert len(a.clients) == 3 and len(a.holdout) == 2
    assert sorted(c.name for c in a.clients + a.holdout) == fed.client_names
    assert a.info["holdout_clients"] == [c.name for c in a.holdout]
    assert hold_out(fed, 0) is fed
    with pytest.raises(ValueError, match="leaves no client to train.*allowed: 0 to 4"):
        hold_out(fed, 5)
    # A comparison over seeds holds out the same clients, so `fedvl bench` averages them.
    from fedvl.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--methods", "fedavg", "--seeds", "0,1", "--holdout-clients", "1",
                 "--rounds", "1", "--train-cap", "20", "--test-cap", "10", "--width", "8",
                 "--depth", "2", "--batch-size", "16", "--quiet", "--out", str(out)]) == 0
    assert "mean_holdout_accuracy" in (out / "comparison.json").read_text()


def test_global_model_scored_as_is_and_a_newcomer_adopts_the_best_peer_model():
    new = client("new", labels=[2, 2, 2, 1], test=[2, 2, 1, 1])
    cpu = torch.device("cpu")
    got = holdout_scores([new], Constant(1), [], TrainConfig(), 0, 0, ["a"], cpu)
    assert got == {"holdout_accuracy": {"new": 0.5}, "mean_holdout_accuracy": 0.5}
    # Personalised: client b's model fits 3 of 4 of the newcomer's training labels, a's 1 of 4;
    # b's is copied (not changed) and fine-tuned at lr 0 here, so it scores as it is.
    models = [Constant(1), Constant(2)]
    got = holdout_scores([new], None, models, TrainConfig(lr=0.0), 0, 0, ["a", "b"], cpu)
    assert got["holdout_source"] == {"new": "b"} and got["holdout_accuracy"] == {"new": 0.5}
    assert models[1].bias[2].item() == 5.0
    # Fine-tuning with a learning rate trains the newcomer's copy, never the peer's model.
    before = [m.bias.detach().clone() for m in models]
    holdout_scores([new], None, models, TrainConfig(lr=1.0, local_epochs=3), 0, 0, ["a", "b"],
                   cpu)
    assert all(torch.equal(m.bias, b) for m, b in zip(models, before, strict=True))


def test_a_run_reports_unseen_clients_and_flower_refuses(tmp_path):
    from fedvl.run.experiment import run_experiment

    cfg = RunConfig(method="local", holdout_clients=2, rounds=1, train_cap=30, test_cap=20,
                    batch_size=16, threads=1, model_args={"width": 8, "depth": 2})
    s = run_experiment(cfg, tmp_path / "run")
    assert len(s["per_client_accuracy"]) == 3 and len(s["holdout_accuracy"]) == 2
    assert not set(s["per_client_accuracy"]) & set(s["holdout_accuracy"])
    assert set(s["holdout_source"].values()) <= set(s["per_client_accuracy"])
    assert (tmp_path / "run" / "config.yaml").read_text().count("holdout_clients: 2") == 1
    pytest.importorskip("flwr")
    from fedvl.flower.server_app import FlowerRun, ServerOptions

    with pytest.raises(ValueError, match="in-process engine only"):
        FlowerRun(None, cfg, ServerOptions(out=str(tmp_path / "flw")))  # type: ignore[arg-type]

"""The `medmnist` benchmark: synthetic archives (no shared data) and the shared PneumoniaMNIST."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedvl.data.medmnist import medmnist
from fedvl.data.sources import DataError, DataOptions
from tests.conftest import SHARED_DATA, write_medmnist

PNEUMONIA = SHARED_DATA / "medmnist" / "pneumoniamnist.npz"
needs_pneumonia = pytest.mark.skipif(not PNEUMONIA.is_file(),
                                     reason=f"shared MedMNIST file not found at {PNEUMONIA}")


@pytest.mark.parametrize("rgb", [False, True])
def test_medmnist_synthetic_archive(tmp_path, rgb):
    path = write_medmnist(tmp_path, "toymnist", num_classes=3, rgb=rgb)
    fed = medmnist(DataOptions(data_dir=str(tmp_path), dataset="toymnist", num_clients=3,
                               alpha=1.0, test_cap=12))
    assert fed.name == "medmnist" and fed.num_classes == 3
    assert fed.image_shape == (3, 28, 28) and len(fed.clients) == 3
    assert fed.info["dataset"] == "toymnist" and fed.info["native_channels"] == (3 if rgb else 1)
    with np.load(path) as z:
        raw = z["train_images"]
        first = torch.from_numpy(raw[:1].astype(np.float32) / 255.0)
    # RGB sets keep their own three channels; grey ones are copied into all three.
    x = fed.denormalize(torch.cat([c.x_train for c in fed.clients]))
    if rgb:
        assert not torch.equal(x[:, 0], x[:, 1])
    else:
        assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 1], x[:, 2])
    assert sum(c.num_train for c in fed.clients) == 120
    gx, gy = fed.global_test
    assert gy.tolist() == (np.arange(40) % 3).tolist()
    expected = first.permute(0, 3, 1, 2) if rgb else first[:, None].expand(-1, 3, -1, -1)
    assert torch.allclose(fed.denormalize(medmnist(DataOptions(
        data_dir=str(tmp_path), dataset="toymnist", num_clients=1)).clients[0].x_train[:1]),
        expected, atol=1e-6)
    assert gx.shape == (40, 3, 28, 28)


def test_medmnist_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(DataError) as e:
        medmnist(DataOptions(data_dir=str(tmp_path), dataset="organamnist"))
    msg = str(e.value)
    assert str(tmp_path / "medmnist" / "organamnist.npz") in msg
    assert "train_images" in msg and "test_labels" in msg and "\n" not in msg
    with pytest.raises(DataError, match="plain file stem"):
        medmnist(DataOptions(data_dir=str(tmp_path), dataset="../cifar10"))


def test_medmnist_refuses_multi_label_sets(tmp_path):
    path = write_medmnist(tmp_path, "chest", num_classes=2, rgb=False)
    with np.load(path) as z:
        arrays = dict(z)
    arrays["train_labels"] = np.zeros((120, 14), dtype=np.uint8)
    np.savez(path, **arrays)
    with pytest.raises(DataError, match="single-label"):
        medmnist(DataOptions(data_dir=str(tmp_path), dataset="chest"))


def test_medmnist_flower_partitions_follow_num_clients():
    from fedvl.config import RunConfig
    from fedvl.flower.simulate import num_partitions

    assert num_partitions(RunConfig(benchmark="medmnist", num_clients=7)) == 7


@needs_pneumonia
def test_pneumoniamnist_from_shared_data():
    with np.load(PNEUMONIA) as z:
        y_train = z["train_labels"][:, 0].astype(np.int64)
        y_test = z["test_labels"][:, 0].astype(np.int64)
    fed = medmnist(DataOptions(data_dir=str(SHARED_DATA), num_clients=4, alpha=0.5,
                               test_cap=60))
    assert fed.num_classes == 2 and fed.image_shape == (3, 28, 28)
    # Uncapped, the clients split the official train split exactly (every image once).
    counts = sum(c.class_counts(2) for c in fed.clients)
    assert counts.tolist() == np.bincount(y_train).tolist()
    assert sum(c.num_train for c in fed.clients) == len(y_train)
    gx, gy = fed.global_test
    assert gy.tolist() == y_test.tolist() and gx.shape == (len(y_test), 3, 28, 28)
    capped = medmnist(DataOptions(data_dir=str(SHARED_DATA), num_clients=4, alpha=0.5,
                                  train_cap=100, test_cap=60))
    for c in capped.clients:
        assert c.num_train == 100 and set(c.y_train.unique().tolist()) <= {0, 1}
        assert c.x_train.min() >= -1.0001 and c.x_train.max() <= 1.0001
        tr = c.class_counts(2).float()
        te = torch.bincount(c.y_test, minlength=2).float()
        assert len(c.y_test) == 60
        assert torch.allclose(tr / tr.sum(), te / te.sum(), atol=0.05)


@needs_pneumonia
def test_cli_run_on_pneumoniamnist(tmp_path, monkeypatch):
    from fedvl.cli import main

    monkeypatch.setenv("FEDVL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["run", "--benchmark", "medmnist", "--data-dir", str(SHARED_DATA),
                 "--dataset", "pneumoniamnist", "--method", "fedavg", "--num-clients", "3",
                 "--train-cap", "30", "--test-cap", "20", "--rounds", "1", "--width", "8",
                 "--quiet", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset_info"]["dataset"] == "pneumoniamnist"
    assert 0.0 <= summary["global_test_accuracy"] <= 1.0

"""Evaluation gives the same numbers however its forwards are cut and its rows are split."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedvl.core import training
from fedvl.core.training import evaluate
from fedvl.data.transforms import PixelImages
from fedvl.engine.inprocess import InProcessTransport
from fedvl.engine.workers import ClientPool
from fedvl.models.base import build_model

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def _model(norm: str = "instance") -> torch.nn.Module:
    model = build_model("convnet", 3, 10, 16, seed=3, width=8, depth=2, norm=norm)
    # Trained for one step so that BatchNorm's running statistics are not the identity.
    model.train()
    model(torch.randn(32, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    return model.eval()


@pytest.mark.parametrize("norm", ["instance", "batch"])
def test_forward_rows_do_not_change_accuracy_or_loss(monkeypatch, norm):
    model = _model(norm)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 3, 16, 16, generator=g), torch.randint(0, 10, (300,), generator=g)
    results = []
    for rows in (7, 64, 256):
        monkeypatch.setattr(training, "CPU_FORWARD_ROWS", rows)
        results.append(evaluate(model, x, y))
    assert results[0] == results[1] == results[2]


def test_pixel_image_rows_stay_uint8_and_read_the_same_floats():
    pixels = np.random.default_rng(0).integers(0, 256, (50, 16, 16, 3), dtype=np.uint8)
    images = PixelImages(pixels, 16, 3, MEAN, STD)
    part = images.rows(10, 37)
    assert isinstance(part, PixelImages) and len(part) == 27
    assert np.shares_memory(part.x, pixels)
    assert torch.equal(part[slice(None)], images[10:37])


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("as_pixels", [False, True])
def test_global_test_split_over_workers_equals_one_evaluation(workers, as_pixels):
    model = _model()
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (700, 16, 16, 3), dtype=np.uint8)
    images = PixelImages(pixels, 16, 3, MEAN, STD)
    y = torch.from_numpy(rng.integers(0, 10, 700))
    x = images if as_pixels else images.tensor()
    pool = ClientPool(workers)
    try:
        got = InProcessTransport._split_accuracy(SimpleNamespace(pool=pool), model, x, y)
    finally:
        pool.close()
    assert got == evaluate(model, images.tensor(), y)[0]


def test_mean_accuracy_leaves_out_clients_without_test_images():
    from fedvl.core.training import mean_accuracy

    assert mean_accuracy([0.5, float("nan"), 0.25]) == 0.375
    assert mean_accuracy([float("nan")]) != mean_accuracy([float("nan")])   # NaN
    model = _model()
    empty = evaluate(model, torch.zeros(0, 3, 16, 16), torch.zeros(0, dtype=torch.long))[0]
    assert mean_accuracy([empty, 1.0]) == 1.0

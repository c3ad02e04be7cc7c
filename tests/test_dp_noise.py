"""The DP noise reaches what a client releases, at the scale the mechanism states.

One DP step is run twice from the same generator seed, at sigma and at sigma ~ 0: every draw
coincides, so the difference of the two releases is the noise alone. Its std per released
coordinate must be lr * sigma * C / (expected batch) for DP-SGD (DP-FedAvg), DP-FedDM's default
image-space mechanism (the paper's DP-SGD on the image update) and DESA's DP anchors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedvl.algorithms.base import ClientContext, ServerContext, make_algorithm
from fedvl.config import RunConfig
from fedvl.core.message import Message
from fedvl.run.assemble import build_env
from tests.conftest import make_toy_federation

SIGMA, CLIP = 3.0, 0.5
# Toy federation: 12 images of each of 4 classes per client; batch 4 -> expected batch 4.
CASES = {
    "fedavg": ({"dp_clip": CLIP}, "weights", 0.05 * SIGMA * CLIP / 4),
    "feddm": ({"init": "noise", "steps": 1, "ipc": 2, "batch_real": 4, "dp_clip": CLIP},
              "synthetic_images", 1.0 * SIGMA * CLIP / 4),
    "desa": ({"anchor_steps": 1, "ipc": 2, "batch_real": 4, "dp_clip": CLIP},
             "synthetic_images", 1.0 * SIGMA * CLIP / 4),
}


def _release(method: str, args: dict, sigma: float) -> torch.Tensor:
    fed = make_toy_federation(num_clients=2, n_train=48)
    cfg = RunConfig(method=method, batch_size=4, lr=0.05, momentum=0.0, local_steps=1,
                    model_args={"width": 8, "depth": 2, "norm": "instance"})
    alg = make_algorithm(method, build_env(cfg, fed, torch.device("cpu")),
                         {**args, "dp_noise": sigma})
    msg = alg.configure(alg.server_init(), ServerContext(0), [0])[0]
    c = fed.clients[0]
    client = ClientContext(cid=0, name=c.name, x=c.x_train, y=c.y_train,
                           num_classes=fed.num_classes, state=Message(),
                           generator=torch.Generator().manual_seed(0), round=0)
    sent = alg.share(client, [1])[1] if method == "desa" else alg.client_update(msg, client)
    _, kind, _ = CASES[method]
    return torch.cat([t.double().flatten() for t in sent.arrays[kind].values()])


@pytest.mark.parametrize("method", list(CASES))
def test_noise_in_the_release_has_the_stated_scale(method):
    args, _, stated = CASES[method]
    noise = _release(method, args, SIGMA) - _release(method, args, 1e-12)
    assert len(noise) > 500
    assert float(noise.std()) == pytest.approx(stated, rel=0.1)


def test_feddm_dp_defaults_to_the_image_update_and_keeps_the_feature_form():
    fed = make_toy_federation(num_clients=1, n_train=48)
    env = build_env(RunConfig(method="feddm", model_args={"width": 8, "depth": 2}), fed,
                    torch.device("cpu"))
    assert make_algorithm("feddm", env, {"init": "noise", "dp_noise": 1.0}).p.dp_space == "image"
    args, _, stated = CASES["feddm"]
    feature = {**args, "dp_space": "feature"}
    noise = _release("feddm", feature, SIGMA) - _release("feddm", feature, 1e-12)
    # The feature-space noise is drawn on the class-mean features: in pixels it is far weaker.
    assert float(noise.std()) < 0.5 * stated
    assert dataclasses.asdict(make_algorithm("feddm", env, feature).p)["dp_space"] == "feature"

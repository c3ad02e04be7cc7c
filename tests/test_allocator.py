"""Freed tensor memory stays in the process: training steps stop faulting pages in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fedvl.engine import allocator

# Ten training steps of a small ConvNet on one thread, after three warm-up steps; prints
# whether the thresholds were set and the minor page faults per step.
STEPS = """
import json, resource, torch
from fedvl.engine.allocator import keep_freed_memory
tuned = keep_freed_memory()
torch.set_num_threads(1)
from fedvl.models.base import build_model
m = build_model("convnet", 3, 10, 32, seed=0, width=16, depth=3)
opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
def step():
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
for _ in range(3):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10
print(json.dumps({"tuned": tuned, "faults_per_step": faults}))
"""


def _run(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != allocator.ENV}
    if env_value is not None:
        env[allocator.ENV] = env_value
    out = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's mallopt is not available")
def test_training_steps_reuse_freed_memory_instead_of_faulting_it_in():
    kept, default = _run(None), _run("default")
    assert kept["tuned"] is True and default["tuned"] is False
    # glibc's defaults hand each step's activations back and fault them in again (thousands
    # of pages a step here); kept memory is reused.
    assert default["faults_per_step"] > 500
    assert kept["faults_per_step"] < default["faults_per_step"] / 10


def test_default_keeps_the_allocator_as_it_is(monkeypatch):
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setenv(allocator.ENV, "default")
    assert allocator.keep_freed_memory() is False
    # Decided once per process: a later call does not change it.
    monkeypatch.delenv(allocator.ENV)
    assert allocator.keep_freed_memory() is False

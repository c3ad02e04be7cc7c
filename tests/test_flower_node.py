"""A Flower node's own data: the same client, for every partition id, as the in-process run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedvl.config import RunConfig
from fedvl.flower.node import load_partition, partition_names
from fedvl.run.assemble import build_federation


def _rows(x: torch.Tensor) -> set[bytes]:
    """Each image of a batch as bytes, to compare sets of images across clients."""
    return {bytes(r.numpy().tobytes()) for r in x}


@pytest.mark.parametrize("domains", [None, ["printed-clean", "handwritten-thick"]])
def test_nodes_of_split_styles_get_the_in_process_clients(domains):
    cfg = RunConfig(benchmark="digits-offline", partitions=2, domains=domains, train_cap=40,
                    test_cap=20, seed=2)
    full = build_federation(cfg)
    names = partition_names(cfg)
    assert names == full.client_names
    for pid, ref in enumerate(full.clients):
        client, k, info, n, _ = load_partition(cfg, pid)
        assert (client.name, k, n) == (ref.name, full.num_classes, len(full.clients))
        assert info["client_groups"] == full.info["client_groups"]
        for f in ("x_train", "y_train", "x_test", "y_test"):
            assert torch.equal(getattr(client, f), getattr(ref, f)), (pid, f)
    with pytest.raises(ValueError, match="out of range"):
        load_partition(cfg, len(full.clients))


def test_the_partitions_of_one_style_split_it():
    cfg = RunConfig(benchmark="digits-offline", partitions=2, domains=["handwritten-color"],
                    train_cap=40, test_cap=20, seed=1)
    whole = build_federation(RunConfig(benchmark="digits-offline", domains=["handwritten-color"],
                                       train_cap=40, test_cap=20, seed=1)).clients[0]
    names = partition_names(cfg)
    assert names == ["handwritten-color-0", "handwritten-color-1"]
    parts = [load_partition(cfg, pid)[0] for pid in range(len(names))]
    assert len(parts) == 2
    # The slices are disjoint and together hold the style's training images and labels.
    assert sum(p.num_train for p in parts) == whole.num_train
    assert not _rows(parts[0].x_train) & _rows(parts[1].x_train)
    assert _rows(parts[0].x_train) | _rows(parts[1].x_train) == _rows(whole.x_train)
    labels = np.sort(torch.cat([p.y_train for p in parts]).numpy())
    assert labels.tolist() == np.sort(whole.y_train.numpy()).tolist()


def test_simulation_starts_one_node_per_client(tmp_path):
    pytest.importorskip("flwr")
    from fedvl.flower.simulate import num_partitions

    assert num_partitions(RunConfig(benchmark="digits-offline")) == 5
    assert num_partitions(RunConfig(benchmark="digits-offline", partitions=3,
                                    domains=["handwritten", "printed-clean"])) == 6
    assert num_partitions(RunConfig(benchmark="cifar10-dirichlet", num_clients=7)) == 7
    # DIGITS: the domains named, else the domain files present.
    (tmp_path / "digits").mkdir()
    for d in ("mnist", "usps"):
        np.savez(tmp_path / "digits" / f"{d}.npz", x=np.zeros(1))
    assert num_partitions(RunConfig(benchmark="digits", data_dir=str(tmp_path))) == 2
    assert num_partitions(RunConfig(benchmark="digits", data_dir=str(tmp_path),
                                    domains=["mnist", "svhn", "usps"])) == 3


def test_a_node_refuses_more_clients_than_images_before_listing_them():
    cfg = RunConfig(benchmark="digits-offline", partitions=2**63 - 1)
    with pytest.raises(ValueError, match="clients cannot split 600 training images"):
        partition_names(cfg)


def test_cifar10c_node_count_is_corruptions_times_partitions():
    """Flower starts one node per CIFAR-10-C client (19 corruptions x 3 by default)."""
    from fedvl.config import RunConfig
    from fedvl.flower.simulate import num_partitions

    assert num_partitions(RunConfig(benchmark="cifar10c")) == 57
    assert num_partitions(RunConfig(benchmark="cifar10c", partitions=2,
                                    corruptions=["fog", "snow"])) == 4


def test_a_node_pays_the_first_optimisers_import_only_to_train():
    """The first optimiser of a process imports torch's compiler front end (about 0.8 s). A
    Flower node pays it before a train reply starts its clock, and a node that only answers
    `query.info` or evaluates (Flower starts a process per message) never pays it."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from fedvl.config import RunConfig\n"
        "from fedvl.flower.node import node_run\n"
        "from fedvl.flower.records import config_to_text\n"
        "from fedvl.core.training import evaluate\n"
        "cfg = RunConfig(benchmark='digits-offline', train_cap=20, test_cap=10)\n"
        "node = node_run(config_to_text(cfg), cfg, 0)\n"
        "alg = node.ensure_algorithm(['a', 'b', 'c', 'd', 'e'])\n"
        "evaluate(node.env.model_fn(), node.data.x_test, node.data.y_test)\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "node.ready_to_train()\n"
        "assert 'torch._dynamo' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

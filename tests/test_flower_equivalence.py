"""Same numbers on the embedded engine and on Flower's simulation engine; no raw data flows.

FedAvg, SCAFFOLD, FedProx, MOON and local-only (client state, personalised evaluation), FedDM,
DESA, FedHe, FedProto, FedDF, FedAF, FedD3, DENSE, DynaFed, FedDyn and FedBN on digits-offline
(ConvNet width 8, 100 training images per client, 2 rounds, seed 1, one torch thread) run in
ONE Flower simulation (Ray started once)
and are compared with the embedded engine: per-round per-client accuracy and loss must be
identical (tolerance 0: the maths and the order of every reduction are the same), and so
must the ledger. Every RecordDict that crosses the Flower network is recorded at the
ServerApp (all traffic goes through it) and checked for client training images and labels.

FedProx at seed 29 also runs *without* a thread count on either side while this process uses
two torch threads (the Ray actors start with one): the server resolves the count and sends it
to the nodes, so the numbers are still identical. SCAFFOLD with `--lr-decay 0.5` shows that every
node trains at its round's learning rate. A SCAFFOLD run interrupted after round 0
and resumed with `fedvl flower simulate --resume` ends with the uninterrupted run's metrics
(the interrupted run is the simulation's last experiment: Ray starts once for all of them).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from fedvl.config import RunConfig  # noqa: E402
from fedvl.engine.driver import TIMING_KEYS  # noqa: E402
from fedvl.flower.node import config_key  # noqa: E402
from fedvl.flower.records import config_to_text  # noqa: E402
from fedvl.registry import ALGORITHMS  # noqa: E402
from fedvl.run.assemble import build_federation  # noqa: E402
from fedvl.run.experiment import run_experiment  # noqa: E402

pytestmark = [pytest.mark.flower, pytest.mark.slow(seconds=68)]

# FedProx runs as DEFAULT_THREADS below (its row checks the same numbers).
METHODS = {"fedavg": {}, "scaffold": {},
           # client state in Context.state: MOON's previous model, local's own model
           "moon": {"out_dim": 16}, "local": {},
           # synthetic sets up, a server-trained model down
           "feddm": {"ipc": 2, "steps": 2, "batch_real": 8, "server_epochs": 2,
                     "server_batch_size": 16},
           # serverless: anchors and anchor logits relayed peer to peer, per-client models
           "desa": {"ipc": 2, "anchor_steps": 2, "batch_real": 8},
           # per-class logits / prototypes through the server, per-client models
           "fedhe": {}, "fedproto": {},
           # ensemble logits on a public set (every node builds the same one)
           "feddf": {"public_batch": 16},
           # condensed sets with soft labels and class knowledge up, prototypes down
           "fedaf": {"ipc": 2, "steps": 2, "batch_real": 8, "server_epochs": 2,
                     "server_batch_size": 16, "projections": 8},
           # one-shot: distilled sets up in round 0 only
           "fedd3": {"ipc": 2, "steps": 2, "batch_real": 8, "server_epochs": 2,
                     "server_batch_size": 16},
           # client models up, a generator and distillation on the server
           "dense": {"server_epochs": 1, "g_steps": 2, "syn_batch": 8, "kd_batch": 8,
                     "noise_dim": 8, "ngf": 4},
           # server-side trajectory matching on the global models
           "dynafed": {"trajectory_length": 2, "expert_rounds": 1, "average_min": 1,
                       "syn_steps": 2, "iterations": 2, "ipc": 1, "finetune_epochs": 1},
           # client state (the linear term) on the nodes, server state h
           "feddyn": {},
           # BatchNorm layers kept on the nodes
           "fedbn": {}}
# Run settings some methods need beyond their options.
BN_MODEL = {"width": 8, "depth": 3, "norm": "batch"}
EXTRA = {"feddf": {"public": "digits-offline", "public_size": 40},
         # DENSE's BN-statistics term and FedBN's local layers need BatchNorm
         "dense": {"model_args": BN_MODEL}, "fedbn": {"model_args": BN_MODEL}}
# Keys of the embedded personalised summary that need cross-client evaluation (not on Flower).
CROSS = {"global_accuracy", "mean_global_accuracy", "cross_accuracy", "inter_accuracy",
         "mean_inter_accuracy", "worst_accuracy"}
BASE = RunConfig(benchmark="digits-offline", train_cap=100, test_cap=50, rounds=2, seed=1,
                 model_args={"width": 8, "depth": 3, "norm": "instance"}, local_steps=4,
                 batch_size=16, threads=1)
# No thread count set: each side would use its own default without the server's resolution.
# FedProx's proximal term rides along: its only row on this transport.
DEFAULT_THREADS = replace(BASE, method="fedprox", method_args={"mu": 0.1}, seed=29,
                          threads=None)
# A per-round learning rate: the nodes must know the round (SCAFFOLD also divides by the lr).
LR_DECAY = replace(BASE, method="scaffold", lr_decay=0.5)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    import torch

    from fedvl.flower.server_app import ServerOptions
    from fedvl.flower.simulate import simulate

    root = tmp_path_factory.mktemp("flower-eq")
    cfgs = {m: replace(BASE, method=m, method_args=a, **EXTRA.get(m, {}))
            for m, a in METHODS.items()}
    cfgs["default-threads"] = DEFAULT_THREADS
    cfgs["lr-decay"] = LR_DECAY
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # differs from the Ray actors' single thread
    embedded = {m: run_experiment(c, out=root / f"emb-{m}") for m, c in cfgs.items()}
    traffic: list[tuple[str, str, object, str]] = []
    current = [""]
    scaffold_key = config_key(config_to_text(cfgs["scaffold"]))
    scaffold_runs = [0]

    def tap(direction, msg):
        # Exchanges are synchronous, so a reply belongs to the experiment of the last send.
        if direction == "send":
            key = str(msg.content["fedvl.run"]["config-key"])
            scaffold_runs[0] += key == scaffold_key != current[0]
            current[0] = key
            # The last experiment repeats SCAFFOLD and is stopped before its round 1 (the
            # resume test continues it): one Ray start-up serves both.
            if (scaffold_runs[0] == 2 and key == scaffold_key
                    and msg.metadata.message_type == "train"
                    and msg.content["fedvl.run"]["round"] == 1):
                raise RuntimeError("server stopped")
        traffic.append((direction, msg.metadata.message_type, msg.content, current[0]))

    experiments = [(c, ServerOptions(out=str(root / f"flw-{m}"), round_timeout=300,
                                     join_timeout=300)) for m, c in cfgs.items()]
    experiments.append((cfgs["scaffold"], ServerOptions(out=str(root / "cut"),
                                                        round_timeout=300)))
    try:
        # The ServerApp's error comes back out of the simulation, after every other run ended.
        with pytest.raises(RuntimeError, match="server stopped"):
            simulate(experiments, tap=tap)
    finally:
        torch.set_num_threads(before)
    flower = {m: json.loads((root / f"flw-{m}" / "summary.json").read_text()) for m in cfgs}
    return cfgs, embedded, flower, traffic, root


@pytest.mark.parametrize("method", [*METHODS, "default-threads", "lr-decay"])
def test_same_numbers(runs, method) -> None:
    _, embedded, flower, _, root = runs
    e, f = embedded[method], flower[method]
    assert f["flower"]["status"] == "completed" and not f["flower"]["failures"]
    assert set(e) - CROSS <= set(f)  # every key of `fedvl run`'s summary.json is there
    assert f["accuracy_curve"] == e["accuracy_curve"]
    assert f["per_client_accuracy"] == e["per_client_accuracy"]
    assert f["per_client_loss"] == e["per_client_loss"]
    for k in ("bytes_up", "bytes_down", "bytes_peer", "bytes_by_kind", "clients",
              "train_samples"):
        assert f.get(k) == e.get(k), k
    rows_e = [json.loads(x) for x in (root / f"emb-{method}" / "metrics.jsonl").open()]
    rows_f = [json.loads(x) for x in (root / f"flw-{method}" / "metrics.jsonl").open()]
    assert len(rows_e) == len(rows_f) == BASE.rounds
    assert f["threads"] == e["threads"] == (2 if method == "default-threads" else 1)
    for a, b in zip(rows_e, rows_f, strict=True):
        for k in ("sampled", "train_loss", "round_bytes_up", "round_bytes_down",
                  "round_bytes_peer", "per_client_accuracy", "mean_accuracy"):
            # FedDM clients do not train a model (no train_loss); star runs have no peer bytes.
            assert k in a or k in ("train_loss", "round_bytes_peer"), (method, k)
            assert a.get(k) == b.get(k), (method, a["round"], k)
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        assert (root / f"flw-{method}" / name).is_file()
    # The clients' seconds travel with their replies: synthesis where they distil (DESA's
    # anchors may come from an earlier run's disk cache: not checked).
    for rows in (rows_e, rows_f):
        summed = [r["client_seconds_summed"] for r in rows]
        assert all(s["total"] > 0 for s in summed), method
        if method != "desa":
            # Clients that train no model spend their time distilling.
            distil = not ALGORITHMS.get(runs[0][method].method).trains_client_models
            assert (sum(s["synthesis"] for s in summed) > 0) == distil, method


def test_no_raw_data_crosses_the_network(runs) -> None:
    from flwr.app import ArrayRecord, ConfigRecord

    cfgs, _, _, traffic, _ = runs
    fed = build_federation(cfgs["fedavg"])
    img = int(np.prod(fed.image_shape))
    rows = {c.x_train[i].numpy().astype(np.float32).tobytes()
            for c in fed.clients for i in range(len(c.y_train))}
    labels = [c.y_train.numpy() for c in fed.clients]
    kinds_seen: dict[str, set[str]] = {}
    assert traffic
    fedavg_key = config_key(config_to_text(cfgs["fedavg"]))
    fedavg_records: set[str] = set()
    for _direction, mtype, content, key_of_run in traffic:
        for key, rec in content.items():
            if isinstance(rec, ConfigRecord):  # small scalars and the config text only
                assert not any(isinstance(v, bytes) for v in rec.values()), key
            if not isinstance(rec, ArrayRecord):
                continue
            # Relayed peer messages (`peer.<to>.`, `inbox.<from>.`) hold the same kinds.
            key = re.sub(r"^(peer|inbox)\.\d+\.", "msg.", key)
            kinds_seen.setdefault(mtype, set()).add(key)
            if key_of_run == fedavg_key:
                fedavg_records.add(key)
            for arr in rec.values():
                a = arr.numpy()
                if a.size % img == 0 and a.size:
                    chunks = a.astype(np.float32).reshape(-1, img)
                    assert not any(r.tobytes() in rows for r in chunks), key
                for y in labels:
                    assert not (a.shape == y.shape and np.array_equal(a, y)), key
    # Only model-kind payloads, SCAFFOLD's control variates, the synthetic sets of FedDM, FedD3
    # and FedAF and DESA's anchors (checked above to hold no raw image row), logits and
    # prototypes ever travel.
    allowed = {"msg.arrays.weights", "msg.arrays.control_variates",
               "msg.arrays.synthetic_images", "msg.arrays.synthetic_labels",
               "msg.arrays.logits", "msg.arrays.prototypes"}
    # local-only never sends a model: its train messages carry no arrays at all
    assert set().union(*kinds_seen.values()) <= allowed
    assert "query.info" not in kinds_seen and "evaluate" in kinds_seen
    assert "msg.arrays.weights" in kinds_seen["train"]
    assert fedavg_records == {"msg.arrays.weights"}  # FedAvg: model weights only


def test_simulate_resume_matches_uninterrupted(runs, capsys) -> None:
    """SCAFFOLD (client state on the nodes) stopped before round 1, resumed from its directory."""
    from fedvl.cli import main

    _, _, flower, _, root = runs
    out = root / "cut"

    def rows(d):
        return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS}
                for x in (d / "metrics.jsonl").open()]

    # The same config again in the same simulation starts from fresh client state, not from
    # the state the first run left on the nodes.
    assert rows(out) == rows(root / "flw-scaffold")[:1]
    assert any((out / "node-state").rglob("round-0.pt"))  # the nodes kept their c_i

    capsys.readouterr()
    assert main(["flower", "simulate", "--resume", str(out)]) == 0
    # Ray's start-up is announced, then measured apart from the rounds (not a silent hang).
    err = capsys.readouterr().err
    assert "fedvl: starting Flower simulation (Ray, 5 virtual nodes)..." in err
    assert re.search(r"fedvl: Flower start-up took \d+\.\d s before the first round", err)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["flower"]["startup_seconds"] > 0
    assert summary["flower"]["status"] == "completed"
    # Equal numbers need every node in every round: a node that misses the deadline (seen on a
    # machine overloaded by other jobs) changes the round, and this says so instead of a diff.
    assert not summary["flower"]["lost_rounds"], summary["flower"]["failures"]
    full = flower["scaffold"]
    for k in ("accuracy_curve", "per_client_accuracy", "per_client_loss", "bytes_by_kind"):
        assert summary[k] == full[k], k
    assert rows(out) == rows(root / "flw-scaffold")

"""The Flower ServerApp's round loop against an in-process Grid (no Ray, no processes).

`FakeGrid` delivers each Message to fedvl's real ClientApp (one Context per node, so client
state persists as in Flower) and can drop messages (a node that never answers) or take nodes
offline. Checks: same numbers as the embedded engine, lost rounds recorded, a silent node
costs at most one round timeout, `min-nodes` stops the run instead of waiting forever, and a
restarted node (new node id, same partition) is used again. Also: an interrupted run resumes
from its checkpoint with fresh nodes that reload their own client state from disk, and the
server resolves the torch thread count once and sends it to every node.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

pytest.importorskip("flwr")

from fedvl.config import RunConfig  # noqa: E402
from fedvl.engine.driver import TIMING_KEYS  # noqa: E402
from tests.conftest import FakeGrid, run_on_grid  # noqa: E402

pytestmark = pytest.mark.flower

DOMAINS = ["handwritten", "printed-clean", "handwritten-thick"]
CFG = RunConfig(method="scaffold", benchmark="digits-offline", domains=DOMAINS, train_cap=30,
                test_cap=20, rounds=3, seed=4, local_steps=2, batch_size=16, threads=1,
                model_args={"width": 8, "depth": 3, "norm": "instance"})


def _rows(tmp_path, name="run"):
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").open()]


def _numbers(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_same_numbers_as_embedded(tmp_path) -> None:
    from fedvl.run.experiment import run_experiment

    s = run_on_grid(FakeGrid(3), CFG, tmp_path, round_timeout=30)
    e = run_experiment(CFG, out=tmp_path / "embedded")
    assert s["accuracy_curve"] == e["accuracy_curve"]
    assert s["per_client_loss"] == e["per_client_loss"]
    assert s["bytes_by_kind"] == e["bytes_by_kind"]


def test_silent_node_is_dropped_and_not_awaited_again(tmp_path) -> None:
    grid = FakeGrid(3, drop=lambda pid, mtype, rnd: pid == 2 and rnd >= 1)
    t0 = time.monotonic()
    s = run_on_grid(grid, CFG, tmp_path, round_timeout=2.0)
    assert time.monotonic() - t0 < 2.0 + 30  # one timeout, not one per message
    fl = s["flower"]
    assert fl["status"] == "completed" and fl["lost_rounds"] == {DOMAINS[2]: [1, 2]}
    rows = _rows(tmp_path)
    assert [r["participants"] for r in rows] == [[0, 1, 2], [0, 1], [0, 1]]
    assert "no reply within" in rows[1]["lost"][DOMAINS[2]]
    assert rows[2]["eval_missing"] == [DOMAINS[2]]
    assert set(s["per_client_accuracy"]) == set(DOMAINS[:2])


def test_min_nodes_stops_instead_of_waiting_forever(tmp_path) -> None:
    grid = FakeGrid(3)
    orig = grid.push_messages

    def push(messages):
        ids = orig(messages)
        if any(m.metadata.message_type == "evaluate" for m in messages):
            grid.online.pop(102, None)  # node 2 leaves for good after round 0
        return ids

    grid.push_messages = push
    t0 = time.monotonic()
    s = run_on_grid(grid, CFG, tmp_path, round_timeout=5.0, min_nodes=3, node_wait=1.0)
    assert time.monotonic() - t0 < 60
    assert s["flower"]["status"] == "aborted" and s["flower"]["rounds_completed"] == 1
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["flower"]["status"] == "aborted"


def test_offline_node_then_restarted(tmp_path) -> None:
    grid = FakeGrid(3)
    orig = grid.push_messages
    seen = []

    def push(messages):
        ids = orig(messages)
        kinds = {m.metadata.message_type for m in messages}
        if "evaluate" in kinds:
            seen.append(1)
            if len(seen) == 1:
                grid.online.pop(101)                 # partition 1 offline during round 1
            elif len(seen) == 2:
                grid.online[201] = 1                 # ... and back with a new node id
                grid.contexts[1].state = type(grid.contexts[1].state)()
        return ids

    grid.push_messages = push
    s = run_on_grid(grid, replace(CFG, method="fedavg"), tmp_path, round_timeout=5.0)
    rows = _rows(tmp_path)
    assert [r["participants"] for r in rows] == [[0, 1, 2], [0, 2], [0, 1, 2]]
    assert rows[1]["lost"] == {DOMAINS[1]: "offline"}
    assert s["flower"]["lost_rounds"] == {DOMAINS[1]: [1]}
    assert s["flower"]["nodes"][DOMAINS[1]] == 201


def test_interrupted_run_resumes_with_node_state_from_disk(tmp_path) -> None:
    import torch

    cfg = replace(CFG, rounds=4, client_ratio=0.67)  # SCAFFOLD: c_i lives on the nodes
    full = run_on_grid(FakeGrid(3, state_dir=str(tmp_path / "nodes-full")), cfg, tmp_path,
                name="full", round_timeout=30)

    grid = FakeGrid(3, state_dir=str(tmp_path / "nodes"))
    orig = grid.push_messages

    def push(messages):
        if any(m.metadata.message_type == "train" and int(m.content["fedvl.run"]["round"]) == 2
               for m in messages):
            raise RuntimeError("server stopped")
        return orig(messages)

    grid.push_messages = push
    with pytest.raises(RuntimeError, match="server stopped"):
        run_on_grid(grid, cfg, tmp_path, name="cut", round_timeout=30)
    ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert ck["round"] == 1 and "client_states" not in ck  # client state stays on the nodes
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["flower"][
        "status"] == "failed"

    # New nodes (empty Context.state), same node state directory: they reload from disk.
    resumed = run_on_grid(FakeGrid(3, state_dir=str(tmp_path / "nodes")), cfg, tmp_path,
                   resume=True, name="cut", round_timeout=30)
    assert _numbers(_rows(tmp_path, "cut")) == _numbers(_rows(tmp_path, "full"))
    assert resumed["accuracy_curve"] == full["accuracy_curve"]
    assert resumed["per_client_loss"] == full["per_client_loss"]
    assert resumed["bytes_by_kind"] == full["bytes_by_kind"]
    assert resumed["flower"]["status"] == "completed" and not resumed["flower"]["failures"]


def test_resume_needs_the_nodes_client_state(tmp_path) -> None:
    """Without the nodes' saved state, SCAFFOLD resumed from round 1 gives other numbers."""
    import shutil

    cfg = replace(CFG, rounds=3)
    run_on_grid(FakeGrid(3, state_dir=str(tmp_path / "nodes-full")), cfg, tmp_path, name="full",
         round_timeout=30)
    grid = FakeGrid(3, state_dir=str(tmp_path / "nodes"))
    orig = grid.push_messages

    def push(messages):
        if any(m.metadata.message_type == "train" and int(m.content["fedvl.run"]["round"]) == 1
               for m in messages):
            raise RuntimeError("server stopped")
        return orig(messages)

    grid.push_messages = push
    with pytest.raises(RuntimeError):
        run_on_grid(grid, cfg, tmp_path, name="cut", round_timeout=30)
    shutil.rmtree(tmp_path / "nodes")
    run_on_grid(FakeGrid(3, state_dir=str(tmp_path / "nodes")), cfg, tmp_path, resume=True,
         name="cut", round_timeout=30)
    assert _numbers(_rows(tmp_path, "cut"))[0] == _numbers(_rows(tmp_path, "full"))[0]
    assert _numbers(_rows(tmp_path, "cut"))[1:] != _numbers(_rows(tmp_path, "full"))[1:]


def test_thread_count_resolved_once_and_sent_to_nodes(tmp_path) -> None:
    import torch
    import yaml

    torch.set_num_threads(2)  # the conftest fixture restores the count afterwards
    grid = FakeGrid(3)
    sent = []
    orig = grid.push_messages

    def push(messages):
        sent.extend(yaml.safe_load(str(m.content["fedvl.run"]["config"]))["threads"]
                    for m in messages)
        return orig(messages)

    grid.push_messages = push
    s = run_on_grid(grid, replace(CFG, threads=None, rounds=1), tmp_path, round_timeout=30)
    assert sent and set(sent) == {2}
    assert s["threads"] == 2
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["threads"] == 2


class TamperingGrid(FakeGrid):
    """A FakeGrid whose node of partition `pid` answers round `rnd` with a record that is not a
    fedvl Message (an unknown payload kind)."""

    def __init__(self, num_nodes: int, pid: int, rnd: int) -> None:
        super().__init__(num_nodes)
        self.bad = (pid, rnd)

    def push_messages(self, messages):
        from flwr.app import Array, ArrayRecord

        ids = super().push_messages(messages)
        for m, i in zip(messages, ids, strict=True):
            run = m.content["fedvl.run"]
            pid = self.online.get(m.metadata.dst_node_id)
            if (m.metadata.message_type == "train" and (pid, int(run["round"])) == self.bad
                    and i in self.outbox):
                import numpy as np

                self.outbox[i].content["msg.arrays.private_images"] = ArrayRecord(
                    {"x": Array(np.zeros((2, 2), dtype=np.float32))})
        return ids


def test_bad_replies_dropped_as_in_embedded(tmp_path, monkeypatch) -> None:
    """A NaN reply is dropped on Flower exactly as in-process (same rejected record, same
    numbers); a reply that is not a fedvl Message is dropped too, and the run goes on."""
    import torch

    from fedvl.algorithms.scaffold import Scaffold
    from fedvl.run.experiment import run_experiment

    original = Scaffold.client_update

    def update(self, msg, ctx):
        reply = original(self, msg, ctx)
        if ctx.cid == 1 and ctx.round == 1:
            cv = reply.arrays["control_variates"]
            name = next(iter(cv))
            cv[name] = torch.full_like(cv[name], float("nan"))
        return reply

    monkeypatch.setattr(Scaffold, "client_update", update)
    s = run_on_grid(FakeGrid(3), CFG, tmp_path, round_timeout=30)
    e = run_experiment(CFG, out=tmp_path / "embedded", fed=None)
    rows = _rows(tmp_path)
    assert rows[1]["participants"] == [0, 2]
    assert "control_variates/" in rows[1]["rejected"][DOMAINS[1]]
    assert s["rejected_replies"] == e["rejected_replies"] != []
    assert s["accuracy_curve"] == e["accuracy_curve"]
    assert s["per_client_loss"] == e["per_client_loss"]

    monkeypatch.setattr(Scaffold, "client_update", original)
    s = run_on_grid(TamperingGrid(3, pid=2, rnd=0), CFG, tmp_path, name="unreadable",
             round_timeout=30)
    row = _rows(tmp_path, "unreadable")[0]
    assert row["participants"] == [0, 1]
    assert "unreadable reply" in row["rejected"][DOMAINS[2]]
    assert "private_images" in row["rejected"][DOMAINS[2]]
    assert s["flower"]["status"] == "completed"


def test_below_min_nodes_fails_and_resumes(tmp_path) -> None:
    """A node that misses round 1 with min-nodes 3: the run fails with a status naming the
    loss, keeps round 0's checkpoint, and resumed with all nodes ends like the embedded run."""
    from fedvl.flower.failures import MinNodesError
    from fedvl.run.experiment import run_experiment

    cfg = replace(CFG, method="fedavg")
    grid = FakeGrid(3, drop=lambda pid, mtype, rnd: pid == 2 and rnd == 1)
    with pytest.raises(MinNodesError) as err:
        run_on_grid(grid, cfg, tmp_path, round_timeout=1.0, min_nodes=3)
    status = "failed: 1 of 3 clients lost at round 1 (below --min-nodes 3)"
    assert err.value.status == status
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["flower"]["status"] == status
    assert [(c["round"], c["client"]) for c in saved["flower"]["lost_clients"]] == [
        (1, DOMAINS[2])]
    assert len(_rows(tmp_path)) == 1   # round 1 is not kept: resume reruns it

    s = run_on_grid(FakeGrid(3), cfg, tmp_path, resume=True, round_timeout=30, min_nodes=3)
    e = run_experiment(cfg, out=tmp_path / "embedded")
    assert s["flower"]["status"] == "completed" and s["flower"]["resumed_after"] == status
    assert s["evaluated_clients"] == DOMAINS
    assert s["accuracy_curve"] == e["accuracy_curve"]
    assert s["per_client_loss"] == e["per_client_loss"]


def test_lost_in_evaluation_counts_and_reasons_are_plain(tmp_path) -> None:
    """An evaluation error reply with terminal escapes: recorded as one plain line; with
    min-nodes 1 the run goes on and the round says whose accuracy its mean is."""
    from flwr.app import Error
    from flwr.app import Message as FlwrMessage

    grid = FakeGrid(3)
    orig = grid.push_messages

    def push(messages):
        ids = orig(messages)
        for m, i in zip(messages, ids, strict=True):
            if (m.metadata.message_type == "evaluate" and m.metadata.dst_node_id == 101
                    and int(m.content["fedvl.run"]["round"]) == 0):
                grid.outbox[i] = FlwrMessage(Error(code=0, reason="\x1b[31mActorDiedError\x1b"
                                                   "[0m:\n\tboom" + "x" * 1000), reply_to=m)
        return ids

    grid.push_messages = push
    s = run_on_grid(grid, replace(CFG, method="fedavg", rounds=2), tmp_path, round_timeout=30)
    rows = _rows(tmp_path)
    assert rows[0]["evaluated_clients"] == [DOMAINS[0], DOMAINS[2]]
    assert rows[0]["eval_missing"] == [DOMAINS[1]]
    assert rows[1]["evaluated_clients"] == DOMAINS
    lost = s["flower"]["lost_clients"]
    assert [(c["round"], c["stage"], c["client"]) for c in lost] == [(0, "evaluate", DOMAINS[1])]
    reason = lost[0]["reason"]
    assert reason.startswith("error 0: ActorDiedError: boom") and len(reason) <= 300
    assert "\x1b" not in reason and "\n" not in reason and "\t" not in reason
    assert s["flower"]["status"] == "completed"


def test_garbled_info_answer_leaves_that_node_out(tmp_path) -> None:
    """A node answering `query.info` with nonsense (a non-number size, a partition beyond the
    federation) is left out and recorded; the run goes on with the others."""
    grid = FakeGrid(3)
    orig = grid.push_messages

    def push(messages):
        ids = orig(messages)
        for m, i in zip(messages, ids, strict=True):
            pid = grid.online.get(m.metadata.dst_node_id)
            if m.metadata.message_type == "query.info" and pid in (1, 2) and i in grid.outbox:
                info = grid.outbox[i].content["info"]
                if pid == 1:
                    info["num-train"] = "lots"
                else:
                    info["partition-id"] = 10**6
        return ids

    grid.push_messages = push
    s = run_on_grid(grid, replace(CFG, method="fedavg", rounds=1), tmp_path, round_timeout=5,
             node_wait=0.1, join_timeout=1, min_nodes=1)
    failures = [f for f in s["flower"]["failures"] if f.get("stage") == "discover"]
    assert any("unreadable info answer" in f.get("error", "") for f in failures)
    assert any("partition 1000000" in f.get("error", "") for f in failures)
    assert _rows(tmp_path)[0]["participants"] == [0]

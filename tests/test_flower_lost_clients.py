"""A client process that dies in a Flower simulation: recorded, never a silent subset.

Without Ray: failure reasons lose their terminal escapes and stay one bounded line, the
`min-nodes` rule and its status text, and `fedvl flower simulate`'s exit code and single error
line. With Ray (one test, two simulations): a ClientApp that calls `os._exit(1)` in round 1
fails the run (exit code 1, one error line, status naming the loss, round 0's checkpoint);
resumed, it ends with the embedded engine's numbers for the rounds before a second crash,
which `--min-nodes 4` tolerates: that client is recorded as lost, the actor is restarted and
the evaluation covers every client again.
"""

from __future__ import annotations

import json

import pytest

from fedvl.flower.failures import (
    REASON_LIMIT,
    MinNodesError,
    check_min_nodes,
    clean_reason,
    describe_loss,
)

RAY_REASON = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::"
              "ClientAppActor.run()\x1b[39m (pid=5090, ip=192.0.2.2)\n\tFile \"x.py\", line 3"
              "\r\n\x1b]8;;http://example.org\x07link\x1b]8;;\x07 \x9b1mbold\x9b0m\x00end'>")


def test_clean_reason_strips_escapes_and_controls() -> None:
    text = clean_reason(RAY_REASON)
    assert text == ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::"
                    "ClientAppActor.run() (pid=5090, ip=192.0.2.2) File \"x.py\", line 3 link "
                    "bold end'>")
    assert all(c.isprintable() for c in text)


def test_clean_reason_is_bounded() -> None:
    text = clean_reason("\x1b[31m" + "a" * 100_000)
    assert len(text) == REASON_LIMIT and text.endswith("...")
    assert clean_reason("short") == "short"


def test_min_nodes_rule_and_status() -> None:
    check_min_nodes(2, "train", 4, 5, 4, {"c": "gone"})   # 4 of 5 answered, 4 needed
    check_min_nodes(2, "train", 2, 2, 5, {})              # fewer sampled than min-nodes: all
    with pytest.raises(MinNodesError) as err:
        check_min_nodes(2, "train", 4, 5, 5, {"c": "gone"})
    assert err.value.status == "failed: 1 of 5 clients lost at round 2 (below --min-nodes 5)"
    assert err.value.lost == {"c": "gone"} and err.value.round == 2
    assert describe_loss(0, "evaluate", 1, 3, 2) == (
        "2 of 3 clients lost in the evaluate of round 0 (below --min-nodes 2)")


def test_simulate_command_exit_code_and_one_line(monkeypatch, short_tmp, capsys) -> None:
    """Without Ray: the command needs every client by default, and a failed run is exit code
    1 with one error line naming the loss and how to continue."""
    pytest.importorskip("flwr")
    import fedvl.flower.simulate as sim
    from fedvl.cli import main

    seen = []

    def fail(experiments, **kw):
        seen.append(experiments[0][1].min_nodes)
        raise MinNodesError(1, "train", 4, 5, experiments[0][1].min_nodes, {"a": "died"})

    monkeypatch.setattr(sim, "simulate", fail)
    out = short_tmp / "run"
    args = ["flower", "simulate", "--method", "fedavg", "--benchmark", "digits-offline",
            "--out", str(out), "--quiet"]
    assert main(args) == 1
    assert main([*args, "--min-nodes", "4"]) == 1
    assert seen == [5, 4]   # digits-offline: 5 partitions
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (f"fedvl: error: run failed: 1 of 5 clients lost at round 1 (below "
                      f"--min-nodes 5); {out}/summary.json says which clients and why; "
                      f"continue with: fedvl flower simulate --resume {out}")
    assert len(err) == 2

    def aborted(experiments, **kw):
        return [{"flower": {"status": "aborted", "failures": [
            {"round": 3, "stage": "sample", "reason": "fewer than 5 reachable nodes after 60 s"}
        ]}}]

    monkeypatch.setattr(sim, "simulate", aborted)
    assert main(args) == 1
    assert capsys.readouterr().err.strip() == (
        f"fedvl: error: run aborted: fewer than 5 reachable nodes after 60 s; continue with: "
        f"fedvl flower simulate --resume {out}")


def _crashing_app(marks: str, crash: dict[int, int]):
    """fedvl's ClientApp, except that partition p dies (`os._exit(1)`) in round crash[p], the
    first two times it gets that round's train message (Ray retries a message once)."""
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg, context):
        import os
        from pathlib import Path

        from fedvl.flower import client_app as ca

        pid, rnd = int(context.node_config["partition-id"]), int(msg.content["fedvl.run"]["round"])
        if crash.get(pid) == rnd:
            mark = Path(marks) / f"{pid}-{rnd}"
            tries = len(mark.read_text()) if mark.exists() else 0
            if tries < 2:
                mark.write_text("x" * (tries + 1))
                os._exit(1)
        return ca.train(msg, context)

    @app.evaluate()
    def evaluate(msg, context):
        from fedvl.flower import client_app as ca

        return ca.evaluate_(msg, context)

    @app.query("info")
    def info(msg, context):
        from fedvl.flower import client_app as ca

        return ca.info(msg, context)

    return app


@pytest.mark.flower
@pytest.mark.slow(seconds=38)
def test_client_process_death_in_simulation(monkeypatch, short_tmp, capsys) -> None:
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    import fedvl.flower.client_app as ca
    from fedvl.cli import main
    from fedvl.config import load_yaml
    from fedvl.engine.driver import TIMING_KEYS
    from fedvl.run.experiment import run_experiment

    marks = short_tmp / "marks"
    marks.mkdir()
    # Partition 1 dies in round 1 (first run); partition 3 in round 2 (resumed run).
    monkeypatch.setattr(ca, "app", _crashing_app(str(marks), {1: 1, 3: 2}))
    out = short_tmp / "run"
    args = ["flower", "simulate", "--method", "fedavg", "--benchmark", "digits-offline",
            "--train-cap", "30", "--test-cap", "20", "--rounds", "3", "--seed", "4",
            "--local-steps", "2", "--batch-size", "16", "--threads", "1", "--width", "8",
            "--depth", "3", "--norm", "instance", "--round-timeout", "120", "--out", str(out),
            "--quiet", "--client-cpus", "1"]
    capsys.readouterr()
    assert main(args) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fedvl:")]
    status = "failed: 1 of 5 clients lost at round 1 (below --min-nodes 5)"
    assert err == [f"fedvl: error: run {status}; {out}/summary.json says which clients and "
                   f"why; continue with: fedvl flower simulate --resume {out}"]
    s = json.loads((out / "summary.json").read_text())
    names = s["clients"]
    fl = s["flower"]
    assert fl["status"] == status and fl["rounds_completed"] == 1
    # Only the dead client is lost: the restarted actor serves the others.
    assert [(c["round"], c["stage"], c["client"]) for c in fl["lost_clients"]] == [
        (1, "train", names[1])]
    assert all(c["reason"].isprintable() and len(c["reason"]) <= 300
               for c in fl["lost_clients"])
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert (out / "checkpoint.pt").is_file()

    # Resumed: round 1 again with every client; partition 3 dies in round 2, which
    # --min-nodes 4 tolerates.
    assert main(["flower", "simulate", "--resume", str(out), "--quiet", "--client-cpus", "1",
                 "--min-nodes", "4"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["flower"]["status"] == "completed" and s["flower"]["resumed_after"] == status
    assert [(c["round"], c["client"]) for c in s["flower"]["lost_clients"]] == [(2, names[3])]
    assert s["evaluated_clients"] == names   # the restarted actor evaluates again
    rows = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    assert [r["participants"] for r in rows] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4],
                                                 [0, 1, 2, 4]]
    assert list(rows[2]["lost"]) == [names[3]] and rows[2]["evaluated_clients"] == names
    embedded = run_experiment(load_yaml(out / "config.yaml"), out=short_tmp / "embedded")
    emb = [json.loads(x) for x in (short_tmp / "embedded" / "metrics.jsonl").open()]

    def numbers(r):
        return {k: v for k, v in r.items() if k in ("train_loss", "per_client_accuracy",
                                                     "per_client_loss", "round_bytes_up")}

    assert [numbers(r) for r in rows[:2]] == [numbers(r) for r in emb[:2]]
    assert embedded["accuracy_curve"][:2] == s["accuracy_curve"][:2]
    assert not any(k in TIMING_KEYS for k in numbers(rows[0]))

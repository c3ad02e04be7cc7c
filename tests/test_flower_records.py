"""Fast checks of the Flower adapter: message <-> RecordDict, config transport, app files."""

from __future__ import annotations

import pytest

flwr = pytest.importorskip("flwr")

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, RecordDict  # noqa: E402

from fedvl.config import RunConfig  # noqa: E402
from fedvl.core.message import Message, MessageError  # noqa: E402
from fedvl.flower.records import (  # noqa: E402
    config_from_run_config,
    config_from_text,
    config_to_text,
    from_recorddict,
    put_message,
    to_recorddict,
)

pytestmark = pytest.mark.flower


def _msg() -> Message:
    return Message(
        {"weights": {"conv.weight": torch.randn(4, 3, 3, 3), "bn.num": torch.tensor(7),
                     "empty": torch.zeros(0, 5)},
         "control_variates": {"conv.weight": torch.randn(4, 3, 3, 3).double()},
         "synthetic_labels": {"y": torch.arange(10)}},
        {"num_examples": 12, "train_loss": 0.5, "flag": True, "name": "x",
         "ints": [1, 2], "mixed": [1, 2.5], "strs": ["a", "b"], "empty": []},
    )


def test_roundtrip_is_exact() -> None:
    msg = _msg()
    rd = to_recorddict(msg)
    assert isinstance(rd["msg.arrays.weights"], ArrayRecord)
    assert isinstance(rd["msg.meta"], ConfigRecord)
    back = from_recorddict(rd)
    assert back.meta == msg.meta
    assert type(back.meta["flag"]) is bool and type(back.meta["num_examples"]) is int
    for kind, tensors in msg.arrays.items():
        assert list(back.arrays[kind]) == list(tensors)  # order kept
        for name, t in tensors.items():
            u = back.arrays[kind][name]
            assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
            assert t.numel() == 0 or u.data_ptr() != t.data_ptr()
    assert msg.bytes_by_kind() == back.bytes_by_kind()


def test_state_prefix_and_replace() -> None:
    rd = RecordDict()
    put_message(rd, _msg(), "state.abc")
    put_message(rd, Message({"weights": {"w": torch.ones(2)}}), "state.abc")
    back = from_recorddict(rd, "state.abc")
    assert list(back.arrays) == ["weights"] and list(back.arrays["weights"]) == ["w"]
    assert from_recorddict(rd, "state.other").arrays == {}


def test_unknown_kind_rejected() -> None:
    rd = RecordDict({"msg.arrays.pickles": ArrayRecord()})
    with pytest.raises(MessageError, match="unknown payload kind"):
        from_recorddict(rd)


def test_config_text_and_run_config() -> None:
    cfg = RunConfig(method="fedprox", method_args={"mu": 0.1}, train_cap=50, rounds=3,
                    domains=["handwritten", "printed-clean"])
    assert config_from_text(config_to_text(cfg)) == cfg
    got = config_from_run_config({"fedvl-config": config_to_text(cfg), "rounds": 5,
                                  "model_args.width": 8, "method_args.mu": 0.2,
                                  "round-timeout": 3.0})
    assert got.rounds == 5 and got.model_args["width"] == 8 and got.model_args["depth"] == 3
    assert got.method_args == {"mu": 0.2} and got.domains == cfg.domains


def test_app_dir_run_config_roundtrip(tmp_path) -> None:
    import tomllib

    from flwr.common.config import flatten_dict

    from fedvl.flower.deploy import write_app_dir
    from fedvl.flower.server_app import ServerOptions

    cfg = RunConfig(method="scaffold", method_args={"cv_scale": "sampled"}, train_cap=40,
                    domains=["handwritten"], model_args={"width": 8, "depth": 2,
                                                         "norm": "instance"})
    d = write_app_dir(tmp_path / "app", cfg, ServerOptions(out=str(tmp_path / "run"),
                                                           round_timeout=7))
    doc = tomllib.loads((d / "pyproject.toml").read_text())
    app = doc["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "fedvl.flower.server_app:app",
                                 "clientapp": "fedvl.flower.client_app:app"}
    run_config = flatten_dict(app["config"])
    assert config_from_run_config(run_config) == cfg
    opts = ServerOptions.from_run_config(run_config)
    assert opts.round_timeout == 7 and opts.out == str((tmp_path / "run").resolve())


def test_commands_need_tls_or_insecure() -> None:
    from fedvl.flower.deploy import superlink_command, supernode_command

    with pytest.raises(ValueError, match="--insecure"):
        superlink_command()
    with pytest.raises(ValueError, match="--insecure"):
        supernode_command(0)
    cmd = supernode_command(2, 3, superlink="10.0.0.1:8000", root_certificates="ca.crt")
    assert cmd[cmd.index("--node-config") + 1] == "partition-id=2 num-partitions=3"
    assert "--insecure" not in cmd and cmd[cmd.index("--root-certificates") + 1] == "ca.crt"
    assert "--disable-runtime-dependency-installation" in superlink_command(insecure=True)


def test_waiting_for_a_run_polls_less_and_less_often(monkeypatch) -> None:
    import fedvl.flower.deploy as deploy

    clock, sleeps, statuses = [0.0], [], iter(["running"] * 6 + ["finished:completed"])
    monkeypatch.setattr(deploy.time, "monotonic", lambda: clock[0])

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock[0] += s

    monkeypatch.setattr(deploy.time, "sleep", sleep)
    monkeypatch.setattr(deploy, "run_status", lambda *a, **k: {"status": next(statuses)})
    assert deploy.wait_for_run(1, "c", "h", timeout=100)["status"] == "finished:completed"
    assert sleeps == [2.0, 3.0, 4.5, 6.75, 10.0, 10.0]
    monkeypatch.setattr(deploy, "run_status", lambda *a, **k: {"status": "running"})
    with pytest.raises(TimeoutError, match="not finished after 20 s"):
        deploy.wait_for_run(1, "c", "h", timeout=20)
    assert clock[0] == pytest.approx(36.25 + 20)   # the last sleep ends at the deadline


def test_certificates(tmp_path) -> None:
    from cryptography import x509

    from fedvl.flower.deploy import make_certificates

    p = make_certificates(tmp_path, ["127.0.0.1", "node.example"])
    ca = x509.load_pem_x509_certificate(p["ca_cert"].read_bytes())
    cert = x509.load_pem_x509_certificate(p["server_cert"].read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "node.example" in san.get_values_for_type(x509.DNSName)


def test_partition_loads_only_own_domain() -> None:
    from fedvl.flower.node import load_partition
    from fedvl.run.assemble import build_federation

    cfg = RunConfig(benchmark="digits-offline", train_cap=20, test_cap=10, seed=3)
    full = build_federation(cfg)
    for pid in (0, 3):
        client, k, _, n, _ = load_partition(cfg, pid)
        ref = full.clients[pid]
        assert n == len(full.clients) and k == full.num_classes and client.name == ref.name
        assert torch.equal(client.x_train, ref.x_train) and torch.equal(client.y_test,
                                                                        ref.y_test)
    with pytest.raises(ValueError, match="out of range"):
        load_partition(cfg, 5)


def test_cli_registered() -> None:
    from fedvl.cli import build_parser

    args = build_parser().parse_args(["flower", "supernode", "--partition-id", "1",
                                      "--insecure", "--dry-run"])
    assert args.func(args) == 0

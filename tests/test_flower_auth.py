"""SuperNode authentication (Flower 1.41 `--enable-supernode-auth`).

Fast tests cover the key files (`fedvl flower certs --nodes`), the command lines and the error
messages. The slow test starts a real TLS SuperLink with authentication on loopback, registers
two SuperNodes' public keys through the Control API (`flwr supernode register`), and starts
them with their private keys; it also starts two intruders: one without a key (it tries to
register itself, which an authenticating SuperLink refuses) and one with a key nobody
registered. The intruders must be refused by the SuperLink and exit, must never be listed as
nodes, and a 1-round run must complete with only the two registered nodes. Without
`--enable-supernode-auth` the keyless intruder would register itself and stay connected, so the
test fails. Every wait is bounded and every process group is torn down (context manager).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec, ed25519  # noqa: E402

from fedvl.cli import main  # noqa: E402
from fedvl.config import RunConfig  # noqa: E402
from fedvl.flower.deploy import (  # noqa: E402
    check_node_key,
    check_node_public_key,
    make_certificates,
    make_node_keys,
    superlink_command,
    supernode_command,
)
from fedvl.flower.local_deployment import LocalFederation  # noqa: E402

HAVE_FLOWER_CLI = (shutil.which("flower-superlink") is not None
                   and shutil.which("flower-supernode") is not None
                   and shutil.which("flwr") is not None)


# -- keys and command lines (fast) ----------------------------------------------------------------
def test_make_node_keys_are_openssh_ecdsa_pairs(tmp_path: Path) -> None:
    pairs = make_node_keys(tmp_path, 2)
    assert [p["private"].name for p in pairs] == ["supernode-0.key", "supernode-1.key"]
    assert [p["public"].name for p in pairs] == ["supernode-0.pub", "supernode-1.pub"]
    pubs = set()
    for pair in pairs:
        # The formats Flower reads: load_ssh_private_key / load_ssh_public_key.
        key = serialization.load_ssh_private_key(pair["private"].read_bytes(), None)
        pub = serialization.load_ssh_public_key(pair["public"].read_bytes())
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert key.curve.name == "secp384r1"
        raw = serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        assert key.public_key().public_bytes(*raw) == pub.public_bytes(*raw)
        assert pair["public"].read_text().startswith("ecdsa-sha2-nistp384 ")
        assert pair["private"].stat().st_mode & 0o777 == 0o600
        assert check_node_key(pair["private"]) == pair["private"].resolve()
        assert check_node_public_key(pair["public"]) == pair["public"].resolve()
        pubs.add(pair["public"].read_text())
    assert len(pubs) == 2


def test_bad_key_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"SuperNode key file not found: .*missing\.key"):
        check_node_key(tmp_path / "missing.key")
    with pytest.raises(ValueError, match=r"public key file not found: .*missing\.pub"):
        check_node_public_key(tmp_path / "missing.pub")
    certs = make_certificates(tmp_path / "certs")
    pair = make_node_keys(tmp_path / "certs", 1)[0]
    # A PKCS#8 PEM key (the TLS server key) is not the OpenSSH format Flower reads.
    with pytest.raises(ValueError, match=r"server\.key is not an unencrypted OpenSSH ECDSA"):
        check_node_key(certs["server_key"])
    with pytest.raises(ValueError, match=r"supernode-0\.pub is not an unencrypted OpenSSH"):
        check_node_key(pair["public"])
    with pytest.raises(ValueError, match=r"supernode-0\.key is not an OpenSSH public key"):
        check_node_public_key(pair["private"])
    ed = ed25519.Ed25519PrivateKey.generate()
    (tmp_path / "ed.key").write_bytes(ed.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption()))
    (tmp_path / "ed.pub").write_bytes(ed.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    with pytest.raises(ValueError, match=r"ed\.key is a .*Ed25519.*ECDSA key on a NIST curve"):
        check_node_key(tmp_path / "ed.key")
    with pytest.raises(ValueError, match=r"ed\.pub is a .*Ed25519.*ECDSA key on a NIST curve"):
        check_node_public_key(tmp_path / "ed.pub")
    with pytest.raises(ValueError, match=">= 0"):
        make_node_keys(tmp_path, -1)


def test_auth_command_lines(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    key = make_node_keys(tmp_path, 1)[0]["private"]
    tls = dict(ca_cert=str(certs["ca_cert"]), cert=str(certs["server_cert"]),
               key=str(certs["server_key"]))
    assert "--enable-supernode-auth" in superlink_command(auth=True, **tls)
    assert "--enable-supernode-auth" not in superlink_command(**tls)
    with pytest.raises(ValueError, match="needs TLS"):
        superlink_command(insecure=True, auth=True)
    cmd = supernode_command(0, 2, root_certificates=str(certs["ca_cert"]), node_key=str(key))
    i = cmd.index("--auth-supernode-private-key")
    assert cmd[i + 1] == str(key.resolve())
    assert "--auth-supernode-private-key" not in supernode_command(
        0, 2, root_certificates=str(certs["ca_cert"]))
    with pytest.raises(ValueError, match="needs TLS"):
        supernode_command(0, 2, insecure=True, node_key=str(key))
    with pytest.raises(ValueError, match="nope.key"):
        supernode_command(0, 2, root_certificates=str(certs["ca_cert"]),
                          node_key=str(tmp_path / "nope.key"))
    with pytest.raises(ValueError, match="needs TLS"):
        LocalFederation(tmp_path / "fed", num_nodes=1, tls=False, auth=True)


def test_cli_certs_nodes_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "certs"
    assert main(["flower", "certs", str(d), "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("ca.crt", "server.pem", "server.key", "supernode-0.key", "supernode-1.pub"):
        assert (d / name).is_file() and name in out
    assert main(["flower", "superlink", "--certs", str(d), "--auth", "--dry-run"]) == 0
    assert capsys.readouterr().out.split()[-1] == "--enable-supernode-auth"
    assert main(["flower", "supernode", "--partition-id", "1", "--root-certificates",
                 str(d / "ca.crt"), "--node-key", str(d / "supernode-1.key"),
                 "--dry-run"]) == 0
    assert f"--auth-supernode-private-key {(d / 'supernode-1.key').resolve()}" in \
        capsys.readouterr().out
    # Bad input: exit 2 and one line naming the file.
    missing = d / "supernode-7.key"
    assert main(["flower", "supernode", "--partition-id", "0", "--root-certificates",
                 str(d / "ca.crt"), "--node-key", str(missing), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"SuperNode key file not found: {missing}" in err
    assert main(["flower", "superlink", "--insecure", "--auth", "--dry-run"]) == 2
    assert "needs TLS" in capsys.readouterr().err
    assert main(["flower", "certs", str(tmp_path / "c2"), "--nodes", "-1"]) == 2
    assert "--nodes must be >= 0" in capsys.readouterr().err


def test_cli_register_checks_keys_first(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("flwr")
    pair = make_node_keys(tmp_path, 1)[0]
    home = tmp_path / "home"
    # Every key is checked before anything is sent: a private key given by mistake is named.
    assert main(["flower", "register", str(pair["public"]), str(pair["private"]),
                 "--flwr-home", str(home)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "supernode-0.key is not an OpenSSH public key" in err
    assert main(["flower", "register", str(tmp_path / "empty"), "--flwr-home",
                 str(home)]) == 2
    assert "public key file not found" in capsys.readouterr().err
    (tmp_path / "nokeys").mkdir()
    assert main(["flower", "register", str(tmp_path / "nokeys"), "--flwr-home",
                 str(home)]) == 2
    assert "no *.pub SuperNode public keys in directory" in capsys.readouterr().err
    assert main(["flower", "register", str(pair["public"]), "--superlink", "127.0.0.1:1",
                 "--flwr-home", str(home)]) == 2
    assert "--root-certificates" in capsys.readouterr().err


# -- a real authenticated federation on loopback (slow) -------------------------------------------
DOMAINS = ["handwritten", "printed-clean"]
CFG = RunConfig(method="fedavg", benchmark="digits-offline", domains=DOMAINS, train_cap=60,
                test_cap=30, seed=2, model_args={"width": 8, "depth": 3, "norm": "instance"},
                local_steps=3, batch_size=16, threads=1)
RUN_TIMEOUT = 300.0
REFUSAL_TIMEOUT = 120.0  # an intruder is refused within seconds; generous for a loaded machine


def _logs(fed: LocalFederation, names: list[str]) -> str:
    return "\n".join(f"--- {n}\n{fed.log(n, 2000)}" for n in names)


@pytest.mark.flower
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_FLOWER_CLI, reason="flower-superlink/flower-supernode/flwr not on "
                                                "PATH")
def test_only_registered_supernodes_join(tmp_path: Path) -> None:
    from fedvl.flower.deploy import list_nodes, submit, wait_for_run, write_app_dir
    from fedvl.flower.server_app import ServerOptions

    cfg = replace(CFG, rounds=1, eval_every=1)
    run_dir = tmp_path / "run"
    app = write_app_dir(tmp_path / "app", cfg, ServerOptions(out=str(run_dir),
                                                             round_timeout=120,
                                                             join_timeout=120))
    stranger_key = make_node_keys(tmp_path / "stranger", 1, prefix="stranger")[0]["private"]
    names = ["superlink.log", "supernode-0.log", "supernode-1.log", "intruder-nokey.log",
             "intruder-stranger.log"]
    with LocalFederation(tmp_path / "fed", num_nodes=2, tls=True, auth=True) as fed:
        registered = set(fed.node_ids.values())
        assert len(registered) == 2
        # Partition ids 0 and 1 claim the registered nodes' partitions: if either intruder got
        # in, the run's discovery would see it.
        nokey = fed.start_extra_node("intruder-nokey", 0)
        stranger = fed.start_extra_node("intruder-stranger", 1, node_key=stranger_key)
        deadline = time.monotonic() + REFUSAL_TIMEOUT
        while running := [n for n, p in fed.extra_nodes.items() if p.poll() is None]:
            assert time.monotonic() < deadline, \
                f"not refused (still running): {running}\n{_logs(fed, names)}"
            time.sleep(0.5)
        assert nokey.returncode != 0 and stranger.returncode != 0, _logs(fed, names)
        # Flower's refusals: self-registration disabled (2001), unknown key (2004).
        assert "SuperNode authentication is enabled" in fed.log("intruder-nokey.log")
        assert "Failed to activate SuperNode" in fed.log("intruder-stranger.log")

        # The registered nodes come online; nobody else is ever listed.
        deadline = time.monotonic() + REFUSAL_TIMEOUT
        while True:
            rows = list_nodes(fed.connection, fed.flwr_home)
            assert {int(r["node-id"]) for r in rows} == registered, rows
            if {int(r["node-id"]) for r in rows if r["status"] == "online"} == registered:
                break
            assert time.monotonic() < deadline, f"nodes not online: {rows}\n" \
                                                f"{_logs(fed, names)}"
            time.sleep(1.0)

        run_id = submit(app, fed.connection, fed.flwr_home, timeout=120)
        try:
            row = wait_for_run(run_id, fed.connection, fed.flwr_home, timeout=RUN_TIMEOUT)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{_logs(fed, names)}") from e
        assert row["status"] == "finished:completed", _logs(fed, names)
        assert {int(r["node-id"]) for r in list_nodes(fed.connection, fed.flwr_home)} == \
            registered
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["flower"]["status"] == "completed" and not summary["flower"]["failures"]
    assert summary["clients"] == DOMAINS
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    assert [r["participants"] for r in rows] == [[0, 1]]

"""SuperNode authentication (Flower 1.41 `--enable-supernode-auth`).

These fast tests cover the key files (`fedvl flower certs --nodes`), the command lines and the
error messages. A real authenticating SuperLink on loopback (registered nodes join, intruders
are refused, a run completes with only the registered nodes) is tested in
tests/test_flower_deployment.py, on the federation its other tests use.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec, ed25519  # noqa: E402

from fedvl.cli import main  # noqa: E402
from fedvl.flower.deploy import (  # noqa: E402
    check_node_key,
    check_node_public_key,
    make_certificates,
    make_node_keys,
    superlink_command,
    supernode_command,
)
from fedvl.flower.local_deployment import LocalFederation  # noqa: E402


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


def test_insecure_local_federation_commands_and_connection(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TLS every process starts with --insecure and `flwr` connects insecurely (the
    deployment tests run with TLS: this checks the other branch without starting processes)."""
    import tomllib

    from fedvl.flower import local_deployment

    spawned: list[tuple[list[str], str]] = []

    def spawn(self, cmd: list[str], log: str) -> object:
        spawned.append((cmd, log))
        return object()

    monkeypatch.setattr(local_deployment.LocalFederation, "_spawn", spawn)
    monkeypatch.setattr(local_deployment, "wait_port", lambda *a, **k: None)
    fed = LocalFederation(tmp_path / "fed", num_nodes=2, tls=False).start()
    assert [log for _, log in spawned] == ["superlink.log", "supernode-0.log", "supernode-1.log"]
    assert spawned[0][0][0] == "flower-superlink"
    assert all("--insecure" in cmd for cmd, _ in spawned)
    assert not fed.certs and not fed.node_keys
    doc = tomllib.loads((fed.flwr_home / "config.toml").read_text())
    assert doc["superlink"][fed.connection] == {"address": fed.address, "insecure": True}


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

"""Deployment helpers: SuperLink/SuperNode command lines, app directories, TLS test certificates,
SuperNode authentication keys, submitting a run with `flwr run` and waiting for its real final
status.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from fedvl.config import RunConfig
from fedvl.flower.server_options import ServerOptions
from fedvl.options import coerce

APP_NAME = "fedvl-flower-app"
SERVERAPP = "fedvl.flower.server_app:app"
CLIENTAPP = "fedvl.flower.client_app:app"


# -- TLS ------------------------------------------------------------------------------------------
def make_certificates(out: str | Path, hosts: list[str] | None = None,
                      days: int = 30) -> dict[str, Path]:
    """Self-signed CA plus a server certificate for `hosts` (testing only).

    Writes ca.crt, ca.key, server.crt, server.key (and server.pem) under `out`; returns paths.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hosts = hosts or ["127.0.0.1", "localhost"]
    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder().subject_name(name("fedvl test CA"))
          .issuer_name(name("fedvl test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder().subject_name(name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    nokey = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8
    paths = {"ca_cert": out / "ca.crt", "ca_key": out / "ca.key",
             "server_cert": out / "server.pem", "server_key": out / "server.key"}
    paths["ca_cert"].write_bytes(ca.public_bytes(pem))
    paths["ca_key"].write_bytes(ca_key.private_bytes(pem, pkcs8, nokey))
    paths["server_cert"].write_bytes(cert.public_bytes(pem))
    paths["server_key"].write_bytes(key.private_bytes(pem, pkcs8, nokey))
    for k in ("ca_key", "server_key"):
        os.chmod(paths[k], 0o600)
    return paths


# -- SuperNode authentication ------------------------------------------------------------------
# Flower 1.41: `flower-superlink --enable-supernode-auth` (TLS only) refuses SuperNodes that try
# to register themselves; an operator registers each node's public key through the Control API
# (`flwr supernode register KEY.pub CONN`), and the node proves it holds the private key by
# signing every Fleet request (`flower-supernode --auth-supernode-private-key KEY`). Flower reads
# the private key with `load_ssh_private_key` and the public key with `load_ssh_public_key`, so
# both are OpenSSH-format ECDSA keys on a NIST curve (what `ssh-keygen -t ecdsa -b 384` writes).
def make_node_keys(out: str | Path, num_nodes: int,
                   prefix: str = "supernode") -> list[dict[str, Path]]:
    """`num_nodes` SuperNode ECDSA P-384 key pairs: `<prefix>-<i>.key` (private) and `.pub`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if num_nodes < 0:
        raise ValueError(f"number of SuperNode keys must be >= 0, got {num_nodes}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for i in range(num_nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        private, public = out / f"{prefix}-{i}.key", out / f"{prefix}-{i}.pub"
        # Create the private key file 0600 before writing: it never exists world-readable.
        private.unlink(missing_ok=True)
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
        public.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
            + f" fedvl-{prefix}-{i}\n".encode())
        pairs.append({"private": private, "public": public})
    return pairs


def _nist_ec(key: Any) -> bool:
    from cryptography.hazmat.primitives.asymmetric import ec

    return isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) and \
        key.curve.name in {"secp192r1", "secp224r1", "secp256r1", "secp384r1", "secp521r1"}


def check_node_key(path: str | Path) -> Path:
    """The SuperNode private key file, checked to be one Flower accepts (else ValueError)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"SuperNode key file not found: {p}")
    try:
        key = load_ssh_private_key(p.read_bytes(), None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise ValueError(f"{p} is not an unencrypted OpenSSH ECDSA private key (make one with "
                         f"`fedvl flower certs DIR --nodes N` or `ssh-keygen -t ecdsa -b 384 "
                         f"-N ''`): {e}") from e
    if not _nist_ec(key):
        raise ValueError(f"{p} is a {type(key).__name__}; Flower needs an ECDSA key on a NIST "
                         "curve (e.g. `ssh-keygen -t ecdsa -b 384`)")
    return p.resolve()


def check_node_public_key(path: str | Path) -> Path:
    """A SuperNode public key file (OpenSSH ECDSA, NIST curve), checked (else ValueError)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"SuperNode public key file not found: {p}")
    try:
        key = load_ssh_public_key(p.read_bytes())
    except (ValueError, UnsupportedAlgorithm) as e:
        raise ValueError(f"{p} is not an OpenSSH public key (`ecdsa-sha2-nistp384 AAAA...`; the "
                         f"`.pub` file next to the node's private key): {e}") from e
    if not _nist_ec(key):
        raise ValueError(f"{p} is a {type(key).__name__}; Flower needs an ECDSA key on a NIST "
                         "curve (e.g. `ssh-keygen -t ecdsa -b 384`)")
    return p.resolve()


def register_node(public_key: str | Path, connection: str, flwr_home: str | Path,
                  exist_ok: bool = False, timeout: float = 60.0) -> int | None:
    """`flwr supernode register KEY.pub CONN`: allow that node; its node id.

    With `exist_ok`, a key that is already registered returns None instead of raising.
    """
    pub = check_node_public_key(public_key)
    data = flwr_json(["supernode", "register", str(pub), connection], flwr_home, timeout)
    if data.get("success") and data.get("node-id"):
        return int(data["node-id"])
    err = str(data.get("error-message", data))
    # `flwr` exits 0 with success=false; code 23 is PUBLIC_KEY_ALREADY_IN_USE.
    if exist_ok and ("[code: 23]" in err or "already in use" in err):
        return None
    raise RuntimeError(f"could not register {pub} with SuperLink connection "
                       f"'{connection}': {' '.join(err.split())}")


def list_nodes(connection: str, flwr_home: str | Path,
               timeout: float = 60.0) -> list[dict[str, Any]]:
    """Rows of `flwr supernode list CONN --format json` (keys: node-id, status, ...)."""
    data = flwr_json(["supernode", "list", connection], flwr_home, timeout)
    if not data.get("success"):
        raise RuntimeError(f"flwr supernode list failed: {data.get('error-message', data)}")
    return list(data.get("nodes", []))


# -- process command lines ----
def superlink_command(host: str = "127.0.0.1", port: int = 8000, insecure: bool = False,
                      ca_cert: str | None = None, cert: str | None = None,
                      key: str | None = None, database: str | None = None,
                      extra: list[str] | None = None, auth: bool = False) -> list[str]:
    """`flower-superlink` with fedvl's defaults (no runtime dependency installation).

    `auth` adds `--enable-supernode-auth`: only SuperNodes whose public key was registered
    with `flwr supernode register` may connect.
    """
    cmd = ["flower-superlink", "--host", host, "--port", str(port),
           "--disable-runtime-dependency-installation"]
    if insecure and auth:
        # Flower itself exits on this combination; say it before anything starts.
        raise ValueError("SuperNode authentication (--auth) needs TLS; drop --insecure and "
                         "pass --certs DIR (or the --ssl-* files)")
    if insecure:
        cmd.append("--insecure")
    else:
        if not (ca_cert and cert and key):
            raise ValueError("TLS needs --ssl-ca-certfile, --ssl-certfile and --ssl-keyfile "
                             "(or --certs DIR from `fedvl flower certs`); pass --insecure to "
                             "run without TLS")
        cmd += ["--ssl-ca-certfile", str(ca_cert), "--ssl-certfile", str(cert),
                "--ssl-keyfile", str(key)]
    if database:
        cmd += ["--database", str(database)]
    if auth:
        cmd.append("--enable-supernode-auth")
    return cmd + list(extra or [])


def supernode_command(partition_id: int, num_partitions: int | None = None,
                      superlink: str = "127.0.0.1:8000", port: int | None = None,
                      insecure: bool = False, root_certificates: str | None = None,
                      host: str = "127.0.0.1", extra: list[str] | None = None,
                      state_dir: str | None = None, node_key: str | None = None) -> list[str]:
    """`flower-supernode` for one partition (its runtime API port defaults to 9094 + id).

    `node_key` (OpenSSH ECDSA private key) makes the node authenticate to a SuperLink started
    with `--enable-supernode-auth`; its public key must have been registered there.
    """
    node_config = f"partition-id={int(partition_id)}"
    if num_partitions is not None:
        node_config += f" num-partitions={int(num_partitions)}"
    if state_dir:
        node_config += f' state-dir="{Path(state_dir).expanduser().resolve()}"'
    cmd = ["flower-supernode", "--superlink", superlink, "--node-config", node_config,
           "--host", host, "--port", str(port if port is not None else 9094 + partition_id)]
    if insecure:
        cmd.append("--insecure")
    else:
        if not root_certificates:
            raise ValueError("TLS needs --root-certificates CA.crt (the CA that signed the "
                             "SuperLink's certificate); pass --insecure to run without TLS")
        cmd += ["--root-certificates", str(root_certificates)]
    if node_key:
        if insecure:
            # A SuperLink cannot enable node authentication without TLS.
            raise ValueError("--node-key needs TLS (--root-certificates); SuperNode "
                             "authentication does not work with --insecure")
        cmd += ["--auth-supernode-private-key", str(check_node_key(node_key))]
    return cmd + list(extra or [])


def flower_env(flwr_home: str | Path | None = None) -> dict[str, str]:
    """Environment for Flower processes: no telemetry, no update check, no runtime installs."""
    env = dict(os.environ)
    env.update({"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"})
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


# -- app directory ----
def run_config_entries(cfg: RunConfig, opts: ServerOptions) -> dict[str, Any]:
    """The `[tool.flwr.app.config]` table: flattened RunConfig fields plus server options.

    None values are omitted (TOML has no null; they are the RunConfig defaults), lists become
    comma-separated strings, and `model_args`/`method_args` become sub-tables (flattened by
    Flower to `model_args.width` etc.). Every key can be overridden with
    `flwr run DIR CONN --run-config "rounds=5 model_args.width=16"`.
    """
    out: dict[str, Any] = {}
    for k, v in cfg.to_dict().items():
        if v is None:
            continue
        if isinstance(v, list):
            v = ",".join(str(x) for x in v)
        out[k] = v
    if opts.out:
        out["out"] = str(Path(opts.out).expanduser().resolve())
    for f in dataclasses.fields(opts):
        if f.name != "out":
            # Typed as declared: TOML keeps 600.0 a float, which Flower passes on as such.
            out[f.name.replace("_", "-")] = coerce(f, getattr(opts, f.name))
    out["resume"] = False  # `--run-config resume=true` continues from the checkpoint in `out`
    return out


def write_app_dir(directory: str | Path, cfg: RunConfig, opts: ServerOptions) -> Path:
    """A Flower app directory whose components are fedvl's generic ServerApp/ClientApp."""
    import tomli_w

    from fedvl import __version__

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    doc = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": APP_NAME, "version": "1.0.0",
                    "description": f"fedvl {cfg.method} on {cfg.benchmark} (generated)",
                    "license": "Apache-2.0",
                    "dependencies": [f"fedvl=={__version__}", "flwr[simulation]>=1.41,<1.43"]},
        "tool": {"hatch": {"build": {"targets": {"wheel": {"packages": ["."]}}}},
                 "flwr": {"app": {"publisher": "fedvl",
                                  "components": {"serverapp": SERVERAPP,
                                                 "clientapp": CLIENTAPP},
                                  "config": run_config_entries(cfg, opts)}}},
    }
    (d / "pyproject.toml").write_text(tomli_w.dumps(doc))
    (d / "README.md").write_text(
        f"# {APP_NAME}\n\nGenerated by `fedvl flower app`. The ServerApp and ClientApp are "
        "fedvl's generic ones (`fedvl.flower`); fedvl must be installed on the SuperLink and "
        "every SuperNode.\n\nSubmit with `flwr run . <connection>` (see fedvl's "
        "docs/flower.md).\n")
    (d / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    return d


def write_connection(flwr_home: str | Path, name: str, address: str, insecure: bool = False,
                     root_certificates: str | None = None) -> Path:
    """Add/replace a `[superlink.<name>]` connection in `$FLWR_HOME/config.toml`."""
    import tomli_w

    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - py3.11 has tomllib
        import tomli as tomllib  # type: ignore[no-redef]

    path = Path(flwr_home) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = tomllib.loads(path.read_text()) if path.is_file() else {}
    conn: dict[str, Any] = {"address": address}
    if insecure:
        conn["insecure"] = True
    elif root_certificates:
        conn["root-certificates"] = str(Path(root_certificates).resolve())
    else:
        raise ValueError("a TLS connection needs root_certificates (or insecure=True)")
    doc.setdefault("superlink", {})[name] = conn
    doc["superlink"].setdefault("default", name)
    path.write_text(tomli_w.dumps(doc))
    return path


def _json_out(text: str) -> Any:
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise ValueError(f"no JSON in flwr output: {text[-500:]}")
    return json.loads(text[start:])


def flwr_json(args: list[str], flwr_home: str | Path, timeout: float) -> Any:
    """Run `flwr ARGS --format json` and return its JSON; a RuntimeError with the output when
    it printed none (`flwr` prints its failures as JSON too, often with exit status 0)."""
    res = subprocess.run(["flwr", *args, "--format", "json"], capture_output=True, text=True,
                         timeout=timeout, env=flower_env(flwr_home))
    try:
        return _json_out(res.stdout)
    except ValueError as e:
        raise RuntimeError(f"flwr {' '.join(args[:2])} failed (exit {res.returncode}): "
                           f"{res.stdout[-2000:]}{res.stderr[-2000:]}") from e


def submit(app_dir: str | Path, connection: str, flwr_home: str | Path,
           run_config: str | None = None, timeout: float = 120.0) -> int:
    """`flwr run APP CONN --format json`; the run id (the run goes on in the SuperLink)."""
    args = ["run", str(app_dir), connection]
    if run_config:
        args += ["--run-config", run_config]
    data = flwr_json(args, flwr_home, timeout)
    if not data.get("success") or not data.get("run-id"):
        raise RuntimeError(f"flwr run did not start a run: {data}")
    return int(data["run-id"])


def run_status(run_id: int, connection: str, flwr_home: str | Path,
               timeout: float = 60.0) -> dict[str, Any]:
    """The run's row from `flwr list --run-id ID --format json` (keys: status, ...)."""
    data = flwr_json(["list", connection, "--run-id", str(run_id)], flwr_home, timeout)
    runs = data.get("runs", data) if isinstance(data, dict) else data
    for row in runs if isinstance(runs, list) else []:
        if str(row.get("run-id")) == str(run_id):
            return row
    raise RuntimeError(f"run {run_id} not found in `flwr list` output: {data}")


def wait_for_run(run_id: int, connection: str, flwr_home: str | Path, timeout: float,
                 poll: float = 2.0, max_poll: float = 10.0) -> dict[str, Any]:
    """Poll `flwr list` until the run is `finished:*`; raise TimeoutError after `timeout` s."""
    # Each poll starts a `flwr` process (0.7 CPU-s here): every 2 s that is a third of a core
    # for the whole run, so the interval grows towards `max_poll` on a long run.
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            last = run_status(run_id, connection, flwr_home,
                              timeout=max(5.0, min(60.0, deadline - time.monotonic())))
        except (RuntimeError, ValueError, subprocess.TimeoutExpired):
            last = last or {}
        if str(last.get("status", "")).startswith("finished"):
            return last
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        poll = min(max_poll, poll * 1.5)
    raise TimeoutError(f"run {run_id} not finished after {timeout:.0f} s (last: {last})")

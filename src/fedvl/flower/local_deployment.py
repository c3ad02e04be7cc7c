"""A real Flower deployment on this machine: one SuperLink and N SuperNodes as separate
processes on 127.0.0.1 (free ports), torn down reliably (process groups, bounded waits).

Used by the deployment tests; each process logs to `<workdir>/*.log`.
With `auth=True` (implies TLS) the SuperLink runs with SuperNode authentication: every node
gets its own key pair, its public key is registered through the Control API before the node
starts, and `start_extra_node` starts nodes outside that list (which the SuperLink refuses).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from fedvl.flower.deploy import (
    flower_env,
    make_certificates,
    make_node_keys,
    register_node,
    superlink_command,
    supernode_command,
    write_connection,
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until something accepts connections on 127.0.0.1:port (or raise)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


def stop_process(proc: subprocess.Popen, grace: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Signal the process group of `proc`, then SIGKILL it if it lingers."""
    if proc.poll() is not None:
        try:  # children of an exited leader may still run
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


class LocalFederation:
    """Context manager: SuperLink + SuperNodes on loopback; `connection` names it for `flwr`."""

    def __init__(self, workdir: str | Path, num_nodes: int, tls: bool = False,
                 startup_timeout: float = 60.0, auth: bool = False) -> None:
        if auth and not tls:
            raise ValueError("SuperNode authentication needs TLS: LocalFederation(tls=True, "
                             "auth=True)")
        self.workdir = Path(workdir)
        self.num_nodes = num_nodes
        self.tls = tls
        self.auth = auth
        self.startup_timeout = startup_timeout
        self.flwr_home = self.workdir / "flwr-home"
        self.connection = "fedvl-local"
        self.superlink: subprocess.Popen | None = None
        self.nodes: dict[int, subprocess.Popen] = {}
        self.extra_nodes: dict[str, subprocess.Popen] = {}
        self.port = 0
        self.certs: dict[str, Path] = {}
        self.node_keys: list[dict[str, Path]] = []  # per partition: {"private", "public"}
        self.node_ids: dict[int, int] = {}  # partition -> node id given at registration
        self._logs: list[Any] = []

    @property
    def address(self) -> str:
        """host:port of the SuperLink."""
        return f"127.0.0.1:{self.port}"

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen:
        fh = open(self.workdir / log, "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(fh)
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                env=flower_env(self.flwr_home), cwd=self.workdir,
                                start_new_session=True)

    def start(self) -> LocalFederation:
        """Start the SuperLink, wait for its port, then start the SuperNodes."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        if self.tls:
            self.certs = make_certificates(self.workdir / "certs", ["127.0.0.1", "localhost"])
            cmd = superlink_command(port=self.port, ca_cert=str(self.certs["ca_cert"]),
                                    cert=str(self.certs["server_cert"]),
                                    key=str(self.certs["server_key"]), auth=self.auth)
            write_connection(self.flwr_home, self.connection, self.address,
                             root_certificates=str(self.certs["ca_cert"]))
        else:
            cmd = superlink_command(port=self.port, insecure=True)
            write_connection(self.flwr_home, self.connection, self.address, insecure=True)
        self.superlink = self._spawn(cmd, "superlink.log")
        wait_port(self.port, self.startup_timeout, self.superlink)
        if self.auth:
            # Register before starting: an authenticated node whose key the SuperLink does not
            # know yet is refused at activation and exits (it does not retry).
            self.node_keys = make_node_keys(self.workdir / "certs", self.num_nodes)
            for pid, pair in enumerate(self.node_keys):
                node_id = register_node(pair["public"], self.connection, self.flwr_home,
                                        timeout=self.startup_timeout)
                assert node_id is not None  # a fresh SuperLink knows no key yet
                self.node_ids[pid] = node_id
        for pid in range(self.num_nodes):
            self.start_node(pid)
        return self

    def _node_command(self, pid: int, node_key: str | Path | None) -> list[str]:
        return supernode_command(pid, self.num_nodes, superlink=self.address, port=free_port(),
                                 insecure=not self.tls,
                                 root_certificates=str(self.certs.get("ca_cert", "")) or None,
                                 node_key=str(node_key) if node_key else None)

    def start_node(self, pid: int) -> subprocess.Popen:
        """(Re)start the SuperNode of partition `pid` on a fresh runtime port."""
        key = self.node_keys[pid]["private"] if self.auth else None
        self.nodes[pid] = self._spawn(self._node_command(pid, key), f"supernode-{pid}.log")
        return self.nodes[pid]

    def start_extra_node(self, name: str, pid: int,
                         node_key: str | Path | None = None) -> subprocess.Popen:
        """Start a SuperNode outside the federation's list (log `<name>.log`), e.g. an intruder."""
        if name in self.extra_nodes:
            raise ValueError(f"an extra node named {name!r} was already started")
        self.extra_nodes[name] = self._spawn(self._node_command(pid, node_key), f"{name}.log")
        return self.extra_nodes[name]

    def kill_node(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Crash (SIGKILL, default) or stop (SIGTERM) one SuperNode and its ClientApps."""
        stop_process(self.nodes[pid], grace=5.0, sig=sig)

    def stop(self) -> None:
        """Stop every process this object started (nodes first), close the logs."""
        for proc in [*self.nodes.values(), *self.extra_nodes.values()]:
            stop_process(proc, grace=5.0)
        if self.superlink is not None:
            stop_process(self.superlink, grace=10.0)
        for fh in self._logs:
            fh.close()
        self._logs.clear()

    def log(self, name: str, tail: int = 3000) -> str:
        """The last characters of one process log (for failure messages)."""
        p = self.workdir / name
        return p.read_text(errors="replace")[-tail:] if p.is_file() else ""

    def __enter__(self) -> LocalFederation:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""`fedvl flower ...`: simulate, superlink, supernode, app, deploy, certs, register.

Importing this module does not import flwr (`fedvl` works without it); the commands that
need Flower say so in one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedvl.cli.common import add_run_options, config_from_args, print_summary
from fedvl.config import ConfigError
from fedvl.flower.server_options import ServerOptions
from fedvl.options import FLAGS, add_flags, check_options, from_mapping, values_from_args


def _server_options(p: argparse.ArgumentParser, simulation: bool = False) -> None:
    if not simulation:
        add_flags(p, ServerOptions)
        return
    # A simulation's nodes are local processes: losing one is a crash, not a network, and a
    # run over the rest is not the configured experiment. So every sampled client is needed
    # unless --min-nodes says otherwise (a failed run resumes from its last full round).
    add_flags(p, ServerOptions, skip=["min_nodes"])
    p.add_argument("--min-nodes", dest="min_nodes", type=int, default=None,
                   help="stop the run (failed, resumable) when fewer sampled clients than "
                        "this answer a round or its evaluation (default: all of them)")


def _opts(args: argparse.Namespace, out: str | None) -> ServerOptions:
    data = {**values_from_args(args, ServerOptions), "out": out}
    return check_options(from_mapping(ServerOptions, data, naming=FLAGS), FLAGS)


def _need_flwr() -> None:
    if importlib.util.find_spec("flwr") is None:
        raise ConfigError("this command needs Flower: pip install 'fedvl[flower]'")


def _tls_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true", help="no TLS (only when you mean it)")
    p.add_argument("--certs", help="directory from `fedvl flower certs` (ca.crt, server.pem, "
                                   "server.key)")
    p.add_argument("--ssl-ca-certfile")
    p.add_argument("--ssl-certfile")
    p.add_argument("--ssl-keyfile")


def _exec(cmd: list[str], dry_run: bool) -> int:
    from fedvl.flower.deploy import flower_env

    print(" ".join(cmd), flush=True)
    if dry_run:
        return 0
    try:
        return subprocess.call(cmd, env=flower_env(os.environ.get("FLWR_HOME")))
    except KeyboardInterrupt:
        return 130


def _error(text: str) -> None:
    """Print `text` as the one `fedvl: error:` line, bounded as every error line is."""
    from fedvl.options import ERROR_LINE_LIMIT, elided

    head = "fedvl: error: "
    print(head + elided(text, ERROR_LINE_LIMIT - len(head)), file=sys.stderr)


def cmd_simulate(args: argparse.Namespace) -> int:
    """`fedvl flower simulate`: the run on Flower's Simulation Engine."""
    _need_flwr()
    from fedvl.engine.logs import check_logs
    from fedvl.flower.failures import MinNodesError
    from fedvl.flower.simulate import num_partitions, simulate
    from fedvl.run.assemble import default_run_dir

    if args.resume:
        from fedvl.cli.common import resumed_config

        # Flags equal to the run's config.yaml pass; any other is refused, --rounds included.
        cfg, out = resumed_config(args, args.resume, extend=False), args.resume
    else:
        cfg = config_from_args(args)
        out = args.out or str(default_run_dir(cfg))
    check_logs(cfg.engine.log)   # said here, before Flower starts
    opts = _opts(args, out)
    if args.min_nodes is None:
        opts = replace(opts, min_nodes=max(1, num_partitions(cfg)))
    try:
        summary = simulate([(cfg, opts)], client_cpus=args.client_cpus,
                           client_gpus=args.client_gpus, verbose=args.verbose,
                           resume=bool(args.resume), announce=not args.quiet)[0]
    except MinNodesError as e:
        _error(f"run {e.status}; {out}/summary.json says which clients and why; continue "
               f"with: fedvl flower simulate --resume {out}")
        return 1
    status = summary["flower"]["status"]
    if status != "completed":
        why = next((f["reason"] for f in reversed(summary["flower"]["failures"])
                    if "reason" in f), "")
        _error(f"run {status}: {why}; continue with: fedvl flower simulate --resume {out}")
        return 1
    if not args.quiet:
        print_summary(summary, getattr(args, "preset", None))
    return 0


def cmd_superlink(args: argparse.Namespace) -> int:
    """`fedvl flower superlink`: start `flower-superlink`."""
    from fedvl.flower.deploy import superlink_command

    ca, cert, key = args.ssl_ca_certfile, args.ssl_certfile, args.ssl_keyfile
    if args.certs:
        d = Path(args.certs)
        ca, cert, key = ca or d / "ca.crt", cert or d / "server.pem", key or d / "server.key"
    cmd = superlink_command(host=args.host, port=args.port, insecure=args.insecure,
                            ca_cert=ca and str(ca), cert=cert and str(cert),
                            key=key and str(key), database=args.database, auth=args.auth)
    if args.auth and not args.database and not args.dry_run:
        print("fedvl: note: without --database the registered SuperNode keys are lost when "
              "the SuperLink restarts", file=sys.stderr)
    return _exec(cmd, args.dry_run)


def cmd_supernode(args: argparse.Namespace) -> int:
    """`fedvl flower supernode`: start `flower-supernode` for one partition."""
    from fedvl.flower.deploy import supernode_command

    cmd = supernode_command(args.partition_id, args.num_partitions, superlink=args.superlink,
                            port=args.port, insecure=args.insecure,
                            root_certificates=args.root_certificates, host=args.host,
                            state_dir=args.state_dir, node_key=args.node_key)
    return _exec(cmd, args.dry_run)


def cmd_app(args: argparse.Namespace) -> int:
    """`fedvl flower app DIR`: write a Flower app directory for this run config."""
    _need_flwr()
    from fedvl.flower.deploy import write_app_dir
    from fedvl.run.assemble import default_run_dir

    cfg = config_from_args(args)
    out = args.out or str(Path(default_run_dir(cfg)).resolve())
    d = write_app_dir(args.dir, cfg, _opts(args, out))
    print(f"wrote {d / 'pyproject.toml'} (results go to {Path(out).resolve()} on the "
          "SuperLink host)")
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    """`fedvl flower deploy DIR`: submit with `flwr run` and wait for the real final status."""
    _need_flwr()
    from fedvl.flower.deploy import submit, wait_for_run, write_connection

    home = Path(args.flwr_home or os.environ.get("FLWR_HOME") or Path.home() / ".flwr")
    if args.superlink:
        if not args.insecure and not args.root_certificates:
            print("fedvl: error: pass --root-certificates CA.crt (or --insecure)",
                  file=sys.stderr)
            return 2
        write_connection(home, args.connection, args.superlink, insecure=args.insecure,
                         root_certificates=args.root_certificates)
    run_id = submit(args.dir, args.connection, home, run_config=args.run_config)
    print(f"submitted run {run_id}", flush=True)
    if args.no_wait:
        return 0
    row = wait_for_run(run_id, args.connection, home, timeout=args.timeout)
    print(json.dumps({k: row.get(k) for k in ("run-id", "status", "elapsed")}))
    return 0 if row.get("status") == "finished:completed" else 1


def cmd_certs(args: argparse.Namespace) -> int:
    """`fedvl flower certs DIR`: self-signed CA, server certificate, SuperNode key pairs."""
    from fedvl.flower.deploy import make_certificates, make_node_keys

    if args.nodes < 0:
        raise ValueError(f"--nodes must be >= 0, got {args.nodes}")
    paths = make_certificates(args.dir, args.host or None, days=args.days)
    for k, v in paths.items():
        print(f"{k}: {v}")
    for i, pair in enumerate(make_node_keys(args.dir, args.nodes)):
        print(f"supernode_{i}_key: {pair['private']}")
        print(f"supernode_{i}_pub: {pair['public']}")
    return 0


def _public_keys(paths: list[str]) -> list[Path]:
    """The `.pub` files named, a directory standing for every `*.pub` in it."""
    keys: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.pub"))
            if not found:
                raise ValueError(f"no *.pub SuperNode public keys in directory {p}")
            keys += found
        else:
            keys.append(p)
    return keys


def cmd_register(args: argparse.Namespace) -> int:
    """`fedvl flower register KEY.pub|DIR ...`: allow SuperNodes on an --auth SuperLink."""
    _need_flwr()
    from fedvl.flower.deploy import check_node_public_key, register_node, write_connection

    keys = [check_node_public_key(k) for k in _public_keys(args.keys)]  # all valid, or none sent
    home = Path(args.flwr_home or os.environ.get("FLWR_HOME") or Path.home() / ".flwr")
    if args.superlink:
        if not args.root_certificates:
            # The Control API of an authenticating SuperLink always uses TLS.
            raise ValueError("pass --root-certificates CA.crt (node authentication needs TLS)")
        write_connection(home, args.connection, args.superlink,
                         root_certificates=args.root_certificates)
    for key in keys:
        try:
            node_id = register_node(key, args.connection, home, exist_ok=True)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            _error(str(e))
            return 1
        print(f"{key}: " + (f"node {node_id}" if node_id is not None else "already registered"),
              flush=True)
    return 0


def register_cli(sub: Any) -> None:
    """Add `fedvl flower ...` to the `fedvl` parser."""
    fl = sub.add_parser("flower", help="run on Flower (simulation or SuperLink/SuperNodes)")
    fsub = fl.add_subparsers(dest="flower_command", required=True)

    p = fsub.add_parser("simulate", help="the run on Flower's simulation engine (Ray)")
    add_run_options(p)
    _server_options(p, simulation=True)
    p.add_argument("--out", help="run directory (default runs/<method>-<benchmark>-...)")
    p.add_argument("--resume", metavar="DIR", help="continue an interrupted run directory (run "
                   "settings given with it must match its config.yaml)")
    p.add_argument("--client-cpus", type=float, default=1.0, help="CPUs per ClientApp actor")
    p.add_argument("--client-gpus", type=float, default=0.0, help="GPUs per ClientApp actor")
    p.add_argument("--quiet", action="store_true",
                   help="no summary table and no start-up lines")
    p.add_argument("--verbose", action="store_true", help="Flower debug logging")
    p.set_defaults(func=cmd_simulate)

    p = fsub.add_parser("superlink", help="start flower-superlink (TLS unless --insecure)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--database", help="state file (default: in memory)")
    p.add_argument("--auth", action="store_true",
                   help="SuperNode authentication: only nodes whose public key was registered "
                        "(`fedvl flower register`) may connect; needs TLS")
    _tls_server(p)
    p.add_argument("--dry-run", action="store_true", help="print the command only")
    p.set_defaults(func=cmd_superlink)

    p = fsub.add_parser("supernode", help="start flower-supernode for one partition")
    p.add_argument("--partition-id", type=int, required=True)
    p.add_argument("--num-partitions", type=int)
    p.add_argument("--superlink", default="127.0.0.1:8000", help="SuperLink host:port")
    p.add_argument("--host", default="127.0.0.1", help="runtime API bind address")
    p.add_argument("--port", type=int, help="runtime API port (default 9094 + partition id)")
    p.add_argument("--insecure", action="store_true", help="no TLS (only when you mean it)")
    p.add_argument("--root-certificates", help="CA certificate that signed the SuperLink's")
    p.add_argument("--node-key", help="this node's private key (OpenSSH ECDSA, from `fedvl "
                                      "flower certs --nodes`) for a SuperLink run with --auth")
    p.add_argument("--state-dir", help="where this node keeps its client state for resumed "
                                       "runs (default $FEDVL_CACHE_DIR/node-state)")
    p.add_argument("--dry-run", action="store_true", help="print the command only")
    p.set_defaults(func=cmd_supernode)

    p = fsub.add_parser("app", help="write a Flower app directory for a run config")
    p.add_argument("dir", help="app directory to create (keep FLWR_HOME outside it)")
    add_run_options(p)
    _server_options(p)
    p.add_argument("--out", help="run directory on the SuperLink host (absolute)")
    p.set_defaults(func=cmd_app)

    p = fsub.add_parser("deploy", help="submit an app directory and wait for the run")
    p.add_argument("dir", help="app directory from `fedvl flower app`")
    p.add_argument("--connection", default="fedvl", help="connection name in config.toml")
    p.add_argument("--superlink", help="host:port; (re)writes the connection first")
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--root-certificates", help="CA certificate of the SuperLink")
    p.add_argument("--flwr-home", help="Flower config directory (default $FLWR_HOME)")
    p.add_argument("--run-config", help="flwr --run-config overrides, e.g. 'rounds=5'")
    p.add_argument("--timeout", type=float, default=24 * 3600.0, help="max seconds to wait")
    p.add_argument("--no-wait", action="store_true", help="submit and return")
    p.set_defaults(func=cmd_deploy)

    p = fsub.add_parser("certs", help="self-signed CA + server certificate (testing) and "
                                      "SuperNode key pairs")
    p.add_argument("dir")
    p.add_argument("--host", action="append", default=[],
                   help="SAN of the SuperLink (repeatable; default 127.0.0.1, localhost)")
    p.add_argument("--days", type=int, default=30)
    p.add_argument("--nodes", type=int, default=0,
                   help="also write N SuperNode key pairs supernode-<i>.key/.pub (for --auth)")
    p.set_defaults(func=cmd_certs)

    p = fsub.add_parser("register", help="register SuperNode public keys with a SuperLink "
                                         "started with --auth")
    p.add_argument("keys", nargs="+", metavar="KEY",
                   help="SuperNode public key file (.pub) or a directory of them")
    p.add_argument("--connection", default="fedvl", help="connection name in config.toml")
    p.add_argument("--superlink", help="host:port; (re)writes the connection first")
    p.add_argument("--root-certificates", help="CA certificate of the SuperLink")
    p.add_argument("--flwr-home", help="Flower config directory (default $FLWR_HOME)")
    p.set_defaults(func=cmd_register)

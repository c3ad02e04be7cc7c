"""The generic fedvl ClientApp: runs any registered algorithm's client half on one partition.

Handlers (message types):
  `query.info`  -> the node's public description (partition id, name, sample counts, shape)
  `train`       -> `algorithm.client_update` on the node's own data; the client's persistent
                   state (SCAFFOLD c_i, MOON's previous model, a local model, ...) lives in
                   `Context.state` between rounds, keyed by the run config and the server's
                   session (`run_key`), and in a snapshot on the node's own disk for resumed
                   runs (`fedvl.flower.node_state`)
  `evaluate`    -> accuracy/loss on the node's own test split, of the received global model
                   (with the layers the node keeps local, FedBN's BatchNorm) or (personalised
                   methods) of the node's own model
Every message carries the run config as YAML text in its `fedvl.run` ConfigRecord (with
the run's resolved torch thread count, so every node computes like the server's process).
Each handler runs under that config's `--deterministic` setting (`deterministic_mod`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedvl.algorithms.base import Algorithm, ClientContext
from fedvl.core.audit import CORR, TENSOR, WITHHELD, Audit, UploadGuard, exemption_of, with_audit
from fedvl.core.message import Message as FedMessage
from fedvl.core.training import evaluate
from fedvl.engine.driver import SHARE_STREAM, client_generator
from fedvl.flower import node_state
from fedvl.flower.node import NodeRun, config_key, node_run
from fedvl.flower.records import (
    INBOX,
    METRICS,
    PEER,
    RUN,
    STATE,
    config_from_text,
    from_recorddict,
    get_messages,
    put_message,
    put_messages,
    to_recorddict,
)
from fedvl.run.assemble import deterministic_mode
from fedvl.timing import accumulating, with_timing


@lru_cache(maxsize=8)
def _deterministic(text: str) -> bool:
    # Cached: parsing the config text costs about 2 ms, paid again by every message otherwise.
    return bool(config_from_text(text).engine.deterministic)


def deterministic_mod(msg: Message, context: Context,
                      call_next: Callable[[Message, Context], Message]) -> Message:
    """Handle `msg` under its run's `--deterministic` setting, then restore the node's own."""
    # Per message, not per process: a node serves runs with and without it, and one hosted in
    # the server's process (tests) must not change the settings the server restores.
    on = RUN in msg.content and _deterministic(str(msg.content[RUN]["config"]))
    with deterministic_mode(on):
        return call_next(msg, context)


app = ClientApp(mods=[deterministic_mod])


def partition_id(context: Context) -> int:
    """This node's partition id (SuperNode `--node-config partition-id=i`, or simulation)."""
    if "partition-id" not in context.node_config:
        raise ValueError("this SuperNode has no 'partition-id' in its node config; start it "
                         "with --node-config \"partition-id=I num-partitions=N\"")
    return int(context.node_config["partition-id"])


def _node(msg: Message, context: Context) -> tuple[NodeRun, ConfigRecord, str]:
    run = msg.content[RUN]
    text = str(run["config"])
    node = node_run(text, config_from_text(text), partition_id(context))
    return node, run, run_key(run)


def run_key(run: ConfigRecord) -> str:
    """Keys one run's client state in `Context.state`: its config and the server's session.

    A Flower run (one simulation, one ServerApp) may hold several experiments; two with the
    same config would otherwise share one client state, the second starting from the first
    one's. On disk the state stays under the config key alone, where a resumed run (a new
    session) finds it.
    """
    key = _config_key(run)
    return f"{key}.{run['session']}" if "session" in run else key


def _config_key(run: ConfigRecord) -> str:
    """The key of the run's config, computed here (client state on disk lives under it)."""
    return config_key(str(run["config"]))


def _client_context(node: NodeRun, state: FedMessage, rnd: int,
                    inbox: dict[int, FedMessage] | None = None, stream: int = 2
                    ) -> ClientContext:
    d = node.data
    extra = {}
    names = {f.name for f in dataclasses.fields(ClientContext)}
    for f in ("x_real", "y_real"):  # raw data kept next to a local virtual set
        if f in names and getattr(d, f, None) is not None:
            extra[f] = getattr(d, f)
    return ClientContext(cid=node.pid, name=d.name, x=d.x_train, y=d.y_train,
                         num_classes=node.num_classes, state=state,
                         generator=client_generator(node.cfg.seed, rnd, node.pid, stream),
                         round=rnd, device=node.device, inbox=inbox or {}, **extra)


# One upload guard per (run config, partition) in this process: it warns once per client.
_GUARDS: dict[tuple[str, int], UploadGuard] = {}
# Where a `share` step's audit and seconds wait for the round's reply (in Context.state).
_SHARED_AUDIT, _SHARED_SECONDS = "fedvl.upload_audit", "fedvl.share_seconds"


def screened(node: NodeRun, alg: Algorithm, key: str, msg: FedMessage
             ) -> tuple[FedMessage, Audit | None]:
    """`msg` as this node's upload guard lets it leave, and its audit (the same guard as the
    in-process engine's, against this node's private images)."""
    return guard(node, alg, key).screen(msg, private_images(node), node.data.name)


def guard(node: NodeRun, alg: Algorithm, key: str) -> UploadGuard:
    """This node's upload guard for run `key` (one per run and partition)."""
    if (key, node.pid) not in _GUARDS:
        if len(_GUARDS) > 8:
            _GUARDS.clear()
        _GUARDS[(key, node.pid)] = UploadGuard(tuple(node.data.x_train.shape[1:]),
                                               node.cfg.upload_guard, exemption_of(alg))
    return _GUARDS[(key, node.pid)]


def private_images(node: NodeRun) -> Any:
    """The images this node must not send: its real training images."""
    d = node.data
    return d.x_real if getattr(d, "x_real", None) is not None else d.x_train


def _client_state(context: Context, node: NodeRun, run: ConfigRecord, key: str) -> FedMessage:
    """This client's persistent state; a resumed run's first message reloads it from disk."""
    prefix = f"{STATE}.{key}"
    mark = f"{prefix}.round"
    if mark not in context.state and "resume-round" in run:
        upto = int(run["resume-round"])
        root = node_state.state_root(context.node_config, run)
        put_message(context.state, node_state.restore(root, _config_key(run), node.pid, upto),
                    prefix)
        context.state[mark] = ConfigRecord({"round": upto})
    return from_recorddict(context.state, prefix)


def _keep_client_state(context: Context, node: NodeRun, run: ConfigRecord, key: str,
                       rnd: int, state: FedMessage) -> None:
    prefix = f"{STATE}.{key}"
    put_message(context.state, state, prefix)
    context.state[f"{prefix}.round"] = ConfigRecord({"round": rnd})
    root = node_state.state_root(context.node_config, run)
    node_state.save(root, _config_key(run), node.pid, rnd, state)


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Public facts about this node's partition (no data)."""
    node, run, _ = _node(msg, context)
    d = node.data
    rec = ConfigRecord({
        # Under `--local-data virtual` the raw set kept beside the virtual one is the larger
        # count a method may report as its `num_examples` (FedVCK condenses the raw data).
        "partition-id": node.pid, "name": d.name,
        "num-train": max(d.num_train, 0 if d.y_real is None else int(d.y_real.shape[0])),
        "num-test": int(d.y_test.shape[0]), "num-classes": node.num_classes,
        "image-shape": [int(s) for s in d.x_train.shape[1:]],
        "num-partitions": node.num_partitions,
        "config-key": _config_key(run),
        "dataset-info": json.dumps(node.info, default=str),
        "has-global-test": node.global_test is not None,
    })
    return Message(RecordDict({"info": rec}), reply_to=msg)


@app.query("share")
def share(msg: Message, context: Context) -> Message:
    """Peer topology: this client's messages to its peers, for the ServerApp to relay."""
    node, run, key = _node(msg, context)
    alg = node.ensure_algorithm(list(run["client-names"]))
    node.ready_to_train()
    rnd = int(run["round"])
    state = _client_state(context, node, run, key)
    peers = [int(p) for p in run["peers"]]
    with accumulating() as acc:
        out = alg.share(_client_context(node, state, rnd, stream=SHARE_STREAM), peers)
        put_message(context.state, state, f"{STATE}.{key}")  # `share` may update the state
        sent, audit = guard(node, alg, key).screen_peers(out, private_images(node),
                                                         node.data.name)
    context.state[f"{_SHARED_SECONDS}.{key}"] = ConfigRecord({"round": rnd, **acc.meta()})
    sent = {r: m.to("cpu") for r, m in sent.items()}
    if audit is not None:   # reported with this round's reply
        context.state[f"{_SHARED_AUDIT}.{key}"] = ConfigRecord(
            {"round": rnd, **audit.meta(), "kinds": audit.withheld})
    return Message(put_messages(RecordDict(), sent, PEER), reply_to=msg)


def _shared_audit(context: Context, key: str, rnd: int) -> Audit | None:
    """The audit of this round's `share` step, if it sent anything image-shaped."""
    name = f"{_SHARED_AUDIT}.{key}"
    if name not in context.state:
        return None
    rec = context.state[name]
    del context.state[name]
    if int(rec["round"]) != rnd:
        return None
    return Audit(float(rec[CORR]), str(rec[TENSOR]),
                 [str(k) for k in rec["kinds"]] if rec[WITHHELD] else [])


def _shared_seconds(context: Context, key: str, rnd: int) -> dict[str, float] | None:
    """The seconds of this round's `share` step, if it ran."""
    name = f"{_SHARED_SECONDS}.{key}"
    if name not in context.state:
        return None
    rec = dict(context.state[name])
    del context.state[name]
    return rec if rec.pop("round", None) == rnd else None


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of the algorithm's client half."""
    node, run, key = _node(msg, context)
    alg = node.ensure_algorithm(list(run["client-names"]))
    node.ready_to_train()
    rnd = int(run["round"])
    with accumulating() as acc:   # the client's seconds travel with its reply (fedvl.timing)
        state = _client_state(context, node, run, key)
        fmsg = from_recorddict(msg.content)
        inbox = {s: m.to(node.device) for s, m in get_messages(msg.content, INBOX).items()}
        reply = alg.client_update(fmsg.to(node.device), _client_context(node, state, rnd, inbox))
        # The algorithm may have mutated `state`.
        _keep_client_state(context, node, run, key, rnd, state)
        reply, audit = screened(node, alg, key, reply)
    shared = _shared_audit(context, key, rnd)
    reply = with_audit(reply, audit.merge(shared) if audit is not None else shared)
    reply = with_timing(reply, acc.meta(), _shared_seconds(context, key, rnd))
    content = to_recorddict(reply.to("cpu"))
    metrics = {"num-examples": int(reply.meta.get("num_examples", node.data.num_train))}
    if "train_loss" in reply.meta:
        metrics["train_loss"] = float(reply.meta["train_loss"])
    content[METRICS] = MetricRecord(metrics)
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate_(msg: Message, context: Context) -> Message:
    """Test accuracy/loss on this node's own test split."""
    node, run, key = _node(msg, context)
    alg = node.ensure_algorithm(list(run["client-names"]))
    rnd = int(run["round"])
    fmsg = from_recorddict(msg.content)
    if "weights" in fmsg.arrays:
        model = alg.load_model(fmsg.to(node.device).get("weights"), node.device)
        if alg.local_layers:   # the layers this node keeps to itself replace the global ones
            state = _client_state(context, node, run, key)
            model = alg.personalise(model, _client_context(node, state, rnd))
    else:
        state = _client_state(context, node, run, key)
        model = alg.client_model(_client_context(node, state, rnd))
        if model is None:
            raise ValueError(f"method '{node.cfg.method}' has neither a global nor a client "
                             "model to evaluate")
    d = node.data
    acc, loss = evaluate(model, d.x_test, d.y_test)
    out = {"accuracy": acc, "loss": loss, "num-test": int(d.y_test.shape[0])}
    if bool(run.get("global-test", False)) and node.global_test is not None:
        xg, yg = (t.to(node.device) for t in node.global_test)
        out["global-test-accuracy"] = evaluate(model, xg, yg)[0]
    return Message(RecordDict({METRICS: MetricRecord(out)}), reply_to=msg)

"""fedvl Message <-> Flower RecordDict, and the run config <-> ConfigRecord.

Layout of a RecordDict carrying a fedvl Message (prefix `p`, "msg" for messages and
"state" for a node's persistent client state):
  `p.arrays.<kind>`  one ArrayRecord per payload kind (tensor name -> Array, order kept)
  `p.meta`           ConfigRecord with the scalar/list metadata (lists that Flower cannot
                     hold natively, e.g. mixed int/float, travel as JSON text under
                     `__json__.<key>`)
Only numeric arrays and plain scalars cross: nothing is pickled.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import yaml
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedvl.config import RunConfig, from_dict
from fedvl.core.message import KINDS, Message, MessageError

MSG = "msg"
STATE = "state"
PEER = "peer"               # a `share` reply: the sender's messages by receiver
INBOX = "inbox"             # a `train` message: the receiver's peer messages by sender
RUN = "fedvl.run"           # ConfigRecord: run config (YAML) + per-message control fields
METRICS = "metrics"         # MetricRecord: num-examples, train_loss / eval results
_JSON = "__json__."


def _native(value: Any) -> bool:
    if isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list):
        types = {type(v) for v in value}
        return len(types) <= 1 and types <= {int, float, str}
    return False


def tensor_to_array(t: torch.Tensor) -> Array:
    """A Flower Array holding a CPU copy of `t` (dtype and shape kept)."""
    arr = t.detach().cpu().numpy()
    # Not np.ascontiguousarray: it turns 0-d arrays (e.g. BN's num_batches_tracked) into 1-d.
    return Array(arr if arr.flags.c_contiguous else arr.copy(order="C"))


def array_to_tensor(a: Array) -> torch.Tensor:
    """A torch tensor owning its storage (writable, no aliasing of the record)."""
    return torch.from_numpy(np.array(a.numpy(), copy=True))


def put_message(rd: RecordDict, msg: Message, prefix: str = MSG) -> RecordDict:
    """Store `msg` in `rd` under `prefix` (replacing any earlier message there)."""
    clear_message(rd, prefix)
    for kind, tensors in msg.arrays.items():
        rd[f"{prefix}.arrays.{kind}"] = ArrayRecord(
            {name: tensor_to_array(t) for name, t in tensors.items()})
    meta: dict[str, Any] = {}
    for k, v in msg.meta.items():
        if _native(v):
            meta[k] = v
        else:
            meta[_JSON + k] = json.dumps(v)
    rd[f"{prefix}.meta"] = ConfigRecord(meta)
    return rd


def to_recorddict(msg: Message, prefix: str = MSG) -> RecordDict:
    """A new RecordDict holding `msg`."""
    return put_message(RecordDict(), msg, prefix)


def from_recorddict(rd: RecordDict, prefix: str = MSG) -> Message:
    """The fedvl Message stored under `prefix` (empty Message if there is none)."""
    head = f"{prefix}.arrays."
    arrays: dict[str, dict[str, torch.Tensor]] = {}
    for key in list(rd.keys()):
        if key.startswith(head):
            kind = key[len(head):]
            if kind not in KINDS:
                raise MessageError(f"record '{key}' names unknown payload kind '{kind}'")
            rec = rd[key]
            if not isinstance(rec, ArrayRecord):
                raise MessageError(f"record '{key}' must be an ArrayRecord")
            arrays[kind] = {name: _tensor(key, name, a) for name, a in rec.items()}
    meta: dict[str, Any] = {}
    rec = rd.get(f"{prefix}.meta") if f"{prefix}.meta" in rd else None
    if rec is not None:
        for k, v in rec.items():
            if k.startswith(_JSON):
                meta[k[len(_JSON):]] = _json(k, v)
            else:
                meta[k] = list(v) if isinstance(v, list) else v
    return Message(arrays, meta)


def _tensor(key: str, name: str, a: Array) -> torch.Tensor:
    """`array_to_tensor(a)`, or a MessageError naming the entry a sender filled with what no
    tensor holds (bytes that are no .npy array, strings, objects, structured dtypes)."""
    try:
        return array_to_tensor(a)
    except Exception as e:   # noqa: BLE001 - the bytes are the sender's to choose
        raise MessageError(f"record '{key}' entry {name[:60]!r} is not a numeric array "
                           f"({type(e).__name__})") from None


def _json(key: str, text: Any) -> Any:
    """The value of a JSON-carried metadata entry, or a MessageError naming it."""
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError) as e:
        raise MessageError(f"metadata '{key[:60]}' is not valid JSON "
                           f"({type(e).__name__})") from None


def put_messages(rd: RecordDict, msgs: dict[int, Message], head: str) -> RecordDict:
    """Store one message per client id under `head.<id>` (peer messages, inboxes)."""
    for cid, msg in msgs.items():
        put_message(rd, msg, f"{head}.{int(cid)}")
    return rd


def get_messages(rd: RecordDict, head: str) -> dict[int, Message]:
    """The messages stored by `put_messages` under `head`, by client id."""
    ids = set()
    for key in rd.keys():
        parts = key.split(".")
        if len(parts) >= 3 and parts[0] == head and parts[1].isdigit():
            ids.add(int(parts[1]))
    return {cid: from_recorddict(rd, f"{head}.{cid}") for cid in sorted(ids)}


def clear_message(rd: RecordDict, prefix: str) -> None:
    """Remove every record of the message stored under `prefix`."""
    for key in list(rd.keys()):
        if key.startswith(f"{prefix}.arrays.") or key == f"{prefix}.meta":
            del rd[key]


# -- run config ----
def config_to_text(cfg: RunConfig) -> str:
    """The run config as YAML text (what travels in ConfigRecords and run_config)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def config_from_text(text: str) -> RunConfig:
    """Parse YAML text produced by `config_to_text`."""
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError("fedvl config text must hold a mapping")
    return from_dict(data)


def config_from_run_config(run_config: dict[str, Any], base: RunConfig | None = None
                           ) -> RunConfig:
    """Build a RunConfig from a Flower run_config.

    `fedvl-config` (YAML text) is the base; any key equal to a RunConfig field overrides it
    (so `flwr run DIR conn --run-config "rounds=5 method='scaffold'"` works). Dotted keys
    `model_args.width=8` / `method_args.mu=0.1` set entries of the two nested dicts.
    """
    fields = set(RunConfig().to_dict())
    cfg = config_from_text(run_config["fedvl-config"]) if "fedvl-config" in run_config else (
        base or RunConfig())
    data: dict[str, Any] = {}
    for key, value in run_config.items():
        head, _, name = key.partition(".")
        head = head.replace("-", "_")
        if not name and head in fields:
            data[head] = value
        elif name and head in ("model_args", "method_args"):
            data.setdefault(head, dict(getattr(cfg, head)))[name] = value
    return from_dict(data, cfg) if data else cfg

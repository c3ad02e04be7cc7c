"""Loading torch files without running code: tensors and plain containers only.

`torch.load(..., weights_only=False)` unpickles whatever a file names, so a crafted
`checkpoint.pt` runs code as soon as it is read. Every torch file fedvl reads goes through
`load_torch`, which uses PyTorch's restricted unpickler (`weights_only=True`: tensors, dicts,
lists, tuples, strings, numbers, None); a file that names anything else is refused with one
line, before any of it runs. `plain` turns what fedvl writes into exactly those types, so its
own files always load.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["UnsafeFileError", "load_torch", "plain"]


class UnsafeFileError(ValueError):
    """A torch file names Python objects beyond tensors and plain data; it was not loaded."""


# PyTorch's text names the refused global ("GLOBAL posix.system") or opcode in one clause.
_WHY = re.compile(r"(GLOBAL [\w.]+|Unsupported operand \d+|Unsupported class [\w.]+)")


def load_torch(path: str | Path, what: str, map_location: torch.device | str = "cpu") -> Any:
    """`torch.load` of `path` with the restricted unpickler; one-line errors name `what`."""
    p = Path(path)
    try:
        with warnings.catch_warnings():
            # A raw pickle draws torch's multi-line protocol warning before the refusal; the
            # refusal is the one line the user needs.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(p, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _WHY.search(str(e))
        detail = f" ({found.group(1)})" if found else ""
        # A named global is an object the file asks to build; any other stop is an opcode the
        # restricted unpickler does not take (a raw pickle, or bytes that are no pickle at all).
        what_is_wrong = ("holds Python objects other than tensors and plain data"
                         if found and found.group(1).startswith(("GLOBAL", "Unsupported class"))
                         else "is not a file of tensors and plain data")
        raise UnsafeFileError(
            f"{what} '{p}' {what_is_wrong}{detail}; fedvl loads only those, since unpickling "
            "anything else can run code: refused") from e
    except Exception as e:  # noqa: BLE001 - a damaged file: zip, EOF, storage errors alike
        # The first sentence is the cause; torch goes on with internals ("an internal miniz
        # error. If you ...").
        why = " ".join(str(e).split()).split(". ")[0][:120] or type(e).__name__
        raise ValueError(f"{what} '{p}' is corrupted or truncated ({type(e).__name__}: "
                         f"{why})") from e


def plain(obj: Any) -> Any:
    """`obj` with numpy scalars and arrays as Python numbers and tensors (loadable by
    `load_torch`); containers are rebuilt, anything else is returned unchanged."""
    # Exact types only: a state dict stays an OrderedDict, other subclasses are left alone.
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, plain(v)) for k, v in obj.items())
    if type(obj) is list:
        return [plain(v) for v in obj]
    if type(obj) is tuple:
        return tuple(plain(v) for v in obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    return obj

"""Flower-only settings of a run, declared once for the flags, the app config and the checks.

Kept apart from `server_app` so that the command line can build its flags without flwr.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedvl.options import Naming, check_options, from_mapping, option

RUN_CONFIG = Naming(label="run_config key '{flag}'")


@dataclass
class ServerOptions:
    """Flower-only settings of a run (not part of the experiment's RunConfig)."""

    out: str | None = option(None, "run directory (absolute path on the SuperLink host)",
                             cli=False)
    round_timeout: float = option(600.0, "max seconds to wait for one round's replies", gt=0)
    min_nodes: int = option(1, "a round needs at least this many reachable sampled nodes",
                            ge=1)
    join_timeout: float = option(300.0, "max seconds to wait for all partitions at the start",
                                 gt=0)
    node_wait: float = option(60.0, "max seconds to wait for --min-nodes before a round, "
                                    "then stop", ge=0)

    @classmethod
    def from_run_config(cls, rc: dict[str, Any]) -> ServerOptions:
        """Read `out`, `round-timeout`, `min-nodes`, `join-timeout`, `node-wait`.

        A Flower run config also holds every RunConfig key; those are not ours and are skipped.
        """
        data = {k: v for k, v in rc.items() if k.replace("-", "_") in _OWN}
        if not data.get("out"):
            data.pop("out", None)
        opts = from_mapping(cls, data, naming=RUN_CONFIG, ignore_unknown=True, hyphens=True)
        return check_options(opts, RUN_CONFIG)


_OWN = set(ServerOptions.__dataclass_fields__)

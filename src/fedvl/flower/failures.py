"""Lost clients on Flower: readable failure reasons and the `min-nodes` rule.

Kept apart from the transport so that the rule and the text cleaning work (and are tested)
without flwr or Ray.
"""

from __future__ import annotations

import re

# Terminal escapes a Flower/Ray error text may carry (Ray colours its tracebacks): CSI
# sequences (`ESC [ ... final byte`, also the 8-bit CSI 0x9b), OSC sequences (`ESC ] ... BEL`
# or `ESC \`), and any other two-byte `ESC x` sequence.
_ESCAPES = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
                      r"|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                      r"|\x1b[@-_]")
# Control characters left after that (C0, DEL, C1): a reason is one line of plain text.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]+")
REASON_LIMIT = 300  # characters of one recorded reason


def clean_reason(text: str, limit: int = REASON_LIMIT) -> str:
    """`text` without terminal escapes or control characters, on one line, at most `limit` long."""
    text = _CONTROLS.sub(" ", _ESCAPES.sub("", str(text)))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MinNodesError(RuntimeError):
    """A round (or its evaluation) heard from fewer clients than `min-nodes`: the run stops.

    Nothing of that round is kept: the last checkpoint is the round before, so the run resumes
    from there with every client again.
    """

    def __init__(self, rnd: int, stage: str, answered: int, asked: int, min_nodes: int,
                 lost: dict[str, str]) -> None:
        self.round, self.stage, self.lost = rnd, stage, dict(lost)
        self.answered, self.asked, self.min_nodes = answered, asked, min_nodes
        super().__init__(describe_loss(rnd, stage, answered, asked, min_nodes))

    @property
    def status(self) -> str:
        """The run's status: `failed: ` and what was lost."""
        return f"failed: {self}"


def required(min_nodes: int, asked: int) -> int:
    """How many of `asked` clients must answer: `min-nodes`, or all of them if fewer."""
    return min(min_nodes, asked)


def check_min_nodes(rnd: int, stage: str, answered: int, asked: int, min_nodes: int,
                    lost: dict[str, str]) -> None:
    """Raise MinNodesError if fewer than `required(min_nodes, asked)` clients answered."""
    if answered < required(min_nodes, asked):
        raise MinNodesError(rnd, stage, answered, asked, min_nodes, lost)


def describe_loss(rnd: int, stage: str, answered: int, asked: int, min_nodes: int) -> str:
    """What was lost, e.g. `1 of 5 clients lost at round 2 (below --min-nodes 5)`."""
    where = f"at round {rnd}" if stage == "train" else f"in the {stage} of round {rnd}"
    return f"{asked - answered} of {asked} clients lost {where} (below --min-nodes {min_nodes})"

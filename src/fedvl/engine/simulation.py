"""The embedded engine: the round driver over the in-process transport."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedvl.algorithms.base import Algorithm, ClientContext
from fedvl.core.audit import DEFAULT_GUARD
from fedvl.core.message import Message
from fedvl.data.federated import FederatedDataset
from fedvl.engine.driver import (
    Progress,
    RoundConfig,
    RoundDriver,
    client_generator,
    evaluation_due,
    round_record,
    sample_clients,
)
from fedvl.engine.inprocess import InProcessTransport
from fedvl.engine.recorder import CHECKPOINT, RunRecorder
from fedvl.seeding import derive_seed

SimulationConfig = RoundConfig

__all__ = ["CHECKPOINT", "Simulation", "SimulationConfig", "client_generator", "derive_seed",
           "evaluation_due", "round_record", "sample_clients"]


class Simulation(RoundDriver):
    """Runs an algorithm over a federated dataset in one process."""

    transport: InProcessTransport

    def __init__(
        self,
        algorithm: Algorithm,
        fed: FederatedDataset,
        cfg: RoundConfig,
        run_dir: Path | None = None,
        device: torch.device | str = "cpu",
        workers: int = 1,
        stack: bool = False,
        upload_guard: float = DEFAULT_GUARD,
    ) -> None:
        device = torch.device(device)
        recorder = RunRecorder(run_dir) if run_dir is not None else None
        transport = InProcessTransport(algorithm, fed, cfg.seed, device, workers, stack,
                                       upload_guard)
        super().__init__(algorithm, transport, cfg, recorder, device)
        self.fed = fed
        self.run_dir = Path(run_dir) if run_dir is not None else None

    @property
    def client_states(self) -> dict[int, Message]:
        """Every client's persistent state (held in this process)."""
        return self.transport.client_states

    def context(self, cid: int, rnd: int) -> ClientContext:
        """The ClientContext of client `cid` in round `rnd`."""
        return self.transport.context(cid, rnd)

    def run(self, resume: bool = False, progress: Progress | None = None) -> dict[str, Any]:
        """Run (or continue) all rounds; the client threads stop when it ends or fails."""
        try:
            return super().run(resume, progress)
        finally:
            self.transport.pool.close()

    def evaluate(self, rnd: int) -> dict[str, Any]:
        """Per-client accuracy/loss of the global model, or of each client's own model."""
        return self.transport.evaluate(rnd, self.state)

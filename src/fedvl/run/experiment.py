"""Run, resume and dry-run one configured experiment on the in-process engine.

What a run is made of comes from `fedvl.run.assemble`; this module adds the run directory, the
progress reporting and the summary. The builders are looked up on the `assemble` module at call
time, so a test that replaces one there (a small federation) replaces it for every path.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedvl.config import ConfigError, RunConfig, load_yaml, resolve_model_args, validate
from fedvl.data.federated import FederatedDataset
from fedvl.engine.allocator import keep_freed_memory
from fedvl.engine.driver import Progress
from fedvl.engine.logs import check_logs
from fedvl.engine.recorder import RunRecorder, discard_failed_start, read_metrics
from fedvl.engine.threads import default_workers, resolve_threads, torch_threads
from fedvl.progress import RoundBar, Sink, reporting
from fedvl.run import assemble


def run_experiment(
    cfg: RunConfig,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool | Sink = False,
    fed: FederatedDataset | None = None,
    on_round: Progress | None = None,
) -> dict[str, Any]:
    """Run one configured experiment end to end and write its run directory.

    `progress`: True shows a progress bar on stderr; a callable receives every progress event
    (`fedvl.progress`: dicts with `phase`, `round`, `client`, `step`, `total`, ...), possibly
    from several threads but never two at once. Neither changes any number of the run.
    `on_round(round, record)` is called after each round is recorded and checkpointed, with its
    metrics record; unlike a progress sink, an exception it raises stops the run (what a
    hyperparameter search does to prune a hopeless trial).
    """
    keep_freed_memory()
    cfg = resolved(cfg)
    # Decided once: the default name has a timestamp, and the cleanup must see the same path.
    run_dir = Path(out) if out is not None else assemble.default_run_dir(cfg)
    # Determinism first: cuBLAS reads its workspace setting at the run's first CUDA call.
    with (assemble.deterministic_mode(cfg.engine.deterministic),
          torch_threads(cfg.engine.threads), discard_failed_start(run_dir)):
        return _run_embedded(cfg, run_dir, resume, progress, fed, on_round)


def resolved(cfg: RunConfig) -> RunConfig:
    """`cfg` validated, with every model option and the thread count filled in.

    The recorded config names the model options the run used (the method's preferences too).
    The packages of its `--log` kinds are checked here, before anything is written.
    """
    validate(cfg)
    check_logs(cfg.engine.log)
    engine = cfg.engine
    return replace(resolve_model_args(cfg), threads=resolve_threads(engine.threads),
                   workers=engine.workers or default_workers(engine.device))


def check_experiment(cfg: RunConfig, fed: FederatedDataset | None = None) -> FederatedDataset:
    """Everything a start checks (config, device, data, models, method options); writes nothing.

    The local virtual sets of `--local-data virtual` are not distilled: their options are
    checked with the config, and distilling is the start of the work, not a check.
    """
    cfg = resolved(cfg)
    # Under the run's own settings: a method that builds with a CUDA op torch has no
    # deterministic kernel for fails here as it would at the start of the run.
    with assemble.deterministic_mode(cfg.engine.deterministic), torch_threads(cfg.engine.threads):
        device = assemble.resolve_device(cfg.engine.device)
        fed = fed if fed is not None else assemble.build_federation(cfg)
        assemble.build_method(cfg, fed, device)
    return fed


def _run_embedded(cfg: RunConfig, run_dir: Path, resume: bool, progress: bool | Sink,
                  fed: FederatedDataset | None, on_round: Progress | None = None
                  ) -> dict[str, Any]:
    bar = (RoundBar(cfg.loop.rounds, f"{cfg.method} on {cfg.data.benchmark}")
           if progress is True else None)
    sink = bar if bar is not None else (progress if callable(progress) else None)
    recorder: RunRecorder | None = None
    try:
        try:
            # Distilling local virtual data (`--local-data virtual`) is before round 0: reported.
            with reporting(sink):
                start = time.perf_counter()
                sim, algorithm, fed, device = assemble.simulation(cfg, fed, run_dir)
                # Building the data and distilling local virtual sets: before the round clock,
                # yet part of what a run costs (a table's cost counts it).
                setup_seconds = time.perf_counter() - start
                recorder = sim.recorder
                assert recorder is not None
                recorder.use_logs(cfg)
                if not resume:
                    recorder.write_config(cfg)
                result = sim.run(resume=resume, progress=on_round)
        finally:
            if bar is not None:
                bar.close()
        sets = algorithm.virtual_sets(sim.state, sim.client_states)
        if fed.info.get("local_data") == "virtual" and not sets:
            sets = {f"local_virtual_{c.name}": (c.x_train, c.y_train) for c in fed.clients}
        images = recorder.save_images(sets, fed.num_classes, fed.mean, fed.std)
        summary = {
            **assemble.summary_head(cfg, fed.client_names,
                                    {c.name: c.num_train for c in fed.clients}, fed.info,
                                    device, run_dir, images),
            **result,
            "setup_seconds": round(setup_seconds, 3),
            **algorithm.report(sim.state),
        }
        recorder.write_summary(summary)
    except BaseException:
        if recorder is not None:
            recorder.logs.close(failed=True)
        raise
    recorder.logs.close()
    return summary


def resume_experiment(run_dir: str | Path, progress: bool | Sink = False,
                      rounds: int | None = None) -> dict[str, Any]:
    """Continue an interrupted run from its directory's config and checkpoint; with `rounds`,
    continue it (finished or not) to that many rounds.

    No method's numbers depend on the total round count (schedules count rounds from 0), so an
    extended run gives the numbers of a run started with `rounds` (`docs/reliability.md`).
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"'{run_dir}' is not a run directory (no config.yaml)")
    cfg = load_yaml(cfg_path)
    if rounds is not None and rounds != cfg.loop.rounds:
        done = len(read_metrics(run_dir))
        if rounds < max(done, 1):
            raise ConfigError(f"--rounds {rounds} is fewer than the {done} rounds '{run_dir}' "
                              f"has run; allowed with --resume: {max(done, 1)} or more")
        cfg = validate(replace(cfg, rounds=rounds))
        # The directory now records the rounds it runs to: a later --resume continues to them.
        RunRecorder(run_dir).write_config(cfg)
    return run_experiment(cfg, out=run_dir, resume=True, progress=progress)

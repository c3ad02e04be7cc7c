"""Hyperparameter search with the same budget for every method (`fedvl tune`).

Each method gets one Optuna study with the same number of finished trials. A trial draws the
run options that declare a search space (`option(..., tune=...)` in `fedvl.config`: the client
optimiser) and the method's own (`tune=` in its `Params`), runs the method with them on the
clients' training data less a validation split (`fedvl.run.assemble.split_validation`) and
scores the mean client accuracy on those validation rows after the last round. No test image
is in the federation a trial runs on. Every evaluated round reports its validation accuracy to
the study's pruner (a median rule unless one is given), which may stop a hopeless trial there.

Everything lives in the output directory: `study.db` (Optuna's SQLite storage: running the
same search again continues each study up to the budget), `trials/<method>/trialNNNN/seedS`
(each trial's run directory, its checkpoint removed when the trial ends), `best/<method>.yaml`
(the best trial's settings as a config `fedvl run --config` loads) and `trials.json` (every
trial: params, value, state, the round it was pruned at). `fedvl bench --tuned DIR` runs the
comparison with the best settings (`load_tuned`).

Optuna is an optional dependency (`pip install 'fedvl[tune]'`), imported only by `tune`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from fedvl.config import (
    ConfigError,
    RunConfig,
    TrainingSection,
    load_yaml,
    shared_model_args,
    validate,
    written_fields,
)
from fedvl.options import Space, search_space
from fedvl.registry import ALGORITHMS

INSTALL = "pip install 'fedvl[tune]'"
STORAGE = "study.db"
TRIALS_JSON = "trials.json"
BEST_DIR = "best"
TRIALS_DIR = "trials"
# A fifth of each client's training images: enough rows per class to tell settings apart on
# small caps, while the trial still trains on most of the data.
DEFAULT_VAL_FRACTION = 0.2
# Optuna names the method's options apart from the run's (`method.mu` next to `lr`).
METHOD_PREFIX = "method."
# Random stream of the samplers' seeds.
SAMPLER_STREAM = 47
# Settings of where the work runs: they change no number, so a study may continue under others.
_ENGINE_KEYS = ("device", "threads", "workers")
# A trial whose process died stays RUNNING in the storage until its heartbeat is this old
# (seconds); then the next search marks it failed. Neither kind counts toward the budget.
HEARTBEAT_S = 30


def require_optuna() -> ModuleType:
    """The optuna module, or one ConfigError saying how to install it."""
    try:
        import optuna
    except ImportError as e:
        raise ConfigError(f"fedvl tune needs Optuna, which is not installed: {INSTALL}") from e
    return optuna


def run_space(base: RunConfig, fixed: Collection[str] = (), method: str | None = None
              ) -> dict[str, Space]:
    """The run options searched for `method`: those declaring a space, less `fixed`, less the
    clients' local optimiser where the method's clients train no model."""
    space = {k: v for k, v in search_space(RunConfig).items() if k not in fixed}
    if method is not None and not ALGORITHMS.get(method).trains_client_models:
        for k in search_space(TrainingSection):
            space.pop(k, None)
    if base.training.local_steps is not None:
        # Local steps override the epochs: searching them would only repeat trials.
        space.pop("local_epochs", None)
    return space


def method_space(method: str, fixed: Collection[str] = ()) -> dict[str, Space]:
    """The method's own options searched (those its Params declare a space for), less `fixed`."""
    return {k: v for k, v in search_space(ALGORITHMS.get(method).Params).items()
            if k not in fixed}


def _setup(base: RunConfig, method: str, method_args: dict[str, Any], seeds: Sequence[int],
           val_fraction: float, space: dict[str, Space]) -> dict[str, Any]:
    """What a study's trials depend on; a study continues only under the same setup."""
    cfg = {k: v for k, v in base.to_dict().items()
           if k not in ("method", "method_args", "seed", *_ENGINE_KEYS)}
    return {"method": method, "method_args": method_args, "config": cfg, "seeds": list(seeds),
            "val_fraction": val_fraction,
            "space": {name: s.describe() for name, s in space.items()}}


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The setup keys (config keys by their own name) whose values differ."""
    keys = [k for k in sorted(set(old) | set(new)) if k != "config" and old.get(k) != new.get(k)]
    oc, nc = old.get("config", {}), new.get("config", {})
    return keys + [k for k in sorted(set(oc) | set(nc)) if oc.get(k) != nc.get(k)]


def _finished(study: Any, optuna: ModuleType) -> int:
    """Trials that count toward the budget: completed or pruned."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=states))


class TrialBar:
    """The search's progress bar: finished trials over all methods, the running one beside it."""

    def __init__(self, total: int, done: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, desc="tune", unit="trial")
        self.where = ""

    def start(self, method: str, number: int, seed: int) -> None:
        """A trial's run starts."""
        self.where = f"{method} trial {number} seed {seed}"
        self.bar.set_postfix_str(self.where, refresh=True)

    def event(self, event: dict[str, Any]) -> None:
        """A progress event of the running trial: its finished rounds."""
        if event.get("phase") != "round_done":
            return
        acc = event.get("mean_accuracy")
        tail = "" if acc is None else f" val_acc={acc:.3f}"
        self.bar.set_postfix_str(f"{self.where} · round {int(event['round']) + 1}/"
                                 f"{event.get('rounds')}{tail}", refresh=True)

    def advance(self) -> None:
        """A trial finished (completed, pruned or diverged)."""
        self.bar.update(1)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()


def tune(
    base: RunConfig,
    methods: Sequence[str],
    trials: int,
    out: str | Path,
    method_args: dict[str, dict[str, Any]] | None = None,
    seeds: Sequence[int] = (0,),
    val_fraction: float = DEFAULT_VAL_FRACTION,
    fixed: Collection[str] = (),
    pruner: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Search every method's space with `trials` finished trials each; write `out`.

    `method_args` are fixed method options (left out of the search); `fixed` names run options
    left out of the search (those the user set). `pruner`: an Optuna pruner (default: the
    median rule). Returns what `trials.json` holds.
    """
    optuna = require_optuna()
    from fedvl.seeding import derive_seed  # torch: not for `fedvl tune --help`

    methods, seeds = list(methods), list(seeds)
    if not methods:
        raise ConfigError("--methods must name at least one method")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ConfigError(f"--trials {trials} is invalid; allowed: an integer >= 1 (the "
                          "finished trials every method gets)")
    if not seeds:
        raise ConfigError("--seeds must name at least one seed")
    if not (isinstance(val_fraction, int | float) and 0 < val_fraction < 1):
        raise ConfigError(f"--val-fraction {val_fraction} is invalid; allowed: a fraction in "
                          "(0, 1) of each client's training images")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--methods names a method twice: {', '.join(methods)}")
    method_args = {m: dict((method_args or {}).get(m, {})) for m in methods}
    # The comparison's model for every method (as `fedvl bench` runs them).
    base = shared_model_args(base)
    spaces: dict[str, tuple[dict[str, Space], dict[str, Space]]] = {}
    for m in methods:
        validate(replace(base, method=m, method_args=method_args[m]))
        spaces[m] = (run_space(base, fixed, m), method_space(m, method_args[m]))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        # The heartbeat is marked experimental; it only decides when a dead trial is failed.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(f"sqlite:///{(out / STORAGE).resolve()}",
                                             heartbeat_interval=HEARTBEAT_S)
    studies = {m: _open_study(optuna, storage, m, _setup(base, m, method_args[m], seeds,
                                                         val_fraction, {**spaces[m][0],
                                                                        **spaces[m][1]}),
                              pruner) for m in methods}
    for m, study in studies.items():
        if (n := _finished(study, optuna)) > trials:
            # The best of more trials than the others got would not be a comparison.
            raise ConfigError(f"the study of {m} in this output directory already has {n} "
                              f"finished trials, more than --trials {trials}: every method "
                              f"gets the same budget; allowed: --trials {n} or more")
    feds: dict[int, Any] = {}

    def federation(seed: int) -> Any:
        # Built once per seed and shared by every trial: the searched options are not data.
        if seed not in feds:
            from fedvl.run.assemble import build_federation, split_validation

            feds[seed] = split_validation(build_federation(replace(base, seed=seed)),
                                          val_fraction, seed)
        return feds[seed]

    done = sum(_finished(s, optuna) for s in studies.values())
    bar = TrialBar(trials * len(methods), done) if progress else None
    try:
        for m in methods:
            study = studies[m]
            left = trials - _finished(study, optuna)
            if left <= 0:
                continue
            # Seeded by the trials already there: a continued study draws new points, not the
            # ones its first part drew.
            study.sampler = optuna.samplers.TPESampler(seed=derive_seed(
                seeds[0], SAMPLER_STREAM, zlib.crc32(m.encode()), len(study.trials)) % 2**32)
            objective = _objective(optuna, base, m, method_args[m], spaces[m], seeds, out,
                                   federation, bar)
            callbacks = [lambda s, t: bar.advance()] if bar is not None else []
            # Pruned and diverged trials count as finished; an error stops the search.
            study.optimize(objective, n_trials=left, callbacks=callbacks)
    finally:
        if bar is not None:
            bar.close()
    report = _report(optuna, base, studies, trials, seeds, val_fraction, spaces, out)
    tmp = out / f"{TRIALS_JSON}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, out / TRIALS_JSON)
    return report


def _open_study(optuna: ModuleType, storage: Any, method: str, setup: dict[str, Any],
                pruner: Any) -> Any:
    """The study of `method` in `storage` (created, or continued when its setup is the same)."""
    if pruner is None:
        # Three trials before it prunes; never at the first evaluated round (too noisy).
        pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
    study = optuna.create_study(storage=storage, study_name=method, direction="maximize",
                                load_if_exists=True, pruner=pruner)
    old = study.user_attrs.get("setup")
    if old is None:
        study.set_user_attr("setup", setup)
    elif old != json.loads(json.dumps(setup)):
        names = ", ".join(_differences(old, json.loads(json.dumps(setup))))
        raise ConfigError(f"the study of {method} in this output directory was run with other "
                          f"settings (they differ in: {names}); continue it with the same "
                          "settings or choose another --out")
    return study


def _objective(optuna: ModuleType, base: RunConfig, method: str, fixed_args: dict[str, Any],
               spaces: tuple[dict[str, Space], dict[str, Space]], seeds: list[int], out: Path,
               federation: Callable[[int], Any], bar: TrialBar | None
               ) -> Callable[[Any], float]:
    """Optuna's objective for `method`: the mean over `seeds` of the mean client validation
    accuracy after the run with the trial's settings."""
    from fedvl.engine.divergence import TrainingDiverged
    from fedvl.engine.recorder import CHECKPOINT
    from fedvl.run.experiment import run_experiment

    run_sp, method_sp = spaces
    rounds = base.loop.rounds

    def objective(trial: Any) -> float:
        run = {k: s.suggest(trial, k) for k, s in run_sp.items()}
        own = {k: s.suggest(trial, METHOD_PREFIX + k) for k, s in method_sp.items()}
        cfg = validate(replace(base, method=method, method_args={**fixed_args, **own}, **run))
        accs = []
        for i, seed in enumerate(seeds):
            run_dir = out / TRIALS_DIR / method / f"trial{trial.number:04d}" / f"seed{seed}"

            def on_round(rnd: int, record: dict[str, Any], i: int = i, seed: int = seed
                         ) -> None:
                acc = record.get("mean_accuracy")
                if acc is None:   # not an evaluated round (--eval-every)
                    return
                # One step per (seed, round), in the same order in every trial: the pruner
                # compares a trial with the others at the same seed and round.
                trial.report(float(acc), i * rounds + rnd)
                if trial.should_prune():
                    trial.set_user_attr("pruned_at", {"seed": seed, "round": rnd})
                    raise optuna.TrialPruned(f"validation accuracy {acc:.4f} at seed {seed}, "
                                             f"round {rnd}")

            if bar is not None:
                bar.start(method, trial.number, seed)
            try:
                summary = run_experiment(replace(cfg, seed=seed), out=run_dir,
                                         progress=bar.event if bar is not None else False,
                                         fed=federation(seed), on_round=on_round)
            except TrainingDiverged as e:
                # A setting that blows training up is a result (the worst one), not an error.
                trial.set_user_attr("diverged", str(e))
                return 0.0
            finally:
                # The trial's record is its config, metrics and summary; the checkpoint is bulk.
                (run_dir / CHECKPOINT).unlink(missing_ok=True)
            accs.append(float(summary["mean_accuracy"]))
        return float(sum(accs) / len(accs))

    return objective


def _params(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A trial's Optuna params as {"run": ..., "method_args": ...}."""
    run = {k: v for k, v in params.items() if not k.startswith(METHOD_PREFIX)}
    own = {k.removeprefix(METHOD_PREFIX): v for k, v in params.items()
           if k.startswith(METHOD_PREFIX)}
    return {"run": run, "method_args": own}


def _trial_entry(t: Any, rounds: int, seeds: list[int], out: Path, method: str
                 ) -> dict[str, Any]:
    """One trial as trials.json lists it."""
    value = t.value if t.value is not None and math.isfinite(t.value) else None
    last = t.last_step
    entry: dict[str, Any] = {
        "number": t.number, "state": t.state.name.lower(), "value": value,
        "params": _params(t.params),
        "pruned_round": (t.user_attrs.get("pruned_at", {}).get("round")
                         if t.state.name == "PRUNED" else None),
        # Step i * rounds + r is seed i, round r.
        "reported": [{"seed": seeds[s // rounds] if s // rounds < len(seeds) else None,
                      "round": s % rounds, "mean_val_accuracy": v}
                     for s, v in sorted(t.intermediate_values.items())],
        "run_dir": str(out / TRIALS_DIR / method / f"trial{t.number:04d}"),
    }
    if t.state.name == "PRUNED":
        entry["pruned_at"] = t.user_attrs.get("pruned_at") or (
            {"seed": seeds[last // rounds], "round": last % rounds} if last is not None
            else None)
    if "diverged" in t.user_attrs:
        entry["diverged"] = t.user_attrs["diverged"]
    if t.duration is not None:
        entry["seconds"] = t.duration.total_seconds()
    return entry


def _report(optuna: ModuleType, base: RunConfig, studies: dict[str, Any], trials: int,
            seeds: list[int], val_fraction: float,
            spaces: dict[str, tuple[dict[str, Space], dict[str, Space]]], out: Path
            ) -> dict[str, Any]:
    """trials.json: every trial of every study, and each method's best (written as YAML)."""
    (out / BEST_DIR).mkdir(exist_ok=True)
    methods: dict[str, Any] = {}
    for m, study in studies.items():
        all_trials = study.get_trials(deepcopy=False)
        complete = [t for t in all_trials if t.state == optuna.trial.TrialState.COMPLETE]
        counts: dict[str, int] = {}
        for t in all_trials:
            counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
        entry: dict[str, Any] = {
            "space": {"run": {k: s.describe() for k, s in spaces[m][0].items()},
                      "method_args": {k: s.describe() for k, s in spaces[m][1].items()}},
            "finished": _finished(study, optuna), "states": counts,
            "trials": [_trial_entry(t, base.loop.rounds, seeds, out, m) for t in all_trials],
            "best": None,
        }
        if complete:
            best = study.best_trial
            p = _params(best.params)
            cfg = replace(base, method=m, seed=seeds[0],
                          method_args={**study.user_attrs["setup"]["method_args"],
                                       **p["method_args"]}, **p["run"])
            path = out / BEST_DIR / f"{m}.yaml"
            head = (f"# fedvl tune: the best of {len(complete)} completed trial(s) of {m} "
                    f"(trial {best.number}): mean client validation accuracy "
                    f"{best.value:.4f}\n")
            path.write_text(head + yaml.safe_dump(written_fields(cfg), sort_keys=False))
            entry["best"] = {"trial": best.number, "value": best.value, **p,
                             "config": str(path)}
        methods[m] = entry
    cfg = {k: v for k, v in base.to_dict().items() if k not in ("method", "method_args", "seed")}
    return {"benchmark": base.benchmark, "trials_per_method": trials, "seeds": seeds,
            "val_fraction": val_fraction,
            "objective": "mean client accuracy on the validation rows (a class-stratified "
                         f"{val_fraction:g} of each client's training images, never trained "
                         "on) after the last round, mean over the seeds",
            "storage": str(out / STORAGE), "config": cfg, "methods": methods}


def load_tuned(tuned: str | Path, methods: Sequence[str]
               ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The tuned settings of each method in `tuned` (a `fedvl tune` output directory):
    (method options, run options of the shared space) per method."""
    root = Path(tuned)
    if not root.is_dir():
        raise ConfigError(f"--tuned '{root}' is not a directory; allowed: the --out directory "
                          "of `fedvl tune`")
    have = sorted(p.stem for p in (root / BEST_DIR).glob("*.yaml"))
    args: dict[str, dict[str, Any]] = {}
    run: dict[str, dict[str, Any]] = {}
    for m in methods:
        path = root / BEST_DIR / f"{m}.yaml"
        if not path.is_file():
            raise ConfigError(f"--tuned '{root}' has no tuned settings of {m} "
                              f"({BEST_DIR}/{m}.yaml); tuned there: "
                              f"{', '.join(have) or 'none'}; run `fedvl tune --methods {m} "
                              f"... --out {root}` first")
        cfg = load_yaml(path)
        if cfg.method != m:
            raise ConfigError(f"'{path}' holds settings of method '{cfg.method}', not {m}")
        args[m] = dict(cfg.method_args)
        run[m] = {k: getattr(cfg, k) for k in search_space(RunConfig)}
    return args, run

"""Federated unlearning with the clients' distilled sets, after QuickDrop (Dhasade et al., 2024).

`fedvl unlearn RUN_DIR --class C | --client K` on a finished `--local-data virtual` run:
1. The distilled data are the run's local virtual sets (every client's, rebuilt from the run's
   config and seed, from the cache when it has them); the model is the run's global model.
2. Ascent: the forgotten part's distilled images (class C from every client, or client K's whole
   set) take `ascent_steps` SGD steps at `ascent_lr`, and the model is then moved as far again
   the other way from where it started: theta <- 2 theta_0 - theta_N (QuickDrop's `unlearn` and
   `compute_sga_grad`, `FedSGA/utils.py` l.20-45), i.e. stochastic gradient ascent.
3. Recovery: `recovery_rounds` FedAvg rounds on the remaining distilled data, every client that
   holds some taking `recovery_epochs` local epochs, averaged by set size (the code's
   `weighted_global_naive_retrain`, `FedNaiveRetrain/server/server_fednaiveretrain.py` l.31-53).
4. Report, before / after ascent / after recovery: accuracy on the clients' real test images of
   the forgotten part and of the rest, and a loss-threshold membership attack (AUC of the
   per-example confidence, forgotten real training images against unseen test images of the
   same part). LiRA (`fedvl.eval.membership`) would need shadow federations trained anew.
5. With `retrain`, the reference QuickDrop is measured against: the same run from scratch
   without the forgotten data (class C cut from every client's real data, or client K held
   out), its local sets distilled anew, measured on the same test images, with its time.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedvl.config import ConfigError
from fedvl.core.training import TrainConfig, evaluate, local_train
from fedvl.data.federated import FederatedDataset
from fedvl.seeding import generator

__all__ = ["UnlearnSettings", "ascend", "recover", "retrain", "unlearn_run", "table"]

# Stream id of the unlearning's batch draws (derived with the run seed).
UNLEARN_STREAM = 211

Sets = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class UnlearnSettings:
    """Schedule and optimiser of the ascent and the recovery (defaults: QuickDrop's MNIST run,
    `reproduce/fig2_with_recovering/code/readMe.md` and `reproduce_single_unlearning.py`)."""

    ascent_steps: int = 1          # one forgetting epoch of batch 256 (l.106, l.95)
    ascent_lr: float = 0.01        # --forgetting_rate 0.01 (readMe, MNIST command)
    recovery_rounds: int = 5       # --recovering_round 5 (l.72)
    recovery_epochs: int = 5       # --local_epoch 5 (l.90)
    lr: float = 0.01               # --learning_rate 0.01 (readMe, MNIST command)
    weight_decay: float = 0.001    # --weight_decay (l.88)
    momentum: float = 0.0          # --momentum 0 (l.89)
    batch_size: int = 256          # --batch_size (l.95)


def check_settings(s: UnlearnSettings) -> None:
    """Refuse settings no schedule can run, naming the option and what is allowed."""
    for name in ("ascent_steps", "recovery_rounds", "recovery_epochs"):
        if getattr(s, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(s, name)} is negative; "
                              "allowed: 0 or more")
    if s.batch_size < 1:
        raise ConfigError(f"--batch-size {s.batch_size}; allowed: 1 or more")
    for name in ("ascent_lr", "lr", "weight_decay", "momentum"):
        v = getattr(s, name)
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"--{name.replace('_', '-')} {v}; allowed: a finite number >= 0")


def ascend(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, s: UnlearnSettings,
           g: torch.Generator) -> None:
    """Gradient ascent on (x, y) in place: `ascent_steps` SGD steps, then reflect the move."""
    if s.ascent_steps == 0 or len(y) == 0:
        return
    start = {k: v.detach().clone() for k, v in model.state_dict().items()
             if torch.is_floating_point(v)}
    cfg = TrainConfig(lr=s.ascent_lr, momentum=0.0, weight_decay=s.weight_decay,
                      local_epochs=1, local_steps=s.ascent_steps, batch_size=s.batch_size)
    local_train(model, x, y, cfg, g)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k in start:
                v.copy_(2 * start[k] - v)


def recover(model: torch.nn.Module, sets: Sets, s: UnlearnSettings, seed: int) -> None:
    """FedAvg on the clients' remaining distilled `sets` in place, weighted by their sizes."""
    from fedvl.core.params import weighted_average

    held = [(k, x, y) for k, (x, y) in enumerate(sets) if len(y) > 0]
    if not held or s.recovery_rounds == 0 or s.recovery_epochs == 0:
        return
    cfg = TrainConfig(lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay,
                      local_epochs=s.recovery_epochs, batch_size=s.batch_size)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for rnd in range(s.recovery_rounds):
        states, weights = [], []
        for k, x, y in held:
            model.load_state_dict(start)
            local_train(model, x, y, cfg, generator(seed, UNLEARN_STREAM, 1, rnd, k))
            states.append({n: v.detach().clone() for n, v in model.state_dict().items()})
            weights.append(float(len(y)))
        start = weighted_average(states, weights)
    model.load_state_dict(start)


@dataclass(frozen=True)
class Target:
    """What is forgotten: class `index` of every client, or client `index` whole."""

    kind: str    # "class" or "client"
    index: int
    name: str


def resolve_target(fed: FederatedDataset, forget_class: int | str | None,
                   forget_client: int | str | None) -> Target:
    """The forgotten class or client of `fed`, or one ConfigError naming what is allowed."""
    if (forget_class is None) == (forget_client is None):
        raise ConfigError("give exactly one of --class C (forget a class) and --client K "
                          "(forget a client)")
    if forget_client is not None:
        try:
            k = fed.client_index(forget_client)
        except ValueError as e:
            raise ConfigError(f"--client {forget_client}: {e}") from e
        if len(fed.clients) < 2:
            raise ConfigError("--client needs a run of 2 or more clients: none would be left")
        return Target("client", k, fed.client_names[k])
    text = str(forget_class)
    if not text.lstrip("-").isdigit() or not 0 <= int(text) < fed.num_classes:
        raise ConfigError(f"--class {text} is not a class of '{fed.name}'; allowed: 0 to "
                          f"{fed.num_classes - 1}")
    if fed.num_classes < 2:
        raise ConfigError("--class needs 2 or more classes: none would be left")
    return Target("class", int(text), str(int(text)))


def split(fed: FederatedDataset, t: Target, part: str) -> tuple[Sets, Sets]:
    """(forgotten, kept) per client of the `part` "train" (distilled), "real" or "test"."""
    forgot: Sets = []
    kept: Sets = []
    for k, c in enumerate(fed.clients):
        x, y = {"train": (c.x_train, c.y_train), "test": (c.x_test, c.y_test),
                "real": (c.x_real, c.y_real)}[part]
        if t.kind == "client":
            empty = (x[:0], y[:0])
            forgot.append((x, y) if k == t.index else empty)
            kept.append(empty if k == t.index else (x, y))
        else:
            f = y == t.index
            forgot.append((x[f], y[f]))
            kept.append((x[~f], y[~f]))
    return forgot, kept


def _cat(sets: Sets) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in sets]), torch.cat([y for _, y in sets])


def measure(model: torch.nn.Module, fed: FederatedDataset, t: Target) -> dict[str, Any]:
    """Accuracy on the forgotten and kept real test images, and the membership attack's AUC."""
    from fedvl.eval.membership import attack_metrics, logit_confidence

    f_test, k_test = (_cat(s) for s in split(fed, t, "test"))
    f_real = _cat(split(fed, t, "real")[0])
    out: dict[str, Any] = {"forgotten_accuracy": evaluate(model, *f_test)[0],
                           "kept_accuracy": evaluate(model, *k_test)[0]}
    # phi = log p_y - log(1 - p_y) orders examples as minus their loss does: its AUC is the
    # loss-threshold attack's.
    scores = logit_confidence(model, torch.cat([f_real[0], f_test[0]]),
                              torch.cat([f_real[1], f_test[1]]))
    member = np.r_[np.ones(len(f_real[1]), dtype=int), np.zeros(len(f_test[1]), dtype=int)]
    if member.all() or not member.any():
        out["loss_attack_auc"] = None
    else:
        m = attack_metrics(scores, member)
        out["loss_attack_auc"] = m["auc"]
        out["loss_attack_tpr_at_1%_fpr"] = m["tpr_at_1%_fpr"]
    return out


def without(fed: FederatedDataset, t: Target) -> FederatedDataset:
    """`fed` (real data) without the forgotten part: class C cut from every client's training
    data, or client K moved to the held-out clients (evaluated, never trained)."""
    if t.kind == "client":
        return replace(fed, clients=[c for k, c in enumerate(fed.clients) if k != t.index],
                       holdout=[*fed.holdout, fed.clients[t.index]])
    clients = []
    for c in fed.clients:
        keep = c.y_train != t.index
        clients.append(replace(c, x_train=c.x_train[keep], y_train=c.y_train[keep]))
    return replace(fed, clients=clients)


def retrain(cfg: Any, real: FederatedDataset, t: Target, out: Path
            ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The run of `cfg` from scratch on its real data `real` without the forgotten part, in
    `out`: its global model and its times (the whole retraining, local sets' distillation
    included, and its rounds)."""
    from fedvl.run.assemble import (
        load_finished,
        resolve_device,
        served_model,
        with_local_virtual_data,
    )
    from fedvl.run.experiment import run_experiment

    t0 = time.perf_counter()
    fed = with_local_virtual_data(cfg, without(real, t), resolve_device(cfg.engine.device))
    summary = run_experiment(cfg, out=out, fed=fed)
    seconds = time.perf_counter() - t0
    # Restored on the same reduced data (no second distillation): the retrained global model.
    model = served_model(*load_finished(out, fed), 0)
    return model, {"retraining": seconds, "retraining_rounds": summary.get("wall_seconds")}


def unlearn_run(run_dir: str | Path, forget_class: int | str | None = None,
                forget_client: int | str | None = None, out: str | Path | None = None,
                settings: UnlearnSettings | None = None, with_retrain: bool = False
                ) -> dict[str, Any]:
    """Unlearn a class or a client from a finished `--local-data virtual` run; writes
    unlearn.json and unlearned_model.pt to `out` (default: the run directory); with
    `with_retrain` also retrains from scratch without it (in `out`/retrain) and compares."""
    from fedvl.config import load_yaml
    from fedvl.engine.threads import resolve_threads, torch_threads
    from fedvl.run.assemble import build_federation, load_finished

    s = settings or UnlearnSettings()
    check_settings(s)
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"'{run_dir}' is not a run directory (no config.yaml)")
    cfg = load_yaml(run_dir / "config.yaml")
    if cfg.virtual.local_data != "virtual":
        raise ConfigError(f"'{run_dir}' was run with --local-data {cfg.virtual.local_data}: "
                          "unlearning needs the clients' distilled sets; allowed: a finished "
                          "run made with --local-data virtual")
    real = build_federation(cfg)
    target = resolve_target(real, forget_class, forget_client)
    sim, algorithm = load_finished(run_dir)
    fed = sim.fed
    model = algorithm.global_model(sim.state)
    if model is None:
        raise ConfigError(f"method '{cfg.method}' keeps no global model to unlearn from; "
                          "allowed: a run of a method with a global model (fedavg, fedprox, "
                          "feddm, ...)")
    summary_path = run_dir / "summary.json"
    run_seconds = (json.loads(summary_path.read_text()).get("wall_seconds")
                   if summary_path.is_file() else None)
    forgot, kept = split(fed, target, "train")
    fx, fy = _cat(forgot)
    if len(fy) == 0:
        raise ConfigError(f"no client holds distilled images of {target.kind} {target.name}; "
                          "allowed: a class some client distilled")
    with torch_threads(resolve_threads(cfg.engine.threads)):
        model = model.to(sim.device)
        stages = {"before": measure(model, fed, target)}
        t0 = time.perf_counter()
        ascend(model, fx, fy, s, generator(cfg.seed, UNLEARN_STREAM, 0))
        t1 = time.perf_counter()
        stages["after_ascent"] = measure(model, fed, target)
        t2 = time.perf_counter()
        recover(model, kept, s, cfg.seed)
        t3 = time.perf_counter()
        stages["after_recovery"] = measure(model, fed, target)
    seconds = (t1 - t0) + (t3 - t2)
    result: dict[str, Any] = {
        "run_dir": str(run_dir), "method": cfg.method, "benchmark": cfg.data.benchmark,
        "forget": {"kind": target.kind, "index": target.index, "name": target.name},
        "settings": asdict(s),
        "distilled_images": {"forgotten": int(len(fy)),
                             "kept": int(sum(len(y) for _, y in kept))},
        "stages": stages,
        "seconds": {"ascent": t1 - t0, "recovery": t3 - t2, "unlearning": seconds,
                    "original_run": run_seconds,
                    "run_over_unlearning": (run_seconds / seconds
                                            if run_seconds and seconds > 0 else None)},
        "membership_attack": "loss threshold (AUC of log p_y - log(1 - p_y)): forgotten real "
                             "training images vs real test images of the same part",
    }
    dest = Path(out) if out is not None else run_dir
    dest.mkdir(parents=True, exist_ok=True)
    if with_retrain:
        ref, times = retrain(cfg, real, target, dest / "retrain")
        with torch_threads(resolve_threads(cfg.engine.threads)):
            result["stages"]["retrained"] = measure(ref.to(sim.device), fed, target)
        result["seconds"].update(times)
        result["seconds"]["retraining_over_unlearning"] = (
            times["retraining"] / seconds if seconds > 0 else None)
    tmp = dest / f"unlearn.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, dest / "unlearn.json")
    torch.save({k: v.cpu() for k, v in model.state_dict().items()},
               dest / "unlearned_model.pt")
    return result


def table(result: dict[str, Any]) -> str:
    """The stages as a short text table (accuracies in %, attack AUC)."""
    rows = [f"{'stage':15s} {'forgotten acc':>13s} {'kept acc':>9s} {'attack AUC':>10s}"]
    for name, m in result["stages"].items():
        auc = "-" if m["loss_attack_auc"] is None else f"{m['loss_attack_auc']:.3f}"
        rows.append(f"{name:15s} {100 * m['forgotten_accuracy']:12.1f}% "
                    f"{100 * m['kept_accuracy']:8.1f}% {auc:>10s}")
    sec = result["seconds"]
    line = f"unlearning {sec['unlearning']:.2f} s"
    if sec["original_run"]:
        line += (f"; the original run's rounds took {sec['original_run']:.1f} s "
                 f"({sec['run_over_unlearning']:.3g}x the unlearning)")
    if sec.get("retraining"):
        line += (f"; retraining without it took {sec['retraining']:.1f} s "
                 f"({sec['retraining_over_unlearning']:.3g}x)")
    return "\n".join([*rows, line])


def replaced(s: UnlearnSettings, **changes: Any) -> UnlearnSettings:
    """`s` with the options given (None keeps the default)."""
    return replace(s, **{k: v for k, v in changes.items() if v is not None})

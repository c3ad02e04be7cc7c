"""Membership inference: LiRA (Carlini et al., 2022) against a run's model, and a nearest-
synthetic-image attack on the synthetic data a method shares.

LiRA, as `fedvl privacy RUN_DIR --client NAME` runs it:
1. The attacker's pool is the target client's training images (members) and its held-out test
   images (non-members).
2. `shadows` federations are trained exactly as the run was (same config, other seeds), each with
   the target client's training set replaced by a random half of the pool; every pool example is
   in exactly half of the shadows (the balanced design of the paper).
3. Every model scores every pool example by its logit-scaled confidence
   phi = log p_y - log(1 - p_y). Online LiRA fits per-example Gaussians to the shadows that held
   the example (in) and did not (out) and scores the likelihood ratio of the target's phi;
   offline LiRA uses only the out Gaussian (one-sided test). With few shadows the variance is
   better shared over all examples (`fix_variance`), as the paper advises below 64 shadows.
4. ROC and AUC from scikit-learn, TPR at 0.1 % and 1 % FPR.

The synthetic-data attack scores a pool image by minus its L2 distance to the nearest synthetic
image the client shared: a much weaker attack (no shadow models, no calibration), reported only
as a lower bound on what shared synthetic data reveal.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

FPRS = (0.001, 0.01)
@torch.no_grad()
def logit_confidence(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                     batch: int = 512) -> np.ndarray:
    """phi = log p_y - log(1 - p_y) of every example, computed stably from the logits."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(y), batch):
        logits = model(x[i:i + batch].to(device)).float()
        yb = y[i:i + batch].to(device)
        z_y = logits.gather(1, yb[:, None]).squeeze(1)
        others = logits.scatter(1, yb[:, None], float("-inf"))
        out.append((z_y - torch.logsumexp(others, dim=1)).cpu())
    return torch.cat(out).double().numpy()


def balanced_masks(num_examples: int, shadows: int, seed: int) -> np.ndarray:
    """[shadows, N] in-masks where every example is in exactly half of the shadows."""
    if shadows < 2 or shadows % 2:
        raise ValueError(f"LiRA needs an even number of shadow models >= 2, got {shadows}")
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((num_examples, shadows)), axis=1)
    return (order < shadows // 2).T.copy()


def lira_scores(target: np.ndarray, shadow: np.ndarray, shadow_in: np.ndarray,
                online: bool = True, fix_variance: bool = False) -> np.ndarray:
    """Per-example LiRA membership score (higher: more likely a member).

    `target` [N]: the target model's phi; `shadow` [S, N]: the shadows' phi; `shadow_in` [S, N]:
    which shadows trained on which example.
    """
    shadow_in = shadow_in.astype(bool)
    if shadow.shape != shadow_in.shape or shadow.shape[1] != target.shape[0]:
        raise ValueError(f"shapes disagree: target {target.shape}, shadow {shadow.shape}, "
                         f"shadow_in {shadow_in.shape}")
    out_n = (~shadow_in).sum(0)
    in_n = shadow_in.sum(0)
    if (out_n == 0).any() or (online and (in_n == 0).any()):
        raise ValueError("every example needs shadow models that held it out"
                         + (" and that trained on it" if online else ""))
    mu_out, sd_out = _masked_moments(shadow, ~shadow_in, fix_variance)
    if not online:
        # One-sided: how far above what models that never saw it produce.
        return -stats.norm.logsf(target, mu_out, sd_out)
    mu_in, sd_in = _masked_moments(shadow, shadow_in, fix_variance)
    return stats.norm.logpdf(target, mu_in, sd_in) - stats.norm.logpdf(target, mu_out, sd_out)


def _masked_moments(values: np.ndarray, mask: np.ndarray, fix_variance: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and std of the masked entries (std shared over columns if asked)."""
    n = mask.sum(0)
    mean = np.where(mask, values, 0.0).sum(0) / n
    var = np.where(mask, (values - mean) ** 2, 0.0).sum(0) / np.maximum(n - 1, 1)
    if fix_variance:
        var = np.full_like(var, var.mean())
    return mean, np.sqrt(var) + 1e-8


def attack_metrics(scores: np.ndarray, is_member: np.ndarray, max_points: int = 400
                   ) -> dict[str, Any]:
    """AUC, TPR at 0.1 % and 1 % FPR, and ROC points of a membership score."""
    from sklearn.metrics import roc_auc_score, roc_curve

    fpr, tpr, _ = roc_curve(is_member, scores)
    out: dict[str, Any] = {"auc": float(roc_auc_score(is_member, scores)),
                           "members": int(is_member.sum()),
                           "non_members": int((1 - is_member).sum())}
    for f in FPRS:
        out[f"tpr_at_{f * 100:g}%_fpr"] = float(tpr[fpr <= f].max(initial=0.0))
    keep = np.unique(np.linspace(0, len(fpr) - 1, min(len(fpr), max_points)).astype(int))
    out["roc"] = {"fpr": fpr[keep].tolist(), "tpr": tpr[keep].tolist()}
    return out


def nearest_synthetic_scores(pool: torch.Tensor, synthetic: torch.Tensor) -> np.ndarray:
    """Minus the L2 distance of each pool image to its nearest synthetic image."""
    a = pool.flatten(1).double()
    b = synthetic.flatten(1).double()
    return (-torch.cdist(a, b).min(dim=1).values).numpy()


def plot_roc(curves: dict[str, dict[str, Any]], title: str) -> Any:
    """ROC curves on log-log axes (as Carlini et al.), AUC in the legend."""
    from fedvl.eval.plots import finish, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for name, m in curves.items():
        fpr = np.maximum(np.asarray(m["roc"]["fpr"]), 1e-5)
        tpr = np.maximum(np.asarray(m["roc"]["tpr"]), 1e-5)
        ax.plot(fpr, tpr, label=f"{name} (AUC {m['auc']:.3f})")
    ax.plot([1e-5, 1], [1e-5, 1], "k--", lw=0.8, label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-3, 1)
    ax.set_ylim(1e-3, 1)
    return finish(fig, ax, "false positive rate", "true positive rate", title)


def run_lira(run_dir: str | Path, client: str | int, shadows: int = 16,
             out: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """LiRA (online and offline) on one client of a finished run; writes privacy.json + ROC."""
    from fedvl.config import load_yaml
    from fedvl.run.assemble import build_federation, load_finished, served_model, trained_model
    from fedvl.run.experiment import run_experiment
    from fedvl.seeding import derive_seed

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"'{run_dir}' is not a run directory (no config.yaml)")
    dest = Path(out) if out is not None else run_dir
    dest.mkdir(parents=True, exist_ok=True)
    cfg = load_yaml(run_dir / "config.yaml")
    fed = build_federation(cfg)
    k = fed.client_index(client)
    c = fed.clients[k]
    pool_x = torch.cat([c.x_train, c.x_test])
    pool_y = torch.cat([c.y_train, c.y_test])
    is_member = np.r_[np.ones(c.num_train, dtype=int), np.zeros(len(c.y_test), dtype=int)]
    sim, algorithm = load_finished(run_dir, fed)
    target = logit_confidence(served_model(sim, algorithm, k), pool_x, pool_y)
    shared = _shared_synthetic(type(algorithm).shared_synthetic,
                               algorithm.virtual_sets(sim.state, sim.client_states), c.name)
    masks = balanced_masks(len(pool_y), shadows, derive_seed(cfg.seed, k, 7001))
    phis = []
    it = range(shadows)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"LiRA shadows ({cfg.method}, client {c.name})", unit="model")
    for s in it:
        sub = torch.from_numpy(masks[s])
        shadow_fed = replace(fed, clients=[
            replace(cl, x_train=pool_x[sub], y_train=pool_y[sub]) if i == k else cl
            for i, cl in enumerate(fed.clients)])
        # The halves depend on the number of shadows: one folder per count and target client.
        sdir = dest / "shadows" / f"{c.name}-of{shadows}" / f"shadow{s}"
        # Shadows differ from the target (and each other) in seed as well as in data.
        scfg = replace(cfg, seed=derive_seed(cfg.seed, k, 7002, s) % 2**31)
        _train_shadow(sdir, masks[s], lambda d, c=scfg, f=shadow_fed: run_experiment(
            c, out=d, fed=f, resume=(d / "checkpoint.pt").is_file()))
        phis.append(logit_confidence(trained_model(sdir, k, shadow_fed), pool_x, pool_y))
    shadow = np.stack(phis)
    fix = shadows < 64
    result: dict[str, Any] = {
        "run_dir": str(run_dir), "method": cfg.method, "benchmark": cfg.benchmark,
        "client": c.name, "shadows": shadows, "fix_variance": fix,
        "attacks": {
            "lira_online": attack_metrics(lira_scores(target, shadow, masks, True, fix),
                                          is_member),
            "lira_offline": attack_metrics(lira_scores(target, shadow, masks, False, fix),
                                           is_member),
            "confidence": attack_metrics(target, is_member),
        },
    }
    if shared is not None:
        name, syn = shared
        result["attacks"]["nearest_synthetic"] = {
            "set": name, **attack_metrics(nearest_synthetic_scores(pool_x, syn), is_member)}
    tmp = dest / f"privacy.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, dest / "privacy.json")
    from fedvl.eval.plots import save

    save(plot_roc(result["attacks"], f"{cfg.method}: client {c.name}"), dest / "privacy_roc",
         ("png", "svg"))
    return result


def _train_shadow(sdir: Path, mask: np.ndarray, train: Any) -> None:
    """Train the shadow in `sdir` on the pool half `mask`, unless it is already there.

    A folder that holds another half (another shadow count, an older layout) is wiped first,
    so a checkpoint is only ever resumed by a shadow of the same half.
    """
    f = sdir / "pool_in.npy"
    same = f.is_file() and np.array_equal(np.load(f), mask)
    if same and (sdir / "summary.json").is_file():
        return
    if not same and sdir.exists():
        shutil.rmtree(sdir)
    sdir.mkdir(parents=True, exist_ok=True)
    np.save(f, mask)
    train(sdir)


def _shared_synthetic(pattern: str | None, sets: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      client: str) -> tuple[str, torch.Tensor] | None:
    """The synthetic images distilled from client data that the run shared (None if none):
    the method's `shared_synthetic` set for this client."""
    name = pattern.format(client=client) if pattern else None
    if name is None or name not in sets:
        return None
    return name, sets[name][0].cpu()

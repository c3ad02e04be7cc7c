"""How far apart the clients are, before and after local distillation (`fedvl heterogeneity`).

For one benchmark configuration: per-client pixel histograms (FedLGD App. E.3), the client x
client MMD^2 matrix of the real training images and of each client's local virtual set (FedLGD's
claim: virtual data shrink the shift), the same on features of a model (a finished run's model
with `--run`, else a seeded random one of the run's architecture), and a t-SNE of real and
virtual features coloured by client and by class. Virtual MMDs use the real data's kernel
bandwidths so the two matrices are on one scale.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedvl.data.federated import FederatedDataset
from fedvl.eval import plots
from fedvl.eval.mmd import heterogeneity
from fedvl.progress import Sink, emit, heartbeat, reporting, scope


def pixel_histograms(fed: FederatedDataset, bins: int = 32) -> dict[str, list[list[float]]]:
    """{client: per channel, the density of its de-normalised training pixels over [0, 1]}."""
    mean = torch.tensor(fed.mean, device="cpu").view(1, -1, 1, 1)
    std = torch.tensor(fed.std, device="cpu").view(1, -1, 1, 1)
    out = {}
    for c in fed.clients:
        px = (c.x_train * std + mean).clamp(0, 1)
        out[c.name] = [np.histogram(px[:, ch].flatten().numpy(), bins=bins, range=(0, 1),
                                    density=True)[0].tolist() for ch in range(px.shape[1])]
    return out


@torch.no_grad()
def _embed(model: torch.nn.Module, x: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """The model's features (`embed`) of `x`, batched, on the CPU."""
    device = next(model.parameters()).device
    return torch.cat([model.embed(x[i:i + batch].to(device)).cpu()
                      for i in range(0, len(x), batch)])


# The parts of an analysis, in order, as a progress display names them.
PARTS = ("loading the data", "distilling the local virtual sets", "pixel MMD², real images",
         "pixel MMD², local virtual sets", "feature MMD², real images",
         "feature MMD², local virtual sets", "figures", "t-SNE")


def _part(name: str) -> Any:
    """A progress scope for one part of the analysis (announced when it begins)."""
    label = f"[{PARTS.index(name) + 1}/{len(PARTS)}] {name}"
    emit("analysis", label=label)
    return scope(phase="analysis", label=label)


def analyse(cfg: Any, out: str | Path, run_dir: str | Path | None = None, samples: int = 200,
            tsne_points: int = 150, progress: Sink | None = None) -> dict[str, Any]:
    """Write heterogeneity.json and its figures for the benchmark of `cfg` into `out`.

    `progress` receives each part as it begins and the steps inside it (`fedvl.progress`).
    """
    with reporting(progress):
        return _analyse(cfg, out, run_dir, samples, tsne_points)


def _analyse(cfg: Any, out: str | Path, run_dir: str | Path | None, samples: int,
             tsne_points: int) -> dict[str, Any]:
    from fedvl.models.base import build_model
    from fedvl.run.assemble import build_federation, trained_model, with_local_virtual_data

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with _part("loading the data"):
        fed = build_federation(cfg)
    with _part("distilling the local virtual sets"):
        virt = with_local_virtual_data(cfg, fed)
    if run_dir is not None:
        model, source = trained_model(run_dir, 0, fed), f"trained model of {run_dir}"
    else:
        c, h, _ = fed.image_shape
        model = build_model(cfg.model, c, fed.num_classes, h, seed=cfg.seed,
                            **cfg.model_args).eval()
        source = f"randomly initialised {cfg.model} (seed {cfg.seed})"
    with _part("pixel MMD², real images"):
        real_px = heterogeneity(fed, samples, cfg.seed)
    with _part("pixel MMD², local virtual sets"):
        virt_px = heterogeneity(virt, samples, cfg.seed, bandwidths=tuple(real_px["bandwidths"]))
    # Only the sampled images are embedded (the same ones the pixel analysis compares).
    embed = partial(_embed, model)
    with _part("feature MMD², real images"):
        real_ft = heterogeneity(fed, samples, cfg.seed, features=embed)
    with _part("feature MMD², local virtual sets"):
        virt_ft = heterogeneity(virt, samples, cfg.seed, features=embed,
                                bandwidths=tuple(real_ft["bandwidths"]))
    result: dict[str, Any] = {
        "benchmark": cfg.benchmark, "clients": fed.client_names,
        "train_samples": {c.name: c.num_train for c in fed.clients},
        "virtual": {"ipc": cfg.ipc, "steps": cfg.virtual_steps, "init": cfg.virtual_init},
        "feature_model": source,
        "pixels": {"real": real_px, "virtual": virt_px},
        "features": {"real": real_ft, "virtual": virt_ft},
        "histograms": pixel_histograms(fed),
    }
    with _part("figures"):
        plots.save(_histogram_figure(result["histograms"], cfg.benchmark),
                   out / "pixel_histograms", ("png", "svg"))
        for kind in ("pixels", "features"):
            fig = plots.mmd_pair(_with_floor(result[kind]["real"]),
                                 _with_floor(result[kind]["virtual"]), fed.client_names,
                                 f"MMD² of {kind}")
            plots.save(fig, out / f"mmd_{kind}", ("png", "svg"))
    with _part("t-SNE"):
        result["tsne"] = _tsne(fed, virt, model, tsne_points, cfg.seed, out)
    tmp = out / f"heterogeneity.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "heterogeneity.json")
    return result


def _with_floor(h: dict[str, Any]) -> np.ndarray:
    """The pairwise MMD^2 matrix with each client's within-client floor on the diagonal."""
    m = np.asarray(h["pairwise_mmd2"], dtype=float)
    np.fill_diagonal(m, h["within_client_mmd2"])
    return m


def _histogram_figure(hists: dict[str, list[list[float]]], title: str) -> Any:
    """One panel per channel, one line per client."""
    plt = plots.pyplot()
    channels = len(next(iter(hists.values())))
    fig, axes = plt.subplots(1, channels, figsize=(4 * channels, 3.2), squeeze=False)
    for ch in range(channels):
        ax = axes[0][ch]
        for name, h in hists.items():
            centres = (np.arange(len(h[ch])) + 0.5) / len(h[ch])
            ax.plot(centres, h[ch], label=name)
        ax.set_yscale("log")
        ax.set_xlabel("pixel value" + (f" (channel {ch})" if channels > 1 else ""))
        ax.set_ylabel("density")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_title(title)
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    return fig


def _tsne(fed: FederatedDataset, virt: FederatedDataset, model: torch.nn.Module, points: int,
          seed: int, out: Path) -> dict[str, Any]:
    """t-SNE of real (a seeded subset per client) and virtual features; writes tsne.png/svg."""
    from sklearn.manifold import TSNE

    g = torch.Generator().manual_seed(seed)
    feats, client, label, virtual = [], [], [], []
    for i, (c, v) in enumerate(zip(fed.clients, virt.clients, strict=True)):
        idx = torch.randperm(c.num_train, generator=g, device=g.device)[:points]
        for x, y, is_v in ((c.x_train[idx], c.y_train[idx], False),
                           (v.x_train, v.y_train, True)):
            feats.append(_embed(model, x))
            client += [i] * len(y)
            label += y.tolist()
            virtual += [is_v] * len(y)
    z = torch.cat(feats).double().numpy()
    with heartbeat():   # scikit-learn's fit reports nothing: say it is still running
        emb = TSNE(n_components=2, init="pca", random_state=seed,
                   perplexity=float(min(30, len(z) - 1))).fit_transform(z)
    fig = plots.tsne_scatter(emb, np.array(client), np.array(label), np.array(virtual),
                             fed.client_names)
    plots.save(fig, out / "tsne", ("png", "svg"))
    return {"points_per_client": points, "total": int(len(z)),
            "virtual": int(np.sum(virtual))}

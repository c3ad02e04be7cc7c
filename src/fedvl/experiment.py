"""Config -> federation + model + algorithm + engine -> run directory with results."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fedvl import __version__
from fedvl.algorithms.base import Algorithm, Env, make_algorithm
from fedvl.config import ConfigError, RunConfig, load_yaml, resolve_model_args, validate
from fedvl.core.training import TrainConfig
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.sources import DataOptions
from fedvl.distill.federated import VirtualSetSpec, client_virtual_set
from fedvl.engine.allocator import keep_freed_memory
from fedvl.engine.recorder import RunRecorder, discard_failed_start, read_metrics
from fedvl.engine.simulation import Simulation, SimulationConfig
from fedvl.engine.threads import default_workers, resolve_threads, torch_threads
from fedvl.engine.workers import ClientPool
from fedvl.models.base import build_model, client_architectures, model_options
from fedvl.options import printable, shown
from fedvl.progress import RoundBar, Sink, reporting, scope
from fedvl.registry import BENCHMARKS
from fedvl.seeding import derive_seed


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but no CUDA device is available")
    return torch.device(name)


def build_federation(cfg: RunConfig) -> FederatedDataset:
    """Load the configured benchmark."""
    factory = BENCHMARKS.get(cfg.benchmark)
    return factory(DataOptions(seed=cfg.seed, data_dir=cfg.data_dir, domains=cfg.domains,
                               dataset=cfg.dataset, train_cap=cfg.train_cap, test_cap=cfg.test_cap,
                               num_clients=cfg.num_clients, alpha=cfg.alpha,
                               image_size=cfg.image_size, severity=cfg.severity,
                               corruptions=cfg.corruptions, partitions=cfg.partitions,
                               partition=cfg.partition, shards_per_client=cfg.shards_per_client,
                               dominant_share=cfg.dominant_share))


def virtual_spec(cfg: RunConfig) -> VirtualSetSpec:
    """The run's local-virtual-data settings (`--ipc`, `--virtual-steps`, ...)."""
    return VirtualSetSpec(ipc=cfg.ipc, steps=cfg.virtual_steps, init=cfg.virtual_init,
                          batch_real=cfg.virtual_batch_real)


def with_client_virtual_data(cfg: RunConfig, client: ClientData, index: int, num_classes: int,
                             device: torch.device | str = "cpu") -> ClientData:
    """One client with its training set replaced by its local virtual set (raw data kept).

    The raw data stay with the client (`x_real`) for methods that keep distilling from it
    (FedLGD); every other method only ever sees the virtual set.
    """
    c, h, _ = (int(v) for v in client.x_train.shape[1:])
    cfg = resolve_model_args(cfg)

    def random_model(seed: int) -> torch.nn.Module:
        return build_model(cfg.model, c, num_classes, h, seed=seed, **cfg.model_args)

    syn = client_virtual_set(client.x_train.to(device), client.y_train.to(device), num_classes,
                             random_model, virtual_spec(cfg), cfg.seed, index)
    x, y = syn.tensors()
    return replace(client, x_train=x, y_train=y, x_real=client.x_train, y_real=client.y_train)


def with_local_virtual_data(cfg: RunConfig, fed: FederatedDataset,
                            device: torch.device | str = "cpu") -> FederatedDataset:
    """Every client with its distilled local virtual set (`with_client_virtual_data`).

    Clients distil on `cfg.workers` threads, one torch thread each, as they would inside a
    round, so the sets are the same whichever path distils them first.
    """
    pool = ClientPool(cfg.workers or 1)
    n = len(fed.clients)

    def distil(k: int) -> ClientData:
        # Progress events of this client's distillation name it (`fedvl.progress`).
        with scope(phase="distill", client=fed.client_names[k], client_id=k, num_clients=n):
            return with_client_virtual_data(cfg, fed.clients[k], k, fed.num_classes, device)
    try:
        done = pool.map(distil, range(n))
    finally:
        pool.close()
    clients = [done[k] for k in range(len(fed.clients))]
    info = {**fed.info, "local_data": "virtual", "ipc": cfg.ipc,
            "virtual_steps": cfg.virtual_steps}
    return replace(fed, clients=clients, info=info)


# The stream of the run seed that initialises the model (`model_seed`).
MODEL_STREAM = 3


def model_seed(run_seed: int) -> int:
    """The seed of a run's initial model weights."""
    return derive_seed(run_seed, MODEL_STREAM)


def build_env(cfg: RunConfig, fed: FederatedDataset, device: torch.device) -> Env:
    """The algorithm's view of the run: model factory, label space, optimiser settings."""
    c, h, _ = fed.image_shape
    cfg = resolve_model_args(cfg)
    init_seed = model_seed(cfg.seed)
    archs = client_architectures(cfg.model, cfg.client_models, len(fed.clients))
    run_model, run_args = cfg.model, dict(cfg.model_args)
    if cfg.client_models is not None and len(set(archs)) == 1:
        # `--client-models alexnet`: one architecture for everyone, the run's model too.
        run_model, run_args = archs[0], model_options(archs[0], cfg.model_args)
    # Fail now (not inside round 1) when model options are wrong.
    _check_model(run_model, c, fed.num_classes, h, init_seed, run_args)
    for name in sorted(set(archs) - {run_model}):
        _check_model(name, c, fed.num_classes, h, init_seed,
                     model_options(name, cfg.model_args))

    def model_fn(num_classes: int | None = None, seed: int | None = None) -> torch.nn.Module:
        # Methods with extra (virtual) classes ask for a wider classifier; the trunk's init
        # is unchanged because the classifier is built last. `seed` gives another random
        # network of the same architecture (distillation with random extractors).
        return build_model(run_model, c, num_classes or fed.num_classes, h,
                           seed=init_seed if seed is None else seed, **run_args)

    def client_model_fn(cid: int, num_classes: int | None = None, seed: int | None = None
                        ) -> torch.nn.Module:
        name = archs[cid]
        if name == run_model:
            return model_fn(num_classes, seed)
        return build_model(name, c, num_classes or fed.num_classes, h,
                           seed=init_seed if seed is None else seed,
                           **model_options(name, cfg.model_args))

    public_fn = None
    if cfg.public is not None:
        cache: list[torch.Tensor] = []

        def public_fn() -> torch.Tensor:
            if not cache:
                cache.append(build_public(cfg, fed.image_shape))
            return cache[0]

    train = TrainConfig(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                        local_epochs=cfg.local_epochs, local_steps=cfg.local_steps,
                        batch_size=cfg.batch_size, lr_decay=cfg.lr_decay,
                        autocast=cfg.autocast)
    return Env(model_fn=model_fn, num_classes=fed.num_classes, num_clients=len(fed.clients),
               train=train, seed=cfg.seed, device=device, client_names=fed.client_names,
               image_shape=fed.image_shape, aggregation=cfg.aggregation, trim=cfg.trim,
               client_models=archs, client_model_fn=client_model_fn, public_fn=public_fn)


def round_config(cfg: RunConfig) -> SimulationConfig:
    """The round loop's settings of a run (the same on every transport)."""
    return SimulationConfig(cfg.rounds, cfg.client_ratio, cfg.eval_every, cfg.seed,
                            min_replies=cfg.min_replies)


def _check_model(name: str, channels: int, num_classes: int, size: int, seed: int,
                 args: dict[str, Any]) -> None:
    """Build one model as the run will, turning a failure into an error naming what was asked.

    Options can be valid alone and impossible together: a ConvNet of depth 3 pools 28 px
    images down to 3 px, but 4 px images to nothing; a width of 10^6 cannot be allocated.
    """
    try:
        build_model(name, channels, num_classes, size, seed=seed, **args)
    except (RuntimeError, TypeError, OverflowError, MemoryError) as e:
        why = printable(" ".join(str(e).split()))[:200] or type(e).__name__
        raise ValueError(f"model '{name}' with options {shown(args, 200)} cannot be built for "
                         f"{channels} x {size} x {size} images: {why}") from e


# Stream id of the public subset's draw.
PUBLIC_STREAM = 101


def build_public(cfg: RunConfig, image_shape: tuple[int, int, int]) -> torch.Tensor:
    """The unlabelled public set: `public_size` training images of benchmark `cfg.public`
    (every client's, drawn with the run seed), resized to the run's image shape."""
    assert cfg.public is not None
    src = BENCHMARKS.get(cfg.public)(DataOptions(seed=cfg.seed, data_dir=cfg.data_dir,
                                                 dataset=cfg.dataset,
                                                 num_clients=cfg.num_clients, alpha=cfg.alpha))
    x = torch.cat([c.x_train for c in src.clients])
    g = torch.Generator().manual_seed(derive_seed(cfg.seed, PUBLIC_STREAM))
    x = x[torch.randperm(len(x), generator=g)[: cfg.public_size]]
    c, h, w = image_shape
    if x.shape[1] != c:
        if x.shape[1] == 1:
            x = x.expand(-1, c, -1, -1)
        else:
            x = x.mean(1, keepdim=True).expand(-1, c, -1, -1)
    if tuple(x.shape[2:]) != (h, w):
        x = torch.nn.functional.interpolate(x, size=(h, w), mode="bilinear",
                                            align_corners=False)
    return x.contiguous()


def default_run_dir(cfg: RunConfig) -> Path:
    """runs/<method>-<benchmark>-s<seed>-<timestamp>."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.method}-{cfg.benchmark}-s{cfg.seed}-{stamp}"


def run_experiment(
    cfg: RunConfig,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool | Sink = False,
    fed: FederatedDataset | None = None,
) -> dict[str, Any]:
    """Run one configured experiment end to end and write its run directory.

    `progress`: True shows a progress bar on stderr; a callable receives every progress event
    (`fedvl.progress`: dicts with `phase`, `round`, `client`, `step`, `total`, ...), possibly
    from several threads but never two at once. Neither changes any number of the run.
    """
    keep_freed_memory()
    cfg = resolved(cfg)
    # Decided once: the default name has a timestamp, and the cleanup must see the same path.
    run_dir = Path(out) if out is not None else default_run_dir(cfg)
    with torch_threads(cfg.threads), discard_failed_start(run_dir):
        return _run_embedded(cfg, run_dir, resume, progress, fed)


def resolved(cfg: RunConfig) -> RunConfig:
    """`cfg` validated, with every model option and the thread count filled in.

    The recorded config names the model options the run used (the method's preferences too).
    """
    validate(cfg)
    return replace(resolve_model_args(cfg), threads=resolve_threads(cfg.threads),
                   workers=cfg.workers or default_workers(cfg.device))


def check_experiment(cfg: RunConfig, fed: FederatedDataset | None = None) -> FederatedDataset:
    """Everything a start checks (config, device, data, models, method options); writes nothing.

    The local virtual sets of `--local-data virtual` are not distilled: their options are
    checked with the config, and distilling is the start of the work, not a check.
    """
    cfg = resolved(cfg)
    with torch_threads(cfg.threads):
        device = resolve_device(cfg.device)
        fed = fed if fed is not None else build_federation(cfg)
        make_algorithm(cfg.method, build_env(cfg, fed, device), cfg.method_args)
    return fed


def _simulation(cfg: RunConfig, fed: FederatedDataset | None, run_dir: Path
                ) -> tuple[Simulation, Algorithm, FederatedDataset, torch.device]:
    """The in-process simulation of `cfg` writing to `run_dir` (and its algorithm and data)."""
    device = resolve_device(cfg.device)
    fed = fed if fed is not None else build_federation(cfg)
    if cfg.local_data == "virtual" and not fed.info.get("local_data") == "virtual":
        fed = with_local_virtual_data(cfg, fed, device)
    env = build_env(cfg, fed, device)
    algorithm = make_algorithm(cfg.method, env, cfg.method_args)
    sim = Simulation(algorithm, fed, round_config(cfg), run_dir=run_dir, device=device,
                     workers=cfg.workers or default_workers(device), stack=cfg.stack_clients,
                     upload_guard=cfg.upload_guard)
    return sim, algorithm, fed, device


def load_finished(run_dir: str | Path, fed: FederatedDataset | None = None
                  ) -> tuple[Simulation, Algorithm]:
    """A finished in-process run rebuilt from its config and restored from its checkpoint."""
    run_dir = Path(run_dir)
    cfg = load_yaml(run_dir / "config.yaml")
    with torch_threads(resolve_threads(cfg.threads)):
        sim, algorithm, _, _ = _simulation(cfg, fed, run_dir)
        try:
            loaded = sim.load_checkpoint()
        except KeyError as e:
            if e.args != ("client_states",):
                raise
            # Flower nodes keep their client state on their own disks, not in the checkpoint.
            raise ValueError(f"'{run_dir}' was not run by the in-process engine (its checkpoint "
                             "holds no client states); rerun it with `fedvl run` to attack it"
                             ) from e
        if not loaded:
            raise FileNotFoundError(f"'{run_dir}' has no checkpoint.pt to load the model from")
    return sim, algorithm


def served_model(sim: Simulation, algorithm: Algorithm, client: int) -> torch.nn.Module:
    """The model a restored run serves `client` with: the global model, or its own model."""
    model = algorithm.global_model(sim.state)
    if model is None:
        model = algorithm.client_model(sim.context(client, sim.start_round - 1))
    return model.eval()


def trained_model(run_dir: str | Path, client: int, fed: FederatedDataset | None = None
                  ) -> torch.nn.Module:
    """The model a finished run serves `client` with: the global model, or its own model."""
    return served_model(*load_finished(run_dir, fed), client)


def _run_embedded(cfg: RunConfig, out: str | Path | None, resume: bool, progress: bool | Sink,
                  fed: FederatedDataset | None) -> dict[str, Any]:
    run_dir = Path(out) if out is not None else default_run_dir(cfg)
    bar = RoundBar(cfg.rounds, f"{cfg.method} on {cfg.benchmark}") if progress is True else None
    sink = bar if bar is not None else (progress if callable(progress) else None)
    try:
        # Distilling local virtual data (`--local-data virtual`) is before round 0: reported too.
        with reporting(sink):
            sim, algorithm, fed, device = _simulation(cfg, fed, run_dir)
            recorder = sim.recorder
            assert recorder is not None
            if not resume:
                recorder.write_config(cfg)
            result = sim.run(resume=resume)
    finally:
        if bar is not None:
            bar.close()
    sets = algorithm.virtual_sets(sim.state, sim.client_states)
    if fed.info.get("local_data") == "virtual" and not sets:
        sets = {f"local_virtual_{c.name}": (c.x_train, c.y_train) for c in fed.clients}
    images = recorder.save_images(sets, fed.num_classes, fed.mean, fed.std)
    summary = {
        **summary_head(cfg, fed.client_names, {c.name: c.num_train for c in fed.clients},
                       fed.info, device, run_dir, images),
        **result,
        **algorithm.report(sim.state),
    }
    recorder.write_summary(summary)
    return summary


def summary_head(cfg: RunConfig, clients: list[str], train_samples: dict[str, int],
                 dataset_info: dict[str, Any], device: torch.device, run_dir: Path,
                 images: list[str]) -> dict[str, Any]:
    """The keys every summary.json starts with (both engines), before the run's results."""
    return {
        "method": cfg.method,
        "benchmark": cfg.benchmark,
        "seed": cfg.seed,
        "rounds": cfg.rounds,
        "model": cfg.model,
        "model_args": resolve_model_args(cfg).model_args,
        "method_args": cfg.method_args,
        "clients": clients,
        "train_samples": train_samples,
        "dataset_info": {k: v for k, v in dataset_info.items() if _jsonable(v)},
        "device": str(device),
        "threads": cfg.threads,
        "workers": cfg.workers,
        "upload_guard": cfg.upload_guard,
        "fedvl_version": __version__,
        "run_dir": str(run_dir),
        "images": images,
    }


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
    if rounds is not None and rounds != cfg.rounds:
        done = len(read_metrics(run_dir))
        if rounds < max(done, 1):
            raise ConfigError(f"--rounds {rounds} is fewer than the {done} rounds '{run_dir}' "
                              f"has run; allowed with --resume: {max(done, 1)} or more")
        cfg = validate(replace(cfg, rounds=rounds))
        # The directory now records the rounds it runs to: a later --resume continues to them.
        RunRecorder(run_dir).write_config(cfg)
    return run_experiment(cfg, out=run_dir, resume=True, progress=progress)


def with_overrides(cfg: RunConfig, **kw: Any) -> RunConfig:
    """Copy of `cfg` with fields replaced."""
    return replace(cfg, **kw)


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False

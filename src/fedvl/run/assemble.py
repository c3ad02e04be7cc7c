"""A run config -> what the run is made of: federation, models, method, round loop, engine.

Every transport builds its run from these functions (the in-process engine here, a Flower
ServerApp and its nodes in `fedvl.flower`), and `fedvl.eval` restores finished runs with them,
so equal configs give equal runs wherever they are built. The settings objects of the layers
below (`DataOptions`, `TrainConfig`, `RoundConfig`, `VirtualSetSpec`) are filled from the
config's sections by field name (`_built`): an option declared in its section reaches the layer
that reads it without being copied here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from fedvl import __version__
from fedvl.algorithms.base import Algorithm, Env, make_algorithm
from fedvl.config import RunConfig, load_yaml, resolve_model_args
from fedvl.core.training import TrainConfig
from fedvl.data.federated import ClientData, FederatedDataset
from fedvl.data.sources import DataOptions
from fedvl.data.transforms import stratified_subset
from fedvl.distill.client_sets import VirtualSetSpec, client_virtual_set
from fedvl.engine.driver import RoundConfig
from fedvl.engine.simulation import Simulation
from fedvl.engine.threads import default_workers, resolve_threads, torch_threads
from fedvl.engine.workers import ClientPool
from fedvl.models.base import build_model, client_architectures, model_options
from fedvl.options import printable, shown
from fedvl.progress import scope
from fedvl.registry import BENCHMARKS
from fedvl.seeding import derive_seed

T = TypeVar("T")


def _built(cls: type[T], *sections: Any, prefix: str = "", keep: tuple[str, ...] = (),
           **extra: Any) -> T:
    """A `cls` whose fields are taken by name from `extra`, then from the config `sections`
    (where field `steps` may be spelled `<prefix>steps`); fields named in `keep` that none of
    them has keep their defaults.

    Any other field found nowhere is an error: an option renamed on one side must not fall back
    to a default unnoticed.
    """
    given = {f.name: getattr(s, f.name) for s in sections for f in dataclasses.fields(s)}
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in extra:
            values[f.name] = extra[f.name]
        elif f.name in given:
            values[f.name] = given[f.name]
        elif prefix + f.name in given:
            values[f.name] = given[prefix + f.name]
        elif f.name not in keep:
            raise TypeError(f"{cls.__name__}.{f.name} matches no option of the run config")
    return cls(**values)


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but no CUDA device is available")
    return torch.device(name)


# -- deterministic kernels (`--deterministic`) -----------------------------------------------
# cuBLAS is deterministic on CUDA >= 10.2 only with a fixed workspace (torch's reproducibility
# notes): ":4096:8" (8 buffers of 4096 KiB) is one of the two settings torch accepts, ":16:8"
# the other, smaller one. Torch reads it at the process's first cuBLAS call, so a run sets it
# before its first CUDA work.
CUBLAS_WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"


@dataclass(frozen=True)
class Determinism:
    """The process-wide torch settings `--deterministic` changes (to restore them after)."""

    algorithms: bool
    warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    cublas_workspace: str | None


def determinism() -> Determinism:
    """This process's current determinism settings."""
    return Determinism(torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled(),
                       bool(torch.backends.cudnn.deterministic),
                       bool(torch.backends.cudnn.benchmark),
                       os.environ.get(CUBLAS_WORKSPACE_CONFIG))


def use_determinism(state: Determinism) -> None:
    """Put this process's determinism settings to `state`."""
    torch.use_deterministic_algorithms(state.algorithms, warn_only=state.warn_only)
    torch.backends.cudnn.deterministic = state.cudnn_deterministic
    torch.backends.cudnn.benchmark = state.cudnn_benchmark
    if state.cublas_workspace is None:
        os.environ.pop(CUBLAS_WORKSPACE_CONFIG, None)
    else:
        os.environ[CUBLAS_WORKSPACE_CONFIG] = state.cublas_workspace


def deterministic_settings(before: Determinism) -> Determinism:
    """`before` with every setting `--deterministic` needs (a workspace already set is kept)."""
    # Errors, not warnings: a run asked to be repeatable must not quietly run a kernel that is
    # not (torch's rule for ops without a deterministic implementation).
    return Determinism(True, False, True, False,
                       before.cublas_workspace if before.cublas_workspace else CUBLAS_WORKSPACE)


@contextmanager
def deterministic_mode(on: bool) -> Iterator[None]:
    """Deterministic torch kernels inside the block when `on`; the previous settings after.

    The settings are process-wide (every thread of the run sees them); with `on` False nothing
    is touched, so a caller's own settings stay in force.
    """
    if not on:
        yield
        return
    before = determinism()
    use_determinism(deterministic_settings(before))
    try:
        yield
    finally:
        use_determinism(before)


# -- data ------------------------------------------------------------------------------------
def data_options(cfg: RunConfig, **changes: Any) -> DataOptions:
    """The benchmark options of a run: its data section and its seed, with `changes` (e.g. a
    Flower node's `only_client`)."""
    return _built(DataOptions, cfg.data, seed=cfg.seed, keep=("only_client",), **changes)


# Stream id of the draw of the held-out clients (`--holdout-clients`).
HOLDOUT_STREAM = 41


def build_federation(cfg: RunConfig) -> FederatedDataset:
    """Load the configured benchmark, its `--holdout-clients` set apart from the training ones."""
    return hold_out(BENCHMARKS.get(cfg.data.benchmark)(data_options(cfg)),
                    cfg.data.holdout_clients)


def hold_out(fed: FederatedDataset, k: int) -> FederatedDataset:
    """`fed` with `k` clients, drawn from their count alone, moved from training to `holdout`.

    The draw does not depend on the run seed, so every seed and method of a comparison holds
    out the same clients (and `fedvl bench` can average them); the others keep their order and
    names, so client i of the run is the i-th kept one.
    """
    if k == 0:
        return fed
    n = len(fed.clients)
    if k >= n:
        raise ValueError(f"--holdout-clients {k} leaves no client to train: benchmark "
                         f"'{fed.name}' has {n} clients here; allowed: 0 to {n - 1}")
    g = torch.Generator().manual_seed(derive_seed(HOLDOUT_STREAM, n, k))
    held = set(torch.randperm(n, generator=g, device=g.device)[:k].tolist())
    return replace(fed, clients=[c for i, c in enumerate(fed.clients) if i not in held],
                   holdout=[c for i, c in enumerate(fed.clients) if i in held],
                   info={**fed.info, "holdout_clients": [fed.clients[i].name
                                                         for i in sorted(held)]})


# Stream id of the validation rows carved from each client's training set (`fedvl tune`).
VALIDATION_STREAM = 43


def validation_rows(y: torch.Tensor, fraction: float, seed: int, client: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, validation rows) of one client's training labels `y`: a class-stratified
    random `fraction` of them (at least one row, never all), drawn with (seed, client)."""
    n = int(y.shape[0])
    want = min(max(1, round(fraction * n)), n - 1)
    if want < 1:
        raise ValueError(f"a client with {n} training image(s) cannot give a validation row "
                         "and keep one to train on; allowed: clients of 2 or more images "
                         "(raise --train-cap)")
    rng = np.random.default_rng(derive_seed(seed, VALIDATION_STREAM, client))
    val = stratified_subset(y.cpu().numpy(), want, rng)
    keep = np.setdiff1d(np.arange(n), val)
    return torch.from_numpy(keep), torch.from_numpy(val)


def split_validation(fed: FederatedDataset, fraction: float, seed: int) -> FederatedDataset:
    """`fed` for a hyperparameter search: each client trains on its training set less a
    validation `fraction`, and is scored on those validation rows in place of its test set.

    No test image stays in the result (the clients' test sets, the global test set and the
    held-out clients are dropped), so a run on it can neither train nor score on test data.
    """
    clients = []
    rows: dict[str, int] = {}
    for k, c in enumerate(fed.clients):
        keep, val = validation_rows(c.y_train, fraction, seed, k)
        clients.append(replace(c, x_train=c.x_train[keep], y_train=c.y_train[keep],
                               x_test=c.x_train[val], y_test=c.y_train[val]))
        rows[c.name] = int(val.shape[0])
    info = {k: v for k, v in fed.info.items() if k != "holdout_clients"}
    return replace(fed, clients=clients, global_test=None, holdout=[],
                   info={**info, "validation_fraction": fraction, "validation_rows": rows})


def virtual_spec(cfg: RunConfig) -> VirtualSetSpec:
    """The run's local-virtual-data settings (`--ipc`, `--virtual-steps`, ...)."""
    # The distillation's own constants are not run options.
    return _built(VirtualSetSpec, cfg.virtual, prefix="virtual_",
                  keep=("lr_img", "dsa", "min_count"))


def with_client_virtual_data(cfg: RunConfig, client: ClientData, index: int, num_classes: int,
                             device: torch.device | str = "cpu") -> ClientData:
    """One client with its training set replaced by its local virtual set (raw data kept).

    The raw data stay with the client (`x_real`) for methods that keep distilling from it
    (FedLGD); every other method only ever sees the virtual set.
    """
    c, h, _ = (int(v) for v in client.x_train.shape[1:])
    models = resolve_model_args(cfg).models

    def random_model(seed: int) -> torch.nn.Module:
        return build_model(models.model, c, num_classes, h, seed=seed, **models.model_args)

    syn = client_virtual_set(client.x_train.to(device), client.y_train.to(device), num_classes,
                             random_model, virtual_spec(cfg), cfg.seed, index)
    x, y = syn.tensors()
    return replace(client, x_train=x, y_train=y, x_real=client.x_train, y_real=client.y_train)


def with_local_virtual_data(cfg: RunConfig, fed: FederatedDataset,
                            device: torch.device | str = "cpu") -> FederatedDataset:
    """Every client with its distilled local virtual set (`with_client_virtual_data`).

    Clients distil on `cfg.engine.workers` threads, one torch thread each, as they would inside
    a round, so the sets are the same whichever path distils them first.
    """
    pool = ClientPool(cfg.engine.workers or 1)
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
    info = {**fed.info, "local_data": "virtual", "ipc": cfg.virtual.ipc,
            "virtual_steps": cfg.virtual.virtual_steps}
    return replace(fed, clients=clients, info=info)


# Stream id of the public subset's draw.
PUBLIC_STREAM = 101


def build_public(cfg: RunConfig, image_shape: tuple[int, int, int]) -> torch.Tensor:
    """The unlabelled public set: `public_size` training images of benchmark `cfg.data.public`
    (every client's, drawn with the run seed), resized to the run's image shape."""
    data = cfg.data
    assert data.public is not None
    # Another benchmark: only the options that locate and split it, none of the run's caps.
    src = BENCHMARKS.get(data.public)(DataOptions(seed=cfg.seed, data_dir=data.data_dir,
                                                  dataset=data.dataset,
                                                  num_clients=data.num_clients,
                                                  alpha=data.alpha))
    x = torch.cat([c.x_train for c in src.clients])
    g = torch.Generator().manual_seed(derive_seed(cfg.seed, PUBLIC_STREAM))
    x = x[torch.randperm(len(x), generator=g, device=g.device)[: data.public_size]]
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


# -- models and method -----------------------------------------------------------------------
@dataclass(frozen=True)
class FederationShape:
    """The public shape of a federation, without any client data: what a Flower server learns
    from its nodes, and all that building the models and the method needs."""

    num_classes: int
    image_shape: tuple[int, int, int]
    client_names: list[str]
    # The benchmark's normalisation (for image grids); empty when the nodes did not say.
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()


# The stream of the run seed that initialises the model (`model_seed`).
MODEL_STREAM = 3


def model_seed(run_seed: int) -> int:
    """The seed of a run's initial model weights."""
    return derive_seed(run_seed, MODEL_STREAM)


def train_config(cfg: RunConfig) -> TrainConfig:
    """The clients' optimiser settings: the run's training section (clients train with SGD,
    unclipped; only a server names another optimiser, only a method's option sets a clip)."""
    return _built(TrainConfig, cfg.training, keep=("optimizer", "max_grad_norm"))


def build_env(cfg: RunConfig, fed: FederatedDataset | FederationShape,
              device: torch.device) -> Env:
    """The algorithm's view of the run: model factory, label space, optimiser settings."""
    c, h, _ = fed.image_shape
    cfg = resolve_model_args(cfg)
    models = cfg.models
    init_seed = model_seed(cfg.seed)
    archs = client_architectures(models.model, models.client_models, len(fed.client_names))
    run_model, run_args = models.model, dict(models.model_args)
    if models.client_models is not None and len(set(archs)) == 1:
        # `--client-models alexnet`: one architecture for everyone, the run's model too.
        run_model, run_args = archs[0], model_options(archs[0], models.model_args)
    # Fail now (not inside round 1) when model options are wrong.
    _check_model(run_model, c, fed.num_classes, h, init_seed, run_args)
    for name in sorted(set(archs) - {run_model}):
        _check_model(name, c, fed.num_classes, h, init_seed,
                     model_options(name, models.model_args))

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
                           **model_options(name, models.model_args))

    public_fn = None
    if cfg.data.public is not None:
        cache: list[torch.Tensor] = []

        def public_fn() -> torch.Tensor:
            if not cache:
                cache.append(build_public(cfg, fed.image_shape))
            return cache[0]

    return Env(model_fn=model_fn, num_classes=fed.num_classes,
               num_clients=len(fed.client_names), train=train_config(cfg), seed=cfg.seed,
               device=device, client_names=fed.client_names, image_shape=fed.image_shape,
               aggregation=cfg.loop.aggregation, trim=cfg.loop.trim, client_models=archs,
               client_model_fn=client_model_fn, public_fn=public_fn,
               image_mean=tuple(fed.mean), image_std=tuple(fed.std))


def build_method(cfg: RunConfig, fed: FederatedDataset | FederationShape,
                 device: torch.device) -> Algorithm:
    """The configured method with its options, built for the federation's shape."""
    return make_algorithm(cfg.method, build_env(cfg, fed, device), cfg.method_args)


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


# -- round loop and engine -------------------------------------------------------------------
def round_config(cfg: RunConfig) -> RoundConfig:
    """The round loop's settings of a run (the same on every transport)."""
    return _built(RoundConfig, cfg.loop, seed=cfg.seed)


def default_run_dir(cfg: RunConfig) -> Path:
    """runs/<method>-<benchmark>-s<seed>-<timestamp>."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.method}-{cfg.data.benchmark}-s{cfg.seed}-{stamp}"


def simulation(cfg: RunConfig, fed: FederatedDataset | None, run_dir: Path
               ) -> tuple[Simulation, Algorithm, FederatedDataset, torch.device]:
    """The in-process simulation of `cfg` writing to `run_dir` (and its algorithm and data)."""
    device = resolve_device(cfg.engine.device)
    fed = fed if fed is not None else build_federation(cfg)
    if cfg.virtual.local_data == "virtual" and not fed.info.get("local_data") == "virtual":
        fed = with_local_virtual_data(cfg, fed, device)
    algorithm = build_method(cfg, fed, device)
    sim = Simulation(algorithm, fed, round_config(cfg), run_dir=run_dir, device=device,
                     workers=cfg.engine.workers or default_workers(device),
                     stack=cfg.engine.stack_clients, upload_guard=cfg.privacy.upload_guard)
    return sim, algorithm, fed, device


# -- finished runs ---------------------------------------------------------------------------
def load_finished(run_dir: str | Path, fed: FederatedDataset | None = None
                  ) -> tuple[Simulation, Algorithm]:
    """A finished in-process run rebuilt from its config and restored from its checkpoint."""
    run_dir = Path(run_dir)
    cfg = load_yaml(run_dir / "config.yaml")
    with torch_threads(resolve_threads(cfg.engine.threads)):
        sim, algorithm, _, _ = simulation(cfg, fed, run_dir)
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
    elif algorithm.local_layers:
        model = algorithm.personalise(model, sim.context(client, sim.start_round - 1))
    return model.eval()


def trained_model(run_dir: str | Path, client: int, fed: FederatedDataset | None = None
                  ) -> torch.nn.Module:
    """The model a finished run serves `client` with: the global model, or its own model."""
    return served_model(*load_finished(run_dir, fed), client)


def summary_head(cfg: RunConfig, clients: list[str], train_samples: dict[str, int],
                 dataset_info: dict[str, Any], device: torch.device, run_dir: Path,
                 images: list[str]) -> dict[str, Any]:
    """The keys every summary.json starts with (both engines), before the run's results."""
    return {
        "method": cfg.method,
        "benchmark": cfg.data.benchmark,
        "seed": cfg.seed,
        "rounds": cfg.loop.rounds,
        "model": cfg.models.model,
        "model_args": resolve_model_args(cfg).models.model_args,
        "method_args": cfg.method_args,
        "clients": clients,
        "train_samples": train_samples,
        "dataset_info": {k: v for k, v in dataset_info.items() if _jsonable(v)},
        "device": str(device),
        "threads": cfg.engine.threads,
        "workers": cfg.engine.workers,
        "upload_guard": cfg.privacy.upload_guard,
        "fedvl_version": __version__,
        "run_dir": str(run_dir),
        "images": images,
    }


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False

"""`fedvl perf --distill`: every synthesis objective's FLOPs, speed and share of the matmul rate.

Each objective is built as its method builds it (the method's default options, one client of
the benchmark, the run's model) and stepped through `synthesize`, the loop every method uses,
on the threads a client gets (one on the CPU). FLOPs are counted over one step with a dispatch
mode over torch's FLOP formulas (convolutions and matrix products, forward and backward, the
same formulas as `FlopCounterMode`, whose module hooks do not run under `autograd.grad`); the
step's time is the median over timed blocks after a warm-up; the matmul rate is timed in the
same run on the same threads (`fedvl.perf.flops.matmul_rate`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from fedvl.devices import module_to
from fedvl.perf.flops import matmul_rate

OBJECTIVES = ("dm", "dm-fixed", "kernel-latent", "embed-logit", "dp-embed-logit", "gradient",
              "target-gradient", "vhl-generator")
WHAT = {
    "dm": "DM on a fresh random ConvNet per step, DSA (FedLGD warm-up, DESA anchors, "
          "fedvl distill)",
    "dm-fixed": "DM on the received global model, DSA (FedLGD local refresh)",
    "kernel-latent": "kernel MMD with the latent constraint, BatchNorm, importance-weighted "
                     "real draws (FedVCK)",
    "embed-logit": "embedding + logit matching in the rho-ball (FedDM)",
    "dp-embed-logit": "the same under DP-SGD on the synthetic images: per-sample clipped image "
                      "gradients, noise init, sigma 1 (DP-FedDM)",
    "gradient": "per-class CE gradient matching on a random ConvNet, DSA (DC style)",
    "target-gradient": "gradient matching to the model update (FedLGD server)",
    "vhl-generator": "VHL's virtual data from the untrained style generator (one call = the "
                     "whole virtual set)",
}


# Ops whose result the host must wait for: a scalar read (`.item()`, `float(t)`, `bool(t)`)
# or an output whose size depends on the data.
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique",
                      "_unique2", "unique_dim", "unique_consecutive", "is_nonzero", "equal",
                      # CUDA kernels that read a size back inside (out of this mode's sight):
                      # bincount its input's maximum.
                      "bincount"})


def _storage(t: torch.Tensor) -> int:
    """The address of a tensor's storage (0 for an empty one)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


class FlopCount(TorchDispatchMode):
    """Counts the FLOPs (torch's formulas), the aten ops and the host syncs run inside it.

    A sync is a scalar read or a data-sized output (`SYNC_OPS`) of a tensor that lives on the
    run's device. On a GPU that is any CUDA tensor; on the CPU, where host and device are one,
    the device's tensors are found by following `device_tensors` (the data, the synthetic set,
    the models) through every op: an op with one of them among its inputs gives device tensors,
    an op with none gives host tensors (random draws on the CPU generator, index arithmetic on
    host copies), which a GPU would compute without waiting. So the count on a CPU is the count
    a GPU would see.
    """

    def __init__(self, device_tensors: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.total = 0
        self.ops = 0
        self.syncs = 0
        self.sync_names: dict[str, int] = {}
        self.track = device_tensors is not None
        self.on_device = {p for p in map(_storage, device_tensors or []) if p}

    def _device(self, tensors: list[torch.Tensor]) -> bool:
        if not self.track:
            return any(t.device.type != "cpu" for t in tensors)
        return any(_storage(t) in self.on_device for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device = self._device(inputs)
        name = func._overloadpacket.__name__
        # Indexing with a boolean mask finds the mask's true entries (a nonzero) below the
        # dispatcher, out of sight of this mode.
        masked = name in MASK_INDEX_OPS and any(t.dtype in (torch.bool, torch.uint8)
                                                for t in inputs[1:])
        # repeat_interleave with a tensor of repeats and no output_size sums them on the host.
        masked = masked or (name == "repeat_interleave" and kwargs.get("output_size") is None
                            and func._overloadname in ("Tensor", "self_Tensor"))
        if (name in SYNC_OPS or masked) and device:
            self.syncs += 1
            self.sync_names[name] = self.sync_names.get(name, 0) + 1
        if self.track:
            # Freed storage is reused: an output's address is device-tainted only by this op.
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and (p := _storage(t)):
                    if device:
                        self.on_device.add(p)
                    else:
                        self.on_device.discard(p)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.total += int(count(*args, **kwargs, out_val=out))
        return out


@dataclass
class Case:
    """One objective ready to step: `step()` runs one synthesis step (or one generator call)."""

    name: str
    step: Callable[[], None]
    info: dict[str, Any]
    # What lives on the run's device (data, synthetic set, models): where a sync is a sync.
    device_tensors: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # The same step run eagerly, whose FLOPs a dispatch mode sees (a replayed graph's kernels
    # are not dispatched); None: `step` itself.
    eager_step: Callable[[], None] | None = None


def build_cases(names: list[str], benchmark: str, data_dir: str | None, train_cap: int | None,
                seed: int, width: int, device: torch.device, graph: bool = False) -> list[Case]:
    """The objectives `names`, each as its method builds it with the method's default options,
    on client 0 of one federation built once; `graph`: captured steps where they apply."""
    from fedvl.config import RunConfig
    from fedvl.run.assemble import build_federation

    cfg = RunConfig(benchmark=benchmark, data_dir=data_dir, train_cap=train_cap, seed=seed,
                    model_args={"width": width, "depth": 3})
    fed = build_federation(cfg)
    return [build_case(n, cfg, fed, device, graph=graph) for n in names]


def build_case(name: str, cfg: Any, fed: Any, device: torch.device,
               batched: bool | None = None, graph: bool = False) -> Case:
    """Objective `name` as its method builds it with the method's default options (run `cfg`,
    federation `fed`, its client 0); `batched` picks gradient matching's path (None: the
    device's), `graph` a captured step where the objective allows one."""
    from fedvl.algorithms.feddm import FedDM
    from fedvl.algorithms.fedlgd import FedLGD
    from fedvl.algorithms.fedvck import FedVCK, class_budget
    from fedvl.config import resolve_model_args
    from fedvl.distill.augment import DSAConfig
    from fedvl.distill.client_sets import init_set, owned_ipc
    from fedvl.distill.dp_matching import DPDistributionMatching
    from fedvl.distill.samplers import (
        FixedModelSampler,
        ImportanceClassSampler,
        RandomModelSampler,
        RhoBallSampler,
        UniformClassSampler,
        importance_weights,
    )
    from fedvl.distill.synthesize import (
        DistributionMatching,
        GradientMatching,
        TargetGradientMatching,
        synthesize,
    )
    from fedvl.distill.synthetic import SyntheticSet
    from fedvl.run.assemble import build_env

    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective '{name}'; allowed: {', '.join(OBJECTIVES)}")
    g = torch.Generator().manual_seed(cfg.seed)
    if name == "kernel-latent":   # FedVCK's BatchNorm ConvNet
        cfg = dataclasses.replace(cfg, model_args={**cfg.model_args, "norm": "batch"})
    env = build_env(resolve_model_args(cfg), fed, device)
    x, y = fed.clients[0].x_train.to(device), fed.clients[0].y_train.to(device)
    k = fed.num_classes
    lgd, dm_p, vck = FedLGD.Params(), FedDM.Params(), FedVCK.Params()
    info: dict[str, Any] = {"what": WHAT[name], "real_images": int(len(y))}
    if name == "vhl-generator":
        from fedvl.algorithms.vhl import VHLParams
        from fedvl.virtual import make_virtual_dataset
        vp = VHLParams()
        shape = tuple(x.shape[1:])

        def gen() -> None:
            make_virtual_dataset(vp.virtual_generator, k, vp.virtual_per_class, shape, cfg.seed,
                                 device=device)

        info.update(generator=vp.virtual_generator, images=k * vp.virtual_per_class)
        return Case(name, gen, info)

    def owned(budget: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        keep = torch.tensor(budget, device=y.device)[y] > 0
        return x[keep], y[keep]

    budget = owned_ipc(y, k, lgd.ipc, lgd.min_class_count)
    xo, yo = owned(budget)
    syn = init_set("real", budget, xo.cpu(), yo.cpu(), k, g)
    model = env.model_fn().to(device)
    # FedLGD's real batches; a fresh random ConvNet per step for DM and DC-style matching.
    uniform = UniformClassSampler(xo, yo, k, lgd.batch_real)
    random_net = RandomModelSampler(lambda s: module_to(env.model_fn(seed=s), device))
    objective: Any
    if name == "dm":
        objective = DistributionMatching(uniform, random_net, k, dsa=DSAConfig())
    elif name == "dm-fixed":
        objective = DistributionMatching(uniform, FixedModelSampler(model), k, dsa=DSAConfig())
    elif name == "kernel-latent":
        budget = class_budget(y, k, vck.ipc, vck.ratio, vck.min_class_count)
        xo, yo = owned(budget)
        syn = (SyntheticSet.from_real(budget, xo.cpu(), yo.cpu(), k, g) if vck.init == "real"
               else SyntheticSet.noise(budget, k, tuple(x.shape[1:]), g))
        w = importance_weights([model], xo, yo, gamma=vck.gamma, bias=vck.bias)
        objective = DistributionMatching(
            ImportanceClassSampler(xo, yo, k, vck.batch_real, w, vck.replacement,
                                   multiset=True, weighting=vck.importance_weights),
            FixedModelSampler(model), k, matching="kernel", kernel=vck.kernel,
            dsa=DSAConfig() if vck.dsa else None, latent_constraint=True,
            latent_stats=vck.latent_stats)
        info["norm"] = "batch"
    elif name in ("embed-logit", "dp-embed-logit"):
        budget = owned_ipc(y, k, dm_p.ipc, dm_p.min_class_count)
        xo, yo = owned(budget)
        rho_ball = RhoBallSampler(model, dm_p.rho, sphere=dm_p.rho_draw == "sphere")
        if name == "embed-logit":
            syn = init_set(dm_p.init, budget, xo.cpu(), yo.cpu(), k, g)
            objective = DistributionMatching(UniformClassSampler(xo, yo, k, dm_p.batch_real),
                                             rho_ball, k, matching="embed_logit", dsa=None)
        else:   # DP needs a noise start
            syn = init_set("noise", budget, xo.cpu(), yo.cpu(), k, g)
            objective = DPDistributionMatching(
                xo, yo, rho_ball, k, batch_per_class=dm_p.batch_real, clip=dm_p.dp_clip,
                noise_multiplier=1.0, space=dm_p.dp_space, logits=True)
    elif name == "gradient":
        objective = GradientMatching(uniform, random_net, k, dsa=DSAConfig(), batched=batched)
    else:   # target-gradient
        gen_t = torch.Generator().manual_seed(cfg.seed + 1)
        targets = {n: torch.randn(p.shape, generator=gen_t, device=gen_t.device).to(device) * 1e-2
                   for n, p in model.named_parameters()}
        model.train()
        objective = TargetGradientMatching(model, targets)
        syn = SyntheticSet.noise(lgd.server_ipc, k, tuple(x.shape[1:]), g)
    syn = syn.to(device)
    info["synthetic_images"] = int(len(syn.labels))

    from fedvl.distill.graphed import not_graphable

    captured = graph and not_graphable(objective) is None
    info["graph"] = captured

    def step() -> None:
        # One step of the loop every method runs (a fresh image optimiser each call).
        synthesize(syn, objective, 1, g, graph=captured)

    def eager() -> None:
        synthesize(syn, objective, 1, g)

    on_device = [x, y, xo, yo, syn.images, syn.labels, *model.parameters(), *model.buffers()]
    if name == "target-gradient":
        on_device += list(targets.values())
    return Case(name, step, info, on_device + _module_tensors(objective),
                eager if captured else None)


def _module_tensors(obj: Any, depth: int = 2) -> list[torch.Tensor]:
    """Parameters and buffers of the models an objective (or its samplers) holds."""
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if depth == 0 or not hasattr(obj, "__dict__"):
        return []
    return [t for v in vars(obj).values() for t in _module_tensors(v, depth - 1)]


def measure(case: Case, device: torch.device, seconds: float = 3.0, warmup: int = 2
            ) -> dict[str, Any]:
    """GFLOP per step, steps/s (median of timed blocks) of one case."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        case.step()
    # On a GPU a sync is a read of a CUDA tensor; on the CPU the case says what is "device".
    with FlopCount(case.device_tensors if device.type == "cpu" else None) as fc:
        case.step()
    sync()
    if case.eager_step is not None:   # a captured step: its FLOPs from the eager one
        with FlopCount(case.device_tensors if device.type == "cpu" else None) as eager:
            case.eager_step()
        fc.total = eager.total
        sync()
    times: list[float] = []
    spent = 0.0
    while spent < seconds or len(times) < 3:
        t = time.perf_counter()
        case.step()
        sync()
        dt = time.perf_counter() - t
        times.append(dt)
        spent += dt
    per_step = statistics.median(times)
    return {**case.info, "gflop_per_step": fc.total / 1e9, "seconds_per_step": per_step,
            "steps_per_second": 1.0 / per_step, "gflops": fc.total / 1e9 / per_step,
            "ops_per_step": fc.ops, "syncs_per_step": fc.syncs, "sync_ops": fc.sync_names,
            "timed_steps": len(times)}


def run_distill_perf(objectives: list[str], benchmark: str, data_dir: str | None,
                     train_cap: int | None, seed: int, width: int, device_name: str,
                     threads: int, seconds: float, matmul_n: int | None = None,
                     graph: bool = False) -> dict[str, Any]:
    """Measure every objective and the matmul rate on the same threads; the JSON record."""
    device = torch.device(device_name)
    bad = sorted(set(objectives) - set(OBJECTIVES))
    if bad or not objectives:
        raise ValueError(f"unknown objective(s) {bad or '(none)'}; allowed: "
                         f"{', '.join(OBJECTIVES)}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rate = matmul_rate(threads, device_name, matmul_n)
        cases = build_cases(objectives, benchmark, data_dir, train_cap, seed, width, device,
                            graph=graph)
        rows = {c.name: measure(c, device, seconds) for c in cases}
        rate_end = matmul_rate(threads, device_name, matmul_n)
    finally:
        torch.set_num_threads(before)
    peak = max(rate["gflops"], rate_end["gflops"])
    for r in rows.values():
        r["share_of_matmul_rate"] = r["gflops"] / peak
    return {"benchmark": benchmark, "train_cap": train_cap, "width": width, "seed": seed,
            "device": device_name, "threads": threads,
            "matmul_gflops": {"start": rate["gflops"], "end": rate_end["gflops"],
                              "used": peak, "n": rate["n"]},
            "objectives": rows}


def table(result: dict[str, Any]) -> str:
    """The result as a plain-text table."""
    head = (f"{'objective':16s} {'GFLOP/step':>10s} {'steps/s':>8s} {'GFLOP/s':>8s} "
            f"{'share':>6s} {'ops/step':>8s} {'syncs':>5s}")
    lines = [f"synthesis objectives on {result['device']} ({result['threads']} thread(s)), "
             f"width {result['width']}, {result['benchmark']}; matmul rate "
             f"{result['matmul_gflops']['used']:.0f} GFLOP/s", head]
    for name, r in result["objectives"].items():
        lines.append(f"{name:16s} {r['gflop_per_step']:10.3f} {r['steps_per_second']:8.2f} "
                     f"{r['gflops']:8.1f} {100 * r['share_of_matmul_rate']:5.1f}% "
                     f"{r['ops_per_step']:8d} {r['syncs_per_step']:5d}")
    return "\n".join(lines)

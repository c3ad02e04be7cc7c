"""Every class's loss gradient at once, as gradient matching needs them, in a number of ops that
does not grow with the number of classes.

Gradient matching compares, class by class, the gradient of the mean loss over class c's real
images with that over its synthetic ones. Each class's images are laid into row c of a
[classes, slots] grid (padded, the padding weighted 0), and the rows are differentiated together.
When the model is the dataset-condensation ConvNet they run as one grouped network: class c gets
its own copy of the weights (expanded, not copied) and the copies run side by side as
convolutions with `groups=classes`, so one backward of the summed per-class losses gives every
class's gradient, one op per layer for all classes. Its GroupNorm is written in plain ops where
a double backward follows: the kernel's double backward expands into ~3x more.

PyTorch's double backward of a grouped convolution (`_convolution_double_backward`) loops over
the groups, ~6 ops a step per class, so past `GROUPED_TWICE_MAX_CLASSES` the gradients that are
differentiated again (the synthetic side) come from one `vmap` over the rows instead, where each
row's convolution is ungrouped and the count no longer grows. Other models use `vmap` on both
sides. A DC-style step (width 32, depth 3, with DSA) is 930–990 ops up to 16 classes and
982–1,024 past them, against 7,143 for the loop over 10 classes (`fedvl perf --distill`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fedvl.distill.losses import class_counts
from fedvl.models.convnet import ConvNet
from fedvl.models.pooling import AvgPool2x2

_LAYERS = (nn.Conv2d, nn.GroupNorm, nn.ReLU, AvgPool2x2, nn.MaxPool2d, nn.Identity)
# Gradients that are differentiated again come from the grouped network up to this many
# classes and from vmap past it: the grouped double backward is fewer ops at 10 classes but
# grows by ~6 per class (a per-group loop), vmap's does not grow (measured in gpu.md).
GROUPED_TWICE_MAX_CLASSES = 16


def groupable(model: nn.Module) -> bool:
    """Whether `model` is a ConvNet of layers `grouped_logits` can run for all classes."""
    if type(model) is not ConvNet:
        return False
    for m in model.features:
        if not isinstance(m, _LAYERS):
            return False
        if isinstance(m, nn.Conv2d) and (m.groups != 1 or m.padding_mode != "zeros"):
            return False
        if isinstance(m, nn.MaxPool2d) and (m.kernel_size not in (2, (2, 2))
                                            or m.stride not in (2, (2, 2))
                                            or m.padding not in (0, (0, 0))):
            return False
    return True


def vmap_exact(model: nn.Module) -> bool:
    """Whether `per_class_gradients` differentiates `model` twice exactly (every model without
    a LayerNorm)."""
    # torch.func's double backward of layer_norm under vmap(grad) gives wrong input gradients
    # (torch 2.13: 11 % off a finite difference in float64, where the per-class loop agrees to
    # 1e-8; tests/test_distill_synthesis.py), so such a model keeps the loop.
    return not any(isinstance(m, nn.LayerNorm) for m in model.modules())


def class_grid(x: torch.Tensor, y: torch.Tensor, num_classes: int, slots: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x laid out as [classes, slots, ...] (class c's rows in row c, in order, zero-padded),
    the labels grid and the 0/1 weight of every cell; every class has at most `slots` rows."""
    # F.one_hot would check the labels' range on the host; a comparison does not.
    onehot = (y.unsqueeze(1) == torch.arange(num_classes, device=y.device)).long()
    rank = (onehot.cumsum(0) - 1).gather(1, y.unsqueeze(1)).squeeze(1)
    cell = y * slots + rank
    total = num_classes * slots
    grid = x.new_zeros((total, *x.shape[1:])).index_copy(0, cell, x)
    weight = x.new_zeros(total).index_fill(0, cell, 1.0)
    # Not repeat_interleave: on a GPU it reads its output size back to the host.
    labels = torch.arange(total, device=y.device) // slots
    shape = (num_classes, slots)
    return grid.view(*shape, *x.shape[1:]), labels.view(shape), weight.view(shape)


def grouped_logits(model: ConvNet, params: dict[str, torch.Tensor], grid: torch.Tensor,
                   plain_norms: bool = False) -> torch.Tensor:
    """Logits [classes, slots, num_classes] of grid row c through copy c of the weights.

    `params` maps every parameter name of `model` to a [classes, ...] stack of it; `grid` is
    [classes, slots, C, H, W]; `plain_norms` writes GroupNorm in plain ops (`plain_group_norms`).
    """
    k, slots = grid.shape[:2]
    # Sample-major, class-minor channels: class c's channels are the c-th block of each image.
    h = grid.transpose(0, 1).reshape(slots, k * grid.shape[2], *grid.shape[3:])
    for i, m in enumerate(model.features):
        name = f"features.{i}"
        if isinstance(m, nn.Conv2d):
            w, b = params[f"{name}.weight"], params.get(f"{name}.bias")
            h = F.conv2d(h, w.reshape(-1, *w.shape[2:]), None if b is None else b.reshape(-1),
                         m.stride, m.padding, m.dilation, k)
        elif isinstance(m, nn.GroupNorm):
            norm = _group_norm_plain if plain_norms else F.group_norm
            h = norm(h, k * m.num_groups, params[f"{name}.weight"].reshape(-1),
                     params[f"{name}.bias"].reshape(-1), m.eps)
        elif isinstance(m, nn.ReLU):
            h = F.relu(h)
        elif isinstance(m, AvgPool2x2):
            h = F.avg_pool2d(h, 2, 2)
        elif isinstance(m, nn.MaxPool2d):
            h = F.max_pool2d(h, 2, 2)
    z = h.reshape(slots, k, -1).transpose(0, 1)                    # [classes, slots, features]
    w, b = params["classifier.weight"], params["classifier.bias"]
    return torch.baddbmm(b.unsqueeze(1), z, w.transpose(1, 2))


def _group_norm_plain(h: torch.Tensor, groups: int, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float) -> torch.Tensor:
    g = h.reshape(h.shape[0], groups, -1)
    var, mean = torch.var_mean(g, -1, keepdim=True, correction=0)
    y = ((g - mean) * torch.rsqrt(var + eps)).reshape(h.shape)
    shape = (1, -1) + (1,) * (h.dim() - 2)
    return torch.addcmul(bias.reshape(shape), y, weight.reshape(shape))


def _group_norm_twice_differentiable(m: nn.GroupNorm, h: torch.Tensor) -> torch.Tensor:
    return _group_norm_plain(h, m.num_groups, m.weight, m.bias, m.eps)


@contextlib.contextmanager
def plain_group_norms(model: nn.Module) -> Iterator[None]:
    """Within it, `model`'s affine GroupNorm layers normalise in plain ops (same values to
    float rounding), whose double backward is ~3x fewer ops than the kernel's."""
    layers = [m for m in model.modules() if isinstance(m, nn.GroupNorm) and m.affine]
    for m in layers:
        m.forward = types.MethodType(_group_norm_twice_differentiable, m)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in layers:
            del m.forward


def per_class_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                        slots: int | None = None, create_graph: bool = False,
                        names: list[str] | None = None
                        ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """d mean CE(model(x_c), c) / d params for every class c at once ({name: [classes, ...]}),
    and the class counts; a class without rows gets a zero gradient.

    `slots` bounds the rows of a class (a class sampler's `per_class`); without it the
    largest class is read from the device. With `create_graph` the gradients are
    differentiable w.r.t. x (a double backward follows). `names`: the parameters wanted
    (default: every trainable one).
    """
    from torch.func import functional_call, grad, vmap

    counts = class_counts(y, num_classes)
    if slots is None:
        slots = int(counts.max()) if len(y) else 0
    slots = max(int(slots), 1)
    grid, labels, weight = class_grid(x, y, num_classes, slots)
    if names is None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
    twice = create_graph and torch.is_grad_enabled()
    if groupable(model) and (not twice or num_classes <= GROUPED_TWICE_MAX_CLASSES):
        stacked = {n: p.detach().unsqueeze(0).expand(num_classes, *p.shape)
                   for n, p in model.named_parameters()}
        wanted = [stacked[n].requires_grad_() for n in names]
        with torch.enable_grad():
            logits = grouped_logits(model, stacked, grid, plain_norms=twice)
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            per_class = (ce.view(weight.shape) * weight).sum(1) / weight.sum(1).clamp_min(1.0)
            grads = torch.autograd.grad(per_class.sum(), wanted, create_graph=twice)
        return dict(zip(names, grads, strict=True)), counts
    wanted_names = set(names)
    params = {n: p.detach() for n, p in model.named_parameters() if n in wanted_names}
    fixed = {n: p.detach() for n, p in model.named_parameters() if n not in wanted_names}
    buffers = dict(model.named_buffers())

    def class_loss(p: dict[str, torch.Tensor], xc: torch.Tensor, yc: torch.Tensor,
                   wc: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, ({**p, **fixed}, buffers), (xc,))
        ce = F.cross_entropy(logits, yc, reduction="none")
        return (ce * wc).sum() / wc.sum().clamp_min(1.0)

    norms = plain_group_norms(model) if twice else contextlib.nullcontext()
    with norms, torch.set_grad_enabled(twice):
        grads = vmap(grad(class_loss), in_dims=(None, 0, 0, 0))(params, grid, labels, weight)
    return grads, counts

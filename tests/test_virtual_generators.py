"""Every registered virtual-data generator: [0, 1] output, shape, determinism, pixel mappings."""

from __future__ import annotations

import pytest
import torch

from fedvl.registry import VIRTUAL_GENERATORS
from fedvl.seeding import seeded
from fedvl.virtual import make_virtual_dataset
from fedvl.virtual.pixels import PIXEL_MAPPINGS

# Small settings for the slow generators; anything registered later runs with its defaults.
FAST = {"random_cnn": {"steps": 2, "batch": 8}}
# offset, scale of each built-in generator's `affine` mapping (pixel = offset + scale * raw).
AFFINE = {"style_gan": (0.5, 0.5), "random_cnn": (0.5, 0.5), "upsampled_noise": (0.5, 0.25)}


def _generate(name: str, seed: int, shape: tuple[int, int, int], **options) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        return VIRTUAL_GENERATORS.get(name)(3, 4, shape, **FAST.get(name, {}), **options)


def test_built_in_generators_are_registered():
    assert set(AFFINE) <= set(VIRTUAL_GENERATORS.names())


@pytest.mark.parametrize("name", VIRTUAL_GENERATORS.names())
@pytest.mark.parametrize("shape", [(3, 16, 16), (1, 28, 28)])
def test_generator_output_is_unit_range_shaped_and_seeded(name, shape):
    a = _generate(name, 0, shape)
    assert a.shape == (12, *shape) and a.dtype == torch.float32
    assert torch.isfinite(a).all() and float(a.min()) >= 0.0 and float(a.max()) <= 1.0
    assert float(a.std()) > 0.01  # not a constant image
    assert torch.equal(a, _generate(name, 0, shape))
    assert not torch.equal(a, _generate(name, 1, shape))
    d = make_virtual_dataset(name, 3, 4, shape, seed=0, **FAST.get(name, {}))
    assert d.images.dtype == torch.uint8 and d.images.shape == (12, *shape)


@pytest.mark.parametrize("name", sorted(AFFINE))
def test_clamp_mapping_clips_the_raw_output(name):
    """`affine` = offset + scale * raw, `clamp` = raw, both clipped to [0, 1]: from the affine
    image the clamp image follows (wherever the affine one is not clipped)."""
    shape = (3, 16, 16)
    assert set(PIXEL_MAPPINGS) == {"affine", "clamp"}
    a = _generate(name, 0, shape)
    assert torch.equal(a, _generate(name, 0, shape, pixel_mapping="affine"))
    c = _generate(name, 0, shape, pixel_mapping="clamp")
    assert c.shape == a.shape and float(c.min()) >= 0.0 and float(c.max()) <= 1.0
    offset, scale = AFFINE[name]
    raw = (a - offset) / scale
    inside = (a > 0) & (a < 1)
    assert torch.allclose(c[inside], raw[inside].clamp(0, 1), atol=1e-5)
    # Where the affine image is black the raw value is below 0: black under clamp as well.
    assert torch.equal(c[a == 0], torch.zeros_like(c[a == 0]))
    assert float((c == 0).float().mean()) > float((a == 0).float().mean())


@pytest.mark.parametrize("name", sorted(AFFINE))
def test_unknown_pixel_mapping_is_refused(name):
    with pytest.raises(ValueError, match=r"pixel_mapping is 'png'; allowed: affine, clamp"):
        _generate(name, 0, (1, 8, 8), pixel_mapping="png")


@pytest.mark.parametrize("name", VIRTUAL_GENERATORS.names())
def test_device_cpu_gives_the_images_of_a_call_without_device(name):
    shape = (3, 16, 16)
    plain = make_virtual_dataset(name, 3, 4, shape, seed=0, **FAST.get(name, {}))
    for device in ("cpu", torch.device("cpu")):
        d = make_virtual_dataset(name, 3, 4, shape, seed=0, device=device, **FAST.get(name, {}))
        assert torch.equal(d.images, plain.images) and torch.equal(d.labels, plain.labels)
        assert d.images.device.type == "cpu" == d.labels.device.type


def test_style_gan_draws_on_the_cpu_and_computes_on_the_device(monkeypatch):
    """The generator's weights come from the seeded CPU generator whatever the device (one seed,
    the same weights everywhere); its forward passes run on the device (here `meta`, a device
    that computes shapes only, as a stand-in for a GPU)."""
    import fedvl.virtual.stylegan as sg

    drawn: dict[str, dict[str, torch.Tensor]] = {}
    move = sg.StyleGenerator.to

    def recording(self, device, *args, **kwargs):
        drawn[str(device)] = {k: v.clone() for k, v in self.state_dict().items()}
        return move(self, device, *args, **kwargs)

    monkeypatch.setattr(sg.StyleGenerator, "to", recording)
    out = {}
    for device in ("meta", "cpu"):
        with seeded(4), torch.no_grad():
            out[device] = sg.style_gan(2, 3, (3, 8, 8), device=device)
    assert out["meta"].device.type == "meta" and out["meta"].shape == out["cpu"].shape
    assert all(v.device.type == "cpu" for v in drawn["meta"].values())
    assert drawn["meta"].keys() == drawn["cpu"].keys()
    assert all(torch.equal(drawn["meta"][k], drawn["cpu"][k]) for k in drawn["cpu"])


def test_a_device_that_is_no_device_is_refused():
    with pytest.raises(ValueError, match=r"device 'gpu0' is not a torch device; allowed: "
                                         r"a torch.device or a name such as 'cpu'"):
        make_virtual_dataset("upsampled_noise", 2, 2, (1, 8, 8), seed=0, device="gpu0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_style_gan_on_cuda_returns_a_cpu_dataset_close_to_the_cpus(monkeypatch):
    # TF32 convolutions (cuDNN's default) round to a 10-bit mantissa: off, the devices differ
    # only in float32 summation order, a last-bit difference that moves a pixel by one level
    # at most where it sits on a rounding boundary.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    shape = (3, 32, 32)
    cpu = make_virtual_dataset("style_gan", 2, 5, shape, seed=0)
    gpu = make_virtual_dataset("style_gan", 2, 5, shape, seed=0, device="cuda")
    assert gpu.images.device.type == "cpu" and gpu.images.dtype == torch.uint8
    assert gpu.images.shape == cpu.images.shape and torch.equal(gpu.labels, cpu.labels)
    diff = (gpu.images.int() - cpu.images.int()).abs()
    assert int(diff.max()) <= 1

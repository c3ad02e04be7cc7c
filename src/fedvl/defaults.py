"""Defaults and closed lists the run configuration needs, free of torch.

The modules that use them (`fedvl.core.audit`, `fedvl.data.cifar10c`, `fedvl.models`) import
torch; the flags of `fedvl run --help` only need these values, so they live here.
"""

from __future__ import annotations

# `--upload-guard`: uploads whose largest |Pearson r| with a private image reaches this are
# withheld (fedvl.core.audit).
DEFAULT_GUARD = 0.9

# The 19 CIFAR-10-C corruptions (fedvl.data.cifar10c).
CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
    "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
    "elastic_transform", "pixelate", "jpeg_compression", "speckle_noise", "gaussian_blur",
    "spatter", "saturate",
)
# The reference pools all five severities; one level per run keeps 10,000 images per corruption
# (not 50,000), and 3 is the middle of the range. The library uses ImageNet-C constants, which
# are stronger on 32x32 images than CIFAR-10-C's own, another reason not to default to 5.
DEFAULT_SEVERITY = 3

# Label-skew partitions (fedvl.data.partition) and their defaults.
PARTITIONS = ("dirichlet", "shards", "dominant")
DEFAULT_PARTITION = "dirichlet"
DEFAULT_SHARDS_PER_CLIENT = 2
DEFAULT_DOMINANT_SHARE = 0.8

# Per-client caps above this are clipped to it (`DataOptions`); every loader then clips them
# to its own data size. 2^31 - 1: more images than any single dataset fedvl reads holds.
MAX_CAP = 2**31 - 1

# `--client-models alternate`: ConvNet and AlexNet in turn (DESA's heterogeneous setting).
ALTERNATE = "alternate"

# Largest first-convolution padding of a ConvNet: the FedVCK reference uses 3; beyond a few
# pixels a border of zeros is no model option, only an allocation that grows with its square.
MAX_FIRST_PADDING = 8

# `--log`: the experiment loggers a run may write beside metrics.jsonl (fedvl.engine.logs).
LOG_KINDS = ("tensorboard", "wandb")
# `fedvl bench --protocol`: multi-round runs every method for `--rounds` rounds; one-shot for
# exactly one, in which weight-averaging methods' clients train ONE_SHOT_LOCAL_EPOCHS epochs
# unless `--local-epochs` / `--local-steps` says otherwise (the FedD3 reference code's one-shot
# baselines take their local epochs from its `-cie` flag, 50 in its README's examples).
PROTOCOLS = ("multi-round", "one-shot")
DEFAULT_PROTOCOL = "multi-round"
ONE_SHOT_LOCAL_EPOCHS = 50


def protocol_run_defaults(protocol: str) -> dict[str, int]:
    """The run settings a protocol brings, under every setting a user, spec or preset gives."""
    return {"local_epochs": ONE_SHOT_LOCAL_EPOCHS} if protocol == "one-shot" else {}

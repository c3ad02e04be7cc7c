"""Dataset-condensation primitives: synthetic sets, DSA, matching losses, synthesis loop, DP."""

from fedvl.distill.augment import (
    DSAConfig,
    DSAParams,
    apply_dsa,
    augment_batch,
    sample_dsa_params,
    siamese_dsa,
)
from fedvl.distill.herding import herding, herding_coreset
from fedvl.distill.losses import (
    class_means,
    distance_wb,
    embed_logit_loss,
    gradient_distance,
    mean_embedding_loss,
    mmd_loss,
    random_directions,
    sliced_wasserstein,
)
from fedvl.distill.samplers import (
    BlendedModelSampler,
    FixedModelSampler,
    ImportanceClassSampler,
    RandomModelSampler,
    RhoBallSampler,
    UniformClassSampler,
    importance_weights,
    perturbation,
)
from fedvl.distill.synthesize import (
    DistributionMatching,
    GradientMatching,
    SynthesisResult,
    TargetGradientMatching,
    synthesize,
)
from fedvl.distill.synthetic import SyntheticSet
from fedvl.distill.trajectory import (
    inner_batches,
    soft_cross_entropy,
    trajectory_matching_loss,
    unroll_sgd,
)

__all__ = [
    "DSAConfig", "DSAParams", "apply_dsa", "augment_batch", "sample_dsa_params", "siamese_dsa",
    "herding", "herding_coreset", "class_means", "distance_wb", "embed_logit_loss",
    "gradient_distance", "mean_embedding_loss", "mmd_loss", "random_directions",
    "sliced_wasserstein", "BlendedModelSampler", "FixedModelSampler", "ImportanceClassSampler",
    "RandomModelSampler", "RhoBallSampler", "UniformClassSampler", "importance_weights",
    "perturbation", "DistributionMatching", "GradientMatching", "SynthesisResult",
    "TargetGradientMatching", "synthesize", "SyntheticSet", "inner_batches",
    "soft_cross_entropy", "trajectory_matching_loss", "unroll_sgd",
]

"""FedVCK's paper forms against the public code's, one code form switched on at a time.

  python benchmarks/fedvck_paper_forms.py --rounds 5 --train-cap 100 --test-cap 100 --seeds 0,1,2

The `fedvck-forms` set of `benchmarks/arms.py` (its options apply), on digits-offline: the
paper's defaults (`init=noise`, `contrastive=paper` with Eq. 16's beta 1,
`importance_weights=linear`, `latent_stats=batch`, first-convolution padding 1), then each of
the code's forms alone (`contrastive=code` at the code's runs' beta 0.1). The contrastive forms
alone, two runs at a time:

  python benchmarks/fedvck_paper_forms.py --arms "paper (defaults),contrastive=code beta=0.1" \\
      --rounds 5 --train-cap 100 --test-cap 100 --seeds 0,1,2 --jobs 2 --threads 1 \\
      --out benchmarks/results/fedvck-contrastive-forms-amd-cpu.json
"""

from __future__ import annotations

from arms import main

if __name__ == "__main__":
    main("fedvck-forms", "benchmarks/results/fedvck-paper-forms-cpu.json")

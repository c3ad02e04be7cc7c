#!/usr/bin/env bash
# Every method and variant with `--preset smoke` on the GPU beside the same run on the CPU
# (benchmarks/gpu_smoke.py), from the repository root of a machine with a CUDA GPU where
# `python3 -m fedvl.cli` runs:
#   bash benchmarks/gpu_smoke.sh [RESULT_JSON]
# Exits non-zero when a configuration fails on either device or the accuracies differ by more
# than 2 points.
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
python3 gpu_smoke.py --out "${1:-results/gpu-smoke.json}"

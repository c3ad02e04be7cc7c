#!/usr/bin/env bash
# The GPU measurements of docs/performance.md in one call, from the repository root of a
# machine with a CUDA GPU where `python3 -m fedvl.cli` runs (fedvl installed, or
# PYTHONPATH=src with its dependencies):
#   bash benchmarks/gpu_perf.sh DATA_DIR [RESULT_DIR]
# DATA_DIR holds cifar10.npz; the JSON files go to
# RESULT_DIR (default benchmarks/results), one per measurement, each with its command.
# Dirichlet splits need flwr-datasets only when they are not cached: a machine without it
# can use a $FEDVL_CACHE_DIR filled by running the same commands where it is installed.
set -euo pipefail
data=$1
out=${2:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

# 100 digit clients: digits-offline's five styles of 2,000 training images, each split into
# 20 Dirichlet clients (the caps apply per style before the split), batch 32. Sequential
# clients, threads and stacked clients against the bare single-model loop.
python3 -m fedvl.cli perf --device cuda --benchmark digits-offline --partitions 20 --clients 5 \
  --train-per-client 2000 --test-per-client 500 \
  --engines bare,embedded,workers,stacked --workers 4 \
  --out "$out/perf-digits-offline-100clients-gpu.json"

# The CPU workload (CIFAR-10, 10 clients x 200 images) on the GPU.
python3 -m fedvl.cli perf --device cuda --data-dir "$data" --clients 10 --engines bare,embedded,stacked \
  --out "$out/perf-cifar10-10clients-gpu.json"

# Every synthesis objective: steps/s, ops and host syncs per step, widths 32 and 128.
python3 -m fedvl.cli perf --distill --device cuda --seconds 2 --out "$out/perf-distill-gpu-w32.json"
python3 -m fedvl.cli perf --distill --device cuda --seconds 2 --width 128 \
  --out "$out/perf-distill-gpu-w128.json"

# The same with captured steps (CUDA graphs) where an objective allows one.
python3 -m fedvl.cli perf --distill --device cuda --seconds 2 --graph \
  --out "$out/perf-distill-gpu-w32-graph.json"

# Gradient matching, all classes in one vmap against one class at a time.
python3 benchmarks/gradient_batched.py --device cuda --out "$out/gradient-batched-gpu.json"

# VHL's style generator on the GPU.
python3 benchmarks/vhl_generator_speed.py --device cuda --out "$out/vhl-generator-device-gpu.json"

# Batched distribution matching against the per-class loop, widths 32 and 128.
python3 benchmarks/distill_speed.py --device cuda --widths 32,128 --steps 20 \
  --out "$out/distill-speed-gpu.json"

# Where a DM step's time goes on the GPU, against a forward+backward of its images.
python3 benchmarks/dm_profile.py --device cuda --width 128 --out "$out/dm-profile-gpu-w128.json"
python3 benchmarks/dm_profile.py --device cuda --width 32 --out "$out/dm-profile-gpu-w32.json"

# Local training under bfloat16 autocast against float32 on the GPU (fedvl run, the CPU
# workload, clients one after another), three interleaved repetitions.
python3 benchmarks/allocator_ab.py --data-dir "$data" --reps 3 --arms "" \
  --flag-arm "float32 on the GPU=--device cuda --workers 1" \
  --flag-arm "bf16 autocast on the GPU=--device cuda --workers 1 --autocast bf16" \
  --result "$out/autocast-bf16-gpu.json"

# torch.compile against eager for a training step, widths 32 and 128.
python3 benchmarks/compile_speed.py --device cuda --width 32 --out "$out/compile-speed-gpu-w32.json"
python3 benchmarks/compile_speed.py --device cuda --width 128 --out "$out/compile-speed-gpu-w128.json"

#!/usr/bin/env bash
# Paper-scale FedLGD Table-1 comparison on one GPU: every (IPC, seed) runs the baselines in one
# process and FedLGD in another, all at once; FedLGD starts once the baselines' process has
# cached that seed's local virtual data. Finished runs already under WORK/runs are reused, so
# the grid can be completed over several calls. Then one call per IPC only summarises.
#   bash benchmarks/gpu_virtual_digits.sh DATA_DIR "10 50" "0 1 2" WORK [extra args...]
# Extra args go to every process; FedLGD's own settings go in $FEDLGD_ARGS (method args that
# name fedlgd would be refused by the baselines' processes). The summaries go to
# $RESULT_DIR (default benchmarks/results); point it elsewhere for trial runs.
set -u
data=$1; ipcs=$2; seeds=$3; work=$4; shift 4
common=(--benchmark digits --data-dir "$data" --width 128 --rounds 100 --eval-every 10
        --lr 0.01 --momentum 0 --virtual-steps 200 --virtual-batch-real 64 --device cuda
        "$@")
read -r -a lgd <<<"${FEDLGD_ARGS:---method-arg fedlgd.local_dm_steps=100 \
--method-arg fedlgd.server_gm_steps=500 --method-arg fedlgd.batch_real=256}"
base=fedavg,fedprox,fednova,scaffold,moon,vhl
mkdir -p "$work/logs"
pids=()
for ipc in $ipcs; do
  for s in $seeds; do
    cache="$work/cache-ipc$ipc-s$s"; mkdir -p "$cache"
    FEDVL_CACHE_DIR=$cache python3 benchmarks/virtual_comparison.py "${common[@]}" --ipc "$ipc" \
      --seeds "$s" --methods $base --work "$work/runs" --result "$work/base-ipc$ipc-s$s.json" \
      >"$work/logs/base-ipc$ipc-s$s.log" 2>&1 &
    bpid=$!; pids+=($bpid)
    # FedLGD waits for the baselines' cached local sets; if that process ends without one
    # (all its runs were already finished), FedLGD distils the same sets itself.
    ( until ls "$cache"/local-virtual-*.pt >/dev/null 2>&1 || ! kill -0 "$bpid" 2>/dev/null; do
        sleep 2; done
      FEDVL_CACHE_DIR=$cache python3 benchmarks/virtual_comparison.py "${common[@]}" --ipc "$ipc" \
        --seeds "$s" --methods fedlgd "${lgd[@]}" --work "$work/runs" \
        --result "$work/fedlgd-ipc$ipc-s$s.json" >"$work/logs/fedlgd-ipc$ipc-s$s.log" 2>&1 ) &
    pids+=($!)
  done
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for ipc in $ipcs; do
  python3 benchmarks/virtual_comparison.py "${common[@]}" "${lgd[@]}" --ipc "$ipc" \
    --seeds "$(echo $seeds | tr ' ' ,)" --work "$work/runs" \
    --result "${RESULT_DIR:-benchmarks/results}/virtual-digits-ipc$ipc-gpu.json" \
    --driver "bash benchmarks/gpu_virtual_digits.sh $data \"$ipcs\" \"$seeds\" $work $*" \
    >"$work/logs/summary-ipc$ipc.log" 2>&1 || rc=1
done
exit $rc

#!/usr/bin/env bash
# The GPU check in one command: the `cuda` tests, benchmarks/gpu.py in three parts, then the delta
# benchmark with a GPU trainer, each under its own timeout so one hang cannot eat the others.
# Log and JSON records go to $OUT.
#   bash benchmarks/gpu_check.sh                            # the project installed
#   WHEELS=.whl OUT=/tmp/out bash benchmarks/gpu_check.sh   # offline: install cp312 wheels first
# See docs/gpu.md ("Running the GPU check") for what each part measures.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-results}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sluice-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/sluice-site:$PWD
fi
export PYTHONUNBUFFERED=1
LOG=$OUT/gpu-check.log
step() {
    local limit=$1
    shift
    echo "=== $* (timeout $limit s)" | tee -a "$LOG"
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "=== exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
nvidia-smi -L 2>&1 | tee -a "$LOG"
step 240 $PY -m pytest -q -s -p no:cacheprovider -m cuda -rsx --timeout 120 tests/transfer_queue/test_device.py \
    tests/weight_sync/test_cuda_ipc.py tests/weight_sync/test_torch_nccl.py tests/weight_sync/test_cuda_host.py \
    tests/weight_sync/test_delta_default.py tests/weight_sync/test_nixl.py tests/recipes/test_runs.py
step 150 $PY benchmarks/gpu.py --sizes 4GiB --reps 3 --transports cuda_ipc,auto,shm
step 180 $PY benchmarks/gpu.py --sizes 4GiB --reps 2 --subscribers 1 --transports tcp,ucx,nixl,nixl_cuda,torch
step 150 $PY benchmarks/gpu.py --sizes 16GiB --reps 2 --subscribers 1 --transports cuda_ipc,shm
step 150 $PY benchmarks/weight_sync_delta.py --sizes 4GiB --lrs 1e-6,1e-5 --subscribers 1 --steps 4 --device cuda \
    --subscriber-device cuda --threads '' --copy-threads 8 --receive-memory host,cuda --timeline
cp results/gpu-*.json results/weight_sync_delta-*.json "$OUT"/ 2>/dev/null || true

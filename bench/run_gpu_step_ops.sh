#!/usr/bin/env bash
# One GPU-host command for the host cost of a tree decode step's sampler, commit and GDN layer: the
# GPU equality tests of the rewrite (tests/gpu/test_step_rewrite_gpu.py, test_step_kernels_gpu.py),
# of the batched commit (tests/gpu/test_batched_commit_gpu.py: batched == per-layer bit for bit at
# the 27B GDN shape) and of the GDN layer's host-work cut (tests/gpu/test_gdn_layer_gpu.py: the
# layer == its previous code bit for bit at the 27B shape), then bench/step_ops.py on CUDA (real
# NVRTC kernels and launches) for the current code (commit paths kernels = per layer and
# kernels-batched = VLLM_TFM_BATCHED_COMMIT=1; gdn_layer = one GDN layer's tree path at the 27B
# layer shape) and the previous one (tests/cpu/_step_before.py, tests/cpu/_gdn_before.py and
# launch parameters packed afresh), R = 1 and 8, B = 32, 27B layer counts with small tensors.
# Run from the repository root (carry .gpu-bundle), $OUT set:
#
#     bash bench/run_gpu_step_ops.sh
#
# Writes $OUT/pytest.log, $OUT/step_ops_cuda.json (labels "batched": the current code, and "before") and
# $OUT/step_ops_*.log. About 4-6 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/step-ops-out}
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .gpu-bundle/install.sh >"$OUT/install.log" 2>&1 || { echo "bundle install failed"; tail -5 "$OUT/install.log"; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
timeout 300 python3 -m pytest -q tests/gpu/test_step_rewrite_gpu.py tests/gpu/test_step_kernels_gpu.py \
    tests/gpu/test_batched_commit_gpu.py tests/gpu/test_gdn_layer_gpu.py >"$OUT/pytest.log" 2>&1
echo "gpu tests exit code $?"; tail -5 "$OUT/pytest.log"
rc=0
timeout 150 python3 bench/step_ops.py --device cuda --label batched --repeats 20 \
    --out "$OUT/step_ops_cuda.json" >"$OUT/step_ops_after.log" 2>&1 || rc=$?
echo "bench (current) exit code $rc"; grep "^R=" "$OUT/step_ops_after.log"; tail -3 "$OUT/step_ops_after.log"
timeout 150 python3 bench/step_ops.py --device cuda --impl before --label before --repeats 20 \
    --out "$OUT/step_ops_cuda.json" >"$OUT/step_ops_before.log" 2>&1 || rc=$?
echo "bench (previous) exit code $rc"; grep "^R=" "$OUT/step_ops_before.log"; tail -3 "$OUT/step_ops_before.log"
exit $rc

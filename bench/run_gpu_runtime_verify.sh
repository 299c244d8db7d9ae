#!/usr/bin/env bash
# One command for the GPU host: the runtime's choice of GDN verify kernel, checked and timed.
#   1. the runtime's GPU tests that run the verify through the plugin's step tables and full-graph
#      plans (step kernels, the GDN layer with VLLM_TFM_GDN_VERIFY=3 and auto, step rewrite, batched
#      commit, kernels on fixed-layout plans);
#   2. bench/gdn_tree.py at the runtime's tree sizes (n = B + 1 = 17, 33, 65; batch 1, 2, 8, 32) on
#      per-step plans, on the full CUDA graphs' fixed-layout plans, and on fixed-layout plans with the
#      drafter's depth bound (DEPTH_BOUND, default 15: a DFlash block of 16), each row with every
#      version and the one the runtime runs (`rt`).
# Run from the repository root with the bundle carried (.gpu-bundle) and $OUT set:
#
#     TOTAL_S=420 bash bench/run_gpu_runtime_verify.sh
#
# Writes under $OUT: install.log, pytest.log/.xml, tfm_sizes{,_fixed,_fixed_bound}.{json,txt} and their
# logs. Whole run bounded by TOTAL_S (default 480 s); prints a status line per step and the tables.
set -uo pipefail

OUT=${OUT:-/tmp/vllm_tfm_out}
TOTAL_S=${TOTAL_S:-480}
DEPTH_BOUND=${DEPTH_BOUND:-15}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck source=bench/gpu_common.sh
source bench/gpu_common.sh
gpu_setup "$OUT"  # the bundle, this checkout first on PYTHONPATH (keeping the bundle's entries)
export VLLM_TFM_CUDA_DIR="$PWD/cuda"
export VLLM_TFM_CACHE=${VLLM_TFM_CACHE:-/tmp/vllm_tfm_kernel_cache}

gpu_steps_begin

gpu_step pytest 240 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/pytest.xml" \
  tests/gpu/test_step_kernels_gpu.py tests/gpu/test_gdn_layer_gpu.py tests/gpu/test_step_rewrite_gpu.py \
  tests/gpu/test_batched_commit_gpu.py tests/gpu/test_full_graph_kernels_gpu.py

SIZES=(--n 17 33 65 --batch 1 2 8 32 --budget-s 10)
gpu_step tfm_sizes 90 python3 bench/gdn_tree.py "${SIZES[@]}" --out "$OUT/tfm_sizes.json"
gpu_step tfm_sizes_fixed 90 python3 bench/gdn_tree.py "${SIZES[@]}" --fixed-plan --out "$OUT/tfm_sizes_fixed.json"
gpu_step tfm_sizes_fixed_bound 90 python3 bench/gdn_tree.py "${SIZES[@]}" --fixed-plan --depth-bound "$DEPTH_BOUND" \
  --out "$OUT/tfm_sizes_fixed_bound.json"

echo
echo "== summary ($(( $(date +%s) - GPU_STEPS_START ))s)"
grep -E "passed|failed|error|skipped" "$OUT/pytest.log" | tail -n 1
gpu_steps_summary
for t in tfm_sizes tfm_sizes_fixed tfm_sizes_fixed_bound; do
  if [ -f "$OUT/$t.txt" ]; then
    echo
    echo "== $t"
    head -n 20 "$OUT/$t.txt"
  fi
done

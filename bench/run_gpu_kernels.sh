#!/usr/bin/env bash
# One command for the GPU host, per kernel family: CUDA kernel tests, compute-sanitizer (memcheck +
# racecheck) on a small case, and the benchmark. Run from the repository root with $OUT set (after
# `source .gpu-bundle/install.sh` so that vLLM is importable for the baselines):
#
#     bash bench/run_gpu_kernels.sh                  # GDN tree verify / commit / conv (bench/gdn_tree.py)
#     bash bench/run_gpu_kernels.sh tree_attention   # tree attention (bench/tree_attention.py)
#     bash bench/run_gpu_kernels.sh kv_compact       # the K/V compaction of the commit (bench/kv_compact.py)
#
# Writes under $OUT: pytest.log/.xml, memcheck.log, racecheck.log, bench.log, <family>.json,
# <family>.txt (gdn_tree / tree_attention), env.txt. Whole run bounded by TOTAL_S (default 500 s);
# each step gets a timeout from what is left. Prints a status line per step, then the benchmark
# table last.
set -uo pipefail

FAMILY=${1:-gdn_tree}
case "$FAMILY" in
  gdn_tree)        TESTS=tests/gpu/test_kernels_gdn.py; T_PYTEST=210; T_MEM=90; T_RACE=120; T_BENCH=300; BENCH_SHARE=6 ;;
  tree_attention)  TESTS=tests/gpu/test_kernels_tree_attention.py; T_PYTEST=170; T_MEM=75; T_RACE=90; T_BENCH=240; BENCH_SHARE=7 ;;
  kv_compact)      TESTS=tests/gpu/test_kv_compact_gpu.py; T_PYTEST=60; T_MEM=60; T_RACE=60; T_BENCH=60; BENCH_SHARE=8 ;;
  *) echo "usage: bash bench/run_gpu_kernels.sh [gdn_tree|tree_attention|kv_compact]" >&2; exit 2 ;;
esac
BENCH=bench/$FAMILY.py
OUT=${OUT:-/tmp/vllm_tfm_out}
TOTAL_S=${TOTAL_S:-500}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

# Use this checkout's code and CUDA sources (the pip-installed copy has no cuda/ folder).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_TFM_CUDA_DIR="$PWD/cuda"
export VLLM_TFM_CACHE=${VLLM_TFM_CACHE:-/tmp/vllm_tfm_kernel_cache}
export PYTHONUNBUFFERED=1

# shellcheck source=bench/gpu_common.sh
source bench/gpu_common.sh
gpu_steps_begin
left() { gpu_left; }
step() { gpu_step "$@"; }

{
  date
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cuda-bindings', cuda.bindings.__version__)"
  python3 -c "from vllm_tfm.kernels import loader; print('kernels:', loader.kernels_unavailable_reason() or 'available', 'nvrtc', loader.nvrtc_version())"
  python3 -c "import vllm, triton; print('vllm', vllm.__version__, 'triton', triton.__version__)"
  command -v compute-sanitizer
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. kernels vs the reference (compiles every variant once, into $VLLM_TFM_CACHE)
step pytest "$T_PYTEST" python3 -m pytest "$TESTS" -q -p no:cacheprovider --junitxml="$OUT/pytest.xml"

# 2. memory errors and shared-memory races on a small case (every kernel variant once)
export VLLM_TFM_SYNC_LAUNCH=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1  # one cudaMalloc per tensor: exact bounds
step memcheck "$T_MEM" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 python3 "$BENCH" --sanitize-case
step racecheck "$T_RACE" compute-sanitizer --tool racecheck --error-exitcode 3 python3 "$BENCH" --sanitize-case
unset VLLM_TFM_SYNC_LAUNCH PYTORCH_NO_CUDA_MEMORY_CACHING

# 3. benchmark: configurations past --budget-s are skipped (listed in the JSON)
bench_left=$(( $(left) - 15 ))
(( bench_left > T_BENCH )) && bench_left=$T_BENCH
step bench "$bench_left" python3 "$BENCH" --out "$OUT/$FAMILY.json" --budget-s $(( bench_left * BENCH_SHARE / 10 ))

echo
echo "== summary ($(( $(date +%s) - GPU_STEPS_START ))s)"
grep -E "passed|failed|error|skipped" "$OUT/pytest.log" | tail -n 1
gpu_steps_summary
grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/memcheck.log" "$OUT/racecheck.log" 2>/dev/null
if [ -f "$OUT/$FAMILY.txt" ]; then
  echo
  cat "$OUT/$FAMILY.txt"
else
  echo "no benchmark table (see $OUT/bench.log)"
  tail -n 20 "$OUT/bench.log" 2>/dev/null
fi

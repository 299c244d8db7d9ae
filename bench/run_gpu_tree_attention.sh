#!/usr/bin/env bash
# One command for the GPU host: tree attention kernel tests, compute-sanitizer (memcheck +
# racecheck) on the sanitize case, and the benchmark (bench/tree_attention.py). Run from the
# repository root with $OUT set, after `source .gpu-bundle/install.sh` (vLLM for the Triton
# baselines):
#
#     bash bench/run_gpu_tree_attention.sh
#
# Writes under $OUT: pytest.log/.xml, memcheck.log, racecheck.log, bench.log, tree_attention.json,
# tree_attention.txt, env.txt. Whole run bounded by TOTAL_S (default 460 s); each step gets a
# timeout from what is left. Prints a status line per step, then the benchmark table last.
set -uo pipefail

OUT=${OUT:-/tmp/vllm_tfm_out}
TOTAL_S=${TOTAL_S:-460}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

# Use this checkout's code and CUDA sources (the pip-installed copy has no cuda/ folder).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_TFM_CUDA_DIR="$PWD/cuda"
export VLLM_TFM_CACHE=${VLLM_TFM_CACHE:-/tmp/vllm_tfm_kernel_cache}
export PYTHONUNBUFFERED=1

start=$(date +%s)
statuses=()
left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }

# step NAME MAX_SECONDS CMD...: run with a timeout of min(MAX, time left), log to $OUT/NAME.log
step() {
  local name=$1 max=$2
  shift 2
  local budget
  budget=$(left)
  (( budget > max )) && budget=$max
  if (( budget < 20 )); then
    statuses+=("$name: skipped (time budget spent)")
    return
  fi
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$budget" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - t0 ))
  local what="ok"
  (( rc == 124 || rc == 137 )) && what="TIMED OUT after ${budget}s"
  (( rc != 0 && rc != 124 && rc != 137 )) && what="FAILED rc=$rc"
  statuses+=("$name: $what (${took}s) -> $OUT/$name.log")
  echo "== $name: $what (${took}s)"
  tail -n 4 "$OUT/$name.log"
}

{
  date
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cuda-bindings', cuda.bindings.__version__)"
  python3 -c "from vllm_tfm.kernels import loader; print('kernels:', loader.kernels_unavailable_reason() or 'available', 'nvrtc', loader.nvrtc_version())"
  python3 -c "import vllm, triton; print('vllm', vllm.__version__, 'triton', triton.__version__)"
  command -v compute-sanitizer
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. kernel vs the float64 reference, and the runtime's kernel path vs its per-request Triton path
#    (compiles every variant once, into $VLLM_TFM_CACHE)
step pytest 170 python3 -m pytest tests/gpu/test_kernels_tree_attention.py -q -p no:cacheprovider --junitxml="$OUT/pytest.xml"

# 2. memory errors and shared-memory races: every variant once on exactly sized tensors
export VLLM_TFM_SYNC_LAUNCH=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1  # one cudaMalloc per tensor: exact bounds
step memcheck 75 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 python3 bench/tree_attention.py --sanitize-case
step racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 3 python3 bench/tree_attention.py --sanitize-case
unset VLLM_TFM_SYNC_LAUNCH PYTORCH_NO_CUDA_MEMORY_CACHING

# 3. benchmark: configurations past --budget-s are skipped (listed in the JSON)
bench_left=$(( $(left) - 15 ))
(( bench_left > 240 )) && bench_left=240
step bench "$bench_left" python3 bench/tree_attention.py --out "$OUT/tree_attention.json" --budget-s $(( bench_left * 7 / 10 ))

echo
echo "== summary ($(( $(date +%s) - start ))s)"
grep -E "passed|failed|error|skipped" "$OUT/pytest.log" | tail -n 1
for s in "${statuses[@]}"; do echo "$s"; done
grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/memcheck.log" "$OUT/racecheck.log" 2>/dev/null
if [ -f "$OUT/tree_attention.txt" ]; then
  echo
  cat "$OUT/tree_attention.txt"
else
  echo "no benchmark table (see $OUT/bench.log)"
  tail -n 20 "$OUT/bench.log" 2>/dev/null
fi

#!/usr/bin/env bash
# One GPU-host command for the Weaver stack kernel (cuda/weaver_stack.cu, VLLM_TFM_WEAVER_STACK), measurements
# first: bench/weaver_stack.py (the stack against the per-op path, rows 1-16), bench/weaver_profile.py (the whole
# build, kernel by kernel) with the stack off and on, then the GPU tests (the stack's, the per-op kernels'
# (attention, linear) and the Weaver graphs'), then compute-sanitizer memcheck on a small case. Run from the
# repository root (carry .gpu-bundle), $OUT set:
#
#     bash bench/run_gpu_weaver_stack.sh
#
# Writes $OUT/weaver_stack.json, $OUT/weaver_profile_stack{0,1}.json and $OUT/logs.tgz (pytest, sanitizer,
# bench and profile logs). About 5 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/weaver-stack-out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
# shellcheck source=bench/gpu_common.sh
source bench/gpu_common.sh
gpu_setup "$LOGS"
rc=0
timeout 150 python3 bench/weaver_stack.py --out "$OUT/weaver_stack.json" >"$LOGS/bench.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
echo "bench exit code $s"; grep -v Warn "$LOGS/bench.log"
cases=${PROFILE_CASES:-1:16:2,8:16:2,1:32:4}
for on in 0 1; do
  VLLM_TFM_WEAVER_STACK=$on timeout 120 python3 bench/weaver_profile.py --cases "$cases" \
      --out "$OUT/weaver_profile_stack$on.json" --top 12 >"$LOGS/profile_stack$on.log" 2>&1
  s=$?; (( s != 0 )) && rc=$s
  echo "profile (stack $on) exit code $s"; grep -h "^R=" "$LOGS/profile_stack$on.log"
done
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_weaver_stack_gpu.py tests/gpu/test_weaver_attention_gpu.py \
    tests/gpu/test_weaver_linear_gpu.py tests/gpu/test_weaver_graphs_gpu.py >"$LOGS/pytest.log" 2>&1 || rc=$?
echo "gpu tests exit code $rc"; tail -4 "$LOGS/pytest.log"
# memcheck last (a cooperative kernel spinning at grid barriers under the tool is the one step that could hang;
# racecheck's subject, shared memory, is per-lane here but for the attention stage, sanitized as its own kernel)
VLLM_TFM_SYNC_LAUNCH=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck \
    --report-api-errors no --error-exitcode 3 python3 bench/weaver_stack.py --sanitize-case >"$LOGS/memcheck.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
echo "memcheck exit code $s"; tail -3 "$LOGS/memcheck.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit $rc

#!/usr/bin/env bash
# One GPU-host command for the Weaver scorer's fused linear-layer kernel (cuda/weaver_linear.cu): its
# GPU tests with the candidate-score, Weaver round, graph and padded-tree tests (whose builds score
# through both kernels), compute-sanitizer memcheck + racecheck on a small case,
# bench/weaver_linear.py (kernel vs RMSNorm + cuBLAS + epilogues at the 27B drafter's layers), and
# bench/weaver_profile.py (the whole build, kernel by kernel) with the kernel and with
# VLLM_TFM_WEAVER_LINEAR_KERNEL=0. Run from the repository root (carry .gpu-bundle), $OUT set:
#
#     bash bench/run_gpu_weaver_linear.sh
#
# Writes $OUT/weaver_linear.json, $OUT/weaver_profile{,_cublas}.json and $OUT/logs.tgz (pytest,
# sanitizer, bench and profile logs). About 4 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/weaver-linear-out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
# shellcheck source=bench/gpu_common.sh
source bench/gpu_common.sh
gpu_setup "$LOGS"
rc=0
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_weaver_linear_gpu.py tests/gpu/test_candidate_scores_gpu.py \
    tests/gpu/test_weaver_round_gpu.py tests/gpu/test_weaver_graphs_gpu.py tests/gpu/test_padded_trees_gpu.py \
    >"$LOGS/pytest.log" 2>&1 || rc=$?
echo "gpu tests exit code $rc"; tail -4 "$LOGS/pytest.log"
gpu_sanitize "$LOGS" python3 bench/weaver_linear.py --sanitize-case || rc=$?
timeout 120 python3 bench/weaver_linear.py --out "$OUT/weaver_linear.json" >"$LOGS/bench.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
echo "bench exit code $s"; cat "$LOGS/bench.log" | grep -v Warn
cases=${PROFILE_CASES:-1:32:2,1:32:4,8:32:2,8:32:4}
timeout 150 python3 bench/weaver_profile.py --cases "$cases" --out "$OUT/weaver_profile.json" --top 12 >"$LOGS/profile.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
VLLM_TFM_WEAVER_LINEAR_KERNEL=0 timeout 150 python3 bench/weaver_profile.py --cases "$cases" \
    --out "$OUT/weaver_profile_cublas.json" --top 12 >"$LOGS/profile_cublas.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
echo "profiles exit code $rc"; grep -h "^R=" "$LOGS/profile.log" "$LOGS/profile_cublas.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit $rc

#!/usr/bin/env bash
# One GPU-host command for the Weaver scorer's node-attention kernel (cuda/weaver_attention.cu) and
# the round kernel's shared-memory selection (cuda/weaver_round.cu): their GPU tests with the other
# Weaver kernel, graph and padded-tree tests (whose builds run through every kernel),
# compute-sanitizer memcheck + racecheck on both kernels' small cases, bench/weaver_attention.py
# (kernel vs the torch path at the 27B drafter's layer), and bench/weaver_profile.py (the whole
# build, kernel by kernel) with the kernel and with VLLM_TFM_WEAVER_ATTENTION_KERNEL=0. Run from the
# repository root (carry .gpu-bundle), $OUT set:
#
#     bash bench/run_gpu_weaver_attention.sh
#
# Writes $OUT/weaver_attention.json, $OUT/weaver_profile{,_torch_attention}.json and $OUT/logs.tgz
# (pytest, sanitizer, bench and profile logs). About 5 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/weaver-attention-out}
LOGS="$OUT/logs"
mkdir -p "$LOGS/attention" "$LOGS/round"
# shellcheck source=bench/gpu_common.sh
source bench/gpu_common.sh
gpu_setup "$LOGS"
rc=0
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_weaver_attention_gpu.py tests/gpu/test_weaver_round_gpu.py \
    tests/gpu/test_weaver_linear_gpu.py tests/gpu/test_candidate_scores_gpu.py tests/gpu/test_weaver_graphs_gpu.py \
    tests/gpu/test_padded_trees_gpu.py >"$LOGS/pytest.log" 2>&1 || rc=$?
echo "gpu tests exit code $rc"; grep -E "passed|failed|error" "$LOGS/pytest.log" | tail -12
gpu_sanitize "$LOGS/attention" python3 bench/weaver_attention.py --sanitize-case || rc=$?
gpu_sanitize "$LOGS/round" python3 bench/weaver_round.py --sanitize-case || rc=$?
timeout 120 python3 bench/weaver_attention.py --out "$OUT/weaver_attention.json" >"$LOGS/bench.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
echo "bench exit code $s"; grep -v Warn "$LOGS/bench.log"
cases=${PROFILE_CASES:-1:32:2,1:32:4,8:32:2,8:32:4}
timeout 150 python3 bench/weaver_profile.py --cases "$cases" --out "$OUT/weaver_profile.json" --top 12 >"$LOGS/profile.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
VLLM_TFM_WEAVER_ATTENTION_KERNEL=0 timeout 150 python3 bench/weaver_profile.py --cases "$cases" \
    --out "$OUT/weaver_profile_torch_attention.json" --top 12 >"$LOGS/profile_torch_attention.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
echo "profiles exit code $rc"; grep -h "^R=" "$LOGS/profile.log" "$LOGS/profile_torch_attention.log"
grep -h "weaver_round\|weaver_node_attention" "$LOGS/profile.log" | head -8
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit $rc

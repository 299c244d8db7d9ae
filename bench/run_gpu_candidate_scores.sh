#!/usr/bin/env bash
# One GPU-host command for the Weaver scorer's candidate-score kernel (cuda/candidate_scores.cu): its
# GPU tests with the Weaver round / graph / padded-tree tests (whose builds now score through it),
# compute-sanitizer memcheck + racecheck on a small case, bench/candidate_scores.py (kernel vs torch
# reference at the 27B drafter shape), and bench/weaver_profile.py (the whole build, kernel by
# kernel) with the kernel and with VLLM_TFM_CANDIDATE_KERNEL=0. Run from the repository root (carry
# .gpu-bundle), $OUT set:
#
#     bash bench/run_gpu_candidate_scores.sh
#
# Writes $OUT/candidate_scores.json, $OUT/weaver_profile{,_torch_candidates}.json and $OUT/logs.tgz
# (pytest, sanitizer, bench and profile logs; the device returns at most 8 files). About 4 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/candidate-scores-out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
# shellcheck source=bench/gpu_common.sh
source bench/gpu_common.sh
gpu_setup "$LOGS"
rc=0
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_candidate_scores_gpu.py tests/gpu/test_weaver_round_gpu.py \
    tests/gpu/test_weaver_graphs_gpu.py tests/gpu/test_padded_trees_gpu.py >"$LOGS/pytest.log" 2>&1 || rc=$?
echo "gpu tests exit code $rc"; tail -4 "$LOGS/pytest.log"
gpu_sanitize "$LOGS" python3 bench/candidate_scores.py --sanitize-case || rc=$?
timeout 120 python3 bench/candidate_scores.py --out "$OUT/candidate_scores.json" >"$LOGS/bench.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
echo "bench exit code $s"; tail -6 "$LOGS/bench.log"
cases=${PROFILE_CASES:-1:32:2,1:32:4,8:32:2,8:32:4}
timeout 150 python3 bench/weaver_profile.py --cases "$cases" --out "$OUT/weaver_profile.json" --top 12 >"$LOGS/profile.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
VLLM_TFM_CANDIDATE_KERNEL=0 timeout 150 python3 bench/weaver_profile.py --cases "$cases" \
    --out "$OUT/weaver_profile_torch_candidates.json" --top 12 >"$LOGS/profile_torch.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
echo "profiles exit code $rc"; grep -h "^R=" "$LOGS/profile.log" "$LOGS/profile_torch.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit $rc

#!/usr/bin/env bash
# One GPU-host command for the Weaver round kernel (cuda/weaver_round.cu): its GPU tests and the
# Weaver-graph tests (which now grow through it), compute-sanitizer memcheck + racecheck on a small
# equality case, then bench/weaver_round.py (27B drafter shape, CUDA graphs, kernel vs torch round).
# Run from the repository root (carry .gpu-bundle), $OUT set:
#
#     bash bench/run_gpu_weaver_round.sh
#
# Writes $OUT/pytest.log, $OUT/memcheck.log, $OUT/racecheck.log, $OUT/weaver_round.json and
# $OUT/bench.log. About 3 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/weaver-round-out}
mkdir -p "$OUT"
# shellcheck source=bench/gpu_common.sh
source bench/gpu_common.sh
gpu_setup "$OUT"
rc=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_weaver_round_gpu.py tests/gpu/test_weaver_graphs_gpu.py \
    tests/gpu/test_padded_trees_gpu.py >"$OUT/pytest.log" 2>&1 || rc=$?
echo "gpu tests exit code $rc"; tail -4 "$OUT/pytest.log"
gpu_sanitize "$OUT" python3 bench/weaver_round.py --sanitize-case || rc=$?
timeout 200 python3 bench/weaver_round.py --out "$OUT/weaver_round.json" >"$OUT/bench.log" 2>&1
s=$?; (( s != 0 )) && rc=$s
echo "bench exit code $s"; tail -8 "$OUT/bench.log"
exit $rc

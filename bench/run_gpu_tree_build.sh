#!/usr/bin/env bash
# One GPU-host command for the lockstep tree builders: the CUDA equality tests, then
# bench/tree_build.py (per-request vs lockstep, R = 8, B = 64, w = 4; evaluation throughput at
# R = 64 anchors, B = 16..128). Run from the repository root (carry .gpu-bundle), $OUT set:
#
#     bash bench/run_gpu_tree_build.sh
#
# Writes $OUT/pytest.log, $OUT/tree_build_cuda.json and $OUT/bench.log. About 3-5 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/tree-build-out}
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .gpu-bundle/install.sh >"$OUT/install.log" 2>&1 || { echo "bundle install failed"; tail -5 "$OUT/install.log"; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
timeout 180 python3 -m pytest -q tests/gpu/test_padded_trees_gpu.py >"$OUT/pytest.log" 2>&1
echo "gpu tests exit code $?"; tail -3 "$OUT/pytest.log"
timeout 360 python3 bench/tree_build.py --device cuda --out "$OUT/tree_build_cuda.json" >"$OUT/bench.log" 2>&1
rc=$?
echo "bench exit code $rc"; tail -60 "$OUT/bench.log"
exit $rc

#!/usr/bin/env bash
# One GPU-host command for the host cost of the TfM (Weaver) tree build: the CUDA-graph equality
# tests, then bench/tree_build_ops.py on CUDA for the current build (eager and replayed as CUDA
# graphs) and the previous one (tests/cpu/_weaver_before.py), R = 1, 8, 32 x B = 16, 32, 64.
# Run from the repository root (carry .gpu-bundle), $OUT set:
#
#     bash bench/run_gpu_tree_build_ops.sh
#
# Writes $OUT/pytest.log, $OUT/tree_build_ops_cuda.json (labels "after" and "before") and
# $OUT/bench_*.log. About 2-4 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/tree-build-ops-out}
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .gpu-bundle/install.sh >"$OUT/install.log" 2>&1 || { echo "bundle install failed"; tail -5 "$OUT/install.log"; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
timeout 200 python3 -m pytest -q tests/gpu/test_weaver_graphs_gpu.py tests/gpu/test_padded_trees_gpu.py >"$OUT/pytest.log" 2>&1
echo "gpu tests exit code $?"; tail -5 "$OUT/pytest.log"
rc=0
timeout 150 python3 bench/tree_build_ops.py --device cuda --graphs --label after --repeats 10 \
    --out "$OUT/tree_build_ops_cuda.json" >"$OUT/bench_after.log" 2>&1 || rc=$?
echo "bench (current, eager + graphs) exit code $rc"; tail -12 "$OUT/bench_after.log"
timeout 120 python3 bench/tree_build_ops.py --device cuda --impl before --label before --repeats 10 \
    --out "$OUT/tree_build_ops_cuda.json" >"$OUT/bench_before.log" 2>&1 || rc=$?
echo "bench (previous, eager) exit code $rc"; tail -12 "$OUT/bench_before.log"
exit $rc

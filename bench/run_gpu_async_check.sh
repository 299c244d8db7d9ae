#!/usr/bin/env bash
# One GPU-host call for bench/NOTES.md section 50's plan fix and asynchronous scheduling (issue 7):
#
#   run (device tool, repository root, carry .gpu-bundle):  bash bench/run_gpu_async_check.sh
#
# 1. graphs: bench/gpu_graphs_e2e.py with the engines that decide it (no-spec eager / PIECEWISE, tfm eager,
#    tfm FULL_AND_PIECEWISE, and both with asynchronous scheduling) at batch 8, batch 1 and in waves (the
#    batch shrinks and is refilled: full tree graphs of a size replay again after another size, which the
#    shared plan region got wrong). Verdicts in $OUT/graphs/graphs.json; its exit code is the bench's.
# 2. diff_full: bench/async_diff.py on the full-graph pair (tfm-fullpw, tfm-fullpw-async), 16 prompts at
#    batch 8: with the fix, no request should diverge.
# 3. diff_eager: bench/async_diff.py on the eager pair (tfm-eager, tfm-eager-async): where the eager
#    asynchronous engine's batch-8 tokens depart, if they do (section 50's 3 of 16, not explained by the fix).
# Each step is bounded, and the whole call, install included, ends within ASYNC_CHECK_TOTAL_S (default 570)
# seconds. $OUT (/tmp/tfm-async-check otherwise) gets summary.txt, graphs.json, async_diff_full.json,
# async_diff_eager.json and logs.tgz (everything else: engine logs and results, probe files), since the device
# tool brings back at most 8 files.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck disable=SC1091
source bench/gpu_common.sh
gpu_call_begin /tmp/tfm-async-check
# shellcheck disable=SC1091
source bench/install_checkout.sh
install_checkout "$W/pip.log" || echo "using the checkout on PYTHONPATH without entry points"
export VLLM_ENABLE_V1_MULTIPROCESSING=0
TOTAL_S=$(( ${ASYNC_CHECK_TOTAL_S:-570} - ($(date +%s) - start) - 15 ))  # 15 s for the packing at the end
gpu_steps_begin
engines=nospec-eager,nospec-graphs,tfm-eager,tfm-fullpw,tfm-eager-async,tfm-fullpw-async
OUT=$W TFM_GRAPHS_DEADLINE_S=${TFM_GRAPHS_DEADLINE_S:-330} gpu_step graphs 345 \
    python3 bench/gpu_graphs_e2e.py --out "$W/graphs" --engines "$engines"
graphs_ok=$(grep -c "^graphs: ok" <<<"${GPU_STATUSES[-1]}")
OUT=$W gpu_step diff_full 150 python3 bench/async_diff.py --out "$W/diff_full" --b1-prompts 0 --prompts 16
OUT=$W gpu_step diff_eager 150 python3 bench/async_diff.py --out "$W/diff_eager" --b1-prompts 0 --prompts 16 \
    --engines tfm-eager,tfm-eager-async
gpu_steps_summary | tee "$OUT/summary.txt"
cp "$W/graphs/graphs.json" "$OUT/graphs.json" 2>/dev/null
cp "$W/diff_full/async_diff.json" "$OUT/async_diff_full.json" 2>/dev/null
cp "$W/diff_eager/async_diff.json" "$OUT/async_diff_eager.json" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$W" . && rm -rf "$W"
(( graphs_ok == 1 ))

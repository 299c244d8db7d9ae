#!/usr/bin/env bash
# One GPU-host call for version 6's phase overlap (-DG6_OVERLAP=1, bench/NOTES.md section 55):
#
#   run (device tool, repository root, carry .gpu-bundle):  bash bench/run_gpu_gdn_overlap.sh
#
# 1. tests: version 6's GPU tests (tests/gpu/test_kernels_gdn.py -k v6), the overlap's bit-for-bit test among them;
# 2. compute-sanitizer memcheck and racecheck on bench/gdn_tree.py --sanitize-case (every kernel, the overlap with
#    clusters of 2 and 1, at 512 and 256 threads);
# 3. the timelines at n = 128, batches 1 and 8, the path solve: the default, then -DG6_OVERLAP=1 (prediction: CTA
#    21.4 -> ~18 us, call 25.2 -> ~22 us at batch 1).
# Bounded by GDN_OVERLAP_TOTAL_S (default 560) seconds; $OUT (/tmp/tfm-gdn-overlap otherwise) gets the logs, the two
# timeline JSON files and summary.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck disable=SC1091
source bench/gpu_common.sh
gpu_call_begin /tmp/tfm-gdn-overlap
TOTAL_S=$(( ${GDN_OVERLAP_TOTAL_S:-560} - ($(date +%s) - start) - 10 ))
gpu_steps_begin
gpu_step tests 200 python3 -m pytest -q tests/gpu/test_kernels_gdn.py -k v6
if (( $(gpu_left) > 60 )); then  # a shell function: its own timeouts (120 s per tool)
  gpu_sanitize "$W" python3 bench/gdn_tree.py --sanitize-case > "$OUT/sanitize.log" 2>&1
  GPU_STATUSES+=("sanitize: exit code $? -> $OUT/sanitize.log")
else
  GPU_STATUSES+=("sanitize: skipped (time budget spent)")
fi
timeline=(python3 bench/gdn_timeline.py --n 128 --batch 1 8 --reps 30 --solve paths)
gpu_step timeline_default 90 "${timeline[@]}" --out "$OUT/gdn_timeline_default.json"
gpu_step timeline_overlap 90 "${timeline[@]}" --define G6_OVERLAP=1 --out "$OUT/gdn_timeline_overlap.json"
gpu_steps_summary | tee "$OUT/summary.txt"
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$W"/memcheck.log "$W"/racecheck.log 2>/dev/null | tee -a "$OUT/summary.txt"
cp "$W"/memcheck.log "$W"/racecheck.log "$OUT/" 2>/dev/null
rm -rf "$W"

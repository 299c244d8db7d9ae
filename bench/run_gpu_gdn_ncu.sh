#!/usr/bin/env bash
# One GPU-host call: Nsight Compute on verify version 6 at the 27B shape, n = 128, batch 1, path solve (issue 5,
# bench/NOTES.md section 56: where each phase's warps stall).
#
#   run (device tool, repository root, carry .gpu-bundle):  bash bench/run_gpu_gdn_ncu.sh
#
# Profiles one launch of gdn_tree_verify_grouped inside bench/gdn_timeline.py (clocks not locked, so the numbers
# read like the timelines'), then prints the report's details page and its per-SASS-instruction source page
# (warp stall samples per instruction) as text, and that page split at the kernel's barriers
# (bench/ncu_sass_segments.py). $OUT (/tmp/tfm-gdn-ncu otherwise): ncu_run.log, details.txt, source_sass.csv,
# segments.txt, segments.json, v6.ncu-rep.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck disable=SC1091
source bench/gpu_common.sh
gpu_call_begin /tmp/tfm-gdn-ncu
timeout 300 ncu --kernel-name gdn_tree_verify_grouped --launch-skip 3 --launch-count 1 --set full \
  --clock-control none --import-source yes -f -o "$OUT/v6" \
  python3 bench/gdn_timeline.py --n 128 --batch 1 --reps 5 --solve paths --out "$W/timeline.json" \
  > "$OUT/ncu_run.log" 2>&1
echo "ncu exit code $?"; tail -5 "$OUT/ncu_run.log"
ncu -i "$OUT/v6.ncu-rep" --page details > "$OUT/details.txt" 2>&1; echo "details exit code $?"
ncu -i "$OUT/v6.ncu-rep" --page source --csv --print-source sass > "$OUT/source_sass.csv" 2>&1
echo "source exit code $?"; head -c 600 "$OUT/source_sass.csv"; echo
python3 bench/ncu_sass_segments.py "$OUT/source_sass.csv" --json "$OUT/segments.json" | tee "$OUT/segments.txt"
grep -iE "Duration|Warp Cycles Per Issued|Issue Slots Busy|Stall|Shared Memory|L2 Hit|Achieved Occupancy" \
  "$OUT/details.txt" | head -60
rm -rf "$W"

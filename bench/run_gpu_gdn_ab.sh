#!/usr/bin/env bash
# One GPU-host call: verify version 6 of the working tree against a base version of the kernel on the same machine
# (issue 5; a branch's timing against main's, bench/NOTES.md section 56):
#
#   here, once:  mkdir -p .base && git show REV:cuda/gdn_tree_verify_grouped.cu > .base/gdn_tree_verify_grouped.cu
#   run (device tool, repository root, carry .gpu-bundle and .base):  bash bench/run_gpu_gdn_ab.sh
#
# 1. bench/gdn_timeline.py at n = 128, batches 1 and 8, path solve: the working tree's kernel, the base's (copied
#    over it, then restored), the working tree's again (the spread between the two runs of one kernel);
# 2. version 6's GPU tests (tests/gpu/test_kernels_gdn.py -k v6) on the working tree's kernel;
# 3. compute-sanitizer memcheck and racecheck on bench/gdn_tree.py --sanitize-case.
# Bounded by GDN_AB_TOTAL_S (default 400) seconds; $OUT (/tmp/tfm-gdn-ab otherwise): summary.txt, t_new.json,
# t_base.json, t_new2.json, tests.log, memcheck.log, racecheck.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
KERNEL=cuda/gdn_tree_verify_grouped.cu
if [ ! -f .base/gdn_tree_verify_grouped.cu ]; then
  echo "no .base/gdn_tree_verify_grouped.cu: make it with git show REV:$KERNEL and carry .base" >&2
  exit 2
fi
# shellcheck disable=SC1091
source bench/gpu_common.sh
gpu_work_begin /tmp/tfm-gdn-ab "${GDN_AB_TOTAL_S:-400}"   # FINAL: what comes back; OUT: the work folder
cp "$KERNEL" "$W/new.cu"
timeline=(python3 bench/gdn_timeline.py --n 128 --batch 1 8 --reps 30 --solve paths)
gpu_step t_new 60 "${timeline[@]}" --out "$FINAL/t_new.json"
cp .base/gdn_tree_verify_grouped.cu "$KERNEL"
gpu_step t_base 60 "${timeline[@]}" --out "$FINAL/t_base.json"
cp "$W/new.cu" "$KERNEL"
gpu_step t_new2 60 "${timeline[@]}" --out "$FINAL/t_new2.json"
gpu_step tests 120 python3 -m pytest -q tests/gpu/test_kernels_gdn.py -k v6
cp "$W/tests.log" "$FINAL/" 2>/dev/null
if (( $(gpu_left) > 60 )); then
  gpu_sanitize "$FINAL" python3 bench/gdn_tree.py --sanitize-case > "$W/sanitize.log" 2>&1
  GPU_STATUSES+=("sanitize: exit code $?")
else
  GPU_STATUSES+=("sanitize: skipped (time budget spent)")
fi
{
  gpu_steps_summary
  for t in t_new t_base t_new2; do echo "== $t"; grep -A3 "   n batch" "$W/$t.log"; done
  grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$FINAL"/memcheck.log "$FINAL"/racecheck.log 2>/dev/null
} | tee "$FINAL/summary.txt"
rm -rf "$W"

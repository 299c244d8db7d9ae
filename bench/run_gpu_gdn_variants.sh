#!/usr/bin/env bash
# One GPU-host call: several versions of verify version 6 timed on one machine, against the working tree's
# (issue 5; branches' kernels and timing-only bounds, bench/NOTES.md section 57):
#
#   here, one file per version:  mkdir -p .variants && git show REV:cuda/gdn_tree_verify_grouped.cu > .variants/NAME.cu
#   run (device tool, repository root, carry .gpu-bundle and .variants):  bash bench/run_gpu_gdn_variants.sh
#
# bench/gdn_timeline.py at n = 128, batches 1 and 8, path solve: the working tree's kernel first, each
# .variants/NAME.cu in name order (copied over cuda/gdn_tree_verify_grouped.cu, which is restored after), the
# working tree's again last (the spread between two runs of one kernel). Timing only: a version's GPU tests and
# sanitizer runs are bench/run_gpu_gdn_ab.sh's. Bounded by GDN_VARIANTS_TOTAL_S (default 480) seconds; $OUT
# (/tmp/tfm-gdn-variants otherwise): summary.txt, t_tree.json, t_NAME.json per version, t_tree2.json (at most
# 5 versions: 8 files come back).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
KERNEL=cuda/gdn_tree_verify_grouped.cu
shopt -s nullglob
variants=(.variants/*.cu)
if (( ${#variants[@]} == 0 || ${#variants[@]} > 5 )); then
  echo "put 1 to 5 versions of $KERNEL in .variants/NAME.cu and carry .variants (found ${#variants[@]})" >&2
  exit 2
fi
# shellcheck disable=SC1091
source bench/gpu_common.sh
gpu_work_begin /tmp/tfm-gdn-variants "${GDN_VARIANTS_TOTAL_S:-480}"   # FINAL: what comes back; OUT: the work folder
cp "$KERNEL" "$W/tree.cu"
timeline=(python3 bench/gdn_timeline.py --n 128 --batch 1 8 --reps 30 --solve paths)
names=(tree)
gpu_step t_tree 60 "${timeline[@]}" --out "$FINAL/t_tree.json"
for f in "${variants[@]}"; do
  name=$(basename "$f" .cu)
  names+=("$name")
  cp "$f" "$KERNEL"
  gpu_step "t_$name" 60 "${timeline[@]}" --out "$FINAL/t_$name.json"
done
cp "$W/tree.cu" "$KERNEL"
names+=(tree2)
gpu_step t_tree2 60 "${timeline[@]}" --out "$FINAL/t_tree2.json"
{
  gpu_steps_summary
  for name in "${names[@]}"; do echo "== $name"; grep -A3 "   n batch" "$W/t_$name.log"; done
} | tee "$FINAL/summary.txt"
rm -rf "$W"

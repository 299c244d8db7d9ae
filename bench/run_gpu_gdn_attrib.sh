#!/usr/bin/env bash
# One GPU-host call attributing verify version 6's time at the 27B shape (issue 5, bench/NOTES.md section 56):
#
#   run (device tool, repository root, carry .gpu-bundle):  bash bench/run_gpu_gdn_attrib.sh
#
# 1. version 6's GPU tests (tests/gpu/test_kernels_gdn.py -k v6);
# 2. bench/gdn_timeline.py (path solve) on the default build at n = 16 .. 128, batches 1 and 8, then at n = 128,
#    batch 1, with parts of the work compiled out (GDN_PROFILE_SKIP, timing only, see the kernel's header): the
#    gram's tiles (1), its k-loop (128), its scatter stores (64), everything but S0's loads (479), everything (511),
#    and the default and the skeleton with clusters of 1.
# Bounded by GDN_ATTRIB_TOTAL_S (default 420) seconds; $OUT (/tmp/tfm-gdn-attrib otherwise) gets summary.txt,
# timelines.txt (every table) and attrib.json (every run's rows, with its command).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck disable=SC1091
source bench/gpu_common.sh
gpu_work_begin /tmp/tfm-gdn-attrib "${GDN_ATTRIB_TOTAL_S:-420}"   # FINAL: what comes back; OUT: the work folder
gpu_step tests 200 python3 -m pytest -q tests/gpu/test_kernels_gdn.py -k v6
timeline=(python3 bench/gdn_timeline.py --reps 30 --solve paths)
gpu_step t_default 60 "${timeline[@]}" --n 16 32 64 128 --batch 1 8 --out "$W/t_default.json"
for skip in 1 128 64 479 511; do
  gpu_step "t_skip$skip" 40 "${timeline[@]}" --n 128 --batch 1 --define "GDN_PROFILE_SKIP=$skip" --out "$W/t_skip$skip.json"
done
gpu_step t_cluster1 40 "${timeline[@]}" --n 128 --batch 1 --cluster 1 --out "$W/t_cluster1.json"
gpu_step t_cluster1_skip511 40 "${timeline[@]}" --n 128 --batch 1 --cluster 1 --define GDN_PROFILE_SKIP=511 \
  --out "$W/t_cluster1_skip511.json"
gpu_steps_summary | tee "$FINAL/summary.txt"
for f in "$W"/t_*.log; do echo "== $(basename "$f" .log)"; cat "$f"; done > "$FINAL/timelines.txt"
python3 - "$W" "$FINAL/attrib.json" <<'PY'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("t_*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps({"command": "bash bench/run_gpu_gdn_attrib.sh", "runs": runs}, indent=1))
PY
cp "$W/tests.log" "$FINAL/" 2>/dev/null
rm -rf "$W"

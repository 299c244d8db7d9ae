#!/usr/bin/env bash
# The GPU-host commands of the serving soak: `vllm serve` with method "tfm" under load, faults and
# bad input (bench/soak.py). One phase per command, each under 9 minutes:
#
#   bash bench/run_gpu_soak.sh soak     [soak.py args]   # load + disconnects + parameter probes, tfm vs no-spec
#   bash bench/run_gpu_soak.sh preempt  [soak.py args]   # small KV cache: preemption with trees in flight
#
# (device tool, repository root, carry .gpu-bundle and .serve-wheels from bench/fetch_serve_wheels.sh;
# --random uses random tiny models instead of the committed toy zoo)
# Unpacks the vLLM bundle, installs this checkout next to it (the plugin loads in `vllm serve`
# through its entry point), then runs the phase. Results: $OUT/soak.json or $OUT/preempt.json,
# server logs $OUT/<role>.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
phase=${1:-soak}
shift || true
OUT=${OUT:-/tmp/tfm-soak-out}
mkdir -p "$OUT"
start=$(date +%s)
echo "== bundle"
# shellcheck disable=SC1091
source .gpu-bundle/install.sh
echo "== install vllm-tfm ($(( $(date +%s) - start )) s)"
if ! python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$GPU_SITE" . >"$OUT/pip.log" 2>&1; then
  echo "pip install of the checkout failed (see pip.log): vllm serve would not load the plugin"
  tail -5 "$OUT/pip.log"
  exit 2
fi
# shellcheck disable=SC1091
source bench/install_serve_wheels.sh   # jmespath + supervisor for `vllm serve` (carry .serve-wheels)
unset VLLM_ENABLE_V1_MULTIPROCESSING
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
echo "== soak phase $phase ($(( $(date +%s) - start )) s)"
python3 bench/soak.py --phase "$phase" --out "$OUT" "$@"
rc=$?
echo "== done in $(( $(date +%s) - start )) s, exit code $rc; files in $OUT:"
ls -la "$OUT"
exit $rc

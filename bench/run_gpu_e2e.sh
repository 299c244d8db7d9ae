#!/usr/bin/env bash
# The one GPU-host command for decode speed at Qwen3.6-27B shape (issue 7): tokens/s at batch 1
# and 8 of no speculation, vLLM's in-tree DFlash (chain, synthetic acceptance) and tfm (B = 16,
# 32, 64, acceptance replay), plus per-stage CUDA-event timings; dummy 27B weights.
#
#   run (device tool, repository root, carry .gpu-bundle):  bash bench/run_gpu_e2e.sh [bench/e2e.py options]
#   e.g.  bash bench/run_gpu_e2e.sh --arms nospec,tfm16,tfm64 --profile bench/results/acceptance.json
#
# Unpacks the vLLM bundle, installs this checkout (entry points included) next to it, then runs
# bench/e2e.py, which starts one engine per arm in its own process and skips arms that would not
# finish before the deadline (printed, with the command that runs them). E2E_DEADLINE_S (default
# 530) bounds the whole command from its start, bundle installation included; the host allows 600.
# Results (e2e_27b.json, e2e.md, arms.log, pip.log) go to $OUT (/tmp/tfm-e2e27-out otherwise).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/tfm-e2e27-out}
export OUT
mkdir -p "$OUT"
start=$(date +%s)
deadline=${E2E_DEADLINE_S:-530}
echo "== bundle"
# shellcheck disable=SC1091
source .gpu-bundle/install.sh
echo "== install vllm-tfm ($(( $(date +%s) - start )) s)"
# shellcheck disable=SC1091
source bench/install_checkout.sh
install_checkout "$OUT/pip.log" || echo "using the checkout on PYTHONPATH without entry points"
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export E2E_COMMAND="$(env | grep "^VLLM_TFM_" | sort | tr "\n" " ")bash bench/run_gpu_e2e.sh $*"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader || true
echo "== GPU checks of the benchmark switches ($(( $(date +%s) - start )) s)"
timeout 60 python3 -m pytest tests/gpu/test_benchmark_gpu.py -q -p no:cacheprovider 2>&1 | tail -n 3
elapsed=$(( $(date +%s) - start ))
echo "== e2e (${elapsed} s; $(( deadline - elapsed )) s left for bench/e2e.py)"
python3 bench/e2e.py --out "$OUT" --deadline-s "$(( deadline - elapsed ))" "$@"
rc=$?
echo "== done in $(( $(date +%s) - start )) s, exit code $rc; files in $OUT:"
ls -la "$OUT"
exit $rc

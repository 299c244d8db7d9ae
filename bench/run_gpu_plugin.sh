#!/usr/bin/env bash
# The one GPU-host command for the tfm runtime inside vLLM 0.26 (issue 6): greedy tfm == no-spec.
#
#   run (device tool, repository root, carry .gpu-bundle):  bash bench/run_gpu_plugin.sh
#
# Unpacks the vLLM bundle, installs this checkout (entry points included) next to it, then runs
# bench/gpu_plugin_e2e.py: random tiny Qwen3.5 hybrid target + DFlash drafter + Weaver in /tmp,
# a no-spec baseline engine, GPU unit checks, and one tfm engine running chain (native and forced
# tree path), ddtree and tfm, with and without oracle-planted branches, batch 8 and 1, float32.
# Logs and results.json go to $OUT (the device tool's output folder; /tmp/tfm-e2e-out otherwise).
# Budget: about 7 minutes (two engine starts); TFM_E2E_DEADLINE_S (default 400) bounds the run.
# Variants (environment; see bench/gpu_plugin_e2e.py's docstring): TFM_E2E_VL=1 runs the target as
# Qwen3_5ForConditionalGeneration (bench/vl_checkpoint.py converts it in the make phase);
# TFM_E2E_SSM_DTYPE=float32 sets mamba_ssm_dtype (float32 GDN state); TFM_E2E_CONTROL=shuffled,alone
# (the default off float32) adds no-spec batch-composition controls to the baseline.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/tfm-e2e-out}
mkdir -p "$OUT"
start=$(date +%s)
echo "== bundle"
# shellcheck disable=SC1091
source .gpu-bundle/install.sh
echo "== install vllm-tfm ($(( $(date +%s) - start )) s)"
# shellcheck disable=SC1091
source bench/install_checkout.sh
install_checkout "$OUT/pip.log" || echo "using the checkout on PYTHONPATH without entry points"
export VLLM_ENABLE_V1_MULTIPROCESSING=0
# float32 runs: every Triton dot product in float32 (Triton's default rounds float32 operands to
# tf32, so vLLM's Triton attention in the no-spec baseline would carry tf32 rounding that the tree
# steps' own float32 attention kernel does not: bench/soak.py's docstring, "Float32")
if [ "${TFM_E2E_DTYPE:-float32}" = float32 ]; then export TRITON_F32_DEFAULT=${TRITON_F32_DEFAULT:-ieee}; fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
echo "== e2e ($(( $(date +%s) - start )) s)"
python3 bench/gpu_plugin_e2e.py --out "$OUT" --phase all
rc=$?
echo "== done in $(( $(date +%s) - start )) s, exit code $rc; files in $OUT:"
ls -la "$OUT"
exit $rc

#!/usr/bin/env bash
# One GPU-host command for the trained toy zoo (zoo/): acceptance evaluation, the vLLM plugin in
# bfloat16, and `vllm serve` with tfm, side by side on the one H200 (one 10-minute host command).
#
#   run (device tool, repository root, carry .gpu-bundle and .serve-wheels):  bash bench/run_gpu_zoo.sh
#
# 1. `vllm-tfm eval` (reference models in PyTorch on CUDA, acceptance by replay): 100 held-out
#    prompts x 256 new tokens, chain / ddtree / treeflash / tfm at B = 16, 32, 64, 128, T = 0 and 1,
#    drafter quality by depth; budget 64 first, cells past ZOO_EVAL_MINUTES are skipped and listed.
# 2. bench/gpu_plugin_e2e.py on the zoo in bfloat16 (greedy cases): identical fraction vs no-spec,
#    with the no-spec batch-8 vs batch-1 control in its baseline. (The float32 run with the
#    sampling chi-square is the same script with TFM_E2E_DTYPE=float32 TFM_E2E_SAMPLING=1.)
# 3. examples/serve_openai.py on the zoo: `vllm serve` with tfm answers OpenAI completions.
# vLLM engines get a fixed KV cache (no memory profiling), so the jobs can share the GPU.
# Outputs in $OUT: acceptance.json, eval.log, plots.tgz, e2e_bf16.tgz, serve.log, run.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/tfm-zoo-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
start=$(date +%s)
# shellcheck disable=SC1091
source .gpu-bundle/install.sh
# shellcheck disable=SC1091
source bench/install_checkout.sh
install_checkout /tmp/pip.log || echo "using the checkout on PYTHONPATH"
# shellcheck disable=SC1091
source bench/install_serve_wheels.sh   # jmespath + supervisor for `vllm serve` (carry .serve-wheels)
export VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
echo "== setup $(( $(date +%s) - start )) s"

timeout 530 python3 -m vllm_tfm.cli eval --zoo zoo --prompts "${ZOO_EVAL_PROMPTS:-100}" \
  --max-new-tokens "${ZOO_EVAL_TOKENS:-256}" --prompt-len 128 --budgets 16,32,64,128 --temperatures 0,1 \
  --device cuda --threads 4 --quality-anchors 32 --deadline-minutes "${ZOO_EVAL_MINUTES:-6.0}" \
  --out "$OUT/acceptance.json" --plots-dir /tmp/zoo-plots >"$OUT/eval.log" 2>&1 &
eval_pid=$!

( timeout 300 python3 examples/serve_openai.py --target zoo/target --drafter zoo/drafter --budget 32 \
    --kv-cache-memory-bytes 4G --max-tokens 48 >"$OUT/serve.log" 2>&1; echo "serve example exit $?" >>"$OUT/serve.log" ) &
serve_pid=$!

mkdir -p /tmp/e2e_bf16
env TFM_E2E_ZOO=zoo TFM_E2E_PROMPTS=32 TFM_E2E_MAX_TOKENS=128 TFM_E2E_BUDGET=32 TFM_E2E_MAX_SEQS=8 \
  TFM_E2E_KV_BYTES=4e9 TFM_E2E_DTYPE=bfloat16 TFM_E2E_CASES=ddtree,tfm,chain-forced TFM_E2E_DEADLINE_S=420 \
  TFM_E2E_DIR=/tmp/tfm-e2e-bf16 timeout 500 python3 bench/gpu_plugin_e2e.py --out /tmp/e2e_bf16 --phase all \
  2>&1 | tee /tmp/e2e_bf16/stdout.log | grep "tfm-e2e\|OK \|FAIL\|DIFF" | grep -v "baseline prompt"
echo "== e2e bf16 done $(( $(date +%s) - start )) s"
wait "$serve_pid"; echo "== serve done $(( $(date +%s) - start )) s"; grep -v "^INFO\|^DEBUG\|^(APIServer" "$OUT/serve.log" | tail -30
wait "$eval_pid"; echo "== eval exit $? at $(( $(date +%s) - start )) s"; tail -70 "$OUT/eval.log"
tar czf "$OUT/e2e_bf16.tgz" -C /tmp e2e_bf16
tar czf "$OUT/plots.tgz" -C /tmp zoo-plots 2>/dev/null || true
ls -la "$OUT"
echo "== total $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# One GPU-host call for the asynchronous soak's failed allowed_token_ids probe (bench/NOTES.md sections 54-55):
#
#   run (device tool, repository root, carry .gpu-bundle):  bash bench/run_gpu_async_params.sh
#
# bench/async_request_params.py three times on the soak's load (64 sequences, 40 background requests, the probes
# allowed / logprobs / min_tokens / sampled / n3 joining the running batch on the soak's probe prompt), with 8
# background requests aborted at step 10 and 8 new ones arriving in the same step: vLLM puts them in the freed
# (lowest) slots and its decode-first reorder then swaps the batch's last rows, the probes', forward. vLLM 0.26's
# InputBatch.swap_states loses the allowed-token mask of the row it moves from i1 (section 55;
# vllm_tfm/vllm_plugin/allowed_token_masks.py fixes it):
# 1. fullpw_async_vllm_masks: full CUDA graphs, asynchronous scheduling, vLLM's own row moves (the patch undone);
# 2. fullpw_async:            the same with the patch (as every engine runs);
# 3. fullpw_sync_vllm_masks:  synchronous scheduling, vLLM's own row moves (whether asynchrony matters).
# Each run's exit code is 1 when the allowed probe got a token outside its ids; its JSON names the step that
# emitted it (path taken, native flags, whether the mask's row was the probe's). Each step is bounded, and the
# whole call, install included, ends within ASYNC_PARAMS_TOTAL_S (default 570) seconds. $OUT
# (/tmp/tfm-async-params otherwise) gets summary.txt, the three JSON files and logs.tgz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck disable=SC1091
source bench/gpu_common.sh
gpu_call_begin /tmp/tfm-async-params
export VLLM_ENABLE_V1_MULTIPROCESSING=0
TOTAL_S=$(( ${ASYNC_PARAMS_TOTAL_S:-570} - ($(date +%s) - start) - 15 ))  # 15 s for the packing at the end
gpu_steps_begin
load=(--max-seqs 64 --background 40 --probes allowed,logprobs,min_tokens,sampled,n3 --abort-step 10 --abort-count 8
      --replace-aborted --soak-probe-prompt)
run_params() {  # NAME MAX_S ENGINE [--without-mask-fix]
  local name=$1 max=$2 engine=$3
  shift 3
  OUT=$W gpu_step "$name" "$max" python3 bench/async_request_params.py --out "$W" --engine "$engine" "$@" "${load[@]}"
}
run_params fullpw_async_vllm_masks 200 tfm-fullpw-async --without-mask-fix
run_params fullpw_async 200 tfm-fullpw-async
run_params fullpw_sync_vllm_masks 150 tfm-fullpw --without-mask-fix
gpu_steps_summary | tee "$OUT/summary.txt"
for e in tfm-fullpw-async-vllm-masks tfm-fullpw-async tfm-fullpw-vllm-masks; do
  cp "$W/async_request_params_$e.json" "$OUT/" 2>/dev/null
done
tar czf "$OUT/logs.tgz" -C "$W" . && rm -rf "$W"

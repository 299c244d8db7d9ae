#!/usr/bin/env bash
# One GPU-host call for the asynchronous soak's failed allowed_token_ids probe (bench/NOTES.md section 54):
#
#   run (device tool, repository root, carry .gpu-bundle):  bash bench/run_gpu_async_params.sh
#
# bench/async_request_params.py three times, nearer the soak than its first run (eager, batch 8, not reproduced):
# 64 sequences, 40 background requests, the probes allowed / logprobs / min_tokens / sampled / n3 joining the
# running batch on the soak's probe prompt (its no-spec answer is known), two background requests aborted mid-run:
# 1. fullpw_async: full CUDA graphs with asynchronous scheduling (the soak's tfm server);
# 2. fullpw_sync:  the same engine scheduling synchronously (the soak of section 53 passed this probe);
# 3. eager_async:  eager with asynchronous scheduling (whether graphs matter).
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
load=(--max-seqs 64 --background 40 --probes allowed,logprobs,min_tokens,sampled,n3 --abort-step 10 --soak-probe-prompt)
OUT=$W gpu_step fullpw_async 240 python3 bench/async_request_params.py --out "$W" --engine tfm-fullpw-async "${load[@]}"
OUT=$W gpu_step fullpw_sync 200 python3 bench/async_request_params.py --out "$W" --engine tfm-fullpw "${load[@]}"
OUT=$W gpu_step eager_async 120 python3 bench/async_request_params.py --out "$W" --engine tfm-eager-async "${load[@]}"
gpu_steps_summary | tee "$OUT/summary.txt"
for e in tfm-fullpw-async tfm-fullpw tfm-eager-async; do
  cp "$W/async_request_params_$e.json" "$OUT/" 2>/dev/null
done
tar czf "$OUT/logs.tgz" -C "$W" . && rm -rf "$W"

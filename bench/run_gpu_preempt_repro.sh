#!/usr/bin/env bash
# The one GPU-host command that tells apart the causes of the greedy divergences of tfm under
# preemption (bench/results/preempt_zoo.json.gz): offline engines on the toy zoo, float32, arms in
# their own subprocesses (bench/gpu_preempt_repro.py: nospec_big reference, tfm_small, tfm_mixed
# (greedy among seeded sampled requests, two aborts, as in the soak), nospec_small, dflash_small,
# then tfm_small_torch and tfm_small_chain_forced only if a tfm small arm diverged, tfm_big last).
# The workload is calibrated so that tfm really preempts (short prompts, long outputs; the
# reasoning is in gpu_preempt_repro.py's docstring); tfm arms run with the request trace on.
#
#   device tool, kind nvidia-h200, repository root, carry ['.gpu-bundle'], timeout 600:
#       bash bench/run_gpu_preempt_repro.sh
#
# Installs this checkout next to vLLM (its entry point loads the plugin), then runs the arms.
# Results in $OUT: preempt_repro.json (commit it gzip-compressed as bench/results/preempt_repro_zoo.json.gz; rewritten
# after every arm), arms.tar.gz (every arm's JSON with all tokens, its log and its request trace),
# run.log, pip.log. Bounded by TFM_PREEMPT_DEADLINE_S (default 470 s) counted from this script's
# start, install included: each arm's cap is its engine start (75 s for the first engine on a
# fresh machine, 40 s after) plus its generation, cut to what is left; arms that would start with
# under 45 s left are skipped. Knobs: TFM_PREEMPT_ARMS (comma list), TFM_PREEMPT_PROMPTS (12),
# TFM_PREEMPT_MAX_TOKENS (768), TFM_PREEMPT_MAX_PROMPT (256), TFM_PREEMPT_CAPACITY (6),
# TFM_PREEMPT_WORKLOAD (preempt | near-max: drafter skipped near max_model_len, big KV arms | stagger |
# plain-front: a plain row in front of spec rows in chain steps, made on purpose), e.g.
#   TFM_PREEMPT_WORKLOAD=near-max TFM_PREEMPT_ARMS=tfm_big,dflash_big,tfm_big_chain bash bench/run_gpu_preempt_repro.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/tfm-preempt-out}
mkdir -p "$OUT"
export TFM_PREEMPT_T0=${TFM_PREEMPT_T0:-$(date +%s)}
export TFM_PREEMPT_COMMAND="$(env | grep -E "^(TFM_PREEMPT|VLLM_TFM)_" | grep -v "^TFM_PREEMPT_T0=" | sort | tr "\n" " ")bash bench/run_gpu_preempt_repro.sh${*:+ $*}"
start=$TFM_PREEMPT_T0

main() {
  echo "== bundle"
  # shellcheck disable=SC1091
  source .gpu-bundle/install.sh || return 2
  echo "== install vllm-tfm ($(( $(date +%s) - start )) s)"
  # shellcheck disable=SC1091
  source bench/install_checkout.sh
  install_checkout "$OUT/pip.log" || return 2   # the tfm method is registered through the entry point
  export HF_HUB_OFFLINE=1
  export VLLM_ENABLE_V1_MULTIPROCESSING=0
  python3 -c "import vllm, vllm_tfm; print('vllm', vllm.__version__, 'vllm_tfm', vllm_tfm.__file__)" || return 2
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
  echo "== arms ($(( $(date +%s) - start )) s)"
  python3 bench/gpu_preempt_repro.py --out "$OUT" --arm all "$@"
  rc=$?
  echo "== done in $(( $(date +%s) - start )) s, exit code $rc; files in $OUT:"
  ls -la "$OUT"
  return $rc
}

main "$@" 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# The one GPU-host command (2 GPUs) for tfm at tensor_parallel_size=2 on vLLM's Ray executor, toy
# zoo, float32 (bench/gpu_tp2_e2e.py): greedy tokens of TP=2 tfm == TP=2 without speculation
# (and == TP=1 tfm), every rank's trees and accepted paths checked equal across the TP group at
# every decode step (VLLM_TFM_CHECK_TP_TREES=1), one Ray actor per rank.
#
#   device tool, kind nvidia-h200-x2, repository root:
#     on a machine where /tmp/gpu-site is already unpacked (an earlier call carried .gpu-bundle),
#     carry ['.ray-bundle']:                 bash bench/run_gpu_tp2.sh [--async-scheduling]
#     or, when both fit one call, carry ['.gpu-bundle', '.ray-bundle']
#   (--target DIR --drafter DIR: other models; default zoo/target and zoo/drafter)
#
# Builds: .gpu-bundle by ../shared/gpu/build_bundle.sh, .ray-bundle by bench/build_ray_bundle.sh.
# Installs this checkout next to vLLM (its vllm.general_plugins entry point is what loads the
# plugin in the Ray actors), then runs the phases. Results: $OUT/tp2_ray_zoo.json (commit it as
# bench/results/tp2_ray_zoo.json), the phase logs, phases.tar.gz (every phase's tokens), run.log.
# Bounded by TFM_TP2_DEADLINE_S (default 505 s) counted from this script's start, install
# included: under 8.5 minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/tfm-tp2-out}
mkdir -p "$OUT"
# NVLink multicast stays off on the shared host: NCCL, PyTorch symmetric memory, NVSHMEM. Exported
# here so every process inherits them (the phases, the local Ray cluster, vLLM's worker actors).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_ALLREDUCE_USE_SYMM_MEM=0   # vLLM's symmetric-memory all-reduce: not needed (float32)
export TFM_TP2_T0=${TFM_TP2_T0:-$(date +%s)}
export TFM_TP2_COMMAND="bash bench/run_gpu_tp2.sh${*:+ $*}"
start=$TFM_TP2_T0

main() {
  echo "== bundles"
  if [ ! -f .ray-bundle/install.sh ]; then
    echo "no .ray-bundle: build it with 'bash bench/build_ray_bundle.sh' and carry it" >&2
    return 2
  fi
  # shellcheck disable=SC1091
  source .ray-bundle/install.sh || return 2   # vLLM (from .gpu-bundle or /tmp/gpu-site), then Ray
  echo "== install vllm-tfm ($(( $(date +%s) - start )) s)"
  # shellcheck disable=SC1091
  source bench/install_checkout.sh
  install_checkout /tmp/tfm-tp2-pip.log || return 2   # Ray actors load the plugin through its entry point
  export HF_HUB_OFFLINE=1
  python3 -c "import ray, vllm, vllm_tfm.serve as s; print('ray', ray.__version__, 'vllm', vllm.__version__, 'tfm entry point', s.plugin_entry_point_installed())" || return 2
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader || true
  if [ "${gpus:-0}" -lt 2 ]; then
    echo "tensor_parallel_size=2 needs 2 GPUs; this machine shows ${gpus:-0} (device kind nvidia-h200-x2)" >&2
    return 2
  fi
  echo "== phases ($(( $(date +%s) - start )) s)"
  python3 bench/gpu_tp2_e2e.py --out "$OUT" --phase all "$@"
  rc=$?
  echo "== done in $(( $(date +%s) - start )) s, exit code $rc; files in $OUT:"
  ls -la "$OUT"
  return $rc
}

main "$@" 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"

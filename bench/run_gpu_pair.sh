#!/usr/bin/env bash
# Two GPU-host commands at once, one per GPU of an nvidia-h200-x2 machine, for the price of one
# call's device time:
#
#   run (device tool, kind nvidia-h200-x2, repository root, carry .gpu-bundle):
#     bash bench/run_gpu_pair.sh 'CMD FOR GPU 0' 'CMD FOR GPU 1'
#   e.g. bash bench/run_gpu_pair.sh 'bash bench/run_gpu_plugin.sh' 'bash bench/run_gpu_e2e.sh --arms nospec,tfm64'
#
# Unpacks the vLLM bundle and installs this checkout once (the runners below then skip their own
# install: two pip installs into one folder would race), then runs each command in its own shell
# with CUDA_VISIBLE_DEVICES set to its GPU and OUT=$OUT/gpu<i>; its console goes to
# $OUT/gpu<i>/console.log. Each command bounds its own time (the runners' deadlines); PAIR_TOTAL_S
# (default 570) kills what is still running so that the logs come back. Prints both consoles' tails,
# then packs each GPU's folder into $OUT/gpu<i>.tar.gz (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/tfm-pair-out}
total=${PAIR_TOTAL_S:-570}
start=$(date +%s)
(( $# == 2 )) || { echo "usage: bash bench/run_gpu_pair.sh 'CMD FOR GPU 0' 'CMD FOR GPU 1'" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_ORDER=PCI_BUS_ID
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .gpu-bundle/install.sh
# shellcheck disable=SC1091
source bench/install_checkout.sh
install_checkout "$OUT/pip.log" || exit 2
export TFM_CHECKOUT_INSTALLED=$PWD
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader || true
echo "== installed in $(( $(date +%s) - start )) s"
pids=()
for i in 0 1; do
  cmd=$([ $i = 0 ] && echo "$1" || echo "$2")
  mkdir -p "$OUT/gpu$i"
  echo "== GPU $i: $cmd"
  ( export CUDA_VISIBLE_DEVICES=$i OUT="$OUT/gpu$i"; exec timeout --kill-after=10 $(( total - ($(date +%s) - start) )) bash -c "$cmd" ) \
    > "$OUT/gpu$i/console.log" 2>&1 &
  pids+=($!)
done
rcs=()
for p in "${pids[@]}"; do wait "$p"; rcs+=($?); done
for i in 0 1; do
  echo "================ GPU $i (exit code ${rcs[$i]}): tail of $OUT/gpu$i/console.log"
  tail -n 40 "$OUT/gpu$i/console.log" | cut -c1-240
done
for i in 0 1; do tar czf "$OUT/gpu$i.tar.gz" -C "$OUT" "gpu$i" && rm -rf "${OUT:?}/gpu$i"; done
echo "== pair done in $(( $(date +%s) - start )) s"
(( rcs[0] == 0 && rcs[1] == 0 ))

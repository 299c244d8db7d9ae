#!/usr/bin/env bash
# The GPU-host commands of the serving soak: `vllm serve` with method "tfm" under load, faults and
# bad input (bench/soak.py). One phase per command on one GPU, each under 9 minutes, or both at
# once on two GPUs:
#
#   bash bench/run_gpu_soak.sh soak     [soak.py args]   # load + disconnects + parameter probes, tfm vs no-spec
#   bash bench/run_gpu_soak.sh preempt  [soak.py args]   # small KV cache: preemption with trees in flight
#   bash bench/run_gpu_soak.sh both     [soak.py args]   # 2 GPUs (kind nvidia-h200-x2): soak on the first,
#                                                        # preempt on the second, at the same time
#   bash bench/run_gpu_soak.sh both --sequential [args]  # one GPU: one after the other (over 10 minutes
#                                                        # with the default deadlines: pass --deadline-s)
#   bash bench/run_gpu_soak.sh soak --nospec-gpu 1 --deadline-s 475 --first-round-share 0.8 --again-requests 400
#                                                        # 2 GPUs: the no-spec server on GPU 1, its load alongside
#                                                        # tfm's: all 2,000 requests and a second round in one call
#                                                        # (bench/results/soak_zoo.json.gz)
#
# (device tool, repository root, carry .gpu-bundle and .serve-wheels from bench/fetch_serve_wheels.sh;
# --random uses random tiny models instead of the committed toy zoo)
# Unpacks the vLLM bundle, installs this checkout next to it (the plugin loads in `vllm serve`
# through its entry point), then runs the phase(s). Results: $OUT/soak.json and/or
# $OUT/preempt.json; server logs $OUT/<role>.log for one phase. With `both`, each phase writes into
# its own folder (both have a server role "nospec"), and what comes back is $OUT/soak.json,
# $OUT/preempt.json, $OUT/soak_driver.log, $OUT/preempt_driver.log and $OUT/server_logs.tar.gz
# (soak/<role>.log, preempt/<role>.log). `both` gives each phase --deadline-s so that the whole
# command ends within TFM_SOAK_TOTAL_S (default 520 s) of its start, install included; a
# --deadline-s of your own wins.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
phase=${1:-soak}
shift || true
OUT=${OUT:-/tmp/tfm-soak-out}
mkdir -p "$OUT"
start=$(date +%s)
total=${TFM_SOAK_TOTAL_S:-520}
# NVLink multicast stays off on the shared host (NCCL, PyTorch symmetric memory, NVSHMEM); every
# process started below inherits these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_ORDER=PCI_BUS_ID   # CUDA's GPU numbers == nvidia-smi's (per-GPU memory readings)

sequential=0
args=()
for a in "$@"; do
  if [ "$a" = "--sequential" ]; then sequential=1; else args+=("$a"); fi
done
case "$phase" in
  soak|preempt) ;;
  both)
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
      IFS=',' read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
    else
      mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ')
    fi
    echo "== both: GPUs ${gpus[*]:-none}"
    if (( ${#gpus[@]} < 2 && ! sequential )); then
      echo "run_gpu_soak.sh both: needs 2 GPUs (soak on one, preempt on the other) and sees ${#gpus[@]}." >&2
      echo "  One after the other they do not fit one 10-minute call: run 'soak' and 'preempt' as two calls," >&2
      echo "  or pass --sequential (with smaller --deadline-s) to run both here in turn." >&2
      exit 2
    fi
    if (( ${#gpus[@]} < 1 )); then
      echo "run_gpu_soak.sh both: no GPU visible" >&2
      exit 2
    fi
    ;;
  *) echo "usage: bash bench/run_gpu_soak.sh soak|preempt|both [--sequential] [soak.py args]" >&2; exit 2 ;;
esac

echo "== bundle"
# shellcheck disable=SC1091
source .gpu-bundle/install.sh
echo "== install vllm-tfm ($(( $(date +%s) - start )) s)"
# shellcheck disable=SC1091
source bench/install_checkout.sh
install_checkout "$OUT/pip.log" || exit 2   # `vllm serve` loads the plugin through its entry point
# shellcheck disable=SC1091
source bench/install_serve_wheels.sh   # jmespath + supervisor for `vllm serve` (carry .serve-wheels)
unset VLLM_ENABLE_V1_MULTIPROCESSING
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader || true

if [ "$phase" != both ]; then
  echo "== soak phase $phase ($(( $(date +%s) - start )) s)"
  python3 bench/soak.py --phase "$phase" --out "$OUT" "${args[@]}"
  rc=$?
  echo "== done in $(( $(date +%s) - start )) s, exit code $rc; files in $OUT:"
  ls -la "$OUT"
  exit $rc
fi

# ---- both: soak and preempt, each in $OUT/<phase>/ with its own GPU (or in turn on one GPU)
left() { echo $(( total - ($(date +%s) - start) )); }
deadline() {  # deadline() PHASE_DEFAULT SECONDS_LEFT_FOR_IT -> --deadline-s for soak.py
  local d=$(( $2 < $1 ? $2 : $1 ))
  echo $(( d < 60 ? 60 : d ))
}
run_one() {  # run_one PHASE GPU DEADLINE: soak.py in the background, its output in $OUT/<phase>_driver.log
  mkdir -p "$OUT/$1"
  echo "== $1 on GPU $2, --deadline-s $3 ($(( $(date +%s) - start )) s)"
  CUDA_VISIBLE_DEVICES=$2 python3 bench/soak.py --phase "$1" --out "$OUT/$1" --deadline-s "$3" "${args[@]}" \
    >"$OUT/$1_driver.log" 2>&1 &
}
margin=25   # stopping the servers and packing the logs
if (( sequential )); then
  half=$(( ($(left) - 2 * margin) / 2 ))
  run_one soak "${gpus[0]}" "$(deadline 450 "$half")"
  wait $!; rc_soak=$?
  run_one preempt "${gpus[0]}" "$(deadline 420 $(( $(left) - margin )))"
  wait $!; rc_preempt=$?
else
  budget=$(( $(left) - margin ))
  run_one soak "${gpus[0]}" "$(deadline 450 "$budget")"
  pid_soak=$!
  run_one preempt "${gpus[1]}" "$(deadline 420 "$budget")"
  pid_preempt=$!
  wait "$pid_soak"; rc_soak=$?
  wait "$pid_preempt"; rc_preempt=$?
fi
for p in soak preempt; do
  echo "== $p driver log (last 40 lines)"
  tail -40 "$OUT/${p}_driver.log"
  if [ -f "$OUT/$p/$p.json" ]; then cp "$OUT/$p/$p.json" "$OUT/$p.json"; else echo "$p: no $p.json"; fi
done
# at most 8 files come back: the servers' logs of both phases travel in one archive
tar czf "$OUT/server_logs.tar.gz" -C "$OUT" soak preempt && rm -rf "${OUT:?}/soak" "${OUT:?}/preempt"
echo "== done in $(( $(date +%s) - start )) s: soak exit code $rc_soak, preempt exit code $rc_preempt; files in $OUT:"
ls -la "$OUT"
(( rc_soak == 0 && rc_preempt == 0 )) && exit 0
exit 1

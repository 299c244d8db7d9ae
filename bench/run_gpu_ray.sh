#!/usr/bin/env bash
# The one GPU-host command for tfm under Ray (one GPU): greedy tfm with
# distributed_executor_backend="ray" (TP=1) == with vLLM's default executor, and a Ray Serve
# OpenAI app from vllm_tfm.serve answering a completion request with tfm (bench/gpu_ray_e2e.py).
#
#   device tool, repository root, one call:   carry ['.gpu-bundle', '.ray-bundle']
#       bash bench/run_gpu_ray.sh [--target DIR --drafter DIR] [--async-scheduling]
#   or, when both bundles do not fit one call (64 MiB with the tracked files):
#       call 1, carry ['.gpu-bundle']:  source .gpu-bundle/install.sh     (unpacks /tmp/gpu-site)
#       call 2 on the still-warm machine, carry ['.ray-bundle']:  bash bench/run_gpu_ray.sh
#
# Builds: .gpu-bundle by ../shared/gpu/build_bundle.sh, .ray-bundle by bench/build_ray_bundle.sh.
# Installs this checkout (with its vllm.general_plugins entry point, which the Ray actors need)
# next to vLLM, then runs the phases: random tiny models (or --target/--drafter, e.g. zoo/target
# and zoo/drafter), default executor, Ray executor, Ray Serve. Logs and ray_results.json go to
# $OUT (the device tool's output folder; /tmp/tfm-ray-out otherwise). Bounded by
# TFM_RAY_DEADLINE_S (default 450 s) plus the install (about a minute on a fresh machine): under
# 9 minutes in all.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/tfm-ray-out}
mkdir -p "$OUT"
start=$(date +%s)
echo "== bundles"
if [ ! -f .ray-bundle/install.sh ]; then
  echo "no .ray-bundle: build it with 'bash bench/build_ray_bundle.sh' and carry it" >&2
  exit 2
fi
# shellcheck disable=SC1091
source .ray-bundle/install.sh || exit 2   # vLLM (from .gpu-bundle or /tmp/gpu-site), then Ray
echo "== install vllm-tfm ($(( $(date +%s) - start )) s)"
# shellcheck disable=SC1091
source bench/install_checkout.sh
install_checkout "$OUT/pip.log" || exit 2   # Ray actors load the plugin through its entry point
# shellcheck disable=SC1091
source bench/install_serve_wheels.sh   # jmespath + supervisor for vLLM's OpenAI server (carry .serve-wheels)
export HF_HUB_OFFLINE=1
python3 -c "import ray, vllm, vllm_tfm.serve as s; print('ray', ray.__version__, 'vllm', vllm.__version__, 'tfm entry point', s.plugin_entry_point_installed())" || exit 2
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
echo "== phases ($(( $(date +%s) - start )) s)"
python3 bench/gpu_ray_e2e.py --out "$OUT" --phase all "$@"
rc=$?
echo "== done in $(( $(date +%s) - start )) s, exit code $rc; files in $OUT:"
ls -la "$OUT"
exit $rc

#!/usr/bin/env bash
# The one GPU-host command for tfm with CUDA graphs (issue 7): greedy tokens with piecewise graphs
# == eager tfm == no speculation, on the toy zoo in float32, batch 8, batch 1 and in waves (a batch that
# shrinks and is refilled, step by step).
#
#   run (device tool, repository root, carry .gpu-bundle):  bash bench/run_gpu_graphs.sh [--engines a,b,...]
#
# Unpacks the vLLM bundle, installs this checkout (entry points included) next to it, runs the CPU
# test of the graph settings (seconds), then bench/gpu_graphs_e2e.py: its engines in parallel (no-spec
# eager / PIECEWISE, tfm eager / PIECEWISE / FULL_AND_PIECEWISE, FULL_AND_PIECEWISE with one switch off each,
# and with asynchronous scheduling, eager and full; its docstring lists them), 32 prompts x 64 tokens each,
# and the verdicts.
# TFM_GRAPHS_DEADLINE_S (default 420) bounds the engines; TFM_GRAPHS_MODELS=random runs random tiny
# models whose GDN layers form two KV-cache groups (the zoo's one) instead of the zoo; TFM_GRAPHS_MODELS=zoo-vl
# the zoo with its target in the vision-language layout (Qwen3.6-27B's architecture).
# Results (graphs.json, <engine>.log, <engine>.json) go to $OUT (/tmp/tfm-graphs-out otherwise).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/tfm-graphs-out}
mkdir -p "$OUT"
start=$(date +%s)
echo "== bundle"
# shellcheck disable=SC1091
source .gpu-bundle/install.sh
echo "== install vllm-tfm ($(( $(date +%s) - start )) s)"
# shellcheck disable=SC1091
source bench/install_checkout.sh
install_checkout "$OUT/pip.log" || echo "using the checkout on PYTHONPATH without entry points"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
echo "== graphs e2e ($(( $(date +%s) - start )) s)"
python3 bench/gpu_graphs_e2e.py --out "$OUT" "$@"
rc=$?
echo "== done in $(( $(date +%s) - start )) s, exit code $rc; files in $OUT:"
ls -la "$OUT"
exit $rc

# Source this on the GPU test host, from the repository root, after the vLLM bundle is unpacked
# (.gpu-bundle/install.sh or .ray-bundle/install.sh set GPU_SITE):
#
#   source bench/install_checkout.sh
#   install_checkout PIP_LOG || exit 2     # or `|| true` where the checkout on PYTHONPATH will do
#
# Installs this checkout into $GPU_SITE next to vLLM, so that every process vLLM starts (engine
# core, `vllm serve`, Ray actors) finds vllm-tfm's `vllm.general_plugins` entry point. --upgrade
# replaces a copy an earlier call left on a still-warm machine (without it pip keeps the old one
# and only warns). Then puts the checkout itself first on PYTHONPATH (bench modules, vllm_tfm).
# TFM_CHECKOUT_INSTALLED=$PWD (set by bench/run_gpu_pair.sh) skips the pip step: two runners
# installing into one $GPU_SITE at once would race.
install_checkout() {
  local log=${1:?usage: install_checkout PIP_LOG}
  if [ "${TFM_CHECKOUT_INSTALLED:-}" = "$PWD" ]; then  # done once by bench/run_gpu_pair.sh for both GPUs
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    return 0
  fi
  if ! python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$GPU_SITE" --upgrade . >"$log" 2>&1; then
    echo "pip install of the checkout failed (see $log): vLLM processes would start without the tfm entry point" >&2
    tail -5 "$log" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    return 1
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

# Shared steps of the GPU-host scripts of the Weaver kernels (bench/run_gpu_weaver_round.sh,
# run_gpu_candidate_scores.sh, run_gpu_weaver_linear.sh). Source it from the repository root.

# gpu_setup LOGDIR: the vLLM bundle (.gpu-bundle, carried), this checkout first on PYTHONPATH,
# unbuffered Python, the GPU's name and memory.
gpu_setup() {
  local logs=$1
  # shellcheck disable=SC1091
  source .gpu-bundle/install.sh >"$logs/install.log" 2>&1 || { echo "bundle install failed"; tail -5 "$logs/install.log"; }
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
}

# gpu_sanitize LOGDIR CMD...: compute-sanitizer memcheck and racecheck on CMD (synchronous launches,
# one cudaMalloc per tensor for exact bounds), LOGDIR/{memcheck,racecheck}.log; prints each tool's
# exit code and summary; returns the last non-zero exit code (0 when both are clean).
gpu_sanitize() {
  local logs=$1 rc=0 s tool
  shift
  for tool in memcheck racecheck; do
    local extra=()
    [[ $tool == memcheck ]] && extra=(--report-api-errors no)
    VLLM_TFM_SYNC_LAUNCH=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 \
        compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 3 "$@" >"$logs/$tool.log" 2>&1
    s=$?
    (( s != 0 )) && rc=$s
    echo "$tool exit code $s"; tail -3 "$logs/$tool.log"
  done
  return $rc
}

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

# gpu_call_begin DEFAULT_OUT: the start of a bounded GPU call (bench/run_gpu_async_check.sh, run_gpu_async_params.sh):
# OUT (DEFAULT_OUT unless set), start (epoch seconds, before the setup), W=$OUT/work created, gpu_setup into it.
gpu_call_begin() {
  OUT=${OUT:-$1}
  start=$(date +%s)
  W="$OUT/work"
  mkdir -p "$W"
  gpu_setup "$W"
}

# gpu_work_begin DEFAULT_OUT TOTAL_SECONDS: gpu_call_begin, then bounded steps whose logs stay in the work
# folder: FINAL = the folder that comes back ($OUT as given), OUT = $W (removed by the caller at the end),
# TOTAL_S = TOTAL_SECONDS less the setup's time and 10 s for the summary, gpu_steps_begin
# (bench/run_gpu_gdn_ab.sh, run_gpu_gdn_attrib.sh, run_gpu_gdn_variants.sh).
gpu_work_begin() {
  gpu_call_begin "$1"
  FINAL=$OUT
  OUT=$W
  TOTAL_S=$(( $2 - ($(date +%s) - start) - 10 ))
  gpu_steps_begin
}

# gpu_sanitize LOGDIR CMD...: compute-sanitizer memcheck and racecheck on CMD (synchronous launches,
# one cudaMalloc per tensor for exact bounds), LOGDIR/{memcheck,racecheck}.log; prints each tool's
# exit code and summary; returns the last non-zero exit code (0 when both are clean). Each tool runs at
# most GPU_SANITIZE_S seconds (default 120; racecheck of version 8's tests takes longer) and only the
# tools in GPU_SANITIZE_TOOLS (default "memcheck racecheck").
gpu_sanitize() {
  local logs=$1 rc=0 s tool
  shift
  for tool in ${GPU_SANITIZE_TOOLS:-memcheck racecheck}; do
    local extra=()
    [[ $tool == memcheck ]] && extra=(--report-api-errors no)
    VLLM_TFM_SYNC_LAUNCH=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${GPU_SANITIZE_S:-120}" \
        compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 3 "$@" >"$logs/$tool.log" 2>&1
    s=$?
    (( s != 0 )) && rc=$s
    echo "$tool exit code $s"; tail -3 "$logs/$tool.log"
  done
  return $rc
}

# Steps of a time-bounded GPU call (bench/run_gpu_kernels.sh, run_gpu_runtime_verify.sh): set OUT and
# TOTAL_S, call gpu_steps_begin, then gpu_step NAME MAX_SECONDS CMD... runs CMD with a timeout of
# min(MAX, seconds left of TOTAL_S), logs to $OUT/NAME.log, prints a status line and the log's last
# lines, and appends the status to GPU_STATUSES (print them with gpu_steps_summary). Steps with less
# than 20 s left are skipped.
gpu_steps_begin() {
  GPU_STEPS_START=$(date +%s)
  GPU_STATUSES=()
}

gpu_left() { echo $(( TOTAL_S - ($(date +%s) - GPU_STEPS_START) )); }

gpu_step() {
  local name=$1 max=$2 budget t0 rc what took
  shift 2
  budget=$(gpu_left)
  (( budget > max )) && budget=$max
  if (( budget < 20 )); then
    GPU_STATUSES+=("$name: skipped (time budget spent)")
    return
  fi
  t0=$(date +%s)
  timeout --kill-after=10 "$budget" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - t0 ))
  what="ok"
  (( rc == 124 || rc == 137 )) && what="TIMED OUT after ${budget}s"
  (( rc != 0 && rc != 124 && rc != 137 )) && what="FAILED rc=$rc"
  GPU_STATUSES+=("$name: $what (${took}s) -> $OUT/$name.log")
  echo "== $name: $what (${took}s)"
  tail -n 4 "$OUT/$name.log"
}

gpu_steps_summary() {
  local s
  for s in "${GPU_STATUSES[@]}"; do echo "$s"; done
}

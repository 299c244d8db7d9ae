# GPU host, sourced after .gpu-bundle/install.sh: install .serve-wheels/ (bench/fetch_serve_wheels.sh)
# into the bundle's site directory, then check that vLLM's OpenAI server imports.
if [ -d .serve-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --target "$GPU_SITE" .serve-wheels/*.whl \
    || echo "installing .serve-wheels failed"
fi
if ! python3 -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
  echo "vllm serve cannot import its OpenAI server here: run bash bench/fetch_serve_wheels.sh on the CPU side and carry .serve-wheels"
  python3 -c "import vllm.entrypoints.openai.api_server" 2>&1 | tail -1
fi

#!/usr/bin/env bash
# Here (CPU side, PyPI reachable): download the pure-Python packages `vllm serve` imports that the
# GPU bundle (../shared/gpu/build_bundle.sh) does not ship. vLLM 0.26's OpenAI server imports
# model_hosting_container_standards, which needs jmespath and supervisor; without them
# `python3 -m vllm.entrypoints.cli.main serve ...` dies at import (seen on the H200 host).
# Output: .serve-wheels/ (ignored by git, ~0.35 MB). Carry it with .gpu-bundle to any GPU-host
# command that starts `vllm serve`; bench/install_serve_wheels.sh installs it there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -rf .serve-wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any --platform manylinux2014_x86_64 -d .serve-wheels jmespath==1.1.0 supervisor==4.3.0
ls -la .serve-wheels

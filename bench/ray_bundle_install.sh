# Source this on the GPU test host, from the repository root:  source .ray-bundle/install.sh
# (bench/build_ray_bundle.sh copies this file into .ray-bundle/.) It unpacks Ray into $RAY_SITE
# (once per machine) and puts it on PYTHONPATH, in front of the vLLM bundle's site.
#
# The vLLM side comes first: .gpu-bundle/install.sh when .gpu-bundle travelled with this call;
# otherwise a /tmp/gpu-site that an earlier call on this (still warm) machine unpacked, which is
# what a second call carrying only .ray-bundle finds (the two bundles together may not fit the
# 64 MiB one call carries).
ray_bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export RAY_SITE=${RAY_SITE:-/tmp/ray-site}
export GPU_SITE=${GPU_SITE:-/tmp/gpu-site}
if [ -f .gpu-bundle/install.sh ]; then
  # shellcheck disable=SC1091
  source .gpu-bundle/install.sh
elif [ -f "$GPU_SITE/.ready" ]; then
  echo "ray bundle: reusing the vLLM bundle unpacked earlier at $GPU_SITE"
  export PYTHONPATH="$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  export VLLM_USE_FLASHINFER_SAMPLER=0
else
  echo "ray bundle: no vLLM found: carry .gpu-bundle in this call or an earlier one on this machine" >&2
  return 1 2>/dev/null || exit 1
fi
if [ ! -f "$RAY_SITE/.ready" ]; then
  mkdir -p "$RAY_SITE"
  tar xJf "$ray_bundle/ray.tar.xz" -C "$RAY_SITE" --strip-components=1
  touch "$RAY_SITE/.ready"
fi
export PYTHONPATH="$RAY_SITE:$PYTHONPATH"
export RAY_USAGE_STATS_ENABLED=0   # no network on the host

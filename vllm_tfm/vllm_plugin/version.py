"""The vLLM version vllm-tfm supports, checked once at plugin registration.

The plugin hooks private V1-runner internals of vLLM 0.26 (see shared/VLLM_HOOKS.md), so any
other vLLM series is refused with one line naming both versions. ``VLLM_TFM_SKIP_VERSION_CHECK=1``
turns the refusal into a warning, for people porting the plugin to a newer vLLM.
"""

from __future__ import annotations

import logging
import os

__all__ = ["SUPPORTED_VLLM_PREFIX", "SKIP_VERSION_CHECK_ENV", "installed_vllm_version", "check_vllm_version"]

logger = logging.getLogger("vllm_tfm")

SUPPORTED_VLLM_PREFIX = "0.26."
"""``vllm.__version__`` must start with this (vLLM 0.26.x)."""

SKIP_VERSION_CHECK_ENV = "VLLM_TFM_SKIP_VERSION_CHECK"


def installed_vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def check_vllm_version() -> str:
    """Return the installed vLLM version; raise RuntimeError (one line) if it is not 0.26.x.

    With ``VLLM_TFM_SKIP_VERSION_CHECK=1`` a mismatch is logged as a warning instead.
    """
    version = installed_vllm_version()
    if version.startswith(SUPPORTED_VLLM_PREFIX):
        return version
    message = (
        f"vllm-tfm supports vLLM {SUPPORTED_VLLM_PREFIX}x only, but vLLM {version} is installed "
        f"(install vllm==0.26.*, or set {SKIP_VERSION_CHECK_ENV}=1 to try anyway)"
    )
    if _truthy(os.environ.get(SKIP_VERSION_CHECK_ENV)):
        logger.warning("%s; continuing because %s is set", message.split(" (install")[0], SKIP_VERSION_CHECK_ENV)
        return version
    raise RuntimeError(message)

"""The four GDN tree operations, from ``vllm_tfm.kernels`` when its NVRTC kernels can run, else the
torch references in ``vllm_tfm.verify`` (same signatures; the kernels are tested against them).
The tree attention kernel (``runtime/attention.py``) follows the same switch.

``set_kernels_enabled(False)``, or ``VLLM_TFM_KERNELS=0`` in the worker's environment, forces the
references in this process (a diagnostic: it tells a kernel bug from a hook bug; the GPU bench
uses it when its kernel check fails).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from vllm_tfm.verify import conv as _conv
from vllm_tfm.verify import gdn as _gdn

from .settings import env_on

__all__ = ["tree_ops", "kernels_in_use", "kernels_enabled", "set_kernels_enabled"]

_NAMES = ("tree_causal_conv1d", "tree_conv_commit", "gdn_tree_verify", "gdn_tree_commit")
_STATE: dict[str, object] = {"enabled": None, "ops": None}  # enabled None: VLLM_TFM_KERNELS decides
KERNELS_ENV = "VLLM_TFM_KERNELS"


def set_kernels_enabled(enabled: bool) -> None:
    """Use the CUDA kernels when they can run (True, the default) or always the references."""
    _STATE["enabled"] = bool(enabled)
    _STATE["ops"] = None


def kernels_enabled() -> bool:
    """False after ``set_kernels_enabled(False)`` or with ``VLLM_TFM_KERNELS=0`` (tree attention then
    keeps vLLM's Triton path too)."""
    if _STATE["enabled"] is None:
        _STATE["enabled"] = env_on(KERNELS_ENV)
    return bool(_STATE["enabled"])


def _reference() -> dict[str, Callable]:
    return {
        "tree_causal_conv1d": _conv.tree_causal_conv1d,
        "tree_conv_commit": _conv.tree_conv_commit,
        "gdn_tree_verify": _gdn.gdn_tree_verify,
        "gdn_tree_commit": _gdn.gdn_tree_commit,
    }


def _kernels() -> dict[str, Callable]:
    if not kernels_enabled():
        return {}
    try:
        from vllm_tfm import kernels  # noqa: PLC0415
    except ImportError:
        return {}
    if not kernels.kernels_available():
        return {}
    return {name: getattr(kernels, name) for name in _NAMES}


def tree_ops() -> SimpleNamespace:
    """Namespace with the four operations, resolved once per process (or per switch)."""
    ops = _STATE["ops"]
    if ops is None:
        table = {**_reference(), **_kernels()}
        ops = SimpleNamespace(**table)
        ops.sources = {n: "kernels" if table[n].__module__.startswith("vllm_tfm.kernels") else "reference" for n in _NAMES}
        _STATE["ops"] = ops
    return ops


def kernels_in_use() -> dict[str, str]:
    """Which implementation each operation uses ("kernels" or "reference")."""
    return dict(tree_ops().sources)

"""What a Ray replica and its vLLM workers need from their environment for tfm to load.

1. The plugin itself: vLLM loads ``vllm.general_plugins`` entry points in every process it starts
   (engine core, workers, Ray actors), from the Python environment of that process. vllm-tfm must
   be *installed* there (``pip install vllm-tfm``, which writes the entry point); a bare copy of
   the package on ``PYTHONPATH`` or in a Ray ``py_modules`` has no entry point and vLLM would
   start without method "tfm". ``VLLM_PLUGINS``, when set, must name ``tfm``.
2. ``VLLM_TFM_*`` variables. Tree options (``VLLM_TFM_PROPOSAL``, ...) are read once, in the process
   that builds the engine config, and then travel inside the config (``vllm_plugin.options``);
   switches (``VLLM_TFM_KERNELS``, ``VLLM_TFM_FORCE_TREE_PATH``, ...) are read in the workers. The
   builder puts both into the replicas' Ray ``runtime_env["env_vars"]``: Ray sets them in the replica
   and in the Ray task where Ray Serve LLM builds the vLLM config, vLLM copies that runtime_env
   onto its Ray worker actors (``parallel_config.ray_runtime_env``), and vLLM's own Ray executors
   copy the engine process's environment to the workers as well (every variable for
   ``RayExecutorV2``, ``VLLM_*`` ones for the legacy executor: ``vllm/ray/ray_env.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib.metadata import entry_points

from vllm_tfm.vllm_plugin.options import ENV_PREFIX, env_overrides

__all__ = [
    "PLUGIN_GROUP",
    "PLUGIN_NAME",
    "PLUGIN_VALUE",
    "check_plugin_loadable",
    "plugin_entry_point_installed",
    "replica_env_vars",
]

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "tfm"
PLUGIN_VALUE = "vllm_tfm:register"


def plugin_entry_point_installed() -> bool:
    """True when this Python environment has vllm-tfm's ``vllm.general_plugins`` entry point."""
    return any(ep.name == PLUGIN_NAME and ep.value == PLUGIN_VALUE for ep in entry_points(group=PLUGIN_GROUP))


def check_plugin_loadable(env: Mapping[str, str]) -> None:
    """Refuse, in one line, an environment in which vLLM would start without the plugin.

    ``env``: the variables the replicas get (their ``VLLM_PLUGINS``, if any, is checked). The entry
    point is checked in this process's environment: the builder runs in the image the replicas
    use, or the deployment installs vllm-tfm itself (``runtime_env={"pip": [...]}``).
    """
    if not plugin_entry_point_installed():
        raise RuntimeError(
            f"vllm-tfm is not installed in this Python environment (no {PLUGIN_GROUP} entry point "
            f"{PLUGIN_NAME!r}): pip install vllm-tfm on every Ray node, or vLLM starts without method 'tfm'"
        )
    allowed = env.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        raise ValueError(f"VLLM_PLUGINS={allowed!r} leaves out {PLUGIN_NAME!r}: vLLM would not load vllm-tfm")


def replica_env_vars(
    explicit: Mapping[str, str],
    runtime_env_vars: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ``env_vars`` of the replicas' runtime_env.

    Later sources win: the builder's own ``VLLM_TFM_*`` variables (``environ``, default
    ``os.environ``), then ``runtime_env_vars`` (the user's runtime_env), then ``explicit``
    (``TfmServeConfig.env``). A ``VLLM_TFM_*`` name that is neither a tree option nor a known
    switch is refused here, with the same one-line message the engine would give.
    """
    source = os.environ if environ is None else environ
    merged = {k: v for k, v in source.items() if k.startswith(ENV_PREFIX)}
    merged.update({str(k): str(v) for k, v in (runtime_env_vars or {}).items()})
    merged.update(explicit)
    env_overrides(merged)  # raises ValueError for an unknown VLLM_TFM_* name
    return merged

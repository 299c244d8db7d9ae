"""Tree settings of one tfm engine, in the worker: which proposal builds the trees, budget, depth.

The tree options are resolved once, in the process that builds the engine config
(``vllm_tfm.vllm_plugin.options``: ``tfm_config.json``, ``VLLM_TFM_<KEY>`` variables, inline
speculative-config keys) and travel to the workers inside the drafter's Hugging Face config;
``TFMProposer`` reads them there (``options.get_tfm_options`` / ``get_drafter_dir``) and turns
them into ``TreeSettings`` here. Two in-process switches come on top:

* ``set_proposal_override(...)``: change the proposal of every tfm engine in this process from the
  next step on (the GPU bench runs chain, ddtree and tfm on one engine);
* ``VLLM_TFM_FORCE_TREE_PATH=1`` (read every step): steps whose trees are all chains still go
  through the tree path (tree GDN verify + commit, tree sampler) instead of vLLM's native chain
  path, so a ``chain`` run exercises every tfm hook.
* ``VLLM_TFM_BATCHED_COMMIT`` (read every step; default on, ``0`` turns it off): the commit of a
  step whose GDN layers are all on the NVRTC kernel path runs as one launch per kernel kind for
  all layers (``vllm_tfm.kernels.batched_commit``) instead of two launches per layer
  (``runtime/commit.py``, ``commit_gdn_layers``). Both write the same states bit for bit
  (tests/gpu/test_batched_commit_gpu.py); on the H200 the batched one cut the commit of a 27B
  step from 10.0 to 3.6 ms (bench/results/e2e_27b_graphs_batched_commit.json.gz in git history at addcf24).

* ``VLLM_TFM_KV_COMPACT_KERNEL`` (read every step; default on, ``0`` turns it off; the switch lives in
  ``runtime/commit.py``, ``set_kv_compact_kernel``): the K/V compaction of the accepted paths runs as
  one NVRTC launch per KV-cache group (``vllm_tfm.kernels.kv_compact``) instead of a gather and a
  scatter per attention layer; both move the same bytes.

* ``VLLM_TFM_GDN_VERIFY`` (read once per step and layer shape, so at capture for CUDA graphs; default
  ``auto``): the GDN tree verify kernel version, ``auto`` picking version 7 for trees of up to 32
  nodes on grids where version 6 takes more than one wave, version 8 for trees of more than 33 nodes whose
  paths it takes (per-step plans) on such grids or of more than 65 nodes, else version 6 where the H200
  measured it faster than version 3 (``kernels.gdn.runtime_verify_variant``), or a version 1-8 for every step.

One debugging switch is read once, when a tfm model runner is built (``trace_settings``):

* ``VLLM_TFM_TRACE=<dir>``: one JSON line per request per step into ``<dir>/trace-<pid>.jsonl``
  (``runtime/trace.py``), at most ``VLLM_TFM_TRACE_MAX_MB`` (default 256) MiB per process.

The budget B (draft nodes per request, root excluded) is vLLM's ``num_speculative_tokens``, the
number of draft tokens that travel to the scheduler every step. The drafter is queried for
``max_depth = min(B, dflash block_size - 1)`` depths of marginals (B when the drafter config names
no block size).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from vllm_tfm.models.tfm_config import TfmConfig
from vllm_tfm.tree.weaver import default_weaver_width

from ..options import VLLM_PROPOSALS

__all__ = [
    "RuntimeSwitch",
    "env_on",
    "env_opted_in",
    "TreeSettings",
    "settings_from_options",
    "set_proposal_override",
    "proposal_override",
    "force_tree_path",
    "batched_commit_enabled",
    "BATCHED_COMMIT_ENV",
    "COMMIT_REUSE_ENV",
    "commit_reuse_enabled",
    "set_commit_reuse",
    "trace_settings",
    "TRACE_MAX_MB_DEFAULT",
]

def env_on(env: str, environ: Mapping[str, str] | None = None) -> bool:
    """An on-by-default environment switch: unset, or set to anything but 0 / false (in ``environ``; None: this
    process's)."""
    return (os.environ if environ is None else environ).get(env, "1") not in ("0", "false", "False")


def env_opted_in(env: str, environ: Mapping[str, str] | None = None) -> bool:
    """An off-by-default environment switch: set to 1 / true (in ``environ``; None: this process's)."""
    return (os.environ if environ is None else environ).get(env, "0").strip().lower() in ("1", "true")


class RuntimeSwitch:
    """A runtime switch read every step: its environment variable unset or not 0 / false (``default_on``, the
    usual form), or set to 1 / true (``default_on=False``: opt-in), unless ``set`` overrode it in this process
    (a same-engine A/B through ``collective_rpc``)."""

    def __init__(self, env: str, setter_name: str, default_on: bool = True) -> None:
        self.env = env
        self._setter_name = setter_name  # the public setter, for the one-line error
        self._override: bool | None = None
        self.default_on = default_on

    def enabled(self) -> bool:
        if self._override is not None:
            return self._override
        return self.enabled_in(os.environ)

    def enabled_in(self, environ: Mapping[str, str]) -> bool:
        """What ``enabled`` says in a process with this environment and no override (the benches' verdicts on
        engines they start with their own environment)."""
        return env_on(self.env, environ) if self.default_on else env_opted_in(self.env, environ)

    def set(self, on: bool | None) -> bool:
        """Override (None: back to the environment's); the setting now in force."""
        if on is not None and not isinstance(on, bool):
            raise ValueError(f"{self._setter_name} takes True, False or None, got {on!r}")
        self._override = on
        return self.enabled()


_OVERRIDE: dict[str, str | None] = {"proposal": None}


def set_proposal_override(proposal: str | None) -> None:
    """Switch the proposal of every tfm engine in this process from the next step on (None: config)."""
    if proposal is not None and proposal not in VLLM_PROPOSALS:
        raise ValueError(f"unknown tfm proposal {proposal!r}; expected one of {VLLM_PROPOSALS}")
    _OVERRIDE["proposal"] = proposal


def proposal_override() -> str | None:
    return _OVERRIDE["proposal"]


def force_tree_path() -> bool:
    return os.environ.get("VLLM_TFM_FORCE_TREE_PATH", "0") not in ("", "0", "false", "False")


BATCHED_COMMIT_ENV = "VLLM_TFM_BATCHED_COMMIT"


def batched_commit_enabled() -> bool:
    """``VLLM_TFM_BATCHED_COMMIT`` is unset or set to something other than 0 / false (default on)."""
    return env_on(BATCHED_COMMIT_ENV)


COMMIT_REUSE_ENV = "VLLM_TFM_COMMIT_REUSE"
_COMMIT_REUSE = RuntimeSwitch(COMMIT_REUSE_ENV, "set_commit_reuse")


def commit_reuse_enabled() -> bool:
    """``VLLM_TFM_COMMIT_REUSE`` unset or not 0 / false (default on), unless ``set_commit_reuse`` overrode it:
    full-graph steps keep the batched commit's index tensors in place and launch its uploaded tables
    again (``step_kernels.CommitReuse``)."""
    return _COMMIT_REUSE.enabled()


def set_commit_reuse(enabled: bool | None) -> None:
    """Override ``VLLM_TFM_COMMIT_REUSE`` in this process (None: back to the environment's); for a
    same-engine A/B (bench/e2e.py --ab-switch commit_reuse, through ``collective_rpc``)."""
    _COMMIT_REUSE.set(enabled)


VERIFY_VERSION_ENV = "VLLM_TFM_GDN_VERIFY"


def verify_version_setting() -> int | None:
    """``VLLM_TFM_GDN_VERIFY``: None (unset or ``auto``: per step, version 8, 7 or 6 where it is faster,
    ``kernels.gdn.runtime_verify_variant``), or a verify kernel version every step runs (1-8; 8 and 7 run version
    6, and 6 version 3, for calls they do not take)."""
    from vllm_tfm.kernels.gdn import VERIFY_VARIANTS

    raw = os.environ.get(VERIFY_VERSION_ENV, "").strip()
    if raw in ("", "auto"):
        return None
    if not raw.isdigit() or int(raw) not in VERIFY_VARIANTS:
        raise ValueError(f"{VERIFY_VERSION_ENV} must be auto or one of {list(VERIFY_VARIANTS)}, got {raw!r}")
    return int(raw)


TRACE_MAX_MB_DEFAULT = 256


def trace_settings() -> tuple[str, int] | None:
    """(directory, byte bound) of the request trace (``VLLM_TFM_TRACE``), or None when it is off."""
    directory = os.environ.get("VLLM_TFM_TRACE", "").strip()
    if not directory or directory in ("0", "false", "False"):
        return None
    raw = os.environ.get("VLLM_TFM_TRACE_MAX_MB", "").strip() or str(TRACE_MAX_MB_DEFAULT)
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"VLLM_TFM_TRACE_MAX_MB must be a number of MiB, got {raw!r}") from None
    if mb <= 0:
        raise ValueError(f"VLLM_TFM_TRACE_MAX_MB must be positive, got {raw!r}")
    return directory, int(mb * (1 << 20))


@dataclass(frozen=True)
class TreeSettings:
    """What the proposer needs each step (all ints are >= 1)."""

    proposal: str
    budget: int
    max_depth: int
    top_k: int
    children_per_node: int
    width: int
    sampling: str
    drafter_dir: str | None
    tfm: TfmConfig

    def current(self) -> "TreeSettings":
        """These settings with the in-process proposal override applied."""
        o = proposal_override()
        return self if o is None or o == self.proposal else replace(self, proposal=o)


def settings_from_options(
    tfm: TfmConfig, drafter_dir: str | None, budget: int, dflash_config: dict | None
) -> TreeSettings:
    """Settings for an engine with the resolved options ``tfm`` and tree budget ``budget``.

    ``dflash_config``: the drafter's ``dflash_config`` dict (its ``block_size`` bounds the depth).
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"tfm needs num_speculative_tokens >= 1 (the tree budget B), got {budget!r}")
    if tfm.proposal not in VLLM_PROPOSALS:
        raise ValueError(f"tfm proposal {tfm.proposal!r} is not available in the vLLM runtime; expected one of {VLLM_PROPOSALS}")
    block = (dflash_config or {}).get("block_size")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 2):
        raise ValueError(f"dflash_config.block_size must be an integer >= 2, got {block!r}")
    return TreeSettings(
        proposal=tfm.proposal,
        budget=budget,
        max_depth=budget if block is None else min(budget, block - 1),
        top_k=tfm.top_k,
        children_per_node=tfm.children_per_node,
        width=tfm.width if tfm.width is not None else default_weaver_width(budget),
        sampling=tfm.sampling,
        drafter_dir=drafter_dir,
        tfm=tfm,
    )

"""Worker-side tree speculative decoding inside vLLM 0.26's V1 GPU model runner, fork-free.

``install()`` is called by ``vllm_tfm.register()`` in every vLLM process after the config patches
(which make ``"method": "tfm"`` a DFlash-like method: ``use_eagle()`` / ``use_dflash()`` true). It
patches, once per process:

* ``TRITON_ATTN`` -> ``attention.TFMTritonAttentionBackend`` (``register_backend``): ancestor mask
  on the target's attention layers during tree-active steps;
* ``QwenGatedDeltaNetAttention._forward_core`` -> ``gdn.tree_forward_core``: tree conv1d + exact
  rollback-free tree verify for the spec rows, no state written;
* ``GDNAttentionMetadataBuilder`` (``gdn_metadata.py``): in tfm engines one GDN metadata build per
  step for all GDN KV-cache groups (the others take it with their block table), and on all-spec
  full-graph steps a build that writes only the values that changed;
* ``GPUModelRunner`` methods (``hooks.py``): the tfm drafter and tree sampler, per-step tree
  metadata and depth positions, the commit after acceptance, step-state lifetime;
* ``GPUModelRunner._determine_batch_execution_and_padding`` (``graph_dispatch.py``): which graph a
  step replays: a tree step replays tfm's own full graph of its size (``full_graphs.py``, mode
  FULL_AND_PIECEWISE) or a piecewise one, never vLLM's chain graphs (``vllm_plugin/cuda_graphs.py``
  for the modes).

One decode step of a tfm engine (sync scheduling; eager, or with piecewise CUDA graphs of the
target and drafter forwards, the tree code running between the graph pieces):

1. ``_prepare_inputs``: vLLM gathers the scheduled drafts (B per request) and computes sequential
   positions and KV slots; the wrapper looks up each request's tree by request id, and on a
   tree-active step writes depth positions (RoPE) and prepares ancestor biases.
2. Forward: attention rows of tree requests are recomputed with their ancestor mask; GDN layers
   verify the spec rows as trees from the committed state and stash deltas.
3. ``_sample``: ``TFMTreeSampler`` walks each tree (greedy argmax walk, or target-only tree
   acceptance for sampled requests) and returns [path..., bonus, -1...] per request.
4. ``_update_states_after_model_execute``: K/V of the accepted path moves to the chain slots;
   GDN state and conv window are committed where vLLM's chain bookkeeping reads them.
5. ``propose_draft_token_ids``: ``TFMProposer`` puts root + accepted path first for the DFlash
   context, gets D marginals from one DFlash forward, builds B-node trees (chain / DDTree /
   Weaver), returns the tokens to vLLM and keeps the parents by request id.
6. Deferred drafts (``deferred_drafts.py``, default on): vLLM's bookkeeping reads the sampled
   tokens' early copy and the scheduler gets placeholder drafts, so the host's bookkeeping,
   scheduling and the next step's input preparation run while the drafter runs; the next step's
   ``_prepare_input_ids`` writes the drafts into the input ids from the device.

Steps without a non-chain tree run vLLM's native chain path unchanged (set
``VLLM_TFM_FORCE_TREE_PATH=1`` to route them through the tree path too).

Debugging switch: ``VLLM_TFM_TRACE=<dir>`` writes one JSON line per request per step
(``trace.py``). Benchmark switches: ``VLLM_TFM_PROFILE=1`` times every stage with CUDA events
(``stage_timing.py``); acceptance replay (``vllm_plugin/benchmark_mode.py``, ``replay.py``)
replaces the verification outcome by draws from a recorded profile.
"""

from __future__ import annotations

__all__ = [
    "install", "is_installed", "snapshot_metrics", "collect_tree_metrics", "flush_trace", "set_deferred_drafts",
    "set_device_topology", "set_commit_reuse", "set_early_sampled_copy", "set_gdn_metadata_fast",
    "set_weaver_lazy_tail", "set_kv_compact_kernel", "set_greedy_accept_kernel", "set_one_slot_commit", "set_topk_kernel",
    "set_prompt_overlap", "set_context_order_kernel", "set_commit_overlap", "set_drafter_graphs",
]


def install() -> None:
    """Apply every runtime patch in this process (idempotent), through the plugin's patch registry
    (``vllm_tfm.vllm_plugin.patching``). Called by ``vllm_tfm.register()`` after its version check."""
    from .attention import install_attention_backend
    from .gdn import install_gdn_patch
    from .gdn_metadata import install_gdn_metadata_patch
    from .graph_dispatch import install_graph_dispatch
    from .hooks import install_profile_hooks, install_runner_hooks

    install_attention_backend()
    install_gdn_patch()
    install_gdn_metadata_patch()
    install_runner_hooks()
    install_graph_dispatch()
    install_profile_hooks()  # only with VLLM_TFM_PROFILE=1 (stage_timing.py)


def is_installed() -> bool:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ..patching import is_patched
    from .graph_dispatch import GRAPH_HOOKS
    from .hooks import RUNNER_HOOKS

    return is_patched(QwenGatedDeltaNetAttention, "_forward_core") and all(
        is_patched(GPUModelRunner, name) for name in (*RUNNER_HOOKS, *GRAPH_HOOKS)
    )


def snapshot_metrics() -> dict | None:
    """Tree counters of the tfm engine in this process (None if none was built here)."""
    from .state import STATE

    if STATE.metrics is None:
        return None
    snap = STATE.metrics.snapshot()
    if STATE.replay is not None:
        snap["acceptance_replay"] = STATE.replay.snapshot()
    return snap


def collect_tree_metrics(worker: object = None, reset: bool = False) -> dict | None:
    """:func:`snapshot_metrics`, then (``reset``) zero the counters and the replay's histograms.
    The signature suits ``LLM.collective_rpc`` (vLLM passes the worker first)."""
    from .state import STATE

    snap = snapshot_metrics()
    if reset:
        if STATE.metrics is not None:
            STATE.metrics.reset()
        if STATE.replay is not None:
            STATE.replay.reset()
    return snap


def set_deferred_drafts(worker: object = None, on: bool | None = None) -> bool:
    """Deferred drafts on or off in this process from the next step on (None: ``VLLM_TFM_DEFERRED_DRAFTS``);
    the setting now in force. The signature suits ``LLM.collective_rpc``."""
    from .deferred_drafts import set_deferred_drafts as _set

    return _set(worker, on)


def set_early_sampled_copy(worker: object = None, on: bool | None = None) -> bool:
    """The sampled tokens' copy queued before the commit (``deferred_drafts.record_sampled_copy``) or after
    it, in this process from the next step on (None: ``VLLM_TFM_EARLY_SAMPLED_COPY``); the setting now in
    force. The signature suits ``LLM.collective_rpc``."""
    from .deferred_drafts import set_early_sampled_copy as _set

    return _set(worker, on)


def set_device_topology(worker: object = None, on: bool | None = None) -> bool:
    """The device-side topology of full-graph steps (``device_topology.py``) on or off in this process
    from the next step on (None: ``VLLM_TFM_DEVICE_TOPOLOGY``); the setting now in force. The
    signature suits ``LLM.collective_rpc``."""
    from .device_topology import device_topology_enabled
    from .device_topology import set_device_topology as _set

    _set(on)
    return device_topology_enabled()


def set_commit_reuse(worker: object = None, on: bool | None = None) -> bool:
    """The commit's reuse across full-graph replays (``step_kernels.CommitReuse``) on or off in this process
    from the next step on (None: ``VLLM_TFM_COMMIT_REUSE``); the setting now in force. The signature
    suits ``LLM.collective_rpc``."""
    from .settings import commit_reuse_enabled
    from .settings import set_commit_reuse as _set

    _set(on)
    return commit_reuse_enabled()


def set_gdn_metadata_fast(worker: object = None, on: bool | None = None) -> bool:
    """The fast GDN metadata build of all-spec full-graph steps (``gdn_metadata.py``) on or off in this
    process from the next step on (None: ``VLLM_TFM_GDN_METADATA_FAST``); the setting now in force. The
    signature suits ``LLM.collective_rpc``."""
    from .gdn_metadata import set_gdn_metadata_fast as _set

    return _set(on)


def set_weaver_lazy_tail(worker: object = None, on: bool | None = None) -> bool:
    """The Weaver graphs' lazy tail check (``weaver_graphs.py``: the forward does not wait for it) on or off
    in this process from the next step on (None: ``VLLM_TFM_WEAVER_LAZY_TAIL``); the setting now in force.
    The signature suits ``LLM.collective_rpc``."""
    from .weaver_graphs import set_weaver_lazy_tail as _set

    return _set(on)


def set_kv_compact_kernel(worker: object = None, on: bool | None = None) -> bool:
    """The one-launch K/V compaction kernel (``commit.py`` ``compact_kv``) on or off in this process from the
    next step on (None: ``VLLM_TFM_KV_COMPACT_KERNEL``); the setting now in force. The signature suits
    ``LLM.collective_rpc``."""
    from .commit import set_kv_compact_kernel as _set

    return _set(on)


def set_greedy_accept_kernel(worker: object = None, on: bool | None = None) -> bool:
    """The one-launch greedy tree acceptance (``sampler.py``, ``vllm_tfm.kernels.greedy_accept``) on or off in this
    process from the next step on (None: ``VLLM_TFM_GREEDY_ACCEPT_KERNEL``); the setting now in force. The
    signature suits ``LLM.collective_rpc``."""
    from .sampler import set_greedy_accept_kernel as _set

    return _set(on)


def set_one_slot_commit(worker: object = None, on: bool | None = None) -> bool:
    """The one-slot commit indices (``step_kernels.py``: slot column 0 and zeros with one GDN state slot per
    request) on or off in this process from the next step on (None: ``VLLM_TFM_ONE_SLOT_COMMIT``); the setting
    now in force. The signature suits ``LLM.collective_rpc``."""
    from .step_kernels import set_one_slot_commit as _set

    return _set(on)


def set_context_order_kernel(worker: object = None, on: bool | None = None) -> bool:
    """The DFlash context order of a tree step's rows in one launch (``drafter_inputs.py``,
    ``vllm_tfm.kernels.context_order``) on or off in this process from the next step on (None:
    ``VLLM_TFM_CONTEXT_ORDER_KERNEL``); the setting now in force. The signature suits ``LLM.collective_rpc``."""
    from .drafter_inputs import set_context_order_kernel as _set

    return _set(on)


def set_topk_kernel(worker: object = None, on: bool | None = None) -> bool:
    """The DFlash top-K kernel of the Weaver build (``vllm_tfm.kernels.topk_rows``) on or off in this process
    from the next build on (None: ``VLLM_TFM_TOPK_KERNEL``); the setting now in force. The Weaver CUDA graphs
    key on it: the first build after a change captures the other setting's graph (a late capture). The
    signature suits ``LLM.collective_rpc``."""
    from .tree_builder_gpu import set_topk_kernel as _set

    return _set(on)


def set_prompt_overlap(worker: object = None, on: bool | None = None) -> bool:
    """The Weaver's prompt pass on its own stream, beside the DFlash top-K (``tree_builder_gpu.prompt_stream``),
    on or off in this process from the next build on (None: ``VLLM_TFM_WEAVER_PROMPT_OVERLAP``); the setting
    now in force. The Weaver CUDA graphs key on it, like ``set_topk_kernel``. The signature suits
    ``LLM.collective_rpc``."""
    from .tree_builder_gpu import set_prompt_overlap as _set

    return _set(on)


def set_commit_overlap(worker: object = None, on: bool | None = None) -> bool:
    """A tree step's commit on its own CUDA stream beside the drafting (``commit_overlap.py``) on or off in this
    process from the next commit on (None: ``VLLM_TFM_COMMIT_OVERLAP``); the setting now in force. The
    signature suits ``LLM.collective_rpc``."""
    from .commit_overlap import set_commit_overlap as _set

    return _set(on)


def set_drafter_graphs(worker: object = None, on: bool | None = None) -> bool:
    """Full CUDA graphs of the DFlash drafter's query forward (``drafter_graphs.py``) on or off in this process
    from the next drafter forward on (None: ``VLLM_TFM_DRAFTER_GRAPHS``); the setting now in force. The signature
    suits ``LLM.collective_rpc``."""
    from .drafter_graphs import set_drafter_graphs as _set

    return _set(on)


def flush_trace(worker: object = None) -> str | None:
    """Write out what the request trace (``VLLM_TFM_TRACE``) buffered in this process; its file, or
    None when no trace is on here. The signature suits ``LLM.collective_rpc``."""
    from .state import STATE

    if STATE.trace is None:
        return None
    STATE.trace.flush()
    return str(STATE.trace.path)

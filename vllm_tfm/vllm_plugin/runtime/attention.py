"""Ancestor-masked attention for tree verification, as a TRITON_ATTN backend override.

vLLM 0.26's Triton unified attention (``v1/attention/ops/triton_unified_attention.py``) masks keys
causally by row: query row i of a request sees the committed context and rows 0..i. Tree nodes
are in topological order, so causal covers every ancestor but also earlier non-ancestors
(siblings, cousins). The kernel accepts one additive ``qq_bias`` [Q, Q] over the query-query
block (rows indexed by the query's position inside its request), shared by every sequence of the
launch, so a per-request mask needs one launch per request (VLLM_HOOKS.md section 4, option a).

``TFMTritonAttentionImpl.forward`` therefore runs vLLM's batched forward for the whole batch
(exact for prefill rows and chain requests) and then recomputes the rows of every request whose
tree is not a chain; when those are all the batch's rows (every request verifies a tree: the
full tree graphs' steps) and the kernel takes them, vLLM's batched forward is skipped:

* kernel path (the default, :data:`DEFAULT_TREE_ATTENTION`; ``VLLM_TFM_TREE_ATTENTION=kernel``):
  ONE launch of ``vllm_tfm.kernels.tree_attention`` for all of
  them, reading the step's ``TreeAttentionPlan`` (ancestor bitmasks, built once per step,
  ``inputs.py``);
* per-request path (``VLLM_TFM_TREE_ATTENTION=triton``, and the fallback: no NVRTC / CUDA kernels,
  ``set_kernels_enabled(False)`` or ``VLLM_TFM_KERNELS=0``, or a configuration the kernel does not take: sliding
  window, soft-cap, ALiBi, sinks, quantised KV cache, head size not a multiple of 32 up to 256):
  one ``unified_attention`` call per tree request carrying the request's [n, n] bias (0 on
  ancestor-or-self pairs, -inf elsewhere). Said once, with the reason.

Only the target model's attention layers are masked: the DFlash drafter's layers (same backend
class) and every step that is not tree-active fall straight through to vLLM. With
``VLLM_TFM_PROFILE=1`` a masked layer's ``forward`` is timed as stage ``attention_layer`` and its
tree rows as ``attention_tree`` (``stage_timing.py``).

The KV of the step was written to the paged cache before ``forward`` (TRITON_ATTN updates the
cache in ``do_kv_cache_update``), at sequential slots ``ctx + j``: the one-request call reads the
same cache through the request's block table row.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
from torch import Tensor

from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
from vllm.v1.attention.ops.triton_unified_attention import unified_attention

from vllm_tfm.kernels.loader import KernelCompileError, KernelLaunchError
from vllm_tfm.kernels.tree_attention import NOT_CUDA, tree_attention_planned, tree_attention_unsupported

from .full_graphs import FullTreeGraphsUnavailable
from .kernels_or_reference import kernels_enabled
from .stage_timing import TIMER
from .state import STATE, AttnTree, StepTree

__all__ = [
    "TFMTritonAttentionBackend",
    "TFMTritonAttentionImpl",
    "BACKEND_PATH",
    "install_attention_backend",
    "kernel_tree_attention",
    "masked_tree_attention",
    "plan_covers_batch",
]

BACKEND_PATH = "vllm_tfm.vllm_plugin.runtime.attention.TFMTritonAttentionBackend"

logger = logging.getLogger("vllm.tfm")  # under vLLM's logger, so the notice shows in its output
_said: set[str] = set()


def _say_fallback(reason: str) -> None:
    """Tell once per reason that tree attention takes the per-request Triton path."""
    if reason in _said:
        return
    _said.add(reason)
    msg = f"vllm_tfm: tree attention runs one Triton call per tree request instead of one kernel launch: {reason}"
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def masked_tree_attention(
    impl: TritonAttentionImpl,
    layer: torch.nn.Module,
    query: Tensor,
    kv_cache: Tensor,
    attn_metadata: object,
    output: Tensor,
    trees: list[AttnTree],
) -> None:
    """Overwrite the rows of each tree request in ``output`` [T, H, hs] with ancestor-masked attention."""
    if is_quantized_kv_cache(impl.kv_cache_dtype) or impl._is_per_token_head_quant:
        raise ValueError(
            f"vllm-tfm tree attention supports unquantised KV caches only, got kv_cache_dtype={impl.kv_cache_dtype!r}"
        )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    kv_heads = key_cache.shape[2]
    k_descale = layer._k_scale.expand((1, kv_heads))
    v_descale = layer._v_scale.expand((1, kv_heads))
    seq_lens = attn_metadata.seq_lens
    block_table = attn_metadata.block_table
    for t in trees:
        s, n, i = t.start, t.n, t.req_index
        unified_attention(
            q=query[s : s + n],
            k=key_cache,
            v=value_cache,
            out=output[s : s + n],
            cu_seqlens_q=t.cu_q,
            max_seqlen_q=n,
            seqused_k=seq_lens[i : i + 1],
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=impl.scale,
            causal=True,
            window_size=impl.sliding_window,
            block_table=block_table[i : i + 1],
            softcap=impl.logits_soft_cap,
            q_descale=None,
            k_descale=k_descale,
            v_descale=v_descale,
            alibi_slopes=impl.alibi_slopes,
            use_alibi_sqrt=impl.use_alibi_sqrt,
            qq_bias=t.bias,
            sinks=impl.sinks,
            chunk_lookback=impl.chunk_lookback,
            use_td=impl.use_td,
        )


TREE_ATTENTION_ENV = "VLLM_TFM_TREE_ATTENTION"
DEFAULT_TREE_ATTENTION = "kernel"
"""The path when ``VLLM_TFM_TREE_ATTENTION`` is unset: the one-launch kernel. Its GPU check passed on
the H200 (``bash bench/run_gpu_kernels.sh tree_attention``: tests against float64, runtime path ==
per-request Triton path, compute-sanitizer memcheck/racecheck clean; tokens of tfm with it ==
no speculation, ``bench/results/graphs_zoo.json.gz``) and it beat the per-request Triton calls at every
measured size (``bench/results/tree_attention_v1.json.gz``). ``VLLM_TFM_TREE_ATTENTION=triton`` goes
back to the per-request calls."""
_CHOSEN = f"{TREE_ATTENTION_ENV}=triton"  # the user's own choice: not warned about


def _config_unsupported(impl: TritonAttentionImpl) -> str | None:
    """Why the tree attention kernel cannot run this layer's configuration (None when it can)."""
    raw = os.environ.get(TREE_ATTENTION_ENV) or None
    choice = raw or DEFAULT_TREE_ATTENTION
    if choice not in ("kernel", "triton"):
        raise ValueError(f"{TREE_ATTENTION_ENV} must be 'kernel' or 'triton', got {choice!r}")
    if choice == "triton":
        return _CHOSEN
    if is_quantized_kv_cache(impl.kv_cache_dtype) or impl._is_per_token_head_quant:
        return f"kv_cache_dtype={impl.kv_cache_dtype!r} (the kernel reads unquantised caches)"
    if tuple(impl.sliding_window) != (-1, -1):
        return f"sliding window {impl.sliding_window}"
    if impl.logits_soft_cap:
        return f"logit soft-cap {impl.logits_soft_cap}"
    if impl.alibi_slopes is not None:
        return "ALiBi slopes"
    if impl.sinks is not None:
        return "attention sinks"
    if getattr(impl, "chunk_lookback", -1) != -1:
        return f"chunked attention (chunk_lookback={impl.chunk_lookback})"
    return None


def kernel_tree_attention(
    impl: TritonAttentionImpl,
    query: Tensor,
    kv_cache: Tensor,
    attn_metadata: object,
    output: Tensor,
    step: StepTree,
) -> bool:
    """Every tree request's rows of ``output`` in one kernel launch; False (nothing done) when the
    kernel cannot run here, after saying why once."""
    if not kernels_enabled():
        return False
    reason = impl.__dict__.get("_tfm_config_reason", False)
    if reason is False:
        reason = impl._tfm_config_reason = _config_unsupported(impl)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    if reason is None:
        reason = tree_attention_unsupported(query, key_cache, value_cache, output)
    if reason is not None:
        if reason not in (NOT_CUDA, _CHOSEN):
            _say_fallback(reason)
        return False
    try:
        bound = getattr(step, "attn_max_seq_len", None)  # a capture: the engine's bound, replayed at every context
        max_seq_len = bound or int(attn_metadata.max_seq_len)
        tree_attention_planned(step.attn_plan, query, key_cache, value_cache, attn_metadata.block_table,
                               attn_metadata.seq_lens, impl.scale, output, max_seq_len, seq_len_bound=bound is not None)
    except (KernelCompileError, KernelLaunchError) as exc:  # nothing was launched: this layer falls back for good
        impl._tfm_config_reason = f"{type(exc).__name__}: {exc}"
        _say_fallback(impl._tfm_config_reason)
        return False
    return True


def plan_covers_batch(plan: object, attn_metadata: object) -> bool:
    """True when the tree plan's rows are every row of the batch (``num_actual_tokens``): no prefill,
    no plain decode, no chain request; vLLM's batched attention has nothing to add then."""
    n = getattr(attn_metadata, "num_actual_tokens", None)
    return plan is not None and n is not None and getattr(plan, "num_rows", -1) == int(n)


class TFMTritonAttentionImpl(TritonAttentionImpl):
    """TRITON_ATTN with the tree mask on the target's layers during tree-active steps."""

    def forward(
        self,
        layer: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata: object,
        output: Tensor,
        output_scale: Tensor | None = None,
        output_block_scale: Tensor | None = None,
    ) -> Tensor:
        step = STATE.step
        if (  # the layer first: the drafter's layers never read the step's plan (built on its first read)
            step is None
            or not step.tree_active
            or getattr(layer, "layer_name", None) not in STATE.target_attn_layers
            or attn_metadata is None
            or step.attn_plan is None
        ):
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        with TIMER.span("attention_layer"):  # a target layer in a tree step (stage_timing)
            if output_scale is not None:
                raise ValueError("vllm-tfm tree attention does not support fused output quantisation")
            # every row of the batch a tree row: the kernel alone writes them all (vLLM's batched forward
            # would compute causal rows that the kernel overwrites; bench/NOTES.md section 40)
            whole = plan_covers_batch(step.attn_plan, attn_metadata)
            kernel = skipped = False
            out = output
            if whole:
                with TIMER.span("attention_tree"):
                    kernel = skipped = kernel_tree_attention(self, query, kv_cache, attn_metadata, output, step)
            if not skipped:
                out = super().forward(
                    layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
                )
                with TIMER.span("attention_tree"):
                    # (when ``whole``, the kernel has just said it cannot run: the fallback directly)
                    kernel = not whole and kernel_tree_attention(self, query, kv_cache, attn_metadata, output, step)
                    if not kernel:
                        if getattr(step, "graph_capture", None) is not None:
                            reason = self.__dict__.get("_tfm_config_reason") or "the tree attention kernel cannot run here"
                            raise FullTreeGraphsUnavailable(f"tree attention: {reason}")
                        masked_tree_attention(self, layer, query, kv_cache, attn_metadata, output, step.attn_trees)
            metrics = STATE.metrics
            if metrics is not None:
                metrics.hook("attention.tree_mask")
                if kernel:
                    metrics.hook("attention.tree_kernel")
                if skipped:
                    metrics.hook("attention.batched_skipped")
        return out


class TFMTritonAttentionBackend(TritonAttentionBackend):
    """TRITON_ATTN (same name, metadata and builder) whose impl applies the tree mask."""

    @staticmethod
    def get_impl_cls() -> type[TFMTritonAttentionImpl]:
        return TFMTritonAttentionImpl


def install_attention_backend() -> None:
    """Point ``AttentionBackendEnum.TRITON_ATTN`` at ``TFMTritonAttentionBackend`` (registry.py:233-288).

    Respected because the CUDA platform resolves backends through ``backend.get_class()``
    (platforms/cuda.py:171-172). Must run before the model is built (the worker's plugin load).
    """
    from vllm.v1.attention.backends import registry

    from ..patching import record_patch

    enum = registry.AttentionBackendEnum.TRITON_ATTN
    previous = registry._ATTN_OVERRIDES.get(enum)
    if previous == BACKEND_PATH:
        return

    def undo() -> None:
        if previous is None:
            registry._ATTN_OVERRIDES.pop(enum, None)
        else:
            registry._ATTN_OVERRIDES[enum] = previous

    registry.register_backend(enum, BACKEND_PATH)
    record_patch("vllm.v1.attention.backends.registry._ATTN_OVERRIDES[TRITON_ATTN]", previous, BACKEND_PATH,
                 reason="tfm: tree-masked attention on the target's layers", undo=undo)

"""Float32 GDN prefill for vLLM 0.26 (which refuses it), so float32 hybrid targets can be served.

vLLM 0.26's Triton/FLA chunked gated-delta-rule prefill asserts ``q.dtype != float32``
(``third_party/flash_linear_attention/ops/chunk.py``), so a Qwen3.5 hybrid in float32 cannot even
prefill, with or without speculation. Float32 targets are how we prove tfm exact to the token
(greedy tfm == greedy no-spec), so this patch routes float32 prefill through
:func:`vllm_tfm.verify.gdn.gdn_chain_chunked`: the delta rule in chunks of 64 tokens (one
triangular solve per chunk), equal to the per-token recurrence
:func:`vllm_tfm.verify.gdn.gdn_chain_recurrence` (the oracle) up to float32 rounding. A 1,000-token
prompt at the toy zoo's head sizes costs about 1,500 tensor operations per GDN layer instead of
24,000 (counted with a dispatch counter on the CPU; each is a kernel launch on the GPU). Meant for float32 exactness checks and
tests; every other dtype goes to vLLM's original kernel unchanged.

Patched: ``ChunkGatedDeltaRule.forward_native`` (qwen_gdn_linear_attn.py, vLLM 0.26.0), which
``ChunkGatedDeltaRule.__init__`` binds as its forward method for the Triton prefill backend.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_tfm.verify.gdn import gdn_chain_chunked

from .patching import replace_attribute

__all__ = ["install_fp32_prefill", "fp32_chunk_gated_delta_rule"]


def fp32_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    core_attn_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as vLLM's ``chunk_gated_delta_rule`` (q, k [1, T, H, K]; v [1, T, HV, V];
    g (log-space), beta [1, T, HV]; initial_state [N, HV, V, K]; cu_seqlens [N+1]).

    Returns (o [1, T, HV, V], final_state [N, HV, V, K] or None).
    """
    total = q.shape[1]
    cu = [0, total] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    o = torch.empty_like(v)
    finals = []
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        out, state = gdn_chain_chunked(
            q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], initial_state[n],
            use_qk_l2norm=use_qk_l2norm_in_kernel,
        )
        o[0, s:e] = out
        finals.append(state)
    if core_attn_out is not None:
        flat = o.reshape(-1)
        core_attn_out.reshape(-1)[: flat.numel()].copy_(flat)
    final = torch.stack(finals) if output_final_state else None
    return o, final


def install_fp32_prefill() -> bool:
    """Patch ``ChunkGatedDeltaRule.forward_native`` (idempotent); float32 inputs only."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import ChunkGatedDeltaRule

    def make(original: Any) -> Any:
        def forward_native(self: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor,
                           output_final_state: bool, cu_seqlens: torch.Tensor | None = None,
                           chunk_indices: torch.Tensor | None = None,
                           chunk_offsets: torch.Tensor | None = None,
                           use_qk_l2norm_in_kernel: bool = True,
                           core_attn_out: torch.Tensor | None = None) -> Any:
            if q.dtype != torch.float32:
                return original(self, q, k, v, g, beta, initial_state, output_final_state,
                                cu_seqlens, chunk_indices, chunk_offsets, use_qk_l2norm_in_kernel,
                                core_attn_out)
            return fp32_chunk_gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state,
                                               cu_seqlens, use_qk_l2norm_in_kernel, core_attn_out)

        return forward_native

    return replace_attribute(ChunkGatedDeltaRule, "forward_native", make,
                             reason="float32 GDN prefill (vLLM 0.26's FLA chunk kernel refuses float32)")

"""One GDN layer's tree path (``spec_tree_gdn`` and ``_tree_step_forward_core`` of
``vllm_tfm/vllm_plugin/runtime/gdn.py`` at commit e4cd83a) as it was before the per-layer host-work
cut, frozen here as a regression oracle: the current code must give the same outputs and stashes bit
for bit. Not imported by the package; ``bench/step_ops.py --impl before`` runs it to count the
previous host work of a layer.

Shared with the current code (not part of the cut): the kernels and references, the step kernel
tables (``step_kernels``), ``_layer_states``, ``_non_spec_rows``, the step state and the timer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod
from vllm_tfm.vllm_plugin.runtime.graph_dispatch import piece_outputs_are_reused
from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import tree_ops
from vllm_tfm.vllm_plugin.runtime.stage_timing import TIMER
from vllm_tfm.vllm_plugin.runtime.state import STATE, GDNStash
from vllm_tfm.vllm_plugin.runtime.step_kernels import StepKernels

SOFTPLUS_THRESHOLD = 20.0


def gdn_gates_before(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """``vllm_tfm.verify.gdn.gdn_gates`` at commit e4cd83a."""
    if a.dim() != 2 or b.shape != a.shape:
        raise ValueError(f"a and b must both have shape [T, HV], got {tuple(a.shape)} and {tuple(b.shape)}")
    hv = a.shape[1]
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(
            f"A_log and dt_bias must have shape [HV={hv}], got {tuple(A_log.shape)} and {tuple(dt_bias.shape)}"
        )
    dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    x = a.to(dtype) + dt_bias.to(dtype)
    g = -torch.exp(A_log.to(dtype)) * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    beta = torch.sigmoid(b.to(dtype))
    return g, beta


_layer_states = gdn_mod._layer_states
_non_spec_rows = gdn_mod._non_spec_rows


def spec_tree_gdn_before(
    x: Tensor,
    a: Tensor,
    b: Tensor,
    parents: Tensor,
    cu_nodes: Tensor,
    conv_state: Tensor,
    ssm_state: Tensor,
    state_indices: Tensor,
    prev_accepted: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    activation: str | None,
    A_log: Tensor,
    dt_bias: Tensor,
    num_k_heads: int,
    head_k_dim: int,
    num_v_heads: int,
    head_v_dim: int,
    kernels: StepKernels | None = None,
) -> tuple[Tensor, GDNStash]:
    """Outputs of the spec rows of one GDN layer and the stash for the commit. Writes no state.

    x: [Ts, 2*H*K + HV*V] pre-conv mixed q|k|v of the spec rows (batch order); a, b: [Ts, HV];
    parents: [Ts] local; cu_nodes: [Rs + 1]; conv_state: [slots, conv_dim, L] (dim-first view);
    ssm_state: [slots, HV, V, K]; state_indices: [Rs, 1 + S] vLLM's spec_state_indices_tensor;
    prev_accepted: [Rs] vLLM's num_accepted_tokens of the spec requests (>= 1);
    conv_weight: [conv_dim, W]. Head counts are per tensor-parallel rank.
    kernels: this step's kernel tables (``step_kernels``): the planned NVRTC kernels run for the
    tensors they take, with the tree plan and slots computed once per step; None (or tensors the
    kernels do not take): the per-call operations of ``tree_ops()``.
    Returns o [Ts, HV, V] in x.dtype.
    """
    ops = tree_ops()
    if kernels is not None:
        grp = kernels.group(state_indices, prev_accepted)
        slots, start, s0, conv_slot, prev = grp.slots, grp.start32, grp.read_slot, grp.conv_slot, grp.prev_accepted
    else:
        slots = state_indices.to(torch.long)
        prev = prev_accepted.to(torch.long)
        start = prev - 1
        s0 = slots.gather(1, start[:, None]).squeeze(1)
        conv_slot = slots[:, 0]
    act = "silu" if activation in ("silu", "swish") else activation
    width = conv_weight.shape[1]
    with TIMER.span("gdn_tree_conv"):
        if (
            kernels is not None
            and act in ("silu", None)
            and kconv.conv_unsupported_reason(x, conv_state, width, conv_weight, conv_bias) is None
        ):
            y = kconv.tree_causal_conv1d_planned(
                kernels.plan, x, conv_state, conv_slot, conv_weight, conv_bias, act, start
            )
        else:
            y = ops.tree_causal_conv1d(x, parents, cu_nodes, conv_state, conv_slot, conv_weight, conv_bias, act, start)
    kd, vd = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    q, k, v = torch.split(y, [kd, kd, vd], dim=-1)
    q = q.reshape(-1, num_k_heads, head_k_dim)
    k = k.reshape(-1, num_k_heads, head_k_dim)
    v = v.reshape(-1, num_v_heads, head_v_dim)
    g, beta = gdn_gates_before(a, b, A_log, dt_bias)
    block_v = None
    if kernels is not None and kgdn.verify_unsupported_reason(q, k, v, ssm_state) is None:
        block_v = kernels.block_v(num_v_heads, head_k_dim, head_v_dim)
    with TIMER.span("gdn_tree_verify"):
        if block_v is not None:
            # the kernel reads a contiguous k; keeping that copy in the stash spares the commit its own
            k = k.contiguous()
            o, delta = kgdn.gdn_tree_verify_planned(
                kernels.plan, q, k, v, g, beta, ssm_state, s0, return_delta=True, block_v=block_v
            )
        else:
            o, delta = ops.gdn_tree_verify(q, k, v, g, beta, parents, cu_nodes, ssm_state, s0, return_delta=True)
    stash = GDNStash(
        x=x,
        k=k,
        g=g,
        delta=delta,
        state_indices=slots,
        prev_accepted=prev,
        conv_state=conv_state,
        ssm_state=ssm_state,
        width=conv_weight.shape[1],
    )
    return o.to(x.dtype), stash


def tree_step_forward_core_before(
    self: Any, step: Any, original: Any, mixed_qkv: Tensor, b: Tensor, a: Tensor, core_attn_out: Tensor
) -> None:
    """``_forward_core`` of one GDN layer in a tree-active step."""
    from vllm.forward_context import get_forward_context

    fc = get_forward_context()
    md_all = fc.attn_metadata
    if not isinstance(md_all, dict) or self.prefix not in md_all:
        return original(self, mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core_attn_out)
    md = md_all[self.prefix]
    if md.spec_sequence_masks is None:
        return original(self, mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core_attn_out)
    if md.num_spec_decodes != step.num_spec_reqs or md.num_spec_decode_tokens != step.num_spec_tokens:
        raise RuntimeError(
            f"vllm-tfm: GDN layer {self.prefix} sees {md.num_spec_decodes} spec requests / "
            f"{md.num_spec_decode_tokens} spec tokens, the tree metadata {step.num_spec_reqs} / {step.num_spec_tokens}"
        )
    with TIMER.span("gdn_tree"):  # our tree path: from here to the spec rows' outputs
        if STATE.metrics is not None:
            STATE.metrics.hook("gdn.tree_verify")
        num_tokens = md.num_actual_tokens
        all_spec = md.num_prefills == 0 and md.num_decodes == 0
        spec_idx = None if all_spec else md.spec_token_indx.to(torch.long)

        def spec_rows(t: Tensor) -> Tensor:
            return t[:num_tokens] if spec_idx is None else t.index_select(0, spec_idx)

        conv_state, ssm_state = _layer_states(self)
        w = self.conv1d.weight
        x = spec_rows(mixed_qkv)
        if spec_idx is None and piece_outputs_are_reused():
            x = x.clone()  # kept for the commit: a view of a CUDA-graph piece's output would be overwritten
        out, stash = spec_tree_gdn_before(
            x,
            spec_rows(a),
            spec_rows(b),
            step.dev("spec_parents"),
            step.dev("spec_cu"),
            conv_state,
            ssm_state,
            md.spec_state_indices_tensor,
            md.num_accepted_tokens,
            w.view(w.size(0), w.size(2)),
            self.conv1d.bias,
            self.activation,
            self.A_log,
            self.dt_bias,
            self.num_k_heads // self.tp_size,
            self.head_k_dim,
            self.num_v_heads // self.tp_size,
            self.head_v_dim,
            kernels=gdn_mod.step_kernels(step, mixed_qkv.device),
        )
        step.gdn[self.prefix] = stash
        if spec_idx is None:
            core_attn_out[:num_tokens] = out
            return None
        core_attn_out.index_copy_(0, spec_idx, out)
    _non_spec_rows(self, md_all, md, original, mixed_qkv, b, a, core_attn_out)
    return None

"""Tree verify inside vLLM's Gated DeltaNet layer (``QwenGatedDeltaNetAttention._forward_core``).

vLLM 0.26 (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:1180) runs spec-decode rows
as a chain: ``causal_conv1d_update`` reads the committed conv window at column
``num_accepted - 1`` of the request's slot ``[n, 0]`` and writes the shifted window back, and
``fused_sigmoid_gating_delta_rule_update`` starts from SSM slot ``[n, num_accepted - 1]`` and
writes the state after token t into slot ``[n, t]``. A tree cannot be processed that way.

During a tree-active step the patched ``_forward_core`` handles the spec rows itself:
1. tree conv1d: node i's window is itself, its ancestors, then the committed columns
   ``num_accepted - 1 ..`` of slot ``[n, 0]`` (``tree_causal_conv1d``), no state written;
2. gates ``g``, ``beta`` (``gdn_gates``, vLLM's formulas);
3. the exact tree verify from S0 = SSM slot ``[n, num_accepted - 1]`` (``gdn_tree_verify``,
   DESIGN.md section 4), no state written, the per-node ``delta`` kept;
4. what the commit needs (pre-conv inputs, keys, gates, deltas, slots) goes to the step state.

Rows that are not spec decodes (prefills, reclassified plain decodes) go through vLLM's own
``_forward_core`` on a copy of the metadata restricted to them. Steps that are not tree-active
are vLLM's code path, untouched.

Under piecewise CUDA graphs this runs inside the splitting op ``vllm::qwen_gdn_attention_core``,
eagerly, every step; its inputs are outputs of the previous graph piece (graph-pool memory that
later pieces overwrite), so the pre-conv inputs kept for the commit are copied then
(``graph_dispatch.piece_outputs_are_reused``).

With ``VLLM_TFM_PROFILE=1`` (``stage_timing.py``) a tree-active step's ``_forward_core`` is timed as
stage ``gdn_layer``, the spec rows (steps 1-4 and the output scatter) as ``gdn_tree``, and inside it
steps 1 and 3 as ``gdn_tree_conv`` and ``gdn_tree_verify``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.verify.gdn import gate_constants, gdn_gates

from .full_graphs import FullTreeGraphsUnavailable, LayerStash
from .graph_dispatch import piece_outputs_are_reused
from .kernels_or_reference import tree_ops
from .one_slot import read_offsets
from .stage_timing import TIMER
from .state import STATE, GDNStash
from .step_kernels import StepKernels, step_kernels

__all__ = ["spec_tree_gdn", "tree_forward_core", "install_gdn_patch"]

_ORIGINAL: dict[str, Any] = {}


def spec_tree_gdn(
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
    out: Tensor | None = None,
    persistent: LayerStash | None = None,
    x_copy: Tensor | None = None,
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
    out: optional [Ts, HV, V] destination of o (e.g. the spec rows of ``core_attn_out``): the verify
    kernel writes it directly when it is contiguous, 16-byte aligned and of x's dtype; otherwise
    (or on the reference path) o is a new tensor and the caller copies it.
    persistent: the layer's stash buffers of a full tree graph capture (``full_graphs.py``): x, q|k, g
    and delta are written there, and only the kernel path is allowed (``FullTreeGraphsUnavailable``
    otherwise).
    x_copy: [Ts, conv_dim] where the stash's copy of x goes (x itself is kept when None and there is
    no ``persistent``: x must then outlive the step).
    On the kernel path the tree conv's launch also writes the copy of x, q and k as the contiguous
    blocks the verify reads, and the gates (``kconv.ConvExtras``): one launch where the separate
    operations took seven (bench/NOTES.md section 40).
    Returns o [Ts, HV, V] in x.dtype (``out`` itself when it was written).
    """
    ops = tree_ops()
    if persistent is not None:
        x_copy = persistent.x[: x.shape[0]]
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
    kd, vd = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    t = x.shape[0]
    conv_kernel = (
        kernels is not None
        and act in ("silu", None)
        and kconv.conv_unsupported_reason(x, conv_state, width, conv_weight, conv_bias) is None
    )
    fused = None  # the prologue's outputs written by the conv launch: (q, k, g, beta)
    stash_x = x  # the pre-conv rows the commit reads
    with TIMER.span("gdn_tree_conv"):
        if conv_kernel:
            extras = _prologue_extras(x, a, b, A_log, dt_bias, num_k_heads, head_k_dim, x_copy, persistent)
            y = kconv.tree_causal_conv1d_planned(
                kernels.plan, x, conv_state, conv_slot, conv_weight, conv_bias, act, start, extras=extras
            )
            if extras is not None:
                qk = extras.qk_out.view(2, t, num_k_heads, head_k_dim)
                fused = (qk[0], qk[1], extras.gates[4], extras.gates[5])
                if extras.x_copy is not None:
                    stash_x = extras.x_copy
        else:
            if persistent is not None:
                raise FullTreeGraphsUnavailable("the tree conv1d of a GDN layer cannot run as a kernel here")
            y = ops.tree_causal_conv1d(x, parents, cu_nodes, conv_state, conv_slot, conv_weight, conv_bias, act, start)
    if x_copy is not None and stash_x is x:  # the launch did not write the copy
        stash_x = x_copy.copy_(x)
    q, k, v = torch.split(y, [kd, kd, vd], dim=-1)
    q = q.reshape(-1, num_k_heads, head_k_dim)
    k = k.reshape(-1, num_k_heads, head_k_dim)
    v = v.reshape(-1, num_v_heads, head_v_dim)
    if fused is not None:
        q, k, g, beta = fused
    else:
        g, beta = gdn_gates(a, b, A_log, dt_bias, _gate_constants(A_log, dt_bias))
    block_v = None
    if kernels is not None and kgdn.verify_unsupported_reason(q, k, v, ssm_state) is None:
        block_v = kernels.block_v(num_v_heads, head_k_dim, head_v_dim)
    if persistent is not None and block_v is None:
        raise FullTreeGraphsUnavailable(
            f"the GDN tree verify cannot run as a kernel here: {kgdn.verify_unsupported_reason(q, k, v, ssm_state) or 'no NVRTC kernels'}"
        )
    with TIMER.span("gdn_tree_verify"):
        if block_v is not None:
            # the kernel reads contiguous q, k and v: q and k come out of the conv launch (or one copy,
            # [2, Ts, H, K], q then k); keeping k in the stash spares the commit its own copy
            delta_out = qk_out = None
            if persistent is not None:  # a full graph capture: what the commit reads goes to fixed addresses
                qk_out, delta_out = persistent.qk[:, :t], persistent.delta[:t]
                if fused is None:
                    g = persistent.g[:t].copy_(g)
            if fused is None:
                q, k = _contiguous_qk(y, num_k_heads, head_k_dim, qk_out)
            o, delta = kgdn.gdn_tree_verify_planned(
                kernels.plan, q, k, v, g, beta, ssm_state, s0, return_delta=True, block_v=block_v,
                out=out if _writable_out(out, v) else None, delta_out=delta_out,
                variant=kernels.verify_variant(q.dtype, num_k_heads, num_v_heads, head_k_dim, head_v_dim),
            )
        else:
            o, delta = ops.gdn_tree_verify(q, k, v, g, beta, parents, cu_nodes, ssm_state, s0, return_delta=True)
    stash = GDNStash(
        x=stash_x,
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


def _prologue_extras(
    x: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, num_k_heads: int, head_k_dim: int,
    x_copy: Tensor | None, persistent: LayerStash | None,
) -> kconv.ConvExtras | None:
    """What the tree conv launch also writes for the layer (``kconv.ConvExtras``): q and k as the verify
    reads them, the gates, the stash's copy of x; into the full graph's stash buffers when there are
    some. None when the launch cannot take them (dtypes, layouts): the separate operations run then."""
    t, hv = a.shape
    kd = num_k_heads * head_k_dim
    constants = _gate_constants(A_log, dt_bias)
    if constants is None:  # inference tensors: per call
        constants = gate_constants(A_log, dt_bias, torch.float32)
    if persistent is not None:
        qk, g = persistent.qk[:, :t].view(2, t, kd), persistent.g[:t]  # each half's rows are contiguous
    else:
        qk = torch.empty((2, t, kd), dtype=x.dtype, device=x.device)
        g = torch.empty((t, hv), dtype=torch.float32, device=x.device)
    beta = torch.empty((t, hv), dtype=torch.float32, device=x.device)
    extras = kconv.ConvExtras(qk_out=qk, qk_cols=kd, x_copy=x_copy, gates=(a, b, *constants, g, beta))
    return extras if kconv.extras_unsupported_reason(x, extras) is None else None


def _contiguous_qk(y: Tensor, num_k_heads: int, head_k_dim: int, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q and k of the conv output y [Ts, 2*H*K + HV*V] as contiguous [Ts, H, K] tensors, both copied
    by one kernel into a [2, Ts, H, K] buffer (the values of ``q.contiguous()``, ``k.contiguous()``):
    ``out`` when given ([2, Ts, H, K] whose two halves are each contiguous), else a new buffer."""
    kd = num_k_heads * head_k_dim
    src = y[:, : 2 * kd].view(-1, 2, num_k_heads, head_k_dim).transpose(0, 1)
    q, k = (src.contiguous() if out is None else out.copy_(src)).unbind(0)
    return q, k


def _writable_out(out: Tensor | None, v: Tensor) -> bool:
    """True when the verify kernel can write o into ``out`` ([Ts, HV, V] of v's dtype, contiguous,
    16-byte aligned) instead of a new tensor."""
    return (
        out is not None and out.shape == v.shape and out.dtype == v.dtype and out.device == v.device
        and out.is_contiguous() and out.data_ptr() % 16 == 0
    )


_GATES: dict[int, tuple[Tensor, Tensor, int, int, tuple[Tensor, Tensor]]] = {}


def _gate_constants(A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor] | None:
    """``gate_constants`` (float32) of a layer's (A_log, dt_bias), computed once per layer, not per step.

    Recomputed when either parameter was written in place since (its version counter moved, e.g. a
    weight reload) or is another tensor; None (computed per call by ``gdn_gates``) for tensors
    without a version counter (inference tensors) or float64 gates.
    """
    try:
        versions = (A_log._version, dt_bias._version)
    except RuntimeError:  # inference tensors have no version counter: nothing tells a reload
        return None
    found = _GATES.get(id(A_log))
    if found is not None and found[0] is A_log and found[1] is dt_bias and found[2:4] == versions:
        return found[4]
    constants = gate_constants(A_log, dt_bias, torch.float32)
    _GATES[id(A_log)] = (A_log, dt_bias, *versions, constants)
    return constants


def _layer_states(layer: Any) -> tuple[Tensor, Tensor]:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    kv = layer.kv_cache
    conv_state = kv[0] if is_conv_state_dim_first() else kv[0].transpose(-1, -2)
    return conv_state, kv[1]


def tree_forward_core(self: Any, mixed_qkv: Tensor, b: Tensor, a: Tensor, core_attn_out: Tensor) -> None:
    """Replacement of ``QwenGatedDeltaNetAttention._forward_core`` (module docstring); in tree-active
    steps timed as stage ``gdn_layer``, its spec rows as ``gdn_tree`` (``stage_timing``)."""
    original = _ORIGINAL["_forward_core"]
    step = STATE.step
    if step is None:  # not a tfm engine (the plugin leaves other methods alone), or no step yet
        if STATE.one_slot:
            _refuse_chain_kernel(self, "a run without tfm step metadata")
        return original(self, mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core_attn_out)
    if not step.tree_gdn:
        if STATE.one_slot:
            _refuse_chain_kernel(self, "a step without the tree path")
        return _chain_step_forward_core(self, step, original, mixed_qkv, b, a, core_attn_out)
    with TIMER.span("gdn_layer"):
        return _tree_step_forward_core(self, step, original, mixed_qkv, b, a, core_attn_out)


def _refuse_chain_kernel(self: Any, where: str) -> None:
    """With one GDN state slot per request (``one_slot.py``) vLLM's chain kernel must not see spec rows: it
    would index 1 + B slot columns of a one-column table, other requests' slots. Raises when this layer's
    metadata has spec rows."""
    from vllm.forward_context import get_forward_context

    md_all = get_forward_context().attn_metadata
    md = md_all.get(self.prefix) if isinstance(md_all, dict) else None
    if md is not None and getattr(md, "spec_sequence_masks", None) is not None:
        raise RuntimeError(
            f"vllm-tfm: GDN layer {self.prefix} got speculative rows in {where}, with one GDN state slot per "
            "request (gdn_state_slots 'one'): vLLM's chain kernel would read other requests' state slots"
        )


def spec_rows_lead(is_spec: Any, num_spec_decodes: int) -> bool:
    """True when the batch's spec-decode requests are its first ``num_spec_decodes`` rows (host data).

    is_spec: [R] bool, batch order (``StepTree.is_spec``). False when the count disagrees with
    vLLM's metadata: the caller then takes the path that does not depend on the order.
    """
    k = int(is_spec.sum())
    return k == num_spec_decodes and bool(is_spec[:k].all())


def _chain_step_forward_core(
    self: Any, step: Any, original: Any, mixed_qkv: Tensor, b: Tensor, a: Tensor, core_attn_out: Tensor
) -> None:
    """``_forward_core`` of one GDN layer in a step without trees (chain drafts, vLLM's verification).

    vLLM 0.26's mixed-batch path (spec decodes together with prefills or plain decodes reclassified
    as prefills) is wrong when a spec row is not among the batch's first rows:
    qwen_gdn_linear_attn.py:1376-1395 passes the whole batch's gates ``a`` and ``b`` to
    ``fused_sigmoid_gating_delta_rule_update`` with the spec rows' own ``cu_seqlens`` (0-based) and
    compacted q/k/v, and the kernel (fused_sigmoid_gating.py:66-72) reads the gate of spec token j
    at batch token j, another row's. vLLM's row order lets that happen: a prompt of at most
    1 + B tokens or a request scheduled without drafts counts as a "decode" for the decode-first
    reorder and may sit before spec rows (a new request takes a finished request's row). The spec
    rows then get another token's gates: wrong output and a wrong recurrent state, so greedy output
    drifts from no speculation (bench/results/preempt_zoo_before_mixed_fix.json in git history at b82e1e7, docs/guarantees.md). In such a
    batch the spec rows and the other rows run as two calls of vLLM's own code, each on metadata
    restricted to them (the spec call sees a batch of spec rows only, where the gates line up).
    """
    from vllm.forward_context import get_forward_context

    md_all = get_forward_context().attn_metadata
    if not isinstance(md_all, dict) or self.prefix not in md_all:
        return original(self, mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core_attn_out)
    md = md_all[self.prefix]
    mixed = md.spec_sequence_masks is not None and (md.num_prefills > 0 or md.num_decodes > 0)
    if not mixed or (step.is_spec is not None and spec_rows_lead(step.is_spec, md.num_spec_decodes)):
        return original(self, mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core_attn_out)
    if STATE.metrics is not None:
        STATE.metrics.hook("gdn.mixed_split")
    spec_md = dataclasses.replace(
        md,
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=0,
        num_decode_tokens=0,
        num_actual_tokens=md.num_spec_decode_tokens,
        non_spec_query_start_loc=None,
        non_spec_state_indices_tensor=None,
        spec_token_indx=None,
        non_spec_token_indx=None,
    )
    _rows_through_vllm(self, md_all, md, spec_md, md.spec_token_indx, original, mixed_qkv, b, a, core_attn_out)
    _non_spec_rows(self, md_all, md, original, mixed_qkv, b, a, core_attn_out)
    return None


def _tree_step_forward_core(
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
        dest = core_attn_out[:num_tokens] if spec_idx is None else None  # the spec rows' outputs
        x = spec_rows(mixed_qkv)
        graphs = getattr(step, "graph_capture", None)
        persistent = x_copy = None
        if graphs is not None:  # a full tree graph capture: the commit's inputs at fixed addresses (full_graphs.py)
            if spec_idx is not None:
                raise RuntimeError("vllm-tfm: a full tree graph capture saw rows that are not spec decodes")
            persistent = graphs.layer_stash(
                self.prefix, x, self.num_k_heads // self.tp_size, self.head_k_dim, torch.float32,
                self.num_v_heads // self.tp_size, self.head_v_dim, x.dtype,
            )  # x is copied there (by the conv launch when it can)
        elif spec_idx is None and piece_outputs_are_reused():
            # kept for the commit: a view of a CUDA-graph piece's output would be overwritten
            x_copy = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        out, stash = spec_tree_gdn(
            x,
            spec_rows(a),
            spec_rows(b),
            step.dev("spec_parents"),
            step.dev("spec_cu"),
            conv_state,
            ssm_state,
            md.spec_state_indices_tensor,
            read_offsets(md.spec_state_indices_tensor) if STATE.one_slot else md.num_accepted_tokens,
            w.view(w.size(0), w.size(2)),
            self.conv1d.bias,
            self.activation,
            self.A_log,
            self.dt_bias,
            self.num_k_heads // self.tp_size,
            self.head_k_dim,
            self.num_v_heads // self.tp_size,
            self.head_v_dim,
            kernels=step_kernels(step, mixed_qkv.device),
            out=dest,
            persistent=persistent,
            x_copy=x_copy,
        )
        step.gdn[self.prefix] = stash
        if spec_idx is None:
            if out is not dest:  # not written in place by the verify kernel
                dest.copy_(out)
            return None
        core_attn_out.index_copy_(0, spec_idx, out)
    _non_spec_rows(self, md_all, md, original, mixed_qkv, b, a, core_attn_out)
    return None


def _non_spec_rows(
    self: Any, md_all: dict, md: Any, original: Any, mixed_qkv: Tensor, b: Tensor, a: Tensor, core_attn_out: Tensor
) -> None:
    """The rows that are not spec decodes (prefills, incl. plain decodes vLLM reclassified as
    prefills) through vLLM's ``_forward_core`` on metadata restricted to them."""
    sub = dataclasses.replace(
        md,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=md.num_prefill_tokens + md.num_decode_tokens,
        spec_query_start_loc=None,
        spec_state_indices_tensor=None,
        spec_sequence_masks=None,
        spec_token_indx=None,
        non_spec_token_indx=None,
        num_accepted_tokens=None,
    )
    _rows_through_vllm(self, md_all, md, sub, md.non_spec_token_indx, original, mixed_qkv, b, a, core_attn_out)


def _rows_through_vllm(
    self: Any, md_all: dict, md: Any, sub: Any, rows: Tensor, original: Any, mixed_qkv: Tensor, b: Tensor, a: Tensor,
    core_attn_out: Tensor,
) -> None:
    """vLLM's ``_forward_core`` on the token ``rows`` alone, with ``sub`` (metadata restricted to
    them) in the forward context for the call; the outputs are scattered back into their rows."""
    idx = rows.to(torch.long)
    out = core_attn_out.new_zeros((idx.shape[0], *core_attn_out.shape[1:]))
    md_all[self.prefix] = sub
    try:
        original(
            self,
            mixed_qkv=mixed_qkv.index_select(0, idx),
            b=b.index_select(0, idx),
            a=a.index_select(0, idx),
            core_attn_out=out,
        )
    finally:
        md_all[self.prefix] = md
    core_attn_out.index_copy_(0, idx, out)


def install_gdn_patch() -> None:
    """Replace ``QwenGatedDeltaNetAttention._forward_core`` through the patch registry (idempotent).

    A class attribute: the custom op ``vllm.qwen_gdn_attention_core`` looks the layer up in the
    forward context and calls ``self._forward_core`` (qwen_gdn_linear_attn.py:1619-1656), so the
    patch is honoured in eager and compiled modes alike.
    """
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from ..patching import replace_attribute

    def make(original: Any) -> Any:
        _ORIGINAL["_forward_core"] = original
        return tree_forward_core

    replace_attribute(QwenGatedDeltaNetAttention, "_forward_core", make, reason="tfm: GDN tree verify for spec rows")

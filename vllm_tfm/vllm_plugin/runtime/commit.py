"""Commit of the accepted path after tree acceptance, in the layout vLLM's chain bookkeeping expects.

Runs in the ``GPUModelRunner._update_states_after_model_execute`` wrapper, before vLLM sets
``num_accepted_tokens = p + 1`` (p accepted drafts) and before the drafter runs. After it, every
request looks exactly as if it had verified the chain root, path_1, ..., path_p:

* Full attention (target layers): node j's K/V was written at the sequential slot of row
  ``ctx + j``; the path node at depth k (local index r_k >= k) moves to row ``ctx + k``. The
  scheduler then rolls ``num_computed_tokens`` back by the rejected count, so the next step
  appends after ``ctx + p``. RoPE used the depth positions, so the moved keys carry exactly the
  rotation a chain would have given them. All reads happen before all writes, so r_k >= k needs
  no ordering. ``compact_kv`` moves every layer of a KV-cache group in one launch of the NVRTC
  kernel (``vllm_tfm.kernels.kv_compact``: 1 launch instead of about 35-40 small torch kernels at the
  27B's 16 attention layers, and no per-layer host dispatch) when it can run, else with the torch
  reference (``kv_compact_reference``, the same moves bit for bit). ``VLLM_TFM_KV_COMPACT_KERNEL=0``
  (or ``set_kv_compact_kernel(False)`` in the worker) keeps the reference; ``VLLM_TFM_KERNELS=0``
  does too.
* GDN (VLLM_HOOKS.md section 5, "What the commit must produce"), with a = p + 1: SSM slot
  ``[n, a - 1]`` holds the state after the last accepted token, and conv slot ``[n, 0]`` columns
  ``a - 1 .. a + W - 3`` hold the last W - 1 pre-conv inputs of ``[history, x_root, x_path...]``.
  We use the algebraic commit with the deltas the tree verify kept (``gdn_tree_commit``: one state
  read and one write per request, ``S* = e^{G_a} S0 + sum_j e^{G_a - G_j} k_j delta_j^T``) and
  ``tree_conv_commit``, instead of replaying the path through vLLM's two chain kernels: the replay
  would need a second ragged batch layout and redo the recurrence the verify already solved,
  while the algebraic form is the exact same state (tested in float64 against the recurrence).

``commit_gdn_layers`` commits every GDN layer of the step: two launches per layer
(``commit_gdn_layer``), or, by default (``VLLM_TFM_BATCHED_COMMIT`` unset or 1) when every layer is on
the kernel path, one launch per kernel kind for all layers (``vllm_tfm.kernels.batched_commit``: the same block
bodies, so the same states bit for bit; a launch's host cost is tens of microseconds, bench/NOTES.md
section 14).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vllm_tfm.kernels import batched_commit as kbatch
from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels import kv_compact as kkv
from vllm_tfm.kernels.loader import warn_fallback
from vllm_tfm.verify.accept_result import AcceptResult

from .kernels_or_reference import kernels_enabled, tree_ops
from .settings import RuntimeSwitch, batched_commit_enabled
from .state import STATE, GDNStash, StepTree
from .step_kernels import StepKernels

__all__ = ["compaction_rows", "compact_kv", "commit_gdn_layer", "commit_gdn_layers", "batched_commit_layers", "spec_accepted", "spec_rows",
           "KV_COMPACT_KERNEL_ENV", "kv_compact_kernel_enabled", "set_kv_compact_kernel"]

KV_COMPACT_KERNEL_ENV = "VLLM_TFM_KV_COMPACT_KERNEL"
_KVC = RuntimeSwitch(KV_COMPACT_KERNEL_ENV, "set_kv_compact_kernel")


def kv_compact_kernel_enabled() -> bool:
    """``VLLM_TFM_KV_COMPACT_KERNEL`` unset or not 0 / false (default on), unless ``set_kv_compact_kernel``
    overrode it: ``compact_kv`` runs the one-launch kernel where it can."""
    return _KVC.enabled()


def set_kv_compact_kernel(on: bool | None) -> bool:
    """Override ``VLLM_TFM_KV_COMPACT_KERNEL`` in this process (None: back to the environment's); the
    setting now in force. For a same-engine A/B (kernel vs torch reference) through ``collective_rpc``."""
    return _KVC.set(on)


def compaction_rows(row_base: Tensor, accepted_nodes: Tensor) -> tuple[Tensor, Tensor]:
    """Source and destination token rows of the K/V moves, [R * Dmax] each, no host sync.

    row_base: [R] int64, the row of each request's root (its first logits row);
    accepted_nodes: [R, Dmax] local indices of the accepted path, -1 padding.
    Path node k (0-based) moves from ``row_base + accepted_nodes[k]`` to ``row_base + 1 + k``.
    Padding entries copy the root row onto itself: the root row is never a real source or
    destination, so these no-op copies cannot race with a real one.
    """
    base = row_base.to(torch.long)[:, None]
    valid = accepted_nodes >= 0
    k1 = torch.arange(1, accepted_nodes.shape[1] + 1, device=accepted_nodes.device)  # 1 + k
    src = torch.where(valid, base + accepted_nodes, base)
    dst = torch.where(valid, base + k1, base)
    return src.reshape(-1), dst.reshape(-1)


def compact_kv(kv_caches: list[Tensor], slot_mapping: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
    """Move K/V between the slots of the given token rows in every cache of one KV-cache group.

    kv_caches: TRITON_ATTN caches, logical [num_blocks, H, block_size, 2 * head_size] (any
    physical stride order); slot_mapping: [>= T] int64, slot of every token row of the step.
    The kernel (``kv_compact_layers``, one launch for the group) when the switch is on, the tensors
    are on a CUDA device and the kernel takes their layout; else the torch reference, saying once
    why when the tensors are on a CUDA device. Never waits for the device. The engine's metrics count
    the calls of each path (hooks ``commit.kv_compact_kernel`` / ``commit.kv_compact_reference``).
    """
    if src_rows.numel() == 0 or not kv_caches:
        return
    metrics = STATE.metrics
    if kv_compact_kernel_enabled() and kernels_enabled():
        reason = kkv.try_kv_compact_layers(kv_caches, slot_mapping, src_rows, dst_rows)  # one check, then the launch
        if reason is None:
            if metrics is not None:
                metrics.hook("commit.kv_compact_kernel")
            return
        if reason != kkv.NOT_CUDA:
            warn_fallback("compact_kv", reason)
    kkv.kv_compact_reference(kv_caches, slot_mapping, src_rows, dst_rows)
    if metrics is not None:
        metrics.hook("commit.kv_compact_reference")


def spec_rows(step: StepTree, t: Tensor) -> Tensor:
    """The spec requests' rows of a per-request tensor ``t`` [R, ...], batch order (``t`` itself when every
    request is a spec request)."""
    return t if step.num_spec_reqs == step.num_reqs else t.index_select(0, step.dev("spec_req_index"))


def spec_accepted(step: StepTree, accept: AcceptResult) -> tuple[Tensor, Tensor]:
    """(last accepted node, accepted draft count) of the spec requests, [Rs] each, batch order."""
    return spec_rows(step, accept.last_node), spec_rows(step, accept.num_accepted)


def commit_gdn_layer(
    stash: GDNStash,
    parents: Tensor,
    cu_nodes: Tensor,
    last_node: Tensor,
    num_accepted: Tensor,
    kernels: StepKernels | None = None,
) -> None:
    """Write one GDN layer's committed SSM state and conv window (module docstring).

    parents / cu_nodes: the spec rows' tree (as given to the verify); last_node, num_accepted:
    [Rs] from ``spec_accepted``. Source: SSM slot [n, prev - 1] and conv columns prev - 1.. (prev =
    vLLM's num_accepted_tokens before the step); destination: SSM slot [n, p] and conv columns
    p.. of slot [n, 0], p = accepted drafts. kernels: this step's kernel tables (the planned
    kernels with indices computed once per step and group), else the per-call operations.
    """
    group = None if kernels is None else kernels.group_of(stash.state_indices)
    if group is not None:
        gdn_idx, conv_idx = kernels.commit_indices(group, last_node, num_accepted)
        if kgdn.commit_unsupported_reason(stash.k, stash.delta, stash.ssm_state) is None:
            kgdn.gdn_tree_commit_planned(kernels.plan, stash.k, stash.g, stash.delta, gdn_idx, stash.ssm_state)
        else:
            _commit_state_per_call(stash, parents, cu_nodes, last_node, num_accepted)
        if kconv.conv_unsupported_reason(stash.x, stash.conv_state, stash.width) is None:
            kconv.tree_conv_commit_planned(kernels.plan, stash.x, conv_idx, stash.conv_state, stash.width)
        else:
            _commit_window_per_call(stash, parents, cu_nodes, last_node, num_accepted)
        return
    _commit_state_per_call(stash, parents, cu_nodes, last_node, num_accepted)
    _commit_window_per_call(stash, parents, cu_nodes, last_node, num_accepted)


def commit_gdn_layers(
    stashes: Sequence[GDNStash],
    parents: Tensor,
    cu_nodes: Tensor,
    last_node: Tensor,
    num_accepted: Tensor,
    kernels: StepKernels | None = None,
) -> int | None:
    """Commit every GDN layer of the step (arguments as ``commit_gdn_layer``).

    With ``VLLM_TFM_BATCHED_COMMIT`` on (the default) and every layer on the kernel path (``batched_commit_layers``):
    all layers in one launch per kernel kind, returning the number of launches; otherwise
    ``commit_gdn_layer`` for each layer in turn, returning None.
    """
    if kernels is not None and stashes and batched_commit_enabled():
        layers = batched_commit_layers(stashes, kernels, last_node, num_accepted)
        if layers is not None:
            reuse = kernels.commit_reuse
            if reuse is None:
                return kbatch.commit_layers_planned(kernels.plan, *layers)
            launches, reuse.uploaded = kbatch.commit_layers_reusing(kernels.plan, *layers, reuse.uploaded)  # type: ignore[arg-type]
            return launches
    for stash in stashes:
        commit_gdn_layer(stash, parents, cu_nodes, last_node, num_accepted, kernels)
    return None


def batched_commit_layers(
    stashes: Sequence[GDNStash], kernels: StepKernels, last_node: Tensor, num_accepted: Tensor
) -> tuple[list[kbatch.GDNCommitLayer], list[kbatch.ConvCommitLayer]] | None:
    """The operands of the batched commit of these layers, or None when some layer is not on the kernel
    path (its slots are not one of the step's groups, or its tensors are ones the per-layer kernels do
    not take): every layer then keeps the per-layer path, which decides layer by layer."""
    gdn, conv = [], []
    reuse = kernels.commit_reuse
    checked = _checked_operands(stashes) if reuse is not None else None
    known = reuse is not None and reuse.checked is not None and _same(checked, reuse.checked)  # type: ignore[arg-type]
    for stash in stashes:
        group = kernels.group_of(stash.state_indices)
        if group is None:
            return None
        if not known:
            if kgdn.commit_unsupported_reason(stash.k, stash.delta, stash.ssm_state) is not None:
                return None
            if kconv.conv_unsupported_reason(stash.x, stash.conv_state, stash.width) is not None:
                return None
        gdn_idx, conv_idx = kernels.commit_indices(group, last_node, num_accepted)
        gdn.append(kbatch.GDNCommitLayer(stash.k, stash.g, stash.delta, stash.ssm_state, gdn_idx))
        conv.append(kbatch.ConvCommitLayer(stash.x, stash.conv_state, conv_idx, stash.width))
    if reuse is not None:
        reuse.checked = checked
    return gdn, conv


def _checked_operands(stashes: Sequence[GDNStash]) -> tuple[object, ...]:
    """What the kernel checks of ``batched_commit_layers`` read, per layer (tensors by identity)."""
    return tuple(v for s in stashes for v in (s.k, s.delta, s.ssm_state, s.x, s.conv_state, s.width))


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return len(a) == len(b) and all(x is y or (type(x) is int and x == y) for x, y in zip(a, b))


def _commit_state_per_call(stash: GDNStash, parents: Tensor, cu_nodes: Tensor, last_node: Tensor, num_accepted: Tensor) -> None:
    slots = stash.state_indices
    prev = stash.prev_accepted - 1
    p = num_accepted.to(torch.long)
    src = slots.gather(1, prev[:, None]).squeeze(1)
    dst = slots.gather(1, p[:, None]).squeeze(1)
    tree_ops().gdn_tree_commit(stash.k, stash.g, stash.delta, parents, cu_nodes, last_node, stash.ssm_state, src, dst)


def _commit_window_per_call(stash: GDNStash, parents: Tensor, cu_nodes: Tensor, last_node: Tensor, num_accepted: Tensor) -> None:
    conv_slot = stash.state_indices[:, 0]
    tree_ops().tree_conv_commit(
        stash.x, parents, cu_nodes, last_node, stash.conv_state, conv_slot, conv_slot, stash.width,
        stash.prev_accepted - 1, num_accepted.to(torch.long),
    )


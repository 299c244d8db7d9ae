"""A full-graph tree step's topology tables on the device (``cuda/tree_step_topology.cu``).

A decode step that replays a full CUDA graph verifies R trees of n nodes each; the graph reads the
GDN plan (``TreePlan.build_into``'s fixed layout), the tree attention's ancestor bitmasks
(``TreeAttentionPlan.build_into``) and the rows' depth positions. ``step_topology`` writes all three
from the proposal's parents where they already are, on the device, in one launch queued after the
drafter: the host need not wait for the proposal's copy before it launches the forward
(``vllm_plugin/runtime/device_topology.py``). ``step_topology_reference`` has the same signature
and builds the same tables with the host functions the runtime used before (numpy, then one copy
each); the two agree entry for entry (tests/cpu/test_step_topology_kernel.py,
tests/gpu/test_step_topology_gpu.py).

Arguments (both functions):

* ``parents``: int64 [P, >= n] local parents of proposals (-1 at each root), any row stride;
* ``rows``: int32 [R] proposal row of each request, or None (request r reads row r);
* ``n``: nodes per tree; R = ``plan``'s request count (``bits.shape[0] // n``);
* ``plan``: int32 1-d, at least ``TreePlan.fixed_size(R, n)`` entries (the tables go to its start);
* ``bits``: int64 [R n, words] with words = ceil(n / 64) (the attention buffer's bitmask view);
* ``positions``: int64 [>= R n] (1-d RoPE) or [P, >= R n] with P <= 4 rows, any row stride (M-RoPE: vLLM's
  ``mrope_positions`` [3, tokens]), positions of the step's rows, sequential on entry (root rows are
  read); tree rows get root + depth, in every row. None: left alone;
* ``err``: int32 [1]: the kernel adds the number of malformed nodes (root not -1, a parent not
  before its child); the reference raises ValueError on them instead, naming the first.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.kernels.loader import get_kernel, kernels_unavailable_reason, launch, tensor_device_index
from vllm_tfm.kernels.plan import TreePlan, upload_into
from vllm_tfm.tree.bitmask import ancestor_bits_and_depths, ragged_ancestor_bits

__all__ = ["MAX_NODES", "MAX_N", "MAX_POSITION_ROWS", "NOT_CUDA", "step_topology", "step_topology_kernel", "step_topology_reference",
           "unsupported_reason"]

SOURCE = "tree_step_topology.cu"
THREADS = 512  # TOPO_THREADS
MAX_NODES = 2048  # TOPO_MAX_NODES: R n per launch
MAX_N = 128  # TOPO_MAX_N: two bitmask words
MAX_POSITION_ROWS = 4  # M-RoPE has 3
NOT_CUDA = "the tensors are not all on one CUDA device"


def _shape_error(parents: Tensor, rows: Tensor | None, n: int, plan: Tensor, bits: Tensor,
                 positions: Tensor | None, err: Tensor) -> str | None:
    if n < 2 or n > MAX_N:
        return f"n = {n} nodes per tree: the kernel takes 2 to {MAX_N}"
    words = (n + 63) // 64
    if bits.dim() != 2 or bits.shape[1] != words or bits.shape[0] % n or bits.dtype != torch.int64:
        return f"bits must be int64 [R n, {words}], got {bits.dtype} {tuple(bits.shape)}"
    r = bits.shape[0] // n
    if r * n > MAX_NODES:
        return f"{r * n} nodes: the kernel takes at most {MAX_NODES} per launch"
    if parents.dim() != 2 or parents.shape[1] < n or parents.dtype != torch.int64 or parents.stride(1) != 1:
        return f"parents must be int64 [P, >= {n}] with contiguous rows, got {parents.dtype} {tuple(parents.shape)}"
    if rows is not None and (rows.dtype != torch.int32 or tuple(rows.shape) != (r,) or not rows.is_contiguous()):
        return f"rows must be int32 [{r}], got {rows.dtype} {tuple(rows.shape)}"
    if rows is None and parents.shape[0] < r:
        return f"{parents.shape[0]} proposal rows for {r} requests and no row map"
    if (plan.dtype != torch.int32 or plan.dim() != 1 or not plan.is_contiguous()
            or plan.numel() < TreePlan.fixed_size(r, n)):
        return f"plan must be a contiguous int32 1-d tensor of >= {TreePlan.fixed_size(r, n)} entries"
    if not bits.is_contiguous():
        return "bits must be contiguous"
    if positions is not None and (positions.dtype != torch.int64 or positions.dim() not in (1, 2)
                                  or positions.shape[-1] < r * n or positions.stride(-1) != 1
                                  or (positions.dim() == 2 and not 1 <= positions.shape[0] <= MAX_POSITION_ROWS)):
        return (f"positions must be int64 [>= {r * n}] or [1..{MAX_POSITION_ROWS}, >= {r * n}] with contiguous rows, "
                f"got {positions.dtype} {tuple(positions.shape)}")
    if err.dtype != torch.int32 or err.numel() < 1:
        return "err must be int32 [1]"
    return None


def unsupported_reason(parents: Tensor, rows: Tensor | None, n: int, plan: Tensor, bits: Tensor,
                       positions: Tensor | None, err: Tensor) -> str | None:
    """None when the kernel takes these arguments, else why not (host metadata only)."""
    reason = _shape_error(parents, rows, n, plan, bits, positions, err)
    if reason is not None:
        return reason
    tensors = [t for t in (parents, rows, plan, bits, positions, err) if t is not None]
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        return NOT_CUDA
    return kernels_unavailable_reason(parents.device.index)


def step_topology(parents: Tensor, rows: Tensor | None, n: int, plan: Tensor, bits: Tensor,
                  positions: Tensor | None, err: Tensor) -> None:
    """The launch (module docstring); raises ValueError for arguments ``unsupported_reason`` rejects
    on their shapes. No host synchronisation."""
    n = int(n)
    reason = _shape_error(parents, rows, n, plan, bits, positions, err)
    if reason is not None:
        raise ValueError(f"step_topology: {reason}")
    step_topology_kernel(parents, rows, n, plan, bits, positions, err)


def step_topology_kernel(parents: Tensor, rows: Tensor | None, n: int, plan: Tensor, bits: Tensor,
                         positions: Tensor | None, err: Tensor) -> None:
    """The launch itself, for arguments ``unsupported_reason`` accepted (not checked again: the
    runtime checks once per step, runtime/device_topology.py)."""
    r = bits.shape[0] // n
    kernel = get_kernel(SOURCE, "tree_step_topology", ["--std=c++17", "-lineinfo"], tensor_device_index(parents))
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    pos_rows, pos_ld = 0, 0  # no positions
    if positions is not None:
        pos_rows, pos_ld = (1, 0) if positions.dim() == 1 else (positions.shape[0], positions.stride(0))
    launch(kernel, (1, 1, 1), (THREADS, 1, 1),
           [parents, i64(parents.stride(0)), rows, i32(r), i32(n), plan, bits, i32(bits.shape[1]), positions,
            i32(pos_rows), i64(pos_ld), err])


def step_topology_reference(parents: Tensor, rows: Tensor | None, n: int, plan: Tensor, bits: Tensor,
                            positions: Tensor | None, err: Tensor) -> None:
    """The same tables from the host functions (one device-to-host copy of the parents, then
    ``TreePlan.build_into``, ``ancestor_bits_and_depths`` and the depth positions); ``err`` is left
    alone and malformed trees raise ValueError."""
    n = int(n)
    reason = _shape_error(parents, rows, n, plan, bits, positions, err)
    if reason is not None:
        raise ValueError(f"step_topology: {reason}")
    r = bits.shape[0] // n
    idx = torch.arange(r) if rows is None else rows.detach().cpu().to(torch.long)
    flat = parents.detach()[idx.to(parents.device), :n].cpu().numpy().astype(np.int64).reshape(-1)
    cu = np.arange(r + 1, dtype=np.int64) * n
    anc, depth = ancestor_bits_and_depths(flat, cu)  # validates: ValueError naming the first bad parent
    if anc.shape[1] != bits.shape[1]:  # more than 64 nodes: whole-array bits of the step's width
        anc = ragged_ancestor_bits(flat, cu, words=bits.shape[1])
    TreePlan.build_into(plan, flat, cu, n, ancestor_bits=anc)
    upload_into(bits, torch.from_numpy(np.ascontiguousarray(anc)))
    if positions is not None:
        rows_of = positions.view(1, -1) if positions.dim() == 1 else positions
        step = rows_of[:, : r * n].view(rows_of.shape[0], r, n)
        tree = step[:, :, :1] + torch.from_numpy(depth).to(positions.device).view(1, r, n)
        step.copy_(tree)

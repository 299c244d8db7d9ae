"""Greedy tree acceptance of a ragged batch in one launch (``cuda/tree_greedy_accept.cu``).

At temperature 0 a tree step accepts, per request, the root-to-node path that follows the target's argmax:
from the root, the first child (index order) whose draft token is the argmax at the current node, until
none is; the bonus token is the argmax at the last node (``vllm_tfm.verify.sampling.verify_greedy``). The
torch path does this in ~45 small launches (children table, pointer doubling, path gathers, vLLM's int32
layout); the kernel does the walk and writes every output in one. ``tree_greedy_accept_reference`` has the
same signature and computes the result with the torch path (``greedy_walk``); the two agree entry for
entry (tests/cpu/test_greedy_accept_kernel.py through the CPU emulation, tests/gpu/test_greedy_accept_gpu.py).

Arguments (both functions):

* ``target``: int64 [T], the argmax of every logits row (``logits.argmax(-1)``);
* ``parents``: int64 [T], local parents, -1 at each request's root (node 0 of the request);
* ``cu``: int64 [R + 1], the requests' node offsets;
* ``drafts``: int32 or int64 [T - R], the draft tokens in request order (vLLM's
  ``spec_decode_metadata.draft_token_ids``): local node i >= 1 of request r is ``drafts[cu[r] - r - 1 + i]``;
* ``dmax``: the batch's largest depth (the width of ``accepted_nodes``);
* ``sampled_cols``: columns of vLLM's int32 ``sampled_token_ids`` (``max_spec_len + 1`` >= dmax + 1);
* ``max_nodes``: the largest tree of the batch (host value; the kernel takes up to ``MAX_N``).

Returns (``AcceptResult``, sampled_token_ids int32 [R, sampled_cols]: the output tokens, then -1).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.kernels.loader import get_kernel, kernels_unavailable_reason, launch, tensor_device_index
from vllm_tfm.tree.bitmask import ragged_depths
from vllm_tfm.tree.types import TreeBatch
from vllm_tfm.verify.accept_result import AcceptResult
from vllm_tfm.verify.sampling import greedy_walk
from vllm_tfm.verify.tree_tables import TreeTables

__all__ = ["MAX_N", "NOT_CUDA", "tree_greedy_accept", "tree_greedy_accept_kernel", "tree_greedy_accept_reference",
           "unsupported_reason"]

SOURCE = "tree_greedy_accept.cu"
THREADS = 128  # GA_THREADS
MAX_N = 1024  # GA_MAX_N: nodes per request
NOT_CUDA = "the tensors are not all on one CUDA device"


def _shape_error(target: Tensor, parents: Tensor, cu: Tensor, drafts: Tensor, dmax: int, sampled_cols: int,
                 max_nodes: int) -> str | None:
    if target.dim() != 1 or target.dtype != torch.int64 or not target.is_contiguous():
        return f"target must be a contiguous int64 [T] tensor, got {target.dtype} {tuple(target.shape)}"
    t = target.shape[0]
    if parents.dtype != torch.int64 or tuple(parents.shape) != (t,) or not parents.is_contiguous():
        return f"parents must be a contiguous int64 [{t}] tensor, got {parents.dtype} {tuple(parents.shape)}"
    if cu.dtype != torch.int64 or cu.dim() != 1 or cu.shape[0] < 2 or not cu.is_contiguous():
        return f"cu must be a contiguous int64 [R + 1] tensor (R >= 1), got {cu.dtype} {tuple(cu.shape)}"
    r = cu.shape[0] - 1
    if drafts.dtype not in (torch.int32, torch.int64) or tuple(drafts.shape) != (t - r,) or not drafts.is_contiguous():
        return f"drafts must be a contiguous int32 or int64 [{t - r}] tensor, got {drafts.dtype} {tuple(drafts.shape)}"
    if not 1 <= max_nodes <= MAX_N:
        return f"{max_nodes} nodes in a tree: the kernel takes 1 to {MAX_N}"
    if not 0 <= dmax < max_nodes:
        return f"dmax = {dmax} for trees of at most {max_nodes} nodes"
    if sampled_cols < dmax + 1:
        return f"sampled_cols = {sampled_cols} < dmax + 1 = {dmax + 1}"
    return None


def unsupported_reason(target: Tensor, parents: Tensor, cu: Tensor, drafts: Tensor, dmax: int, sampled_cols: int,
                       max_nodes: int) -> str | None:
    """None when the kernel takes these arguments, else why not (host metadata only)."""
    reason = _shape_error(target, parents, cu, drafts, dmax, sampled_cols, max_nodes)
    if reason is not None:
        return reason
    tensors = (target, parents, cu, drafts)
    if not all(x.is_cuda for x in tensors) or len({x.device for x in tensors}) != 1:
        return NOT_CUDA
    return kernels_unavailable_reason(target.device.index)


def _outputs(r: int, dmax: int, sampled_cols: int, device: torch.device) -> tuple[Tensor, ...]:
    def i64(*shape: int) -> Tensor:
        return torch.empty(shape, dtype=torch.int64, device=device)

    return (i64(r, dmax), i64(r), i64(r), i64(r), i64(r, dmax + 1),
            torch.empty((r, sampled_cols), dtype=torch.int32, device=device))


def tree_greedy_accept(target: Tensor, parents: Tensor, cu: Tensor, drafts: Tensor, dmax: int, sampled_cols: int,
                       max_nodes: int) -> tuple[AcceptResult, Tensor]:
    """The launch (module docstring); raises ValueError for arguments ``unsupported_reason`` rejects on
    their shapes. No host synchronisation."""
    dmax, sampled_cols, max_nodes = int(dmax), int(sampled_cols), int(max_nodes)
    reason = _shape_error(target, parents, cu, drafts, dmax, sampled_cols, max_nodes)
    if reason is not None:
        raise ValueError(f"tree_greedy_accept: {reason}")
    return tree_greedy_accept_kernel(target, parents, cu, drafts, dmax, sampled_cols)


def tree_greedy_accept_kernel(target: Tensor, parents: Tensor, cu: Tensor, drafts: Tensor, dmax: int,
                              sampled_cols: int) -> tuple[AcceptResult, Tensor]:
    """The launch itself, for arguments ``unsupported_reason`` accepted (not checked again)."""
    r = cu.shape[0] - 1
    accepted, num_accepted, last, bonus, tokens, sampled = _outputs(r, dmax, sampled_cols, target.device)
    kernel = get_kernel(SOURCE, "tree_greedy_accept", ["--std=c++17", "-lineinfo"], tensor_device_index(target))
    i32 = ctypes.c_int
    launch(kernel, (r, 1, 1), (THREADS, 1, 1),
           [target, parents, cu, drafts, i32(int(drafts.dtype == torch.int64)), i32(dmax), accepted, num_accepted,
            last, bonus, tokens, sampled, i32(sampled_cols)])
    return AcceptResult(accepted, num_accepted, last, bonus, tokens), sampled


def tree_greedy_accept_reference(target: Tensor, parents: Tensor, cu: Tensor, drafts: Tensor, dmax: int,
                                 sampled_cols: int, max_nodes: int) -> tuple[AcceptResult, Tensor]:
    """The same result from the torch path: the tree batch of the drafts, its ``TreeTables`` (host-built,
    reading the tree back from the device) and ``greedy_walk``; ``dmax`` must be the trees' largest depth."""
    dmax, sampled_cols, max_nodes = int(dmax), int(sampled_cols), int(max_nodes)
    reason = _shape_error(target, parents, cu, drafts, dmax, sampled_cols, max_nodes)
    if reason is not None:
        raise ValueError(f"tree_greedy_accept: {reason}")
    par, cu_host = parents.cpu().numpy(), cu.cpu().numpy()
    depth = ragged_depths(par, cu_host)
    if int(depth.max()) != dmax:
        raise ValueError(f"tree_greedy_accept: dmax = {dmax}, the trees' largest depth is {int(depth.max())}")
    tokens = torch.zeros(target.shape[0], dtype=torch.int64, device=target.device)
    tokens[torch.from_numpy(np.nonzero(par >= 0)[0]).to(target.device)] = drafts.to(torch.int64)
    trees = TreeBatch(tokens, parents, torch.from_numpy(depth).to(target.device), cu)
    result = greedy_walk(target, trees, TreeTables.from_host(par, cu_host, target.device, depth=depth))
    sampled = torch.full((cu.shape[0] - 1, sampled_cols), -1, dtype=torch.int32, device=target.device)
    sampled[:, : dmax + 1] = result.output_tokens.to(torch.int32)
    return result, sampled

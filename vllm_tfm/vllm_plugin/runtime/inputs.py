"""Per-step tree metadata from the scheduled batch, and tree (depth) positions.

Runs inside the ``GPUModelRunner._prepare_inputs`` wrapper, after vLLM has computed the
sequential positions, the slot mapping (node j of a request keeps the sequential KV slot
``ctx + j``) and the spec-decode metadata. Then:

* ``build_step_tree`` looks up each spec request's tree (``ProposalStore``) and lays out, in batch
  order, local parents and depths of every scheduled row, the same for the logits rows the
  sampler sees, the spec-request subset the GDN layers see, and, for the requests whose tree is
  not a chain, the tree attention plan: request indices, first rows, sizes and ancestor bitmasks
  of all of them, built with whole-array operations and copied to the device in one transfer
  (``vllm_tfm.kernels.tree_attention.TreeAttentionPlan``) when the first tree-masked attention
  layer reads it (``StepTree.attn_plan``; a step that replays a full tree graph never does). The per-request biases of the fallback
  attention path (``per_request_trees``) are only built if that path runs.
* ``tree_positions`` turns positions into ``position(root) + depth`` (RoPE of a node = its place on
  its own root..node path); vLLM's ``_preprocess`` reads the positions buffer after this.

A step is *tree-active* when some request verifies a non-chain tree (or, with the debug switch
``force_tree_path``, any spec request with drafts). Steps that are not tree-active run vLLM's
native chain path untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.kernels.tree_attention import TreeAttentionPlan
from vllm_tfm.tree.bitmask import ancestor_bits_and_depths, ragged_depths, walked_in_one_pass
from vllm_tfm.tree.types import ancestor_mask

from .state import LOOKUP_OFF, AttnTree, ProposalStore, StepTree

__all__ = [
    "build_step_tree",
    "tree_positions",
    "ancestor_bias",
    "attention_plan",
    "per_request_trees",
    "BIAS_PAD_ROWS",
]


BIAS_PAD_ROWS = 32
"""Zero rows after the n real rows of a tree bias. The Triton kernel reads bias row ``query_pos``
for every row of its last query tile (up to BLOCK_Q - 1 <= 31 rows past the request's n rows,
masking only the key columns), so the padding keeps those reads inside the allocation."""


def ancestor_bias(parents: np.ndarray, device: torch.device | str) -> Tensor:
    """[n + BIAS_PAD_ROWS, n] float32 attention bias for ``unified_attention(qq_bias=...)``.

    Row i < n: 0 where key j is an ancestor-or-self of query i, else -inf; rows >= n are zero
    padding (see ``BIAS_PAD_ROWS``). The row stride is n, the kernel's query-key width.
    """
    m = ancestor_mask(torch.from_numpy(np.asarray(parents, dtype=np.int64)))
    n = m.shape[0]
    bias = torch.zeros(n + BIAS_PAD_ROWS, n, dtype=torch.float32)
    bias[:n].masked_fill_(~m, float("-inf"))
    return bias.to(device, non_blocking=True)


def _bias_from_bits(bits: np.ndarray, n: int, device: torch.device | str) -> Tensor:
    """``ancestor_bias`` of one tree from its bitmask rows [n, W] (int64)."""
    j = np.arange(n)
    vis = ((bits[:, j // 64] >> (j % 64)) & 1).astype(bool)
    bias = torch.zeros(n + BIAS_PAD_ROWS, n, dtype=torch.float32)
    bias[:n].masked_fill_(~torch.from_numpy(vis), float("-inf"))
    return bias.to(device, non_blocking=True)


def attention_plan(step: StepTree) -> TreeAttentionPlan | None:
    """The tree attention plan of a step: every request whose tree is not a chain, vectorised.

    Rows of tree request r are ``query_start[r] .. + num_scheduled[r] - 1`` (its tree in node
    order); their local parents come from ``step.local_parent``. None when no request needs a mask.
    """
    reqs = np.nonzero(step.is_tree)[0].astype(np.int64)
    if reqs.size == 0:
        return None
    sizes = step.num_scheduled[reqs]
    starts = step.query_start[reqs]
    cu = np.zeros(reqs.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=cu[1:])
    rows = np.repeat(starts - cu[:-1], sizes) + np.arange(int(cu[-1]), dtype=np.int64)
    return TreeAttentionPlan.from_parents(reqs, starts, sizes, step.local_parent[rows], step.device)


def per_request_trees(plan: TreeAttentionPlan, device: torch.device | str) -> list[AttnTree]:
    """The plan as one ``AttnTree`` (bias [n + pad, n], cu_q) per request, for the fallback path."""
    trees = []
    off = 0
    for r, s, n in zip(plan.tree_req.tolist(), plan.tree_start.tolist(), plan.tree_size.tolist()):
        cu_q = torch.tensor([0, n], dtype=torch.int32).to(device, non_blocking=True)
        trees.append(AttnTree(r, s, n, _bias_from_bits(plan.bits[off : off + n], n, device), cu_q))
        off += n
    return trees


def build_step_tree(
    req_ids: Sequence[str],
    num_scheduled: np.ndarray,
    spec_tokens: Mapping[str, Sequence[int]],
    store: ProposalStore,
    allow_trees: bool,
    force_tree_path: bool = False,
    device: torch.device | str = "cpu",
    defer_topology: bool = False,
    one_slot: bool = False,
) -> StepTree:
    """Tree metadata of one step.

    Args:
        req_ids: the R requests in batch order; num_scheduled: [R] scheduled tokens per request.
        spec_tokens: req_id -> draft tokens scheduled this step (``scheduled_spec_decode_tokens``).
        store: where the proposals live; a request whose scheduled drafts are not a prefix of its
            proposal (or has none) verifies its drafts as a chain.
        allow_trees: False when the batch needs vLLM's own sampler (penalties, logprobs, ...):
            every request then verifies a chain and the step is not tree-active.
        force_tree_path: make any step with drafts tree-active (debug).
        defer_topology: rows holding placeholders of the proposal whose host copy is still in flight
            (deferred drafts) do not wait for it: they count as trees (tree-active step), their
            lookup is known from the lengths, and the arrays that need their parents (local and
            sample parents, depths, spec parents, is_tree) are filled by ``StepTree.complete``
            (vLLM's ``_preprocess``, after the dispatch and the attention metadata). A row whose
            proposal turns out to be a chain keeps the tree path (exact for chains too).
        one_slot: one GDN state slot per request (``one_slot.py``): a step with drafts that is not
            tree-active is a ``gdn_tree`` step (vLLM's sampler verifies its chains, the GDN layers take
            the tree path).
    """
    num_req = len(req_ids)
    num_scheduled = np.asarray(num_scheduled, dtype=np.int64)
    if num_scheduled.shape != (num_req,):
        raise ValueError(f"num_scheduled must have shape [{num_req}], got {num_scheduled.shape}")
    use_spec = len(spec_tokens) > 0
    qs = np.zeros(num_req + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=qs[1:])
    num_draft = np.zeros(num_req, dtype=np.int64)
    is_spec = np.zeros(num_req, dtype=bool)
    is_tree = np.zeros(num_req, dtype=bool)
    local_parent: list[np.ndarray | None] = []
    lookup = np.zeros(num_req, dtype=np.int8)
    proposal_len = np.zeros(num_req, dtype=np.int64)
    deferred: list[tuple[int, str, list[int]]] = []  # rows whose parents come with the proposal's host copy
    for r, rid in enumerate(req_ids):
        n = int(num_scheduled[r])
        drafts = spec_tokens.get(rid, ())
        d = len(drafts)
        num_draft[r] = d
        # vLLM's spec-decode rows (gpu_model_runner.py:2226-2235): scheduled drafts and nothing else;
        # a running request that got one token and no drafts (token budget) is a non-spec row there
        is_spec[r] = use_spec and rid in spec_tokens and n == d + 1
        par = np.arange(-1, n - 1, dtype=np.int64)  # a chain
        if is_spec[r] and d > 0 and not allow_trees:
            lookup[r] = LOOKUP_OFF
        elif is_spec[r] and d > 0:
            provisional = store.provisional_match(rid, drafts) if defer_topology else None
            if provisional is not None:
                lookup[r], proposal_len[r] = provisional
                is_tree[r] = True
                deferred.append((r, rid, list(drafts)))
                par = None  # filled by StepTree.complete
            else:
                rec, lookup[r], proposal_len[r] = store.match(rid, list(drafts))
                if rec is not None and not rec.is_chain:
                    par = rec.parents.astype(np.int64)
                    is_tree[r] = True
        local_parent.append(par)
    has_drafts = bool((is_spec & (num_draft > 0)).any())
    tree_active = bool(allow_trees and (is_tree.any() or (force_tree_path and has_drafts)))
    sample_cu = np.zeros(num_req + 1, dtype=np.int64)
    np.cumsum(num_draft + 1, out=sample_cu[1:])
    spec_idx = np.nonzero(is_spec)[0].astype(np.int64)
    spec_cu = np.zeros(spec_idx.shape[0] + 1, dtype=np.int64)
    np.cumsum(num_scheduled[spec_idx], out=spec_cu[1:])
    step = StepTree(
        num_reqs=num_req,
        num_tokens=int(qs[-1]),
        tree_active=tree_active,
        query_start=qs,
        num_scheduled=num_scheduled,
        num_draft=num_draft,
        row_base=qs[:-1] + num_scheduled - num_draft - 1,
        req_index=np.repeat(np.arange(num_req, dtype=np.int64), num_scheduled),
        is_spec=is_spec,
        is_tree=is_tree,
        **(_pending_arrays(qs, sample_cu, spec_cu) if deferred else
           _topology_arrays(local_parent, qs, num_draft, is_spec, sample_cu, spec_idx)),
        sample_cu=sample_cu,
        spec_cu=spec_cu,
        spec_req_index=spec_idx,
        device=device,
        lookup=lookup,
        proposal_len=proposal_len,
        gdn_tree=bool(one_slot and has_drafts and not tree_active),
    )
    if deferred:

        def fill_topology() -> None:
            for r, rid, drafts in deferred:
                rec, lookup[r], proposal_len[r] = store.match(rid, drafts)
                if rec is not None and not rec.is_chain:
                    local_parent[r] = rec.parents.astype(np.int64)
                else:  # a chain (or, never expected, no longer matching): verified as a chain on the tree path
                    local_parent[r] = np.arange(-1, int(num_scheduled[r]) - 1, dtype=np.int64)
                    is_tree[r] = False
            for name, value in _topology_arrays(local_parent, qs, num_draft, is_spec, sample_cu, spec_idx).items():
                setattr(step, name, value)

        step._topology = fill_topology
    elif tree_active:
        step.defer_attn_plan()  # built by the first tree-masked attention layer; a full-graph step needs none
        step.upload()  # every index array the step's hooks read on the device, in one copy
    elif step.gdn_tree:
        step.upload()
    return step


def _pending_arrays(qs: np.ndarray, sample_cu: np.ndarray, spec_cu: np.ndarray) -> dict[str, np.ndarray]:
    """``_topology_arrays``' shapes, every entry -2 (not a parent, not a depth) until ``StepTree.complete``."""
    t, n, ts = int(qs[-1]), int(sample_cu[-1]), int(spec_cu[-1])
    return {"local_parent": np.full(t, -2, dtype=np.int64), "depth": np.full(t, -2, dtype=np.int64),
            "sample_parents": np.full(n, -2, dtype=np.int64), "sample_depth": np.full(n, -2, dtype=np.int64),
            "spec_parents": np.full(ts, -2, dtype=np.int64), "ancestor_bits": None}


def _topology_arrays(
    local_parent: list[np.ndarray],
    qs: np.ndarray,
    num_draft: np.ndarray,
    is_spec: np.ndarray,
    sample_cu: np.ndarray,
    spec_idx: np.ndarray,
) -> dict[str, np.ndarray]:
    """The step's arrays that depend on its trees' parents: local parents and depths of the scheduled
    rows, the same for the logits rows (a spec row's tree; otherwise the last d + 1 rows, any drafts
    read as a chain), the spec rows' parents, and the scheduled rows' ancestor bitmasks when the step is
    a few hundred rows in requests of <= 64 (else None)."""
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
    num_req = len(local_parent)
    parents_all = cat(local_parent)
    if parents_all.shape[0] and walked_in_one_pass(parents_all.shape[0], int(np.diff(qs).max())):
        # a decode step's trees: depths and ancestor bitmasks in one pass (the full graph's plans read the bits)
        bits, depth_all = ancestor_bits_and_depths(parents_all, qs)
    else:
        bits, depth_all = None, ragged_depths(parents_all, qs)  # whole-array, not per request
    if is_spec.all():  # every row a spec row (the usual decode step): the logits rows are the scheduled rows
        sample_parents_all, sample_depth_all = parents_all, depth_all
    else:
        sample = [local_parent[r] if is_spec[r] else np.arange(-1, int(num_draft[r]), dtype=np.int64)
                  for r in range(num_req)]
        sample_parents_all = cat(sample)
        sample_depth_all = ragged_depths(sample_parents_all, sample_cu)
    spec_parents = parents_all if spec_idx.shape[0] == num_req else cat([local_parent[i] for i in spec_idx])
    return {"local_parent": parents_all, "depth": depth_all, "sample_parents": sample_parents_all,
            "sample_depth": sample_depth_all, "spec_parents": spec_parents, "ancestor_bits": bits}


def tree_positions(positions: Tensor, query_start: Tensor, req_index: Tensor, depth: Tensor) -> Tensor:
    """position(root of the row's request) + depth(row), for every row.

    positions: [T] or [3, T] (M-RoPE: the text rows' three components move together);
    query_start: [R + 1] first row of each request; req_index: [T] request of each row; depth: [T].
    Rows of chain requests keep their positions (their depth is their offset from the root).
    """
    root_rows = query_start.to(torch.long)[req_index.to(torch.long)]
    root = positions.index_select(-1, root_rows)
    return root + depth.to(positions.dtype)

"""Tree plan: the index tables the CUDA kernels read, built once per decode step on the host.

A plan depends only on the tree shapes (``parents``, ``cu_nodes``), so one plan serves the GDN
verify and commit and the conv of every layer of a step. Layout (all int32 on the target device;
T nodes, R requests, P = sum over nodes of depth + 1):

* ``cu`` [R+1]: node offsets of the requests (``cu_nodes``).
* ``perm`` [T]: level order, the flat node index at each position; positions of request r are
  ``cu[r] .. cu[r+1]-1``, sorted by (depth, node index).
* ``pos`` [T]: inverse of ``perm``.
* ``depth`` [T]: depth of each node (root 0).
* ``pair_off`` [T+1]: by level position p, the first entry of that node's path in ``pair_j``.
* ``pair_j`` [P]: for each node (in level order) its root..node path as flat node indices,
  root first, the node itself last: entry ``pair_off[pos[i]] + e`` is i's ancestor at depth e.
* ``req_of`` [T]: request of each node.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.tree.bitmask import ragged_ancestor_bits

__all__ = ["TreePlan", "CommitIndices", "ancestor_matrix", "upload_into"]


def _depths(gpar: np.ndarray) -> np.ndarray:
    """Depth of every node from flat parents (-1 at roots) by pointer jumping (log2 depth rounds)."""
    depth = (gpar >= 0).astype(np.int64)
    jump = gpar.copy()
    while True:
        live = np.nonzero(jump >= 0)[0]
        if live.size == 0:
            return depth
        tgt = jump[live]
        add, nxt = depth[tgt], jump[tgt]  # read before writing: simultaneous update
        depth[live] += add
        jump[live] = nxt


def ancestor_matrix(bits: np.ndarray, num_requests: int, nodes_per_request: int) -> np.ndarray:
    """[R, n, n] bool ancestor-or-self matrices of R trees of n nodes from their bitmask rows
    (``tree.bitmask.ragged_ancestor_bits``: [R n, words], bit j % 64 of word j // 64 of row i set
    when node j lies on the root..i path): entry [r, i, j] is that bit of tree r's row i."""
    r, n = int(num_requests), int(nodes_per_request)
    raw = np.ascontiguousarray(bits).astype("<i8", copy=False).view(np.uint8).reshape(r, n, -1)
    return np.unpackbits(raw, axis=2, count=n, bitorder="little").view(bool)


@dataclass(frozen=True)
class TreePlan:
    """Index tables of a ragged tree batch for the CUDA kernels (see the module docstring)."""

    num_requests: int
    num_nodes: int
    max_nodes: int
    max_depth: int
    num_pairs: int
    max_pairs_per_request: int
    cu: Tensor
    perm: Tensor
    pos: Tensor
    depth: Tensor
    pair_off: Tensor
    pair_j: Tensor
    req_of: Tensor
    depth_bound: int | None = None
    """A fixed-layout plan's depth that its trees are expected not to exceed (full CUDA graphs: the
    drafter's ``max_depth``), below its capacity ``max_depth`` = n - 1. Read only by version 6's choice
    of solve (``kernels.gdn.grouped_solve``), which is exact for any depth; None: ``max_depth``."""

    @property
    def device(self) -> torch.device:
        return self.cu.device

    @staticmethod
    def build(parents: Tensor, cu_nodes: Tensor, device: torch.device | str | None = None) -> "TreePlan":
        """Validate a ragged batch (parents [T] local, -1 at roots; cu_nodes [R+1]) and build its plan.

        Runs on the CPU (one device-to-host copy of parents and cu_nodes when they live on a GPU)
        and copies the tables to ``device`` (default: parents' device) in one transfer.
        Raises ValueError naming the first malformed entry.
        """
        target = torch.device(device) if device is not None else parents.device
        host = _host_plan(parents, cu_nodes)
        packed = torch.cat(host._tables()).to(torch.int32).to(target)
        return host._over(packed, host.num_pairs, host.max_depth, host.max_pairs_per_request)

    @staticmethod
    def build_into(buffer: Tensor, parents: Tensor | np.ndarray, cu_nodes: Tensor | np.ndarray, nodes_per_request: int,
                   ancestor_bits: np.ndarray | None = None, depth_bound: int | None = None,
                   layout: "TreePlan | None" = None) -> "TreePlan":
        """The plan of a batch whose R trees all have ``nodes_per_request`` nodes, written into ``buffer``
        (int32, on the device, at least :meth:`fixed_size` entries) in a layout and with scalars that
        depend only on R and n = ``nodes_per_request``, never on the tree shapes.

        For launches recorded once and replayed with other trees (CUDA graphs): the tables' addresses,
        the kernels' grids and shared memory and every scalar argument are those of the worst case
        (max depth n - 1, n (n + 1) / 2 pairs per request, the pair tables padded to that), the table
        contents are this batch's. Every kernel computes the same values as with :meth:`build`: they
        read depths and pair offsets from the tables and use the scalars only as bounds and strides.
        The host-to-device copy is ordered on the current stream (a launch recorded earlier that reads
        the buffer sees the old tables). Raises ValueError on a malformed tree or another node count.

        ``ancestor_bits``: the batch's ``ragged_ancestor_bits`` when the caller has them already (a
        full-graph replay builds them once for this plan and the tree-attention plan). The tables are
        read off the [R, n, n] :func:`ancestor_matrix` with whole-array numpy operations (no ragged
        bookkeeping: a decode step on the critical path of the host); they equal :meth:`build`'s
        (tests/cpu/test_full_graphs.py).

        ``depth_bound``: the plan's :attr:`depth_bound` (0 <= bound; a bound >= n - 1 says nothing and is
        stored as None). A tree deeper than it is still computed exactly; it only informs the choice
        of version 6's solve, made once when a CUDA graph is captured.

        ``layout``: a plan this function returned for the same buffer, R, n and bound (a full graph's
        replays): it is returned again with the new contents, without building its views anew.
        """
        n = int(nodes_per_request)
        par = np.asarray(parents.detach().cpu() if isinstance(parents, Tensor) else parents, dtype=np.int64)
        cu = np.asarray(cu_nodes.detach().cpu() if isinstance(cu_nodes, Tensor) else cu_nodes, dtype=np.int64)
        if par.ndim != 1 or cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"parents must be [T] and cu_nodes [R+1] with R >= 1, got {par.shape} and {cu.shape}")
        counts = np.diff(cu)
        if int(cu[0]) != 0 or int(cu[-1]) != par.shape[0] or bool((counts != n).any()):
            raise ValueError(f"every tree must have {n} nodes for a fixed-layout plan, got counts {counts.tolist()} "
                             f"for {par.shape[0]} parents")
        if depth_bound is not None and int(depth_bound) < 0:
            raise ValueError(f"depth_bound must be >= 0, got {depth_bound}")
        bound = None if depth_bound is None or int(depth_bound) >= n - 1 else int(depth_bound)
        r = counts.shape[0]
        bits = ragged_ancestor_bits(par, cu) if ancestor_bits is None else ancestor_bits  # validates the trees
        words = (n + 63) // 64
        if bits.shape != (r * n, words):
            raise ValueError(f"ancestor_bits must be [{r * n}, {words}], got {bits.shape}")
        anc = ancestor_matrix(bits, r, n)
        t = r * n
        cap = TreePlan.fixed_pairs_per_request(n)
        depth = anc.sum(axis=2, dtype=np.int64) - 1  # [R, n]
        order = np.argsort(depth, axis=1, kind="stable")  # level order within each request, index breaks ties
        base = (np.arange(r, dtype=np.int64) * n)[:, None]
        perm = (order + base).reshape(-1)
        pos = np.empty(t, dtype=np.int64)
        pos[perm] = np.arange(t, dtype=np.int64)
        # a node's ancestors, shallowest first: along a root..node path indices grow with depth
        # (every parent precedes its child), so the row-major nonzeros of the level-ordered rows
        # are the pairs in build()'s order
        req, _, col = np.nonzero(anc[np.arange(r)[:, None], order])
        lengths = depth.reshape(-1)[perm] + 1
        packed = np.zeros((r + 1) + 5 * t + 1 + r * cap, dtype=np.int32)
        o = 0
        for part in (cu, perm, pos, depth.reshape(-1)):
            packed[o : o + part.shape[0]] = part
            o += part.shape[0]
        np.cumsum(lengths, out=packed[o + 1 : o + 1 + t])  # pair_off (first entry 0)
        o += t + 1
        packed[o : o + col.shape[0]] = col + req * n  # pair_j, zero-padded to R n (n + 1) / 2
        o += r * cap
        packed[o : o + t] = np.repeat(np.arange(r, dtype=np.int32), n)  # req_of
        if buffer.dtype != torch.int32 or buffer.dim() != 1 or buffer.numel() < packed.shape[0]:
            raise ValueError(f"buffer must be a 1-d int32 tensor of >= {packed.shape[0]} entries, got "
                             f"{buffer.dtype} {tuple(buffer.shape)}")
        view = buffer[: packed.shape[0]]
        upload_into(view, torch.from_numpy(packed))
        if (layout is not None and (layout.num_requests, layout.max_nodes, layout.depth_bound) == (r, n, bound)
                and layout.num_pairs == r * cap and layout.cu.data_ptr() == buffer.data_ptr()):
            return layout
        cu_d, perm_d, pos_d, depth_d, off_d, pj_d, req_d = torch.split(view, [r + 1, t, t, t, t + 1, r * cap, t])
        return TreePlan(num_requests=r, num_nodes=t, max_nodes=n, max_depth=n - 1, num_pairs=r * cap,
                        max_pairs_per_request=cap, cu=cu_d, perm=perm_d, pos=pos_d, depth=depth_d, pair_off=off_d,
                        pair_j=pj_d, req_of=req_d, depth_bound=bound)

    def _tables(self) -> list[Tensor]:
        """The tables in their packed order."""
        return [self.cu, self.perm, self.pos, self.depth, self.pair_off, self.pair_j, self.req_of]

    def _over(self, packed: Tensor, pairs_len: int, max_depth: int, max_pairs_per_request: int) -> "TreePlan":
        """This plan with its tables the consecutive slices of ``packed`` (pair_j of ``pairs_len`` entries)
        and the given bounds."""
        t = self.num_nodes
        sizes = [self.num_requests + 1, t, t, t, t + 1, pairs_len, t]
        cu, perm, pos, depth, off, pj, req = torch.split(packed, sizes)
        return dataclasses.replace(self, max_depth=max_depth, num_pairs=pairs_len, max_pairs_per_request=max_pairs_per_request,
                                   cu=cu, perm=perm, pos=pos, depth=depth, pair_off=off, pair_j=pj, req_of=req)

    @staticmethod
    def fixed_pairs_per_request(nodes_per_request: int) -> int:
        """(node, ancestor) pairs of a chain of n nodes: the most a tree of n nodes has."""
        n = int(nodes_per_request)
        return n * (n + 1) // 2

    @staticmethod
    def fixed_size(num_requests: int, nodes_per_request: int) -> int:
        """int32 entries of a :meth:`build_into` plan of R trees of n nodes."""
        r, n = int(num_requests), int(nodes_per_request)
        return (r + 1) + 5 * r * n + 1 + r * TreePlan.fixed_pairs_per_request(n)


def upload_into(dest: Tensor, host: Tensor) -> None:
    """Copy the CPU tensor ``host`` into ``dest`` in stream order without making the host wait: on a
    GPU through pinned memory, kept by PyTorch's host allocator until the copy has run."""
    if dest.is_cuda:
        dest.copy_(host.pin_memory(), non_blocking=True)
    else:
        dest.copy_(host)


def _host_plan(parents: Tensor, cu_nodes: Tensor) -> TreePlan:
    """Validate a ragged batch and compute its plan on the CPU (int64 tables; ``TreePlan`` module docstring).

    numpy, not torch: a decode step builds one plan for arrays of a few hundred entries, where
    torch's CPU operators cost microseconds to milliseconds each (thread-pool dispatch; seen at
    ~15 ms per plan at batch 8 in a vLLM worker) and numpy's about one microsecond.
    """
    if parents.dim() != 1 or cu_nodes.dim() != 1 or cu_nodes.numel() < 2:
        raise ValueError(
            f"parents must be [T] and cu_nodes [R+1] with R >= 1, got {tuple(parents.shape)} and {tuple(cu_nodes.shape)}"
        )
    if parents.dtype.is_floating_point or cu_nodes.dtype.is_floating_point:
        raise ValueError("parents and cu_nodes must be integer tensors")
    par = parents.detach().to("cpu", torch.long).numpy()
    cu = cu_nodes.detach().to("cpu", torch.long).numpy()
    t_nodes = par.shape[0]
    r_req = cu.shape[0] - 1
    counts = np.diff(cu)
    if int(cu[0]) != 0 or int(cu[-1]) != t_nodes:
        raise ValueError(f"cu_nodes must start at 0 and end at the number of nodes {t_nodes}, got {int(cu[0])}..{int(cu[-1])}")
    if (counts <= 0).any():
        r = int(np.nonzero(counts <= 0)[0][0])
        raise ValueError(f"request {r} has {int(counts[r])} nodes in cu_nodes; every tree needs at least its root")
    if t_nodes >= 2**31:
        raise ValueError(f"{t_nodes} nodes do not fit the kernels' int32 indices")
    req_of = np.repeat(np.arange(r_req, dtype=np.int64), counts)
    bos = cu[:-1][req_of]
    local = np.arange(t_nodes, dtype=np.int64) - bos
    is_root = local == 0
    bad = (is_root & (par != -1)) | (~is_root & ((par < 0) | (par >= local)))
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise ValueError(
            f"parents[{i}] = {int(par[i])} is invalid for local node {int(local[i])} of request {int(req_of[i])}: "
            "the root needs -1 and every other node 0 <= parent < its local index"
        )
    gpar = np.where(is_root, -1, par + bos)
    depth = _depths(gpar)
    max_depth = int(depth.max())

    # level order: stable sort by (request, depth); node index breaks ties
    perm = np.argsort(req_of * (max_depth + 1) + depth, kind="stable")
    pos = np.empty_like(perm)
    pos[perm] = np.arange(t_nodes, dtype=np.int64)

    # ancestor table by depth: anc[i, e] = ancestor of i at depth e (e <= depth[i])
    anc = np.full((t_nodes, max_depth + 1), -1, dtype=np.int64)
    rows = np.arange(t_nodes, dtype=np.int64)
    cur = rows.copy()
    for step in range(max_depth + 1):
        col = depth - step
        ok = col >= 0
        anc[rows[ok], col[ok]] = cur[ok]
        cur = np.where(cur >= 0, gpar[np.maximum(cur, 0)], cur)
    lengths = depth[perm] + 1
    keep = np.arange(max_depth + 1)[None, :] < lengths[:, None]
    pair_j = anc[perm][keep]
    pair_off = np.zeros(t_nodes + 1, dtype=np.int64)
    np.cumsum(lengths, out=pair_off[1:])
    num_pairs = int(pair_off[-1])
    if num_pairs >= 2**31:
        raise ValueError(f"the batch has {num_pairs} (node, ancestor) pairs; the kernels index them with int32")
    per_request = pair_off[cu[1:]] - pair_off[cu[:-1]]
    t = torch.from_numpy
    return TreePlan(num_requests=r_req, num_nodes=t_nodes, max_nodes=int(counts.max()), max_depth=max_depth,
                    num_pairs=num_pairs, max_pairs_per_request=int(per_request.max()), cu=t(cu.copy()), perm=t(perm),
                    pos=t(pos), depth=t(depth), pair_off=t(pair_off), pair_j=t(pair_j), req_of=t(req_of))


@dataclass(frozen=True)
class CommitIndices:
    """Per-request indices of one commit, on the device (int32 [R] each), built once per step.

    ``accepted``: local index of the deepest accepted node; ``src`` / ``dst``: state slots;
    ``src_start`` / ``dst_start``: conv-state column offsets (zeros for the GDN commit).
    ``snapshot``: when some slot is one request's destination and another request's source, the
    source slots (int64) to copy before writing; ``src`` then indexes that copy (0..R-1), so every
    source is read before any slot is written, as the reference promises.
    """

    accepted: Tensor
    src: Tensor
    dst: Tensor
    src_start: Tensor
    dst_start: Tensor
    snapshot: Tensor | None

    @staticmethod
    def build(
        accepted: list[int],
        src: list[int],
        dst: list[int],
        device: torch.device | str,
        src_start: list[int] | None = None,
        dst_start: list[int] | None = None,
    ) -> "CommitIndices":
        """From validated host lists (one entry per request); one host-to-device copy."""
        r = len(accepted)
        dst_set = set(dst)
        alias = any(s in dst_set and s != d for s, d in zip(src, dst))
        src_used = list(range(r)) if alias else list(src)
        rows = [accepted, src_used, dst, src_start or [0] * r, dst_start or [0] * r]
        packed = torch.tensor(rows, dtype=torch.int32).to(device)
        snapshot = torch.tensor(src, dtype=torch.long).to(device) if alias else None
        return CommitIndices(packed[0], packed[1], packed[2], packed[3], packed[4], snapshot)

"""The commit of many GDN layers in one launch per kernel kind (``gdn_tree_commit_layers`` in
``cuda/gdn_tree_commit.cu``, ``tree_conv_commit_layers`` in ``cuda/tree_conv.cu``).

A decode step commits every GDN layer: per layer one ``gdn_tree_commit`` (SSM state) and one
``tree_conv_commit`` (conv window), 96 launches at Qwen3.6-27B's 48 GDN layers, each costing tens
of microseconds of host time through cuda-python (bench/NOTES.md section 14). The layers share the
step's tree plan and accepted nodes; their tensors are separate allocations. So the batched kernels
read one row per layer from a small device table of 64-bit words (pointers and strides, field order
``GDN_LAYER_FIELDS`` / ``CONV_LAYER_FIELDS``, the ``GdnCommitLayer`` / ``ConvCommitLayer`` structs of
the CUDA sources), and fold the layer into the grid dimension of the request (GDN: z = layer * R + r;
conv: y = layer * R + r). Each CTA runs the per-layer kernel's own block body, so the states are
bitwise those of the per-layer launches.

Both tables go to the device in one host-to-device copy from pinned memory, without a
synchronisation (``vllm_tfm.verify.packed_upload``). Layers whose compile-time constants or shared
scalars differ (``Launch``: dtypes, head counts and sizes, the accepted-node tensor) go into separate
launches, as do runs of more than 65535 // R layers (the grid's y / z limit).

The layers run concurrently, so the batched commit equals the per-layer sequence when no layer's
destination rows are another layer's source rows in memory. In vLLM every layer has its own state
views, and layers that share one buffer belong to different KV-cache groups, whose slots are
different blocks; within a layer the per-layer kernels' rules hold (a snapshot of the sources when a
slot is one request's destination and another's source).
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels.loader import get_kernel, launch, tensor_device_index
from vllm_tfm.kernels.plan import CommitIndices, TreePlan

__all__ = [
    "CONV_LAYER_FIELDS",
    "GDN_LAYER_FIELDS",
    "MAX_GRID_YZ",
    "CommitTables",
    "ConvCommitLayer",
    "GDNCommitLayer",
    "Launch",
    "UploadedCommit",
    "build_commit_tables",
    "commit_layers_planned",
    "commit_layers_reusing",
    "commit_operands",
    "conv_layer_row",
    "gdn_layer_row",
    "gdn_tree_commit_layers",
    "launch_batches",
    "launch_commit_tables",
    "tree_conv_commit_layers",
    "upload_commit_tables",
]

GDN_LAYER_FIELDS = (
    "k", "g", "delta", "src_state", "src_idx", "ss_slot", "ss_head", "ss_v",
    "dst_state", "dst_idx", "ds_slot", "ds_head", "ds_v",
)
"""One row of the GDN table: the fields of ``struct GdnCommitLayer`` (cuda/gdn_tree_commit.cu), in order."""

CONV_LAYER_FIELDS = (
    "x", "x_row", "src_state", "src_idx", "ss_slot", "ss_d", "ss_l", "src_start",
    "dst_state", "dst_idx", "ds_slot", "ds_d", "ds_l", "dst_start",
)
"""One row of the conv table: the fields of ``struct ConvCommitLayer`` (cuda/tree_conv.cu), in order."""

MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z


@dataclass(frozen=True)
class GDNCommitLayer:
    """One layer's SSM-state commit: the arguments of ``gdn_tree_commit_planned`` but the plan."""

    k: Tensor
    g: Tensor
    delta: Tensor
    ssm_state: Tensor
    idx: CommitIndices


@dataclass(frozen=True)
class ConvCommitLayer:
    """One layer's conv-window commit: the arguments of ``tree_conv_commit_planned`` but the plan."""

    x: Tensor
    conv_state: Tensor
    idx: CommitIndices
    width: int


@dataclass(frozen=True)
class Launch:
    """One launch of a batched kernel: table rows ``start .. start + len(layers) - 1``.

    kind: "gdn" or "conv"; layers: indices into the caller's layer list; dtypes: (k,) for GDN,
    (x, conv state) for conv; dims: (H, HV, K, V) for GDN, (D, W) for conv; accepted: the
    accepted-node tensor the launch reads (shared by its layers).
    """

    kind: str
    start: int
    layers: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    dims: tuple[int, ...]
    accepted: Tensor


@dataclass(frozen=True)
class CommitTables:
    """The host side of a batched commit: the rows of both tables, in launch order, and the launches.

    keep: tensors the rows point into that the caller's layers do not hold (contiguous copies,
    snapshots); they stay referenced until the launches are queued (PyTorch's caching allocator then
    keeps their memory from other streams' work until the kernels ran on this one).
    """

    gdn_rows: np.ndarray
    conv_rows: np.ndarray
    launches: tuple[Launch, ...]
    keep: tuple[Tensor, ...]


def launch_batches(keys: Sequence[Hashable], num_requests: int, max_blocks: int = MAX_GRID_YZ) -> list[list[int]]:
    """Which layers go into one launch: the layers of each launch key (in order of first appearance),
    cut into runs of at most ``max_blocks // num_requests`` layers (the grid dimension that holds
    layer * R + r has at most ``max_blocks`` entries)."""
    if num_requests > max_blocks:
        raise ValueError(f"{num_requests} requests exceed the kernels' grid limit of {max_blocks}")
    per = max_blocks // max(num_requests, 1)
    by_key: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    return [members[a : a + per] for members in by_key.values() for a in range(0, len(members), per)]


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def gdn_layer_row(layer: GDNCommitLayer) -> tuple[list[int], list[Tensor]]:
    """(the layer's row of the GDN table, tensors made for it). The operands are normalised exactly as
    ``gdn_tree_commit_planned`` does (contiguous k and delta, float32 g, the source snapshot)."""
    k, delta, g, state, idx = layer.k, layer.delta, layer.g, layer.ssm_state, layer.idx
    made: list[Tensor] = []
    if not k.is_contiguous():
        k = k.contiguous()
        made.append(k)
    if not delta.is_contiguous():
        delta = delta.contiguous()
        made.append(delta)
    if g.dtype != torch.float32 or not g.is_contiguous():
        g = g.to(torch.float32).contiguous()
        made.append(g)
    src_state = state
    if idx.snapshot is not None:
        src_state = state[idx.snapshot].contiguous()
        made.append(src_state)
    ss, ds = src_state.stride(), state.stride()
    row = [k.data_ptr(), g.data_ptr(), delta.data_ptr(), src_state.data_ptr(), idx.src.data_ptr(), ss[0], ss[1], ss[2],
           state.data_ptr(), idx.dst.data_ptr(), ds[0], ds[1], ds[2]]
    return row, made


def conv_layer_row(layer: ConvCommitLayer) -> tuple[list[int], list[Tensor]]:
    """(the layer's row of the conv table, tensors made for it), normalised as ``tree_conv_commit_planned``
    does (x with unit column stride, the source snapshot)."""
    x, state, idx = layer.x, layer.conv_state, layer.idx
    made: list[Tensor] = []
    if x.stride(1) != 1:
        x = x.contiguous()
        made.append(x)
    src_state = state
    if idx.snapshot is not None:
        src_state = state[idx.snapshot].contiguous()
        made.append(src_state)
    ss, ds = src_state.stride(), state.stride()
    row = [x.data_ptr(), x.stride(0), src_state.data_ptr(), idx.src.data_ptr(), ss[0], ss[1], ss[2], _ptr(idx.src_start),
           state.data_ptr(), idx.dst.data_ptr(), ds[0], ds[1], ds[2], _ptr(idx.dst_start)]
    return row, made


def _gdn_launch_key(layer: GDNCommitLayer) -> tuple:
    _, h, kd = layer.k.shape
    hv, vd = layer.delta.shape[1], layer.delta.shape[2]
    return (layer.k.dtype,), (h, hv, kd, vd), layer.idx.accepted


def _conv_launch_key(layer: ConvCommitLayer) -> tuple:
    return (layer.x.dtype, layer.conv_state.dtype), (layer.x.shape[1], layer.width), layer.idx.accepted


def build_commit_tables(
    gdn_layers: Sequence[GDNCommitLayer], conv_layers: Sequence[ConvCommitLayer], num_requests: int
) -> CommitTables:
    """Rows and launches of a batched commit (host work only: pointers, strides, launch grouping).

    Conv layers of width <= 1 keep no window and are left out (as the per-layer commit does nothing).
    """
    launches: list[Launch] = []
    keep: list[Tensor] = []
    tables: dict[str, list[list[int]]] = {"gdn": [], "conv": []}
    conv_live = [i for i, layer in enumerate(conv_layers) if layer.width > 1]
    for kind, layers, members, key_of, row_of in (
        ("gdn", gdn_layers, list(range(len(gdn_layers))), _gdn_launch_key, gdn_layer_row),
        ("conv", conv_layers, conv_live, _conv_launch_key, conv_layer_row),
    ):
        keys = [key_of(layers[i]) for i in members]
        # the accepted tensor is compared by identity (a tensor's own __eq__ is elementwise)
        hashable = [(dt, dims, id(acc)) for dt, dims, acc in keys]
        rows = tables[kind]
        for batch in launch_batches(hashable, num_requests):
            dtypes, dims, accepted = keys[batch[0]]
            launches.append(Launch(kind, len(rows), tuple(members[b] for b in batch), dtypes, dims, accepted))
            for b in batch:
                row, made = row_of(layers[members[b]])
                rows.append(row)
                keep.extend(made)
    return CommitTables(
        gdn_rows=np.asarray(tables["gdn"], dtype=np.int64).reshape(-1, len(GDN_LAYER_FIELDS)),
        conv_rows=np.asarray(tables["conv"], dtype=np.int64).reshape(-1, len(CONV_LAYER_FIELDS)),
        launches=tuple(launches),
        keep=tuple(keep),
    )


def upload_commit_tables(tables: CommitTables, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """Both tables on the device, [Lg, 13] and [Lc, 14] int64 views of one buffer: one copy from pinned
    memory, no synchronisation (``packed_upload``)."""
    from vllm_tfm.verify.packed_upload import packed_upload

    dev = packed_upload({"gdn": tables.gdn_rows, "conv": tables.conv_rows}, device)
    return dev["gdn"], dev["conv"]



def launch_commit_tables(
    plan: TreePlan, tables: CommitTables, gdn_table: Tensor, conv_table: Tensor, use_qk_l2norm: bool = True
) -> int:
    """Launch every batch of ``tables`` (its rows uploaded as ``gdn_table`` / ``conv_table``); returns the
    number of launches."""
    i32 = ctypes.c_int
    r = plan.num_requests
    dev_index = tensor_device_index(gdn_table if len(gdn_table) else conv_table)
    for job in tables.launches:
        n = len(job.layers)
        if job.kind == "gdn":
            (k_dtype,) = job.dtypes
            h, hv, kd, vd = job.dims
            m_cap = plan.max_depth + 1
            opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={kgdn.DTYPE_CODE[k_dtype]}", f"-DGDN_K={kd}", f"-DGDN_V={vd}"]
            launch(
                get_kernel(kgdn.COMMIT_SOURCE, "gdn_tree_commit_layers", opts, dev_index),
                (vd // kgdn.COMMIT_BV, hv, r * n),
                (kgdn.COMMIT_THREADS, 1, 1),
                [gdn_table[job.start : job.start + n], i32(r), plan.cu, plan.pos, plan.depth, plan.pair_off,
                 plan.pair_j, job.accepted, i32(h), i32(hv), i32(m_cap), i32(int(use_qk_l2norm))],
                shared_mem=kgdn.commit_smem_bytes(kd, m_cap),
            )
        else:
            x_dtype, st_dtype = job.dtypes
            dim, width = job.dims
            opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={kgdn.DTYPE_CODE[x_dtype]}",
                    f"-DCONV_ST={kgdn.DTYPE_CODE[st_dtype]}", "-DCONV_WT=0"]  # the options of the per-layer commit
            launch(
                get_kernel(kconv.SOURCE, "tree_conv_commit_layers", opts, dev_index),
                ((dim + kconv.THREADS - 1) // kconv.THREADS, r * n, 1),
                (kconv.THREADS, 1, 1),
                [conv_table[job.start : job.start + n], i32(r), plan.cu, plan.pos, plan.depth, plan.pair_off,
                 plan.pair_j, job.accepted, i32(dim), i32(width)],
            )
    return len(tables.launches)


def commit_layers_planned(
    plan: TreePlan,
    gdn_layers: Sequence[GDNCommitLayer],
    conv_layers: Sequence[ConvCommitLayer],
    use_qk_l2norm: bool = True,
) -> int:
    """The SSM-state and conv-window commits of many layers for a prebuilt plan: one table upload and
    one launch per kernel kind and launch key (module docstring). No host synchronisation. Every
    layer must be one the per-layer kernels take (``commit_unsupported_reason`` /
    ``conv_unsupported_reason`` None). Returns the number of launches."""
    tables = build_commit_tables(gdn_layers, conv_layers, plan.num_requests)
    if not tables.launches:
        return 0
    gdn_table, conv_table = upload_commit_tables(tables, plan.device)
    return launch_commit_tables(plan, tables, gdn_table, conv_table, use_qk_l2norm)


@dataclass(frozen=True)
class UploadedCommit:
    """A batched commit's tables on the device, to be launched again while its layers' operands are the
    same tensor objects (``commit_layers_reusing``).

    The rows hold the operands' addresses, so a reuse is valid only while every operand is the tensor
    it was (same object, storage never swapped); the caller keeps its per-step index tensors in place
    (filled, not reallocated) to get there. ``num_requests``: the R the launches were cut for.
    """

    operands: tuple[object, ...]
    num_requests: int
    tables: CommitTables
    gdn_table: Tensor
    conv_table: Tensor

    def matches(self, operands: tuple[object, ...], num_requests: int) -> bool:
        return (num_requests == self.num_requests and len(operands) == len(self.operands)
                and all(a is b for a, b in zip(operands, self.operands)))


def commit_operands(gdn_layers: Sequence[GDNCommitLayer], conv_layers: Sequence[ConvCommitLayer]) -> tuple[object, ...]:
    """Everything a batched commit's rows and launches are made of, per layer (tensors by identity,
    the conv width by value): two commits with the same operands have the same tables."""
    out: list[object] = []
    for g in gdn_layers:
        i = g.idx
        out += (g.k, g.g, g.delta, g.ssm_state, i.accepted, i.src, i.dst, i.snapshot)
    for c in conv_layers:
        i = c.idx
        out += (c.x, c.conv_state, c.width, i.accepted, i.src, i.dst, i.src_start, i.dst_start, i.snapshot)
    return tuple(out)


def commit_layers_reusing(
    plan: TreePlan,
    gdn_layers: Sequence[GDNCommitLayer],
    conv_layers: Sequence[ConvCommitLayer],
    previous: UploadedCommit | None,
    use_qk_l2norm: bool = True,
) -> tuple[int, UploadedCommit | None]:
    """``commit_layers_planned``, launching ``previous``'s uploaded tables when they were made from the same
    operands (``commit_operands``) for the same R: no rows built, no upload, only the launches. Returns
    (launches, what the next call can reuse: ``previous``, the tables made now, or None when the rows
    point into tensors made for this call: contiguous copies or snapshots)."""
    operands = commit_operands(gdn_layers, conv_layers)
    r = plan.num_requests
    if previous is not None and previous.matches(operands, r):
        if not previous.tables.launches:
            return 0, previous
        return launch_commit_tables(plan, previous.tables, previous.gdn_table, previous.conv_table, use_qk_l2norm), previous
    tables = build_commit_tables(gdn_layers, conv_layers, r)
    if not tables.launches:
        return 0, (UploadedCommit(operands, r, tables, torch.empty(0), torch.empty(0)) if not tables.keep else None)
    gdn_table, conv_table = upload_commit_tables(tables, plan.device)
    launches = launch_commit_tables(plan, tables, gdn_table, conv_table, use_qk_l2norm)
    return launches, (UploadedCommit(operands, r, tables, gdn_table, conv_table) if not tables.keep else None)


def _check_counts(names: str, *seqs: Sequence) -> None:
    if len({len(s) for s in seqs}) > 1:
        raise ValueError(f"{names} must have one entry per layer, got {[len(s) for s in seqs]}")


def gdn_tree_commit_layers(
    k: Sequence[Tensor],
    g: Sequence[Tensor],
    delta: Sequence[Tensor],
    parents: Tensor,
    cu_nodes: Tensor,
    accepted: Tensor,
    ssm_state: Sequence[Tensor],
    src_indices: Sequence[Tensor],
    dst_indices: Sequence[Tensor],
    use_qk_l2norm: bool = True,
) -> None:
    """Same signature and semantics as ``vllm_tfm.verify.gdn.gdn_tree_commit_layers``: the batched
    kernel when every layer's tensors are ones the kernel takes, else ``gdn_tree_commit`` per layer
    (kernel or reference). Validates on the host (device-to-host copies), like ``gdn_tree_commit``."""
    _check_counts("k, g, delta, ssm_state, src_indices and dst_indices", k, g, delta, ssm_state, src_indices, dst_indices)
    if any(kgdn.commit_unsupported_reason(k[i], delta[i], ssm_state[i]) is not None for i in range(len(k))):
        for i in range(len(k)):
            kgdn.gdn_tree_commit(k[i], g[i], delta[i], parents, cu_nodes, accepted, ssm_state[i], src_indices[i],
                                 dst_indices[i], use_qk_l2norm)
        return
    if not k:
        return
    checked = [kgdn._checked_commit_args(k[i], g[i], delta[i], parents, cu_nodes, accepted, ssm_state[i],
                                         src_indices[i], dst_indices[i]) for i in range(len(k))]
    device = delta[0].device
    plan = TreePlan.build(parents, cu_nodes, device=device)
    layers, shared = [], None
    for i, (acc, src, dst) in enumerate(checked):
        idx = CommitIndices.build(acc, src, dst, device)
        shared = idx.accepted if shared is None else shared
        layers.append(GDNCommitLayer(k[i], g[i], delta[i], ssm_state[i], replace(idx, accepted=shared)))
    commit_layers_planned(plan, layers, [], use_qk_l2norm)


def tree_conv_commit_layers(
    x: Sequence[Tensor],
    parents: Tensor,
    cu_nodes: Tensor,
    accepted: Tensor,
    conv_state: Sequence[Tensor],
    src_indices: Sequence[Tensor],
    dst_indices: Sequence[Tensor],
    width: int,
    src_start: Sequence[Tensor | None] | None = None,
    dst_start: Sequence[Tensor | None] | None = None,
) -> None:
    """Same signature and semantics as ``vllm_tfm.verify.conv.tree_conv_commit_layers``: the batched
    kernel when every layer's tensors are ones the kernel takes, else ``tree_conv_commit`` per layer."""
    n = len(x)
    s_starts = [None] * n if src_start is None else list(src_start)
    d_starts = [None] * n if dst_start is None else list(dst_start)
    _check_counts("x, conv_state, src_indices, dst_indices (and src_start, dst_start when given)",
                  x, conv_state, src_indices, dst_indices, s_starts, d_starts)
    if any(kconv.conv_unsupported_reason(x[i], conv_state[i], width) is not None for i in range(n)):
        for i in range(n):
            kconv.tree_conv_commit(x[i], parents, cu_nodes, accepted, conv_state[i], src_indices[i], dst_indices[i],
                                   width, s_starts[i], d_starts[i])
        return
    if n == 0:
        return
    checked = [kconv._checked_commit_args(x[i], parents, cu_nodes, accepted, conv_state[i], src_indices[i],
                                          dst_indices[i], width, s_starts[i], d_starts[i]) for i in range(n)]
    device = x[0].device
    plan = TreePlan.build(parents, cu_nodes, device=device)
    layers, shared = [], None
    for i, (acc, src, dst, ss, ds) in enumerate(checked):
        idx = CommitIndices.build(acc, src, dst, device, ss, ds)
        shared = idx.accepted if shared is None else shared
        layers.append(ConvCommitLayer(x[i], conv_state[i], replace(idx, accepted=shared), width))
    commit_layers_planned(plan, [], layers)

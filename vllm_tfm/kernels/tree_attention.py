"""Torch-facing wrapper of the tree attention kernel (``cuda/tree_attention.cu``).

``tree_attention`` has the signature of the torch reference ``vllm_tfm.verify.tree_attention`` and
computes the same function: every tree request of a batch in one kernel launch over vLLM's paged KV
cache (prefix fully visible, tree keys by ancestor bitmask, GQA), plus a merge launch when the keys
are split across CTAs (long contexts, few rows). It runs the kernel for CUDA inputs
of float32, bfloat16 or float16 with a head size that is a multiple of 32 up to 256, a contiguous
last dimension and 16-byte aligned rows; otherwise it calls the reference (with a one-time warning
for CUDA inputs).

The vLLM plugin builds a :class:`TreeAttentionPlan` once per decode step (per-tree request, first
row, size and bitmask offset plus the bitmasks: one host-to-device copy) and calls
:func:`tree_attention_planned` in each attention layer; no host synchronisation happens there.

Not supported by the kernel (callers keep vLLM's Triton path for these): sliding windows, logit
soft-capping, ALiBi, attention sinks and quantised KV caches.
"""

from __future__ import annotations

import ctypes
import functools
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.kernels.loader import (
    device_smem_optin,
    get_kernel,
    kernels_unavailable_reason,
    launch,
    warn_fallback,
)
from vllm_tfm.tree.bitmask import ragged_ancestor_bits

__all__ = [
    "TreeAttentionPlan",
    "choose_block_n",
    "choose_splits",
    "tree_attention",
    "tree_attention_planned",
    "tree_attention_smem_bytes",
    "tree_attention_unsupported",
]

SOURCE = "tree_attention.cu"
THREADS = 128
BLOCK_M = 64  # rows (node, head of the group) per CTA: TA_BM in the source
MAX_SPLITS = 64  # TA_MAX_SPLITS
DEFAULT_STAGES = 2  # K/V tiles in flight (TA_STAGES)
MIN_TILES_PER_SPLIT = 1  # the merge is its own launch over the whole GPU: even a tile per split pays
MERGE_CHUNK = 16  # TA_MERGE_CHUNK: the merge of more splits takes another round of loads
# key tiles per split below which no more than MERGE_CHUNK splits are taken (bench/NOTES.md section 44: one tree
# of 17 nodes, 27B shape, ran 124.5 us at 32k keys in 33 splits of ~31 tiles against 158.6 in 16, but 36.7 at 4096
# keys in 33 splits of ~4 tiles against 34.7 in 16)
LONG_SPLIT_MIN_TILES = 16
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NOT_CUDA = "inputs are not CUDA tensors"  # the reference is the CPU implementation: no warning
LOG2E = 1.4426950408889634
MIN_COMPUTE_CAPABILITY = (8, 0)


def tree_attention_smem_bytes(head_dim: int, block_n: int, dtype: torch.dtype, stages: int = DEFAULT_STAGES) -> int:
    """Dynamic shared memory of one CTA (mirrors the comment in the source)."""
    fp32 = dtype == torch.float32
    pitch = head_dim + (4 if fp32 else 8)
    elem = 4 if fp32 else 2
    smem = (BLOCK_M + 2 * stages * block_n) * pitch * elem
    if fp32:
        smem += 4 * 16 * (block_n + 4) * 4
    return smem


def choose_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per tile: 64 for 16-bit inputs with D <= 128, else 32 (two CTAs per SM at D = 256 bf16)."""
    return 64 if dtype != torch.float32 and head_dim <= 128 else 32


def choose_splits(base_ctas: int, max_tiles: int, num_sms: int, ctas_per_sm: int = 2, long_splits: bool = True) -> int:
    """Key splits per row tile: none when the row tiles already fill the SMs (a split then adds its merge,
    not parallelism: 32 trees of 17 nodes at a 512-key context ran 66 us unsplit, 95 in two splits);
    else as many as one wave of ``ctas_per_sm`` CTAs per SM holds (a partial second wave costs a whole
    one: 8 such trees at 4096 keys ran 120 us in 4 splits, one wave, and 164 in 5), at least
    MIN_TILES_PER_SPLIT key tiles each (one tree of 17 nodes at 512 keys ran 14.5 us in 16 splits of
    one or two tiles, 20.7 in 4). bench/NOTES.md section 43. More than MERGE_CHUNK splits only at long
    contexts, LONG_SPLIT_MIN_TILES tiles or more each (section 44), and only with ``long_splits``: False
    when ``max_tiles`` is an engine bound rather than the call's (a CUDA graph captured at the engine's
    max_model_len replays at every context, and a short one would be cut into a few tiles per split)."""
    if base_ctas <= 0 or base_ctas >= num_sms:
        return 1
    want = (ctas_per_sm * num_sms) // base_ctas
    splits = max(1, min(MAX_SPLITS, want, max_tiles // MIN_TILES_PER_SPLIT))
    if splits > MERGE_CHUNK:
        splits = max(MERGE_CHUNK, min(splits, max_tiles // LONG_SPLIT_MIN_TILES)) if long_splits else MERGE_CHUNK
    return splits


@dataclass(frozen=True)
class TreeAttentionPlan:
    """Per-call (per decode step) metadata: host arrays and their device copy (one transfer).

    ``tree_req``, ``tree_start``, ``tree_size`` [R] (host int64); ``bits`` [sum n, words] (host
    int64); ``meta`` [4 R] int32 on the device (request | first row | size | first bitmask row);
    ``bits_dev`` [sum n, words] int64 on the device.
    """

    tree_req: np.ndarray
    tree_start: np.ndarray
    tree_size: np.ndarray
    bits: np.ndarray
    meta: Tensor
    bits_dev: Tensor

    @property
    def num_trees(self) -> int:
        return int(self.tree_size.shape[0])

    @functools.cached_property
    def num_rows(self) -> int:
        """Query rows of all the plan's trees (the sum of ``tree_size``)."""
        return int(self.tree_size.sum())

    @property
    def max_nodes(self) -> int:
        return int(self.tree_size.max()) if self.num_trees else 0

    @property
    def words(self) -> int:
        return int(self.bits.shape[1])

    @staticmethod
    def build(tree_req: np.ndarray, tree_start: np.ndarray, tree_size: np.ndarray, bits: np.ndarray,
              device: torch.device | str) -> TreeAttentionPlan:
        """From host arrays (trees in any order; bitmask rows in tree order); one host-to-device copy."""
        req = np.ascontiguousarray(tree_req, dtype=np.int64)
        start = np.ascontiguousarray(tree_start, dtype=np.int64)
        size = np.ascontiguousarray(tree_size, dtype=np.int64)
        b = np.ascontiguousarray(bits, dtype=np.int64)
        r = size.shape[0]
        if req.shape != (r,) or start.shape != (r,) or b.ndim != 2 or b.shape[0] != int(size.sum()):
            raise ValueError(
                f"tree_req, tree_start, tree_size must be [R] and bits [sum of sizes, words]; got {req.shape}, "
                f"{start.shape}, {size.shape}, {b.shape}"
            )
        off = np.zeros(r, dtype=np.int64)
        if r > 1:
            np.cumsum(size[:-1], out=off[1:])
        meta = np.concatenate([req, start, size, off]).astype(np.int32)
        head = (meta.shape[0] + 1) // 2  # int32 meta packed into int64 words, then the bitmasks
        packed = np.zeros(head + b.size, dtype=np.int64)
        packed[:head].view(np.int32)[: meta.shape[0]] = meta
        packed[head:] = b.reshape(-1)
        dev = torch.from_numpy(packed).to(device, non_blocking=True)
        meta_dev = dev[:head].view(torch.int32)[: meta.shape[0]]
        bits_dev = dev[head:].view(b.shape[0], b.shape[1]) if b.size else dev[head:].view(0, b.shape[1])
        return TreeAttentionPlan(req, start, size, b, meta_dev, bits_dev)

    @staticmethod
    def build_into(buffer: Tensor, tree_start: np.ndarray, parents: np.ndarray, nodes_per_request: int,
                   ancestor_bits: np.ndarray | None = None, layout: TreeAttentionPlan | None = None) -> TreeAttentionPlan:
        """The plan of R requests that are all trees of n = ``nodes_per_request`` nodes (request r's rows
        start at ``tree_start[r]``), written into ``buffer`` (int64 on the device, at least
        :meth:`fixed_size` entries) at addresses that depend on R and n only: a launch recorded once
        (CUDA graphs) reads the bitmasks of whatever batch was written last. ``parents``: [R n] local
        parents in tree order; ``ancestor_bits``: their ``ragged_ancestor_bits`` when the caller has
        them. One host-to-device copy, in stream order, no host wait. ``layout``: a plan this function
        returned for the same buffer and trees' starts and sizes (a full graph's replays): only the
        bitmasks are written, and a plan with them is returned."""
        from vllm_tfm.kernels.plan import upload_into

        start = np.ascontiguousarray(tree_start, dtype=np.int64)
        r, n = start.shape[0], int(nodes_per_request)
        cu = np.arange(r + 1, dtype=np.int64) * n
        bits = ragged_ancestor_bits(np.asarray(parents, dtype=np.int64), cu) if ancestor_bits is None else ancestor_bits
        if bits.shape != (r * n, (n + 63) // 64):
            raise ValueError(f"ancestor_bits must be [{r * n}, {(n + 63) // 64}], got {bits.shape}")
        head = 2 * r
        if (layout is not None and layout.bits.shape == bits.shape and np.array_equal(layout.tree_start, start)
                and layout.meta.data_ptr() == buffer.data_ptr() and bool((layout.tree_size == n).all())):
            upload_into(buffer[head : head + bits.size], torch.from_numpy(np.ascontiguousarray(bits).reshape(-1)))
            return dataclasses.replace(layout, bits=bits)
        size = np.full(r, n, dtype=np.int64)
        meta = np.concatenate([np.arange(r, dtype=np.int64), start, size, cu[:-1]]).astype(np.int32)
        packed = np.zeros(head + bits.size, dtype=np.int64)
        packed[:head].view(np.int32)[:] = meta
        packed[head:] = bits.reshape(-1)
        if buffer.dtype != torch.int64 or buffer.dim() != 1 or buffer.numel() < packed.size:
            raise ValueError(f"buffer must be a 1-d int64 tensor of >= {packed.size} entries, got {buffer.dtype} "
                             f"{tuple(buffer.shape)}")
        dev = buffer[: packed.size]
        upload_into(dev, torch.from_numpy(packed))
        return TreeAttentionPlan(np.arange(r, dtype=np.int64), start, size, bits, dev[:head].view(torch.int32),
                                 dev[head:].view(bits.shape[0], bits.shape[1]))

    @staticmethod
    def fixed_size(num_requests: int, nodes_per_request: int) -> int:
        """int64 entries of a :meth:`build_into` plan of R trees of n nodes."""
        r, n = int(num_requests), int(nodes_per_request)
        return 2 * r + r * n * ((n + 63) // 64)

    @staticmethod
    def from_parents(tree_req: np.ndarray, tree_start: np.ndarray, tree_size: np.ndarray, parents: np.ndarray,
                     device: torch.device | str) -> TreeAttentionPlan:
        """From the trees' local parents (flat, in tree order): bitmasks built vectorised on the host."""
        size = np.asarray(tree_size, dtype=np.int64)
        cu = np.zeros(size.shape[0] + 1, dtype=np.int64)
        np.cumsum(size, out=cu[1:])
        return TreeAttentionPlan.build(tree_req, tree_start, size, ragged_ancestor_bits(parents, cu), device)


def _aligned(t: Tensor, elems: int) -> bool:
    """Contiguous last dimension, other strides multiples of ``elems`` elements, 16-byte aligned base."""
    return t.stride(-1) == 1 and all(s % elems == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0


def tree_attention_unsupported(q: Tensor, key_cache: Tensor, value_cache: Tensor, out: Tensor | None = None) -> str | None:
    """Why the kernel cannot take these tensors (None when it can). No host synchronisation."""
    tensors = [q, key_cache, value_cache] + ([out] if out is not None else [])
    if not all(t.is_cuda for t in tensors):
        return NOT_CUDA
    if not (q.dtype == key_cache.dtype == value_cache.dtype) or q.dtype not in DTYPE_CODE:
        return f"dtypes q {q.dtype}, key_cache {key_cache.dtype}, value_cache {value_cache.dtype}: one of float32, bfloat16, float16"
    if q.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        return "shapes are not q [T, Hq, D] / caches [num_blocks, block_size, Hkv, D]"
    dim = q.shape[2]
    if dim % 32 != 0 or dim > 256:
        return f"head size {dim}: the kernel takes multiples of 32 up to 256"
    elems = 16 // q.element_size()
    if not all(_aligned(t, elems) for t in tensors):
        return f"a tensor has a non-contiguous last dimension, strides not multiples of {elems} elements or a base not 16-byte aligned"
    reason = kernels_unavailable_reason(q.device.index)
    if reason is None:
        dev_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        smem = tree_attention_smem_bytes(dim, choose_block_n(dim, q.dtype), q.dtype)
        cc = torch.cuda.get_device_capability(dev_index)
        if cc < MIN_COMPUTE_CAPABILITY:
            reason = f"compute capability {cc[0]}.{cc[1]}: the kernel needs 8.0 (cp.async, ldmatrix, bf16 mma.sync)"
        elif smem > device_smem_optin(dev_index):
            reason = (f"the kernel needs {smem} bytes of shared memory; "
                      f"the device allows {device_smem_optin(dev_index)}")
    return reason


def _workspace(numel: int, device: torch.device) -> Tensor:
    """Float32 scratch for the splits' partials (never read before written; tests poison it)."""
    return torch.empty(numel, dtype=torch.float32, device=device)


def tree_attention_planned(
    plan: TreeAttentionPlan,
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    out: Tensor,
    max_seq_len: int,
    splits: int | None = None,
    block_n: int | None = None,
    stages: int = DEFAULT_STAGES,
    extra_options: tuple[str, ...] = (),
    seq_len_bound: bool = False,
) -> Tensor:
    """One launch (two with split keys): the tree rows of ``out`` for every tree of ``plan`` (no host
    synchronisation).

    q, out [T, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D]; block_table
    [num_requests, max_blocks] int32; seq_lens [num_requests] int32 (on the device, vLLM's);
    max_seq_len: an upper bound of seq_lens over the plan's requests (sizes the key splits);
    ``seq_len_bound``: it is only the engine's bound (a CUDA graph capture), not this call's maximum, so
    the splits stay within one merge chunk (:func:`choose_splits`).
    Inputs must be supported (:func:`tree_attention_unsupported` is None) and valid (the public
    :func:`tree_attention` checks). ``splits`` / ``block_n`` force the key splits / keys per tile,
    ``stages`` the K/V tiles in flight (2-4); ``extra_options`` are added to the NVRTC options (timing
    variants, e.g. ``-DTA_PROFILE_SKIP=1``; ``bench/tree_attention.py --define``).
    """
    if not 2 <= stages <= 4:
        raise ValueError(f"stages={stages} must be 2, 3 or 4")
    if plan.num_trees == 0:
        return out
    dev = q.device
    dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
    hq, dim = q.shape[1], q.shape[2]
    hkv, block_size = key_cache.shape[2], key_cache.shape[1]
    group = hq // hkv
    bn = block_n or choose_block_n(dim, q.dtype)
    smem = tree_attention_smem_bytes(dim, bn, q.dtype, stages)
    mtiles = -(-plan.max_nodes * group // BLOCK_M)
    minb = 2 if q.dtype != torch.float32 and 2 * smem <= device_smem_optin(dev_index) else 1
    if splits is None:
        base = int((-(-plan.tree_size * group // BLOCK_M)).sum()) * hkv
        sms = torch.cuda.get_device_properties(dev_index).multi_processor_count
        splits = choose_splits(base, -(-max_seq_len // bn), sms, minb, long_splits=not seq_len_bound)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits={splits} must be in 1..{MAX_SPLITS}")
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[q.dtype]}", f"-DTA_D={dim}", f"-DTA_BN={bn}",
            f"-DTA_MINB={minb}", f"-DTA_STAGES={stages}", *extra_options]
    kern = get_kernel(SOURCE, "tree_attention", opts, dev_index)
    slots = plan.num_trees * hkv * mtiles
    if splits > 1:
        ws = _workspace(slots * splits * BLOCK_M * (dim + 2), dev)
        ws_o, ws_ml = ws[: slots * splits * BLOCK_M * dim], ws[slots * splits * BLOCK_M * dim :]
    else:
        ws_o = ws_ml = None
    i32, i64, f32 = ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    ks, vs, qs, os_ = key_cache.stride(), value_cache.stride(), q.stride(), out.stride()
    launch(
        kern,
        (mtiles, hkv * splits, plan.num_trees),
        (THREADS, 1, 1),
        [q, i64(qs[0]), i64(qs[1]),
         key_cache, i64(ks[0]), i64(ks[1]), i64(ks[2]),
         value_cache, i64(vs[0]), i64(vs[1]), i64(vs[2]),
         block_table, i64(block_table.stride(0)), seq_lens,
         plan.meta, plan.bits_dev, i32(plan.words),
         out, i64(os_[0]), i64(os_[1]),
         ws_o, ws_ml,
         i32(plan.num_trees), i32(hkv), i32(group), i32(block_size), i32(splits), i32(mtiles),
         f32(float(scale) * LOG2E)],
        shared_mem=smem,
    )
    if splits > 1:  # the splits' merge: a thread per 4 output values of every row tile
        merge = get_kernel(SOURCE, "tree_attention_merge_many" if splits > MERGE_CHUNK else "tree_attention_merge", opts,
                           dev_index)
        launch(
            merge,
            (-(-BLOCK_M * dim // (4 * THREADS)), slots, 1),
            (THREADS, 1, 1),
            [ws_o, ws_ml, plan.meta, out, i64(os_[0]), i64(os_[1]),
             i32(plan.num_trees), i32(hkv), i32(group), i32(splits), i32(mtiles)],
        )
    return out


def tree_attention(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    tree_req: Tensor,
    tree_start: Tensor,
    tree_size: Tensor,
    ancestor_bits: Tensor,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """Ancestor-masked attention of every tree's rows, one kernel launch (see ``vllm_tfm.verify.tree_attention``).

    Same signature, checks and result as the reference: q [T, Hq, D]; key_cache, value_cache
    [num_blocks, block_size, Hkv, D]; block_table [num_requests, max_blocks]; seq_lens
    [num_requests]; tree_req, tree_start, tree_size [R]; ancestor_bits [sum n, W] int64; scale.
    Writes the tree rows of ``out`` (zeros if None) and returns it. CUDA kernel when supported,
    else the torch reference.
    """
    from vllm_tfm.verify import tree_attention as reference

    args = reference.check_tree_attention_args(q, key_cache, value_cache, block_table, seq_lens, tree_req,
                                               tree_start, tree_size, ancestor_bits, out)
    reason = tree_attention_unsupported(q, key_cache, value_cache, out)
    if reason is not None:
        if reason != NOT_CUDA:
            warn_fallback("tree_attention", reason)
        return reference.tree_attention(q, key_cache, value_cache, block_table, seq_lens, tree_req, tree_start,
                                        tree_size, ancestor_bits, scale, out)
    if out is None:
        out = torch.zeros_like(q)
    bits = ancestor_bits.detach().to("cpu", torch.int64).numpy()
    plan = TreeAttentionPlan.build(np.array(args.req), np.array(args.start), np.array(args.size), bits, q.device)
    max_len = max(args.seq_len, default=1)
    return tree_attention_planned(plan, q, key_cache, value_cache, block_table.to(q.device),
                                  seq_lens.to(q.device), scale, out, max_len)

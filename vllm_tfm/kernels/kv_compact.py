"""K/V compaction of the accepted tree paths in one launch for all layers of a KV-cache group
(``cuda/kv_compact.cu``).

After tree acceptance, the K/V of every accepted path node moves from the slot of its tree row to the
slot of its chain row, in every full-attention layer (``runtime/commit.py``: ``compaction_rows`` makes
the row lists, ``compact_kv`` dispatches here). The torch way, ``kv_compact_reference``, is one
advanced-indexing gather and one scatter per layer plus the index arithmetic: about 35-40 small kernels
for the 16 attention layers of Qwen3.6-27B, and milliseconds of host dispatch on a slow CPU. The kernel
does every layer in one launch (per group of layers with one layout), reading the layers' base
addresses from a small device table that is uploaded once per set of caches and kept (keyed by the
caches' addresses, shapes, strides and dtypes), so a steady-state step uploads nothing and never waits
for the device.

Arguments (both functions): ``kv_caches``, TRITON_ATTN caches, logical [num_blocks, H, block_size,
2 * head_size] (vLLM 0.26 ``TritonAttentionBackend.get_kv_cache_shape``; physically NHD or HND, or any
other non-overlapping strides); ``slot_mapping``: int64 [>= T], the slot of every token row of the step;
``src_rows`` / ``dst_rows``: int64 [M] token rows, move m copies the bytes of slot
``slot_mapping[src_rows[m]]`` to slot ``slot_mapping[dst_rows[m]]`` in every cache. The kernel copies
bytes, so any dtype of 1, 2, 4 or 8 bytes moves (bf16 / fp16, fp8 caches and their inline scales).
It equals the reference (gather everything, then scatter) bit for bit for any rows when M <= 128
(one round: every load of the CTA before its barrier, every store after), and for the row lists of
``compaction_rows`` at any M (the ordering argument is in the CUDA source).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.kernels.loader import get_kernel, kernels_unavailable_reason, launch, tensor_device_index

__all__ = [
    "CacheLayout",
    "NOT_CUDA",
    "cache_layout",
    "kv_compact_layers",
    "kv_compact_reference",
    "kv_compact_shape_reason",
    "kv_compact_unsupported_reason",
    "launch_geometry",
    "try_kv_compact_layers",
]

SOURCE = "kv_compact.cu"
LANES = 32  # KVC_LANES: copy units per CTA
PER_THREAD = 8  # KVC_PER_THREAD: moves per thread and round
MAX_WARPS = 16  # KVC_MAX_WARPS
ROUND = MAX_WARPS * PER_THREAD  # moves per round at most: one round up to here (exact for any rows)
UNITS = (16, 8, 4, 2, 1)  # copy sizes in bytes, largest first (KVC_UNIT)
ELEMENT_SIZES = (1, 2, 4, 8)
MAX_GRID_Y = 65535  # layers per launch
INT32_MAX = 2**31 - 1
NOT_CUDA = "the tensors are not all on one CUDA device"
_PLAN_CACHE_SIZE = 32


def kv_compact_reference(kv_caches: Sequence[Tensor], slot_mapping: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
    """The torch compaction (module docstring): (block, offset) of the moves once per block size, then
    per layer one gather and one scatter. The gather is a copy, so every read happens before any write
    whatever the rows; duplicate destinations (only padding entries copying a slot onto itself) write
    the same bytes."""
    if src_rows.numel() == 0:
        return
    src = slot_mapping[src_rows].to(torch.long)
    dst = slot_mapping[dst_rows].to(torch.long)
    split: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
    for kv in kv_caches:
        bs = kv.shape[2]
        idx = split.get(bs)
        if idx is None:
            idx = split[bs] = (src // bs, src % bs, dst // bs, dst % bs)
        src_block, src_off, dst_block, dst_off = idx
        kv[dst_block, :, dst_off] = kv[src_block, :, src_off]


@dataclass(frozen=True)
class CacheLayout:
    """The geometry one launch shares across its layers: sizes, byte strides and the copy unit.

    A token row's content (H heads x 2 head_size elements) is cut into ``heads * units_per_head``
    units of ``unit`` bytes; unit c of head h of the row at (block, offset) starts at byte
    ``block * s_block + h * s_head + offset * s_tok + c * s_unit`` of the layer. ``unit`` is 16 when
    the last dimension is contiguous and every stride, the row and the base address are multiples of
    16 bytes (vector copies), else the largest power of two dividing them all, or one element when the
    last dimension is strided.
    """

    num_blocks: int
    heads: int
    block_size: int
    unit: int
    units_per_head: int
    s_block: int
    s_head: int
    s_tok: int
    s_unit: int

    @property
    def units_per_row(self) -> int:
        return self.heads * self.units_per_head


def _overlaps(shape: Sequence[int], strides: Sequence[int], item: int = 1) -> bool:
    """Whether two index tuples can share memory, each addressing ``item`` units from its offset
    (sufficient test: each dimension's stride, in increasing order, at least the extent of the ones
    below it)."""
    extent = item
    for stride, size in sorted((s, n) for s, n in zip(strides, shape) if n > 1):
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def _extent_bytes(kv: Tensor) -> int:
    return (sum(s * (n - 1) for s, n in zip(kv.stride(), kv.shape)) + 1) * kv.element_size()


def _disjoint(a: Tensor, b: Tensor) -> bool:
    """Whether two caches whose address ranges intersect still share no byte: one layout, the second
    at a byte distance d from the first, tested as one tensor with an extra dimension of size 2 and
    stride d (vLLM's cross-layer layout interleaves the layers' blocks this way)."""
    if a.shape != b.shape or a.stride() != b.stride() or a.element_size() != b.element_size():
        return False
    es = a.element_size()
    strides = [s * es if n > 1 else 0 for s, n in zip(a.stride(), a.shape)]
    return not _overlaps([*a.shape, 2], [*strides, abs(b.data_ptr() - a.data_ptr())], es)


def _layers_sharing_memory(kv_caches: Sequence[Tensor]) -> tuple[int, int] | None:
    """Two layers (indices, smaller first) whose caches may share a byte, or None."""
    spans = sorted((kv.data_ptr(), kv.data_ptr() + _extent_bytes(kv), i) for i, kv in enumerate(kv_caches))
    for a, (_, end, i) in enumerate(spans):
        for start, _, j in spans[a + 1 :]:
            if start >= end:
                break  # sorted by start: no later range reaches back into this one
            if not _disjoint(kv_caches[i], kv_caches[j]):
                return min(i, j), max(i, j)
    return None


def cache_layout(kv: Tensor) -> CacheLayout | str:
    """The cache's ``CacheLayout``, or why the kernel does not take it (host metadata only)."""
    if kv.dim() != 4:
        return f"a cache has shape {tuple(kv.shape)}, not the logical [num_blocks, H, block_size, 2 * head_size]"
    es = kv.element_size()
    if es not in ELEMENT_SIZES:
        return f"a cache's dtype {kv.dtype} has {es}-byte elements; the kernel copies 1, 2, 4 or 8"
    nb, h, bs, e = (int(n) for n in kv.shape)
    if min(nb, h, bs, e) == 0:
        return f"a cache is empty: shape {tuple(kv.shape)}"
    strides = [s if n > 1 else 0 for s, n in zip(kv.stride(), kv.shape)]  # a size-1 dimension's stride is never used
    if _overlaps(kv.shape, strides):
        return f"a cache's elements overlap (strides {tuple(kv.stride())} for shape {tuple(kv.shape)})"
    sb = [s * es for s in strides]
    if e == 1 or kv.stride(3) == 1:  # contiguous content: the widest unit that keeps every copy aligned
        g = math.gcd(sb[0], sb[1], sb[2], e * es, kv.data_ptr())
        unit = next(u for u in UNITS if g % u == 0)
        units_per_head, s_unit = e * es // unit, unit
    else:
        if kv.data_ptr() % es:
            return f"a cache's base address is not aligned to its {es}-byte elements"
        unit, units_per_head, s_unit = es, e, sb[3]
    if h * units_per_head > INT32_MAX or bs > INT32_MAX:
        return f"a cache of shape {tuple(kv.shape)} is too large for the kernel's 32-bit unit indices"
    return CacheLayout(nb, h, bs, unit, units_per_head, sb[0], sb[1], sb[2], s_unit)


@dataclass(frozen=True)
class LaunchGroup:
    """Layers of one launch: their shared layout and the device table of their base addresses."""

    layout: CacheLayout
    table: Tensor  # int64 [layers]
    layers: tuple[int, ...]  # indices into kv_caches, in table order


_plans: dict[tuple, tuple[LaunchGroup, ...] | str] = {}


def _plan_key(kv_caches: Sequence[Tensor]) -> tuple:
    """What the launches of these caches depend on. The device once: addresses are unique across
    devices (unified addressing) and ``_build_plan`` refuses caches on several devices."""
    return kv_caches[0].device, tuple((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in kv_caches)


def _build_plan(kv_caches: Sequence[Tensor]) -> tuple[LaunchGroup, ...] | str:
    """The launches for these caches (layers grouped by layout, cut at the grid limit) with their tables
    uploaded in one copy (``packed_upload``), or why the kernel does not take the caches."""
    from vllm_tfm.verify.packed_upload import packed_upload

    device = kv_caches[0].device
    if any(t.device != device for t in kv_caches):
        return NOT_CUDA
    by_layout: dict[CacheLayout, list[int]] = {}
    for i, kv in enumerate(kv_caches):
        layout = cache_layout(kv)
        if isinstance(layout, str):
            return f"layer {i}: {layout}"
        by_layout.setdefault(layout, []).append(i)
    shared = _layers_sharing_memory(kv_caches)
    if shared is not None:  # the launch's CTAs would race on the shared bytes (the reference moves twice)
        return f"the caches of layers {shared[0]} and {shared[1]} share memory"
    cuts = [(layout, members[a : a + MAX_GRID_Y]) for layout, members in by_layout.items()
            for a in range(0, len(members), MAX_GRID_Y)]
    tables = packed_upload({str(g): np.array([kv_caches[i].data_ptr() for i in members], dtype=np.int64)
                            for g, (_, members) in enumerate(cuts)}, device)
    return tuple(LaunchGroup(layout, tables[str(g)], tuple(members)) for g, (layout, members) in enumerate(cuts))


def _layers_plan(kv_caches: Sequence[Tensor]) -> tuple[LaunchGroup, ...] | str:
    """``_build_plan`` once per set of caches (addresses, shapes, strides, dtypes, device): the tables
    hold exactly the addresses of the key, so a hit is valid whatever tensor objects carry them."""
    key = _plan_key(kv_caches)
    plan = _plans.get(key)
    if plan is None:
        plan = _build_plan(kv_caches)
        if len(_plans) >= _PLAN_CACHE_SIZE:
            del _plans[next(iter(_plans))]  # the oldest
        _plans[key] = plan
    return plan


def _rows_error(slot_mapping: Tensor, src_rows: Tensor, dst_rows: Tensor) -> str | None:
    for name, t in (("src_rows", src_rows), ("dst_rows", dst_rows), ("slot_mapping", slot_mapping)):
        if t.dtype != torch.int64 or t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
            return f"{name} must be a contiguous int64 1-d tensor, got {t.dtype} {tuple(t.shape)} strides {t.stride()}"
    if src_rows.numel() != dst_rows.numel():
        return f"src_rows and dst_rows differ in length: {src_rows.numel()} and {dst_rows.numel()}"
    if src_rows.numel() > INT32_MAX:
        return f"{src_rows.numel()} moves are more than the kernel's 32-bit count"
    return None


def _checked_plan(kv_caches: Sequence[Tensor], slot_mapping: Tensor, src_rows: Tensor, dst_rows: Tensor,
                  need_cuda: bool) -> tuple[LaunchGroup, ...] | str:
    """The launches for these arguments, or why the kernel does not take them (``need_cuda``: on this
    machine's CUDA device, through the loader; else any device, as under the CPU emulation)."""
    if need_cuda:
        device = slot_mapping.device
        if device.type != "cuda" or any(t.device != device for t in (src_rows, dst_rows, *kv_caches[:1])):
            return NOT_CUDA  # the plan refuses caches on several devices
    reason = _rows_error(slot_mapping, src_rows, dst_rows)
    if reason is None and need_cuda:
        reason = kernels_unavailable_reason(tensor_device_index(slot_mapping))  # cached: before any upload
    if reason is not None:
        return reason
    return _layers_plan(kv_caches) if kv_caches else ()


def kv_compact_shape_reason(kv_caches: Sequence[Tensor], slot_mapping: Tensor, src_rows: Tensor,
                            dst_rows: Tensor) -> str | None:
    """None when the kernel takes these arguments on their dtypes, shapes and strides (any device:
    the CPU emulation runs it too), else why not. Host metadata only."""
    plan = _checked_plan(kv_caches, slot_mapping, src_rows, dst_rows, need_cuda=False)
    return plan if isinstance(plan, str) else None


def kv_compact_unsupported_reason(kv_caches: Sequence[Tensor], slot_mapping: Tensor, src_rows: Tensor,
                                  dst_rows: Tensor) -> str | None:
    """None when ``kv_compact_layers`` can run these arguments here, else why not: ``NOT_CUDA`` first
    (a CPU step is no reason to warn), then the rows' dtypes and shapes, the loader's availability and
    the caches' layouts (``kv_compact_shape_reason``). Host metadata only."""
    plan = _checked_plan(kv_caches, slot_mapping, src_rows, dst_rows, need_cuda=True)
    return plan if isinstance(plan, str) else None


def launch_geometry(layout: CacheLayout, num_layers: int, num_moves: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of one launch: a CTA per (slice of ``LANES`` units, layer), as many warps as
    make one round hold every move (at most ``MAX_WARPS``)."""
    warps = max(1, min(MAX_WARPS, -(-num_moves // PER_THREAD)))
    return (-(-layout.units_per_row // LANES), num_layers, 1), (32 * warps, 1, 1)


def _launch(plan: tuple[LaunchGroup, ...], slot_mapping: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
    m = src_rows.numel()
    if m == 0 or not plan:
        return
    dev = tensor_device_index(slot_mapping)
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    for group in plan:
        lay = group.layout
        kernel = get_kernel(SOURCE, "kv_compact_layers", ["--std=c++17", "-lineinfo", f"-DKVC_UNIT={lay.unit}"], dev)
        grid, block = launch_geometry(lay, len(group.layers), m)
        launch(kernel, grid, block,
               [group.table, slot_mapping, i64(slot_mapping.numel()), src_rows, dst_rows, i32(m),
                i64(lay.num_blocks), i32(lay.block_size), i64(lay.s_block), i64(lay.s_head), i64(lay.s_tok),
                i64(lay.s_unit), i32(lay.units_per_head), i32(lay.units_per_row)])


def kv_compact_layers(kv_caches: Sequence[Tensor], slot_mapping: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
    """The compaction by the kernel (module docstring): one launch per group of layers with one layout
    (one launch at the 27B shape). Raises ValueError for what ``kv_compact_shape_reason`` refuses; the
    device is not checked (``kv_compact_unsupported_reason`` does). No host synchronisation."""
    plan = _checked_plan(kv_caches, slot_mapping, src_rows, dst_rows, need_cuda=False)
    if isinstance(plan, str):
        raise ValueError(f"kv_compact_layers: {plan}")
    _launch(plan, slot_mapping, src_rows, dst_rows)


def try_kv_compact_layers(kv_caches: Sequence[Tensor], slot_mapping: Tensor, src_rows: Tensor,
                          dst_rows: Tensor) -> str | None:
    """``kv_compact_layers`` when ``kv_compact_unsupported_reason`` is None (returning None), else that
    reason, having done nothing: the runtime's one check per call (``runtime/commit.py`` compact_kv)."""
    plan = _checked_plan(kv_caches, slot_mapping, src_rows, dst_rows, need_cuda=True)
    if isinstance(plan, str):
        return plan
    _launch(plan, slot_mapping, src_rows, dst_rows)
    return None

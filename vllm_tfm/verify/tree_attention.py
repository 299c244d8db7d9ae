"""Tree attention over a paged KV cache: the torch reference of ``cuda/tree_attention.cu``.

The verify step's attention for every tree request of a batch. Tree t is one request's n nodes in
topological order, at query rows ``tree_start[t] .. tree_start[t] + n - 1``; the request (row
``tree_req[t]`` of ``block_table`` and ``seq_lens``) has ``seq_lens[req]`` keys, vLLM's meaning:
the committed prefix (``ctx = seq_lens[req] - n`` keys, visible to every node) followed by the tree's
own n keys in node order (the step's KV was written at the sequential slots ``ctx + j``). Node j
sees tree key i iff i <= j and bit i of its ancestor bitmask is set (ancestor-or-self). With
``G = Hq / Hkv`` query heads per KV head (GQA):

    out[start + j, h] = softmax_k(scale * q[start + j, h] . K[k, h // G]) @ V[k, h // G]   (visible k)

Cache layout (vLLM 0.26 TRITON_ATTN, ``kv_cache.transpose(1, 2).split(D, -1)``): ``key_cache`` and
``value_cache`` are [num_blocks, block_size, Hkv, D]; key position p of a request lives in block
``block_table[req, p // block_size]`` at slot ``p % block_size``.

Ancestor bitmasks: ``ancestor_bits`` [sum n, W] int64, row ``cu[t] + j`` (``cu`` the prefix sums of
``tree_size``) for node j of tree t, bit ``i % 64`` of word ``i // 64`` for node i
(``vllm_tfm.tree.bitmask.ragged_ancestor_bits`` builds them from parents).

The reference gathers each request's keys, builds the dense [n, kv_len] mask and applies softmax in
``float64`` for float64 inputs, else float32. Only the tree rows of ``out`` are written.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TreeAttentionArgs", "check_tree_attention_args", "tree_attention"]


@dataclass(frozen=True)
class TreeAttentionArgs:
    """Validated host view of a call: per tree (request, first row, nodes, first bitmask row)."""

    req: list[int]
    start: list[int]
    size: list[int]
    node_off: list[int]
    seq_len: list[int]
    words: int


def _int_vector(x: Tensor, name: str, length: int | None = None) -> list[int]:
    if not isinstance(x, Tensor) or x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if length is not None and x.numel() != length:
        raise ValueError(f"{name} must have shape [{length}] (one per tree), got {tuple(x.shape)}")
    return [int(v) for v in x.tolist()]


def check_tree_attention_args(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    tree_req: Tensor,
    tree_start: Tensor,
    tree_size: Tensor,
    ancestor_bits: Tensor,
    out: Tensor | None = None,
) -> TreeAttentionArgs:
    """Validate a call's arguments (shapes, dtypes, index ranges, bitmasks); raise ValueError naming the problem.

    Reads the index tensors on the host (one synchronisation for device tensors).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    rows, hq, dim = q.shape
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_blocks, block_size, hkv, kdim = key_cache.shape
    if kdim != dim:
        raise ValueError(f"the caches' head size {kdim} differs from q's {dim}")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} query heads must be a multiple of Hkv={hkv} KV heads")
    if not (q.dtype == key_cache.dtype == value_cache.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, key_cache and value_cache must share one floating dtype, got {q.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {list(q.shape)} on {q.device}, got {out.dtype} {list(out.shape)} on {out.device}")
    if block_table.dim() != 2 or block_table.dtype.is_floating_point:
        raise ValueError(f"block_table must be a [num_requests, max_blocks] integer tensor, got {block_table.dtype} {tuple(block_table.shape)}")
    lens = _int_vector(seq_lens, "seq_lens", block_table.shape[0])
    size = _int_vector(tree_size, "tree_size")
    num_trees = len(size)
    req = _int_vector(tree_req, "tree_req", num_trees)
    start = _int_vector(tree_start, "tree_start", num_trees)
    node_off = [0] * (num_trees + 1)
    for t, n in enumerate(size):
        node_off[t + 1] = node_off[t] + n
    if ancestor_bits.dim() != 2 or ancestor_bits.dtype != torch.int64:
        raise ValueError(f"ancestor_bits must be a [sum of tree sizes, words] int64 tensor, got {ancestor_bits.dtype} {tuple(ancestor_bits.shape)}")
    words = ancestor_bits.shape[1]
    if ancestor_bits.shape[0] != node_off[-1]:
        raise ValueError(f"ancestor_bits has {ancestor_bits.shape[0]} rows for {node_off[-1]} tree nodes (the sum of tree_size)")
    taken: list[tuple[int, int]] = []
    bt_rows = block_table.to("cpu", torch.long) if num_trees else block_table
    for t in range(num_trees):
        n, r, s = size[t], req[t], start[t]
        if n < 1 or n > 64 * words:
            raise ValueError(f"tree_size[{t}] = {n}: a tree has 1 .. 64 * words = {64 * words} nodes")
        if not 0 <= r < block_table.shape[0]:
            raise ValueError(f"tree_req[{t}] = {r} is not a row of block_table ({block_table.shape[0]} requests)")
        if s < 0 or s + n > rows:
            raise ValueError(f"tree {t}: rows {s} .. {s + n - 1} are outside q's {rows} rows")
        taken.append((s, s + n))
        kv = lens[r]
        if kv < n:
            raise ValueError(f"tree {t}: seq_lens[{r}] = {kv} is shorter than the tree's {n} nodes (the tree's keys are the last n)")
        used = (kv + block_size - 1) // block_size
        if used > block_table.shape[1]:
            raise ValueError(f"tree {t}: {kv} keys need {used} blocks; block_table has {block_table.shape[1]} columns")
        blocks = bt_rows[r, :used]
        if used and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
            raise ValueError(f"tree {t}: block_table[{r}] names a block outside the cache's {num_blocks} blocks")
    taken.sort()
    for (s0, e0), (s1, _) in itertools.pairwise(taken):
        if s1 < e0:
            raise ValueError(f"trees overlap in q's rows ({s0} .. {e0 - 1} and from {s1})")
    _check_bits(ancestor_bits, size, node_off, words)
    return TreeAttentionArgs(req, start, size, node_off[:-1], [lens[r] for r in req], words)


def _check_bits(bits: Tensor, size: list[int], node_off: list[int], words: int) -> None:
    """Every node sees itself and no later node (bitmask rows of a topological tree)."""
    if not size:
        return
    b = bits.to("cpu")
    local = torch.cat([torch.arange(n) for n in size])
    unpacked = ((b.unsqueeze(-1) >> torch.arange(64)) & 1).reshape(b.shape[0], 64 * words).bool()
    cols = torch.arange(64 * words)
    self_bit = unpacked[torch.arange(b.shape[0]), local]
    later = (unpacked & (cols[None, :] > local[:, None])).any(-1)
    bad = ~self_bit | later
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        t = max(i for i in range(len(size)) if node_off[i] <= row)
        j = row - node_off[t]
        what = "does not see itself" if not bool(self_bit[row]) else "sees a later node"
        raise ValueError(f"ancestor_bits row {row} (tree {t}, node {j}) {what}: bit j must be set and no bit above j")


def _gather_keys(cache: Tensor, block_table: Tensor, req: int, kv_len: int) -> Tensor:
    """[kv_len, Hkv, D]: the request's keys (or values) in position order."""
    bs = cache.shape[1]
    pos = torch.arange(kv_len, device=cache.device)
    blocks = block_table[req].to(cache.device, torch.long)[pos // bs]
    return cache[blocks, pos % bs]


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
    """Ancestor-masked attention of every tree's rows (see the module docstring).

    q [T, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D] (q's dtype);
    block_table [num_requests, max_blocks] int; seq_lens [num_requests] int (keys per request,
    tree included); tree_req, tree_start, tree_size [R] int; ancestor_bits [sum n, W] int64;
    scale: softmax scale. Writes the tree rows of ``out`` ([T, Hq, D], q's dtype; zeros if None)
    and returns it; the other rows are left as they are.
    """
    args = check_tree_attention_args(q, key_cache, value_cache, block_table, seq_lens, tree_req, tree_start,
                                     tree_size, ancestor_bits, out)
    if out is None:
        out = torch.zeros_like(q)
    hq, hkv = q.shape[1], key_cache.shape[2]
    group = hq // hkv
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    bits = ancestor_bits.to(q.device)
    for t in range(len(args.size)):
        n, s, kv = args.size[t], args.start[t], args.seq_len[t]
        ctx = kv - n
        k = _gather_keys(key_cache, block_table, args.req[t], kv).to(cdt).repeat_interleave(group, dim=1)
        v = _gather_keys(value_cache, block_table, args.req[t], kv).to(cdt).repeat_interleave(group, dim=1)
        rows = bits[args.node_off[t] : args.node_off[t] + n]  # [n, W]
        i = torch.arange(n, device=q.device)
        tree_vis = ((rows[:, i // 64] >> (i % 64)) & 1).bool()  # [n (node), n (key node)]
        vis = torch.cat([torch.ones(n, ctx, dtype=torch.bool, device=q.device), tree_vis], dim=1)  # [n, kv]
        scores = torch.einsum("jhd,khd->hjk", q[s : s + n].to(cdt), k) * scale
        w = torch.softmax(scores.masked_fill(~vis[None], float("-inf")), dim=-1)
        out[s : s + n] = torch.einsum("hjk,khd->jhd", w, v).to(out.dtype)
    return out

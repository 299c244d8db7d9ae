"""Reading rows of the target's vocabulary tables (input embedding, lm_head) for the drafters.

The Weaver reads the target's input embedding at tree tokens and the target's ``lm_head`` rows of
the DFlash candidates. On one GPU those are plain ``[V, H]`` weights. Under tensor parallelism the
serving engine splits both by vocabulary: each rank holds rows ``[start, start + n)`` of the
original vocabulary (vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead``; padding rows past the
original vocabulary are never read). ``ShardedVocabTable`` reads such a split table the way a
vocabulary-parallel embedding does (Megatron-LM, Shoeybi et al. 2019, section 3): every rank
contributes its own rows and zeros elsewhere, and a sum over the ranks (``all_reduce``, injected
by the caller: this module imports no distributed runtime) completes them. Each element of the sum
has exactly one non-zero term, so the result is exact and the same bytes on every rank, whatever
order the reduction adds in; that is what keeps the ranks' trees identical.

``candidate_residual`` needs only ``rows . query`` for K candidates, so under a split it reduces
the ``[..., K]`` partial dot products instead of ``[..., K, H]`` rows (H times fewer bytes).

Tables here are a ``Tensor`` ``[V, H]``, an ``nn.Module`` (``nn.Embedding``: called on the ids;
``nn.Linear``: its ``.weight``), or a ``ShardedVocabTable``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .common import as_weight, compute_dtype

__all__ = [
    "ShardedVocabTable",
    "VocabTable",
    "candidate_residual",
    "candidate_scores_reference",
    "table_num_rows",
    "table_rows",
]


class ShardedVocabTable:
    """Rows ``[start, start + local.shape[0])`` of a ``[num_rows, H]`` table held by this rank.

    local: [n_local, H] this rank's rows (``n_local`` may include padding rows past ``num_rows``,
    which are never read). all_reduce: sums a tensor over the ranks that hold the other rows and
    returns the sum (in place or not); every rank must call the table's methods in the same order
    with equally shaped ids, as with any collective.
    """

    def __init__(self, local: Tensor, start: int, end: int, num_rows: int, all_reduce: Callable[[Tensor], Tensor]) -> None:
        if local.dim() != 2:
            raise ValueError(f"the local shard must be 2-D [rows, hidden], got shape {tuple(local.shape)}")
        if not 0 <= start <= end <= num_rows:
            raise ValueError(f"shard rows [{start}, {end}) must lie in [0, {num_rows}]")
        if end - start > local.shape[0]:
            raise ValueError(f"shard rows [{start}, {end}) need {end - start} local rows, the shard has {local.shape[0]}")
        self.local = local
        self.start, self.end, self.num_rows = start, end, num_rows
        self.all_reduce = all_reduce

    @property
    def hidden_size(self) -> int:
        return int(self.local.shape[1])

    def _local_index(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        ids = ids.to(self.local.device)
        mine = (ids >= self.start) & (ids < self.end)
        return torch.where(mine, ids - self.start, 0), mine

    def partial_rows(self, ids: Tensor) -> Tensor:
        """This rank's contribution to ``rows(ids)``: its own rows, zeros elsewhere. [*ids.shape, H]."""
        idx, mine = self._local_index(ids)
        rows = self.local.index_select(0, idx.reshape(-1)).view(*ids.shape, -1)
        return torch.where(mine[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    def rows(self, ids: Tensor) -> Tensor:
        """The full rows of ``ids`` (any shape, values in [0, num_rows)) on every rank: [*ids.shape, H]."""
        return self.all_reduce(self.partial_rows(ids))

    def partial_dots(self, ids: Tensor, queries: Tensor, dtype: torch.dtype) -> Tensor:
        """This rank's contribution to ``rows(ids) . queries`` in ``dtype``: ids [..., K], queries [..., H] -> [..., K]."""
        idx, mine = self._local_index(ids)
        rows = self.local.index_select(0, idx.reshape(-1)).view(*ids.shape, -1)
        dots = torch.einsum("...h,...kh->...k", queries.to(dtype), rows.to(dtype))
        return torch.where(mine, dots, torch.zeros((), dtype=dtype, device=dots.device))

    def dots(self, ids: Tensor, queries: Tensor, dtype: torch.dtype) -> Tensor:
        """``rows(ids) . queries`` summed over the ranks (one non-zero term each): [..., K] in ``dtype``."""
        return self.all_reduce(self.partial_dots(ids, queries, dtype))


VocabTable = Tensor | nn.Module | ShardedVocabTable


def table_num_rows(table: VocabTable, name: str) -> int:
    """The vocabulary size a table covers (ids must lie in [0, this))."""
    if isinstance(table, ShardedVocabTable):
        return table.num_rows
    return int(as_weight(table, name).shape[0])


def table_rows(table: VocabTable, ids: Tensor) -> Tensor:
    """Rows of ``ids``: [*ids.shape, H] (an ``nn.Module`` is called on the ids, like an embedding)."""
    if isinstance(table, ShardedVocabTable):
        return table.rows(ids)
    if isinstance(table, Tensor):
        return table[ids]
    return table(ids)


def candidate_residual(lm_head: VocabTable, ids: Tensor, queries: Tensor) -> Tensor:
    """``lm_head[ids] . query`` for candidates ids [..., K] and queries [..., H]: [..., K], in the
    compute dtype of the queries (float32, float64 for float64 queries)."""
    cd = compute_dtype(queries.dtype)
    if isinstance(lm_head, ShardedVocabTable):
        return lm_head.dots(ids, queries, cd)
    weight = as_weight(lm_head, "lm_head")
    flat = ids.reshape(-1)
    rows = weight.index_select(0, flat if flat.device == weight.device else flat.to(weight.device)).view(*ids.shape, -1)
    queries, rows = (t if t.dtype == cd else t.to(cd) for t in (queries, rows))
    return torch.einsum("...h,...kh->...k", queries, rows)


def candidate_scores_reference(
    lm_head: VocabTable, cand_ids: Tensor, cand_logits: Tensor, depths: Tensor, queries: Tensor
) -> Tensor:
    """The Weaver's candidate scores before the softmax: for node (r, i) at depth d = depths[r, i]
    (clamped to [0, D - 1]) and candidate k, ``cand_logits[r, d, k] + lm_head[cand_ids[r, d, k]] .
    queries[r, i]``. cand_ids, cand_logits [R, D, K]; depths [R, w] int64; queries [R, w, H].
    Returns [R, w, K] in the queries' compute dtype (float32; float64 for float64 queries). The
    torch reference of ``vllm_tfm.kernels.candidate_scores.candidate_scores``."""
    r, w = depths.shape
    k = cand_ids.shape[2]
    gather = depths.clamp(0, cand_ids.shape[1] - 1)[..., None].expand(r, w, k)
    ids = cand_ids.gather(1, gather)  # [R, w, K]
    logits = cand_logits.gather(1, gather)
    cd = compute_dtype(queries.dtype)
    if isinstance(lm_head, Tensor) and lm_head.dtype == queries.dtype == logits.dtype == cd:
        # logits + lm_head[ids] . query in one batched GEMM
        flat = ids.flatten()
        rows = lm_head.index_select(0, flat if flat.device == lm_head.device else flat.to(lm_head.device))
        rows = rows.view(r * w, k, -1)
        q = queries.reshape(r * w, -1, 1)
        return torch.baddbmm(logits.reshape(r * w, k, 1), rows, q).view(r, w, k)
    residual = candidate_residual(lm_head, ids, queries)  # [R, w, K]
    return (logits if logits.dtype == residual.dtype else logits.to(residual.dtype)) + residual

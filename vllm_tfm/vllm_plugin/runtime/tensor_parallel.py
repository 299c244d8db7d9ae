"""Tensor parallelism in the tfm runtime: the Weaver's vocabulary tables, and the rank-consistency check.

Every tensor-parallel rank builds the tree itself from the same inputs (docs/ray.md, "Tensor-parallel
ranks build the same tree"); two things make that work and let a run prove it:

* ``target_vocab_table``: under TP vLLM splits the target's input embedding and ``lm_head`` by
  vocabulary (``VocabParallelEmbedding`` / ``ParallelLMHead``, vocab_parallel_embedding.py: each
  rank holds ``shard_indices.org_vocab_start_index .. org_vocab_end_index`` of the original
  vocabulary, then padding). The Weaver reads rows of both at arbitrary token ids, so on TP > 1 it
  gets a ``vllm_tfm.models.vocab_table.ShardedVocabTable`` that completes the rows (or their dot
  products with the Weaver's queries) with one all-reduce over the TP group: exact, and the same
  bytes on every rank.
* ``VLLM_TFM_CHECK_TP_TREES=1`` (a debug switch read when the proposer is built; it costs an
  all-gather per step): after each proposal the draft tokens and parents of every request, and
  after each verification the accepted path and output tokens, are all-gathered over the TP group
  and compared with rank 0's; a difference stops the engine with a RuntimeError naming the rank and
  the request. The runtime's metrics count the checked steps (``tp_tree_checks``,
  ``tp_accept_checks``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from vllm_tfm.models.vocab_table import ShardedVocabTable

__all__ = ["check_tp_trees_enabled", "check_same_on_tp_ranks", "first_mismatch", "target_vocab_table", "tp_world_size"]

CHECK_ENV = "VLLM_TFM_CHECK_TP_TREES"


def tp_world_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return int(get_tensor_model_parallel_world_size())


def check_tp_trees_enabled() -> bool:
    return os.environ.get(CHECK_ENV, "0") not in ("", "0", "false", "False")


def target_vocab_table(model: torch.nn.Module, names: tuple[str, ...], what: str, tp_size: int) -> Tensor | ShardedVocabTable:
    """The target's ``what`` (first of ``names`` found) as a table the Weaver can read rows of.

    TP = 1: the weight itself. TP > 1: a ``ShardedVocabTable`` over this rank's shard, completed
    by vLLM's tensor-parallel all-reduce.
    """
    module = None
    for name in names:
        try:
            module = model.get_submodule(name)
            break
        except AttributeError:
            continue
    if module is None or not isinstance(getattr(module, "weight", None), Tensor):
        raise ValueError(f"vllm-tfm: cannot find the target's {what} (looked for {', '.join(names)})")
    if tp_size == 1:
        return module.weight
    return sharded_table(module, what)


def sharded_table(module: Any, what: str) -> ShardedVocabTable:
    """A ``ShardedVocabTable`` over a vLLM ``VocabParallelEmbedding`` / ``ParallelLMHead`` shard."""
    indices = getattr(module, "shard_indices", None)
    if indices is None:
        raise ValueError(
            f"vllm-tfm: the target's {what} ({type(module).__name__}) is not a vocabulary-parallel layer; "
            "the Weaver cannot read it under tensor parallelism"
        )
    if indices.num_added_elements:
        raise ValueError(f"vllm-tfm: the target's {what} has {indices.num_added_elements} added (LoRA) vocabulary rows; not supported")
    from vllm.distributed import tensor_model_parallel_all_reduce

    return ShardedVocabTable(
        module.weight,
        int(indices.org_vocab_start_index),
        int(indices.org_vocab_end_index),
        int(module.org_vocab_size),
        tensor_model_parallel_all_reduce,
    )


def first_mismatch(gathered: Tensor) -> tuple[int, int] | None:
    """gathered [world, R, n] (rank, request, values): (rank, request) of the first row that differs
    from rank 0's, or None when every rank holds rank 0's values."""
    diff = (gathered != gathered[:1]).any(dim=-1)  # [world, R]
    if not bool(diff.any()):
        return None
    rank, req = (int(v) for v in diff.nonzero()[0])
    return rank, req


def check_same_on_tp_ranks(what: str, per_request: list[Tensor], req_ids: list[str], step: int) -> None:
    """All-gather ``per_request`` tensors (each [R, ...]) over the TP group; raise if a rank differs.

    Every rank calls this at the same point of the same step (a collective); all of them see the
    same gathered data, so they all raise together.
    """
    from vllm.distributed import get_tp_group

    r = per_request[0].shape[0]
    rows = torch.cat([t.reshape(r, -1).to(torch.int64) for t in per_request], dim=1)  # [R, n]
    gathered = get_tp_group().all_gather(rows[None].contiguous(), dim=0)  # [world, R, n]
    bad = first_mismatch(gathered)
    if bad is not None:
        rank, req = bad
        name = req_ids[req] if req < len(req_ids) else str(req)
        raise RuntimeError(
            f"vllm-tfm: tensor-parallel rank {rank} has different {what} than rank 0 at step {step} for request "
            f"{name!r} (rank 0: {gathered[0, req].tolist()[:16]}, rank {rank}: {gathered[rank, req].tolist()[:16]})"
        )

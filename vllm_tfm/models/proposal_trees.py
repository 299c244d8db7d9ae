"""Draft trees of R requests (or R evaluation anchors) from the drafter outputs, in one batch.

The glue between the drafter models and the lockstep tree builders of ``vllm_tfm.tree``, shared
by the vLLM runtime (``vllm_plugin.runtime.tree_builder_gpu``) and offline evaluation:

* ``weaver_padded_trees`` / ``weaver_draft_trees``: TfM trees. DFlash top-K candidates per depth
  (the top K of the raw logits, as the reference decoder's ``DFlashProposer`` takes them: ``torch.topk``, or
  ``vllm_tfm.kernels.topk_rows`` with ``topk_kernel``), one
  ``BatchedWeaverTreeScorer`` for all requests, ``WeaverGrowth`` (``build_weaver_padded``);
  ``weaver_growth`` is their part without host syncs (what a CUDA graph can capture).
* ``treeflash_padded_trees``: TreeFlash trees from the marginals and a
  ``BatchedTreeFlashTransitionScorer``, ``build_treeflash_padded``.

``*_padded_trees`` return ``PaddedTrees`` (scores and draft log-probabilities included);
``*_draft_trees`` return the runtime layout: tokens [R, B] (node j + 1 in column j) and parents
[R, 1 + B], every tree completed to B draft nodes (``fill_to_budget``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vllm_tfm.kernels.topk_rows import topk_candidates
from vllm_tfm.kernels.weaver_round import round_fn_for
from vllm_tfm.tree.padded import PaddedTrees
from vllm_tfm.tree.treeflash_padded import build_treeflash_padded
from vllm_tfm.tree.weaver_padded import WeaverGrowth

from .treeflash import BatchedTreeFlashTransitionScorer, TreeFlashApproximator
from .vocab_table import VocabTable
from .weaver import BatchedWeaverTreeScorer, Weaver

__all__ = ["treeflash_padded_trees", "weaver_draft_trees", "weaver_growth", "weaver_padded_trees"]


def _candidates(dflash_logits: Tensor, top_k: int, kernel: bool = False) -> tuple[Tensor, Tensor]:
    """(cand_logits, cand_ids) [R, D, K]: topk of the logits in float32 (float64 stays float64).
    ``kernel``: the one-launch top-K (``vllm_tfm.kernels.topk_rows``) where it takes the logits, which
    orders equal logits by index (``torch.topk`` in no fixed way); else ``torch.topk``."""
    if dflash_logits.dim() != 3 or 0 in dflash_logits.shape:
        raise ValueError(f"dflash_logits must be [R, D, V] and non-empty, got {tuple(dflash_logits.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    return topk_candidates(dflash_logits, top_k, kernel=kernel)


def _runs_prompt_beside(prompt_stream: torch.cuda.Stream | None, dflash_hidden: Tensor) -> bool:
    """Whether ``weaver_growth`` runs the prompt pass on ``prompt_stream`` (CUDA inputs only)."""
    return prompt_stream is not None and dflash_hidden.is_cuda


def weaver_growth(
    weaver: Weaver,
    dflash_logits: Tensor,
    dflash_hidden: Tensor,
    verifier_hidden: Tensor,
    root_tokens: Tensor,
    embed: VocabTable,
    lm_head: VocabTable,
    budget: int,
    top_k: int,
    width: int,
    children_per_node: int,
    logits_dtype: torch.dtype | None = None,
    round_kernel: bool = True,
    score_kernel: bool = True,
    topk_kernel: bool = True,
    prompt_stream: torch.cuda.Stream | None = None,
) -> tuple[WeaverGrowth, Tensor]:
    """The host-sync-free part of ``weaver_padded_trees``: DFlash top-K candidates, the batched
    Weaver scorer and the first ``fixed_rounds`` rounds of growth. Returns (growth, cand_ids);
    ``growth.run_tail()`` finishes it (one host sync), ``growth.trees()`` reads it. With fixed
    shapes this is the part a CUDA graph captures (``vllm_plugin.runtime.weaver_graphs``).
    ``round_kernel``: grow with the one-launch round kernel (``vllm_tfm.kernels.weaver_round``) when
    it takes these tensors (CUDA; the same trees), else with the torch round. ``score_kernel``: the
    scorer's kernels where they take the tensors (``BatchedWeaverTreeScorer``: its linear layers
    through ``vllm_tfm.kernels.weaver_linear``, its candidate scores through
    ``vllm_tfm.kernels.candidate_scores``; the same scores to the activations' rounding). ``topk_kernel``:
    the DFlash top-K through ``vllm_tfm.kernels.topk_rows`` where it takes the logits (equal logits
    ordered by index), else ``torch.topk``. ``prompt_stream`` (CUDA): the scorer's prompt pass runs on
    it, concurrently with the top-K and the growth's set-up on the current stream (the two need
    nothing from each other; ``BatchedWeaverTreeScorer``); the roots' scoring call joins them. The
    same trees: the same kernels on the same inputs. Everything the prompt stream reads or writes is
    made before the event it starts after (``BatchedWeaverTreeScorer.prompt_buffers``): a buffer
    allocated later could be a temporary of the top-K that the top-K still reads."""
    fork: torch.cuda.Event | None = None
    kv_cache: list[Tensor] | None = None
    if _runs_prompt_beside(prompt_stream, dflash_hidden):
        kv_cache = BatchedWeaverTreeScorer.prompt_buffers(weaver, verifier_hidden, dflash_hidden, 1 + budget)
        fork = torch.cuda.Event()  # the prompt's inputs and buffers are ready here, before the top-K is queued
        fork.record()
    else:
        prompt_stream = None
    cand_logits, cand_ids = _candidates(dflash_logits, top_k, kernel=topk_kernel)
    if logits_dtype is not None:
        cand_logits = cand_logits.to(logits_dtype)
    scorer = BatchedWeaverTreeScorer(
        weaver, verifier_hidden, dflash_hidden, cand_ids, cand_logits, embed, lm_head, max_nodes=1 + budget,
        score_kernel=score_kernel, prompt_stream=prompt_stream, prompt_after=fork, kv_cache=kv_cache,
    )
    growth = WeaverGrowth(
        root_tokens, cand_ids, scorer, budget, dflash_logits.shape[1], width, children_per_node, check=False
    )
    if round_kernel:
        kernel = round_fn_for(growth)
        if kernel is not None:
            growth.round_fn = kernel
    growth.run_fixed()
    scorer.join_prompt()  # no-op after the roots' call; a capture must end with its streams joined
    return growth, cand_ids


def weaver_padded_trees(
    weaver: Weaver,
    dflash_logits: Tensor,
    dflash_hidden: Tensor,
    verifier_hidden: Tensor,
    root_tokens: Tensor,
    embed: VocabTable,
    lm_head: VocabTable,
    budget: int,
    top_k: int,
    width: int,
    children_per_node: int,
    logits_dtype: torch.dtype | None = None,
    round_kernel: bool = True,
    score_kernel: bool = True,
    topk_kernel: bool = True,
    prompt_stream: torch.cuda.Stream | None = None,
) -> tuple[PaddedTrees, Tensor]:
    """TfM trees of R requests, ``max_depth`` = D: (trees, cand_ids [R, D, K]).

    dflash_logits: [R, D, V] raw DFlash logits of depths 1..D; dflash_hidden: [R, D, H] the DFlash
    outputs (after its final norm) at block slots 1..D; verifier_hidden: [R, H] the target's final
    hidden state at the row that produced each root token; root_tokens: [R].
    ``logits_dtype``: dtype the candidates' DFlash logits are rounded to before scoring (None: the
    float32 / float64 of the topk, like the reference decoder).
    Per request the tree equals ``build_weaver`` with ``weaver.tree_scorer`` (to scorer rounding).
    """
    growth, cand_ids = weaver_growth(
        weaver, dflash_logits, dflash_hidden, verifier_hidden, root_tokens, embed, lm_head,
        budget, top_k, width, children_per_node, logits_dtype, round_kernel, score_kernel, topk_kernel,
        prompt_stream,
    )
    growth.run_tail()
    return growth.trees(), cand_ids


def weaver_draft_trees(
    weaver: Weaver,
    dflash_logits: Tensor,
    dflash_hidden: Tensor,
    verifier_hidden: Tensor,
    root_tokens: Tensor,
    embed: VocabTable,
    lm_head: VocabTable,
    budget: int,
    top_k: int,
    width: int,
    children_per_node: int,
    logits_dtype: torch.dtype | None = None,
    round_kernel: bool = True,
    score_kernel: bool = True,
    topk_kernel: bool = True,
    prompt_stream: torch.cuda.Stream | None = None,
) -> tuple[Tensor, Tensor]:
    """``weaver_padded_trees`` in the runtime layout: tokens [R, B], parents [R, 1 + B]; a tree
    smaller than B is completed with the best depth-1 candidate."""
    trees, cand_ids = weaver_padded_trees(
        weaver, dflash_logits, dflash_hidden, verifier_hidden, root_tokens, embed, lm_head,
        budget, top_k, width, children_per_node, logits_dtype, round_kernel, score_kernel, topk_kernel,
        prompt_stream,
    )
    return trees.draft_layout(cand_ids[:, 0, 0])


def treeflash_padded_trees(
    approximator: TreeFlashApproximator,
    final_norm: nn.Module,
    block_hidden_prenorm: Tensor,
    marginal_logprobs: Tensor,
    root_tokens: Tensor,
    embed: nn.Module | Tensor,
    lm_head: nn.Module | Tensor,
    budget: int,
    max_depth: int,
    top_m: int,
    temperature: float = 1.0,
) -> PaddedTrees:
    """TreeFlash trees of R requests. block_hidden_prenorm: [R, gamma, H] DFlash residual streams
    (slot d = depth d); marginal_logprobs: [R, D, V] log-probabilities of depths 1..D.
    Per request the tree equals ``build_treeflash`` with ``TreeFlashTransitionScorer``."""
    scorer = BatchedTreeFlashTransitionScorer(approximator, final_norm, block_hidden_prenorm, embed, lm_head, temperature)
    return build_treeflash_padded(root_tokens, marginal_logprobs, scorer, budget, max_depth, top_m, check=False)


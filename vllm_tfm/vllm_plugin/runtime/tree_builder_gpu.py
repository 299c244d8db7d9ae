"""Batched tree construction from the DFlash marginals, on the device of the marginals.

Every builder returns a padded batch ``tokens [R, B]`` (draft tokens, node j + 1 of the tree is
column j) and ``parents [R, 1 + B]`` (local parents, -1 at the root), nodes in topological order,
exactly B draft nodes per request: vLLM moves a fixed number of draft tokens per request per
step, so a tree that comes out smaller (a chain shallower than B, a DDTree whose candidate space
ran dry) is completed by ``fill_to_budget``.

* ``chain_trees``, ``ddtree_trees``: ``vllm_tfm.tree.marginal_padded`` (plain DFlash and DDTree).
* ``weaver_trees``: the TfM proposal; the Weaver re-scores the DFlash top-K candidates along each
  node's path (``vllm_tfm.models.BatchedWeaverTreeScorer``) while ``vllm_tfm.tree.build_weaver_padded``
  grows all requests' trees in lockstep: one Weaver call per step for every request, about
  ceil(B / w) steps, one host sync at the end (``vllm_tfm.models.proposal_trees``). Same trees as
  ``vllm_tfm.tree.build_weaver`` per request (to Weaver rounding). The steps before that sync have
  fixed shapes and update their state in place: ``weaver_graphs`` replays them as CUDA graphs
  (the default; ``VLLM_TFM_WEAVER_GRAPHS=0`` builds eagerly).
* ``treeflash_trees``: TreeFlash; the AR approximator corrects the DFlash pre-norm residual
  stream of every depth for each previous token (``vllm_tfm.models.BatchedTreeFlashTransitionScorer``)
  and ``vllm_tfm.tree.build_treeflash_padded`` keeps the B best keys per depth: one scorer call
  per depth for every request, one host sync at the end. Same trees as
  ``vllm_tfm.tree.build_treeflash`` per request (to scorer rounding).

Determinism: sorts are stable and scores are accumulated in float64 in a fixed order, so equal
inputs give equal trees on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vllm_tfm.models.proposal_trees import treeflash_padded_trees, weaver_draft_trees
from vllm_tfm.models.treeflash import TreeFlashApproximator
from vllm_tfm.models.vocab_table import VocabTable
from vllm_tfm.tree.marginal_padded import (
    chain_trees,
    check_marginals,
    ddtree_trees,
    ranked_top,
)
from vllm_tfm.tree.padded import fill_to_budget

from .kernels_or_reference import kernels_enabled
from .settings import RuntimeSwitch

__all__ = ["PROMPT_OVERLAP_ENV", "TOPK_KERNEL_ENV", "chain_trees", "ddtree_trees", "fill_to_budget", "growth_switches",
           "prompt_overlap_enabled", "prompt_stream", "ranked_top", "set_prompt_overlap", "set_topk_kernel",
           "topk_kernel_enabled", "treeflash_trees", "weaver_trees"]

TOPK_KERNEL_ENV = "VLLM_TFM_TOPK_KERNEL"
_TOPK = RuntimeSwitch(TOPK_KERNEL_ENV, "set_topk_kernel")


def topk_kernel_enabled() -> bool:
    """``VLLM_TFM_TOPK_KERNEL`` unset or not 0 / false (default on), unless ``set_topk_kernel`` overrode it: the
    Weaver build's DFlash top-K runs as one kernel launch (``vllm_tfm.kernels.topk_rows``) where it can. The
    builds pass ``kernels_enabled() and topk_kernel_enabled()``: ``VLLM_TFM_KERNELS=0`` turns it off too."""
    return _TOPK.enabled()


def set_topk_kernel(on: bool | None) -> bool:
    """Override ``VLLM_TFM_TOPK_KERNEL`` in this process (None: back to the environment's); the setting now in
    force. The Weaver CUDA graphs key on it (``weaver_graphs.graph_key``), so the next build after a change
    replays (or captures) the other setting's graph."""
    return _TOPK.set(on)


PROMPT_OVERLAP_ENV = "VLLM_TFM_WEAVER_PROMPT_OVERLAP"
# opt-in: on an H100 at the 27B shape it gave no steady gain per tree step (batch 2 slower, batch 4 faster;
# bench/NOTES.md section 63); its form with every buffer made before the fork passed the zoo's tokens there
_PROMPT_OVERLAP = RuntimeSwitch(PROMPT_OVERLAP_ENV, "set_prompt_overlap", default_on=False)
_PROMPT_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def prompt_overlap_enabled() -> bool:
    """``VLLM_TFM_WEAVER_PROMPT_OVERLAP`` set to 1 / true (default off), unless ``set_prompt_overlap`` overrode
    it: the Weaver's prompt pass runs on a second stream while the DFlash top-K and the growth's set-up run on
    the build's own (``models.proposal_trees.weaver_growth``; bench/NOTES.md section 62)."""
    return _PROMPT_OVERLAP.enabled()


def set_prompt_overlap(on: bool | None) -> bool:
    """Override ``VLLM_TFM_WEAVER_PROMPT_OVERLAP`` in this process (None: back to the environment's); the
    setting now in force. The Weaver CUDA graphs key on it, like ``set_topk_kernel``."""
    return _PROMPT_OVERLAP.set(on)


def prompt_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream of the Weaver's prompt pass on ``device`` while the switch is on (None off it, and on
    other devices than CUDA): one per device for the process, since cuBLAS keeps a workspace per
    stream and CUDA graphs capture work on any stream forked from the capturing one."""
    device = torch.device(device)
    if device.type != "cuda" or not prompt_overlap_enabled():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _PROMPT_STREAMS.get(device)
    if stream is None:
        stream = _PROMPT_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def growth_switches(device: torch.device) -> dict[str, object]:
    """The runtime switches of a Weaver build on ``device``, as ``weaver_growth`` keywords: the round, score and
    top-K kernels (``kernels_enabled()``, ``topk_kernel_enabled()``) and the prompt stream (``prompt_stream``).
    One place for the eager build here and the captured one (``weaver_graphs``), whose graph key reads the same."""
    kernels = kernels_enabled()
    return {"round_kernel": kernels, "score_kernel": kernels, "topk_kernel": kernels and topk_kernel_enabled(),
            "prompt_stream": prompt_stream(device)}


def weaver_trees(
    weaver: nn.Module,
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
) -> tuple[Tensor, Tensor]:
    """TfM trees: Weaver-scored best-first growth of all requests at once (module docstring).

    dflash_logits: [R, D, V] raw DFlash logits; dflash_hidden: [R, D, H] DFlash outputs (after
    its final norm) at block slots 1..D; verifier_hidden: [R, H] the target's final hidden state
    at the row that produced each root (bonus) token; root_tokens: [R].
    Returns tokens [R, B], parents [R, 1 + B] (completed by ``fill_to_budget``). The candidates'
    DFlash logits are held in the Weaver's dtype (``dflash_hidden.dtype``) before scoring.
    """
    check_marginals(dflash_logits, budget)
    return weaver_draft_trees(
        weaver, dflash_logits, dflash_hidden, verifier_hidden, root_tokens, embed, lm_head,
        budget, top_k, width, children_per_node, logits_dtype=dflash_hidden.dtype, **growth_switches(dflash_hidden.device),
    )


def treeflash_trees(
    approximator: TreeFlashApproximator,
    final_norm: nn.Module,
    dflash_prenorm: Tensor,
    dflash_logits: Tensor,
    root_tokens: Tensor,
    embed: nn.Module | Tensor,
    lm_head: nn.Module | Tensor,
    budget: int,
    top_m: int,
) -> tuple[Tensor, Tensor]:
    """TreeFlash trees of all requests at once, ``max_depth`` = D (module docstring).

    dflash_prenorm: [R, D, H] the DFlash residual stream before its final norm at block slots
    1..D (depths 1..D); dflash_logits: [R, D, V] raw DFlash logits of the same slots; root_tokens:
    [R]; embed: the target's input embedding ([V, H] or a module called on ids); lm_head: [V, H] or
    a module mapping [N, H] to [N, V] logits. Returns tokens [R, B], parents [R, 1 + B]; a tree
    smaller than B (its restricted transition graph ran out) is completed by ``fill_to_budget``
    with the best depth-1 marginal token.
    """
    check_marginals(dflash_logits, budget)
    r, d, _ = dflash_logits.shape
    if dflash_prenorm.dim() != 3 or tuple(dflash_prenorm.shape[:2]) != (r, d):
        raise ValueError(f"dflash_prenorm must be [R={r}, D={d}, H], got {tuple(dflash_prenorm.shape)}")
    logprobs = torch.log_softmax(dflash_logits if dflash_logits.dtype == torch.float64 else dflash_logits.float(), dim=-1)
    # the scorer reads block slot d for depth d (slot 0, the root's, is never read)
    block = torch.cat([dflash_prenorm.new_zeros(r, 1, dflash_prenorm.shape[2]), dflash_prenorm], dim=1)
    trees = treeflash_padded_trees(approximator, final_norm, block, logprobs, root_tokens, embed, lm_head, budget, d, top_m)
    return trees.draft_layout(logprobs[:, 0].argmax(-1))

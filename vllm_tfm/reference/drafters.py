"""Glue from the drafter models (``vllm_tfm.models``) to the tree builders (``vllm_tfm.tree``).

One :class:`DFlashProposer` per generation. Each step it runs the DFlash drafter once over
``[bonus, MASK x (gamma - 1)]`` at positions ``P .. P + gamma - 1`` (P = the bonus position = the
number of committed tokens the target has processed), reading the tapped target hidden states of
every committed token (their per-layer context K/V are cached and extended after each commit),
then builds the tree of the chosen method:

* ``chain``: the argmax of each depth's marginal (:func:`vllm_tfm.tree.build_chain`);
* ``ddtree``: best-first over the marginals (:func:`vllm_tfm.tree.build_ddtree`);
* ``treeflash``: marginals + the TreeFlash AR approximator's transitions
  (:func:`vllm_tfm.tree.build_treeflash`);
* ``tfm``: DFlash top-K candidates per depth, Weaver scores along each path, best-first with w
  nodes per Weaver call (:func:`vllm_tfm.tree.build_weaver`).

All four builders are deterministic (top-ranked children); when sampling, the decoder verifies
them with ``target_only`` (or ``traversal`` in its sibling-order mode, exact for any children sets).
The target's embedding and lm_head are shared with the drafters (DFlash's z-lab layout stores
neither).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vllm_tfm.models import (
    DFlashDrafter,
    DrafterBundle,
    TreeFlashApproximator,
    TreeFlashTransitionScorer,
    Weaver,
    drafter_logits,
)
from vllm_tfm.tree import Tree, build_chain, build_ddtree, build_treeflash, build_weaver, default_weaver_width

__all__ = ["METHODS", "DraftInputs", "ProposalBias", "DFlashProposer", "make_proposer"]

METHODS = ("chain", "ddtree", "treeflash", "tfm")


@dataclass(frozen=True)
class DraftInputs:
    """What a proposer sees at one decode step.

    root: the bonus token (tree node 0). position: its position P (committed tokens processed).
    verifier_hidden: [H] the target's final-norm hidden state at position P - 1 (whose logits gave
    the root). tokens: [P + 1] int64, every committed token (prompt included) then the root.
    """

    root: int
    position: int
    verifier_hidden: Tensor
    tokens: Tensor


ProposalBias = Callable[[DraftInputs, int], Tensor]
"""bias(inputs, max_depth) -> [max_depth, V] added to the proposal logits of depths 1..max_depth
(DFlash marginals, hence Weaver candidates and their logits, and TreeFlash transitions). For tests
that need a drafter that knows the target's continuation; None in normal use."""


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _BiasedTransitions:
    """A TreeFlash transition scorer with a per-depth logit bias [D, V] added (renormalised)."""

    def __init__(self, inner: Callable[[int, Tensor], Tensor], bias: Tensor) -> None:
        self.inner = inner
        self.bias = bias

    def __call__(self, depth: int, prev_tokens: Tensor) -> Tensor:
        logp = self.inner(depth, prev_tokens)
        return torch.log_softmax(logp + self.bias[depth - 1].to(logp), dim=-1)


class DFlashProposer:
    """Builds one tree per step from a DFlash drafter (and a Weaver or TreeFlash approximator).

    Args:
        method: one of :data:`METHODS`.
        drafter: the DFlash block drafter.
        embed, lm_head: the target's input embedding and lm_head (shared with the drafter).
        gamma: block size (2 .. drafter block size); the deepest draft depth is gamma - 1.
        weaver: needed for ``tfm``. treeflash: needed for ``treeflash``.
        top_k: DFlash candidates per depth for Weaver (clipped to V).
        width: Weaver nodes expanded per call (None: ``default_weaver_width(B)``).
        children_per_node: children an expanded Weaver node publishes.
        top_m: TreeFlash stage-1 candidates per depth.
        proposal_bias: see :data:`ProposalBias` (tests).
    """

    def __init__(
        self,
        method: str,
        drafter: DFlashDrafter,
        embed: nn.Module,
        lm_head: nn.Module,
        *,
        gamma: int | None = None,
        weaver: Weaver | None = None,
        treeflash: TreeFlashApproximator | None = None,
        top_k: int = 512,
        width: int | None = None,
        children_per_node: int = 8,
        top_m: int = 16,
        proposal_bias: ProposalBias | None = None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        block = drafter.config.block_size
        gamma = block if gamma is None else int(gamma)
        if not 2 <= gamma <= block:
            raise ValueError(f"block size gamma must be in 2..{block} (the drafter's block size), got {gamma}")
        if method == "tfm":
            if weaver is None:
                raise ValueError("method 'tfm' needs a Weaver")
            if gamma - 1 > weaver.config.max_depth:
                raise ValueError(f"gamma - 1 = {gamma - 1} exceeds the Weaver's max_depth {weaver.config.max_depth}")
        if method == "treeflash" and treeflash is None:
            raise ValueError("method 'treeflash' needs a TreeFlash approximator")
        for name, v in (("top_k", top_k), ("children_per_node", children_per_node), ("top_m", top_m)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if width is not None and width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.method = method
        self.drafter = drafter
        self.embed = embed
        self.lm_head = lm_head
        self.gamma = gamma
        self.weaver = weaver
        self.treeflash = treeflash
        self.top_k = top_k
        self.width = width
        self.children_per_node = children_per_node
        self.top_m = top_m
        self.proposal_bias = proposal_bias
        self.dtype = next(drafter.parameters()).dtype
        self._ctx_kv: list[tuple[Tensor, Tensor]] | None = None

    @property
    def max_depth(self) -> int:
        return self.gamma - 1

    # ------------------------------------------------------------------ context
    def reset(self) -> None:
        """Forget the context (start of a generation)."""
        self._ctx_kv = None

    @torch.no_grad()
    def add_context(self, taps: Tensor, start_position: int) -> None:
        """Append committed tokens: ``taps [m, n_tap * H]`` at positions start .. start + m - 1."""
        if taps.shape[0] == 0:
            return
        pos = torch.arange(start_position, start_position + taps.shape[0], device=taps.device)
        kv = self.drafter.context_kv(taps.to(self.dtype), pos)
        if self._ctx_kv is None:
            self._ctx_kv = kv
        else:
            self._ctx_kv = [(torch.cat([k0, k1]), torch.cat([v0, v1])) for (k0, v0), (k1, v1) in zip(self._ctx_kv, kv)]

    # ------------------------------------------------------------------ propose
    @torch.no_grad()
    def propose(self, inputs: DraftInputs, budget: int) -> Tree:
        """The tree (root = ``inputs.root``, at most 1 + budget nodes) for this step."""
        if self._ctx_kv is None:
            raise ValueError("the proposer has no context: call add_context with the prompt's tapped hidden states first")
        n_ctx = self._ctx_kv[0][0].shape[0]
        if n_ctx != inputs.position:
            raise ValueError(f"the proposer holds {n_ctx} context tokens but the bonus sits at position {inputs.position}")
        dev = inputs.tokens.device
        block = self.drafter.block_tokens(torch.tensor([inputs.root], device=dev))[0, : self.gamma]
        positions = torch.arange(inputs.position, inputs.position + self.gamma, device=dev)
        cu = torch.tensor([0, n_ctx], dtype=torch.long, device=dev)
        prenorm = self.drafter.forward_batch_prenorm(self._ctx_kv, cu, block[None], positions[None], self.embed)[0]
        return self.tree_from_block(inputs, prenorm, budget)

    @torch.no_grad()
    def tree_from_block(self, inputs: DraftInputs, prenorm: Tensor, budget: int) -> Tree:
        """The step's tree from the DFlash block's residual stream ``prenorm [gamma, H]`` (before the
        final norm), as :meth:`propose` computes it; callers that run the DFlash forward for many
        anchors at once (the acceptance replay) build each anchor's tree here."""
        hidden = self.drafter.norm(prenorm)  # [gamma, H]
        logits = drafter_logits(self.drafter, hidden, self.lm_head)  # [D, V], row d-1 = depth d
        logits = logits.to(_math_dtype(logits.dtype))
        bias = None
        if self.proposal_bias is not None:
            bias = self.proposal_bias(inputs, self.max_depth).to(logits)
            logits = logits + bias
        d = self.max_depth
        if self.method == "chain":
            return build_chain(inputs.root, torch.log_softmax(logits, -1), budget, d)
        if self.method == "ddtree":
            return build_ddtree(inputs.root, torch.log_softmax(logits, -1), budget, d)
        if self.method == "treeflash":
            scorer = TreeFlashTransitionScorer(self.treeflash, self.drafter.norm, prenorm, self.embed, self.lm_head)
            if bias is not None:
                scorer = _BiasedTransitions(scorer, bias)
            return build_treeflash(inputs.root, torch.log_softmax(logits, -1), scorer, budget, d, self.top_m)
        # tfm
        k = min(self.top_k, logits.shape[-1])
        cand_logits, cand_ids = torch.topk(logits, k, dim=-1)  # [D, K], sorted descending
        scorer = self.weaver.tree_scorer(
            inputs.verifier_hidden.to(self.dtype), hidden[1:], cand_ids, cand_logits, self.embed, self.lm_head
        )
        width = self.width if self.width is not None else default_weaver_width(budget)
        return build_weaver(inputs.root, cand_ids, scorer, budget, d, width, self.children_per_node)


def make_proposer(
    method: str,
    bundle: DrafterBundle,
    target: nn.Module,
    gamma: int | None = None,
    proposal_bias: ProposalBias | None = None,
    width: int | None = None,
    **overrides,
) -> DFlashProposer:
    """A proposer for ``method`` from a drafter directory's models and the target's embedding/lm_head.

    Settings default to the bundle's ``tfm_config.json`` (top_k, width, children_per_node,
    treeflash_top_m); ``width`` when given and ``overrides`` (same keyword names as
    :class:`DFlashProposer`) win.
    """
    tfm = bundle.tfm
    kw = {}
    if tfm is not None:
        kw = dict(top_k=tfm.top_k, width=tfm.width, children_per_node=tfm.children_per_node, top_m=tfm.treeflash_top_m)
    if width is not None:
        kw["width"] = width
    kw.update(overrides)
    return DFlashProposer(
        method,
        bundle.dflash,
        target.get_input_embeddings(),
        target.get_output_embeddings(),
        gamma=gamma,
        weaver=bundle.weaver,
        treeflash=bundle.treeflash,
        proposal_bias=proposal_bias,
        **kw,
    )

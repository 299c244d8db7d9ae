"""Per-branch sequential verifier: the slow baseline and the oracle for the tree-verify forward.

Every root-to-leaf path of the tree runs through the unmodified `transformers` model as an
ordinary sequence continuation, starting from a deep copy of the HF cache of the committed prefix.
A node's logits come from the first path that contains it (every path through a node sees the same
ancestors, so any path gives the same logits up to kernel-level rounding). The commit feeds the
accepted root..node tokens to the model with the real cache, exactly like chain decoding.

Same interface as :class:`vllm_tfm.reference.target_tree.TreeTarget` (prefill / verify / commit),
with an :class:`HFState` (the HF cache itself) as the committed state.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vllm_tfm.tree.types import Tree

from .hf_compat import cache_kwarg, capture_final_hidden, capture_layer_outputs, check_supported, output_cache
from .target_tree import PrefillOutput

__all__ = ["HFState", "BranchVerifyOutput", "BranchVerifier"]


@dataclass
class HFState:
    """An HF cache after ``prefix_len`` processed tokens (batch 1)."""

    prefix_len: int
    cache: object

    def clone(self) -> "HFState":
        return HFState(self.prefix_len, copy.deepcopy(self.cache))


@dataclass
class BranchVerifyOutput:
    """``logits [n, V]``, ``final_hidden [n, H]`` and ``taps [n, n_tap * H]`` (None without taps)
    at every node."""

    logits: Tensor
    final_hidden: Tensor
    taps: Tensor | None


def leaves(tree: Tree) -> list[int]:
    """Nodes without children, in index order (the root alone is a leaf of a 1-node tree)."""
    par = tree.parents.tolist()
    has_child = [False] * len(par)
    for p in par[1:]:
        has_child[p] = True
    return [i for i, c in enumerate(has_child) if not c]


class BranchVerifier:
    """Verifies a tree one root-to-leaf path at a time with the HF model and copies of its cache."""

    def __init__(self, model: nn.Module, tap_layers: Sequence[int] = ()):
        check_supported(model)
        self.model = model
        self.tap_layers = tuple(int(i) for i in tap_layers)
        self._cache_kw = cache_kwarg(model)
        self.device = next(model.parameters()).device

    def _run(self, ids: Tensor, cache) -> tuple[Tensor, Tensor, Tensor | None, object]:
        """HF forward of ids [m] (continuing ``cache`` if given): logits [m, V], final [m, H], taps, cache."""
        with capture_layer_outputs(self.model, self.tap_layers) as cap, capture_final_hidden(self.model) as fin:
            kwargs = {self._cache_kw: cache} if cache is not None else {}
            out = self.model(input_ids=ids[None], use_cache=True, **kwargs)
        taps = torch.cat([cap[lid][0] for lid in self.tap_layers], dim=-1) if self.tap_layers else None
        return out.logits[0], fin["final"][0], taps, output_cache(out)

    @torch.no_grad()
    def prefill(self, input_ids: Tensor) -> tuple[HFState, PrefillOutput]:
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).view(-1)
        if ids.numel() == 0:
            raise ValueError("the prompt must hold at least one token")
        logits, final, taps, cache = self._run(ids, None)
        return HFState(int(ids.numel()), cache), PrefillOutput(logits[-1], final[-1], taps)

    @torch.no_grad()
    def verify(self, state: HFState, tree: Tree) -> BranchVerifyOutput:
        """Logits at every node: one HF forward per root-to-leaf path on a copy of the cache."""
        n = tree.num_nodes
        tokens = tree.tokens.to(self.device)
        logits: list[Tensor | None] = [None] * n
        finals: list[Tensor | None] = [None] * n
        taps: list[Tensor | None] = [None] * n
        for leaf in leaves(tree):
            path = tree.path(leaf)
            lg, fh, tp, _ = self._run(tokens[path], copy.deepcopy(state.cache))
            for j, node in enumerate(path):
                if logits[node] is None:
                    logits[node] = lg[j]
                    finals[node] = fh[j]
                    if tp is not None:
                        taps[node] = tp[j]
        tap_t = torch.stack(taps) if self.tap_layers else None
        return BranchVerifyOutput(torch.stack(logits), torch.stack(finals), tap_t)

    @torch.no_grad()
    def commit(self, state: HFState, tree: Tree, out: BranchVerifyOutput, accepted: int) -> list[int]:
        """Feed the root..``accepted`` tokens through the model with the real cache; returns the path."""
        n = tree.num_nodes
        if not 0 <= accepted < n:
            raise ValueError(f"accepted node {accepted} out of range for a tree of {n} nodes")
        path = tree.path(accepted)
        _, _, _, cache = self._run(tree.tokens.to(self.device)[path], state.cache)
        state.cache = cache
        state.prefix_len += len(path)
        return path

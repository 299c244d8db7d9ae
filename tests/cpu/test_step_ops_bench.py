"""bench/step_ops.py: a budget whose Weaver drafts are all chains is refused (the runtime takes vLLM's chain path
there, not the tree path the bench measures) unless the tree path is forced."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import step_ops


def test_chains_only_reason_names_the_budget_and_the_way_out():
    chains = torch.arange(-1, 8).repeat(2, 1)  # two requests, each a chain of 8 drafts
    reason = step_ops.chains_only_reason(chains, 8)
    assert reason is not None and reason.startswith("--budget 8: every request's Weaver draft is a chain")
    assert "depth min(block size - 1, B) = 8" in reason and "--force-tree-path" in reason
    one_tree = chains.clone()
    one_tree[1, 2] = 0  # request 1's second draft hangs off the root: a tree
    assert step_ops.chains_only_reason(one_tree, 8) is None


def test_budget_8_on_the_zoo_shapes_is_all_chains_and_9_is_not():
    # what made `bench/step_ops.py --budget 8` fail its tree-active assertion (bench/NOTES.md sections 55-56)
    _, p8 = step_ops.draft_trees(1, 8, 101)
    _, p9 = step_ops.draft_trees(1, 9, 101)
    assert step_ops.chains_only_reason(p8, 8) is not None
    assert step_ops.chains_only_reason(p9, 9) is None

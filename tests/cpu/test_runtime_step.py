"""Per-step tree metadata of the vLLM runtime: proposal lookup, batch layout, positions, drafter order.

Everything here is host/tensor bookkeeping that decides which rows see which rows; each test
compares against a direct construction written in the test (ancestors by walking parents, the
reordered rows by listing them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _trees import path_of, proposal_store, random_tree_parents
from vllm_tfm.vllm_plugin.runtime.drafter_inputs import dflash_context_order
from vllm_tfm.vllm_plugin.runtime.inputs import BIAS_PAD_ROWS, build_step_tree, tree_positions
from vllm_tfm.vllm_plugin.runtime.state import ProposalStore


def test_store_lookup_accepts_prefixes_only():
    store = proposal_store({"a": ([7, 8, 9], [-1, 0, 0, 1]), "b": ([1, 2, 3], [-1, 0, 1, 2])})
    full = store.lookup("a", [7, 8, 9])
    assert full is not None and full.parents.tolist() == [-1, 0, 0, 1] and not full.is_chain
    cut = store.lookup("a", [7, 8])  # the scheduler truncated the drafts
    assert cut.tokens == (7, 8) and cut.parents.tolist() == [-1, 0, 0]
    assert store.lookup("a", [7, 9]) is None  # not what was proposed
    assert store.lookup("a", [0, 0, 0]) is None  # zeroed drafts
    assert store.lookup("zz", [1]) is None
    assert store.lookup("b", [1, 2, 3]).is_chain
    store.retain({"b"})
    assert store.lookup("a", [7, 8, 9]) is None and store.lookup("b", [1]) is not None


def brute_ancestor(parents: list[int], i: int, j: int) -> bool:
    return j in path_of(torch.tensor(parents), i)


def test_build_step_tree_lays_out_a_mixed_batch():
    tree = [-1, 0, 0, 1, 1, 2]  # 5 drafts
    store = proposal_store({
        "tree": ([11, 12, 13, 14, 15], tree),
        "chain": ([21, 22, 23, 24, 25], [-1, 0, 1, 2, 3, 4]),
        "stale": ([31, 32, 33, 34, 35], tree),
    })
    req_ids = ["prefill", "tree", "chain", "stale", "nodraft"]
    num_sched = np.array([4, 6, 6, 6, 1])
    spec = {"tree": [11, 12, 13, 14, 15], "chain": [21, 22, 23, 24, 25], "stale": [0, 0, 0, 0, 0], "nodraft": []}
    step = build_step_tree(req_ids, num_sched, spec, store, allow_trees=True)
    assert step.tree_active
    assert step.is_spec.tolist() == [False, True, True, True, True]
    assert step.is_tree.tolist() == [False, True, False, False, False]
    assert step.num_draft.tolist() == [0, 5, 5, 5, 0]
    chain = lambda n: list(range(-1, n - 1))  # noqa: E731
    assert step.local_parent.tolist() == chain(4) + tree + chain(6) + chain(6) + chain(1)
    assert step.depth.tolist() == [0, 1, 2, 3] + [0, 1, 1, 2, 2, 2] + list(range(6)) * 2 + [0]
    # logits rows: the prefill has one (its last), the others all of theirs
    assert step.sample_cu.tolist() == [0, 1, 7, 13, 19, 20]
    assert step.sample_parents.tolist() == [-1] + tree + chain(6) + chain(6) + [-1]
    assert step.row_base.tolist() == [3, 4, 10, 16, 22]
    # the GDN's spec subset: every decode-shaped request, in batch order
    assert step.spec_req_index.tolist() == [1, 2, 3, 4]
    assert step.spec_cu.tolist() == [0, 6, 12, 18, 19]
    assert step.spec_parents.tolist() == tree + chain(6) + chain(6) + [-1]
    # attention plan: one masked request, its bitmask rows exactly its ancestor-or-self sets
    plan = step.attn_plan
    assert plan.tree_req.tolist() == [1] and plan.tree_start.tolist() == [4] and plan.tree_size.tolist() == [6]
    assert [[bool((int(plan.bits[i, 0]) >> j) & 1) for j in range(6)] for i in range(6)] == [
        [brute_ancestor(tree, i, j) for j in range(6)] for i in range(6)]
    assert plan.meta.tolist() == [1, 4, 6, 0]
    # the fallback's per-request form: bias 0 exactly on ancestor-or-self pairs
    (t,) = step.attn_trees
    assert (t.req_index, t.start, t.n) == (1, 4, 6)
    expect = torch.tensor([[0.0 if brute_ancestor(tree, i, j) else float("-inf") for j in range(6)] for i in range(6)])
    assert torch.equal(t.bias[:6], expect) and t.cu_q.tolist() == [0, 6]
    # rows past n are zero padding for the kernel's last query tile, row stride stays n
    assert t.bias.shape == (6 + BIAS_PAD_ROWS, 6) and t.bias.stride(0) == 6 and not t.bias[6:].any()


def test_a_decode_row_without_drafts_is_not_a_spec_row_when_others_verify_trees():
    """vLLM 0.26 marks a row as a spec decode only when the scheduler put it in
    ``scheduled_spec_decode_tokens`` (gpu_model_runner.py:2226-2235, ``num_decode_draft_tokens``
    -1 otherwise); a running request that got a single token (the step's token budget ran out on
    it) is absent there and goes through the GDN's non-spec path. The tree metadata must count
    the same spec rows, or the GDN tree verify sees a different number of spec requests than vLLM
    and the step fails."""
    tree = [-1, 0, 0, 1]
    store = proposal_store({"tree": ([11, 12, 13], tree), "short": ([21, 22, 23], tree)})
    req_ids = ["tree", "short", "tail"]
    spec = {"tree": [11, 12, 13], "short": [21]}  # "short": budget cut to 2 tokens; "tail": 1 token, no drafts
    step = build_step_tree(req_ids, np.array([4, 2, 1]), spec, store, allow_trees=True)
    # what vLLM's GDN metadata builder counts as spec rows: in the dict and num_scheduled == drafts + 1
    vllm_spec = [rid in spec and n == len(spec[rid]) + 1 for rid, n in zip(req_ids, [4, 2, 1])]
    assert step.is_spec.tolist() == vllm_spec == [True, True, False]
    assert step.spec_req_index.tolist() == [0, 1] and step.spec_cu.tolist() == [0, 4, 6]
    assert step.num_spec_tokens == 6 and step.spec_parents.tolist() == tree + [-1, 0]
    assert step.sample_cu.tolist() == [0, 4, 6, 7]  # the tail row still has its one logits row
    assert step.tree_active and step.is_tree.tolist() == [True, False, False]


def test_build_step_tree_without_trees():
    store = proposal_store({"tree": ([11, 12], [-1, 0, 0])})
    spec = {"tree": [11, 12]}
    step = build_step_tree(["tree"], np.array([3]), spec, store, allow_trees=False)
    assert not step.tree_active and not step.is_tree.any() and step.attn_trees == []
    assert step.local_parent.tolist() == [-1, 0, 1]  # read as a chain
    chain_store = proposal_store({"c": ([1, 2], [-1, 0, 1])})
    step = build_step_tree(["c"], np.array([3]), {"c": [1, 2]}, chain_store, allow_trees=True)
    assert not step.tree_active
    step = build_step_tree(["c"], np.array([3]), {"c": [1, 2]}, chain_store, allow_trees=True, force_tree_path=True)
    assert step.tree_active and step.attn_trees == [] and step.attn_plan is None  # chains need no mask
    with pytest.raises(ValueError, match=r"num_scheduled must have shape \[1\]"):
        build_step_tree(["c"], np.array([3, 1]), {}, chain_store, allow_trees=True)


def test_attention_plan_covers_every_tree_request_in_batch_order():
    gen = torch.Generator().manual_seed(5)
    trees = {f"t{k}": random_tree_parents(n, gen, kind).tolist()
             for k, (n, kind) in enumerate([(9, "random"), (70, "deep"), (5, "star")])}
    store = ProposalStore()
    for k, (rid, p) in enumerate(trees.items()):  # proposals of different sizes: one put each
        store.put([rid], torch.tensor([list(range(10 * k, 10 * k + len(p) - 1))]), torch.tensor([p]))
    req_ids = ["t0", "pre", "t1", "t2"]
    num_sched = np.array([9, 3, 70, 5])
    spec = {rid: list(range(10 * k, 10 * k + len(p) - 1)) for k, (rid, p) in enumerate(trees.items())}
    step = build_step_tree(req_ids, num_sched, spec, store, allow_trees=True)
    plan = step.attn_plan
    assert plan.tree_req.tolist() == [0, 2, 3] and plan.tree_start.tolist() == [0, 12, 82]
    assert plan.tree_size.tolist() == [9, 70, 5] and plan.words == 2
    row = 0
    for rid in ("t0", "t1", "t2"):
        par = trees[rid]
        for i in range(len(par)):
            for j in range(128):
                assert bool((int(plan.bits[row, j // 64]) >> (j % 64)) & 1) == (j < len(par) and brute_ancestor(par, i, j))
            row += 1
    assert [t.start for t in step.attn_trees] == [0, 12, 82]  # the fallback form agrees


def test_tree_positions_are_root_position_plus_depth():
    # two requests: a prefill at positions 10..12 and a tree whose root sits at position 40
    positions = torch.tensor([10, 11, 12, 40, 41, 42, 43, 44])
    qs = torch.tensor([0, 3, 8])
    req = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    depth = torch.tensor([0, 1, 2, 0, 1, 1, 2, 1])
    assert tree_positions(positions, qs, req, depth).tolist() == [10, 11, 12, 40, 41, 41, 42, 41]
    mrope = torch.stack([positions, positions + 5, positions + 9])  # text rows of an M-RoPE model
    out = tree_positions(mrope, qs, req, depth)
    assert out.tolist() == [[10, 11, 12, 40, 41, 41, 42, 41], [15, 16, 17, 45, 46, 46, 47, 46], [19, 20, 21, 49, 50, 50, 51, 50]]


def test_dflash_context_order_puts_root_and_path_first():
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        sizes = torch.randint(1, 9, (4,), generator=gen).tolist()
        extra = [int(torch.randint(0, 3, (1,), generator=gen)) if s == 1 else 0 for s in sizes]  # prefill rows
        rows_per_req = [s + e for s, e in zip(sizes, extra)]
        starts = np.concatenate([[0], np.cumsum(rows_per_req)])
        dmax = max(sizes)
        accepted = torch.full((4, max(dmax - 1, 1)), -1, dtype=torch.long)
        expected = []
        for r, (n, e) in enumerate(zip(sizes, extra)):
            parents = random_tree_parents(n, gen, "random")
            last = int(torch.randint(0, n, (1,), generator=gen))
            path = path_of(parents, last)[1:]
            accepted[r, : len(path)] = torch.tensor(path, dtype=torch.long)
            base = int(starts[r]) + e
            rest = [j for j in range(1, n) if j not in path]
            expected += list(range(int(starts[r]), base)) + [base] + [base + j for j in path] + [base + j for j in rest]
        req_index = torch.repeat_interleave(torch.arange(4), torch.tensor(rows_per_req))
        row_base = torch.tensor(starts[:-1]) + torch.tensor(extra)
        perm = dflash_context_order(req_index, row_base, torch.tensor(rows_per_req), accepted)
        assert perm.tolist() == expected


def test_settings_from_options_bound_depth_by_the_block_and_switch_proposals():
    from vllm_tfm.models.tfm_config import TfmConfig
    from vllm_tfm.vllm_plugin.runtime.settings import set_proposal_override, settings_from_options

    s = settings_from_options(TfmConfig(proposal="ddtree"), "/d", 64, {"block_size": 16})
    assert (s.proposal, s.budget, s.max_depth, s.width) == ("ddtree", 64, 15, 4)
    assert settings_from_options(TfmConfig(proposal="chain"), None, 7, {}).max_depth == 7
    try:
        set_proposal_override("chain")
        assert s.current().proposal == "chain" and s.proposal == "ddtree"
    finally:
        set_proposal_override(None)
    assert s.current() is s
    with pytest.raises(ValueError, match="unknown tfm proposal 'beam'"):
        set_proposal_override("beam")
    with pytest.raises(ValueError, match="block_size must be an integer >= 2"):
        settings_from_options(TfmConfig(proposal="chain"), None, 7, {"block_size": 1})


def test_kernels_env_switch_forces_the_references(monkeypatch):
    from vllm_tfm.vllm_plugin.runtime import kernels_or_reference as kor

    monkeypatch.setitem(kor._STATE, "ops", None)
    monkeypatch.setitem(kor._STATE, "enabled", None)  # not decided yet: the environment decides
    monkeypatch.setenv("VLLM_TFM_KERNELS", "0")
    assert not kor.kernels_enabled()
    assert set(kor.kernels_in_use().values()) == {"reference"}
    monkeypatch.setitem(kor._STATE, "enabled", None)
    monkeypatch.setenv("VLLM_TFM_KERNELS", "1")
    assert kor.kernels_enabled()
    kor.set_kernels_enabled(False)  # an explicit call wins over the environment
    assert not kor.kernels_enabled()

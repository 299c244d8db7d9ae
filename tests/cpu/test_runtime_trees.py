"""Batched tree builders of the vLLM runtime against the reference builders of vllm_tfm.tree.

The runtime builds all requests' trees at once on the device (no heap, no host loop); the
reference builders are per-request Python. Same tokens, same parents, same node order is the
contract (a tree built differently on two tensor-parallel ranks, or differently from the
reference decoder, would be a bug)."""

from __future__ import annotations

import pytest
import torch

from vllm_tfm.models.tfm_config import WeaverConfig
from vllm_tfm.models.weaver import Weaver
from vllm_tfm.tree import build_chain, build_ddtree, build_weaver
from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import chain_trees, ddtree_trees, fill_to_budget, weaver_trees

NEG = float("-inf")


def check_against_reference(lp: torch.Tensor, budget: int) -> None:
    tok, par, n = ddtree_trees(lp, budget)
    assert tok.shape == (lp.shape[0], budget) and par.shape == (lp.shape[0], budget + 1)
    for r in range(lp.shape[0]):
        ref = build_ddtree(0, lp[r], budget, lp.shape[1])
        k = int(n[r])
        assert k == ref.num_nodes
        assert tok[r, : k - 1].tolist() == ref.tokens[1:].tolist()
        assert par[r, :k].tolist() == ref.parents.tolist()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ddtree_matches_reference_on_random_marginals(dtype):
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        d = int(torch.randint(1, 5, (1,), generator=gen))
        v = int(torch.randint(2, 12, (1,), generator=gen))
        b = int(torch.randint(1, 12, (1,), generator=gen))
        lp = torch.log_softmax(2 * torch.randn(3, d, v, generator=gen, dtype=torch.float64), -1).to(dtype)
        check_against_reference(lp, b)


def test_ddtree_breaks_ties_like_the_reference():
    """Equal probabilities (ties between siblings, between depths, and exact 0 log-probs)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(80):
        d = int(torch.randint(1, 5, (1,), generator=gen))
        v = int(torch.randint(2, 7, (1,), generator=gen))
        b = int(torch.randint(1, 12, (1,), generator=gen))
        w = torch.randint(0, 3, (2, d, v), generator=gen).double()
        w[..., 0] += 1  # at least one token with positive probability per depth
        check_against_reference(torch.log(w / w.sum(-1, keepdim=True)), b)


def test_ddtree_never_drafts_zero_probability_tokens_and_completes_the_budget():
    # depth 1 has two possible tokens, depth 2 one: only 2 + 2 prefixes exist
    lp = torch.full((1, 2, 5), NEG, dtype=torch.float64)
    lp[0, 0, 3], lp[0, 0, 1] = torch.tensor(0.7).log(), torch.tensor(0.3).log()
    lp[0, 1, 4] = 0.0
    tok, par, n = ddtree_trees(lp, 7)
    assert int(n[0]) == 5  # root + (3), (3,4), (1), (1,4)
    assert tok[0, :4].tolist() == [3, 4, 1, 4]
    assert par[0, :5].tolist() == [-1, 0, 1, 0, 3]
    # completion: a chain of fillers (the best depth-1 token) under the last real node
    assert tok[0, 4:].tolist() == [3, 3, 3]
    assert par[0, 5:].tolist() == [4, 5, 6]


def test_chain_matches_reference_and_extends_short_chains():
    gen = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(torch.randn(4, 6, 9, generator=gen, dtype=torch.float64), -1)
    tok, par = chain_trees(lp, 4)  # D = 6 >= B = 4
    for r in range(4):
        ref = build_chain(0, lp[r], 4, 6)
        assert tok[r].tolist() == ref.tokens[1:].tolist()
        assert par[r].tolist() == ref.parents.tolist()
    tok, par = chain_trees(lp, 9)  # D = 6 < B = 9: the chain continues with the last depth's argmax
    assert par.tolist() == [list(range(-1, 9))] * 4
    top = lp.argmax(-1)
    assert tok[:, :6].tolist() == top.tolist()
    assert tok[:, 6:].tolist() == top[:, 5:6].expand(4, 3).tolist()


def test_fill_to_budget_keeps_real_nodes_and_appends_a_chain():
    tokens = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]])
    t, p = fill_to_budget(tokens, parents, torch.tensor([3, 5]), torch.tensor([9, 9]))
    assert t.tolist() == [[5, 6, 9, 9], [1, 2, 3, 4]]
    assert p.tolist() == [[-1, 0, 0, 2, 3], [-1, 0, 1, 2, 3]]


def test_weaver_trees_equal_build_weaver_per_request():
    torch.manual_seed(0)
    cfg = WeaverConfig(d_model=16, d_rank=8, n_layers=1, n_heads=2, d_mlp=12, max_depth=3)
    weaver = Weaver(cfg).double().eval()
    gen = torch.Generator().manual_seed(3)
    vocab, depth, r = 20, 3, 2
    embed = torch.randn(vocab, 16, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(vocab, 16, generator=gen, dtype=torch.float64)
    logits = torch.randn(r, depth, vocab, generator=gen, dtype=torch.float64)
    dflash_hidden = torch.randn(r, depth, 16, generator=gen, dtype=torch.float64)
    verifier = torch.randn(r, 16, generator=gen, dtype=torch.float64)
    roots = torch.tensor([4, 11])
    tok, par = weaver_trees(weaver, logits, dflash_hidden, verifier, roots, embed, lm_head,
                            budget=6, top_k=5, width=2, children_per_node=3)
    cand_logits, cand_ids = torch.topk(logits.float(), 5, dim=-1)
    for i in range(r):
        scorer = weaver.tree_scorer(verifier[i], dflash_hidden[i], cand_ids[i], cand_logits[i].double(), embed, lm_head)
        ref = build_weaver(int(roots[i]), cand_ids[i], scorer, 6, depth, 2, 3)
        n = ref.num_nodes
        assert tok[i, : n - 1].tolist() == ref.tokens[1:].tolist()
        assert par[i, :n].tolist() == ref.parents.tolist()


def previous_weaver_trees(weaver, logits, dflash_hidden, verifier, roots, embed, lm_head, budget, top_k, width, cpn):
    """The runtime's former per-request loop, written out: build_weaver per request with its own
    WeaverTreeScorer, then missing nodes as a chain of the best depth-1 candidate."""
    r, depth, _ = logits.shape
    cand_logits, cand_ids = torch.topk(logits.float(), min(top_k, logits.shape[-1]), dim=-1)
    tokens, parents = [], []
    for i in range(r):
        scorer = weaver.tree_scorer(verifier[i], dflash_hidden[i], cand_ids[i], cand_logits[i].to(dflash_hidden.dtype),
                                    embed, lm_head)
        tree = build_weaver(int(roots[i]), cand_ids[i], scorer, budget, depth, width, cpn)
        n = tree.num_nodes
        filler = int(cand_ids[i, 0, 0])
        tokens.append(tree.tokens[1:].tolist() + [filler] * (budget + 1 - n))
        parents.append(tree.parents.tolist() + list(range(n - 1, budget)))
    return tokens, parents


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_weaver_trees_equal_the_per_request_loop_over_many_settings(dtype):
    cfg = WeaverConfig(d_model=16, d_rank=8, n_layers=2, n_heads=2, d_mlp=12, max_depth=5)
    gen = torch.Generator().manual_seed(11)
    vocab, r = 40, 5
    for case, (depth, budget, top_k, width, cpn) in enumerate(
        [(5, 17, 8, 2, 3), (3, 6, 2, 4, 1), (4, 1, 5, 1, 8), (5, 30, 40, 3, 8), (2, 12, 3, 2, 2), (5, 9, 1, 1, 1)]
    ):
        torch.manual_seed(case)
        weaver = Weaver(cfg).to(dtype).eval()
        embed = torch.randn(vocab, 16, generator=gen, dtype=torch.float64).to(dtype)
        lm_head = torch.randn(vocab, 16, generator=gen, dtype=torch.float64).to(dtype)
        logits = torch.randn(r, depth, vocab, generator=gen, dtype=torch.float64).to(dtype) * 3
        dflash_hidden = torch.randn(r, depth, 16, generator=gen, dtype=torch.float64).to(dtype)
        verifier = torch.randn(r, 16, generator=gen, dtype=torch.float64).to(dtype)
        roots = torch.randint(0, vocab, (r,), generator=gen)
        tok, par = weaver_trees(weaver, logits, dflash_hidden, verifier, roots, embed, lm_head,
                                budget=budget, top_k=top_k, width=width, children_per_node=cpn)
        want_tok, want_par = previous_weaver_trees(weaver, logits, dflash_hidden, verifier, roots, embed, lm_head,
                                                   budget, top_k, width, cpn)
        assert tok.tolist() == want_tok, f"case {case}"
        assert par.tolist() == want_par, f"case {case}"


def test_ddtree_on_a_large_vocabulary_with_ties_matches_the_reference():
    """V = 3000 > 4 * B takes ranked_top's topk path (no full-row sort); logits rounded to a
    coarse grid make many exact ties, which must still break toward the lower token id."""
    gen = torch.Generator().manual_seed(5)
    for budget in (5, 31):
        logits = torch.round(4 * torch.randn(2, 3, 3000, generator=gen)) / 4
        check_against_reference(torch.log_softmax(logits, -1), budget)


def test_treeflash_trees_equal_build_treeflash_per_request():
    """The proposer's TreeFlash trees (pre-norm stream of depths 1..D, no root slot) against the
    per-request reference builder with the per-request scorer on the full block, for a batch of
    requests whose trees fill the budget and requests whose restricted graph is smaller (filled)."""
    from vllm_tfm.models import TreeFlashApproximator, TreeFlashConfig, TreeFlashTransitionScorer
    from vllm_tfm.models.common import RMSNorm
    from vllm_tfm.tree import build_treeflash
    from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import treeflash_trees

    from _models import randomize

    hid, vocab, r = 16, 24, 5
    approx = randomize(TreeFlashApproximator(TreeFlashConfig(hidden_size=hid, intermediate_size=12)), seed=4).double().eval()
    norm = randomize(RMSNorm(hid), seed=5).double()
    gen = torch.Generator().manual_seed(6)
    embed = torch.randn(vocab, hid, generator=gen, dtype=torch.float64)
    head = torch.randn(vocab, hid, generator=gen, dtype=torch.float64)
    for depth, budget, top_m in [(4, 9, 3), (3, 20, 2), (1, 5, 4), (5, 12, 16)]:
        block = torch.randn(r, 1 + depth, hid, generator=gen, dtype=torch.float64)  # slot 0: the root's, unread
        with torch.no_grad():
            logits = norm(block[:, 1:]) @ head.T
        logits[1, 0] = 0.0  # exact ties at depth 1 of request 1 (broken by token id, as the reference)
        roots = torch.randint(0, vocab, (r,), generator=gen)
        tok, par = treeflash_trees(approx, norm, block[:, 1:], logits, roots, embed, head, budget, top_m)
        assert tok.shape == (r, budget) and par.shape == (r, budget + 1)
        lp = torch.log_softmax(logits, -1)
        for i in range(r):
            scorer = TreeFlashTransitionScorer(approx, norm, block[i], embed, head)
            ref = build_treeflash(int(roots[i]), lp[i], scorer, budget, depth, top_m)
            n = ref.num_nodes
            assert tok[i, : n - 1].tolist() == ref.tokens[1:].tolist()
            assert par[i, :n].tolist() == ref.parents.tolist()
            # a smaller tree is completed by a chain of the best depth-1 marginal token under its last node
            assert par[i, n:].tolist() == list(range(n - 1, budget))
            assert tok[i, n - 1 :].tolist() == [int(lp[i, 0].argmax())] * (budget - n + 1)


def test_treeflash_trees_refuse_a_prenorm_stream_of_the_wrong_shape():
    from vllm_tfm.models import TreeFlashApproximator, TreeFlashConfig
    from vllm_tfm.models.common import RMSNorm
    from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import treeflash_trees

    approx = TreeFlashApproximator(TreeFlashConfig(hidden_size=8, intermediate_size=4)).eval()
    logits = torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match=r"dflash_prenorm must be \[R=2, D=3, H\], got \(2, 4, 8\)"):
        treeflash_trees(approx, RMSNorm(8), torch.randn(2, 4, 8), logits, torch.tensor([1, 2]), torch.randn(10, 8),
                        torch.randn(10, 8), 4, 2)

"""Acceptance by replay (vllm_tfm.reference.replay) against the speculative decoder itself.

* Greedy: for every method and budget, the replay's accepted count of every step of every prompt
  equals what SpeculativeDecoder (tree verify with the target) records, with a drafter made to
  propose the target's continuation at some depths and noise elsewhere (so acceptance varies
  between 0 and the full depth from step to step).
* ``accepted_depth`` against hand-built trees (siblings, a match below a mismatch, short rows).
* Sampled continuations follow the target's distribution (chi-square of the first sampled token
  over many seeds against the target's softmax; a wrong temperature is rejected by the same test).
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_tfm.reference.decoder import SamplingConfig, SpeculativeDecoder
from vllm_tfm.reference.drafters import METHODS, DraftInputs, make_proposer
from vllm_tfm.reference.replay import accepted_depth, replay_cells, target_continuations
from vllm_tfm.reference.toy_drafters import random_drafters
from vllm_tfm.reference.toy_targets import tiny_qwen3_5
from vllm_tfm.tree.types import Tree

GAMMA, PROMPT_LEN, NEW = 5, 6, 12


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen3_5(seed=41)
    return target, random_drafters(target, seed=42, block_size=8)


def greedy_continuation(target, tokens: list[int], n: int) -> list[int]:
    out = target.generate(torch.tensor([tokens]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def flaky_oracle_bias(target, seed: int):
    """Boost the target's greedy continuation at a pseudo-random subset of depths (a function of the
    position, so decoder and replay see the same proposal), and a random token elsewhere."""

    def bias(inputs: DraftInputs, max_depth: int) -> torch.Tensor:
        cont = greedy_continuation(target, inputs.tokens.tolist(), max_depth)
        g = torch.Generator().manual_seed(seed * 1000 + inputs.position)
        b = torch.zeros(max_depth, target.config.vocab_size)
        keep = torch.rand(max_depth, generator=g) < 0.7
        noise = torch.randint(0, target.config.vocab_size, (max_depth,), generator=g)
        tok = torch.where(keep, torch.tensor(cont), noise)
        b[torch.arange(max_depth), tok] = 60.0
        return b

    return bias


def test_greedy_replay_equals_the_decoder_step_by_step(models):
    target, bundle = models
    gen = torch.Generator().manual_seed(7)
    windows = torch.randint(3, target.config.vocab_size, (3, PROMPT_LEN), generator=gen).tolist()
    bias = flaky_oracle_bias(target, seed=3)
    budgets = (3, 9)
    cells = replay_cells(target, bundle, windows, PROMPT_LEN, METHODS, budgets, (0.0,), NEW, gamma=GAMMA, proposal_bias=bias)
    assert [(c["method"], c["budget"]) for c in cells] == [(m, b) for m in METHODS for b in budgets]
    seen_depths = set()
    for cell in cells:
        proposer = make_proposer(cell["method"], bundle, target, gamma=GAMMA, proposal_bias=bias)
        dec = SpeculativeDecoder(target, proposer, cell["budget"])
        want = []
        for w in windows:
            res = dec.generate(w, NEW, sampling=SamplingConfig(temperature=0.0))
            want.append([s.accepted for s in res.steps])
        assert cell["accepted_per_step"] == want, (cell["method"], cell["budget"])
        flat = [a for per in want for a in per]
        assert cell["mal"] == pytest.approx(sum(a + 1 for a in flat) / len(flat))
        seen_depths.update(flat)
    assert 0 in seen_depths and GAMMA - 1 in seen_depths  # the comparison covers rejections and full paths


def test_accepted_depth_on_hand_built_trees():
    # root 0 -> (1: 5), (2: 6); 1 -> (3: 7); 2 -> (4: 8); 3 -> (5: 9)
    tree = Tree.from_parents(torch.tensor([4, 5, 6, 7, 8, 9]), torch.tensor([-1, 0, 0, 1, 2, 3]))
    assert accepted_depth(tree, [5, 7, 9]) == 3
    assert accepted_depth(tree, [5, 7, 1]) == 2
    assert accepted_depth(tree, [6, 8, 9]) == 2
    assert accepted_depth(tree, [6, 7, 9]) == 1  # 7 sits below 5, not below 6
    assert accepted_depth(tree, [1, 7, 9]) == 0
    assert accepted_depth(tree, [5]) == 1  # a continuation row shorter than the tree
    assert accepted_depth(Tree.from_parents(torch.tensor([4]), torch.tensor([-1])), [5, 7]) == 0


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square, cells with expected count < 5 pooled (Wilson-Hilferty)."""
    n = counts.sum().item()
    exp = probs * n
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    ex = torch.cat([exp[~small], exp[small].sum()[None]])
    stat = (((obs - ex) ** 2) / ex.clamp_min(1e-12)).sum().item()
    k = obs.numel() - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_continuations_follow_the_target_distribution(models):
    target, _ = models
    prompt = [5, 9, 11, 3]
    n = 1500
    first = target_continuations(target, [prompt] * n, 1, temperature=1.0, seed=11, batch_size=n)[:, -1]
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    counts = torch.bincount(first, minlength=logits.numel()).double()
    assert _chi_square_p(counts, torch.softmax(logits, -1)) > 1e-3
    # the same check rejects the wrong distribution (temperature 0.5 instead of 1)
    assert _chi_square_p(counts, torch.softmax(logits / 0.5, -1)) < 1e-6
    # greedy continuations equal transformers' generate
    ids = target_continuations(target, [prompt, [7, 7, 2, 1]], 6, temperature=0.0, seed=0)
    assert ids[0, 4:].tolist() == greedy_continuation(target, prompt, 6)
    assert ids[1, 4:].tolist() == greedy_continuation(target, [7, 7, 2, 1], 6)


@pytest.mark.parametrize("method", METHODS)
def test_batched_trees_equal_the_per_anchor_trees(models, method):
    """The lockstep builders give every anchor the tree DFlashProposer.tree_from_block builds."""
    from vllm_tfm.reference.replay import (
        accepted_depths_padded,
        batched_trees,
        target_states,
    )

    target, bundle = models
    gen = torch.Generator().manual_seed(17)
    ids = torch.randint(3, target.config.vocab_size, (2, 30), generator=gen)
    final, taps = target_states(target, ids, bundle.dflash.config.target_layer_ids)
    for budget in (1, 5, 23):
        proposer = make_proposer(method, bundle, target, gamma=GAMMA)
        drafter = proposer.drafter
        anchors = [(0, 7), (1, 12), (0, 20), (1, 25)]
        ctx_all = [drafter.context_kv(taps[i], torch.arange(ids.shape[1])) for i in range(2)]
        prenorms, want, conts = [], [], []
        for i, a in anchors:
            proposer._ctx_kv = [(k[:a], v[:a]) for k, v in ctx_all[i]]
            x = DraftInputs(root=int(ids[i, a]), position=a, verifier_hidden=final[i, a - 1], tokens=ids[i, : a + 1])
            want.append(proposer.propose(x, budget))
            block = drafter.block_tokens(ids[i, a : a + 1])[:, :GAMMA]
            cu = torch.tensor([0, a])
            prenorms.append(drafter.forward_batch_prenorm(proposer._ctx_kv, cu, block, torch.arange(a, a + GAMMA)[None], proposer.embed)[0])
            conts.append(ids[i, a + 1 : a + GAMMA])
        roots = torch.tensor([int(ids[i, a]) for i, a in anchors])
        vh = torch.stack([final[i, a - 1] for i, a in anchors])
        tokens, parents, num_nodes = batched_trees(proposer, torch.stack(prenorms), roots, vh, budget)
        for r, tree in enumerate(want):
            n = int(num_nodes[r])
            assert n == tree.num_nodes, (method, budget, r)
            assert tokens[r, :n].tolist() == tree.tokens.tolist(), (method, budget, r)
            assert parents[r, :n].tolist() == tree.parents.tolist(), (method, budget, r)
        # the padded acceptance walk equals the per-tree walk on a continuation that follows each
        # tree's last node (so every tree has a deep accepted path)
        cont = torch.zeros(len(want), GAMMA - 1, dtype=torch.long)
        for r, tree in enumerate(want):
            j = tree.num_nodes - 1
            path = []
            while j > 0:
                path.append(int(tree.tokens[j]))
                j = int(tree.parents[j])
            cont[r, : len(path)] = torch.tensor(path[::-1])
        got = accepted_depths_padded(tokens, parents, num_nodes, cont).tolist()
        assert got == [accepted_depth(t, cont[r].tolist()) for r, t in enumerate(want)]
        assert max(got) >= 1

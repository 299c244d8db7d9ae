"""Acceptance profiles and their replay (benchmarks): distributions, the vLLM chain mapping, trees.

The replayed accepted-length distribution must be the profile's (exactly on a uniform grid, and
by a chi-square test on seeded draws); the map to vLLM's ``synthetic_acceptance_rates`` must
give a chain whose accepted-length law (through vLLM's own conversion to conditional rates) is
the profile's; spine-first marginals must give trees deep enough for every draw.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from _trees import path_of, random_tree_parents

from vllm_tfm.tree.types import TreeBatch
from vllm_tfm.verify.acceptance_profile import (
    AcceptanceProfile,
    ProfileEntry,
    acceptance_by_depth,
    builtin_geometric_profile,
    chain_pmf_from_conditional_rates,
    geometric_pmf,
    load_profile,
    mean_accepted_length,
    pmf_from_counts,
    profile_from_eval,
    resize_pmf,
    save_profile,
    synthetic_acceptance_rates,
)
from vllm_tfm.verify.acceptance_replay import (
    deepest_nodes,
    draw_accepted,
    geometric_rank_ratio,
    pmf_cdf,
    replay_accept,
    spine_first_logits,
    spine_is_first,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from chisquare import chi2_sf  # noqa: E402

PMF = [0.10, 0.05, 0.20, 0.0, 0.15, 0.30, 0.20]  # D = 6, a zero in the middle, mass at the end


# ------------------------------------------------------------------ profiles


def test_pmf_helpers_by_hand() -> None:
    assert pmf_from_counts([0, 2, 2, 1, 2], 3) == [0.2, 0.2, 0.6, 0.0]
    with pytest.raises(ValueError, match="outside 0..3"):
        pmf_from_counts([4], 3)
    g = geometric_pmf(0.5, 3)
    assert g == [0.5, 0.25, 0.125, 0.125]
    assert acceptance_by_depth(g) == [0.5, 0.25, 0.125]
    assert mean_accepted_length(g) == 1 + 0.25 + 2 * 0.125 + 3 * 0.125
    assert resize_pmf(PMF, 3) == pytest.approx([0.10, 0.05, 0.20, 0.65])
    assert resize_pmf([0.5, 0.5], 3) == [0.5, 0.5, 0.0, 0.0]


def test_profile_entry_refuses_bad_pmfs() -> None:
    with pytest.raises(ValueError, match="must sum to 1"):
        ProfileEntry(method="tfm", budget=4, temperature=0.0, accepted_pmf=[0.5, 0.4])
    with pytest.raises(ValueError, match="finite and >= 0"):
        ProfileEntry(method="tfm", budget=4, temperature=0.0, accepted_pmf=[1.5, -0.5])


def eval_results() -> dict:
    """A `vllm-tfm eval` results file in the shape evaluate() writes (two prompts per cell)."""
    cell = lambda m, b, t, per: {"method": m, "budget": b, "temperature": t, "max_depth": 3, "mal": 0.0,  # noqa: E731
                                 "acceptance_by_depth": [], "accepted_per_step": per, "tree_nodes_per_step": []}
    return {"models": "zoo", "acceptance": [
        cell("chain", 16, 0.0, [[3, 0], [1, 1]]),
        cell("chain", 64, 0.0, [[3, 3], [3, 3]]),
        cell("tfm", 16, 0.0, [[2, 3, 3], [0]]),
        cell("tfm", 16, 1.0, [[1], [1, 2, 2]]),
    ]}


def test_profile_from_eval_and_selection(tmp_path: Path) -> None:
    prof = profile_from_eval(eval_results(), "acc.json")
    assert prof.measured and len(prof.entries) == 4
    tfm0 = prof.select("tfm", 16, 0.0)
    assert tfm0.accepted_pmf == [0.25, 0.0, 0.25, 0.5] and tfm0.steps == 4
    with pytest.raises(ValueError, match=r"has 2 entries for tfm B=16 \(tfm B=16 T=0, tfm B=16 T=1\): name the temperature"):
        prof.select("tfm", 16)
    with pytest.raises(ValueError, match=r"has no entry for tfm B=64 \(it has: chain B=16 T=0, chain B=64 T=0"):
        prof.select("tfm", 64)
    # the chain of 15 drafts: the smallest budget whose cell drafts that deep, else the deepest
    assert prof.select_chain(3).budget == 16
    assert prof.select_chain(15).budget in (16, 64)
    # files: eval results and profile JSON both load; random-model results are labelled
    (tmp_path / "eval.json").write_text(json.dumps({**eval_results(), "models": "random"}))
    loaded = load_profile(tmp_path / "eval.json")
    assert not loaded.measured and "RANDOM" in loaded.source
    save_profile(prof, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == prof
    # a gzip-compressed profile (how superseded profiles are stored in bench/results) loads the same
    (tmp_path / "p.json.gz").write_bytes(gzip.compress((tmp_path / "p.json").read_bytes()))
    assert load_profile(tmp_path / "p.json.gz") == prof
    (tmp_path / "plain.json.gz").write_bytes((tmp_path / "p.json").read_bytes())  # named .gz, not compressed
    with pytest.raises(ValueError, match=r"plain.json.gz: cannot read JSON \(Not a gzipped file"):
        load_profile(tmp_path / "plain.json.gz")
    with pytest.raises(ValueError, match="no such file"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "vllm-tfm-acceptance-profile/1", "source": "x",
                                                   "measured": True, "entries": []}))
    with pytest.raises(ValueError, match=r"bad.json: entries: List should have at least 1 item"):
        load_profile(tmp_path / "bad.json")


def test_builtin_profile_is_labelled_and_ordered() -> None:
    prof = builtin_geometric_profile(depth=15, temperatures=(1.0,))
    assert not prof.measured and "NOT measured" in prof.source
    mal = {e.budget: e.mean_accepted_length for e in prof.find("tfm")}
    assert mal[16] < mal[32] < mal[64]
    assert prof.select_chain(15).mean_accepted_length < mal[16]


@pytest.mark.parametrize("pmf, k", [
    (PMF, 6), (PMF, 3), (PMF, 9), (geometric_pmf(0.8, 15), 15), ([1.0], 4), ([0.0, 0.0, 1.0], 2),
])
def test_synthetic_rates_reproduce_the_profile_through_vllms_conversion(pmf: list[float], k: int) -> None:
    utils = pytest.importorskip("vllm.v1.spec_decode.utils")
    rates = synthetic_acceptance_rates(pmf, k)
    assert len(rates) == k and all(0.0 <= r <= 1.0 for r in rates)
    assert all(rates[i] <= rates[i - 1] for i in range(1, k))
    conditional = utils.unconditional_to_conditional_rates(rates)  # what vLLM's sampler kernels read
    assert chain_pmf_from_conditional_rates(conditional) == pytest.approx(resize_pmf(pmf, k), abs=1e-12)


def test_synthetic_rates_pass_vllms_own_validation() -> None:
    config = pytest.importorskip("vllm.config")
    rates = synthetic_acceptance_rates(geometric_pmf(0.75, 15), 15)
    assert config.SpeculativeConfig._resolve_synthetic_acceptance_rates(15, rates, None) == rates


def test_chain_pmf_from_conditional_rates_by_hand() -> None:
    assert chain_pmf_from_conditional_rates([0.5, 1.0, 0.0]) == [0.5, 0.0, 0.5, 0.0]


# ------------------------------------------------------------------ replay draws


def test_inverse_cdf_on_a_uniform_grid_gives_the_pmf_exactly() -> None:
    n = 100_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    drawn = draw_accepted(pmf_cdf(PMF), u)
    counts = torch.bincount(drawn, minlength=len(PMF)).tolist()
    for c, p in zip(counts, PMF, strict=True):
        assert abs(c - n * p) <= 1


def spine_tree(depth: int, siblings: int, gen: torch.Generator) -> torch.Tensor:
    """Parents of a spine 0-1-..-depth followed by ``siblings`` nodes hanging off random spine nodes."""
    parents = [-1] + list(range(depth))
    for _ in range(siblings):
        parents.append(int(torch.randint(0, len(parents), (1,), generator=gen)))
    return torch.tensor(parents)


def batch_of(parent_list: list[torch.Tensor], vocab: int, gen: torch.Generator) -> TreeBatch:
    from vllm_tfm.tree.types import Tree

    trees = [Tree.from_parents(torch.randint(0, vocab, (p.numel(),), generator=gen), p) for p in parent_list]
    return TreeBatch.from_trees(trees)


def repeat_batch(trees: TreeBatch, times: int) -> TreeBatch:
    """The batch ``trees`` repeated ``times`` times (requests in order, one flat batch)."""
    counts = trees.cu_nodes.diff().repeat(times)
    cu = torch.zeros(counts.numel() + 1, dtype=torch.long)
    cu[1:] = counts.cumsum(0)
    return TreeBatch(trees.tokens.repeat(times), trees.parents.repeat(times), trees.depth.repeat(times), cu)


def test_replayed_lengths_follow_the_profile_chi_square() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, depth = 50, len(PMF) - 1
    base = batch_of([spine_tree(depth, 9, gen), spine_tree(depth + 3, 2, gen), torch.arange(-1, depth)], vocab, gen)
    trees = repeat_batch(base, 2000)  # 2000 steps x 3 requests in one call
    logits = torch.randn(trees.num_nodes, vocab, generator=gen)
    draws = torch.Generator().manual_seed(1)
    out = replay_accept(trees, logits, torch.rand(trees.num_requests, generator=draws, dtype=torch.float64), pmf_cdf(PMF))
    assert not out.clamped.any()
    assert torch.equal(out.result.num_accepted, out.drawn)  # every draw realised
    counts = torch.bincount(out.result.num_accepted, minlength=len(PMF))
    n = int(counts.sum())
    cells = [(int(c), n * p) for c, p in zip(counts.tolist(), PMF, strict=True) if p > 0]
    assert counts[3] == 0  # probability 0 never drawn
    stat = sum((c - e) ** 2 / e for c, e in cells)
    assert chi2_sf(stat, len(cells) - 1) > 1e-3, (counts.tolist(), stat)


def test_replay_accepts_a_prefix_of_the_first_deepest_path_and_the_target_argmax_bonus() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = 30
    parent_list = [random_tree_parents(12, gen, kind) for kind in ("random", "deep", "star", "chain")]
    trees = batch_of(parent_list, vocab, gen)
    logits = torch.randn(trees.num_nodes, vocab, generator=gen)
    cdf = pmf_cdf([0.0, 0.0, 0.0, 1.0])  # always draw A = 3
    out = replay_accept(trees, logits, torch.zeros(4, dtype=torch.float64), cdf)
    deepest = deepest_nodes(trees)
    for r, parents in enumerate(parent_list):
        start = int(trees.cu_nodes[r])
        depth = trees.depth[start:start + parents.numel()]
        first_deepest = int(torch.nonzero(depth == depth.max())[0])
        assert int(deepest[r]) - start == first_deepest
        spine = path_of(parents, first_deepest)  # root .. deepest, written independently
        want = min(3, len(spine) - 1)
        assert out.result.num_accepted[r].item() == want
        assert bool(out.clamped[r]) == (len(spine) - 1 < 3)
        accepted = out.result.accepted_nodes[r, :want].tolist()
        assert accepted == spine[1:want + 1]
        last = spine[want]
        tokens = [int(trees.tokens[start + j]) for j in spine[1:want + 1]]
        bonus = int(logits[start + last].argmax())
        assert out.result.output_tokens[r, : want + 1].tolist() == tokens + [bonus]


# ------------------------------------------------------------------ spine-first marginals


def test_geometric_rank_ratio_solves_the_top1_equation() -> None:
    for top1, ranks in ((0.9, 8), (0.5, 4), (0.3, 8)):
        rho = geometric_rank_ratio(top1, ranks)
        assert (1 - rho) / (1 - rho**ranks) == pytest.approx(top1, abs=1e-12)
    with pytest.raises(ValueError, match="top1 must be in"):
        geometric_rank_ratio(0.1, 8)


def test_spine_first_logits_keep_the_drafters_ranking() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 1000, generator=gen, dtype=torch.float64)
    shaped = spine_first_logits(logits, top1=0.9, ranks=8)
    p = shaped.softmax(-1)
    tail = 992 * math.exp(-30.0)
    assert p.max(-1).values == pytest.approx(torch.full((2, 4), 0.9 / (1 + tail), dtype=torch.float64), abs=1e-9)
    assert torch.equal(shaped.argmax(-1), logits.argmax(-1))
    top8 = logits.topk(8, -1).indices
    assert torch.equal(shaped.gather(-1, top8).argsort(-1, descending=True), torch.arange(8).expand(2, 4, 8))


@pytest.mark.parametrize("budget", [16, 32, 64])
def test_spine_first_ddtree_and_weaver_trees_reach_the_drafted_depth(budget: int) -> None:
    from vllm_tfm.models.tfm_config import WeaverConfig
    from vllm_tfm.models.weaver import Weaver
    from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import ddtree_trees, weaver_trees

    gen = torch.Generator().manual_seed(budget)
    r, depth, vocab, width = 2, 15, 600, 32
    flat = 1e-3 * torch.rand(r, depth, vocab, generator=gen)  # what dummy weights give: nearly flat
    shaped = spine_first_logits(flat, top1=0.9)
    assert spine_is_first(0.9, depth, vocab=vocab) and not spine_is_first(0.6, depth, vocab=vocab)

    def max_depth(parents: torch.Tensor) -> int:
        return max(len(path_of(parents[i], j)) - 1 for i in range(r) for j in range(parents.shape[1]))

    _, flat_parents, _ = ddtree_trees(torch.log_softmax(flat, -1), budget)
    assert max_depth(flat_parents) <= 2  # the star that flat marginals give (why replay reshapes them)
    _, parents, _ = ddtree_trees(torch.log_softmax(shaped, -1), budget)
    assert max_depth(parents) == depth
    _, low, _ = ddtree_trees(torch.log_softmax(spine_first_logits(flat, top1=0.6), -1), 16)
    assert max_depth(low) < depth  # below the spine_is_first threshold the spine is cut short

    torch.manual_seed(0)
    weaver = Weaver(WeaverConfig(d_model=width, d_rank=16, n_layers=1, n_heads=2, d_mlp=24, max_depth=depth)).eval()
    embed = 2e-3 * torch.rand(vocab, width, generator=gen) - 1e-3  # dummy-weight scale
    lm_head = 2e-3 * torch.rand(vocab, width, generator=gen) - 1e-3
    with torch.no_grad():
        _, wparents = weaver_trees(weaver, shaped, torch.randn(r, depth, width, generator=gen),
                                   torch.randn(r, width, generator=gen), torch.tensor([1, 2]), embed, lm_head,
                                   budget, 512, -(-budget // 16), 8)
    assert max_depth(wparents) == depth


# ------------------------------------------------------------------ profile entry round trip


def test_profile_model_round_trip(tmp_path: Path) -> None:
    prof = AcceptanceProfile(source="s", measured=True,
                             entries=[ProfileEntry(method="tfm", budget=8, temperature=1.0, accepted_pmf=PMF, steps=10)])
    save_profile(prof, tmp_path / "x.json")
    back = load_profile(tmp_path / "x.json")
    assert back.entries[0].acceptance_by_depth == acceptance_by_depth(PMF)

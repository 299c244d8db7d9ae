"""The reference speculative decoder against the target's own decoding.

* Greedy: every method's output equals ``model.generate(do_sample=False)`` token for token
  (float32), for random tiny Qwen3.5 hybrids (3 GDN + 1 attention layers) and a random tiny Qwen3,
  over prompts shorter and longer than the conv window, several budgets and block sizes; with
  random drafters (little accepted) and with a drafter that knows the target's continuation
  (long accepted paths, deep commits).
* Sampling: the distribution of the first 3 generated tokens equals the target's own sampling
  distribution (exact enumeration), by a chi-square test with a fixed seed; the same samples
  are rejected against a slightly different distribution (the test has power).
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_tfm.reference.decoder import SamplingConfig, SpeculativeDecoder
from vllm_tfm.reference.drafters import METHODS, DraftInputs, make_proposer
from vllm_tfm.reference.toy_drafters import random_drafters
from vllm_tfm.reference.toy_targets import tiny_qwen3, tiny_qwen3_5


pytestmark = pytest.mark.usefixtures("one_thread")


_CACHE: dict = {}


def setup(kind: str):
    """(target, drafter bundle) for 'qwen3_5' (4 layers: GDN x3 + attention) or 'qwen3' (2 layers)."""
    if kind not in _CACHE:
        target = tiny_qwen3_5(seed=21) if kind == "qwen3_5" else tiny_qwen3(seed=22)
        _CACHE[kind] = (target, random_drafters(target, seed=23, block_size=8))
    return _CACHE[kind]


def hf_greedy(target, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    out = target.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=0
    )
    return out[0, len(prompt):].tolist()


# (kind, prompt, budget, gamma): prompts of 1 and 2 tokens are shorter than the conv window (W = 4)
CASES = [
    ("qwen3_5", [7], 4, 8),
    ("qwen3_5", [3, 9], 12, 5),
    ("qwen3_5", [5, 1, 2, 8, 4, 6, 3], 24, 8),
    ("qwen3", [11], 6, 3),
    ("qwen3", [2, 40, 17, 5], 16, 8),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind,prompt,budget,gamma", CASES)
def test_greedy_equals_hf_generate(method, kind, prompt, budget, gamma):
    target, bundle = setup(kind)
    want = hf_greedy(target, prompt, 16)
    dec = SpeculativeDecoder(target, make_proposer(method, bundle, target, gamma=gamma, width=4), budget)
    res = dec.generate(prompt, 16)
    assert res.tokens == want
    assert all(1 <= s.tree_nodes <= budget + 1 and s.tree_depth <= gamma - 1 for s in res.steps)
    assert len(res.acceptance_by_depth) == gamma - 1


def continuation_bias(target, boost: float = 100.0):
    """A proposal bias that puts the target's own greedy continuation of the committed tokens
    on top of every depth's proposal (the drafter then 'knows' the answer)."""

    def bias(inputs: DraftInputs, max_depth: int) -> torch.Tensor:
        cont = hf_greedy(target, inputs.tokens.tolist(), max_depth)
        b = torch.zeros(max_depth, target.config.vocab_size)
        b[torch.arange(max_depth), torch.tensor(cont)] = boost
        return b

    return bias


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
def test_greedy_with_an_oracle_drafter_accepts_deep_paths(method, kind):
    """Long accepted paths (deep commits of attention KV, conv windows and GDN states) stay exact."""
    target, bundle = setup(kind)
    prompt, gamma, n = [9, 4], 6, 31
    want = hf_greedy(target, prompt, n)
    dec = SpeculativeDecoder(
        target, make_proposer(method, bundle, target, gamma=gamma, width=1, proposal_bias=continuation_bias(target)), 12
    )
    res = dec.generate(prompt, n)
    assert res.tokens == want
    # the first token comes from the prefill; every step then accepts all gamma - 1 drafts + a bonus
    assert [s.accepted for s in res.steps] == [gamma - 1] * 5
    assert res.mean_accepted_length == gamma
    assert res.acceptance_by_depth == [1.0] * (gamma - 1)


def test_branch_verifier_backend_decodes_the_same():
    target, bundle = setup("qwen3_5")
    prompt = [3, 1, 4]
    bias = continuation_bias(target)
    outs = []
    for verifier in ("tree", "branch"):
        dec = SpeculativeDecoder(target, make_proposer("ddtree", bundle, target, gamma=4, proposal_bias=bias), 6, verifier)
        outs.append(dec.generate(prompt, 10).tokens)
    assert outs[0] == outs[1] == hf_greedy(target, prompt, 10)


def test_eos_stops_generation_like_hf():
    target, bundle = setup("qwen3_5")
    prompt = [8, 8, 2]
    free = hf_greedy(target, prompt, 20)
    eos = free[6]  # stop at the first occurrence of the 7th token
    want = hf_greedy(target, prompt, 20, eos=eos)
    assert want[-1] == eos and len(want) < 20
    dec = SpeculativeDecoder(target, make_proposer("tfm", bundle, target, width=4, proposal_bias=continuation_bias(target)), 8)
    res = dec.generate(prompt, 20, eos_token_id=eos)
    assert res.tokens == want
    assert res.finish_reason == "eos"


# ---------------------------------------------------------------------- sampling


def target_distribution(target, prompt: list[int], k: int, temperature: float) -> dict[tuple[int, ...], float]:
    """Exact probability of every k-token continuation under softmax(logits / T) (enumeration)."""
    vocab = target.config.vocab_size
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(k):
            prefixes = list(probs)
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            logits = target(input_ids=ids).logits[:, -1].double()
            p = torch.softmax(logits / temperature, dim=-1)
            probs = {pre + (t,): probs[pre] * float(p[i, t]) for i, pre in enumerate(prefixes) for t in range(vocab)}
    return probs


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square p-value, cells with expected count < 5 pooled into one."""
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e, o = n * p, counts.get(cell, 0)
        if e < 5:
            pool_obs, pool_exp = pool_obs + o, pool_exp + e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("method,acceptance", [("tfm", "target_only"), ("ddtree", "traversal")])
def test_sampling_matches_the_target_distribution(method, acceptance):
    """First 3 tokens (the first from the prefill, then tree steps: depth-1 and depth-2 acceptance,
    bonus tokens after rejection, commits) against exact enumeration of the target's sampling
    distribution: 500 samples, fixed seed, 64 cells (V = 4)."""
    target = tiny_qwen3_5(
        seed=31, vocab_size=4, hidden_size=32, num_layers=2, layer_types=["linear_attention", "full_attention"], logit_scale=1.0
    )
    bundle = random_drafters(target, seed=32, block_size=3)
    prompt, k, n, temp = [1, 3], 3, 500, 1.0
    dec = SpeculativeDecoder(target, make_proposer(method, bundle, target, width=3), budget=6, acceptance=acceptance)
    gen = torch.Generator().manual_seed(1234)
    results = dec.sample_many(prompt, n, k, sampling=SamplingConfig(temperature=temp), generator=gen)
    counts: dict = {}
    for r in results:
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    first_steps = [r.steps[0].accepted for r in results]
    assert sum(a >= 1 for a in first_steps) > n // 2 and sum(a >= 2 for a in first_steps) > n // 10  # trees get accepted
    assert chi_square_pvalue(counts, target_distribution(target, prompt, k, temp), n) > 1e-3
    # power: the same samples are rejected against the distribution at temperature 1.5
    assert chi_square_pvalue(counts, target_distribution(target, prompt, k, 1.5), n) < 1e-6


def test_errors_name_the_problem():
    target, bundle = setup("qwen3")
    with pytest.raises(ValueError, match="unknown method 'beam'"):
        make_proposer("beam", bundle, target)
    with pytest.raises(ValueError, match=r"block size gamma must be in 2\.\.8"):
        make_proposer("chain", bundle, target, gamma=9)
    prop = make_proposer("chain", bundle, target)
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        SpeculativeDecoder(target, prop, 0)
    with pytest.raises(ValueError, match="unknown verifier 'fast'"):
        SpeculativeDecoder(target, prop, 4, verifier="fast")
    with pytest.raises(ValueError, match="unknown acceptance 'typical'"):
        SpeculativeDecoder(target, prop, 4, acceptance="typical")
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SpeculativeDecoder(target, prop, 4).generate([1], 0)
    assert math.isnan(SpeculativeDecoder(target, prop, 4).generate([1], 1).mean_accepted_length)

"""The runtime's tree acceptance against vLLM's sampled_token_ids contract and a brute-force walk.

vLLM reads ``sampled_token_ids`` [R, max_spec_len + 1] (int32): accepted drafts, the bonus
token, then -1; it counts accepted tokens as the non-(-1) entries. The runtime lays the logits
rows out from the step metadata, verifies with vllm_tfm.verify.sampling and pads the result."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from _greedy_cases import brute_greedy_walk
from _sampling_fakes import sampling_metadata
from _trees import path_of, random_tree_parents
from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
from vllm_tfm.vllm_plugin.runtime.sampler import (
    needs_native_sampler,
    output_token_ids,
    sample_trees,
)
from vllm_tfm.vllm_plugin.runtime.state import ProposalStore
from vllm_tfm.verify.logits_processing import TreeSamplingParams
from vllm_tfm.verify.sampling import verify_tree

VOCAB = 50


def make_batch(seed: int):
    """A batch of a prefill request and four tree requests with planted accepted paths."""
    gen = torch.Generator().manual_seed(seed)
    budget = 6
    store = ProposalStore()
    req_ids, sched, spec, trees = ["pre"], [3], {}, {}
    ids, toks, pars = [], [], []
    for r, kind in enumerate(["random", "chain", "star", "deep"]):
        rid = f"q{r}"
        parents = random_tree_parents(budget + 1, gen, kind)
        tokens = torch.randint(0, VOCAB, (budget,), generator=gen)
        req_ids.append(rid)
        sched.append(budget + 1)
        spec[rid] = tokens.tolist()
        trees[rid] = (parents.tolist(), [0] + tokens.tolist())
        ids.append(rid)
        toks.append(tokens)
        pars.append(parents)
    store.put(ids, torch.stack(toks), torch.stack(pars))
    step = build_step_tree(req_ids, np.array(sched), spec, store, allow_trees=True)
    n_rows = int(step.sample_cu[-1])
    logits = torch.randn(n_rows, VOCAB, generator=gen, dtype=torch.float64)
    # plant a path in each tree: make the argmax at each path node's parent its token
    for r, rid in enumerate(req_ids[1:], start=1):
        parents, tokens = trees[rid]
        last = int(torch.randint(0, budget + 1, (1,), generator=gen))
        base = int(step.sample_cu[r])
        for j in path_of(torch.tensor(parents), last)[1:]:
            logits[base + parents[j], tokens[j]] = 100.0
    drafts = torch.tensor([t for rid in req_ids[1:] for t in spec[rid]])
    return step, logits, drafts, trees, req_ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_tree_output_follows_the_contract(seed):
    step, logits, drafts, trees, req_ids = make_batch(seed)
    batch = sample_trees(step, drafts)
    params = TreeSamplingParams.from_host(np.zeros(len(req_ids)), None, None, None, "cpu")
    result = verify_tree(logits, batch, params)
    max_spec = int(step.num_draft.max())
    out = output_token_ids(result, max_spec)
    assert out.dtype == torch.int32 and out.shape == (len(req_ids), max_spec + 1)
    argmax = logits.argmax(-1).tolist()
    # the prefill request: its one logits row's argmax, then padding
    assert out[0].tolist() == [argmax[0]] + [-1] * max_spec
    for r, rid in enumerate(req_ids[1:], start=1):
        parents, tokens = trees[rid]
        base = int(step.sample_cu[r])
        path, bonus = brute_greedy_walk(parents, tokens, argmax[base : base + len(parents)])
        expect = [tokens[j] for j in path] + [bonus]
        assert out[r].tolist() == expect + [-1] * (max_spec + 1 - len(expect))
        assert result.accepted_nodes[r, : len(path)].tolist() == path
        assert int(result.last_node[r]) == (path[-1] if path else 0)
        assert int((out[r] != -1).sum()) == len(path) + 1  # what vLLM counts as num_accepted_tokens


def test_metrics_histogram_counts_accepted_drafts():
    step, logits, drafts, trees, req_ids = make_batch(3)
    result = verify_tree(logits, sample_trees(step, drafts), TreeSamplingParams.from_host(np.zeros(5), None, None, None, "cpu"))
    m = Metrics(max_depth=6)
    m.record_step(step)
    m.record_accept(step, result)
    snap = m.snapshot()
    acc = result.num_accepted[1:].tolist()  # spec requests are the four tree requests
    assert snap["verified_spec_requests"] == 4
    assert snap["accepted_hist"] == [acc.count(k) for k in range(7)]
    assert snap["mean_accepted_length"] == pytest.approx(1 + sum(acc) / 4)
    assert snap["acceptance_by_depth"][0] == pytest.approx(sum(a >= 1 for a in acc) / 4)
    assert snap["tree_steps"] == 1 and snap["steps"] == 1


def test_needs_native_sampler_triggers():
    assert not needs_native_sampler(sampling_metadata())
    assert needs_native_sampler(sampling_metadata(no_penalties=False))
    assert needs_native_sampler(sampling_metadata(bad_words_token_ids={0: [[3]]}))
    assert needs_native_sampler(sampling_metadata(allowed_token_ids_mask=torch.zeros(1, 2, dtype=torch.bool)))
    assert needs_native_sampler(sampling_metadata(max_num_logprobs=0))
    idle_min_tokens = SimpleNamespace(min_toks={})
    busy_min_tokens = SimpleNamespace(min_toks={0: (3, [], set())})
    procs = lambda p: SimpleNamespace(non_argmax_invariant=[p], argmax_invariant=[])  # noqa: E731
    assert not needs_native_sampler(sampling_metadata(logitsprocs=procs(idle_min_tokens)))
    assert needs_native_sampler(sampling_metadata(logitsprocs=procs(busy_min_tokens)))
    assert needs_native_sampler(sampling_metadata(logitsprocs=procs(object())))  # unknown processor
    holder = SimpleNamespace(has_tracked_requests=lambda: True)
    assert needs_native_sampler(sampling_metadata(thinking_budget_state_holder=holder))


def test_tree_sampling_params_from_vllm_arrays():
    p = TreeSamplingParams.from_host(np.array([0.0, 0.7]), np.array([50, 3]), np.array([1.0, 0.9]), None, "cpu")
    assert p.greedy_mask().tolist() == [True, False]
    assert p.top_k.tolist() == [50, 3] and p.top_p.tolist() == pytest.approx([1.0, 0.9]) and p.min_p is None

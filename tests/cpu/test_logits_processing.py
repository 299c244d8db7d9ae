"""Per-request temperature / min-p / top-k / top-p at every tree node, against hand-computed cases
and a straightforward per-row implementation written here from vLLM 0.26's semantics."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_tfm.verify.logits_processing import TreeSamplingParams, per_node, process_logits

P4 = [0.5, 0.3, 0.15, 0.05]


def one_row(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """One node's probabilities, written out step by step (vLLM Sampler order)."""
    vocab = len(logits)
    if temperature < 1e-5:
        best = max(range(vocab), key=lambda i: (logits[i], -i))  # lowest id among the maxima
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    x = [v / temperature for v in logits]

    def softmax(z: list[float]) -> list[float]:
        m = max(z)
        e = [math.exp(v - m) if v != float("-inf") else 0.0 for v in z]
        s = sum(e)
        return [v / s for v in e]

    if min_p > 0:
        pr = softmax(x)
        x = [v if pr[i] >= min_p * max(pr) else float("-inf") for i, v in enumerate(x)]
    if 0 < top_k < vocab:
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [v if v >= kth else float("-inf") for v in x]
    if top_p < 1:
        pr = softmax(x)
        ascending = sorted(range(vocab), key=lambda i: (x[i], i))  # equal logits: lower id first
        cum = 0.0
        for i in ascending[:-1]:
            cum += pr[i]
            if cum <= 1 - top_p:
                x[i] = float("-inf")
    return softmax(x)


def test_hand_computed_cases():
    logits = torch.tensor([P4], dtype=torch.float64).log()
    cu = torch.tensor([0, 1])
    s5, s3 = math.sqrt(0.5), math.sqrt(0.3)
    cases = [
        (dict(temperature=[1.0], top_p=[0.75]), [0.625, 0.375, 0.0, 0.0]),
        (dict(temperature=[1.0], min_p=[0.2]), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (dict(temperature=[1.0], top_k=[2]), [0.625, 0.375, 0.0, 0.0]),
        (dict(temperature=[1.0], top_k=[3], top_p=[0.9]), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (dict(temperature=[2.0]), [math.sqrt(v) / sum(math.sqrt(w) for w in P4) for v in P4]),
        # min-p before top-p: min-p 0.5 drops token 3, then top-p 0.75 (1 - p = 0.25) drops token 2,
        # whose renormalised mass sqrt(.15) / (sqrt(.5) + sqrt(.3) + sqrt(.15)) = 0.236 <= 0.25.
        # (top-p first would keep token 2: on all four tokens its cumulative mass is 0.328.)
        (dict(temperature=[2.0], min_p=[0.5], top_p=[0.75]), [s5 / (s5 + s3), s3 / (s5 + s3), 0.0, 0.0]),
        (dict(temperature=[0.0], top_k=[1]), [1.0, 0.0, 0.0, 0.0]),
    ]
    for kwargs, expected in cases:
        probs = process_logits(logits, TreeSamplingParams.from_lists(**kwargs), cu)
        assert probs.dtype == torch.float64
        torch.testing.assert_close(probs[0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_matches_straightforward_implementation_on_ragged_batch():
    gen = torch.Generator().manual_seed(0)
    vocab = 7
    counts = [3, 1, 4, 2, 5, 2]
    cu = torch.tensor([0] + counts).cumsum(0)
    logits = torch.randn(int(cu[-1]), vocab, generator=gen, dtype=torch.float64) * 2
    temperature = [0.7, 0.0, 1.3, 1.0, 0.5, 1e-6]
    top_k = [0, 3, -1, 2, 7, 4]
    top_p = [0.9, 1.0, 0.5, 0.8, 1.0, 0.3]
    min_p = [0.0, 0.3, 0.1, 0.05, 0.2, 0.0]
    params = TreeSamplingParams.from_lists(temperature, top_k, top_p, min_p)
    probs = process_logits(logits, params, cu)
    for r in range(len(counts)):
        for i in range(int(cu[r]), int(cu[r + 1])):
            expected = one_row(logits[i].tolist(), temperature[r], top_k[r], top_p[r], min_p[r])
            torch.testing.assert_close(probs[i], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_each_node_uses_its_own_request_parameters():
    row = torch.tensor(P4, dtype=torch.float64).log()
    logits = row.repeat(5, 1)
    cu = torch.tensor([0, 2, 5])
    params = TreeSamplingParams.from_lists([1.0, 1.0], top_k=[1, 0])
    probs = process_logits(logits, params, cu)
    torch.testing.assert_close(probs[:2], torch.tensor([[1.0, 0, 0, 0]] * 2, dtype=torch.float64))
    torch.testing.assert_close(probs[2:], torch.tensor([P4] * 3, dtype=torch.float64))
    assert per_node(torch.tensor([7, 9]), cu, 5).tolist() == [7, 7, 9, 9, 9]


def test_disabled_filters_are_plain_softmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 1, 2, 3, 4])
    params = TreeSamplingParams.from_lists(
        [0.8, 1.0, 1.5, 1.0], top_k=[0, -1, 6, 100], top_p=[1.0] * 4, min_p=[0.0] * 4
    )
    expected = torch.softmax(logits / torch.tensor([0.8, 1.0, 1.5, 1.0], dtype=torch.float64).unsqueeze(1), dim=-1)
    torch.testing.assert_close(process_logits(logits, params, cu), expected, rtol=0, atol=1e-14)


def test_ties_top_k_keeps_all_ties_and_greedy_takes_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0]], dtype=torch.float64)
    cu = torch.tensor([0, 1])
    probs = process_logits(logits, TreeSamplingParams.from_lists([1.0], top_k=[2]), cu)
    assert (probs[0] > 0).tolist() == [False, True, False, True, False]
    probs = process_logits(logits, TreeSamplingParams.from_lists([1.0], top_k=[3]), cu)
    assert (probs[0] > 0).tolist() == [False, True, True, True, True]  # the k-th value 2.0 is tied
    probs = process_logits(logits, TreeSamplingParams.from_lists([0.0]), cu)
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_dtypes():
    logits = torch.tensor([P4, P4], dtype=torch.float64).log()
    cu = torch.tensor([0, 2])
    params = TreeSamplingParams.from_lists([1.0], top_p=[0.75])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        probs = process_logits(logits.to(dt), params, cu)
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs[1], torch.tensor([0.625, 0.375, 0, 0]), rtol=0, atol=3e-3)


def test_invalid_parameters_raise():
    with pytest.raises(ValueError, match="top_p must be in"):
        TreeSamplingParams.from_lists([1.0], top_p=[0.0])
    with pytest.raises(ValueError, match="min_p must be in"):
        TreeSamplingParams.from_lists([1.0], min_p=[1.5])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        TreeSamplingParams.from_lists([-1.0])
    with pytest.raises(ValueError, match=r"top_k must have shape \[2\]"):
        TreeSamplingParams.from_lists([1.0, 1.0], top_k=[1])
    with pytest.raises(ValueError, match="top_k must be an integer tensor"):
        TreeSamplingParams(torch.ones(1), top_k=torch.ones(1))
    params = TreeSamplingParams.from_lists([1.0, 1.0])
    with pytest.raises(ValueError, match="params hold 2 requests but cu_nodes describes 1"):
        process_logits(torch.zeros(3, 4), params, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="logits must be"):
        process_logits(torch.zeros(3), params, torch.tensor([0, 1, 3]))

"""bench/chisquare.py: the two-sample chi-square homogeneity test of the GPU sampling check."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from chisquare import OTHER, chi2_sf, homogeneity_test, pool_categories  # noqa: E402


def test_chi2_sf_matches_closed_forms() -> None:
    # dof 2: sf(x) = exp(-x / 2); dof 1: sf(x) = erfc(sqrt(x / 2))
    for x in (0.0, 0.3, 2.0, 5.991464547107979, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12, abs=1e-300)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10, abs=1e-300)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)  # the textbook 5% point
    # dof 4: sf(x) = exp(-x/2) (1 + x/2)
    assert chi2_sf(9.0, 4) == pytest.approx(math.exp(-4.5) * 5.5, rel=1e-12)


def test_chi2_sf_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dof >= 1"):
        chi2_sf(1.0, 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        chi2_sf(-1.0, 3)


def test_hand_example_statistic_and_p_value() -> None:
    # a: 10 x, 20 y, 30 z; b: 20 each. Expected per arm: 15, 20, 25 ->
    # X^2 = 2 * (25/15 + 0 + 25/25) = 16/3, dof 2, p = exp(-8/3).
    a = ["x"] * 10 + ["y"] * 20 + ["z"] * 30
    b = ["x"] * 20 + ["y"] * 20 + ["z"] * 20
    r = homogeneity_test(a, b)
    assert r["statistic"] == pytest.approx(16 / 3, rel=1e-12)
    assert r["dof"] == 2
    assert r["p_value"] == pytest.approx(math.exp(-8 / 3), rel=1e-12)
    assert r["categories"] == ["z", "y", "x"]  # most frequent first (totals 50, 40, 30)
    assert r["counts_a"] == [30, 20, 10] and r["counts_b"] == [20, 20, 20]


def test_rare_categories_are_pooled_into_other() -> None:
    # totals: A 100, B 60, C 6, D 4, E 2 over n_a = n_b = 86: C, D, E have expected 3, 2, 1 < 5
    a = [("A", 1)] * 50 + [("B", 2)] * 30 + [("C", 3)] * 3 + [("D", 4)] * 2 + [("E", 5)] * 1
    b = [("A", 1)] * 50 + [("B", 2)] * 30 + [("C", 3)] * 3 + [("D", 4)] * 2 + [("E", 5)] * 1
    r = homogeneity_test(a, b)
    assert r["categories"] == [str(("A", 1)), str(("B", 2)), OTHER]
    assert r["counts_a"] == [50, 30, 6] and r["counts_b"] == [50, 30, 6]
    assert r["statistic"] == pytest.approx(0.0, abs=1e-12) and r["dof"] == 2 and r["p_value"] == pytest.approx(1.0)


def test_small_other_absorbs_the_smallest_kept_category() -> None:
    # totals A 100, B 12, C 2 (n_a = n_b = 57): B alone is fine (6 >= 5) but OTHER = {C} would
    # have expected 1, so B joins it (expected 7).
    ca = {"A": 50, "B": 6, "C": 1}
    kept = pool_categories(Counter(ca), Counter(ca))
    assert kept == ["A"]
    r = homogeneity_test([k for k, v in ca.items() for _ in range(v)], [k for k, v in ca.items() for _ in range(v)])
    assert r["categories"] == ["A", OTHER] and r["counts_a"] == [50, 7] and r["dof"] == 1


def test_single_category_is_vacuous() -> None:
    r = homogeneity_test([7] * 30, [7] * 40)
    assert (r["statistic"], r["dof"], r["p_value"]) == (0.0, 0, 1.0)


def test_empty_arm_raises() -> None:
    with pytest.raises(ValueError, match="both arms need samples"):
        homogeneity_test([], [1, 2])


def _joint_samples(temperature: float, n: int, seed: int) -> list[tuple[int, int]]:
    """n samples of (token1, token2) from two fixed peaked categoricals over 40 tokens."""
    g = torch.Generator().manual_seed(123)
    logits = 3.0 * torch.randn(2, 40, generator=g, dtype=torch.float64)
    p = torch.softmax(logits / temperature, -1)
    s = torch.Generator().manual_seed(seed)
    t1 = torch.multinomial(p[0], n, replacement=True, generator=s)
    t2 = torch.multinomial(p[1], n, replacement=True, generator=s)
    return list(zip(t1.tolist(), t2.tolist()))


def test_equal_distributions_give_large_p() -> None:
    ps = [homogeneity_test(_joint_samples(1.0, 2000, 2 * i), _joint_samples(1.0, 2000, 2 * i + 1))["p_value"]
          for i in range(5)]
    assert min(ps) > 0.001  # five fixed-seed draws; each fails with probability 0.001 under H0
    assert sum(ps) / len(ps) > 0.1  # p-values are uniform under H0


def test_different_distributions_give_tiny_p() -> None:
    r = homogeneity_test(_joint_samples(1.0, 2000, 0), _joint_samples(0.7, 2000, 1))
    assert r["dof"] >= 2
    assert r["p_value"] < 1e-6

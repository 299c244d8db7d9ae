"""Two-sample chi-square homogeneity test over categorical samples (no scipy needed).

Used by bench/gpu_plugin_e2e.py (TFM_E2E_SAMPLING=1) to check that speculative sampling leaves
the output distribution unchanged: samples of one arm vs samples of the no-spec baseline.

Pearson's test of homogeneity for a 2 x k contingency table: with counts a_c, b_c (totals
n_a, n_b, N = n_a + n_b) the expected counts are E_ic = n_i (a_c + b_c) / N and
X^2 = sum_ic (O_ic - E_ic)^2 / E_ic, asymptotically chi-square with k - 1 degrees of freedom;
the p-value is the chi-square survival function Q(dof / 2, X^2 / 2) (regularized upper
incomplete gamma function, torch.special.gammaincc, float64).
Categories whose expected count is below ``min_expected`` in either arm are pooled into one
"other" category (the usual validity rule of thumb: every expected count >= 5).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable

import torch

OTHER = "other"


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof); dof >= 1, statistic >= 0 (float64 math)."""
    if dof < 1:
        raise ValueError(f"chi-square needs dof >= 1, got {dof}")
    if statistic < 0:
        raise ValueError(f"chi-square statistic must be >= 0, got {statistic}")
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    x = torch.tensor(statistic / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


def pool_categories(counts_a: Counter, counts_b: Counter, min_expected: float = 5.0) -> list[Hashable]:
    """Categories kept separate (most frequent first); the rest go to OTHER.

    Keeps the largest categories whose expected count is >= ``min_expected`` in both arms; if the
    pooled OTHER would itself fall below ``min_expected``, the smallest kept categories are moved
    into it until it does not (or nothing is kept).
    """
    n_a, n_b = sum(counts_a.values()), sum(counts_b.values())
    if n_a == 0 or n_b == 0:
        raise ValueError(f"both arms need samples, got {n_a} and {n_b}")
    total = counts_a + counts_b
    n = n_a + n_b
    scale = min(n_a, n_b) / n  # the smaller arm's expected count is total_c * scale

    def ok(tot: int) -> bool:
        return tot * scale >= min_expected

    order = sorted(total, key=lambda c: (-total[c], repr(c)))  # deterministic tie-break
    kept = [c for c in order if ok(total[c])]
    rest = n - sum(total[c] for c in kept)
    while kept and 0 < rest and not ok(rest):
        rest += total[kept.pop()]
    return kept


def homogeneity_test(samples_a: Iterable[Hashable], samples_b: Iterable[Hashable],
                     min_expected: float = 5.0) -> dict:
    """Pearson chi-square homogeneity test of two categorical samples.

    samples_a, samples_b: hashable category labels (e.g. (token1, token2) tuples), any lengths.
    Returns {"statistic", "dof", "p_value", "categories" (labels as strings, OTHER last if used),
    "counts_a", "counts_b" (per category, same order), "n_a", "n_b"}. With fewer than two pooled
    categories the test is vacuous: statistic 0, dof 0, p_value 1.
    """
    ca, cb = Counter(samples_a), Counter(samples_b)
    kept = pool_categories(ca, cb, min_expected)
    keep = set(kept)
    obs_a = [ca[c] for c in kept]
    obs_b = [cb[c] for c in kept]
    other_a = sum(v for c, v in ca.items() if c not in keep)
    other_b = sum(v for c, v in cb.items() if c not in keep)
    labels = [str(c) for c in kept]
    if other_a + other_b > 0:
        obs_a.append(other_a)
        obs_b.append(other_b)
        labels.append(OTHER)
    n_a, n_b = sum(obs_a), sum(obs_b)
    n = n_a + n_b
    k = len(labels)
    res = {"categories": labels, "counts_a": obs_a, "counts_b": obs_b, "n_a": n_a, "n_b": n_b}
    if k < 2:
        return {"statistic": 0.0, "dof": 0, "p_value": 1.0, **res}
    stat = 0.0
    for oa, ob in zip(obs_a, obs_b):
        tot = oa + ob
        ea, eb = n_a * tot / n, n_b * tot / n
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    dof = k - 1
    return {"statistic": stat, "dof": dof, "p_value": chi2_sf(stat, dof), **res}

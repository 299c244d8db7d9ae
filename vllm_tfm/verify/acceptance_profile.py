"""Acceptance profiles: how many drafts a verify step accepts, recorded once, replayed in benchmarks.

A profile entry describes one proposal method at one tree budget B and one temperature by the
distribution of the number A of drafts accepted per verify step (the accepted path's depth; the
step emits A + 1 tokens with the bonus): ``accepted_pmf[k] = P(A = k)`` for k = 0..D, D the
deepest depth the method drafts. Everything else follows from it:

* acceptance by depth ``P(A >= d)``, d = 1..D (what ``vllm-tfm eval`` reports per cell);
* mean accepted length ``MAL = 1 + E[A]``;
* vLLM's ``synthetic_acceptance_rates`` for a chain of K drafts: the *unconditional*
  per-position rates ``P(A >= i + 1)``, i = 0..K-1 (``vllm.config.SpeculativeConfig``; vLLM turns
  them into conditional rates ``c_i = P(A >= i + 1) / P(A >= i)`` for its early-exit loop, and a
  chain accepted under those rates has exactly this distribution of A, truncated at K).

Sources of a profile (``load_profile``):

* the results JSON of ``vllm-tfm eval`` (``vllm_tfm.reference.evaluate``): one entry per
  (method, budget, temperature) cell, its pmf the histogram of ``accepted_per_step``;
* a profile JSON in the format of :class:`AcceptanceProfile` (``format`` =
  :data:`PROFILE_FORMAT`), e.g. written by :func:`save_profile`;
* :func:`builtin_geometric_profile`: geometric acceptance with fixed per-depth rates, NOT a
  measurement (``measured`` is False and the ``source`` says so), for runs made before the toy
  zoo is evaluated.

Plain Python (no torch, no vLLM): the GPU benchmark's driver and the plugin both read it.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "PROFILE_FORMAT",
    "PMF_TOLERANCE",
    "ProfileEntry",
    "AcceptanceProfile",
    "pmf_from_counts",
    "geometric_pmf",
    "resize_pmf",
    "acceptance_by_depth",
    "mean_accepted_length",
    "synthetic_acceptance_rates",
    "chain_pmf_from_conditional_rates",
    "profile_from_eval",
    "builtin_geometric_profile",
    "BUILTIN_GEOMETRIC_RATES",
    "load_profile",
    "save_profile",
]

PROFILE_FORMAT = "vllm-tfm-acceptance-profile/1"
PMF_TOLERANCE = 1e-6
"""How far the sum of a pmf may be from 1 (JSON round trips of measured frequencies)."""


def _check_pmf(pmf: Sequence[float]) -> list[float]:
    if len(pmf) < 1:
        raise ValueError("accepted_pmf needs at least one entry (P(A = 0))")
    vals = [float(p) for p in pmf]
    if any(not math.isfinite(p) or p < 0 for p in vals):
        raise ValueError(f"accepted_pmf entries must be finite and >= 0, got {vals}")
    total = math.fsum(vals)
    if abs(total - 1.0) > PMF_TOLERANCE:
        raise ValueError(f"accepted_pmf must sum to 1 (within {PMF_TOLERANCE}), got {total!r}")
    return vals


def acceptance_by_depth(pmf: Sequence[float]) -> list[float]:
    """``P(A >= d)`` for d = 1..D, from ``pmf[k] = P(A = k)``, k = 0..D (tail sums, clipped to [0, 1])."""
    out = []
    for d in range(1, len(pmf)):
        out.append(min(1.0, max(0.0, math.fsum(pmf[d:]))))
    return out


def mean_accepted_length(pmf: Sequence[float]) -> float:
    """``1 + E[A]``: tokens emitted per verify step (accepted drafts plus the bonus)."""
    return 1.0 + math.fsum(k * p for k, p in enumerate(pmf))


def pmf_from_counts(accepted: Iterable[int], max_depth: int) -> list[float]:
    """The empirical pmf over 0..max_depth of per-step accepted counts (refuses counts outside it)."""
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    counts = [0] * (max_depth + 1)
    n = 0
    for a in accepted:
        a = int(a)
        if not 0 <= a <= max_depth:
            raise ValueError(f"an accepted count {a} is outside 0..{max_depth}")
        counts[a] += 1
        n += 1
    if n == 0:
        raise ValueError("no accepted counts: an empty cell has no distribution")
    return [c / n for c in counts]


def geometric_pmf(rate: float, depth: int) -> list[float]:
    """A drafts accepted with probability ``rate`` each, in order, up to ``depth``:
    ``P(A = k) = rate^k (1 - rate)`` for k < depth and ``P(A = depth) = rate^depth``."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    return [rate**k * (1.0 - rate) for k in range(depth)] + [rate**depth]


def resize_pmf(pmf: Sequence[float], depth: int) -> list[float]:
    """The pmf of ``min(A, depth)``: mass beyond ``depth`` moves to ``depth``; zeros pad a deeper range.

    This is what a drafter that drafts at most ``depth`` tokens sees of a longer profile.
    """
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    vals = list(pmf)
    if len(vals) <= depth + 1:
        return vals + [0.0] * (depth + 1 - len(vals))
    return vals[:depth] + [math.fsum(vals[depth:])]


def synthetic_acceptance_rates(pmf: Sequence[float], num_speculative_tokens: int) -> list[float]:
    """vLLM's ``synthetic_acceptance_rates`` for a chain of K drafts that reproduces this pmf.

    Entry i is the unconditional probability that the first i + 1 drafts are all accepted,
    ``P(min(A, K) >= i + 1)``; the list has length K, lies in [0, 1] and never increases (vLLM
    refuses anything else).
    """
    k = int(num_speculative_tokens)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    rates = acceptance_by_depth(resize_pmf(_check_pmf(pmf), k))
    for i in range(1, len(rates)):  # tail sums never increase; guard the last ulp of rounding
        rates[i] = min(rates[i], rates[i - 1])
    return rates


def chain_pmf_from_conditional_rates(conditional: Sequence[float]) -> list[float]:
    """The distribution of A for a chain that accepts draft i with probability ``conditional[i]``
    given drafts 0..i-1 were accepted, stopping at the first rejection (vLLM's synthetic mode)."""
    out, alive = [], 1.0
    for c in conditional:
        out.append(alive * (1.0 - c))
        alive *= c
    return out + [alive]


class ProfileEntry(BaseModel):
    """The accepted-count distribution of one (method, budget, temperature)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = Field(min_length=1)
    budget: int = Field(ge=1, description="tree budget B (draft nodes per step)")
    temperature: float = Field(ge=0.0)
    accepted_pmf: list[float] = Field(description="P(A = k), k = 0..D")
    steps: int | None = Field(default=None, ge=1, description="verify steps measured (None: not a measurement)")

    @field_validator("accepted_pmf")
    @classmethod
    def _pmf(cls, v: list[float]) -> list[float]:
        return _check_pmf(v)

    @property
    def max_depth(self) -> int:
        return len(self.accepted_pmf) - 1

    @property
    def acceptance_by_depth(self) -> list[float]:
        return acceptance_by_depth(self.accepted_pmf)

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.accepted_pmf)

    def label(self) -> str:
        return f"{self.method} B={self.budget} T={self.temperature:g}"


class AcceptanceProfile(BaseModel):
    """A set of entries with where they came from. ``measured`` is False for synthetic profiles."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["vllm-tfm-acceptance-profile/1"] = PROFILE_FORMAT
    source: str = Field(min_length=1, description="the command / file the numbers come from")
    measured: bool
    entries: list[ProfileEntry] = Field(min_length=1)

    def find(self, method: str, budget: int | None = None, temperature: float | None = None) -> list[ProfileEntry]:
        """Entries of ``method`` (and ``budget`` / ``temperature`` when given)."""
        return [
            e
            for e in self.entries
            if e.method == method
            and (budget is None or e.budget == budget)
            and (temperature is None or abs(e.temperature - temperature) < 1e-9)
        ]

    def select(self, method: str, budget: int, temperature: float | None = None) -> ProfileEntry:
        """The one entry of (method, budget[, temperature]); a ValueError lists what exists otherwise."""
        found = self.find(method, budget, temperature)
        if len(found) == 1:
            return found[0]
        have = ", ".join(e.label() for e in self.entries)
        want = f"{method} B={budget}" + ("" if temperature is None else f" T={temperature:g}")
        if not found:
            raise ValueError(f"acceptance profile ({self.source}) has no entry for {want} (it has: {have})")
        raise ValueError(
            f"acceptance profile ({self.source}) has {len(found)} entries for {want} ({', '.join(e.label() for e in found)}): "
            "name the temperature"
        )

    def select_chain(self, depth: int, temperature: float | None = None) -> ProfileEntry:
        """The chain entry for a chain of ``depth`` drafts: the smallest budget drafting at least
        ``depth`` deep (every budget >= the drafter's depth gives the same chain), else the deepest."""
        found = self.find("chain", None, temperature)
        if not found:
            have = ", ".join(e.label() for e in self.entries)
            raise ValueError(f"acceptance profile ({self.source}) has no 'chain' entry (it has: {have})")
        temps = {e.temperature for e in found}
        if len(temps) > 1:
            raise ValueError(
                f"acceptance profile ({self.source}) has chain entries at temperatures {sorted(temps)}: name the temperature"
            )
        deep = [e for e in found if e.max_depth >= depth]
        return min(deep, key=lambda e: e.budget) if deep else max(found, key=lambda e: e.max_depth)


def profile_from_eval(results: Mapping[str, Any], source: str) -> AcceptanceProfile:
    """Entries from ``vllm-tfm eval`` results: one per acceptance cell, pmf from ``accepted_per_step``
    (``--per-step`` files) or from ``accepted_histogram`` (the default, compact files)."""
    cells = results.get("acceptance")
    if not isinstance(cells, list) or not cells:
        raise ValueError(f"{source}: no 'acceptance' cells (not a `vllm-tfm eval` results file?)")
    entries = []
    for i, c in enumerate(cells):
        try:
            if "accepted_per_step" in c:
                per_step = [a for per_prompt in c["accepted_per_step"] for a in per_prompt]
                pmf, steps = pmf_from_counts(per_step, int(c["max_depth"])), len(per_step)
            else:
                hist = [int(h) for h in c["accepted_histogram"]]
                if len(hist) != int(c["max_depth"]) + 1 or min(hist) < 0 or sum(hist) == 0:
                    raise ValueError(f"accepted_histogram must hold max_depth + 1 counts, not all 0, got {hist}")
                steps = sum(hist)
                pmf = [h / steps for h in hist]
            entries.append(
                ProfileEntry(
                    method=str(c["method"]),
                    budget=int(c["budget"]),
                    temperature=float(c["temperature"]),
                    accepted_pmf=pmf,
                    steps=steps,
                )
            )
        except (KeyError, TypeError, ValueError, ValidationError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{source}: acceptance cell {i}: {msg}") from None
    models = results.get("models")
    measured = models != "random"
    note = "" if measured else " (RANDOM models: mechanics only)"
    return AcceptanceProfile(source=f"{source}{note}", measured=measured, entries=entries)


BUILTIN_GEOMETRIC_RATES: Mapping[tuple[str, int], float] = {
    ("chain", 16): 0.75,
    ("tfm", 16): 0.80,
    ("tfm", 32): 0.84,
    ("tfm", 64): 0.87,
}
"""Per-depth acceptance rates of the built-in profile: round numbers chosen so that the tree
arms gain over the chain roughly as the TfM paper reports (MAL +73% at B = 64), NOT measured."""


def builtin_geometric_profile(depth: int = 15, temperatures: Sequence[float] = (0.0, 1.0)) -> AcceptanceProfile:
    """Geometric acceptance (:data:`BUILTIN_GEOMETRIC_RATES`) to ``depth``, the same at every temperature."""
    entries = [
        ProfileEntry(method=m, budget=b, temperature=float(t), accepted_pmf=geometric_pmf(rate, depth))
        for (m, b), rate in BUILTIN_GEOMETRIC_RATES.items()
        for t in temperatures
    ]
    rates = ", ".join(f"{m} B={b}: {r}" for (m, b), r in BUILTIN_GEOMETRIC_RATES.items())
    return AcceptanceProfile(
        source=f"builtin geometric profile, NOT measured (per-depth rates {rates}; depth {depth})",
        measured=False,
        entries=entries,
    )


def load_profile(path: str | Path) -> AcceptanceProfile:
    """A profile JSON or a ``vllm-tfm eval`` results JSON, gzip-compressed when its name ends in ``.gz``
    (one-line ValueError otherwise)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
        data = json.loads(gzip.decompress(raw) if p.suffix == ".gz" else raw)
    except FileNotFoundError:
        raise ValueError(f"acceptance profile {p}: no such file") from None
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"acceptance profile {p}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"acceptance profile {p}: expected a JSON object")
    if "format" in data:
        try:
            return AcceptanceProfile.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"]) or "<root>"
            raise ValueError(f"acceptance profile {p}: {loc}: {err['msg'].removeprefix('Value error, ')}") from None
    if "acceptance" in data:
        return profile_from_eval(data, str(p))
    raise ValueError(f"acceptance profile {p}: neither a profile (no 'format') nor `vllm-tfm eval` results (no 'acceptance')")


def save_profile(profile: AcceptanceProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.model_dump(mode="json"), indent=1) + "\n")

"""Verdicts of the tensor-parallel run (bench/gpu_tp2_e2e.py): pure functions of the phases' JSON.

Kept apart from the GPU script so that the CPU tests check them (tests/cpu/test_tp_verdicts.py):
token comparison with the first divergence of every differing prompt, the per-rank tree-check
counters, the Ray-actor placement of the workers and the mean accepted length from vLLM's
spec-decode counters.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

Tokens = Sequence[Sequence[int]]
WINDOW_BEFORE, WINDOW_AFTER = 4, 8  # tokens shown around a first divergence


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length if one is a
    prefix of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_tokens(a: Tokens | None, b: Tokens | None) -> dict[str, Any]:
    """Prompt-by-prompt comparison of two runs' generated tokens.

    ``equal`` is True only when both runs have tokens, the same number of prompts, and every
    prompt's tokens are identical. ``differing`` lists each differing prompt with its first
    divergence and a window of both sides around it.
    """
    if a is None or b is None:
        return {"equal": False, "reason": "tokens missing on the " + ("left" if a is None else "right"),
                "prompts": None, "identical_prompts": None, "differing": []}  # fmt: skip
    differing: list[dict[str, Any]] = []
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        j = first_divergence(x, y)
        if j is not None:
            lo, hi = max(0, j - WINDOW_BEFORE), j + WINDOW_AFTER
            differing.append({"prompt": i, "first_divergence": j, "len_a": len(x), "len_b": len(y),
                              "window_start": lo, "a": list(x[lo:hi]), "b": list(y[lo:hi])})  # fmt: skip
    same_count = len(a) == len(b)
    res: dict[str, Any] = {
        "equal": same_count and not differing and len(a) > 0,
        "prompts": min(len(a), len(b)),
        "identical_prompts": min(len(a), len(b)) - len(differing),
        "differing": differing,
    }
    if not same_count:
        res["reason"] = f"prompt counts differ: {len(a)} vs {len(b)}"
    elif not a:
        res["reason"] = "no prompts"
    return res


def tokens_digest(tokens: Tokens | None) -> str | None:
    """sha256 of the token lists (compact JSON), to tell runs apart without storing their tokens."""
    if tokens is None:
        return None
    return hashlib.sha256(json.dumps([list(t) for t in tokens], separators=(",", ":")).encode()).hexdigest()


def find_key(obj: Any, key: str) -> Any:
    """The value of ``key`` in a nested dict (depth first), or None."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = find_key(v, key)
            if found is not None:
                return found
    return None


def _same_positive_count(values: Sequence[Any]) -> bool:
    return all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in values) and len(set(values)) == 1


def tree_check_verdict(workers: Sequence[dict[str, Any]], tp: int) -> dict[str, Any]:
    """One report per rank, and every rank reports the same positive number of cross-rank tree
    checks (``tp_tree_checks`` in the runtime's metrics snapshot) and, where the runtime counts
    them (``tp_accept_checks``), of accepted-path checks."""
    checks = [find_key(w.get("tree_metrics"), "tp_tree_checks") for w in workers]
    accepts = [find_key(w.get("tree_metrics"), "tp_accept_checks") for w in workers]
    steps = [find_key(w.get("tree_metrics"), "tree_steps") for w in workers]
    ok = len(workers) == tp and _same_positive_count(checks)
    if any(a is not None for a in accepts):
        ok = ok and _same_positive_count(accepts)
    return {"ok": ok, "tp_tree_checks": checks, "tp_accept_checks": accepts, "tree_steps": steps}


def actor_verdict(
    workers: Sequence[dict[str, Any]], tp: int, driver_pid: int | None, proposal: str | None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One worker per rank, each in its own Ray actor and process (not the driver's), with the
    plugin and its runtime hooks loaded, the expected tree proposal (None: no speculation) and the
    driver's ``env`` variables present in the worker's ``VLLM_TFM_*`` environment."""
    problems: list[str] = []
    if len(workers) != tp:
        problems.append(f"{len(workers)} workers for tp={tp}")
    actors = [w.get("ray_actor_id") for w in workers]
    if not all(isinstance(a, str) and a and not a.startswith("error") for a in actors):
        problems.append(f"not every worker is in a Ray actor: {actors}")
    elif len(set(actors)) != len(actors):
        problems.append(f"workers share a Ray actor: {actors}")
    pids = [w.get("pid") for w in workers]
    if len(set(pids)) != len(pids) or driver_pid in pids:
        problems.append(f"worker pids not distinct from each other and the driver ({driver_pid}): {pids}")
    ranks = sorted(r for r in (w.get("rank") for w in workers) if r is not None)
    if ranks != list(range(tp)):
        problems.append(f"ranks {ranks}, expected 0..{tp - 1}")
    for i, w in enumerate(workers):
        if w.get("error"):
            problems.append(f"worker {i}: {w['error']}")
        if not (w.get("plugin_registered") and w.get("runtime_installed")):
            problems.append(f"worker {i}: plugin_registered={w.get('plugin_registered')} runtime_installed={w.get('runtime_installed')}")
        got = (w.get("options") or {}).get("proposal")
        if proposal is not None and got != proposal:
            problems.append(f"worker {i}: proposal {got!r}, expected {proposal!r}")
        for k, v in (env or {}).items():
            if (w.get("tfm_env") or {}).get(k) != v:
                problems.append(f"worker {i}: {k}={(w.get('tfm_env') or {}).get(k)!r}, expected {v!r}")
    return {"ok": not problems, "problems": problems, "actors": actors, "pids": pids}


def mean_accepted_length(counters: dict[str, Any] | None) -> float | None:
    """1 + accepted draft tokens / drafts, from vLLM's ``vllm:spec_decode_*`` counters."""
    if not counters:
        return None
    drafts = counters.get("vllm:spec_decode_num_drafts")
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens")
    if not isinstance(drafts, int | float) or not isinstance(accepted, int | float) or drafts <= 0:
        return None
    return 1.0 + accepted / drafts


def _ran(phase: dict[str, Any] | None) -> bool:
    return bool(phase) and "skipped" not in phase


def tp_verdicts(phases: dict[str, dict[str, Any]], tp: int = 2, check_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Verdicts of the run from its phases' JSON (``tp1_tfm``, ``tp2_nospec``, ``tp2_tfm`` and,
    optionally, ``tp2_ddtree``; a phase that did not finish has an ``error``).

    ``all_ok`` needs: TP=tp tfm tokens == TP=tp no-spec tokens (speculation exact under TP);
    every rank's tree checks positive and equal; one worker per rank, each in its own Ray actor,
    with the plugin, proposal ``tfm`` and ``check_env`` seen there; and TP=tp tfm == TP=1 tfm,
    unless TP=1 and TP=tp already differ without speculation (reduction order under TP changes
    float rounding: then the tfm runs must differ exactly where the no-spec runs do, which
    tfm == no-spec at TP=tp implies). A ``tp2_ddtree`` phase that ran must pass the same checks.
    """
    tp1, tfm, nospec = phases.get("tp1_tfm") or {}, phases.get("tp2_tfm") or {}, phases.get("tp2_nospec") or {}
    cmp = {
        "tp2_tfm_vs_tp1_tfm": compare_tokens(tp1.get("tokens"), tfm.get("tokens")),
        "tp2_tfm_vs_tp2_nospec": compare_tokens(nospec.get("tokens"), tfm.get("tokens")),
        "tp1_tfm_vs_tp2_nospec": compare_tokens(tp1.get("tokens"), nospec.get("tokens")),
    }
    v: dict[str, Any] = {
        "tp2_tfm_equals_tp1_tfm": cmp["tp2_tfm_vs_tp1_tfm"]["equal"],
        "tp2_tfm_equals_tp2_nospec": cmp["tp2_tfm_vs_tp2_nospec"]["equal"],
        "tp1_tfm_equals_tp2_nospec": cmp["tp1_tfm_vs_tp2_nospec"]["equal"],  # information: TP numerics
        "tp_tree_checks": tree_check_verdict(tfm.get("workers") or [], tp),
        "workers_in_distinct_actors": actor_verdict(tfm.get("workers") or [], tp, tfm.get("driver_pid"), "tfm", check_env),
    }
    v["tp1_difference_explained_by_tp_numerics"] = (
        not v["tp2_tfm_equals_tp1_tfm"] and v["tp2_tfm_equals_tp2_nospec"]
        and tp1.get("tokens") is not None and not v["tp1_tfm_equals_tp2_nospec"]
    )  # fmt: skip
    ok = [
        v["tp2_tfm_equals_tp2_nospec"],
        v["tp_tree_checks"]["ok"],
        v["workers_in_distinct_actors"]["ok"],
        v["tp2_tfm_equals_tp1_tfm"] or v["tp1_difference_explained_by_tp_numerics"],
    ]
    ddt = phases.get("tp2_ddtree")
    if _ran(ddt):
        assert ddt is not None
        cmp["tp2_ddtree_vs_tp2_nospec"] = compare_tokens(nospec.get("tokens"), ddt.get("tokens"))
        cmp["tp2_ddtree_vs_tp2_tfm"] = compare_tokens(tfm.get("tokens"), ddt.get("tokens"))
        v["tp2_ddtree_equals_tp2_nospec"] = cmp["tp2_ddtree_vs_tp2_nospec"]["equal"]
        v["tp2_ddtree_tree_checks"] = tree_check_verdict(ddt.get("workers") or [], tp)
        v["tp2_ddtree_workers_in_distinct_actors"] = actor_verdict(
            ddt.get("workers") or [], tp, ddt.get("driver_pid"), "ddtree", check_env)
        ok += [v["tp2_ddtree_equals_tp2_nospec"], v["tp2_ddtree_tree_checks"]["ok"],
               v["tp2_ddtree_workers_in_distinct_actors"]["ok"]]  # fmt: skip
    v["mean_accepted_length"] = {
        name: mean_accepted_length(ph.get("spec_counters")) for name, ph in phases.items() if ph and "spec_counters" in ph
    }
    v["errors"] = {name: ph["error"] for name, ph in phases.items() if ph and ph.get("error")}
    v["all_ok"] = all(ok) and not v["errors"]
    return {"verdicts": v, "comparisons": cmp}

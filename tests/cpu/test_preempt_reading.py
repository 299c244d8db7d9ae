"""Logic of the preemption diagnostic (bench/preempt_reading.py, bench/gpu_preempt_repro.py's driver).

Hand-made tokens with planted divergences, preemption logs and resume counts keyed by vLLM's
internal request ids ("<external>-<suffix>"): the mapping to prompts, the first divergence with its
position relative to the request's preemptions and the reference margin there, and the reading
of which hypotheses a pattern over the arms supports.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_preempt_repro
import preempt_reading as pr

REF = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24]]
IDS = ["0", "1", "2", "3"]


def planted(changes: dict[int, int]) -> list[list[int]]:
    """REF with prompt i changed from position changes[i] on (token 99 there, then 98s)."""
    out = [list(t) for t in REF]
    for i, pos in changes.items():
        out[i][pos:] = [99] + [98] * (len(out[i]) - pos - 1)
    return out


def topk(margins: dict[tuple[int, int], float]) -> list[list[list[list[float]]]]:
    """Reference top-3 per position: the reference token first, 99 second at -margin below, 50 third."""
    return [[[[tok, -1.0], [99, -1.0 - margins.get((i, p), 2.0)], [50, -9.0]] for p, tok in enumerate(t)]
            for i, t in enumerate(REF)]


def test_first_divergence() -> None:
    assert pr.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert pr.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert pr.first_divergence([1, 2, 3], [1, 2]) == 2


def test_internal_ids_map_to_prompts() -> None:
    index = pr.prompt_index_of(["10", "11", "12"])
    assert index == {"10": 0, "11": 1, "12": 2}
    counts = pr.per_prompt_counts({"11-ab12cd34": 2, "12": 1, "7-deadbeef": 3}, index)
    assert counts == {1: 2, 2: 1, -1: 3}  # the unknown id is kept visible under -1
    log = [{"request_id": "12-0000aaaa", "num_output_tokens": 9}, {"request_id": "12-0000aaaa", "num_output_tokens": 3},
           {"request_id": "10-ffff0000", "num_output_tokens": 0}]
    assert pr.per_prompt_preemptions(log, index) == {2: [3, 9], 0: [0]}
    with pytest.raises(ValueError, match="duplicate request ids"):
        pr.prompt_index_of(["1", "1"])


def test_compare_arm_places_divergences_relative_to_preemptions() -> None:
    arm = planted({1: 3, 2: 1, 3: 4})
    cmp = pr.compare_arm(REF, arm, ref_topk=topk({(1, 3): 0.08, (2, 1): 1e-4}),
                         preemptions={1: [3], 2: [4], 3: [0, 2]}, resumed={1: 1, 2: 1, 3: 2})
    assert cmp["identical"] == 1 and cmp["compared"] == 4
    assert cmp["divergent_indices"] == [1, 2, 3]
    d1, d2, d3 = cmp["divergent"]
    assert (d1["pos"], d1["ref"], d1["arm"], d1["after_preemption"], d1["since_resume"]) == (3, 10, 99, True, 0)
    assert d1["ref_margin"] == pytest.approx(0.08) and d1["arm_rank"] == 1
    assert d2["after_preemption"] is False and d2["since_resume"] is None  # preempted only after it diverged
    assert d2["ref_margin"] == pytest.approx(1e-4)
    assert d3["since_resume"] == 2 and d3["resumed"] == 2
    assert cmp["divergent_after_preemption"] == 2 and cmp["divergent_at_resume_token"] == 1
    assert cmp["divergent_near_tie"] == 1 and cmp["divergent_never_preempted"] == 0
    with pytest.raises(ValueError, match="4 reference prompts but 3"):
        pr.compare_arm(REF, arm[:3])


def arm(tokens: list[list[int]] | None, preemptions: dict[int, list[int]], n_pre: float, **extra: object) -> dict:
    if tokens is None:
        return {"skipped": "10 s left"}
    return {"comparison": pr.compare_arm(REF, tokens, ref_topk=topk({}), preemptions=preemptions), "preemptions": n_pre,
            **extra}


def test_reading_resumed_only_points_to_a() -> None:
    arms = {
        "tfm_small": arm(planted({1: 3, 3: 4}), {1: [2], 3: [4], 0: [1]}, 3.0,
                         tree_metrics={"accepted_restored": 0, "states_moved": 0}),
        "nospec_small": arm([list(t) for t in REF], {2: [1]}, 1.0),
        "dflash_small": arm([list(t) for t in REF], {2: [1]}, 2.0),
        "tfm_big": arm([list(t) for t in REF], {}, 0.0),
        "tfm_small_torch": arm(planted({1: 3}), {1: [3]}, 2.0),
        "tfm_small_chain_forced": arm(None, {}, 0.0),
    }
    r = pr.reading(arms)
    assert r["support"]["a"].startswith("supported")
    assert r["support"]["b"].startswith("not indicated")
    assert r["support"]["c"].startswith("refuted")
    assert "not_preemption" not in r["support"]
    assert r["support"]["kernels"].startswith("not kernel-specific")
    assert "trees" not in r["support"] and r["states"]["tfm_small_chain_forced"] == "skipped"


def test_reading_live_corruption_and_vllm_side() -> None:
    arms = {
        "tfm_small": arm(planted({0: 2, 2: 1}), {0: [4]}, 1.0, tree_metrics={"accepted_restored": 3, "states_moved": 1}),
        "nospec_small": arm(planted({2: 5}), {2: [3]}, 2.0),
        "dflash_small": {"error": "ValueError: boom"},
        "tfm_big": arm(planted({0: 2}), {}, 0.0),
        "tfm_small_torch": arm([list(t) for t in REF], {1: [2]}, 2.0),
        "tfm_small_chain_forced": arm([list(t) for t in REF], {1: [2]}, 2.0),
    }
    r = pr.reading(arms)
    assert r["support"]["a"].startswith("not alone")
    assert r["support"]["b"].startswith("supported")
    assert r["support"]["c"] == "supported: nospec_small diverge too (vLLM-side under preemption)"
    assert r["support"]["not_preemption"].startswith("tfm_big diverges")
    assert r["support"]["d"].startswith("possible")
    assert r["support"]["kernels"].startswith("the NVRTC kernels are implicated")
    assert r["support"]["trees"].startswith("specific to tree proposals")
    assert r["states"]["dflash_small"] == "failed"


def test_reading_near_ties_are_not_corruption() -> None:
    tfm = arm(planted({2: 1}), {}, 2.0)
    tfm["comparison"] = pr.compare_arm(REF, planted({2: 1}), ref_topk=topk({(2, 1): 1e-4}), preemptions={})
    r = pr.reading({"tfm_small": tfm, "nospec_small": arm([list(t) for t in REF], {}, 0.0)})
    assert r["support"]["b"].startswith("not indicated")
    assert r["support"]["c"].startswith("undecided")
    assert any("nospec_small: identical but saw NO preemption" in ln for ln in r["lines"])


def test_reading_without_tfm_small() -> None:
    r = pr.reading({"tfm_small": {"skipped": "5 s left"}})
    assert r["support"] == {} and r["lines"] == ["tfm_small skipped: no reading"]


def test_driver_args_and_workload() -> None:
    args = gpu_preempt_repro.parse_args(["--arms", "tfm_big,tfm_small", "--out", "/tmp/x"])
    assert args.arm_list == ["nospec_big", "tfm_small", "tfm_big"]  # the reference first, canonical order
    with pytest.raises(SystemExit):
        gpu_preempt_repro.parse_args(["--arms", "tfm_smal"])
    w = gpu_preempt_repro.make_prompts(str(ROOT / "zoo" / "target"), n=8, max_prompt=700)
    assert [len(p) for p in w["prompts"]] == w["lengths"] and len(w["lengths"]) == 8
    assert min(w["lengths"]) >= 16 and max(w["lengths"]) <= 700
    assert sum(n > 400 for n in w["lengths"]) == 2 and sum(n <= 64 for n in w["lengths"]) == 2

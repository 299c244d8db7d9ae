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
    w = gpu_preempt_repro.make_prompts(str(ROOT / "zoo" / "target"), n=8, max_prompt=256, max_tokens=768)
    lens, outs = w["lengths"], w["max_tokens"]
    assert [len(p) for p in w["prompts"]] == lens and len(lens) == 8 and len(outs) == 8
    assert all(691 <= m <= 768 for m in outs)
    assert all(16 <= n <= 96 for i, n in enumerate(lens[:-1]) if i % 4 != 3) and 128 <= lens[3] <= 256
    assert 1021 <= lens[-1] + outs[-1] <= 1024  # the last request ends just short of max_model_len
    assert gpu_preempt_repro.arm_timeout("nospec_big", first=True) == gpu_preempt_repro.COLD_START_S + 60
    assert gpu_preempt_repro.arm_timeout("tfm_small", first=False) == gpu_preempt_repro.WARM_START_S + 150


def test_near_max_workload() -> None:
    w = gpu_preempt_repro.make_prompts(str(ROOT / "zoo" / "target"), n=12, workload="near-max")
    lens, outs = w["lengths"], w["max_tokens"]
    assert w["workload"] == "near-max" and [len(p) for p in w["prompts"]] == lens
    long_idx = [i for i, n in enumerate(lens) if n > 96]
    assert long_idx == [3, 7, 11]
    assert [outs[i] for i in long_idx] == list(gpu_preempt_repro.NEAR_MAX_LONG_OUTPUTS)
    # each long request ends one token short of max_model_len: the drafter (B + 1 query tokens) no longer fits
    assert all(lens[i] + outs[i] == gpu_preempt_repro.MAX_MODEL_LEN - 1 for i in long_idx)
    assert all(16 <= lens[i] <= 96 and 180 <= outs[i] <= 200 for i in range(12) if i not in long_idx)
    with pytest.raises(ValueError, match="workload 'nearmax': choose one of"):
        gpu_preempt_repro.make_prompts(str(ROOT / "zoo" / "target"), workload="nearmax")
    args = gpu_preempt_repro.parse_args(["--arms", "tfm_big_chain,dflash_big,tfm_big"])
    assert args.arm_list == ["nospec_big", "tfm_big", "dflash_big", "tfm_big_chain"]


def test_stagger_workload() -> None:
    w = gpu_preempt_repro.make_prompts(str(ROOT / "zoo" / "target"), n=12, workload="stagger")
    lens, outs, arrive = w["lengths"], w["max_tokens"], w["arrive_step"]
    assert [len(p) for p in w["prompts"]] == lens and len(arrive) == 12
    assert arrive[:6] == [0] * 6 and arrive[6:] == [6, 10, 14, 18, 22, 26]
    assert all(24 <= outs[i] <= 40 for i in range(3)) and all(240 <= outs[i] <= 260 for i in range(3, 6))
    # late prompts fit the decode class of vLLM's reorder (at most 1 + B = 17 tokens)
    assert all(3 <= lens[i] <= 14 for i in range(6, 12)) and all(16 <= lens[i] <= 96 for i in range(6))
    assert gpu_preempt_repro.make_prompts(str(ROOT / "zoo" / "target"), n=4)["arrive_step"] == [0] * 4


def test_plain_front_workload() -> None:
    w = gpu_preempt_repro.make_prompts(str(ROOT / "zoo" / "target"), n=12, workload="plain-front")
    lens, outs = w["lengths"], w["max_tokens"]
    mml, budget = gpu_preempt_repro.MAX_MODEL_LEN, gpu_preempt_repro.BUDGET
    assert outs[:6] == [3, 4, 5, 6, 7, 8] and outs[6:10] == [90] * 4 and outs[10:] == [14, 14]
    # the long prompts leave no room for the drafter's 1 + B query tokens from the first decode step
    assert all(lens[i] + outs[i] == mml - 1 and lens[i] + budget + 1 > mml for i in (10, 11))
    # the short requests end inside that window, the spec rows behind them outlive it
    assert max(outs[:6]) < outs[10] < outs[6] and all(16 <= n <= 96 for n in lens[:10])


def test_sampling_kinds_of_the_mixed_arm() -> None:
    plain = gpu_preempt_repro.sampling_kinds(12, mixed=False)
    assert plain == [{"temperature": 0.0}] * 12
    mixed = gpu_preempt_repro.sampling_kinds(12, mixed=True)
    sampled = [i for i, k in enumerate(mixed) if k["temperature"]]
    assert sampled == [1, 4, 7, 10] and [mixed[i]["temperature"] for i in sampled] == [0.8, 1.3, 0.8, 1.3]
    assert [mixed[i]["seed"] for i in sampled] == [1001, 1004, 1007, 1010]
    assert [i for i, k in enumerate(mixed) if "abort_after" in k] == [1, 4]
    assert [gpu_preempt_repro.kind_label(mixed[i]) for i in (0, 1, 7)] == ["greedy", "t=0.8 seed=1001 aborted",
                                                                           "t=0.8 seed=1007"]


def test_compare_only_the_greedy_prompts_of_a_mixed_arm() -> None:
    arm_tokens = planted({0: 1, 1: 2, 3: 0})  # prompt 1 is sampled there: its difference is not a divergence
    cmp = pr.compare_arm(REF, arm_tokens, only=[0, 2, 3])
    assert cmp["compared"] == 3 and cmp["identical"] == 1 and cmp["divergent_indices"] == [0, 3]
    with pytest.raises(ValueError, match="outside the 4 compared"):
        pr.compare_arm(REF, arm_tokens, only=[0, 4])


def test_reading_of_the_mixed_arm() -> None:
    same = [list(t) for t in REF]
    mixed = {"comparison": pr.compare_arm(REF, planted({2: 3}), ref_topk=topk({}), preemptions={2: [1]}, only=[0, 2, 3]),
             "preemptions": 4.0}
    r = pr.reading({"tfm_small": arm(same, {1: [2]}, 2.0), "tfm_mixed": mixed})
    assert r["support"]["mixed"].startswith("supported: greedy requests diverge only in the mixed batch")
    assert "tfm_mixed: greedy 2/3 identical, divergent [2] (1 after a preemption of that request, 0 near ties; 4.0 preemptions)" in r["lines"]
    r = pr.reading({"tfm_small": arm(planted({1: 3}), {1: [2]}, 2.0), "tfm_mixed": arm(same, {}, 0.0)})
    assert r["support"]["mixed"].startswith("not needed")
    assert any(ln.startswith("tfm_mixed: greedy 4/4 identical") and ln.endswith("(inconclusive)") for ln in r["lines"])
    r = pr.reading({"tfm_small": {"skipped": "x"}, "tfm_mixed": mixed})
    assert r["lines"][0] == "tfm_small skipped: no reading" and r["lines"][1].startswith("tfm_mixed: greedy 2/3")


def test_driver_summary_of_a_traced_mixed_arm(tmp_path, monkeypatch) -> None:
    """arm_summary on written arm files: the mixed arm is compared on its greedy prompts only, its
    divergence gets the request trace read at it; a divergence makes the conditional arms run."""
    import json

    monkeypatch.setattr(gpu_preempt_repro, "WORK", tmp_path)
    ids = ["0", "1", "2", "3"]
    (tmp_path / "nospec_big.json").write_text(json.dumps({"tokens": REF, "request_ids": ids}))
    trace = tmp_path / "trace_tfm_mixed"
    trace.mkdir()
    recs = [{"s": 0, "r": "2-0a0b0c0d", "row": 0, "n": 30, "d": 0, "spec": 0, "path": "plain", "no": 0, "out": [13], "acc": 0,
             "new": 1, "t": 0.0},
            {"s": 0, "r": "1-11111111", "row": 1, "n": 9, "d": 0, "spec": 0, "path": "plain", "no": 0, "out": [7], "acc": 0,
             "new": 1, "t": 0.8},
            {"s": 1, "r": "3-33333333", "row": 0, "n": 1, "d": 0, "spec": 0, "path": "chains", "no": 0, "out": [19], "acc": 0,
             "t": 0.0},  # a chain step with a plain row in front of request 0's spec row
            {"s": 1, "r": "0-00000000", "row": 1, "n": 5, "d": 4, "spec": 1, "path": "chains", "no": 0, "out": [1], "acc": 0,
             "t": 0.0},
            {"s": 3, "r": "2-0a0b0c0d", "row": 0, "n": 17, "d": 16, "spec": 1, "path": "tree", "tree": 1, "dep": 3, "no": 1,
             "out": [14, 15, 99], "acc": 2, "back": 1, "a0": 1, "a": 3, "fix": "restore", "t": 0.0}]  # fmt: skip
    (trace / "trace-9.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    mixed = {"tokens": planted({1: 0, 2: 3}), "request_ids": ids, "greedy": [0, 2, 3],
             "kinds": ["greedy", "t=0.8 seed=1001", "greedy", "greedy"], "trace_dir": str(trace), "preemptions": 3.0,
             "preempt_log": [{"request_id": "2-0a0b0c0d", "num_output_tokens": 1}]}  # fmt: skip
    (tmp_path / "tfm_mixed.json").write_text(json.dumps(mixed))
    (tmp_path / "tfm_small.json").write_text(json.dumps({"tokens": REF, "request_ids": ids, "preemptions": 2.0}))
    runs = {"nospec_big": {}, "tfm_small": {"rc": 0}, "tfm_mixed": {"rc": 0}}
    s = gpu_preempt_repro.arm_summary("tfm_mixed", runs["tfm_mixed"], json.loads((tmp_path / "nospec_big.json").read_text()))
    c = s["comparison"]
    assert c["compared"] == 3 and c["divergent_indices"] == [2] and s["trace"]["records"] == 5
    assert s["trace"]["mixed_steps"] == {"mixed_non_tree_steps": 1, "misordered_mixed_steps": 1, "requests_behind_plain_row": [0],
                                         "first_misordered": [{"f": 0, "s": 1, "path": "chains", "plain_rows": [0],
                                                               "spec_rows_behind": 1}]}  # fmt: skip
    (d,) = c["divergent"]
    assert d["pos"] == 3 and d["preempted_at"] == [1] and d["since_resume"] == 2
    rd = d["trace"]["reading"]
    assert rd["step"] == 3 and rd["token_in_step"] == 2 and rd["token_kind"] == "bonus"
    assert rd["left_out_before"] == [3] and rd["offsets_fixed_before"] == ["3:restore"] and rd["behind_plain_row_before"] == []
    assert d["trace"]["step_mates"][0]["others"] == [{"i": 1, "kind": "t=0.8 seed=1001", "n": 9, "d": 0, "t": 0.8, "new": 1,
                                                      "acc": 0}]  # fmt: skip
    assert gpu_preempt_repro.tfm_diverged(runs) is True
    assert gpu_preempt_repro.tfm_diverged({"nospec_big": {}, "tfm_small": {"rc": 0}}) is False
    assert gpu_preempt_repro.tfm_diverged({"nospec_big": {}}) is None


class _FakeLLM:
    """What gpu_preempt_repro.generate uses of vLLM 0.26's LLM, one token per request per step:
    ``enqueue`` returns internal ids ("<counter>-<suffix>"), ``llm_engine.step`` returns final
    outputs only (LLM's FINAL_ONLY) under the external id, ``abort_request`` takes internal ids;
    the scheduler's requests count their output tokens."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.ns = SimpleNamespace
        self.reqs: dict[str, SimpleNamespace] = {}
        self.llm_engine = self
        self.scheduler = SimpleNamespace(requests=self.reqs)

    def enqueue(self, prompts, params, use_tqdm=True):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self.reqs[f"{i}-0badf00d"] = self.ns(prompt=p["prompt_token_ids"], max=sp.max_tokens, output_token_ids=[], done=False)
        return list(self.reqs)

    def has_unfinished_requests(self):
        return any(not r.done for r in self.reqs.values())

    def abort_request(self, ids, internal=False):
        assert internal
        for rid in ids:
            self.reqs.pop(rid)

    def step(self):
        outs = []
        for rid, r in self.reqs.items():
            if r.done:
                continue
            r.output_token_ids.append(r.prompt[0] * 100 + len(r.output_token_ids))
            r.done = len(r.output_token_ids) >= r.max
            if r.done:
                outs.append(self.ns(request_id=rid.rpartition("-")[0], finished=True,
                                    outputs=[self.ns(token_ids=list(r.output_token_ids), logprobs=None)]))
        return outs


def test_generate_aborts_requests_mid_stream_and_keeps_prompt_order() -> None:
    from types import SimpleNamespace

    llm = _FakeLLM()
    params = [SimpleNamespace(max_tokens=m) for m in (5, 9, 4)]
    obs = SimpleNamespace(scheduler=llm.scheduler)
    out = gpu_preempt_repro.generate(llm, [[1], [2], [3]], params, {1: 3}, obs)
    assert out["tokens"] == [[100, 101, 102, 103, 104], [], [300, 301, 302, 303]]
    assert out["aborted"] == [1] and out["request_ids"] == ["0", "1", "2"] and out["topk"] is None
    assert out["internal_ids"] == ["0-0badf00d", "1-0badf00d", "2-0badf00d"]


def test_small_kv_of_a_one_slot_engine_is_sized_for_its_one_gdn_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    target, drafter = str(ROOT / "zoo" / "target"), str(ROOT / "zoo" / "drafter")
    monkeypatch.setenv("VLLM_TFM_GDN_STATE_SLOTS", "per_draft")
    per_draft = {a: gpu_preempt_repro.kv_bytes(a, target, drafter, 1024) for a in ("tfm_small", "dflash_small")}
    monkeypatch.setenv("VLLM_TFM_GDN_STATE_SLOTS", "one")
    one = {a: gpu_preempt_repro.kv_bytes(a, target, drafter, 1024) for a in ("tfm_small", "dflash_small")}
    monkeypatch.delenv("VLLM_TFM_GDN_STATE_SLOTS")  # the plugin's default at tensor parallelism 1: one slot
    assert {a: gpu_preempt_repro.kv_bytes(a, target, drafter, 1024) for a in ("tfm_small", "dflash_small")} == one
    assert one["dflash_small"] == per_draft["dflash_small"]  # vLLM's own method: the plugin's switch does not apply
    assert (one["tfm_small"]["gdn_state_slots"], per_draft["tfm_small"]["gdn_state_slots"]) == ("one", "per_draft")
    budget = gpu_preempt_repro.BUDGET
    import soak

    expect = soak.estimate_request_kv_bytes(target, drafter, budget, 1024, gdn_state_slots="one")
    assert one["tfm_small"]["bytes_per_request"] == expect < per_draft["tfm_small"]["bytes_per_request"]

"""bench/gpu_graphs_e2e.py on CPU: the engine configs it asks vLLM for (through the plugin's
config-time decisions) and its verdicts on made-up runs (equal, diverging, failed, graphs unused)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_graphs_e2e as g

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _vllm_plugin_env import vllm_cpu_session

    with vllm_cpu_session(tmp_path_factory.mktemp("graphs-bench") / "vllm-cache"):
        yield


def test_engine_configs(session: Any) -> None:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    def args(name: str) -> Any:
        a = EngineArgs(**g.engine_kwargs(name, str(g.ZOO / "target"), str(g.ZOO / "drafter"), 32))
        a.create_speculative_config(a.create_model_config(), ParallelConfig())
        return a

    def mode(a: Any) -> str | None:
        m = a.compilation_config.cudagraph_mode
        return None if m is None else m.name

    tfm = args("tfm-graphs")
    assert mode(tfm) == "PIECEWISE" and not tfm.enforce_eager and tfm.dtype == "float32"
    assert tfm.compilation_config.cudagraph_capture_sizes == [1, 2, 4, 8, *(33 * k for k in range(1, 9))]
    assert args("tfm-eager").enforce_eager and mode(args("tfm-fullpw")) == "FULL_AND_PIECEWISE"
    nospec = args("nospec-graphs")
    assert mode(nospec) == "PIECEWISE" and nospec.compilation_config.cudagraph_capture_sizes is None  # vLLM's own
    assert args("nospec-eager").speculative_config is None
    assert nospec.async_scheduling is None  # vLLM's default
    assert args("tfm-fullpw").async_scheduling is False and args("tfm-eager").async_scheduling is False  # pinned


def test_the_async_engine_asks_for_asynchronous_scheduling(session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    kw = g.engine_kwargs("tfm-fullpw-async", str(g.ZOO / "target"), str(g.ZOO / "drafter"), 32)
    assert kw["async_scheduling"] is True and kw["compilation_config"] == {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert "env" not in g.ENGINES["tfm-fullpw-async"]  # the engine argument alone asks for it
    for name in [k for k in os.environ if k.startswith("VLLM_TFM_")]:
        monkeypatch.delenv(name)
    a = EngineArgs(**kw)
    assert a.create_speculative_config(a.create_model_config(), ParallelConfig()).method == "tfm"
    assert ("tfm-fullpw-async", "nospec-graphs") in g.REQUIRED and ("tfm-fullpw", "tfm-fullpw-async") in g.REQUIRED
    assert "tfm-fullpw-async" in g.GRAPH_ENGINES
    eager = g.engine_kwargs("tfm-eager-async", str(g.ZOO / "target"), str(g.ZOO / "drafter"), 32)
    assert eager["async_scheduling"] is True and eager["enforce_eager"] is True
    assert "env" not in g.ENGINES["tfm-eager-async"] and ("tfm-eager", "tfm-eager-async") in g.INFORMATIONAL


def test_the_zoo_vl_target_builds_as_the_vision_language_architecture(session: Any, tmp_path: Path) -> None:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    target = g.zoo_vl_target(tmp_path)
    assert g.is_vl_target(target) and not g.is_vl_target(g.ZOO / "target")
    kw = g.engine_kwargs("tfm-fullpw-async", str(target), str(g.ZOO / "drafter"), 32)
    assert kw["limit_mm_per_prompt"] == {"image": 0, "video": 0} and kw["async_scheduling"] is True
    assert "limit_mm_per_prompt" not in g.engine_kwargs("tfm-fullpw-async", str(g.ZOO / "target"), str(g.ZOO / "drafter"), 32)
    a = EngineArgs(**kw)
    mc = a.create_model_config()
    assert mc.architectures == ["Qwen3_5ForConditionalGeneration"] and mc.is_multimodal_model
    assert a.create_speculative_config(mc, ParallelConfig()).method == "tfm"


def run(b8: list[list[int]], b1: list[list[int]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"status": "ok", "b8": b8, "b1": b1 if b1 is not None else b8, "waves": b8, **extra}


def test_verdicts_and_graph_usage() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    piecewise = {"b8_graph_steps": {"cudagraph.tree.PIECEWISE": 5, "cudagraph.other.PIECEWISE": 2},
                 "b1_graph_steps": {"cudagraph.tree.PIECEWISE": 9}}
    runs = {
        "nospec-eager": run(ref, b8_margins=[[0.5] * 4, [0.5, 0.5, 1e-6, 0.5]]),
        "nospec-graphs": run(ref),
        "tfm-eager": run([[1, 2, 3, 4], [5, 6, 0, 8]], ref),  # a near-tie flip at batch 8
        "tfm-graphs": run(ref, [[1, 2, 3, 4], [5, 6, 9, 8]], **piecewise),
    }
    v = g.verdicts(runs)
    assert set(v) == {"tfm-graphs == nospec-graphs", "tfm-graphs == tfm-eager", "tfm-eager == nospec-eager",
                      "nospec-graphs == nospec-eager"}  # tfm-fullpw was not run: its pair is left out
    assert v["nospec-graphs == nospec-eager"]["equal"] and v["nospec-graphs == nospec-eager"]["required"] is False
    flip = v["tfm-eager == nospec-eager"]
    assert not flip["equal"] and not flip["b8"]["equal"] and flip["b1"]["equal"]
    assert flip["b8"]["divergences"] == [{"prompt": 1, "pos": 2, "expected": [5, 6, 7, 8], "got": [5, 6, 0, 8],
                                          "nospec_top2_margin": 1e-6, "lengths": [4, 4]}]
    bad = v["tfm-graphs == nospec-graphs"]
    assert not bad["equal"] and bad["b8"]["equal"] and bad["b1"]["prompts_differing"] == 1
    assert bad["b1"]["divergences"] == [{"prompt": 1, "pos": 2, "expected": [5, 6, 7, 8], "got": [5, 6, 9, 8],
                                         "nospec_top2_margin": None, "lengths": [4, 4]}]  # margins: b8 only
    usage = g.graph_usage(runs)
    assert usage == {"tfm-graphs": {"counts": {"cudagraph.tree.PIECEWISE": 14, "cudagraph.other.PIECEWISE": 2},
                                    "cudagraph_mode": None, "ok": True}}
    # an engine that failed has no tokens: its pairs are unequal; tree steps without graphs fail the usage check
    runs["tfm-fullpw"] = {"status": "error", "b8_graph_steps": {"cudagraph.tree.NONE": 3}}
    v = g.verdicts(runs)
    assert not v["tfm-fullpw == nospec-graphs"]["equal"]
    assert v["tfm-fullpw == nospec-graphs"]["b8"] == {"missing": ["tfm-fullpw"]}
    assert g.graph_usage(runs)["tfm-fullpw"]["ok"] is False


def test_graph_usage_wants_full_tree_steps_of_the_full_and_piecewise_engine() -> None:
    def engine(counts: dict[str, int]) -> dict[str, object]:
        return {"status": "ok", "b8_graph_steps": counts, "b1_graph_steps": {}}

    full = {"cudagraph.tree.FULL": 9, "cudagraph.tree.PIECEWISE": 4, "cudagraph.other.PIECEWISE": 2}
    usage = g.graph_usage({"tfm-fullpw": engine(full), "tfm-graphs": engine(full)})
    assert usage["tfm-fullpw"]["ok"] is True
    assert usage["tfm-graphs"]["ok"] is False  # the piecewise engine must never replay a full graph
    usage = g.graph_usage({"tfm-fullpw": engine({"cudagraph.tree.PIECEWISE": 13})})
    assert usage["tfm-fullpw"]["ok"] is False


def test_metadata_usage_wants_the_update_on_random_models_and_never_in_the_control() -> None:
    def engine(b8: int, b1: int, fast: int = 0) -> dict[str, object]:
        return {"status": "ok", "b8_paths": {g.METADATA_REUSED: b8} if b8 else {},
                "b1_paths": {g.METADATA_REUSED: b1, g.METADATA_FAST: fast}}

    runs = {"nospec-eager": engine(0, 0), "tfm-eager": engine(4, 9), "tfm-fullpw": engine(4, 9, 5),
            "tfm-fullpw-pergroup": engine(0, 0)}
    usage = g.metadata_usage(runs, "random")
    assert set(usage) == {"tfm-eager", "tfm-fullpw", "tfm-fullpw-pergroup"}  # no-spec has no tfm hooks
    assert usage["tfm-fullpw"] == {g.METADATA_REUSED: 13, g.METADATA_FAST: 5, "ok": True}
    assert usage["tfm-fullpw-pergroup"]["ok"] and usage["tfm-eager"]["ok"]
    runs["tfm-fullpw-pergroup"] = engine(0, 2)  # the switch did not take: the control reused metadata
    assert g.metadata_usage(runs, "random")["tfm-fullpw-pergroup"]["ok"] is False
    runs["tfm-fullpw"] = engine(0, 0, 5)  # on the random models (two GDN groups) the update must run
    assert g.metadata_usage(runs, "random")["tfm-fullpw"]["ok"] is False
    assert g.metadata_usage(runs, "zoo")["tfm-fullpw"]["ok"] is True  # the zoo has one GDN group


def test_metadata_usage_wants_fast_builds_only_where_full_graphs_run() -> None:
    def engine(fast: int) -> dict[str, object]:
        return {"status": "ok", "b8_paths": {g.METADATA_REUSED: 3}, "b1_paths": {g.METADATA_FAST: fast}}

    runs = {"tfm-fullpw": engine(0), "tfm-graphs": engine(0), "tfm-fullpw-pergroup": {"status": "ok"}}
    usage = g.metadata_usage(runs, "zoo")
    assert usage["tfm-fullpw"]["ok"] is False  # full graphs, all-spec steps: the fast build must have run
    assert usage["tfm-graphs"]["ok"] is True  # piecewise graphs only: vLLM's build, never the fast one
    assert usage["tfm-fullpw-pergroup"]["ok"] is True
    runs = {"tfm-fullpw": engine(7), "tfm-graphs": engine(2), "tfm-fullpw-pergroup": engine(1)}
    usage = g.metadata_usage(runs, "zoo")
    assert usage["tfm-fullpw"]["ok"] is True
    assert usage["tfm-graphs"]["ok"] is False and usage["tfm-fullpw-pergroup"]["ok"] is False


def test_the_per_group_control_is_a_required_bit_for_bit_pair() -> None:
    ref = [[1, 2, 3], [4, 5, 6]]
    runs = {"tfm-fullpw": run(ref), "tfm-fullpw-pergroup": run(ref, [[1, 2, 3], [4, 7, 6]])}
    v = g.verdicts(runs)["tfm-fullpw == tfm-fullpw-pergroup"]
    assert v["required"] and v["b8"]["equal"] and not v["b1"]["equal"] and not v["equal"]
    assert g.ENGINES["tfm-fullpw-pergroup"]["env"] == {"VLLM_TFM_GDN_METADATA_ONCE": "0"}
    assert g.graph_usage({"tfm-fullpw-pergroup": {"b8_graph_steps": {"cudagraph.tree.FULL": 3}}})[
        "tfm-fullpw-pergroup"]["ok"]


def test_deferred_usage_wants_placeholders_except_in_the_sync_control_and_the_same_acceptance() -> None:
    def engine(b8: int, b1: int, mal: tuple[float, float] = (3.5, 2.5)) -> dict[str, object]:
        return {"status": "ok", "b8_tree_metrics": {"placeholder_steps": b8, "mean_accepted_length": mal[0]},
                "b1_tree_metrics": {"placeholder_steps": b1, "mean_accepted_length": mal[1]},
                "waves_tree_metrics": {"placeholder_steps": 0, "mean_accepted_length": 3.25}}

    runs = {"nospec-eager": {"status": "ok"}, "tfm-eager": engine(5, 40), "tfm-fullpw": engine(5, 40),
            "tfm-fullpw-sync": engine(0, 0)}
    usage = g.deferred_usage(runs)
    assert set(usage) == {"tfm-eager", "tfm-fullpw", "tfm-fullpw-sync", "same_acceptance"}
    assert all(u["ok"] for u in usage.values()) and usage["tfm-fullpw"]["placeholder_steps"] == 45
    runs["tfm-fullpw-sync"] = engine(0, 1)  # the switch did not take
    assert g.deferred_usage(runs)["tfm-fullpw-sync"]["ok"] is False
    runs["tfm-fullpw-sync"] = engine(0, 0, (3.5, 2.4))  # other drafts reached the forward
    assert g.deferred_usage(runs)["same_acceptance"]["ok"] is False
    runs["tfm-fullpw"] = engine(0, 0)  # deferred drafts never ran in the default engine
    assert g.deferred_usage(runs)["tfm-fullpw"]["ok"] is False
    assert ("tfm-fullpw", "tfm-fullpw-sync") in g.REQUIRED
    assert g.ENGINES["tfm-fullpw-sync"]["env"] == {"VLLM_TFM_DEFERRED_DRAFTS": "0"}


def test_deferred_usage_of_the_async_engine_wants_no_handed_placeholders_and_reports_its_acceptance() -> None:
    """The -async engine's mean accepted length is reported, not required equal: asynchronous scheduling
    runs some requests a step past max_tokens (discarded tokens the tree metrics count, NOTES 50)."""
    def engine(b8: int, b1: int, mal: tuple[float, float] = (3.5, 2.5)) -> dict[str, object]:
        return {"status": "ok", "b8_tree_metrics": {"placeholder_steps": b8, "mean_accepted_length": mal[0]},
                "b1_tree_metrics": {"placeholder_steps": b1, "mean_accepted_length": mal[1]},
                "waves_tree_metrics": {"placeholder_steps": 0, "mean_accepted_length": 3.25}}

    runs = {"tfm-fullpw": engine(5, 40), "tfm-fullpw-async": engine(0, 0, (3.5, 2.6))}
    usage = g.deferred_usage(runs)
    assert set(usage) == {"tfm-fullpw", "tfm-fullpw-async"}
    assert all(u["ok"] for u in usage.values())
    assert g.acceptance_async(runs) == {"b8": [3.5, 3.5], "b1": [2.5, 2.6], "waves": [3.25, 3.25]}
    assert g.acceptance_async({"tfm-fullpw": engine(5, 40)}) is None
    runs["tfm-fullpw-async"] = engine(0, 3)  # the engine ran synchronously: its wrapper handed placeholders out
    assert g.deferred_usage(runs)["tfm-fullpw-async"]["ok"] is False


def test_zoo_prompts_are_a_fixed_file_in_the_zoo_vocabulary() -> None:
    """The zoo prompts come from bench/graphs_zoo_prompts.json, not from the live source files (whose
    edits changed the prompts, and the acceptance with them, from commit to commit)."""
    import json

    fixed = json.loads(g.PROMPT_FILE.read_text())["prompts"]
    ps = g.prompts(32)
    assert ps == fixed and len(ps) == 32 and all(5 <= len(p) <= 100 for p in ps)
    vocab = json.loads((g.ZOO / "target" / "config.json").read_text())["vocab_size"]
    assert all(0 <= t < vocab for p in ps for t in p)
    assert g.prompts(8) == ps[:8]
    with pytest.raises(SystemExit, match="holds 32 prompts"):
        g.prompts(33)


def test_the_topology_control_must_not_write_on_the_device_and_tfm_fullpw_must() -> None:
    def engine(n: int) -> dict:
        return {"b8_paths": {g.DEVICE_TOPOLOGY: n}, "b1_paths": {}}

    assert g.ENGINES["tfm-fullpw-hosttopo"]["env"] == {"VLLM_TFM_DEVICE_TOPOLOGY": "0"}
    assert ("tfm-fullpw", "tfm-fullpw-hosttopo") in g.REQUIRED
    usage = g.topology_usage({"tfm-fullpw": engine(5), "tfm-fullpw-hosttopo": engine(0), "tfm-eager": engine(0)})
    assert set(usage) == {"tfm-fullpw", "tfm-fullpw-hosttopo"} and all(u["ok"] for u in usage.values())
    assert not g.topology_usage({"tfm-fullpw": engine(0)})["tfm-fullpw"]["ok"]  # the kernel never ran
    assert not g.topology_usage({"tfm-fullpw-hosttopo": engine(2)})["tfm-fullpw-hosttopo"]["ok"]  # switch ignored


def test_one_slot_engines_must_commit_into_one_slot_and_the_others_never() -> None:
    def engine(n: int, m: int | None = None) -> dict:
        m = n if m is None else m
        return {"b8_paths": {g.ONE_SLOT_COMMITS: n, g.ONE_SLOT_INDICES: m}, "b1_paths": {},
                "waves_paths": {g.ONE_SLOT_COMMITS: n}}

    for name, copy in (("tfm-eager-oneslot", "tfm-eager"), ("tfm-fullpw-oneslot", "tfm-fullpw"),
                       ("tfm-fullpw-async-oneslot", "tfm-fullpw-async")):
        one, base = g.ENGINES[name], g.ENGINES[copy]
        assert one["env"] == {"VLLM_TFM_GDN_STATE_SLOTS": "one"}  # the engine it copies, with the option
        assert {k: v for k, v in one.items() if k != "env"} == {k: v for k, v in base.items() if k != "env"}
    assert {("tfm-eager-oneslot", "tfm-eager"), ("tfm-fullpw-oneslot", "tfm-fullpw"),
            ("tfm-fullpw-async-oneslot", "nospec-graphs")} <= set(g.REQUIRED)
    usage = g.one_slot_usage({"tfm-fullpw-oneslot": engine(7), "tfm-fullpw": engine(0), "nospec-graphs": engine(0)})
    assert set(usage) == {"tfm-fullpw-oneslot", "tfm-fullpw"} and all(u["ok"] for u in usage.values())
    assert usage["tfm-fullpw-oneslot"][g.ONE_SLOT_COMMITS] == 14
    assert not g.one_slot_usage({"tfm-eager-oneslot": engine(0)})["tfm-eager-oneslot"]["ok"]  # the option was lost
    assert not g.one_slot_usage({"tfm-eager": engine(3)})["tfm-eager"]["ok"]
    # the column-0 commit indices: taken by one-slot engines on the kernel path, never by the others
    assert usage["tfm-fullpw-oneslot"][g.ONE_SLOT_INDICES] == 7
    assert not g.one_slot_usage({"tfm-fullpw-oneslot": engine(7, 0)})["tfm-fullpw-oneslot"]["ok"]
    assert g.one_slot_usage({"tfm-fallback-oneslot": engine(5, 0)})["tfm-fallback-oneslot"]["ok"]  # torch reference ops
    assert not g.one_slot_usage({"tfm-fallback-oneslot": engine(5, 2)})["tfm-fallback-oneslot"]["ok"]
    assert not g.one_slot_usage({"tfm-fullpw": engine(0, 3)})["tfm-fullpw"]["ok"]


class FakeEngine:
    """vLLM's LLMEngine as run_waves uses it: every unfinished request runs each step and gains up to
    ``per_step`` tokens (a deterministic function of its prompt and position); ids get vLLM's random suffix."""

    def __init__(self, per_step: int, max_seqs: int = 8) -> None:
        self.per_step, self.max_seqs = per_step, max_seqs
        self.reqs: dict[str, list[Any]] = {}
        self.prompts: list[dict[str, Any]] = []

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any) -> None:
        assert len(self.reqs) < self.max_seqs, "the schedule overfilled the batch"
        self.reqs[f"{request_id}-1a2b3c4d"] = [prompt["prompt_token_ids"], params.max_tokens, []]
        self.prompts.append(prompt)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.reqs)

    def step(self) -> list[Any]:
        from types import SimpleNamespace

        outs = []
        for rid, (prompt, max_tokens, toks) in list(self.reqs.items()):
            for _ in range(min(self.per_step, max_tokens - len(toks))):
                toks.append((sum(prompt) + 7 * len(toks)) % 97)
            finished = len(toks) == max_tokens
            outs.append(SimpleNamespace(request_id=rid, finished=finished, outputs=[SimpleNamespace(token_ids=list(toks))]))
            if finished:
                del self.reqs[rid]
        return outs


@pytest.mark.parametrize("per_step", [1, 3])
def test_waves_shrink_and_grow_the_batch_and_return_every_prompts_tokens(per_step: int) -> None:
    from types import SimpleNamespace

    ps = [[i, i + 1, 2 * i] for i in range(20)]
    engine = FakeEngine(per_step)
    render = (lambda p: {**p, "type": "token"}) if per_step == 3 else None  # what LLM does before add_request
    toks, in_flight = g.run_waves(engine, ps, lambda m: SimpleNamespace(max_tokens=m), 64, hold=2, render=render)
    assert all(("type" in p) == (render is not None) for p in engine.prompts) and len(engine.prompts) == 20
    assert [len(t) for t in toks] == [64 - 4 * (i % 8) for i in range(20)]
    assert toks == [[(sum(p) + 7 * j) % 97 for j in range(len(t))] for p, t in zip(ps, toks)]  # in prompt order
    assert max(in_flight) == 8 and g.regrowths(in_flight, 8) >= 2
    # every stretch below 8 before the batch grows back lasts at least `hold` steps (all-spec steps of R - 1)
    runs, n = [], 0
    for a, b in zip(in_flight, in_flight[1:]):
        n = n + 1 if a < 8 else 0
        if a < 8 <= b:
            runs.append(n)
    assert runs and min(runs) >= 2


def test_wave_schedule_refuses_bad_sizes_and_holds() -> None:
    sched = g.WaveSchedule(7, 3, 1)
    assert sched.start() == [0, 1, 2]
    assert sched.after_step(3) == [] and sched.after_step(2) == [] and sched.after_step(1) == [3, 4]  # refilled
    assert sched.after_step(2) == [] and sched.after_step(0) == [5, 6]  # nothing in flight: no hold
    assert not sched.pending and sched.after_step(0) == []
    with pytest.raises(ValueError, match="waves need n >= 1, max_seqs >= 1 and hold >= 0, got 0, 8, 2"):
        g.WaveSchedule(0, 8, 2)


def test_waves_usage_wants_a_regrowth_and_full_graph_size_returns() -> None:
    grew = [8, 8, 7, 7, 8, 6]
    runs = {"nospec-graphs": {"status": "ok", "waves_in_flight": grew},
            "tfm-fullpw": {"status": "ok", "waves_in_flight": grew, "waves_graph_steps": {g.SIZE_RETURN: 4}},
            "tfm-graphs": {"status": "ok", "waves_in_flight": [8, 8, 7, 6]},
            "tfm-fullpw-sync": {"status": "ok", "waves_in_flight": grew, "waves_graph_steps": {}},
            "tfm-eager": {"status": "ok"}, "tfm-fullpw-async": {"status": "error"}}
    usage = g.waves_usage(runs)
    assert usage["nospec-graphs"] == {"regrowths": 1, "ok": True}
    assert usage["tfm-fullpw"] == {"regrowths": 1, g.SIZE_RETURN: 4, "ok": True}
    assert usage["tfm-graphs"]["ok"] is False  # the batch never grew back
    assert usage["tfm-fullpw-sync"]["ok"] is False  # full graphs never returned to a size
    assert usage["tfm-eager"] == {"ok": False, "why": "no waves run"} and "tfm-fullpw-async" not in usage
    assert g.SIZE_RETURN == "cudagraph.tree.full_size_return"  # the runtime's hook (runtime/full_graphs.py)


def test_waves_tokens_join_the_verdicts() -> None:
    ref = [[1, 2, 3], [4, 5, 6]]
    runs = {"tfm-fullpw": run(ref), "nospec-graphs": run(ref)}
    runs["tfm-fullpw"]["waves"] = [[1, 2, 3], [4, 9, 6]]
    v = g.verdicts(runs)["tfm-fullpw == nospec-graphs"]
    assert v["b8"]["equal"] and v["b1"]["equal"] and not v["waves"]["equal"] and not v["equal"]
    assert v["waves"]["divergences"][0]["pos"] == 1
    # an output with a token too many (asynchronous scheduling runs steps past max_tokens): its pos is the shorter
    # length, and the lengths say so
    runs["tfm-fullpw"]["waves"] = [[1, 2, 3, 4], [4, 5, 6]]
    d = g.verdicts(runs)["tfm-fullpw == nospec-graphs"]["waves"]["divergences"]
    assert d == [{"prompt": 0, "pos": 3, "expected": [2, 3], "got": [2, 3, 4], "nospec_top2_margin": None,
                  "lengths": [3, 4]}]


def test_tfm_engines_pin_per_draft_slots_unless_they_name_a_layout() -> None:
    # tfm's default ("auto") is one slot on one GPU; the plain engines keep their results' layout
    assert g.engine_env("tfm-fullpw") == {"VLLM_TFM_GDN_STATE_SLOTS": "per_draft"}
    assert g.engine_env("tfm-fullpw-pergroup") == {"VLLM_TFM_GDN_STATE_SLOTS": "per_draft", "VLLM_TFM_GDN_METADATA_ONCE": "0"}
    assert g.engine_env("tfm-fullpw-oneslot") == {"VLLM_TFM_GDN_STATE_SLOTS": "one"}
    assert g.engine_env("nospec-graphs") == {}
    assert g.engine_env("tfm-fullpw-async-auto") == {}  # tfm's own default
    auto, base = g.ENGINES["tfm-fullpw-async-auto"], g.ENGINES["tfm-fullpw-async"]
    assert {k: v for k, v in auto.items() if k != "pin"} == base and ("tfm-fullpw-async-auto", "nospec-graphs") in g.REQUIRED
    expected = {n for n, e in g.ENGINES.items() if e["spec"] and g.expects_one_slot(n)}
    assert expected == {"tfm-eager-oneslot", "tfm-fullpw-oneslot", "tfm-fullpw-async-oneslot", "tfm-fallback-oneslot",
                        "tfm-fullpw-async-auto", "tfm-fullpw-oneslot-dgraph"}
    commits = {"b8_paths": {g.ONE_SLOT_COMMITS: 4, g.ONE_SLOT_INDICES: 4}}
    assert g.one_slot_usage({"tfm-fullpw-async-auto": commits})["tfm-fullpw-async-auto"]["ok"]
    assert not g.one_slot_usage({"tfm-fullpw-async": commits})["tfm-fullpw-async"]["ok"]


def test_the_fallback_engine_is_judged_as_piecewise_with_one_slot() -> None:
    name = "tfm-fallback-oneslot"
    assert g.engine_env(name) == {"VLLM_TFM_GDN_STATE_SLOTS": "one", "VLLM_TFM_KERNELS": "0"}
    assert g.ENGINES[name]["compilation_config"] == {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert (name, "nospec-graphs") in g.REQUIRED and name in g.GRAPH_ENGINES

    def run(full: int, piecewise: int, fast: int = 0, commits: int = 5) -> dict:
        return {"b8_graph_steps": {"cudagraph.tree.FULL": full, "cudagraph.tree.PIECEWISE": piecewise},
                "b8_paths": {g.METADATA_FAST: fast, g.ONE_SLOT_COMMITS: commits}}

    assert g.graph_usage({name: run(0, 9)})[name]["ok"]
    assert not g.graph_usage({name: run(2, 9)})[name]["ok"]  # a full graph replayed: the fallback did not happen
    # its GDN metadata builder has the FULL mode's buffers: all-spec steps build fast without tree graphs too
    # (729 on the H100, bench/results/graphs_zoo_oneslot_default_s61.json.gz)
    assert g.metadata_usage({name: run(0, 9, fast=3)}, "zoo")[name]["ok"]
    assert not g.metadata_usage({name: run(0, 9)}, "zoo")[name]["ok"]
    assert g.one_slot_usage({name: run(0, 9)})[name]["ok"] and not g.one_slot_usage({name: run(0, 9, commits=0)})[name]["ok"]


def test_every_commit_of_a_tfm_engine_runs_beside_the_drafting_where_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def engine(commits: int, overlapped: int) -> dict:
        return {"b8_paths": {g.COMMITS: commits, g.COMMITS_OVERLAPPED: overlapped}, "b1_paths": {},
                "waves_paths": {g.COMMITS: commits, g.COMMITS_OVERLAPPED: overlapped}}

    monkeypatch.delenv("VLLM_TFM_COMMIT_OVERLAP", raising=False)
    usage = g.commit_overlap_usage({"tfm-fullpw": engine(9, 0), "nospec-graphs": engine(0, 0)})
    assert set(usage) == {"tfm-fullpw"} and usage["tfm-fullpw"] == {g.COMMITS: 18, g.COMMITS_OVERLAPPED: 0, "ok": True}
    assert not g.commit_overlap_usage({"tfm-fullpw": engine(9, 9)})["tfm-fullpw"]["ok"]  # off by default
    monkeypatch.setenv("VLLM_TFM_COMMIT_OVERLAP", "1")  # the driver's environment, which every engine inherits
    assert g.commit_overlap_usage({"tfm-fullpw": engine(9, 9)})["tfm-fullpw"]["ok"]
    assert not g.commit_overlap_usage({"tfm-fullpw": engine(9, 8)})["tfm-fullpw"]["ok"]  # one commit on the drafting's stream
    off = dict(g.ENGINES["tfm-fullpw"], env={"VLLM_TFM_COMMIT_OVERLAP": "0"})
    monkeypatch.setitem(g.ENGINES, "tfm-fullpw", off)  # an engine's own setting wins
    assert g.commit_overlap_usage({"tfm-fullpw": engine(9, 0)})["tfm-fullpw"]["ok"]
    assert not g.commit_overlap_usage({"tfm-fullpw": engine(9, 9)})["tfm-fullpw"]["ok"]


def test_the_drafter_graph_engine_replays_its_graphs_and_drafts_as_the_engine_it_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    def engine(forwards: int, mal: float, replays: int | None = None) -> dict:
        paths = {g.DRAFTER_GRAPH: forwards, g.DRAFTER_GRAPH_REPLAYS: max(forwards - 16, 0) if replays is None else replays}
        return {"b8_paths": paths, "b1_paths": {}, "waves_paths": {},
                **{f"{label}_tree_metrics": {"mean_accepted_length": mal} for label in g.LABELS}}

    monkeypatch.delenv("VLLM_TFM_DRAFTER_GRAPHS", raising=False)
    base, copy = g.ENGINES["tfm-fullpw-oneslot"], g.ENGINES["tfm-fullpw-oneslot-dgraph"]
    assert copy["env"] == {**base["env"], "VLLM_TFM_DRAFTER_GRAPHS": "1"}
    assert {k: v for k, v in copy.items() if k != "env"} == {k: v for k, v in base.items() if k != "env"}
    assert {("tfm-fullpw-oneslot-dgraph", "nospec-graphs"), ("tfm-fullpw-oneslot-dgraph", "tfm-fullpw-oneslot")} <= set(g.REQUIRED)
    usage = g.drafter_graph_usage({"tfm-fullpw-oneslot": engine(0, 2.5), "tfm-fullpw-oneslot-dgraph": engine(40, 2.5),
                                   "nospec-graphs": engine(0, 0.0)})
    assert all(u["ok"] for u in usage.values()) and set(usage) == {"tfm-fullpw-oneslot", "tfm-fullpw-oneslot-dgraph",
                                                                  "same_drafts"}
    assert not g.drafter_graph_usage({"tfm-fullpw-oneslot-dgraph": engine(0, 2.5)})["tfm-fullpw-oneslot-dgraph"]["ok"]
    # every capture failed (section 69's H100 run: 16 forwards, all eager): not ok
    assert not g.drafter_graph_usage({"tfm-fullpw-oneslot-dgraph": engine(16, 2.5, 0)})["tfm-fullpw-oneslot-dgraph"]["ok"]
    assert not g.drafter_graph_usage({"tfm-fullpw-oneslot": engine(3, 2.5)})["tfm-fullpw-oneslot"]["ok"]
    monkeypatch.setenv("VLLM_TFM_DRAFTER_GRAPHS", "1")  # the driver's environment, which every engine inherits
    assert g.drafter_graph_usage({"tfm-fullpw-oneslot": engine(40, 2.5)})["tfm-fullpw-oneslot"]["ok"]
    assert not g.drafter_graph_usage({"tfm-fullpw-oneslot": engine(0, 2.5)})["tfm-fullpw-oneslot"]["ok"]
    monkeypatch.delenv("VLLM_TFM_DRAFTER_GRAPHS")
    other = g.drafter_graph_usage({"tfm-fullpw-oneslot": engine(0, 2.5), "tfm-fullpw-oneslot-dgraph": engine(40, 2.4)})
    assert not other["same_drafts"]["ok"]  # other drafts: the graphs read something stale

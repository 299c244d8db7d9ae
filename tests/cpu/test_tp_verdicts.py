"""Verdicts of the tensor-parallel GPU run (bench/tp_verdicts.py, bench/gpu_tp2_e2e.py's summary).

Hand-built phase results with planted differences: the first divergence of every differing prompt,
the per-rank tree-check counters, the Ray-actor checks, the mean accepted length from vLLM's
counters, which combinations pass, and the result file the summary writes (exit code, compact
tokens, a skipped optional phase left out of the verdict).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_tp2_e2e
from tp_verdicts import (
    actor_verdict,
    compare_tokens,
    first_divergence,
    mean_accepted_length,
    tokens_digest,
    tp_verdicts,
    tree_check_verdict,
)

CHECK_ENV = {"VLLM_TFM_CHECK_TP_TREES": "1"}


def test_first_divergence() -> None:
    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert first_divergence([5, 6], [5, 6, 7]) == 2  # a prefix diverges where it ends
    assert first_divergence([], [1]) == 0
    assert first_divergence([], []) is None


def test_compare_tokens_reports_each_differing_prompt() -> None:
    a = [list(range(20)), list(range(100, 120)), [7, 8]]
    b = [list(range(20)), list(range(100, 105)) + [0] + list(range(106, 120)), [7]]
    c = compare_tokens(a, b)
    assert c["equal"] is False and c["prompts"] == 3 and c["identical_prompts"] == 1
    d1, d2 = c["differing"]
    assert (d1["prompt"], d1["first_divergence"], d1["window_start"]) == (1, 5, 1)
    assert d1["a"] == [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]
    assert d1["b"] == [101, 102, 103, 104, 0, 106, 107, 108, 109, 110, 111, 112]
    assert (d2["prompt"], d2["first_divergence"], d2["len_a"], d2["len_b"]) == (2, 1, 2, 1)
    assert compare_tokens(a, [list(t) for t in a])["equal"] is True


def test_compare_tokens_refuses_missing_or_uneven_runs() -> None:
    assert compare_tokens(None, [[1]])["equal"] is False
    assert compare_tokens([[1]], None)["reason"] == "tokens missing on the right"
    c = compare_tokens([[1], [2]], [[1]])
    assert c["equal"] is False and c["reason"] == "prompt counts differ: 2 vs 1" and c["differing"] == []
    assert compare_tokens([], [])["equal"] is False  # nothing compared is not a pass


def test_tokens_digest_tells_runs_apart() -> None:
    assert tokens_digest([[1, 2], [3]]) == tokens_digest([[1, 2], [3]])
    assert tokens_digest([[1, 2], [3]]) != tokens_digest([[1], [2, 3]])
    assert tokens_digest(None) is None


def _worker(rank: int, actor: str | None = None, pid: int | None = None, checks: Any = 161,
            proposal: str = "tfm", env: dict[str, str] | None = None, async_scheduling: bool = False) -> dict[str, Any]:
    return {"async_scheduling": async_scheduling,
        "rank": rank, "pid": 1000 + rank if pid is None else pid, "ray_actor_id": f"actor{rank}" if actor is None else actor,
        "plugin_registered": True, "runtime_installed": True, "options": {"proposal": proposal},
        "tfm_env": CHECK_ENV if env is None else env,
        "tree_metrics": {"tree_steps": 161, **({} if checks is None else {"tp_tree_checks": checks})},
    }  # fmt: skip


def test_tree_check_verdict() -> None:
    assert tree_check_verdict([_worker(0), _worker(1)], tp=2) == {
        "ok": True, "tp_tree_checks": [161, 161], "tp_accept_checks": [None, None], "tree_steps": [161, 161]}
    with_accepts = [_worker(0), _worker(1)]
    for w in with_accepts:
        w["tree_metrics"]["tp_accept_checks"] = 160
    assert tree_check_verdict(with_accepts, tp=2)["ok"]
    with_accepts[1]["tree_metrics"]["tp_accept_checks"] = 0  # counted on one rank only
    assert not tree_check_verdict(with_accepts, tp=2)["ok"]
    assert not tree_check_verdict([_worker(0), _worker(1, checks=160)], tp=2)["ok"]  # ranks disagree
    assert not tree_check_verdict([_worker(0, checks=0), _worker(1, checks=0)], tp=2)["ok"]  # nothing checked
    assert not tree_check_verdict([_worker(0, checks=None), _worker(1, checks=None)], tp=2)["ok"]  # check off
    assert not tree_check_verdict([_worker(0, checks=True), _worker(1, checks=True)], tp=2)["ok"]  # not a count
    assert not tree_check_verdict([_worker(0)], tp=2)["ok"]  # a rank missing
    nested = {"tree_metrics": {"tp": {"tp_tree_checks": 7}}}
    assert tree_check_verdict([nested, nested], tp=2)["tp_tree_checks"] == [7, 7]


def test_actor_verdict() -> None:
    good = [_worker(0), _worker(1)]
    assert actor_verdict(good, 2, driver_pid=1, proposal="tfm", env=CHECK_ENV) == {
        "ok": True, "problems": [], "actors": ["actor0", "actor1"], "pids": [1000, 1001]}
    bad = {
        "shared actor": [_worker(0), _worker(1, actor="actor0")],
        "no actor": [_worker(0), _worker(1, actor="")],
        "driver pid": [_worker(0, pid=1), _worker(1)],
        "proposal": [_worker(0), _worker(1, proposal="ddtree")],
        "env": [_worker(0), _worker(1, env={})],
        "one worker": [_worker(0)],
        "ranks": [_worker(0), _worker(0, actor="actor9", pid=1009)],
    }
    for why, workers in bad.items():
        v = actor_verdict(workers, 2, driver_pid=1, proposal="tfm", env=CHECK_ENV)
        assert not v["ok"] and v["problems"], why
    unloaded = [_worker(0), {**_worker(1), "runtime_installed": False}]
    assert "runtime_installed=False" in actor_verdict(unloaded, 2, 1, "tfm")["problems"][0]


def test_mean_accepted_length() -> None:
    counters = {"vllm:spec_decode_num_drafts": 1059, "vllm:spec_decode_num_accepted_tokens": 3112}
    assert mean_accepted_length(counters) == pytest.approx(1 + 3112 / 1059)
    assert mean_accepted_length({"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_accepted_tokens": 0}) is None
    assert mean_accepted_length({}) is None and mean_accepted_length(None) is None


TOKENS = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]


def _phase(tokens: list[list[int]], tp: int, proposal: str | None, driver_pid: int = 1,
           async_scheduling: bool = False) -> dict[str, Any]:
    ph: dict[str, Any] = {"tokens": [list(t) for t in tokens], "driver_pid": driver_pid,
                          "spec_counters": {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens": 15}}
    checks = 5 if proposal else None
    ph["workers"] = [_worker(r, checks=checks, proposal=proposal or "tfm", async_scheduling=async_scheduling) for r in range(tp)]
    return ph


def _planted(row: int, pos: int, value: int = 99) -> list[list[int]]:
    out = [list(t) for t in TOKENS]
    out[row][pos] = value
    return out


def test_tp_verdicts_all_equal_passes() -> None:
    phases = {"tp1_tfm": _phase(TOKENS, 1, "tfm"), "tp2_tfm": _phase(TOKENS, 2, "tfm"), "tp2_nospec": _phase(TOKENS, 2, None),
              "tp2_ddtree": {"skipped": "no time"}}  # fmt: skip
    v = tp_verdicts(phases, 2, CHECK_ENV)["verdicts"]
    assert v["all_ok"] and v["tp2_tfm_equals_tp1_tfm"] and v["tp2_tfm_equals_tp2_nospec"] and v["tp1_tfm_equals_tp2_nospec"]
    assert "tp2_ddtree_equals_tp2_nospec" not in v  # skipped: not judged
    assert v["mean_accepted_length"]["tp2_tfm"] == pytest.approx(2.5)


def test_tp_verdicts_speculation_changing_tokens_under_tp_fails() -> None:
    phases = {"tp1_tfm": _phase(TOKENS, 1, "tfm"), "tp2_tfm": _phase(_planted(2, 3), 2, "tfm"), "tp2_nospec": _phase(TOKENS, 2, None)}
    out = tp_verdicts(phases, 2, CHECK_ENV)
    v = out["verdicts"]
    assert not v["all_ok"] and not v["tp2_tfm_equals_tp2_nospec"] and not v["tp1_difference_explained_by_tp_numerics"]
    assert [(d["prompt"], d["first_divergence"]) for d in out["comparisons"]["tp2_tfm_vs_tp2_nospec"]["differing"]] == [(2, 3)]


def test_tp_verdicts_tp_numerics_explain_a_tp1_difference() -> None:
    tp2 = _planted(0, 1)  # TP=2 differs from TP=1 already without speculation
    phases = {"tp1_tfm": _phase(TOKENS, 1, "tfm"), "tp2_tfm": _phase(tp2, 2, "tfm"), "tp2_nospec": _phase(tp2, 2, None)}
    v = tp_verdicts(phases, 2, CHECK_ENV)["verdicts"]
    assert v["all_ok"] and not v["tp2_tfm_equals_tp1_tfm"] and v["tp1_difference_explained_by_tp_numerics"]


def test_tp_verdicts_needs_tree_checks_and_a_passing_ddtree_run() -> None:
    base = {"tp1_tfm": _phase(TOKENS, 1, "tfm"), "tp2_tfm": _phase(TOKENS, 2, "tfm"), "tp2_nospec": _phase(TOKENS, 2, None)}
    unchecked = dict(base, tp2_tfm=_phase(TOKENS, 2, None))  # workers report no tp_tree_checks
    assert not tp_verdicts(unchecked, 2, CHECK_ENV)["verdicts"]["all_ok"]
    good_ddt = dict(base, tp2_ddtree=_phase(TOKENS, 2, "ddtree"))
    v = tp_verdicts(good_ddt, 2, CHECK_ENV)["verdicts"]
    assert v["all_ok"] and v["tp2_ddtree_equals_tp2_nospec"] and v["tp2_ddtree_workers_in_distinct_actors"]["ok"]
    failed_ddt = dict(base, tp2_ddtree={"error": "RuntimeError: tfm trees differ across TP ranks"})
    v = tp_verdicts(failed_ddt, 2, CHECK_ENV)["verdicts"]
    assert not v["all_ok"] and v["errors"] == {"tp2_ddtree": "RuntimeError: tfm trees differ across TP ranks"}
    no_nospec = dict(base, tp2_nospec={"skipped": "no time"})
    assert not tp_verdicts(no_nospec, 2, CHECK_ENV)["verdicts"]["all_ok"]


def test_summary_writes_the_result_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work, out = tmp_path / "phases", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    monkeypatch.setattr(gpu_tp2_e2e, "WORK", work)
    monkeypatch.setenv("TFM_TP2_COMMAND", "bash bench/run_gpu_tp2.sh")
    monkeypatch.setenv("TFM_TP2_BUDGET", "32")
    target = str(ROOT / "zoo" / "target")
    n = len(gpu_tp2_e2e.prompts(target))
    ref = [[i, i + 1, i + 2] for i in range(n)]
    bad = [list(t) for t in ref]
    bad[4][2] = 7777
    files = {"tp1_tfm": _phase(ref, 1, "tfm"), "tp2_tfm": _phase(bad, 2, "tfm"), "tp2_nospec": _phase(ref, 2, None)}
    for name, ph in files.items():
        (work / f"{name}.json").write_text(json.dumps(ph))
    args = argparse.Namespace(out=str(out), target=target, drafter="unused", target_arg="zoo/target", drafter_arg="zoo/drafter",
                              async_scheduling=False)
    runs = {name: {"rc": 0, "wall_s": 1.0} for name in files} | {"tp2_ddtree": {"skipped": "10 s left"}}
    assert gpu_tp2_e2e.summary(args, runs, {"gpus": []}) == 1  # the planted divergence fails the run
    res = json.loads((out / gpu_tp2_e2e.RESULT).read_text())
    assert res["command"] == "TFM_TP2_BUDGET=32 bash bench/run_gpu_tp2.sh"
    assert res["settings"]["target"] == "zoo/target" and res["settings"]["prompts"] == n
    lens = res["settings"]["prompt_lengths"]
    assert lens[:2] == [1, 200] and all(1 <= x <= 200 for x in lens) and len(set(lens)) > 8  # mixed lengths
    assert res["verdicts"]["tp2_tfm_equals_tp2_nospec"] is False and res["verdicts"]["all_ok"] is False
    d = res["comparisons"]["tp2_tfm_vs_tp1_tfm"]["differing"]
    assert [(x["prompt"], x["first_divergence"], x["b"]) for x in d] == [(4, 2, [4, 5, 7777])]
    assert "tokens" not in res["phases"]["tp2_tfm"] and res["phases"]["tp2_tfm"]["tokens_digest"] == tokens_digest(bad)
    assert res["tokens_tp1_tfm"][0] == "0 1 2"
    assert res["phases"]["tp2_ddtree"] == {"skipped": "10 s left"}
    (work / "tp2_tfm.json").write_text(json.dumps(_phase(ref, 2, "tfm")))
    assert gpu_tp2_e2e.summary(args, runs, {"gpus": []}) == 0
    res = json.loads((out / gpu_tp2_e2e.RESULT).read_text())
    assert res["verdicts"]["tfm_scheduling_as_asked"] is True and res["settings"]["async_scheduling_tfm"] is False
    # --async-scheduling: the tfm phases' workers must report asynchronous scheduling, every one of them
    args.async_scheduling = True
    assert gpu_tp2_e2e.summary(args, runs, {"gpus": []}) == 1
    assert json.loads((out / gpu_tp2_e2e.RESULT).read_text())["verdicts"]["tfm_scheduling_as_asked"] is False
    (work / "tp1_tfm.json").write_text(json.dumps(_phase(ref, 1, "tfm", async_scheduling=True)))
    (work / "tp2_tfm.json").write_text(json.dumps(_phase(ref, 2, "tfm", async_scheduling=True)))
    assert gpu_tp2_e2e.summary(args, runs, {"gpus": []}) == 0
    half = _phase(ref, 2, "tfm", async_scheduling=True)
    half["workers"][1]["async_scheduling"] = False  # one rank synchronous
    (work / "tp2_tfm.json").write_text(json.dumps(half))
    assert gpu_tp2_e2e.summary(args, runs, {"gpus": []}) == 1


def test_async_scheduling_reaches_only_the_tfm_engines() -> None:
    tfm = gpu_tp2_e2e.engine_kwargs("t", "d", 2, "tfm", async_scheduling=True)
    assert tfm["async_scheduling"] is True and tfm["speculative_config"]["method"] == "tfm"
    assert "async_scheduling" not in gpu_tp2_e2e.engine_kwargs("t", "d", 2, None, async_scheduling=True)  # vLLM's default
    assert gpu_tp2_e2e.engine_kwargs("t", "d", 2, "tfm")["async_scheduling"] is False  # pinned without the flag


def test_prompts_are_seeded_and_in_range() -> None:
    target = str(ROOT / "zoo" / "target")
    ps = gpu_tp2_e2e.prompts(target)
    assert ps == gpu_tp2_e2e.prompts(target) and len(ps) >= 32
    assert min(min(p) for p in ps) >= 3 and max(max(p) for p in ps) < 8190


def test_phase_skipped_when_time_is_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_tp2_e2e, "DEADLINE_S", 0.0)
    args = argparse.Namespace(out=str(tmp_path), target="t", drafter="d")
    assert "skipped" in gpu_tp2_e2e.run_phase(args, "tp2_ddtree")
    assert not list(tmp_path.iterdir())  # nothing started, no log


def test_scheduling_as_asked_needs_every_phase_to_report_its_workers() -> None:
    asked = gpu_tp2_e2e.ray_e2e.scheduling_as_asked
    on, off = _worker(0, async_scheduling=True), _worker(0)
    assert asked([{"workers": [on]}, {"workers": [on, on]}], True) and asked([{"workers": [off]}], False)
    assert not asked([{"workers": [on, on]}, {"workers": []}], True)  # a phase without workers: not shown
    assert not asked([{"workers": [on]}, {"error": "RuntimeError: no engine"}], True)
    assert not asked([{"workers": [{**on, "async_scheduling": "error: no vllm_config"}]}], True)
    assert not asked([{"workers": [on]}], False)

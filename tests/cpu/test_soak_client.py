"""The soak's load generator (bench/soak_client.py) against a stand-in OpenAI completion server.

The stand-in (_openai_standin.py) answers like ``vllm serve`` (token ids, usage, event streams,
400s) with outputs that are a fixed function of the request, and can be told to corrupt or
shorten answers: the client must count intended disconnects (and the server must see them),
detect errors and lost tokens, record latencies, and report exactly the corrupted greedy answer.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp", reason="aiohttp (a vLLM dependency) is needed by the soak client")
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from typing import Self

import soak_client as sc
from _openai_standin import StandinState, make_app, output_tokens


class Standin:
    """The stand-in app on an ephemeral loopback port inside the test's event loop."""

    def __init__(self, state: StandinState) -> None:
        self.state = state
        self.runner = web.AppRunner(make_app(state))
        self.url = ""

    async def __aenter__(self) -> Self:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def unique_first_token_prompts() -> sc.PromptSource:
    """Random prompts whose first token is unique per prompt (so a fault can target one request)."""
    counter = itertools.count(10_000)
    return lambda rng, n: [next(counter)] + [rng.randrange(3, 900) for _ in range(n - 1)]


def run(coro):
    return asyncio.run(coro)


def load(url: str, specs, concurrency: int = 8, budget_s: float = 30.0, hard_s: float = 40.0):
    t = time.monotonic()
    return run(sc.run_load(url, "m", specs, concurrency=concurrency, stop_launching_at=t + budget_s, hard_stop_at=t + hard_s))


# ----------------------------------------------------------------------------------- workload
def test_workload_is_deterministic_bounded_and_mixed() -> None:
    prompts = sc.random_token_prompts(3, 900)
    a = sc.make_workload(400, prompts, seed=3, max_model_len=512)
    b = sc.make_workload(400, prompts, seed=3, max_model_len=512)
    assert a == b
    assert a != sc.make_workload(400, prompts, seed=4, max_model_len=512)
    for s in a:
        assert 1 <= len(s.prompt) and len(s.prompt) + s.max_tokens <= 512, s
        assert all(3 <= t < 900 for t in s.prompt)
        assert (s.seed is None) == s.greedy
    drops = [s for s in a if s.disconnect_after_tokens is not None]
    assert len(drops) == 20  # exactly 5% of 400
    assert all(s.stream and s.max_tokens >= 48 and 1 <= s.disconnect_after_tokens <= s.max_tokens // 3 for s in drops)
    near = [s for s in a if s.kind == "near_max"]
    assert near and all(len(s.prompt) + s.max_tokens >= 512 - 3 for s in near)
    assert any(len(s.prompt) + s.max_tokens == 512 for s in near)  # some end exactly at max_model_len
    kinds = {s.kind for s in a}
    assert kinds == {"short", "long", "near_max"}
    greedy = sum(s.greedy for s in a)
    assert 150 < greedy < 250
    assert {s.temperature for s in a} == {0.0, 0.6, 0.8, 1.0, 1.3}
    assert 150 < sum(s.stream for s in a) < 260
    assert any(s.top_p is not None for s in a) and any(s.top_k is not None for s in a)


def test_workload_refuses_impossible_sizes() -> None:
    with pytest.raises(ValueError, match="at least one request"):
        sc.make_workload(0, sc.random_token_prompts(3, 9), seed=0, max_model_len=512)
    with pytest.raises(ValueError, match="too small"):
        sc.make_workload(5, sc.random_token_prompts(3, 9), seed=0, max_model_len=40)


def test_stream_prompts_are_windows_of_the_stream() -> None:
    src = sc.stream_token_prompts(list(range(100)))
    p = src(random.Random(0), 250)  # longer than the stream: tiled
    assert len(p) == 250 and all((b - a) % 100 == 1 for a, b in itertools.pairwise(p))


# ----------------------------------------------------------------------------------- the load
def test_load_counts_disconnects_records_latency_and_finds_no_error() -> None:
    specs = sc.make_workload(60, unique_first_token_prompts(), seed=1, max_model_len=400, disconnect_fraction=0.1)
    state = StandinState(delay_per_chunk_s=0.003, chunk_tokens=3)

    async def go():
        async with Standin(state) as s:
            results, wall = await sc.run_load(s.url, "m", specs, concurrency=8, stop_launching_at=time.monotonic() + 30,
                                              hard_stop_at=time.monotonic() + 40)
            await asyncio.sleep(0.2)  # let the server notice the last disconnects
            return results, wall

    results, wall = run(go())
    by = {r.index: r for r in results}
    planned = {s.index for s in specs if s.disconnect_after_tokens is not None}
    assert len(planned) == 6
    assert {r.index for r in results if r.status == "disconnected"} == planned
    assert {r.status for r in results if r.index not in planned} == {"ok"}
    for s in specs:
        r = by[s.index]
        if r.status == "ok":
            assert r.token_ids == output_tokens(list(s.prompt), s.max_tokens, s.temperature, s.seed, 0)
            assert r.completion_tokens == s.max_tokens and r.finish_reason == "length"
            # every chunk (stream) or the answer (non-stream) waited >= 3 ms in the stand-in
            chunks = -(-s.max_tokens // 3) if s.stream else 1
            assert r.latency_s >= 0.003 * chunks * 0.9
            if s.stream:
                assert r.chunks == chunks and 0 < r.ttft_s <= r.latency_s
        else:
            assert s.disconnect_after_tokens <= len(r.token_ids) < s.max_tokens
    assert state.finished["abort"] == 6  # the server saw each disconnect
    summ = sc.summarize(specs, results, wall)
    assert summ["errors"] == 0 and summ["status_counts"] == {"disconnected": 6, "ok": 54}
    assert summ["disconnects_planned"] == summ["disconnects_done"] == 6 and summ["disconnects_finished_first"] == 0
    lat = [r.latency_s for r in results if r.status == "ok"]
    assert summ["latency_s"]["n"] == 54
    assert summ["latency_s"]["p50"] == pytest.approx(float(np.percentile(lat, 50)))
    assert summ["latency_s"]["p99"] == pytest.approx(float(np.percentile(lat, 99)))
    assert summ["completion_tokens"] == sum(len(r.token_ids) for r in results)
    assert summ["throughput_tokens_per_s"] == pytest.approx(summ["completion_tokens"] / wall)


def test_lost_tokens_and_refusals_are_errors() -> None:
    specs = sc.make_workload(12, unique_first_token_prompts(), seed=2, max_model_len=300, disconnect_fraction=0.0)
    victim = specs[5]
    state = StandinState(short={victim.prompt[0]}, spec=True)

    async def go():
        async with Standin(state) as s:
            res, _ = await sc.run_load(s.url, "m", specs, concurrency=4, stop_launching_at=time.monotonic() + 30,
                                       hard_stop_at=time.monotonic() + 40)
            async with aiohttp.ClientSession() as session:
                url = s.url + "/v1/completions"
                body = {"model": "m", "prompt": [5, 6], "max_tokens": 4, "presence_penalty": 0.5}
                plain = await sc.complete(session, url, body)
                streamed = await sc.complete(session, url, {**body, "stream": True})
            return res, plain, streamed

    results, plain, streamed = run(go())
    bad = [r for r in results if r.status == "error"]
    assert [r.index for r in bad] == [victim.index]
    assert f"lost tokens: {victim.max_tokens - 1} of {victim.max_tokens}" in bad[0].error
    assert plain.http_status == 400 and plain.error_code == 400 and not plain.streamed_error
    assert plain.error == "presence_penalty is not supported with speculative method 'tfm'"
    assert streamed.http_status == 200 and streamed.streamed_error and streamed.error_code == 400 and streamed.done
    assert streamed.error == plain.error


def test_check_result_catches_each_kind_of_loss() -> None:
    spec = sc.RequestSpec(0, (1, 2), 4, 0.0, stream=True)

    def outcome(**kw):
        base = {"http_status": 200, "done": True, "usage": {"completion_tokens": 4}}
        base.update(kw)
        o = sc.Outcome(**{k: v for k, v in base.items() if k != "tokens"})
        o.choices[0] = sc.Choice(token_ids=kw.get("tokens", [1, 2, 3, 4]), finish_reason=kw.get("finish", "length"))
        return o

    assert sc.check_result(spec, outcome()).status == "ok"
    assert "without [DONE]" in sc.check_result(spec, outcome(done=False)).error
    r = sc.check_result(spec, outcome())
    r2 = sc.check_result(spec, sc.Outcome(http_status=200, done=True, usage={"completion_tokens": 3},
                                         choices={0: sc.Choice(token_ids=[1, 2, 3], finish_reason="stop")}))
    assert r.status == "ok" and r2.status == "error"
    assert "lost tokens: 3 of 4" in r2.error and "finish_reason 'stop'" in r2.error and "completion_tokens 3" in r2.error
    no_usage = sc.check_result(spec, sc.Outcome(http_status=200, done=True, choices={0: sc.Choice([1, 2, 3, 4], "", "length")}))
    assert no_usage.error == "no usage chunk"
    http = sc.check_result(spec, sc.Outcome(http_status=500, error="boom"))
    assert http.status == "error" and http.error == "HTTP 500: boom"


def test_deadlines_cut_running_requests_and_skip_the_rest() -> None:
    specs = [sc.RequestSpec(i, (100 + i, 1), 50, 0.0, stream=True) for i in range(10)]
    state = StandinState(delay_per_chunk_s=0.05, chunk_tokens=1)  # 2.5 s per request

    async def go():
        async with Standin(state) as s:
            t = time.monotonic()
            return await sc.run_load(s.url, "m", specs, concurrency=3, stop_launching_at=t + 0.3, hard_stop_at=t + 0.6)

    t0 = time.monotonic()
    results, wall = run(go())
    assert time.monotonic() - t0 < 2.0 and wall < 1.5
    assert [r.status for r in results] == ["cut"] * 3 + ["not_started"] * 7


# ----------------------------------------------------------------------------------- comparisons
def test_compare_greedy_reports_exactly_the_corrupted_answer() -> None:
    specs = sc.make_workload(40, unique_first_token_prompts(), seed=5, max_model_len=300, disconnect_fraction=0.05)
    victim = next(s for s in specs if s.greedy and s.max_tokens >= 8 and s.disconnect_after_tokens is None)
    sampled = next(s for s in specs if not s.greedy and s.max_tokens >= 8 and s.disconnect_after_tokens is None)

    async def go():
        async with Standin(StandinState()) as ref, Standin(StandinState(corrupt={victim.prompt[0], sampled.prompt[0]})) as bad:
            a, _ = await sc.run_load(bad.url, "m", specs, concurrency=6, stop_launching_at=time.monotonic() + 30,
                                     hard_stop_at=time.monotonic() + 40)
            b, _ = await sc.run_load(ref.url, "m", specs, concurrency=6, stop_launching_at=time.monotonic() + 30,
                                     hard_stop_at=time.monotonic() + 40)
            return a, b

    a, b = run(go())
    cmp = sc.compare_greedy(specs, a, b)
    greedy_ok = [s for s in specs if s.greedy and s.disconnect_after_tokens is None]
    assert cmp["compared"] == len(greedy_ok)
    assert cmp["identical"] == len(greedy_ok) - 1
    (d,) = cmp["divergences"]
    ra = next(r for r in a if r.index == victim.index).token_ids
    rb = next(r for r in b if r.index == victim.index).token_ids
    assert d["index"] == victim.index and d["pos"] == 2 and ra[2] != rb[2] and ra[:2] == rb[:2]
    assert d["a"] == ra[0:6] and d["b"] == rb[0:6] and d["from"] == 0
    # identical runs compare identical; a length difference is a divergence at the shorter length
    assert sc.compare_greedy(specs, b, b)["identical_fraction"] == 1.0
    short = [sc.RequestResult(r.index, r.status, token_ids=r.token_ids[:-1] if r.index == victim.index else r.token_ids)
             for r in b]
    (d2,) = sc.compare_greedy(specs, b, short)["divergences"]
    assert d2["pos"] == victim.max_tokens - 1 and d2["len_a"] == victim.max_tokens


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert sc.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert sc.percentile([], 50) is None


# ----------------------------------------------------------------------------------- /metrics
METRICS_BEFORE = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="soak"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="soak"} 160.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="soak"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="soak",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="soak",position="1"} 5.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="soak"} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="soak"} 0.0
vllm:num_requests_running{engine="0",model_name="soak"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="soak"} 1.0
"""
METRICS_AFTER = METRICS_BEFORE.replace("} 10.0", "} 110.0").replace("} 160.0", "} 1760.0").replace(
    "accepted_tokens_total{engine=\"0\",model_name=\"soak\"} 20.0", "accepted_tokens_total{engine=\"0\",model_name=\"soak\"} 270.0"
).replace('position="0"} 8.0', 'position="0"} 88.0').replace('position="1"} 5.0', 'position="1"} 55.0').replace(
    'finished_reason="abort",model_name="soak"} 0.0', 'finished_reason="abort",model_name="soak"} 4.0'
).replace("running{engine=\"0\",model_name=\"soak\"} 2.0", "running{engine=\"0\",model_name=\"soak\"} 0.0")


def test_prometheus_parsing_and_spec_decode_summary() -> None:
    before, after = sc.parse_prometheus(METRICS_BEFORE), sc.parse_prometheus(METRICS_AFTER)
    assert sc.metric_value(before, "vllm:num_requests_running") == 2.0
    assert sc.metric_value(after, "vllm:num_requests_running") == 0.0
    assert sc.metric_value(before, "vllm:request_success_total") == 3.0
    assert sc.metric_value(after, "vllm:request_success_total", finished_reason="abort") == 4.0
    assert sc.metric_value(after, "vllm:not_there") is None
    summary = sc.spec_decode_summary(before, after)
    assert summary["drafts"] == 100 and summary["draft_tokens"] == 1600 and summary["accepted_tokens"] == 250
    assert summary["mean_accepted_length"] == pytest.approx(3.5)
    assert summary["acceptance_by_position"] == pytest.approx([0.8, 0.5])
    delta = sc.metrics_delta(before, after)
    assert delta["vllm:request_success_total{finished_reason=abort}"] == 4.0
    assert "vllm:request_success_total{finished_reason=length}" not in delta  # unchanged
    assert "vllm:num_requests_running" not in delta  # gauges are not deltas


def test_a_stream_that_ends_in_the_chunk_crossing_its_drop_point_counts_as_finished() -> None:
    specs = [sc.RequestSpec(i, (500 + i, 1), 60, 0.0, stream=True, disconnect_after_tokens=10) for i in range(3)]
    state = StandinState(chunk_tokens=1000)  # the whole answer in one event

    async def go():
        async with Standin(state) as s:
            return await sc.run_load(s.url, "m", specs, concurrency=3, stop_launching_at=time.monotonic() + 30,
                                     hard_stop_at=time.monotonic() + 40)

    results, wall = run(go())
    assert [r.status for r in results] == ["ok"] * 3 and all(len(r.token_ids) == 60 for r in results)
    summ = sc.summarize(specs, results, wall)
    assert (summ["disconnects_planned"], summ["disconnects_done"], summ["disconnects_finished_first"]) == (3, 0, 3)
    assert state.finished == {"length": 3, "abort": 0}

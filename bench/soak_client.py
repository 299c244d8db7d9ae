"""The load side of the serving soak (bench/soak.py): workload, OpenAI completion client, summaries.

Pure Python plus aiohttp (a vLLM dependency); no torch, no vLLM import, so it runs and is tested
on CPU against a stand-in server (tests/cpu/test_soak_client.py).

* ``make_workload``: a deterministic list of ``RequestSpec`` (prompt token ids, max_tokens,
  temperature / top-p / top-k / seed, streaming or not, and for a chosen few a number of received
  tokens after which the client drops the connection). Prompt and output lengths are random,
  including prompts that end a few tokens short of ``max_model_len - max_tokens``.
* ``complete``: one ``POST /v1/completions`` (streaming or not) read into an ``Outcome`` (HTTP
  status, choices with their token ids, usage, the error a server reported, timings).
* ``run_load``: the specs through ``concurrency`` parallel clients, in order, until a deadline
  (requests not started by then are ``not_started``; requests still running at the hard deadline
  are cut and marked ``cut``); every result is checked for lost tokens (``ignore_eos`` requests
  must return exactly ``max_tokens`` tokens with finish reason ``length``).
* ``summarize`` / ``compare_greedy``: error counts and messages, latency percentiles, throughput;
  token-for-token comparison of greedy outputs between two runs with the first divergence.
* ``parse_prometheus`` / ``spec_decode_summary``: vLLM's ``/metrics`` text and the spec-decode
  counters (mean accepted length, acceptance by position).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "Outcome",
    "PromptSource",
    "RequestResult",
    "RequestSpec",
    "check_result",
    "compare_greedy",
    "complete",
    "make_workload",
    "metric_value",
    "metrics_delta",
    "parse_prometheus",
    "percentile",
    "random_token_prompts",
    "request_body",
    "run_load",
    "spec_decode_summary",
    "stream_token_prompts",
    "summarize",
]

PromptSource = Callable[[random.Random, int], list[int]]
"""(rng, length) -> a prompt of exactly ``length`` token ids."""


# ------------------------------------------------------------------------------------ workload
@dataclass(frozen=True)
class RequestSpec:
    """One completion request of the soak (all requests set ``ignore_eos``)."""

    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool = False
    disconnect_after_tokens: int | None = None  # streaming only: drop the connection once this many tokens arrived
    kind: str = "short"  # short / long / near_max

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def random_token_prompts(low: int, high: int) -> PromptSource:
    """Prompts of uniform random token ids in [low, high)."""
    if not 0 <= low < high:
        raise ValueError(f"need 0 <= low < high, got {low}, {high}")
    return lambda rng, n: [rng.randrange(low, high) for _ in range(n)]


def stream_token_prompts(tokens: Sequence[int]) -> PromptSource:
    """Windows of a token stream (e.g. tokenized source files) at random offsets, tiled if short."""
    stream = list(tokens)
    if not stream:
        raise ValueError("the token stream is empty")

    def source(rng: random.Random, n: int) -> list[int]:
        start = rng.randrange(len(stream))
        return [stream[(start + i) % len(stream)] for i in range(n)]

    return source


def make_workload(
    n: int,
    prompts: PromptSource,
    *,
    seed: int,
    max_model_len: int,
    max_new_tokens: int = 160,
    long_max_new_tokens: int = 384,
    greedy_fraction: float = 0.5,
    stream_fraction: float = 0.5,
    disconnect_fraction: float = 0.05,
    near_max_fraction: float = 0.05,
    long_fraction: float = 0.15,
    temperatures: Sequence[float] = (0.6, 0.8, 1.0, 1.3),
) -> list[RequestSpec]:
    """``n`` deterministic requests (same arguments, same list).

    Kinds: ``near_max`` (prompt ends 0-3 tokens before ``max_model_len - max_tokens``, max_tokens
    1-64), ``long`` (prompt a quarter to a half of ``max_model_len``, 64-``long_max_new_tokens``
    new tokens), ``short`` (prompt 4-512 tokens, log-uniform; 1-``max_new_tokens`` new tokens).
    Sampled requests get a temperature from ``temperatures``, sometimes top-p 0.9 / top-k 40, and a
    seed. Exactly ``round(disconnect_fraction * n)`` requests stream and drop the connection after
    1..max_tokens/3 tokens (their max_tokens is at least 48, so the drop normally comes before the
    end: one engine step adds at most a DFlash block of tokens).
    """
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    if max_model_len < 80:
        raise ValueError(f"max_model_len {max_model_len} is too small for the workload (>= 80)")
    rng = random.Random(seed)
    drop = set(rng.sample(range(n), round(disconnect_fraction * n)))
    specs = []
    for i in range(n):
        u = rng.random()
        kind = "near_max" if u < near_max_fraction else ("long" if u < near_max_fraction + long_fraction else "short")
        if kind == "near_max":
            max_tokens = rng.randint(1, 64)
        elif kind == "long":
            max_tokens = rng.randint(64, long_max_new_tokens)
        else:
            max_tokens = rng.randint(1, max_new_tokens)
        disconnect = None
        if i in drop:
            max_tokens = max(max_tokens, 48)
            disconnect = rng.randint(1, max_tokens // 3)
        max_tokens = min(max_tokens, max_model_len - 8)
        room = max_model_len - max_tokens
        if kind == "near_max":
            prompt_len = room - rng.randint(0, 3)
        elif kind == "long":
            prompt_len = rng.randint(max_model_len // 4, max_model_len // 2)
        else:
            prompt_len = int(math.exp(rng.uniform(math.log(4), math.log(512))))
        prompt_len = max(1, min(prompt_len, room))
        greedy = rng.random() < greedy_fraction
        temperature = 0.0 if greedy else rng.choice(list(temperatures))
        top_p = 0.9 if not greedy and rng.random() < 0.3 else None
        top_k = 40 if not greedy and rng.random() < 0.3 else None
        stream = disconnect is not None or rng.random() < stream_fraction
        specs.append(
            RequestSpec(
                index=i,
                prompt=tuple(prompts(rng, prompt_len)),
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=None if greedy else seed * 1_000_003 + i,
                stream=stream,
                disconnect_after_tokens=disconnect,
                kind=kind,
            )
        )
    return specs


def request_body(spec: RequestSpec, model: str) -> dict[str, Any]:
    """The JSON body of ``spec`` for vLLM's ``/v1/completions``."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(spec.prompt),
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": spec.stream,
    }
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.top_p is not None:
        body["top_p"] = spec.top_p
    if spec.top_k is not None:
        body["top_k"] = spec.top_k
    if spec.seed is not None:
        body["seed"] = spec.seed
    return body


# ------------------------------------------------------------------------------------ one request
@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: Any = None


@dataclass
class Outcome:
    """What one completion call returned (or how it failed)."""

    http_status: int | None = None
    choices: dict[int, Choice] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    error: str | None = None  # transport failure, HTTP error body, or an error the server streamed
    error_code: int | None = None  # the "code" of an OpenAI error object, when the server sent one
    streamed_error: bool = False  # the error arrived inside a 200 event stream
    disconnected: bool = False  # the client dropped the connection on purpose
    done: bool = False  # stream: "data: [DONE]" seen; non-stream: a JSON body parsed
    latency_s: float | None = None
    ttft_s: float | None = None
    chunks: int = 0

    def tokens(self, index: int = 0) -> list[int]:
        c = self.choices.get(index)
        return [] if c is None else c.token_ids


def _error_of(payload: Any) -> tuple[str, int | None] | None:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        code = err.get("code")
        return str(err.get("message", err)), int(code) if isinstance(code, int) else None
    return None


def _absorb_choices(out: Outcome, choices: Iterable[dict[str, Any]], first_token_time: Callable[[], None]) -> None:
    for ch in choices:
        c = out.choices.setdefault(int(ch.get("index", 0)), Choice())
        ids = ch.get("token_ids") or []
        if ids:
            first_token_time()
        c.token_ids.extend(int(t) for t in ids)
        c.text += ch.get("text") or ""
        if ch.get("finish_reason") is not None:
            c.finish_reason = ch["finish_reason"]
        if ch.get("logprobs") is not None:
            c.logprobs = ch["logprobs"]


async def complete(
    session: Any,
    url: str,
    body: dict[str, Any],
    *,
    disconnect_after_tokens: int | None = None,
    timeout_s: float = 120.0,
    request_id: str | None = None,
) -> Outcome:
    """POST ``body`` to ``url`` (a ``/v1/completions`` URL) and read the whole answer.

    Streaming bodies are read event by event (``data: {...}`` lines, until ``data: [DONE]``);
    with ``disconnect_after_tokens`` the connection is closed (not drained) as soon as that many
    tokens arrived, as a client that goes away does. ``request_id`` goes in the ``X-Request-Id``
    header (vLLM 0.26 names the engine request ``cmpl-<request_id>-<choice>-<8 hex>`` after it).
    """
    import aiohttp

    out = Outcome()
    t0 = time.perf_counter()

    def mark_first() -> None:
        if out.ttft_s is None:
            out.ttft_s = time.perf_counter() - t0

    try:
        headers = None if request_id is None else {"X-Request-Id": request_id}
        async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            out.http_status = resp.status
            if resp.status != 200 or not body.get("stream"):
                raw = await resp.read()
                try:
                    payload = json.loads(raw)
                except ValueError:
                    payload = None
                err = _error_of(payload)
                if resp.status != 200 or err is not None:
                    out.error, out.error_code = err if err is not None else (raw[:300].decode(errors="replace"), None)
                    if out.error_code is None and resp.status != 200:
                        out.error_code = resp.status
                elif isinstance(payload, dict):
                    _absorb_choices(out, payload.get("choices") or [], mark_first)
                    out.usage = payload.get("usage")
                    out.done = True
                else:
                    out.error = f"unparseable body: {raw[:200]!r}"
            else:
                buf = b""
                async for piece in resp.content.iter_any():
                    buf += piece
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            out.done = True
                            continue
                        try:
                            event = json.loads(data)
                        except ValueError:
                            out.error = f"unparseable event: {data[:200]!r}"
                            continue
                        err = _error_of(event)
                        if err is not None:
                            out.error, out.error_code = err
                            out.streamed_error = True
                            continue
                        if event.get("usage"):
                            out.usage = event["usage"]
                        choices = event.get("choices") or []
                        if choices:
                            out.chunks += 1
                        _absorb_choices(out, choices, mark_first)
                        got = sum(len(c.token_ids) for c in out.choices.values())
                        if disconnect_after_tokens is not None and got >= disconnect_after_tokens and not out.done:
                            finished = all(c.finish_reason is not None for c in out.choices.values())
                            if not finished:
                                out.disconnected = True
                                resp.close()  # drop the connection without reading the rest
                                break
                    if out.disconnected:
                        break
    except TimeoutError:
        out.error = f"timeout after {timeout_s:.0f} s"
    except aiohttp.ClientError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.latency_s = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------------ the load
@dataclass
class RequestResult:
    """One soak request: ``status`` is ok / disconnected / error / cut / not_started."""

    index: int
    status: str
    error: str | None = None
    http_status: int | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    chunks: int = 0
    started_s: float | None = None  # since the load started

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_result(spec: RequestSpec, out: Outcome) -> RequestResult:
    """The soak's verdict on one request (lost tokens, errors, intended disconnects)."""
    c = out.choices.get(0)
    res = RequestResult(
        index=spec.index,
        status="ok",
        http_status=out.http_status,
        token_ids=list(c.token_ids) if c else [],
        finish_reason=c.finish_reason if c else None,
        completion_tokens=(out.usage or {}).get("completion_tokens"),
        latency_s=out.latency_s,
        ttft_s=out.ttft_s,
        chunks=out.chunks,
    )
    if out.error is not None:
        res.status, res.error = "error", (f"HTTP {out.http_status}: " if out.http_status not in (None, 200) else "") + out.error
        return res
    if out.disconnected:
        res.status = "disconnected"
        return res
    problems = []
    if spec.stream and not out.done:
        problems.append("stream ended without [DONE]")
    if len(res.token_ids) != spec.max_tokens:
        problems.append(f"lost tokens: {len(res.token_ids)} of {spec.max_tokens} token ids")
    if res.finish_reason != "length":
        problems.append(f"finish_reason {res.finish_reason!r}, expected 'length' (ignore_eos)")
    if res.completion_tokens is not None and res.completion_tokens != spec.max_tokens:
        problems.append(f"usage.completion_tokens {res.completion_tokens} != max_tokens {spec.max_tokens}")
    if spec.stream and res.completion_tokens is None:
        problems.append("no usage chunk")
    if problems:
        res.status, res.error = "error", "; ".join(problems)
    return res


async def run_load(
    base_url: str,
    model: str,
    specs: Sequence[RequestSpec],
    *,
    concurrency: int,
    stop_launching_at: float,
    hard_stop_at: float,
    request_timeout_s: float = 120.0,
    on_progress: Callable[[int, int], None] | None = None,
    request_id_prefix: str | None = None,
) -> tuple[list[RequestResult], float]:
    """Send ``specs`` in order through ``concurrency`` clients; (results in spec order, wall seconds).

    ``stop_launching_at`` / ``hard_stop_at`` are ``time.monotonic()`` values: no request starts
    after the first; requests still running at the second are cancelled (connection dropped) and
    reported as ``cut``. With ``request_id_prefix`` each request carries ``X-Request-Id:
    <prefix><spec.index>`` (so a server-side trace names it).
    """
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    results: dict[int, RequestResult] = {}
    running: dict[int, float] = {}
    order = iter(range(len(specs)))
    t_start = time.monotonic()
    done = 0

    async def worker(session: Any) -> None:
        nonlocal done
        for k in order:
            spec = specs[k]
            if time.monotonic() >= stop_launching_at:
                results[spec.index] = RequestResult(spec.index, "not_started")
                continue
            started = time.monotonic() - t_start
            running[spec.index] = started
            try:
                out = await complete(
                    session, url, request_body(spec, model), disconnect_after_tokens=spec.disconnect_after_tokens,
                    timeout_s=request_timeout_s,
                    request_id=None if request_id_prefix is None else f"{request_id_prefix}{spec.index}",
                )
            except asyncio.CancelledError:
                results[spec.index] = RequestResult(spec.index, "cut", started_s=started)
                raise
            finally:
                running.pop(spec.index, None)
            res = check_result(spec, out)
            res.started_s = started
            results[spec.index] = res
            done += 1
            if on_progress is not None:
                on_progress(done, len(specs))

    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        wait = max(0.0, hard_stop_at - time.monotonic())
        _, pending = await asyncio.wait(tasks, timeout=wait)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - t_start
    for spec in specs:  # cancelled before they were picked up
        results.setdefault(spec.index, RequestResult(spec.index, "not_started"))
    return [results[s.index] for s in specs], wall


# ------------------------------------------------------------------------------------ summaries
def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    return {"n": len(values), "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


def summarize(specs: Sequence[RequestSpec], results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Counts by status, the errors, latency percentiles (seconds) and throughput of one load."""
    by_index = {s.index: s for s in specs}
    counts = Counter(r.status for r in results)
    errors = [r for r in results if r.status == "error"]
    ok = [r for r in results if r.status == "ok"]
    lat = [r.latency_s for r in ok if r.latency_s is not None]
    lat_stream = [r.latency_s for r in ok if r.latency_s is not None and by_index[r.index].stream]
    lat_plain = [r.latency_s for r in ok if r.latency_s is not None and not by_index[r.index].stream]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None and by_index[r.index].stream]
    tpot = [
        (r.latency_s - r.ttft_s) / (len(r.token_ids) - 1)
        for r in ok
        if by_index[r.index].stream and r.ttft_s is not None and r.latency_s is not None and len(r.token_ids) > 1
    ]
    tokens = sum(len(r.token_ids) for r in results if r.status in ("ok", "disconnected"))
    planned = [r for r in results if by_index[r.index].disconnect_after_tokens is not None and r.status not in ("not_started", "cut")]
    return {
        "requests": len(results),
        "status_counts": dict(sorted(counts.items())),
        "errors": len(errors),
        "error_examples": [{"index": r.index, "error": r.error} for r in errors[:20]],
        "error_kinds": dict(Counter(_error_kind(r.error) for r in errors).most_common()),
        "disconnects_planned": len(planned),
        "disconnects_done": counts.get("disconnected", 0),
        # the server may hand a slow reader several steps at once, so a stream can end before its drop point
        "disconnects_finished_first": sum(1 for r in planned if r.status == "ok"),
        "greedy_ok": sum(1 for r in ok if by_index[r.index].greedy),
        "latency_s": _pcts(lat),
        "latency_stream_s": _pcts(lat_stream),
        "latency_nonstream_s": _pcts(lat_plain),
        "ttft_s": _pcts(ttft),
        "tpot_s": _pcts(tpot),
        "wall_s": round(wall_s, 3),
        "completion_tokens": tokens,
        "throughput_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ok_requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
    }


def _error_kind(error: str | None) -> str:
    """Errors grouped by their message with the numbers taken out."""
    return re.sub(r"\d+", "N", error or "")[:120]


def compare_greedy(
    specs: Sequence[RequestSpec], a: Sequence[RequestResult], b: Sequence[RequestResult], context: int = 3
) -> dict[str, Any]:
    """Greedy requests that finished ok in both runs: identical token ids or the first divergence."""
    ra, rb = {r.index: r for r in a}, {r.index: r for r in b}
    compared, identical, divergences = 0, 0, []
    for s in specs:
        x, y = ra.get(s.index), rb.get(s.index)
        if not s.greedy or x is None or y is None or x.status != "ok" or y.status != "ok":
            continue
        compared += 1
        ta, tb = x.token_ids, y.token_ids
        pos = next((i for i, (p, q) in enumerate(zip(ta, tb)) if p != q), None)
        if pos is None and len(ta) == len(tb):
            identical += 1
            continue
        if pos is None:
            pos = min(len(ta), len(tb))
        lo = max(0, pos - context)
        divergences.append({
            "index": s.index, "pos": pos, "kind": s.kind, "prompt_len": len(s.prompt), "max_tokens": s.max_tokens,
            "from": lo, "a": ta[lo:pos + context + 1], "b": tb[lo:pos + context + 1], "len_a": len(ta), "len_b": len(tb),
        })
    return {
        "compared": compared,
        "identical": identical,
        "identical_fraction": identical / compared if compared else None,
        "divergences": divergences,
    }


# ------------------------------------------------------------------------------------ /metrics
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition -> {(name, sorted label pairs): value}; comments skipped."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        pairs = tuple(sorted(_LABEL.findall(labels or "")))
        out[(name, pairs)] = v
    return out


def metric_value(metrics: dict, name: str, **labels: str) -> float | None:
    """Sum of the samples named ``name`` whose labels include ``labels`` (None if there is none)."""
    vals = [v for (n, pairs), v in metrics.items() if n == name and all((k, labels[k]) in pairs for k in labels)]
    return sum(vals) if vals else None


def metrics_delta(before: dict, after: dict, prefixes: Sequence[str] = ("vllm:",)) -> dict[str, float]:
    """after - before of every ``*_total`` counter sample (by name and labels) with a given prefix."""
    out = {}
    for key, v in after.items():
        name, pairs = key
        if not name.endswith("_total") or not name.startswith(tuple(prefixes)):
            continue
        d = v - before.get(key, 0.0)
        if d:
            label = ",".join(f"{k}={val}" for k, val in pairs if k not in ("model_name", "engine"))
            out[name + (f"{{{label}}}" if label else "")] = out.get(name + (f"{{{label}}}" if label else ""), 0.0) + d
    return dict(sorted(out.items()))


def spec_decode_summary(before: dict, after: dict) -> dict[str, Any]:
    """vLLM's spec-decode counters over an interval: drafts, draft tokens, accepted, by position."""

    def delta(name: str, **labels: str) -> float:
        return (metric_value(after, name, **labels) or 0.0) - (metric_value(before, name, **labels) or 0.0)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    draft_tokens = delta("vllm:spec_decode_num_draft_tokens_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    positions = sorted(
        {int(dict(pairs)["position"]) for (n, pairs) in after if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    )
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in positions]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "mean_accepted_length": 1.0 + accepted / drafts if drafts else None,
        "acceptance_by_position": [c / drafts for c in per_pos] if drafts else [],
    }

"""A small stand-in for ``vllm serve``'s OpenAI completion endpoint, for CPU tests of the soak.

aiohttp.web (a vLLM dependency). Serves ``/health``, ``/metrics`` (the Prometheus names the soak
reads) and ``/v1/completions`` with vLLM's shapes: ``choices[i].token_ids`` (return_token_ids),
``usage``, streaming as ``data: {...}`` events with delta token ids, an optional usage event and
``data: [DONE]``; request-validation errors as HTTP 400 JSON when not streaming and as a 200
stream carrying one ``{"error": {..., "code": 400}}`` event when streaming (vLLM 0.26's behaviour).

Outputs are a fixed function of the request, so two stand-ins agree token for token unless told
to misbehave: ``corrupt`` (greedy outputs of prompts whose first token is in the set get one
token changed), ``short`` (those prompts lose their last token). ``spec=True`` refuses what method
'tfm' refuses, with the same messages, and counts spec-decode drafts. Client disconnects are
counted (a write to a closed connection fails) and reported as ``finished_reason="abort"``.

A spec stand-in started with ``VLLM_TFM_TRACE=<dir>`` in its environment writes trace records in
the shape of tfm's request trace there (``_write_trace``), named after the ``X-Request-Id``
header as vLLM names its requests.

Run as a script for a subprocess server: ``python _openai_standin.py --port P [--spec] ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

VOCAB = 1000
TFM_REFUSED = {  # request field -> the feature name method 'tfm' reports
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "bad_words": "bad_words",
    "prompt_logprobs": "prompt_logprobs",
    "structured_outputs": "structured output",
}
VLLM_SPEC_MESSAGE = "The min_p and logit_bias sampling parameters are not yet supported with speculative decoding."


@dataclass
class StandinState:
    spec: bool = False
    delay_per_chunk_s: float = 0.002
    chunk_tokens: int = 3
    corrupt: set[int] = field(default_factory=set)
    short: set[int] = field(default_factory=set)
    preemptions_per_request: int = 0
    running: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"length": 0, "abort": 0})
    drafts: int = 0
    accepted: int = 0
    preemptions: int = 0
    trace_path: str | None = None  # VLLM_TFM_TRACE of a spec stand-in: trace records like tfm's
    trace_step: int = 0


def output_tokens(prompt: list[int], n_tokens: int, temperature: float, seed: int | None, choice: int) -> list[int]:
    """The stand-in's 'model': greedy output depends on the prompt only."""
    base = sum(prompt) * 31 + len(prompt)
    if temperature > 0:
        base += 17 * (seed or 0) + 101 * choice
    return [(base + 7 * i * i + 3 * i) % VOCAB for i in range(n_tokens)]


def _refusal(state: StandinState, body: dict[str, Any]) -> str | None:
    if body.get("stream") and body.get("use_beam_search"):
        return "Streaming is not currently supported with beam search"
    if not state.spec:
        return None
    if body.get("min_p") or body.get("logit_bias"):
        return VLLM_SPEC_MESSAGE
    for key, feature in TFM_REFUSED.items():
        v = body.get(key)
        if key == "repetition_penalty":
            refused = v not in (None, 1.0)
        else:
            refused = bool(v)
        if refused:
            return f"{feature} is not supported with speculative method 'tfm'"
    return None


def _choices(state: StandinState, body: dict[str, Any]) -> list[list[int]]:
    prompt = [int(t) for t in body["prompt"]]
    n = int(body.get("n", 1))
    temperature = float(body.get("temperature") or 0.0)
    max_tokens = int(body.get("max_tokens", 16))
    out = []
    for c in range(n):
        toks = output_tokens(prompt, max_tokens, temperature, body.get("seed"), c)
        if temperature == 0 and prompt and prompt[0] in state.corrupt and len(toks) > 2:
            toks[2] = (toks[2] + 1) % VOCAB
        if prompt and prompt[0] in state.short:
            toks = toks[:-1]
        out.append(toks)
    return out


def _write_trace(state: StandinState, request_id: str, body: dict[str, Any], choices: list[list[int]]) -> None:
    """Records in the shape of tfm's request trace (vllm_tfm/vllm_plugin/runtime/trace.py) for one
    completion: two tokens per 'step', the first step a new request's prefill; with
    ``preemptions_per_request`` the second step is the request resumed after a preemption."""
    import os
    import random

    if state.trace_path is None:
        return
    os.makedirs(state.trace_path, exist_ok=True)
    path = os.path.join(state.trace_path, f"trace-{os.getpid()}.jsonl")
    lines = [] if os.path.exists(path) else [json.dumps({"trace": "vllm-tfm", "version": 1})]
    temperature = float(body.get("temperature") or 0.0)
    for c, toks in enumerate(choices):
        rid = f"cmpl-{request_id}-{c}-{random.getrandbits(32):08x}"
        for j, start in enumerate(range(0, len(toks), 2)):
            out = toks[start : start + 2]
            rec: dict[str, Any] = {"s": state.trace_step, "ts": 0.0, "r": rid, "row": 0, "n": 17 if j else len(body["prompt"]),
                                   "d": 16 if j else 0, "spec": int(j > 0), "path": "tree", "no": start, "t": temperature,
                                   "acc": len(out) - 1, "out": out}  # fmt: skip
            if j == 0:
                rec["new"] = 1
            elif j == 1 and state.preemptions_per_request:
                rec.update(res=1, n=len(body["prompt"]) + 2, d=0, spec=0)
            lines.append(json.dumps(rec))
            state.trace_step += 1
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def _logprobs(toks: list[int]) -> dict[str, Any]:
    return {"tokens": [f"token_id:{t}" for t in toks], "top_logprobs": [{f"token_id:{t}": -0.1, "token_id:0": -2.5} for t in toks]}


def make_app(state: StandinState) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_: web.Request) -> web.Response:
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {float(state.running)}',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {0.25 if state.running else 0.0}',
            f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {float(state.preemptions)}',
        ]
        for reason, count in state.finished.items():
            lines.append(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="m"}} {float(count)}')
        if state.spec:
            lines += [
                f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(state.drafts)}',
                f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {float(4 * state.drafts)}',
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {float(state.accepted)}',
            ]
            for pos in range(4):
                share = state.accepted if pos == 0 else state.accepted // (pos + 1)
                lines.append(
                    f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{pos}"}} {float(share)}'
                )
        return web.Response(text="\n".join(lines) + "\n")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        refusal = _refusal(state, body)
        stream = bool(body.get("stream"))
        if refusal is not None and (not stream or body.get("use_beam_search")):
            err = {"error": {"message": refusal, "type": "BadRequestError", "param": None, "code": 400}}
            return web.json_response(err, status=400)
        if refusal is None:
            choices = _choices(state, body)
            _write_trace(state, request.headers.get("X-Request-Id") or "anon", body, choices)
        state.running += 1
        state.preemptions += state.preemptions_per_request
        try:
            if not stream:
                await asyncio.sleep(state.delay_per_chunk_s)
                out = []
                for i, toks in enumerate(choices):
                    ch = {"index": i, "text": " ".join(map(str, toks)), "token_ids": toks, "finish_reason": "length"}
                    if body.get("logprobs") is not None:
                        ch["logprobs"] = _logprobs(toks)
                    out.append(ch)
                n_tok = sum(len(t) for t in choices)
                state.finished["length"] += len(choices)
                if state.spec:
                    state.drafts += 1
                    state.accepted += n_tok // 2
                return web.json_response({"choices": out, "usage": {"completion_tokens": n_tok, "prompt_tokens": len(body["prompt"])}})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                if refusal is not None:
                    err = {"error": {"message": refusal, "type": "BadRequestError", "param": None, "code": 400}}
                    await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                else:
                    for i, toks in enumerate(choices):
                        for start in range(0, len(toks), state.chunk_tokens):
                            part = toks[start : start + state.chunk_tokens]
                            last = start + state.chunk_tokens >= len(toks)
                            ch = {"index": i, "text": " ".join(map(str, part)), "token_ids": part,
                                  "finish_reason": "length" if last else None}
                            await resp.write(f"data: {json.dumps({'choices': [ch]})}\n\n".encode())
                            if state.spec:
                                state.drafts += 1
                                state.accepted += len(part) - 1
                            await asyncio.sleep(state.delay_per_chunk_s)
                    if (body.get("stream_options") or {}).get("include_usage"):
                        usage = {"completion_tokens": sum(len(t) for t in choices), "prompt_tokens": len(body["prompt"])}
                        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                    state.finished["length"] += len(choices)
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except (ConnectionResetError, ConnectionError, RuntimeError):
                state.finished["abort"] += 1
            return resp
        finally:
            state.running -= 1

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--spec", action="store_true")
    ap.add_argument("--corrupt", type=int, nargs="*", default=[])
    ap.add_argument("--preemptions-per-request", type=int, default=0)
    ap.add_argument("--startup-delay", type=float, default=0.0)
    args = ap.parse_args()
    import os

    state = StandinState(spec=args.spec, corrupt=set(args.corrupt), preemptions_per_request=args.preemptions_per_request,
                         trace_path=(os.environ.get("VLLM_TFM_TRACE") or None) if args.spec else None)
    if args.startup_delay:
        import time

        time.sleep(args.startup_delay)
    web.run_app(make_app(state), host="127.0.0.1", port=args.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()

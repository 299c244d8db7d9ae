"""The request-parameter probes of the soak: one request per row of docs/guarantees.md's matrix.

Sent to the tfm server and to the no-spec server while their loads run (bad input under load).
A "refused" row passes when tfm answers HTTP 400, or in a stream one error event with code 400,
whose message contains the documented text; an "ok" row passes when every choice has all its
tokens and, for greedy / beam-search rows, equals the no-spec server's answer token for token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import soak_client as sc

__all__ = ["PROBES", "PROBE_MAX_TOKENS", "Probe", "judge_probes", "probe_body", "run_probes"]

MODEL_NAME = "soak"


@dataclass(frozen=True)
class Probe:
    """One row of the request-parameter matrix (docs/guarantees.md), sent to both servers.

    expect: "refused" (tfm answers HTTP 400, or in a stream one error event with code 400, whose
    message contains ``message``) or "ok" (tfm answers; with ``compare`` every choice must equal the
    no-spec server's answer token for token).
    """

    name: str
    extra: dict[str, Any]
    expect: str
    message: str | None = None
    stream: bool = False
    compare: bool = True
    choices: int = 1


TFM_REFUSAL = "is not supported with speculative method 'tfm'"
VLLM_SPEC_REFUSAL = "min_p and logit_bias sampling parameters are not yet supported with speculative decoding"

PROBES: tuple[Probe, ...] = (
    Probe("presence_penalty", {"presence_penalty": 0.5}, "refused", "presence_penalty " + TFM_REFUSAL),
    Probe("presence_penalty/stream", {"presence_penalty": 0.5}, "refused", "presence_penalty " + TFM_REFUSAL, stream=True),
    Probe("frequency_penalty", {"frequency_penalty": 0.5}, "refused", "frequency_penalty " + TFM_REFUSAL),
    Probe("repetition_penalty", {"repetition_penalty": 1.2}, "refused", "repetition_penalty " + TFM_REFUSAL),
    Probe("bad_words", {"bad_words": ["ab"]}, "refused", "bad_words " + TFM_REFUSAL),
    Probe("prompt_logprobs", {"prompt_logprobs": 1}, "refused", "prompt_logprobs " + TFM_REFUSAL),
    Probe("structured_output", {"structured_outputs": {"choice": ["yes", "no"]}}, "refused", "structured output " + TFM_REFUSAL),
    Probe("structured_output/stream", {"structured_outputs": {"choice": ["yes", "no"]}}, "refused",
          "structured output " + TFM_REFUSAL, stream=True),
    Probe("min_p", {"min_p": 0.1, "temperature": 1.0, "seed": 1}, "refused", VLLM_SPEC_REFUSAL),
    Probe("logit_bias", {"logit_bias": {"5": 2.0}}, "refused", VLLM_SPEC_REFUSAL),
    Probe("beam_search/stream", {"use_beam_search": True, "n": 2}, "refused", "Streaming is not currently supported with beam search",
          stream=True),
    Probe("logprobs", {"logprobs": 2}, "ok"),
    Probe("logprobs/stream", {"logprobs": 2}, "ok", stream=True),
    Probe("min_tokens", {"min_tokens": 8}, "ok"),
    Probe("allowed_token_ids", {"allowed_token_ids": list(range(3, 200))}, "ok"),
    Probe("n=3 sampled", {"n": 3, "temperature": 0.8, "seed": 7}, "ok", compare=False, choices=3),  # vLLM refuses greedy n > 1
    Probe("beam_search", {"use_beam_search": True, "n": 2}, "ok", choices=2),
    Probe("seed+top_p+top_k", {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 11}, "ok", compare=False),
    Probe("temperature=1.0 stream", {"temperature": 1.0, "seed": 3}, "ok", stream=True, compare=False),
)


PROBE_MAX_TOKENS = 12

EXPECTED_ERRORS: tuple[str, ...] = tuple(sorted({p.message for p in PROBES if p.message}))
"""Exception messages a server logs on purpose when it refuses a probe (vLLM logs a traceback for a
validation error raised inside a stream); any other traceback in a server log is a finding."""


def probe_body(probe: Probe, prompt: list[int], max_tokens: int = PROBE_MAX_TOKENS) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True, "stream": probe.stream}
    if probe.stream:
        body["stream_options"] = {"include_usage": True}
    body.update(probe.extra)
    return body


async def run_probes(base_url: str, prompt: list[int], delay_s: float) -> dict[str, sc.Outcome]:
    import aiohttp

    await asyncio.sleep(delay_s)
    url = base_url + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        outs = await asyncio.gather(*(sc.complete(session, url, probe_body(p, prompt)) for p in PROBES))
    return {p.name: o for p, o in zip(PROBES, outs)}


def judge_probes(tfm: dict[str, sc.Outcome], ref: dict[str, sc.Outcome] | None) -> list[dict[str, Any]]:
    """Each probe's tfm outcome against its expectation (and the no-spec answer for ``compare``)."""
    rows = []
    for p in PROBES:
        o = tfm.get(p.name)
        row: dict[str, Any] = {"probe": p.name, "expect": p.expect, "stream": p.stream}
        if o is None:
            row.update(ok=False, why="not sent")
            rows.append(row)
            continue
        row.update(http_status=o.http_status, error=o.error, error_code=o.error_code, streamed_error=o.streamed_error,
                   choices=len(o.choices), tokens=[o.tokens(i) for i in sorted(o.choices)])
        if p.expect == "refused":
            as_400 = o.http_status == 400 or (o.streamed_error and o.error_code == 400)
            row["ok"] = bool(as_400 and o.error and p.message and p.message in o.error)
            row["how"] = "stream error event (HTTP 200)" if o.streamed_error else f"HTTP {o.http_status}"
        else:
            lengths = [len(o.tokens(i)) for i in sorted(o.choices)]
            full = all(n >= 1 for n in lengths) if "beam" in p.name else all(n == PROBE_MAX_TOKENS for n in lengths)
            good = o.error is None and len(o.choices) == p.choices and o.done and full
            if good and p.compare and ref is not None:
                r = ref.get(p.name)
                same = r is not None and r.error is None and all(o.tokens(i) == r.tokens(i) for i in range(p.choices))
                row["identical_to_nospec"] = same
                good = good and same
            row["ok"] = bool(good)
        rows.append(row)
    return rows


